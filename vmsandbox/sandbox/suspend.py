"""Suspend: a running sandbox's memory saved to disk with libvirt's managed save, its QEMU
ended, its GPUs given back; and what a suspend or resume that was killed or failed halfway is
settled into (``settle``).

A suspend runs, each transition under the host lock and the slow work outside it:

1. under the lock: the sandbox's hold taken by this call (``doing`` "suspend") with the disk
   its save may take counted (``saved_bytes``: its memory), refused with RESOURCE_EXHAUSTED
   when the saves of the host would pass ``max_saved_gib``; the record stored ``suspending``
   with what a resume needs (suspension.py: its GPUs by model and guest slot);
2. GPU sandboxes: the guest lets its GPUs go (guest/quiesce.py: CUDA processes checkpointed,
   the driver unloaded; processes that still hold a GPU make it FAILED_PRECONDITION naming
   them, unless ``force`` ends them); the GPUs are detached (handover.py); in shared NVSwitch
   mode their Fabric Manager partition is then deactivated and its lease forgotten (fmpm,
   outside the lock: the guest no longer has its GPUs); under the lock the GPUs are released
   as a destroy releases them (teardown.release_gpus) and the hold and the record stop naming
   the partition (the suspension keeps its size); then the GPUs are sanitized;
3. the memory saved (``Hypervisor.save``), once the guest's control
   channel is served (``wait_for_control``: a sandbox suspended right after its create may
   still be starting the program that serves it, and its resume would wait for a wake the
   saved guest cannot answer);
4. under the lock: the hold settled with the save's size, the record stored ``suspended``.

A suspend that fails is settled at once (``settle``): a guest that still runs goes back to
ready (its GPUs are those it still holds; a quiesce that failed restored what it checkpointed),
one whose memory was saved is suspended. Reconcile settles those whose process was killed the
same way, and never takes a suspended sandbox or its save apart.

The partition's lease is the last thing to go and the first to come: it is deactivated only
once no GPU of it is in the guest, and its hold keeps naming it until then, so a lease is never
an orphan while its GPUs may be in a guest. A settled sandbox whose guest holds none of its
GPUs names no partition (``settle``); a lease left for it (FM unreachable, a process killed
between the deactivation and the commit, a resume that failed after its activation) is then
one its hold does not explain, which ``recover`` deactivates at once and reconcile's fabric
pass otherwise. Its GPUs wait, sanitizing, until that lease is gone.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import replace

from vmsandbox.config import Config
from vmsandbox.errors import FailedPrecondition, ResourceExhausted, VmSandboxError
from vmsandbox.gpu.custody.work import release
from vmsandbox.gpu.fabric.lease import FabricLease
from vmsandbox.guest import ssh
from vmsandbox.progress import Progress
from vmsandbox.sandbox import handover
from vmsandbox.sandbox.holds import SAVES, Hold, Holds, own
from vmsandbox.sandbox.record import (
    STATE_READY,
    STATE_STOPPED,
    STATE_SUSPENDED,
    STATE_SUSPENDING,
    SandboxFiles,
    SandboxRecord,
)
from vmsandbox.sandbox.store import Found, SandboxStore
from vmsandbox.sandbox.teardown import hold_of, release_gpus, sanitize_released
from vmsandbox.vm.domain import CONTROL_PORT
from vmsandbox.vm.hypervisor import Hypervisor
from vmsandbox.vm.process import Ownership

Lock = Callable[[], contextlib.AbstractContextManager[None]]
MIB = 2**20
GIB = 2**30
# States a sandbox may be suspended from: its guest runs and a caller may use it.
SUSPENDABLE = (STATE_READY, "started", "failed")
# How long a save waits for the guest to open its control channel's port (its program starts
# right after sshd), and how often it looks.
CONTROL_WAIT_S = 30.0
CONTROL_POLL_S = 0.1


def now_utc() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def suspend(
    store: SandboxStore,
    lock: Lock,
    found: Found,
    *,
    force: bool = False,
    progress: Progress,
    guest_run: handover.GuestRun = ssh.run,
) -> Found:
    """Suspend the sandbox of ``found`` (module docstring); idempotent for one suspended
    already. FAILED_PRECONDITION for a sandbox whose guest does not run (or is not ours to
    suspend), RESOURCE_EXHAUSTED past ``max_saved_gib``."""
    hypervisor, config = store.hypervisor, store.config
    record = found.record
    if found.state == STATE_SUSPENDED and not hypervisor.running(record.domain, uuid=found.uuid):
        return found
    check_suspendable(store, found)
    if record.gpus:
        handover.check_detachable(record)
    owner = own(config)
    try:
        with lock():
            found = _begin(store, found, owner)
        try:
            found = _save(store, lock, found, owner, force, progress, guest_run)
        except BaseException as exc:
            recover(hypervisor, config, lock, found.uuid, owner)
            if isinstance(exc, Exception) and not getattr(exc, "__notes__", None):
                exc.add_note(f"sandbox {record.name!r} was left {_state_now(store, found)}")
            raise
    finally:
        owner.end()
    return found


def check_suspendable(store: SandboxStore, found: Found) -> None:
    """FAILED_PRECONDITION for a sandbox that is not ours, does not run, or is in a
    transition (creating, pooled, suspending, resuming)."""
    record, name = found.record, found.record.name
    if not store.local(record):
        raise FailedPrecondition(
            f"sandbox {name!r} was made with another state directory; suspend it there",
            details={"name": name},
        )
    shown = store.view(record, found.state, found.uuid).state
    if shown not in SUSPENDABLE or not store.hypervisor.running(record.domain, uuid=found.uuid):
        why = (
            f"it does not run; start it with 'vmsandbox start {name}'"
            if shown == STATE_STOPPED
            else f"it is {shown}"
        )
        raise FailedPrecondition(
            f"sandbox {name!r} cannot be suspended: {why}",
            details={"name": name, "state": shown},
        )


def saved_total(holds: dict[str, Hold], but: str = "") -> int:
    """The bytes the host's saved memory takes (or may take, for a save at work), of every
    hold but ``but``."""
    return sum(hold.saved_bytes for uuid, hold in holds.items() if uuid != but)


def _begin(store: SandboxStore, found: Found, owner: Ownership) -> Found:
    """Under the lock: the hold taken with the save's room counted, the record suspending."""
    config, record = store.config, found.record
    holds = Holds(config)
    current = holds.all()
    hold = current.get(found.uuid) or hold_of(record, found.uuid)
    if hold.busy:
        raise FailedPrecondition(
            f"sandbox {record.name!r} is busy: a {hold.doing or 'call'} is at work on it",
            details={"name": record.name, "doing": hold.doing},
        )
    need = record.memory_mib * MIB
    limit = config.max_saved_gib * GIB
    used = saved_total(current, but=found.uuid)
    if used + need > limit:
        raise ResourceExhausted(
            f"sandbox {record.name!r} cannot be suspended: its memory ({record.memory_mib} MiB) "
            f"would take the host's saved memory past max_saved_gib = {config.max_saved_gib} "
            f"(saves take {used / GIB:.1f} GiB now); resume or destroy a suspended sandbox",
            details={"name": record.name, "used_bytes": used, "limit_bytes": limit},
        )
    holds.put(replace(hold, owner=owner.identity, doing="suspend", saved_bytes=need))
    definition = store.hypervisor.definition(record.domain, uuid=found.uuid)
    kept = handover.suspension(record, definition, now_utc())
    return store.commit(found, lambda now: replace(now, suspended=kept), STATE_SUSPENDING)


