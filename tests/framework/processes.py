"""Which processes a test run started, and the waits the tests poll with.

Other test runs share this machine (and libvirtd), and an external nested-host QEMU may run:
a process is this run's when its environment carries this run's mark (every process the run
starts inherits it), or when its command line names a directory this run made (QEMU started
by libvirtd, whose environment libvirt clears, names the overlay in the test's state dir).
tests/conftest.py fails the session, naming them, when such processes outlive it.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

RUN_ID = uuid.uuid4().hex
os.environ["VMSANDBOX_TEST_RUN"] = RUN_ID
RUN_DIRS: set[str] = set()


def _record_run_dirs(event: str, args: tuple[object, ...]) -> None:
    """Audit hook: every ``tempfile.mkdtemp`` of this process (TemporaryDirectory too), so the
    state directories of all tests are known without each test having to register its own."""
    if event == "tempfile.mkdtemp":
        RUN_DIRS.add(os.fspath(args[0]))  # type: ignore[arg-type]


sys.addaudithook(_record_run_dirs)

# The tools whose processes a test must never leave running.
LEAK_TOOLS = ("qemu-system-*", "qemu-img", "genisoimage", "mmdebstrap", "vmsandbox")
LEAK_GRACE_SECONDS = 30.0  # a destroyed domain's QEMU, a probe's deadline: let them finish


@dataclass(frozen=True)
class Proc:
    """One live process as /proc shows it."""

    pid: int
    session: int
    argv: tuple[str, ...]
    environ: frozenset[bytes]

    @property
    def tool(self) -> str | None:
        """Which of LEAK_TOOLS this process is (scripts run by an interpreter count too)."""
        words = list(self.argv[:3])
        if "vmsandbox.cli" in words:
            return "vmsandbox"
        names = [os.path.basename(word) for word in words]
        return next((n for n in names if any(fnmatch(n, tool) for tool in LEAK_TOOLS)), None)

    def describe(self) -> str:
        return f"pid {self.pid}: {' '.join(self.argv)[:300]}"


def processes() -> list[Proc]:
    """Every live process (zombies, already dead, left out) that this user may read."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
            argv = Path(entry.path, "cmdline").read_bytes()
            environ = Path(entry.path, "environ").read_bytes()
        except OSError:
            continue  # gone while we looked, or not ours to read
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] in ("Z", "X") or not argv:
            continue  # a zombie, or a kernel thread
        found.append(
            Proc(
                pid=int(entry.name),
                session=int(fields[3]),
                argv=tuple(arg.decode(errors="replace") for arg in argv.rstrip(b"\0").split(b"\0")),
                environ=frozenset(environ.split(b"\0")),
            )
        )
    return found


def run_leftovers(dirs: set[str]) -> list[Proc]:
    """Processes of LEAK_TOOLS that this run started and that still run."""
    mark = f"VMSANDBOX_TEST_RUN={RUN_ID}".encode()
    prefixes = tuple(d.rstrip("/") + "/" for d in dirs)
    return [
        proc
        for proc in processes()
        if proc.pid != os.getpid()
        and proc.tool is not None
        and (mark in proc.environ or any(p in arg for arg in proc.argv for p in prefixes))
    ]


def wait_for(condition: Callable[[], bool], limit: float = 60.0) -> bool:
    """Poll ``condition`` until it holds (True) or ``limit`` seconds pass (False)."""
    deadline = time.monotonic() + limit
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def wait_until_gone(find: Callable[[], list[Proc]], limit: float) -> list[Proc]:
    """Poll ``find`` until it finds nothing or ``limit`` seconds pass; what is left."""
    deadline = time.monotonic() + limit
    while (left := find()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left
