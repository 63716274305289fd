"""Build-time mapping of the repository's top-level ``templates/``, ``images/`` and ``systemd/``
into the package: the wheel carries them as ``vmsandbox/_data/templates``, ``.../images`` and
``.../systemd``
(``vmsandbox.resources`` finds them there, or at the top of a checkout). Everything else about
the project is in pyproject.toml. build_py also generates the gRPC stubs of the OpenShell
driver (setup/gen_proto.py, with grpcio-tools from the build requirements) into the build tree."""

import sys
from pathlib import Path

from setuptools import find_namespace_packages, find_packages, setup
from setuptools.command.build_py import build_py

sys.path.insert(0, str(Path(__file__).resolve().parent / "setup"))
from gen_proto import generate


class BuildWithStubs(build_py):
    """build_py, then the generated ``*_pb2*.py`` stubs written beside the built package."""

    def run(self) -> None:
        super().run()
        if not self.editable_mode:
            generate(Path(__file__).resolve().parent, Path(self.build_lib))


TOP = {
    "vmsandbox._data.templates": "templates",
    "vmsandbox._data.images": "images",
    "vmsandbox._data.systemd": "systemd",
}
# Each recipe folder (images/minimal, images/common, ...) is a data-only package of its own.
DATA = [*TOP, *(f"vmsandbox._data.images.{sub}" for sub in find_namespace_packages("images"))]

setup(
    packages=[*find_packages(include=["vmsandbox", "vmsandbox.*"]), *DATA],
    package_dir=TOP,
    package_data={
        "vmsandbox": ["py.typed"],
        # guest programs that are not Python (guest/programs/firstboot_lean.sh)
        "vmsandbox.guest.programs": ["*.sh"],
        **{package: ["*"] for package in DATA},
    },
    cmdclass={"build_py": BuildWithStubs},
)
