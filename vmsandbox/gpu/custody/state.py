"""A GPU's custody between tenants: its states, the record kept of it, and what the allocator
may take.

::

    free -> assigned -> sanitizing -> free
                                   \\-> quarantined (the step's words)
    suspect (a reset-class fault)     -> resetting -> free | failed   (one automatic reset)
    quarantined (reason, since)       -> resetting -> free | failed   (``vmsandbox gpus check``)
    failed                            -> free only by ``vmsandbox gpus release --force``

- ``free``: allocatable. A GPU with no record is free.
- ``assigned``: given to a sandbox (its reservation holds it: sandbox/holds.py) or seen held
  by another tool's domain (``owner``: that domain's UUID, recorded); it goes back through
  ``sanitizing`` when released.
- ``sanitizing``: released, being reset, checked and cleared (``worker``: the process doing
  it; a record whose worker is gone is finished by the next reconcile or health pass).
- ``suspect``: a health signal whose cure is a reset was seen; it gets one automatic reset
  (``resetting``) once nothing holds it.
- ``quarantined``: a signal that a reset does not cure, a second reset-class fault within
  ``AUTO_RESET_WINDOW_S`` of the last automatic reset, or a failed sanitize: out until an
  operator checks it.
- ``resetting``: an automatic reset or an operator's check at work (``worker``).
- ``failed``: a reset or check did not bring it back: out until an operator releases it.

Only ``free`` GPUs are ever allocated (``is_allocatable``): the inventory carries each GPU's
state (``with_custody``) and the allocator leaves every other one out, naming why.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from vmsandbox.host.model import Gpu, Inventory
from vmsandbox.vm.process import ProcessIdentity

FREE = "free"
ASSIGNED = "assigned"
SANITIZING = "sanitizing"
SUSPECT = "suspect"
QUARANTINED = "quarantined"
RESETTING = "resetting"
FAILED = "failed"
STATES = (FREE, ASSIGNED, SANITIZING, SUSPECT, QUARANTINED, RESETTING, FAILED)
# Out until an operator acts (or, for suspect, the automatic reset runs).
OUT = (SUSPECT, QUARANTINED, FAILED)
# Worked on now by one process (``worker``).
AT_WORK = (SANITIZING, RESETTING)
AUTO_RESET_WINDOW_S = 24 * 3600.0  # one automatic reset per GPU in this long


def now_text() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def seconds_since(stamp: str, now: float | None = None) -> float:
    """Seconds since an ISO stamp of ``now_text``; infinity for an empty or bad one."""
    try:
        then = time.mktime(time.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ")) - time.timezone
    except (ValueError, OverflowError):
        return float("inf")
    return (time.time() if now is None else now) - then


@dataclass(frozen=True)
class Custody:
    """What the host remembers of one GPU (its PCI address ``bdf``)."""

    bdf: str
    state: str = FREE
    reason: str = ""  # why it is not free: the signal's or the failed step's words
    since: str = field(default_factory=now_text)  # when the state last changed
    owner: str = ""  # assigned: another tool's domain's UUID (a sandbox's is its reservation)
    group: int | None = None  # its IOMMU group
    companions: tuple[str, ...] = ()
    partition: int | None = None  # the Fabric Manager partition it was assigned with
    worker: ProcessIdentity | None = None  # sanitizing or resetting: who
    signal: str = ""  # the kind of signal that made it suspect or quarantined
    auto_reset_at: str = ""  # when its last automatic reset began
    steps: Mapping[str, float] = field(default_factory=dict)  # the last sanitize's seconds

    @property
    def worked_on(self) -> bool:
        """Whether a live process is sanitizing or resetting it now."""
        return self.state in AT_WORK and self.worker is not None and self.worker.alive()

    def moved(self, state: str, **changes: Any) -> Custody:
        """This record in ``state`` from now on (``since`` stamped)."""
        return replace(self, state=state, since=now_text(), **changes)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["companions"] = list(self.companions)
        data["worker"] = self.worker.to_dict() if self.worker else None
        data["steps"] = dict(self.steps)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Custody:
        worker = data.get("worker")
        state = str(data.get("state", FREE))
        if state not in STATES:
            raise ValueError(f"unknown custody state {state!r}")
        steps = data.get("steps") or {}
        return cls(
            bdf=str(data["bdf"]),
            state=state,
            reason=str(data.get("reason", "")),
            since=str(data.get("since", "")),
            owner=str(data.get("owner", "")),
            group=None if data.get("group") is None else int(data["group"]),
            companions=tuple(str(bdf) for bdf in data.get("companions") or ()),
            partition=None if data.get("partition") is None else int(data["partition"]),
            worker=ProcessIdentity.from_dict(worker) if isinstance(worker, dict) else None,
            signal=str(data.get("signal", "")),
            auto_reset_at=str(data.get("auto_reset_at", "")),
            steps={str(k): float(v) for k, v in dict(steps).items()},
        )


def shown_state(record: Custody | None, in_use_by: str | None) -> str:
    """The state ``vmsandbox gpus`` shows: a free GPU that a domain or a reservation holds
    is assigned, whatever its record says."""
    state = record.state if record is not None else FREE
    return ASSIGNED if state == FREE and in_use_by is not None else state


def is_allocatable(gpu: Gpu) -> bool:
    """Whether the allocator may take ``gpu``: its custody is free and nothing holds it."""
    return gpu.custody == FREE and gpu.in_use_by is None


def with_custody(inventory: Inventory, records: Mapping[str, Custody]) -> Inventory:
    """``inventory`` with each GPU's custody state, reason and since from ``records`` (by
    BDF): what the allocator, ``vmsandbox gpus`` and the capacity count read."""
    gpus = []
    for gpu in inventory.gpus:
        record = records.get(gpu.bdf)
        state = shown_state(record, gpu.in_use_by)
        reason = record.reason if record is not None and state != FREE else ""
        since = record.since if record is not None else ""
        gpus.append(replace(gpu, custody=state, custody_reason=reason, custody_since=since))
    return replace(inventory, gpus=tuple(gpus))


# -- what each event does to a record (pure: the store writes the result under the lock) ------


class CustodyRefused(Exception):
    """A transition the record's state does not allow (the words say why)."""


