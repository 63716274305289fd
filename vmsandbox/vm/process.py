"""Which process made something, told apart from a later process that reuses its pid.

A create records its creator's identity (pid, start time, boot id); reconcile removes a sandbox
still being created only when that process is gone: a recycled pid or a reboot is not it.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ProcessIdentity:
    pid: int
    start: str | None  # field 22 of /proc/PID/stat: clock ticks after boot
    boot: str  # /proc/sys/kernel/random/boot_id

    @classmethod
    def current(cls) -> ProcessIdentity:
        return cls(pid=os.getpid(), start=start_time(os.getpid()), boot=boot_id())

    def alive(self) -> bool:
        """Whether this very process still runs (not a zombie, not a reused pid)."""
        if self.boot != boot_id() or self.start is None:
            return False
        return start_time(self.pid) == self.start

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProcessIdentity | None:
        pid = data.get("pid")
        if not isinstance(pid, int):
            return None
        start = data.get("start")
        start_text = str(start) if start is not None else None
        return cls(pid=pid, start=start_text, boot=str(data.get("boot")))


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
