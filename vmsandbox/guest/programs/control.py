#!/usr/bin/python3
"""vmsandbox's control channel in the guest: the request a pool claim makes, without SSH.

Baked into the project's own images as /usr/lib/vmsandbox/control.py (compiled there to
control.pyc) and run as root by ``vmsandbox-control.service`` once sshd has started, real-time
(SCHED_FIFO, lowest priority: images/common/control.sh says why). It serves
the virtio-serial port named ``org.vmsandbox.control.0``, whose host end is a socket in the
sandbox's private folder that only vmsandbox (root) opens. A claim of a pooled guest writes its
new hostname through it: a few milliseconds, where an SSH login, a shell and sudo took half a
second under TCG.

It accepts three requests, one line each, with NAME in vmsandbox's sandbox name grammar
(lowercase letters, digits and inner dashes, at most 48), and answers ``ok`` or ``error: WHY``:
``claim NAME`` (a claim: the guest takes NAME as its hostname once it has checked that its sshd
runs, so a guest whose sshd has died is never handed out), ``hostname NAME`` (the hostname
alone, as older hosts ask) and ``wake NANOSECONDS HEX`` (a resume: the guest's memory was
saved and restored, so its clock is as far behind as it was suspended and its random number
generator's state is a copy of an earlier one: the clock is set to the host's, given in
nanoseconds since the epoch, the 32 bytes of HEX, drawn by the host, are credited to the
kernel's entropy pool and the kernel reseeds at once, then sshd is checked as for a claim).
Nothing it reads reaches a shell or a program: the name is written to
/proc/sys/kernel/hostname, /etc/hostname and /etc/hosts by this program itself. Standard
library only: it runs with ``python3 -I -S``.
"""

from __future__ import annotations

import fcntl
import os
import re
import signal
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path

PREFIX = "vmsandbox-control"
PORT_NAME = "org.vmsandbox.control.0"
# vmsandbox/validate.py's sandbox name grammar (tests/unit/guest/test_control.py keeps the two
# equal).
NAME_MAX = 48
NAME_RE = re.compile(r"^[a-z0-9](?:[a-z0-9-]*[a-z0-9])?\Z")
REQUEST_MAX = 128  # bytes of one request line, newline included
VERBS = ("claim", "hostname", "wake")
SEED_BYTES = 32  # what ``wake`` credits to the kernel's entropy pool
CLOCK_DIGITS = 20  # nanoseconds since the epoch, as a whole number
# linux/random.h: RNDADDENTROPY = _IOW('R', 0x03, int[2]); RNDRESEEDCRNG = _IO('R', 0x07).
RNDADDENTROPY = 0x40085203
RNDRESEEDCRNG = 0x5207
RANDOM = Path("/dev/random")
SSHD_PID_FILE = Path("/run/sshd.pid")  # sshd's PidFile (Debian's default)
PORT_WAIT_S = 30.0
POLL_S = 0.1
# While the host end is closed, a read returns at once: the program waits for the kernel's
# SIGIO (sent when the host connects), and looks again after this long in case one was missed.
IDLE_WAIT_S = 1.0


class RequestError(Exception):
    """A request this program refuses: the message says why (it goes back to the host)."""


def parse(line: bytes) -> tuple[str, str]:
    """The verb and its argument (the hostname; for ``wake`` the clock and the seed) a request
    line asks for; RequestError for anything else."""
    if not line.endswith(b"\n"):
        raise RequestError("a request is one line ending in a newline")
    try:
        text = line[:-1].decode("ascii")
    except UnicodeDecodeError as exc:
        raise RequestError("a request is ASCII text") from exc
    verb, _, name = text.partition(" ")
    if verb not in VERBS:
        raise RequestError(
            f"unknown request {verb[:20]!r} (they are 'claim NAME', 'hostname NAME', "
            "'wake NANOSECONDS HEX')"
        )
    if verb == "wake":
        clock, _, seed = name.partition(" ")
        if not (clock.isdigit() and clock.isascii() and 0 < len(clock) <= CLOCK_DIGITS):
            raise RequestError(f"wake: {clock[: CLOCK_DIGITS + 1]!r} is not a clock in nanoseconds")
        if len(seed) != 2 * SEED_BYTES or not all(c in "0123456789abcdef" for c in seed):
            raise RequestError(f"wake: the seed is not {SEED_BYTES} bytes in lowercase hex")
        return verb, name
    if not name or len(name) > NAME_MAX or not NAME_RE.match(name):
        raise RequestError(
            f"hostname {name[: NAME_MAX + 1]!r} is not a sandbox name (1-{NAME_MAX} lowercase "
            "letters, digits and inner dashes)"
        )
    return verb, name


def sshd_running(pid_file: Path = SSHD_PID_FILE, proc: Path = Path("/proc")) -> str | None:
    """None when the process of sshd's PID file is an sshd; else why not."""
    try:
        pid = int(pid_file.read_text().strip())
        command = (proc / str(pid) / "comm").read_text().strip()
    except (OSError, ValueError) as exc:
        return f"sshd is not running ({pid_file}: {getattr(exc, 'strerror', None) or exc})"
    if command != "sshd":
        return f"sshd is not running (process {pid} of {pid_file} is {command!r})"
    return None


