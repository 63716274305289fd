"""A sandbox's lifetime: when it ends (``create --ttl``), pushing that later (``extend``), and
destroying the sandboxes whose time is up (``reap``).

The end is kept in the sandbox's record (``expires_at``, UTC), in libvirt like the rest of it, so
it survives restarts of every process; nothing counts down in memory. ``vmsandbox serve`` reaps
on its own every REAP_EVERY_S; hosts without it run ``vmsandbox reap`` from the systemd timer
shipped in ``systemd/``.

Reaping deletes, so it follows the rule of every sweep that deletes: it acts on a complete view
only. A libvirt error while listing aborts it before anything is destroyed; a record whose
expiry cannot be read is never taken for an expired one.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from vmsandbox.errors import FailedPrecondition, NotFound, VmSandboxError
from vmsandbox.sandbox.expiry import now, parse, seconds_left, stamp
from vmsandbox.sandbox.handle import Sandbox
from vmsandbox.sandbox.store import SandboxStore
from vmsandbox.validate import check_duration

REAP_EVERY_S = 60.0  # how often ``vmsandbox serve`` reaps
log = logging.getLogger("vmsandbox.reap")

Lock = Callable[[str], contextlib.AbstractContextManager[None]]


def extend(store: SandboxStore, lock: Lock, name: str, seconds: float) -> Sandbox:
    """Push sandbox ``name``'s expiry ``seconds`` later (from now, if it has already passed);
    FAILED_PRECONDITION for a sandbox without a lifetime, which is never reaped."""
    seconds = check_duration(seconds, "duration")
    with lock("extend a sandbox's lifetime"):
        found = store.require(name)
        end = parse(found.record.expires_at) if found.record.expires_at else None
        if end is None:
            raise FailedPrecondition(
                f"sandbox {name!r} has no lifetime to extend: it lives until destroyed "
                "(create it with --ttl to give it one)",
                details={"name": name, "expires_at": found.record.expires_at},
            )
        expires_at = stamp(max(end, now()) + timedelta(seconds=seconds))
        return store.update(name, uuid=found.uuid, expires_at=expires_at)


@dataclass
class Reaped:
    """What one reap did: the sandboxes destroyed, and those it could not destroy, why."""

    destroyed: list[str] = field(default_factory=list)
    failed: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> error (to_dict)

    def to_dict(self) -> dict[str, Any]:
        return {"destroyed": list(self.destroyed), "failed": dict(self.failed)}


def reap(
    store: SandboxStore,
    destroy: Callable[[str, str], None],
    at: datetime | None = None,
) -> Reaped:
    """Destroy this state directory's sandboxes whose lifetime has ended by ``at`` (now), each
    by its identity (``destroy(name, uuid)``), so a later sandbox of the same name is never
    taken. Any error listing the sandboxes propagates before anything is destroyed; a sandbox
    that cannot be destroyed is reported and the others are still reaped."""
    moment = at or now()
    expired = [
        found
        for found in store.found()  # raises on a libvirt error: nothing is destroyed on a guess
        if store.local(found.record)  # another state directory's sandboxes are its own reaper's
        and seconds_left(found.record.expires_at, moment) == 0.0
    ]
    reaped = Reaped()
    for found in expired:
        name = found.record.name
        try:
            current = store.require(name, found.uuid)
            if seconds_left(current.record.expires_at, now()) != 0.0:
                continue  # extended since it was listed
            destroy(name, found.uuid)
        except NotFound:
            continue  # destroyed meanwhile by someone else
        except VmSandboxError as exc:
            reaped.failed[name] = exc.to_dict()
            continue
        reaped.destroyed.append(name)
    return reaped


class Reaper:
    """A thread that calls ``reap_once`` every ``every`` seconds until ``close``, logging what
    it destroyed and any error (a failed round is tried again next time; it never stops the
    thread). ``vmsandbox serve`` runs one."""

    def __init__(self, reap_once: Callable[[], Reaped], every: float = REAP_EVERY_S) -> None:
        self._reap_once = reap_once
        self._every = every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vmsandbox-reaper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            try:
                reaped = self._reap_once()
            except VmSandboxError as exc:
                log.warning("reap skipped: %s: %s", exc.code, exc.message)
                continue
            except Exception:
                log.exception("reap failed")
                continue
            for name in reaped.destroyed:
                log.info("reaped sandbox %s: its lifetime ended", name)
            for name, error in reaped.failed.items():
                log.warning("could not reap sandbox %s: %s", name, error.get("message"))

    def close(self) -> None:
        """Stop; a round under way finishes first."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
