"""The host kernel's log, read record by record from ``/dev/kmsg`` from where the last reader
stopped.

Each record of ``/dev/kmsg`` is ``PRIORITY,SEQUENCE,MICROSECONDS,FLAGS;TEXT`` (continuation
lines ``" KEY=value"`` follow); the sequence number grows by one per record for the life of the
boot. A reader keeps a cursor (the boot id and the last sequence number it handled) in a file,
so a monitor that restarts reads on where it stopped, and one that starts for the first time
(or after a reboot) begins at the end: errors logged before it ever ran are not taken for new
ones. A record overwritten before it was read (the ring is full) is skipped (``EPIPE``).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

KMSG = "/dev/kmsg"
_RECORD = 8192  # the kernel's largest record


@dataclass(frozen=True)
class Record:
    sequence: int
    microseconds: int  # since boot, the kernel's own clock
    text: str


def parse_record(raw: bytes) -> Record | None:
    """One ``/dev/kmsg`` record, None when it is not one."""
    head, sep, body = raw.decode("utf-8", errors="replace").partition(";")
    fields = head.split(",")
    if not sep or len(fields) < 3:
        return None
    try:
        sequence, microseconds = int(fields[1]), int(fields[2])
    except ValueError:
        return None
    return Record(sequence, microseconds, body.split("\n", 1)[0])


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


class KernelLog:
    """The records logged since this reader's cursor (``cursor``: a file it keeps). It keeps
    ``/dev/kmsg`` open between reads, so each read after the first returns only new records;
    ``close`` lets it go."""

    def __init__(self, cursor: Path, path: str = KMSG) -> None:
        self.cursor, self.path = cursor, path
        self._fd: int | None = None
        self._last: int | None = None

    def _stored(self) -> int | None:
        try:
            data = json.loads(self.cursor.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or data.get("boot") != _boot_id():
            return None
        sequence = data.get("sequence")
        return sequence if isinstance(sequence, int) else None

    def _keep(self, sequence: int) -> None:
        partial = self.cursor.with_suffix(".partial")
        with contextlib.suppress(OSError):
            partial.write_text(json.dumps({"boot": _boot_id(), "sequence": sequence}))
            os.replace(partial, self.cursor)

    def new(self) -> list[Record]:
        """The records after the cursor, the cursor moved past them. The first read of a
        reader without a cursor (or with one of another boot) returns nothing and sets the
        cursor at the end."""
        first = self._fd is None
        if first:
            try:
                self._fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
            except OSError:
                return []
            self._last = self._stored()
        found = list(self._read())
        fresh = [r for r in found if self._last is not None and r.sequence > self._last]
        if first and self._last is None:
            fresh = []
        newest = max((r.sequence for r in found), default=None)
        if newest is not None and (self._last is None or newest > self._last):
            self._last = newest
            self._keep(newest)
        return fresh

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _read(self) -> Iterator[Record]:
        assert self._fd is not None
        while True:
            try:
                raw = os.read(self._fd, _RECORD)
            except OSError as exc:
                if exc.errno == errno.EPIPE:
                    continue  # overwritten before it was read
                return  # EAGAIN: nothing more for now
            if not raw:
                return
            # one record per read from /dev/kmsg; a plain file (the tests') gives many
            for line in raw.split(b"\n"):
                record = parse_record(line) if line and not line.startswith(b" ") else None
                if record is not None:
                    yield record
