"""Disk files for the image tests: a raw disk of a given size, to import or to refuse."""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path


def raw_disk(path: Path, *, size: int = 4 << 20) -> Path:
    """A raw disk with an MBR: one Linux partition from sector 2048, signature 0x55AA."""
    sectors = size // 512
    entry = struct.pack("<B3sB3sII", 0x80, b"\0" * 3, 0x83, b"\0" * 3, 2048, sectors - 2048)
    mbr = bytes(446) + entry + bytes(48) + b"\x55\xaa"
    with path.open("wb") as handle:
        handle.write(mbr)
        handle.truncate(size)
    return path


def mbr_qcow2(path: Path, size: str = "64M") -> Path:
    """A qcow2 whose first sector ends in the MBR signature: importable (``images import``
    refuses a blank qcow2), though nothing in it boots."""
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(path), size], check=True)
    signature = ["-c", "write -P 0x55 510 1", "-c", "write -P 0xaa 511 1"]
    subprocess.run(["qemu-io", *signature, str(path)], check=True, capture_output=True)
    return path