def _save(
    store: SandboxStore,
    lock: Lock,
    found: Found,
    owner: Ownership,
    force: bool,
    progress: Progress,
    guest_run: handover.GuestRun,
) -> Found:
    """Outside the lock but for the commits: the GPUs handed back, the memory saved."""
    hypervisor, config = store.hypervisor, store.config
    record = found.record
    assert record.suspended is not None  # written by _begin
    if record.gpus:
        files = SandboxFiles.of(config, record.stem)
        run = handover.guest_runner(guest_run, record, files)
        progress(f"letting the GPUs of {record.name} go in the guest")
        report = handover.let_go(run, record, force=force)
        with lock():
            kept = replace(record.suspended, guest=report)
            found = store.commit(found, lambda now: replace(now, suspended=kept))
        handover.detach(hypervisor, record.domain, found.uuid, kept, record.gpus, progress)
        deactivated = _deactivate(config, found.uuid, record, progress)
        released = tuple(bdf for gpu in record.gpus for bdf in (gpu.bdf, *gpu.companions))
        with lock():
            _release(config, found.uuid, owner, record.name, deactivated)
            found = store.commit(found, lambda now: replace(now, gpus=(), fabric_partition=None))
        for line in sanitize_released(config, lock, released):
            progress(line)
    wait_for_control(hypervisor, record.domain, found.uuid, record.name, progress)
    progress(f"saving the memory of {record.name} ({record.memory_mib} MiB)")
    hypervisor.save(record.domain, uuid=found.uuid)
    size = hypervisor.saved(record.domain, uuid=found.uuid) or 0
    with lock():
        holds = Holds(config)
        hold = holds.get(found.uuid)
        if hold is not None and hold.owned_by(owner.identity):
            holds.put(replace(hold, owner=None, doing="", saved_bytes=size))
        done = replace(found.record.suspended or record.suspended, save_bytes=size)
        found = store.commit(found, lambda now: replace(now, suspended=done), STATE_SUSPENDED)
    progress(f"{record.name} is suspended ({size / MIB:.0f} MiB saved)")
    return found


