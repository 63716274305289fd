"""Build-time mapping of the repository's top-level ``templates/`` and ``images/`` into the
package: the wheel carries them as ``vmsandbox/_data/templates`` and ``vmsandbox/_data/images``
(``vmsandbox.resources`` finds them there, or at the top of a checkout). Everything else about
the project is in pyproject.toml."""

from setuptools import find_namespace_packages, find_packages, setup

TOP = {"vmsandbox._data.templates": "templates", "vmsandbox._data.images": "images"}
# Each recipe folder (images/minimal, images/common, ...) is a data-only package of its own.
DATA = [*TOP, *(f"vmsandbox._data.images.{sub}" for sub in find_namespace_packages("images"))]

setup(
    packages=[*find_packages(include=["vmsandbox", "vmsandbox.*"]), *DATA],
    package_dir=TOP,
    package_data={"vmsandbox": ["py.typed"], **{package: ["*"] for package in DATA}},
)