def _replace(path: Path, text: str) -> None:
    """Write ``path`` whole through a new file renamed over it (mode 0644, owner root)."""
    new = path.with_name(f".{path.name}.vmsandbox-new")
    fd = os.open(new, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    try:
        os.fchmod(fd, 0o644)
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(new, path)


def set_hostname(
    name: str, root: Path = Path("/"), kernel: Path = Path("/proc/sys/kernel/hostname")
) -> None:
    """The hostname now (the kernel's) and at later boots; /etc/hosts maps it to 127.0.1.1
    (sudo looks its own host up, and a name missing there would go to DNS)."""
    hosts = root / "etc/hosts"
    lines = hosts.read_text().splitlines() if hosts.exists() else []
    kept = [line for line in lines if line.split()[:1] != ["127.0.1.1"]]
    _replace(hosts, "\n".join([*kept, f"127.0.1.1 {name}"]) + "\n")
    _replace(root / "etc/hostname", f"{name}\n")
    kernel.write_text(name)


def wake(clock_ns: int, seed: bytes, random: Path = RANDOM) -> None:
    """After a resume: the clock set to ``clock_ns`` (CLOCK_REALTIME), ``seed`` credited to
    the kernel's entropy pool and the kernel's random number generator reseeded from it."""
    time.clock_settime_ns(time.CLOCK_REALTIME, clock_ns)
    fd = os.open(random, os.O_WRONLY | os.O_CLOEXEC)
    try:
        info = struct.pack("ii", 8 * len(seed), len(seed)) + seed
        fcntl.ioctl(fd, RNDADDENTROPY, info)
        fcntl.ioctl(fd, RNDRESEEDCRNG)
    finally:
        os.close(fd)


def answer(
    line: bytes,
    apply: Callable[[str], None] = set_hostname,
    sshd: Callable[[], str | None] = sshd_running,
    woken: Callable[[int, bytes], None] = wake,
) -> bytes:
    """The answer line to one request line."""
    try:
        verb, name = parse(line)
        if verb == "wake":
            clock, _, seed = name.partition(" ")
            try:
                woken(int(clock), bytes.fromhex(seed))
            except OSError as exc:
                return f"error: setting the clock and seed failed: {exc.strerror or exc}\n".encode()
        problem = sshd() if verb in ("claim", "wake") else None
        if problem is not None:
            return f"error: {problem}\n".encode()
        if verb != "wake":
            apply(name)
    except RequestError as exc:
        return f"error: {exc}\n".encode()
    except OSError as exc:
        return f"error: setting the hostname failed: {exc.strerror or exc}\n".encode()
    return b"ok\n"


def find_port(sys_ports: Path = Path("/sys/class/virtio-ports"), wait: float = PORT_WAIT_S) -> str:
    """The /dev name of the port named PORT_NAME (waited for: its driver may still load);
    "" when the domain has none."""
    deadline = time.monotonic() + wait
    while True:
        for port in sorted(sys_ports.iterdir()) if sys_ports.is_dir() else []:
            with open(port / "name") as handle:
                if handle.read().strip() == PORT_NAME:
                    return port.name
        if time.monotonic() > deadline:
            return ""
        time.sleep(POLL_S)


def serve(fd: int, apply: Callable[[str], None] = set_hostname) -> None:
    """Answer request lines on the open port ``fd``, forever."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGIO})
    fcntl.fcntl(fd, fcntl.F_SETOWN, os.getpid())
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_ASYNC)
    pending = b""
    overlong = False  # the rest of a line already answered as too long is dropped
    while True:
        chunk = os.read(fd, REQUEST_MAX)
        if not chunk:  # the host end is closed: what it left unfinished is dropped
            pending, overlong = b"", False
            signal.sigtimedwait({signal.SIGIO}, IDLE_WAIT_S)
            continue
        pending += chunk
        if overlong:
            if b"\n" not in pending:
                pending = b""
                continue
            pending, overlong = pending.partition(b"\n")[2], False
        while b"\n" in pending:
            line, _, pending = pending.partition(b"\n")
            os.write(fd, answer(line + b"\n", apply))
        if len(pending) >= REQUEST_MAX:
            os.write(fd, f"error: a request is at most {REQUEST_MAX} bytes\n".encode())
            pending, overlong = b"", True


def main(argv: list[str]) -> int:
    if argv:
        print(f"{PREFIX}: error: usage: control.py, got {argv!r}", file=sys.stderr)
        return 2
    port = find_port()
    if not port:
        print(f"{PREFIX}: this domain has no port {PORT_NAME}; nothing to serve", flush=True)
        return 0
    try:
        fd = os.open(f"/dev/{port}", os.O_RDWR | os.O_CLOEXEC)
        print(f"{PREFIX}: serving {PORT_NAME} on /dev/{port}", flush=True)
        serve(fd)
    except OSError as exc:
        print(f"{PREFIX}: error: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
