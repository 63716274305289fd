"""The host-wide lock that guards vmsandbox's short state transitions, waited for in turn.

It guards transitions only (a reservation recorded, a domain defined, a record committed),
never slow work: discovery, fmpm, boots, live attach and SSH happen outside it (see
docs/architecture-rules.md). Three properties, each from the kernel's ``flock``:

- **Released by death.** The lock is an ``flock`` on ``host.lock`` in the state directory:
  the kernel drops it when its holder dies, so a process killed mid-create never leaves it
  stuck.
- **Fair.** A waiter first takes a numbered ticket: a file in ``host.lock.d/``, created under
  a short ``flock`` of the counter file and ``flock``-ed by its owner for as long as it waits
  and holds. The lock goes to the lowest live ticket: a waiter tries ``host.lock`` only when
  no lower ticket is alive, and a ticket whose ``flock`` can be taken belongs to a dead
  process and is removed. So waiters are served first come, first served.
- **Bounded, and the holder named.** A wait ends after ``timeout`` seconds with
  DEADLINE_EXCEEDED naming the process ahead (pid, command, since when it holds or waits)
  and how many wait in between.

One thread may take the lock again while it holds it (the inner hold is a no-op), so a
transition that calls another never waits for itself.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vmsandbox.errors import DeadlineExceeded, FailedPrecondition

DEFAULT_TIMEOUT = 60.0
_FIRST_PAUSE = 0.002
_LONGEST_PAUSE = 0.05
_TICKET_DIGITS = 12
_held = threading.local()  # the lock paths this thread holds


@dataclass(frozen=True)
class Hold:
    """One hold of the lock, for the load benchmark: how long it waited and held, and why."""

    purpose: str
    waited: float
    held: float


# Every hold of this process, when a caller (bench/lock_load.py) sets it to a list.
STATS: list[Hold] | None = None


def held(path: Path) -> bool:
    """Whether this thread holds the lock at ``path``."""
    return str(path) in getattr(_held, "paths", set())


@contextlib.contextmanager
def host_lock(path: Path, timeout: float = DEFAULT_TIMEOUT, purpose: str = "") -> Iterator[None]:
    """Hold the lock at ``path`` for the block, waiting at most ``timeout`` seconds in turn.

    ``purpose`` names the transition in the holder's ticket, for a waiter's error message.
    """
    paths: set[str] = getattr(_held, "paths", set())
    if str(path) in paths:
        yield  # this thread holds it already
        return
    asked = time.monotonic()
    try:
        ticket = _Ticket.take(path, purpose)
    except OSError as exc:
        raise FailedPrecondition(
            f"host lock {path}: its queue cannot be written: {exc.strerror or exc} "
            f"({exc.filename or path})",
            details={"lock": str(path), "errno": exc.errno},
        ) from exc
    try:
        lock_fd = ticket.wait_turn(path, timeout)
        try:
            ticket.mark_held()
            got = time.monotonic()
            paths.add(str(path))
            _held.paths = paths
            try:
                yield
            finally:
                paths.discard(str(path))
                if STATS is not None:
                    STATS.append(Hold(purpose, got - asked, time.monotonic() - got))
        finally:
            os.close(lock_fd)  # the flock goes with the descriptor
    finally:
        ticket.give_back()


@dataclass
class _Ticket:
    """This process's place in the queue of ``path``: a file it keeps ``flock``-ed."""

    queue: Path
    number: int
    fd: int
    info: dict[str, Any]

    @property
    def file(self) -> Path:
        return self.queue / _ticket_name(self.number)

    @classmethod
    def take(cls, path: Path, purpose: str) -> _Ticket:
        """The next number, and its file created already locked (it appears under its final
        name only once locked, so no one mistakes it for a dead waiter's)."""
        queue = path.with_name(path.name + ".d")
        queue.mkdir(mode=0o700, exist_ok=True)
        info = {
            "pid": os.getpid(),
            "command": _command(),
            "purpose": purpose,
            "waiting_since": time.time(),
        }
        counter = os.open(queue / "counter", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(counter, fcntl.LOCK_EX)
            number = int(os.pread(counter, 32, 0).decode() or 0) + 1
            os.pwrite(counter, str(number).encode().ljust(32), 0)
            partial = queue / f"{_ticket_name(number)}.partial"
            fd = os.open(partial, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(fd, json.dumps(info).encode())
            os.rename(partial, queue / _ticket_name(number))
        finally:
            os.close(counter)
        return cls(queue, number, fd, info)

    def wait_turn(self, path: Path, timeout: float) -> int:
        """Wait until no lower ticket is alive and ``path`` can be locked; its descriptor.
        DEADLINE_EXCEEDED after ``timeout`` seconds, naming who is ahead."""
        deadline = time.monotonic() + timeout
        pause = _FIRST_PAUSE
        lock_fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            while True:
                ahead = self._live_ahead()
                if not ahead:
                    try:
                        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        return lock_fd
                    except BlockingIOError:
                        pass  # a process that takes no ticket holds it
                if time.monotonic() >= deadline:
                    raise self._timed_out(path, timeout, ahead)
                time.sleep(pause)
                pause = min(pause * 2, _LONGEST_PAUSE)
        except BaseException:
            os.close(lock_fd)
            raise

    def _live_ahead(self) -> list[int]:
        """The numbers of live tickets lower than this one; dead ones are removed."""
        live = []
        for number in sorted(_numbers(self.queue)):
            if number >= self.number:
                break
            if file_held(self.queue / _ticket_name(number)):
                live.append(number)
        return live

    def _timed_out(self, path: Path, timeout: float, ahead: list[int]) -> DeadlineExceeded:
        first = _read(self.queue / _ticket_name(ahead[0])) if ahead else None
        between = max(0, len(ahead) - 1)
        if first is None:
            who = "a vmsandbox process that took no place in the queue"
            details: dict[str, Any] = {"holder": None}
        else:
            since = first.get("held_since") or first.get("waiting_since") or time.time()
            doing = "holds it" if first.get("held_since") else "is first in line"
            purpose = f" for {first['purpose']}" if first.get("purpose") else ""
            who = (
                f"pid {first.get('pid')} ({first.get('command', '?')}){purpose}, which {doing} "
                f"since {_clock(since)} ({time.time() - since:.0f} s)"
            )
            details = {"holder": first}
        return DeadlineExceeded(
            f"host lock {path} not free after {timeout:.0f} s: {who}"
            + (f"; {between} more waiting before this call" if between else ""),
            details={**details, "waiting_ahead": len(ahead), "lock": str(path)},
        )

    def mark_held(self) -> None:
        self.info["held_since"] = time.time()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, json.dumps(self.info).encode(), 0)

    def give_back(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.file.unlink()
        os.close(self.fd)


def _ticket_name(number: int) -> str:
    return f"{number:0{_TICKET_DIGITS}d}"


def _numbers(queue: Path) -> list[int]:
    return [int(name) for name in os.listdir(queue) if name.isdigit()]


def file_held(path: Path) -> bool:
    """Whether a live process keeps ``path`` locked (``flock``); a file nobody locks (its
    owner died) is removed. Tickets of the lock's queue and owner files use it."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return True
        raise
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return False
    finally:
        os.close(fd)


def _read(ticket: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(ticket.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _command() -> str:
    """This process's command line, short (for a waiter's message)."""
    return " ".join(Path(sys.argv[0]).name.split() + sys.argv[1:])[:200] or "python"


def _clock(epoch: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))
