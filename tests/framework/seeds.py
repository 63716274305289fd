"""Reading a file out of a NoCloud seed ISO (isoinfo), as a guest's cloud-init would."""

from __future__ import annotations

import subprocess
from pathlib import Path


def read_iso(iso: Path, name: str) -> str:
    return subprocess.run(
        ["isoinfo", "-R", "-i", str(iso), "-x", f"/{name}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
