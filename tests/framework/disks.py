"""Disk files for the image tests: a raw disk of a given size, to import or to refuse."""

from __future__ import annotations

import struct
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
