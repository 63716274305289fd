"""The host's durable custody records, in the state directory: one file per GPU, written
atomically under the host lock, and two logs beside them.

- ``<state>/custody/gpus/<bdf>.json``: the GPU's ``Custody`` (state.py). Written only under
  the host lock (``CustodyStore`` refuses otherwise), each write whole (a reader sees the old
  record or the new one). A record that cannot be read is not taken for free: it reads as
  quarantined, with why (fail closed).
- ``<state>/custody/events.jsonl``: every change of state with what caused it, and every
  operator action (``gpus check``, ``gpus release --force``) with who ran it.
- ``<state>/custody/sanitize.jsonl``: each sanitize's seconds per step and its outcome (the
  metrics' histogram and ``bench/gpu_handoff.py`` read it); the last ``LOG_KEPT`` lines are
  kept.

The transitions themselves are state.py's pure functions; the store applies one to the
current record under the lock and writes the result.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from vmsandbox.config import Config
from vmsandbox.errors import FailedPrecondition, Internal, ResourceExhausted, VmSandboxError
from vmsandbox.lock import held
from vmsandbox.tools import write_json

from .state import QUARANTINED, Custody, now_text

LOG_KEPT = 2000  # lines of sanitize.jsonl and events.jsonl kept (cut to this at twice it)


class CustodyStore:
    """The custody records of one state directory (see the module docstring)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.folder = config.state_dir / "custody"
        self.gpus = self.folder / "gpus"

    # -- reading (any time: each record is written whole) ----------------------------------

    def all(self) -> dict[str, Custody]:
        """Every GPU's record, by BDF; a GPU without one is free."""
        found: dict[str, Custody] = {}
        if not self.gpus.is_dir():
            return found
        for path in self.gpus.glob("*.json"):
            record = self._read(path)
            found[record.bdf] = record
        return found

    def get(self, bdf: str) -> Custody:
        path = self.gpus / f"{bdf}.json"
        return self._read(path) if path.exists() else Custody(bdf, since="")

    def _read(self, path: Path) -> Custody:
        try:
            return Custody.from_dict(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return Custody(
                path.stem,
                state=QUARANTINED,
                reason=f"its custody record {path} cannot be read ({exc}): check it, or release "
                "it with 'vmsandbox gpus release --force'",
                signal="record",
            )

    # -- writing (under the host lock) -----------------------------------------------------

    def _check_locked(self, doing: str) -> None:
        if not held(self.config.lock_path):
            raise Internal(
                f"{doing} outside the host lock: custody changes under the lock only",
                details={"lock": str(self.config.lock_path)},
            )

    def put(self, record: Custody, cause: str) -> Custody:
        """Write ``record`` (atomically) and log the change with its ``cause``."""
        doing = f"writing the custody record of GPU {record.bdf}"
        self._check_locked(doing)
        try:
            write_json(self.gpus / f"{record.bdf}.json", record.to_dict())
        except OSError as exc:
            raise _unwritable(doing, exc) from exc
        self.log(
            {
                "bdf": record.bdf,
                "state": record.state,
                "cause": cause,
                "reason": record.reason,
                "owner": record.owner,
            }
        )
        return record

    def change(
        self, bdf: str, transition: Callable[[Custody], Custody | None], cause: str
    ) -> Custody | None:
        """Apply ``transition`` to the GPU's current record and write the result; None when
        it changed nothing."""
        self._check_locked(f"changing the custody of GPU {bdf}")
        new = transition(self.get(bdf))
        return None if new is None else self.put(new, cause)

    # -- the logs --------------------------------------------------------------------------

    def log(self, event: Mapping[str, Any], name: str = "events.jsonl") -> None:
        """Append one event (a line of JSON, stamped) to a log; a log that cannot be written
        loses the line, never the transition."""
        line = json.dumps({"at": now_text(), **event}) + "\n"
        path = self.folder / name
        with contextlib.suppress(OSError):
            self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            with os.fdopen(fd, "a") as out:
                out.write(line)
            if path.stat().st_size > LOG_KEPT * 400:
                _trim(path)

    def read_log(self, name: str = "events.jsonl") -> list[dict[str, Any]]:
        """The lines of a log that read as JSON objects, oldest first."""
        try:
            text = (self.folder / name).read_text()
        except OSError:
            return []
        found = []
        for line in text.splitlines():
            with contextlib.suppress(ValueError):
                item = json.loads(line)
                if isinstance(item, dict):
                    found.append(item)
        return found

    def sanitizes(self) -> list[dict[str, Any]]:
        """The sanitize log: each sanitize's GPU, outcome and seconds per step."""
        return self.read_log("sanitize.jsonl")


def _trim(path: Path) -> None:
    """Keep the last LOG_KEPT lines of a log (rewritten whole)."""
    lines = path.read_text().splitlines(keepends=True)
    if len(lines) <= LOG_KEPT:
        return
    partial = path.with_suffix(".partial")
    partial.write_text("".join(lines[-LOG_KEPT:]))
    os.replace(partial, path)


def _unwritable(doing: str, exc: OSError) -> VmSandboxError:
    full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
    return (ResourceExhausted if full else FailedPrecondition)(
        f"{doing}: {exc.strerror or exc} ({exc.filename})",
        details={"errno": errno.errorcode.get(exc.errno or 0, str(exc.errno))},
    )


def each(bdfs: Iterable[str]) -> list[str]:
    """``bdfs`` once each, in order."""
    return list(dict.fromkeys(bdfs))
