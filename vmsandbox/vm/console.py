"""Reading a guest's serial console log: its last lines, how far the boot got, and the lines that
say it never will (firmware finding nothing to boot, a kernel panic, an initramfs without root).

The log is written by QEMU (``<serial><log file=...>``) and holds firmware, kernel, systemd and
seed reader output (cloud-init in stock images, vmsandbox's first-boot unit in the project's own),
colours and cursor moves included; what is shown is stripped of those.
"""

from __future__ import annotations

import codecs
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

from vmsandbox.errors import NotFound

# Escape sequences of the guest console (colours, cursor moves): never echoed to a terminal.
_ANSI_RE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-_]")

# Lines after which a guest never reaches SSH, whatever the wait: firmware (SeaBIOS, OVMF),
# the kernel, and Debian's initramfs-tools when the root device never shows up.
FATAL = (
    re.compile(r"No bootable device"),  # SeaBIOS
    re.compile(r"No bootable option or device was found"),  # OVMF BdsDxe
    re.compile(r"Kernel panic - not syncing"),
    re.compile(r"VFS: Unable to mount root fs"),
    re.compile(r"Gave up waiting for root"),
    re.compile(r"ALERT! .* does not exist"),
    # vmsandbox's first-boot unit refusing or failing to apply the seed (guest/programs/firstboot*)
    re.compile(r"vmsandbox-firstboot: error: "),
)
# Seen when what reads the NoCloud seed runs: cloud-init (its banner, its systemd units, its log
# lines) or vmsandbox's first-boot unit (its lines, systemd's "Starting <unit> - <description>").
# Never the kernel command line's echo (``cloud-init=disabled``,
# ``systemd.mask=vmsandbox-firstboot.service``). Without either, the seed that installs the SSH
# keys is never read.
SEED_READER_RE = re.compile(
    r"Cloud-init v\. |cloud-init(-local)?\.service|cloud-init\[\d+\]"
    r"|vmsandbox-firstboot(: |\.service - )"
)
# The console saying that sshd has started and that the network is configured. The project's
# images say so in lines of their own, "vmsandbox-boot: <event> at <uptime>s" (their kernel
# command line has "quiet": systemd reports no unit there), and the first boot's line for a NIC it
# brought up itself; older builds without "quiet" say it through systemd's status lines (the
# unit's start, the network-online target). The multi-user target comes after all of them and
# counts for both, should a line be lost.
SSHD_STARTED_RE = re.compile(r"Started sshd?\.service\b|vmsandbox-boot: sshd is up at ")
NETWORK_ONLINE_RE = re.compile(
    r"Reached target network-online\.target\b|vmsandbox-firstboot: \S+ is up at "
    r"|vmsandbox-boot: network is online at "
)
MULTI_USER_RE = re.compile(r"Reached target multi-user\.target\b")
# Lines each boot of a guest prints once: SeaBIOS's banner, the kernel's (without "quiet"),
# the project's initramfs. Seen RESTARTS_FATAL times, the guest is starting over in a loop
# (a kernel that cannot fit its memory resets the machine at once, and libvirt restarts it).
BOOT_START_RES = (
    re.compile(r"SeaBIOS \(version "),
    re.compile(r"Linux version \d"),
    re.compile(r"vmsandbox-boot: initramfs started"),
)
RESTARTS_FATAL = 3
# Any sign that a kernel has started: its banner or timestamps, the project's initramfs,
# systemd, a login prompt. A console without one shows only firmware or a bootloader.
KERNEL_SIGN_RE = re.compile(
    r"Linux version \d|^\[\s*\d+\.\d+\]|vmsandbox-boot: |systemd|login: |Run /init",
    re.MULTILINE,
)
# "vmsandbox-boot: <event> at <seconds>s": a stage of the boot, in the guest's own clock.
BOOT_MARK_RE = re.compile(r"vmsandbox-boot: (?P<event>.+?) at (?P<at>\d+(?:\.\d+)?)s\b")

_STAGES = (
    ("Reached target multi-user", "multi-user target reached"),
    ("vmsandbox-boot: sshd is up", "sshd up"),
    ("Starting ssh.service", "starting sshd"),
    ("vmsandbox-boot: systemd starting", "systemd starting"),
    ("cloud-init", "cloud-init running"),
    ("vmsandbox-firstboot", "first-boot unit running"),
    ("Reached target basic", "basic system up"),
    ("Run /init", "initramfs"),
    ("vmsandbox-boot: initramfs started", "initramfs"),
    ("Linux version", "kernel booting"),
)
_TAIL_BYTES = 16384


def clean(text: str) -> str:
    """``text`` without escape sequences and unprintable characters (newlines and tabs kept)."""
    text = _ANSI_RE.sub("", text).replace("\r", "")
    return "".join(ch for ch in text if ch in "\n\t" or ch.isprintable())


