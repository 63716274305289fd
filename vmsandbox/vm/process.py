"""Who is at work on something, told apart from a later process that reuses its pid, and seen
across PID namespaces.

A transition in flight (a create, a claim, a fill, a start) records its owner's identity; a
record or reservation whose owner is gone is left over and taken apart by reconcile. Two ways
to tell, the first where there is one:

- **An owner file** (``Ownership``): a file in the state directory's ``owners/`` folder that
  the transition keeps ``flock``-ed while it works. The kernel drops the lock when the process
  dies, and anyone who can open the file can test it, whatever PID namespace they run in (a
  container's pid means nothing on the host). The transition gives the file up when it ends,
  also when it fails and leaves cleanup to reconcile, so a long-lived process (``vmsandbox
  serve``) never keeps a failed create alive.
- **pid, start time and boot id**, for records written before owner files: a reused pid or a
  reboot is not the owner. Only meaningful inside the PID namespace that wrote it.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import secrets
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from vmsandbox.lock import file_held


@dataclass(frozen=True)
class ProcessIdentity:
    pid: int
    start: str | None  # field 22 of /proc/PID/stat: clock ticks after boot
    boot: str  # /proc/sys/kernel/random/boot_id
    owner: str | None = None  # the owner file (``Ownership``) this process keeps locked

    @classmethod
    def current(cls, owner: str | None = None) -> ProcessIdentity:
        return cls(pid=os.getpid(), start=start_time(os.getpid()), boot=boot_id(), owner=owner)

    def alive(self) -> bool:
        """Whether the owner is still at work: its owner file is still locked; without one,
        this very process still runs (not a zombie, not a reused pid, not another boot)."""
        if self.owner is not None:
            return owner_alive(Path(self.owner))
        if self.boot != boot_id() or self.start is None:
            return False
        return start_time(self.pid) == self.start

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if self.owner is None:
            del data["owner"]  # records without owner files read as they did
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProcessIdentity | None:
        pid = data.get("pid")
        if not isinstance(pid, int):
            return None
        start = data.get("start")
        start_text = str(start) if start is not None else None
        owner = data.get("owner")
        return cls(
            pid=pid,
            start=start_text,
            boot=str(data.get("boot")),
            owner=str(owner) if owner else None,
        )


class Ownership:
    """An owner file in ``folder``, kept locked from ``begin`` until ``end`` (or death)."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.path = folder / secrets.token_hex(8)
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        self.identity = ProcessIdentity.current(str(self.path))

    @property
    def active(self) -> bool:
        return self._fd is not None

    def end(self) -> None:
        """Give the owner file up: from now on the owner reads as gone."""
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        os.close(self._fd)
        self._fd = None


_PROCESS_OWNERS: dict[Path, Ownership] = {}


def process_owner(folder: Path) -> ProcessIdentity:
    """The identity of this process with an owner file in ``folder`` that it keeps for as
    long as it lives (a ``starter``: shown starting while the process that started it lives)."""
    owner = _PROCESS_OWNERS.get(folder)
    if owner is None or not owner.active:
        owner = _PROCESS_OWNERS[folder] = Ownership(folder)
    return owner.identity


os.register_at_fork(after_in_child=_PROCESS_OWNERS.clear)  # a child is another process


@atexit.register
def _end_process_owners() -> None:
    """A process that ends gives its owner files up: none is left behind in ``owners/`` for
    every ``vmsandbox start`` that ever ran (one killed is swept by ``sweep_owner_files``)."""
    for owner in _PROCESS_OWNERS.values():
        owner.end()


# An owner file younger than this is never swept: between its creation and its ``flock`` it
# is unlocked, and must not be taken for a dead owner's.
SWEEP_AGE_S = 60.0


def sweep_owner_files(folder: Path) -> None:
    """Remove the owner files in ``folder`` that nobody keeps locked any more (their owners
    were killed before they could give them up); a record naming one reads its owner as gone
    either way."""
    if not folder.is_dir():
        return
    for path in folder.iterdir():
        with contextlib.suppress(OSError):
            if time.time() - path.stat().st_mtime > SWEEP_AGE_S:
                owner_alive(path)  # removes a file that nobody locks


def owner_alive(path: Path) -> bool:
    """Whether someone keeps the owner file ``path`` locked; a file nobody locks is removed."""
    return file_held(path)


def start_time(pid: int) -> str | None:
    """When process ``pid`` started, or None if it is gone or a zombie (killed, not reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] in ("Z", "X") else fields[19]


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"
