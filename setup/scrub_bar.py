#!/usr/bin/env python3
"""Clear a GPU's memory through its memory BAR, from the host: the nested host's scrub hook.

    scrub_bar.py BDF [--bar N]

vmsandbox runs its ``gpu_scrub_hook`` with a released GPU's PCI address once the GPU has been
reset and answers again (vmsandbox/gpu/custody/sanitize.py). The emulated ati-vga cards of the
nested GPU host keep their video memory through a reset (QEMU's reset of the device leaves its
VRAM as it was), and all of it is visible through BAR0: this writes zeros over the whole BAR
through the function's sysfs ``resourceN`` file and reads it back. Exit 0 when every byte reads
zero. Memory decoding is switched on for the write when it is off (sysfs ``enable``) and off
again after. A real card whose memory is larger than its BAR needs the vendor's own tool.

Standard library only: it runs under L1's /usr/bin/python3.
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys

DEVICES = "/sys/bus/pci/devices"
CHUNK = 1 << 20


def scrub(bdf: str, bar: int) -> int:
    """Zero BAR ``bar`` of ``bdf`` and check it; the number of bytes that are not zero after."""
    folder = os.path.join(DEVICES, bdf)
    enable = os.path.join(folder, "enable")
    with open(enable) as state:
        was_enabled = state.read().strip() != "0"
    if not was_enabled:
        with open(enable, "w") as state:
            state.write("1")
    try:
        fd = os.open(os.path.join(folder, f"resource{bar}"), os.O_RDWR | os.O_SYNC)
        try:
            size = os.fstat(fd).st_size
            with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as bar_:
                zeros = bytes(CHUNK)
                for start in range(0, size, CHUNK):
                    end = min(start + CHUNK, size)
                    bar_[start:end] = zeros[: end - start]
                left = 0
                for start in range(0, size, CHUNK):
                    chunk = bar_[start : min(start + CHUNK, size)]
                    left += len(chunk) - chunk.count(0)
        finally:
            os.close(fd)
    finally:
        if not was_enabled:
            with open(enable, "w") as state:
                state.write("0")
    return left


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bdf")
    parser.add_argument("--bar", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        left = scrub(args.bdf, args.bar)
    except OSError as exc:
        print(f"scrub_bar: {args.bdf} BAR{args.bar}: {exc}", file=sys.stderr)
        return 1
    if left:
        print(f"scrub_bar: {args.bdf} BAR{args.bar}: {left} bytes not zero after", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