def tail(path: Path, lines: int) -> str:
    """The last ``lines`` lines of the console log, cleaned; empty when there is none."""
    try:
        with path.open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - _TAIL_BYTES))
            text = handle.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(clean(text).splitlines()[-lines:])


def kernel_started(path: Path) -> bool:
    """Whether the console log shows any sign of a kernel (KERNEL_SIGN_RE) in its last lines."""
    return KERNEL_SIGN_RE.search(tail(path, 200)) is not None


def read_lines(path: Path, lines: int | None = None) -> str:
    """The whole console log, or its last ``lines`` lines, cleaned (read from the end: a long
    log is never read whole for a few lines). NOT_FOUND when there is no log yet."""
    try:
        with path.open("rb") as handle:
            if lines is None:
                return clean(handle.read().decode(errors="replace"))
            size = handle.seek(0, os.SEEK_END)
            back = _TAIL_BYTES
            while True:
                handle.seek(max(0, size - back))
                text = clean(handle.read().decode(errors="replace"))
                if back >= size or text.count("\n") > lines:
                    return "\n".join(text.splitlines()[-lines:]) if lines else ""
                back *= 4
    except FileNotFoundError as exc:
        raise NotFound(f"no console log at {path} (the guest never started?)") from exc


def follow(path: Path, lines: int | None = 10, poll: float = 0.2) -> Iterator[str]:
    """The last ``lines`` lines of the console log, then every line the guest adds (cleaned),
    as it comes; a log that starts over (the guest started again) is followed from its top.
    Ends when the log is removed (the sandbox destroyed)."""
    backlog = read_lines(path, lines)
    yield from backlog.splitlines()
    try:
        offset = path.stat().st_size
    except FileNotFoundError:
        return
    partial = ""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character may split
    while True:
        try:
            with path.open("rb") as handle:
                if os.fstat(handle.fileno()).st_size < offset:
                    offset, partial = 0, ""
                    decoder.reset()
                handle.seek(offset)
                chunk = handle.read()
        except FileNotFoundError:
            if partial:
                yield clean(partial)
            return
        offset += len(chunk)
        pieces = (partial + decoder.decode(chunk)).split("\n")
        partial = pieces.pop()
        for piece in pieces:
            yield clean(piece)
        if not chunk:
            time.sleep(poll)


def stage(path: Path) -> str:
    """A short phrase for how far the guest has got, read from its console log."""
    text = tail(path, 80)
    if not text:
        return "firmware"
    for marker, phrase in _STAGES:
        if marker in text:
            return phrase
    return "booting"


class ConsoleWatch:
    """Follows a console log as it grows: remembers whether a seed reader (cloud-init or the
    first-boot unit) was ever seen and finds the first fatal line. Reads only what was added
    since the last ``poll``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seed_reader_seen = False
        self.sshd_started_seen = False
        self.network_online_seen = False
        self.lean_boot_seen = False
        self.fatal: str | None = None
        self.boots = [0] * len(BOOT_START_RES)  # how often each boot's line was seen
        self._offset = 0
        self._partial = ""

    def poll(self) -> str | None:
        """The first fatal line seen so far, or None."""
        try:
            with self.path.open("rb") as handle:
                if os.fstat(handle.fileno()).st_size < self._offset:
                    self._offset, self._partial = 0, ""  # truncated: QEMU started it again
                handle.seek(self._offset)
                chunk = handle.read()
        except OSError:
            return self.fatal
        self._offset += len(chunk)
        text = self._partial + clean(chunk.decode(errors="replace"))
        lines = text.split("\n")
        self._partial = lines.pop()  # an unfinished line is read again with the rest of it
        for line in lines:
            if SEED_READER_RE.search(line):
                self.seed_reader_seen = True
            both = MULTI_USER_RE.search(line) is not None
            self.sshd_started_seen |= both or SSHD_STARTED_RE.search(line) is not None
            self.network_online_seen |= both or NETWORK_ONLINE_RE.search(line) is not None
            self.lean_boot_seen |= BOOT_MARK_RE.search(line) is not None
            if self.fatal is None and any(pattern.search(line) for pattern in FATAL):
                self.fatal = line.strip()
            for index, pattern in enumerate(BOOT_START_RES):
                self.boots[index] += pattern.search(line) is not None
        return self.fatal

    @property
    def restarts(self) -> int:
        """How many times the guest has started over since the log began (0: booted once)."""
        return max(0, max(self.boots) - 1)

    @property
    def sshd_reachable(self) -> bool:
        """Whether the console has said that the network is up and that sshd started. A guest
        of the project's lean boot (its "vmsandbox-boot" lines) is knocked at once its network
        is up: its NIC answers every knock from then on, a refused one at once and without
        starting anything, so the knock that finds sshd comes right after sshd listens (its
        "sshd is up" line comes a process start later)."""
        return self.network_online_seen and (self.sshd_started_seen or self.lean_boot_seen)