def wait_for_control(
    hypervisor: Hypervisor, domain: str, uuid: str, name: str, progress: Progress
) -> None:
    """Before a save: wait (up to CONTROL_WAIT_S) until the guest has its control channel's
    port open, so that the restored guest answers the resume's ``wake`` at once. Nothing to
    wait for when the domain has no channel or libvirt does not know; when the wait runs out
    the guest is saved all the same (its resume then sets the clock over SSH)."""
    deadline = time.monotonic() + CONTROL_WAIT_S
    said = False
    while hypervisor.channel_state(domain, CONTROL_PORT, uuid=uuid) == "disconnected":
        if time.monotonic() >= deadline:
            progress(f"{name}'s guest did not open its control channel; saving it as it is")
            return
        if not said:
            progress(f"waiting for {name}'s guest to serve its control channel (still starting)")
            said = True
        time.sleep(CONTROL_POLL_S)


def _deactivate(config: Config, uuid: str, record: SandboxRecord, progress: Progress) -> bool:
    """Shared NVSwitch mode, once the GPUs are out of the guest: the sandbox's partition
    deactivated and its lease forgotten, outside the lock (fmpm is slow); whether that is
    done (True without a partition). When Fabric Manager cannot do it the suspend goes on:
    the lease stays, no longer explained by the hold once it is settled, for reconcile to
    deactivate, and the GPUs wait for it, sanitizing."""
    partition = record.fabric_partition
    if partition is None:
        return True
    progress(f"deactivating Fabric Manager partition {partition}")
    try:
        FabricLease(config).release(uuid, record.name)
    except VmSandboxError as exc:
        progress(
            f"Fabric Manager partition {partition} stays active for now ({exc.message}); "
            "reconcile deactivates it, and its GPUs are sanitized once it has"
        )
        return False
    return True


def _release(config: Config, uuid: str, owner: Ownership, name: str, deactivated: bool) -> None:
    """Under the lock: the hold (still this call's) lets its GPUs and its partition go."""
    holds = Holds(config)
    hold = holds.get(uuid)
    if hold is None or not hold.owned_by(owner.identity):
        raise FailedPrecondition(f"sandbox {uuid} was taken over while it was being suspended")
    release_gpus(holds, hold, f"sandbox {name} ({uuid}) suspended", deactivated=deactivated)


def _state_now(store: SandboxStore, found: Found) -> str:
    now = store.by_domain(found.record.domain, found.uuid)
    return "removed" if now is None else store.view(now.record, now.state, now.uuid).state


