"""The host-wide lock under which names, ports and GPUs are chosen and domains defined.

An ``flock`` on a file in the state directory: released by the kernel when its holder dies, so a
process killed mid-create never leaves the lock stuck.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from vmsandbox.errors import DeadlineExceeded


@contextmanager
def host_lock(path: Path, timeout: float = 60.0) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + timeout
        delay = 0.002
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise DeadlineExceeded(
                        f"host lock {path} still held by another vmsandbox process after "
                        f"{timeout:.0f}s"
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
        yield
    finally:
        os.close(fd)
