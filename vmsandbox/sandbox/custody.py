"""Where a sandbox's life meets its GPUs' custody (``vmsandbox.gpu.custody``): the GPUs given
to a sandbox with its reservation, taken back before the reservation is dropped, and sanitized
before anyone may take them again.

- A GPU in a reservation (holds.py) is assigned to its sandbox: the reservation, written under
  the lock in the same step as the choice, is the record of it. When the reservation is
  dropped (destroy, reconcile, a failed create's or claim's undo), ``Holds.drop`` marks its
  GPUs ``sanitizing`` first, under the same hold of the lock; the caller, once the lock is
  let go, hands them to ``sanitize``.
- ``sanitize``: the sanitize of each GPU, outside the lock; a GPU that fails a step is
  quarantined with the step's words (never an error of the call that released it: the
  sandbox is gone either way).
- ``reconcile``: GPUs left ``sanitizing`` by a process that died are sanitized again from the
  start; GPUs still ``assigned`` to a sandbox that is neither a reservation nor a domain any
  more are released and sanitized; GPUs another tool's domain holds are recorded as
  ``assigned`` to it, so that they are sanitized once it lets them go.
- ``held_by``: who holds a GPU now (a reservation or any domain), read under the lock, for an
  operator's ``gpus check``.

A stop keeps a sandbox's GPUs (the same tenant starts it again): it releases nothing.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from vmsandbox.config import Config
from vmsandbox.errors import VmSandboxError
from vmsandbox.gpu.custody import state, work
from vmsandbox.gpu.custody.sanitize import StepFailed, identify
from vmsandbox.gpu.custody.store import CustodyStore
from vmsandbox.sandbox.holds import Holds

if TYPE_CHECKING:
    from vmsandbox.host.model import Inventory
    from vmsandbox.progress import Progress
    from vmsandbox.vm.hypervisor import Hypervisor, Stored

Lock = Callable[[], contextlib.AbstractContextManager[None]]
log = logging.getLogger(__name__)


def shown(config: Config, inventory: Inventory) -> Inventory:
    """``inventory`` with each GPU's custody state and reason, from the records now."""
    return state.with_custody(inventory, CustodyStore(config).all())


def sanitize(
    config: Config, lock: Lock, bdfs: Iterable[str], progress: Progress | None = None
) -> list[str]:
    """Outside the lock: sanitize ``bdfs``; what went wrong, one line per GPU (quarantined,
    or waiting for its partition to be deactivated)."""
    wanted = list(bdfs)
    if not wanted:
        return []
    said: list[str] = []
    try:
        results = work.run_pending(config, lock, wanted)
    except VmSandboxError as exc:  # the lock: the GPUs stay sanitizing, for reconcile
        return [f"GPUs {', '.join(wanted)} are left sanitizing for reconcile: {exc.message}"]
    for result in results:
        record = result.record
        if result.waiting:
            said.append(f"GPU {record.bdf} waits to be sanitized: {result.waiting}")
        elif record.state != state.FREE:
            said.append(f"GPU {record.bdf} is {record.state}: {record.reason}")
        elif progress is not None and result.outcome is not None:
            steps = ", ".join(f"{k} {v:.2f}s" for k, v in result.outcome.steps.items())
            progress(f"GPU {record.bdf} sanitized ({steps})")
    for line in said:
        log.info("%s", line)
        if progress is not None:
            progress(line)
    return said


def held_by(config: Config, hypervisor: Hypervisor, bdf: str) -> str | None:
    """Under the lock: the reservation or domain holding ``bdf`` (or a function of its card
    or group), None when nothing does."""
    record = CustodyStore(config).get(bdf)
    functions = {bdf, *record.companions}
    for hold in Holds(config).all().values():
        if functions & set(hold.gpus):
            return f"sandbox {hold.name} ({hold.uuid})"
    holders = hypervisor.hostdev_holders()
    return next((f"domain {holders[f]}" for f in sorted(functions) if f in holders), None)


def reconcile(config: Config, lock: Lock, domains: Iterable[Stored]) -> list[str]:
    """Custody's part of reconcile (module docstring), given every domain (the view read
    before the lock); what went wrong, one line per GPU."""
    listed = list(domains)
    store = CustodyStore(config)
    pending: list[str] = []
    with lock():
        holds = Holds(config).all()
        alive = set(holds) | {stored.uuid for stored in listed}
        for bdf, record in store.all().items():
            if record.state == state.ASSIGNED and record.owner not in alive:
                pending += work.release(config, [bdf], f"reconcile: {record.owner} is gone")
        held = {bdf for hold in holds.values() for bdf in hold.gpus}
        for stored in listed:
            if stored.uuid in holds:
                continue
            for bdf in stored.hostdevs:
                if bdf not in held and _foreign_gpu(config, store, bdf):
                    work.assign_foreign(config, bdf, stored.uuid, stored.domain)
    return sanitize(config, lock, [*pending, *work.waiting(config)])


def _foreign_gpu(config: Config, store: CustodyStore, bdf: str) -> bool:
    """Whether ``bdf`` is a free GPU (by its record and by sysfs)."""
    if store.get(bdf).state != state.FREE:
        return False
    try:
        identify(bdf, str(config.pci_sysfs))
    except StepFailed:
        return False
    return True