def assigned(record: Custody, owner: str, partition: int | None) -> Custody:
    """Given to the sandbox (or domain) ``owner``: only a free GPU is."""
    if record.state != FREE:
        raise CustodyRefused(f"GPU {record.bdf} is {record.state}, not free: it cannot be given")
    return record.moved(ASSIGNED, owner=owner, partition=partition, reason="", signal="")


def released(record: Custody, partition: int | None = None) -> Custody:
    """Its holder (assigned with Fabric Manager ``partition``) let it go: a free or assigned
    GPU is sanitized, a suspect one gets its automatic reset; one out for an operator stays
    out; one at work stays so."""
    if record.state in (FREE, ASSIGNED):
        return record.moved(SANITIZING, owner="", worker=None, partition=partition)
    if record.state == SUSPECT:
        return record.moved(
            RESETTING, owner="", worker=None, auto_reset_at=now_text(), partition=partition
        )
    return replace(record, owner="", partition=partition)


def taken_up(record: Custody, worker: ProcessIdentity) -> Custody:
    """``worker`` starts the work a sanitizing or resetting record waits for: refused while
    another live process does it."""
    if record.state not in AT_WORK:
        raise CustodyRefused(f"GPU {record.bdf} is {record.state}: nothing to sanitize")
    if record.worked_on and record.worker != worker:
        assert record.worker is not None
        raise CustodyRefused(f"GPU {record.bdf} is being {record.state} by pid {record.worker.pid}")
    return replace(record, worker=worker)


def finished(record: Custody, ok: bool, words: str, steps: Mapping[str, float]) -> Custody:
    """The sanitize or reset ended: free when it passed; else a sanitize's GPU is quarantined
    and a reset's has failed, with the step's words."""
    if ok:
        return record.moved(FREE, reason="", signal="", worker=None, steps=dict(steps))
    state = QUARANTINED if record.state == SANITIZING else FAILED
    return record.moved(state, reason=words, signal="sanitize", worker=None, steps=dict(steps))


def signalled(record: Custody, kind: str, words: str, reset_cures: bool) -> Custody | None:
    """A health signal about the GPU; None when it changes nothing (a GPU already out keeps
    its first reason; one being reset right now is judged by its own checks). A fault a reset
    cures makes it suspect, once per AUTO_RESET_WINDOW_S; any other quarantines it."""
    if record.state in (QUARANTINED, FAILED, *AT_WORK):
        return None
    if record.state == SUSPECT and reset_cures:
        return None
    recent = seconds_since(record.auto_reset_at) < AUTO_RESET_WINDOW_S
    if reset_cures and not recent:
        return record.moved(SUSPECT, reason=words, signal=kind)
    if reset_cures:
        words += "; a second fault within a day of its automatic reset: an operator checks it"
    return record.moved(QUARANTINED, reason=words, signal=kind)


def checking(record: Custody, worker: ProcessIdentity, *, automatic: bool) -> Custody:
    """A reset and re-check begins: the automatic one of a suspect GPU, or an operator's of a
    GPU that is not assigned."""
    if record.state == ASSIGNED:
        raise CustodyRefused(f"GPU {record.bdf} is assigned to {record.owner}: release it first")
    if record.worked_on:
        raise CustodyRefused(f"GPU {record.bdf} is already being {record.state}")
    stamp = now_text() if automatic else record.auto_reset_at
    return record.moved(RESETTING, worker=worker, auto_reset_at=stamp)


def forced_free(record: Custody) -> Custody:
    """An operator's release of a GPU that is out: free without a reset (the host was power
    cycled, the GPU replaced). Never of one that is assigned or at work."""
    if record.state == ASSIGNED or record.worked_on:
        raise CustodyRefused(
            f"GPU {record.bdf} is {record.state}: only a GPU that is out is released by force"
        )
    return record.moved(FREE, reason="", signal="", worker=None, owner="")
