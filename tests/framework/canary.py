"""The canary of GPU custody on the nested GPU host: does tenant B find what tenant A left in a
card's memory?

Tenant A's guest fills the whole video memory of each emulated card it holds (its BAR0, mapped
through the guest's sysfs ``resource0``) with a random 16-byte marker, and counts it right away
(the probe finds every byte: it can fail). After A's sandbox is destroyed, tenant B's guest on
the same cards counts the marker in the whole of their memory: with custody on, 0 bytes; with
sanitizing off (``gpu_sanitize = false``), what the reset left, since the emulated ati-vga card
keeps its video memory through a reset. ``PROGRAM`` runs in the guest as root
(``vmsandbox exec NAME -- sudo python3 -c PROGRAM MODE MARKER``) and prints the bytes found.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from subprocess import CompletedProcess

# Every AMD display function the guest has (the cards passed to it), BAR0 filled ("write") or
# only counted ("count"): the bytes equal to the marker, counted as whole markers.
PROGRAM = """
import mmap, os, sys
mode, marker = sys.argv[1], bytes.fromhex(sys.argv[2])
root, chunk, found = "/sys/bus/pci/devices", 1 << 20, 0
for name in sorted(os.listdir(root)):
    folder = os.path.join(root, name)
    ids = open(folder + "/vendor").read().strip(), open(folder + "/class").read()[:4]
    if ids != ("0x1002", "0x03"):
        continue
    if open(folder + "/enable").read().strip() == "0":
        open(folder + "/enable", "w").write("1")
    fd = os.open(folder + "/resource0", os.O_RDWR | os.O_SYNC)
    size = os.fstat(fd).st_size
    bar = mmap.mmap(fd, size)
    if mode == "write":
        block = marker * (chunk // len(marker))
        for start in range(0, size, chunk):
            bar[start:start + chunk] = block[: min(chunk, size - start)]
    for start in range(0, size, chunk):
        found += bar[start:start + chunk].count(marker) * len(marker)
    bar.close()
    os.close(fd)
print(found)
"""

Run = Callable[..., CompletedProcess[str]]


def marker() -> str:
    """A fresh random marker, as hex."""
    return os.urandom(16).hex()


def probe(run: Run, sandbox: str, mode: str, mark: str) -> int:
    """Bytes of ``mark`` the guest of ``sandbox`` finds in its cards' memory, after writing it
    everywhere first when ``mode`` is "write"; ``run`` runs a command in the nested host."""
    done = run("vmsandbox", "exec", sandbox, "--", "sudo", "python3", "-c", PROGRAM, mode, mark)
    if done.returncode != 0:
        raise AssertionError(f"the canary probe failed in {sandbox}: {done.stderr[-2000:]}")
    return int(done.stdout.strip().splitlines()[-1])