def recover(
    hypervisor: Hypervisor, config: Config, lock: Lock, uuid: str, owner: Ownership
) -> None:
    """After a suspend or resume of ``owner`` failed: the sandbox settled (``settle``), under
    the lock; then, outside it, the partitions leased to it that its settled hold no longer
    names deactivated (``stale_leases``: its guest holds none of their GPUs), and the GPUs
    the settle let go sanitized. What fails here is left for reconcile (the hold stays this
    call's, whose process is about to end; a lease stays in the ledger)."""
    released: tuple[str, ...] = ()
    stale: list[int] = []
    with contextlib.suppress(Exception), lock():
        before = Holds(config).get(uuid)
        settle(hypervisor, config, uuid, owner=owner)
        after = Holds(config).get(uuid)
        kept = set(after.gpus) if after is not None else set()
        released = tuple(bdf for bdf in (before.gpus if before else ()) if bdf not in kept)
        stale = stale_leases(config, uuid)
    with contextlib.suppress(Exception):
        FabricLease(config).release_orphans(stale)
    with contextlib.suppress(Exception):
        sanitize_released(config, lock, released)


def stale_leases(config: Config, uuid: str) -> list[int]:
    """Under the lock: the partitions leased to sandbox ``uuid`` that its settled hold does
    not name (none while a call is at work on it). Deactivating them outside the lock is
    safe: a leased partition counts as taken for every allocation, so none of them can be
    reserved again before its lease is gone."""
    hold = Holds(config).get(uuid)
    if hold is None or hold.owner is not None:
        return []
    leased = [lease.partition for lease in FabricLease(config).leases() if lease.uuid == uuid]
    return [partition for partition in leased if partition != hold.partition]


def settle(
    hypervisor: Hypervisor, config: Config, uuid: str, *, owner: Ownership | None = None
) -> str | None:
    """Under the lock: a sandbox whose suspend or resume ended halfway (its hold's ``doing``
    in SAVES, owned by ``owner`` or, without one, by a process that is gone) brought to a
    clear state, which is returned (None: nothing to settle):

    - its memory saved and the guest off: ``suspended``, no GPU and no Fabric Manager
      partition held (any a resume reserved or attached are let go: the saved guest holds
      none);
    - its guest running: ``ready`` with the GPUs it holds now (those the guest still has),
      and its partition only while the guest has one of them; the suspension forgotten;
    - neither: the guest is off without a save (it crashed): stored ``ready``, shown
      stopped, its GPUs kept as a stopped sandbox keeps them.
    """
    holds = Holds(config)
    hold = holds.get(uuid)
    if hold is None or hold.doing not in SAVES or hold.owner is None:
        return None
    if owner is not None and not hold.owned_by(owner.identity):
        return None
    if owner is None and not hold.left_over:
        return None
    stored = hypervisor.metadata(hold.domain, uuid=uuid)
    if stored is None or stored.data is None:
        holds.put(replace(hold, owner=None, doing=""))
        return None
    record = SandboxRecord.from_dict(stored.data)
    store = SandboxStore(hypervisor, config)
    size = hypervisor.saved(hold.domain, uuid=uuid)
    running = hypervisor.running(hold.domain, uuid=uuid)
    if size is not None and not running:  # never restored since: no GPU was attached
        kept = record.suspended
        if kept is not None and record.gpus and not kept.gpus:
            kept = replace(kept, gpus=record.gpus)
        if kept is not None:
            kept = replace(kept, save_bytes=size)
        hold = release_gpus(holds, hold, f"sandbox {hold.name} ({uuid}) saved, GPUs let go")
        holds.put(replace(hold, owner=None, doing="", saved_bytes=size))
        left = replace(record, gpus=(), fabric_partition=None, suspended=kept)
        store.put(left, STATE_SUSPENDED, uuid)
        return STATE_SUSPENDED
    attached = handover.attached(hypervisor, hold.domain)
    gpus = tuple(gpu for gpu in record.gpus if gpu.bdf in attached)
    held = tuple(bdf for bdf in hold.gpus if bdf in attached)
    dropped = [bdf for bdf in hold.gpus if bdf not in attached]
    if dropped:  # reserved by a resume and never attached, or already out of the guest
        release(config, dropped, f"sandbox {hold.name} ({uuid}) runs without them", hold.partition)
    partition = hold.partition if held else None  # its lease: kept while the guest has a GPU
    holds.put(replace(hold, gpus=held, partition=partition, owner=None, doing="", saved_bytes=0))
    fabric = record.fabric_partition if gpus else None
    ready = replace(record, gpus=gpus, fabric_partition=fabric, suspended=None, starter=None)
    store.put(ready, STATE_READY, uuid)
    return STATE_READY
