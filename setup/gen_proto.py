"""Generate the Python stubs of vmsandbox's .proto files with grpcio-tools (a build-time tool).

Run by setup/setup.sh after the editable install, and by setup.py's build_py for wheels; the
generated ``*_pb2*.py`` files are never committed. The include root is the repository top, so
the generated modules import each other as ``vmsandbox.openshell.proto.<name>_pb2``.
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

PROTOS = (
    "vmsandbox/openshell/proto/extension.proto",
    "vmsandbox/openshell/proto/sandbox.proto",
    "vmsandbox/openshell/proto/compute_driver.proto",
    "vmsandbox/openshell/proto/host_info.proto",
)


def generate(root: Path, out: Path | None = None) -> None:
    """Write the stubs of every proto under ``root`` into ``out`` (default: beside them)."""
    from grpc_tools import protoc

    well_known = resources.files("grpc_tools") / "_proto"
    target = out or root
    for proto in PROTOS:
        (target / proto).parent.mkdir(parents=True, exist_ok=True)
        argv = [
            "protoc",
            f"-I{root}",
            f"-I{well_known}",
            f"--python_out={target}",
            f"--pyi_out={target}",
            f"--grpc_python_out={target}",
            str(root / proto),
        ]
        if protoc.main(argv) != 0:
            raise SystemExit(f"protoc failed on {proto}")


if __name__ == "__main__":
    generate(Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve())
