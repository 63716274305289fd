"""Custody at work: GPUs given out and taken back under the host lock, and sanitized, reset and
checked outside it.

Every change of a record happens under the host lock, in milliseconds; the slow part (a
reset, the memory clear, the scrub hook: seconds to minutes) happens outside it, by a process
that first writes itself into the record as its ``worker`` (an owner file it keeps locked,
``vm.process.Ownership``). A worker that dies leaves the record ``sanitizing`` or
``resetting`` with a worker that reads as gone: the next ``run_pending`` (reconcile, the
health monitor) takes it up and does the whole job again. A GPU is never freed by a process
that did not see every step pass.

``release`` is what every path that lets GPUs go calls under the lock, right before it drops
the reservation that holds them (destroy, a failed create's undo, a failed claim's undo,
reconcile); it returns the GPUs to sanitize, which the caller hands to ``run_pending`` once
the lock is let go. With ``gpu_sanitize`` off a released GPU is free at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from vmsandbox.config import Config
from vmsandbox.errors import FailedPrecondition
from vmsandbox.gpu.fabric.lease import FabricLease
from vmsandbox.host.bdf import slot_of
from vmsandbox.host.sysfs import PciFunction
from vmsandbox.vm.process import Ownership, ProcessIdentity

from . import state
from .sanitize import Host, NotYet, Outcome, StepFailed, identify, sanitize
from .state import Custody, CustodyRefused
from .store import CustodyStore, each

Lock = Callable[[], contextlib.AbstractContextManager[None]]


@dataclass(frozen=True)
class Result:
    """How one GPU's sanitize or reset ended: its record after it, and the outcome (None when
    it could not begin: ``waiting`` says why)."""

    record: Custody
    outcome: Outcome | None = None
    waiting: str = ""


def assign_foreign(config: Config, bdf: str, uuid: str, domain: str) -> None:
    """Under the lock: a free GPU seen held by another tool's domain (``uuid``), assigned to
    it, so that it is sanitized once that domain lets it go. (A sandbox's GPUs are assigned
    by its reservation: sandbox/holds.py.)"""
    CustodyStore(config).change(
        bdf,
        lambda record: state.assigned(_described(record, [bdf], config), uuid, None),
        f"held by domain {domain}",
    )


def _described(record: Custody, functions: list[str], config: Config) -> Custody:
    """``record`` with the GPU's IOMMU group (from sysfs) and its card's other functions
    among ``functions``."""
    group = PciFunction(record.bdf, f"{config.pci_sysfs}/{record.bdf}").iommu_group
    slot = slot_of(record.bdf)
    companions = tuple(f for f in functions if f != record.bdf and slot_of(f) == slot)
    return replace(record, group=group, companions=companions or record.companions)


def release(
    config: Config, bdfs: Iterable[str], cause: str, partition: int | None = None
) -> list[str]:
    """Under the lock, before the reservation that holds ``bdfs`` (with Fabric Manager
    ``partition``) is dropped: each GPU goes to ``sanitizing`` (a suspect one to its
    automatic reset); the GPUs to work on now. Of the functions given (a reservation lists
    companions too) only those the store knows or sysfs says are GPUs are recorded."""
    store = CustodyStore(config)
    known = store.all()
    functions = each(bdfs)
    pending = []
    for bdf in functions:
        if bdf not in known and not _is_gpu(bdf, config):
            continue
        if not config.gpu_sanitize:
            store.change(bdf, _freed_unsanitized, f"{cause}; sanitizing is off")
            continue
        record = store.change(
            bdf,
            lambda r: state.released(_described(r, functions, config), partition),
            cause,
        )
        if record is not None and record.state in state.AT_WORK:
            pending.append(bdf)
    return pending


def _freed_unsanitized(record: Custody) -> Custody | None:
    if record.state not in (state.FREE, state.ASSIGNED):
        return None
    return record.moved(state.FREE, owner="", reason="")


def _is_gpu(bdf: str, config: Config) -> bool:
    try:
        identify(bdf, str(config.pci_sysfs))
    except StepFailed:
        return False
    return True


def host_of(config: Config) -> Host:
    """The host as the sanitize steps see it: ``config``'s sysfs, and Fabric Manager's
    partitions as this state directory's fabric ledger holds them (a partition with a lease
    is active)."""
    fabric = FabricLease(config)
    return Host(
        sysfs=str(config.pci_sysfs),
        partition_active=lambda p: any(lease.partition == p for lease in fabric.leases()),
    )


def waiting(config: Config) -> list[str]:
    """The GPUs left sanitizing or resetting by a worker that is gone (or none)."""
    return [
        bdf
        for bdf, record in CustodyStore(config).all().items()
        if record.state in state.AT_WORK and not record.worked_on
    ]


def run_pending(
    config: Config, lock: Lock, bdfs: Iterable[str] | None = None, host: Host | None = None
) -> list[Result]:
    """Sanitize (or reset) the GPUs waiting for it: ``bdfs``, or every one ``waiting``. Each
    is taken up under the lock, worked on outside it, and freed or quarantined (failed, for a
    reset) under it again as soon as it is done."""
    store = CustodyStore(config)
    wanted = each(bdfs) if bdfs is not None else waiting(config)
    if not wanted:
        return []
    owner = Ownership(config.state_dir / "owners")
    try:
        taken: list[Custody] = []
        with lock():
            for bdf in wanted:
                with contextlib.suppress(CustodyRefused):
                    record = store.change(
                        bdf, lambda r: state.taken_up(r, owner.identity), "taken up"
                    )
                    if record is not None:
                        taken.append(record)
        return [_work(config, lock, store, record, owner.identity, host) for record in taken]
    finally:
        owner.end()


def _work(
    config: Config,
    lock: Lock,
    store: CustodyStore,
    record: Custody,
    worker: ProcessIdentity,
    host: Host | None,
) -> Result:
    host = host or host_of(config)
    doing = record.state
    try:
        outcome = sanitize(record.bdf, record.partition, config, host)
    except NotYet as wait:
        with lock():
            left = store.change(record.bdf, _let_go(worker), f"waits: {wait}")
        return Result(left or store.get(record.bdf), waiting=str(wait))
    store.log(
        {
            "bdf": record.bdf,
            "doing": doing,
            "ok": outcome.ok,
            "steps": outcome.steps,
            "notes": outcome.notes,
            "failed": outcome.failed,
            "words": outcome.words,
            "seconds": round(outcome.seconds, 4),
        },
        "sanitize.jsonl",
    )
    with lock():
        done = store.change(
            record.bdf,
            _finish(worker, outcome),
            "passed" if outcome.ok else f"failed at {outcome.failed}",
        )
    return Result(done or store.get(record.bdf), outcome)


def _let_go(worker: ProcessIdentity) -> Callable[[Custody], Custody | None]:
    def let_go(record: Custody) -> Custody | None:
        if record.worker != worker:
            return None
        return replace(record, worker=None)

    return let_go


def _finish(worker: ProcessIdentity, outcome: Outcome) -> Callable[[Custody], Custody | None]:
    def finish(record: Custody) -> Custody | None:
        if record.worker != worker or record.state not in state.AT_WORK:
            return None  # taken from this worker meanwhile (a forced release)
        return state.finished(record, outcome.ok, outcome.words, outcome.steps)

    return finish


def check(
    config: Config,
    lock: Lock,
    bdf: str,
    held_by: Callable[[], str | None],
    *,
    automatic: bool = False,
    host: Host | None = None,
) -> Result:
    """Reset and re-check ``bdf`` now (an operator's ``gpus check``, or a suspect GPU's
    automatic reset): free when every step passes, failed otherwise. FAILED_PRECONDITION while
    a domain or reservation holds it (``held_by``, asked under the lock)."""
    store = CustodyStore(config)
    owner = Ownership(config.state_dir / "owners")
    try:
        with lock():
            holder = held_by()
            if holder is not None:
                raise FailedPrecondition(
                    f"GPU {bdf} is held by {holder}: destroy that sandbox first; its release "
                    "resets the GPU",
                    details={"bdf": bdf, "held_by": holder},
                )
            try:
                record = store.change(
                    bdf,
                    lambda r: state.checking(r, owner.identity, automatic=automatic),
                    "automatic reset" if automatic else "checked by an operator",
                )
            except CustodyRefused as exc:
                raise FailedPrecondition(str(exc), details={"bdf": bdf}) from exc
        assert record is not None
        return _work(config, lock, store, record, owner.identity, host)
    finally:
        owner.end()


def force_release(config: Config, lock: Lock, bdf: str, who: str) -> Custody:
    """An operator frees a GPU that is out, without a reset; logged with ``who``."""
    store = CustodyStore(config)
    with lock():
        before = store.get(bdf)
        try:
            record = store.change(bdf, state.forced_free, f"released by force by {who}")
        except CustodyRefused as exc:
            raise FailedPrecondition(str(exc), details={"bdf": bdf}) from exc
        store.log(
            {
                "bdf": bdf,
                "operator": who,
                "action": "release --force",
                "was": before.state,
                "reason_was": before.reason,
            }
        )
    assert record is not None
    return record
