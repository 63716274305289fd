"""Resume: a suspended sandbox's memory restored, its guest woken, its GPUs taken again.

A resume runs, each transition under the host lock and the slow work outside it:

1. GPU sandboxes, outside the lock: the host's GPUs read (inventory, fabric); under the lock,
   free GPUs of the model and count it had (any host address) reserved in its hold, or
   RESOURCE_EXHAUSTED with the sandbox left suspended, nothing lost; in shared NVSwitch mode
   they are the GPUs of a free Fabric Manager partition of the size it had, chosen by the
   fabric policy as a create's are (gpu/fabric/policy.py), and the partition is reserved too;
2. under the lock: the hold taken by this call (``doing`` "resume"), the record ``resuming``
   with the new GPUs (and partition);
3. shared NVSwitch mode: the partition activated (its lease written first, the image's NVIDIA
   driver checked against Fabric Manager's release, as a create's fabric step does);
4. the memory restored (``Hypervisor.start`` of a domain with a managed save); the guest
   woken: its clock set to the host's and its random number generator reseeded from bytes
   the host drew (the control channel's ``wake``, or over SSH for guests without it), beside
   the VM generation ID libvirt changed (genid); and sshd answering;
5. GPU sandboxes: each GPU attached at its old guest slot (handover.py), seen by the guest,
   taken up (driver loaded, checkpointed processes restored with the old-to-new GPU map:
   guest/quiesce.py) and verified as a create verifies;
6. under the lock: the hold settled (no saved bytes), the record ``ready``, the suspension
   forgotten.

A resume that fails is settled at once as suspend.py's ``settle`` says: a guest that runs is
ready with the GPUs it holds, one still saved stays suspended with no GPU held; a partition it
activated whose GPUs the guest does not hold is deactivated again (suspend.py's ``recover``).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import NamedTuple

from vmsandbox.config import Config
from vmsandbox.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    Unavailable,
    VmSandboxError,
)
from vmsandbox.gpu.record import GpuRecord
from vmsandbox.guest import control, ssh
from vmsandbox.host.model import Inventory
from vmsandbox.progress import Progress
from vmsandbox.sandbox import boot, create, handover, reserve, resume_gpus
from vmsandbox.sandbox.holds import Holds, own
from vmsandbox.sandbox.record import (
    STATE_READY,
    STATE_RESUMING,
    STATE_SUSPENDED,
    SandboxFiles,
    SandboxRecord,
)
from vmsandbox.sandbox.store import Found, SandboxStore
from vmsandbox.sandbox.suspend import recover
from vmsandbox.sandbox.suspension import Suspension
from vmsandbox.vm import netguard
from vmsandbox.vm.domain import CONTROL_PORT
from vmsandbox.vm.hypervisor import Hypervisor
from vmsandbox.vm.process import Ownership

Lock = Callable[[], contextlib.AbstractContextManager[None]]
Inventories = Callable[[Mapping[str, str]], Inventory]
# How long a restored guest may take to answer SSH (it was running: seconds, not a boot).
SSH_TIMEOUT_S = 120.0
# How long a resume tries its first SSH command before it falls back to the boot wait, and
# how often.
QUICK_S = 10.0
QUICK_POLL_S = 0.1
WAKE_S = 2.0  # how long the control channel's ``wake`` may take (``_woken``)
# How long a restored guest's channel may read "disconnected" before it is taken for closed
# (``_channel_open``), and how often it is read again meanwhile.
CHANNEL_WAIT_S = 0.5
CHANNEL_POLL_S = 0.02


def resume(
    store: SandboxStore,
    lock: Lock,
    found: Found,
    progress: Progress,
    inventory: Inventories,
    guest_run: handover.GuestRun = ssh.run,
    verify: bool = True,
) -> Found:
    """Resume the suspended sandbox of ``found`` (module docstring); the sandbox as stored,
    its ``boot_seconds`` the seconds from the restore until SSH answered. Idempotent for a
    sandbox that runs (nothing done). FAILED_PRECONDITION for one that is not suspended."""
    hypervisor, config = store.hypervisor, store.config
    record = found.record
    if hypervisor.running(record.domain, uuid=found.uuid) and found.state != STATE_SUSPENDED:
        return found
    check_resumable(store, found)
    held = record.suspended
    assert held is not None  # check_resumable
    view = None
    if held.gpus:
        view = reserve.look(hypervisor, config, True, inventory)
    owner = own(config)
    stage: list[str] = []  # "attaching" once restored with GPUs to attach, until taken up
    try:
        with lock():
            found = _begin(store, found, owner, view)
        try:
            return _restore(store, lock, found, held, progress, guest_run, verify, owner, stage)
        except BaseException as exc:
            if stage == ["attaching"]:  # the guest never took a GPU up: it can be saved again
                _save_again(store, found, held, exc)
            recover(hypervisor, config, lock, found.uuid, owner)
            raise
    finally:
        owner.end()


def check_resumable(store: SandboxStore, found: Found) -> None:
    """FAILED_PRECONDITION for a sandbox that is not suspended (or not ours)."""
    record, name = found.record, found.record.name
    if not store.local(record):
        raise FailedPrecondition(
            f"sandbox {name!r} was made with another state directory; resume it there",
            details={"name": name},
        )
    saved = store.hypervisor.saved(record.domain, uuid=found.uuid)
    if found.state != STATE_SUSPENDED or record.suspended is None or saved is None:
        shown = store.view(record, found.state, found.uuid).state
        raise FailedPrecondition(
            f"sandbox {name!r} is not suspended (it is {shown}); 'vmsandbox suspend {name}' "
            "suspends it",
            details={"name": name, "state": shown},
        )


def _begin(
    store: SandboxStore, found: Found, owner: Ownership, view: reserve.HostView | None
) -> Found:
    """Under the lock: the hold taken (with new GPUs reserved), the record resuming."""
    config, record = store.config, found.record
    held = record.suspended
    assert held is not None
    holds = Holds(config)
    hold = holds.get(found.uuid)
    if hold is None or hold.busy:
        raise FailedPrecondition(
            f"sandbox {record.name!r} is busy: a {hold.doing if hold else 'call'} is at work on it",
            details={"name": record.name},
        )
    gpus: tuple[GpuRecord, ...] = ()
    partition: int | None = None
    if view is not None:
        gpus, partition = resume_gpus.reserve_for(config, record, held, view, holds)
    functions = tuple(bdf for gpu in gpus for bdf in (gpu.bdf, *gpu.companions))
    holds.put(
        replace(hold, gpus=functions, partition=partition, owner=owner.identity, doing="resume")
    )
    return store.commit(
        found, lambda now: replace(now, gpus=gpus, fabric_partition=partition), STATE_RESUMING
    )


def _restore(
    store: SandboxStore,
    lock: Lock,
    found: Found,
    held: Suspension,
    progress: Progress,
    guest_run: handover.GuestRun,
    verify: bool,
    owner: Ownership,
    stage: list[str],
) -> Found:
    hypervisor, config = store.hypervisor, store.config
    record = found.record
    files = SandboxFiles.of(config, record.stem)
    resume_gpus.activate(config, record, found.uuid, progress)
    netguard.before_start(config)
    progress(f"restoring the memory of {record.name}")
    started = time.monotonic()
    hypervisor.start(record.domain, uuid=found.uuid)
    control.restrict(files.control)
    waited = reach(hypervisor, config, record, found.uuid, guest_run, progress, started).seconds
    progress(f"{record.name} answers SSH {waited:.2f} s after the restore, its clock set")
    report = None
    if record.gpus:
        run = handover.guest_runner(guest_run, record, files)
        definition = hypervisor.definition(record.domain, uuid=found.uuid)
        stage.append("attaching")
        handover.attach(hypervisor, record.domain, found.uuid, held, record.gpus, progress)
        handover.wait_until_seen(run, definition, held, record.gpus, record.name, progress)
        stage.append("taking up")
        revived = handover.take_up(run, record)
        progress(f"the guest took its GPUs up: {revived}")
        if verify:
            endpoint = ssh.Endpoint(record.ssh.host, record.ssh.port or 22, record.ssh.user)
            report = create.verify_guest(record, endpoint, files, guest_run)
    with lock():
        holds = Holds(config)
        hold = holds.get(found.uuid)
        if hold is None or not hold.owned_by(owner.identity):
            raise FailedPrecondition(f"sandbox {record.name!r} was taken over while it resumed")
        holds.put(replace(hold, owner=None, doing="", saved_bytes=0))

        def ready(now: SandboxRecord) -> SandboxRecord:
            verification = report or now.verification
            return replace(now, suspended=None, verification=verification, boot_seconds=waited)

        found = store.commit(found, ready, STATE_READY)
    if report is not None and not report["ok"]:
        from vmsandbox.guest.verify import VerificationReport, raise_if_failed

        raise_if_failed(VerificationReport.from_dict(report), subject=f"sandbox {record.name!r}")
    return found


def _save_again(store: SandboxStore, found: Found, held: Suspension, exc: BaseException) -> None:
    """A resume whose GPUs could not be attached or were not seen (the guest's driver never
    took them up): what was attached detached and the guest saved again, so that it stays
    suspended with its GPUs to take rather than running without them. What fails here is a
    note on the resume's error; the sandbox is then settled as it is."""
    hypervisor, domain = store.hypervisor, found.record.domain
    try:
        there = handover.attached(hypervisor, domain)
        pairs = [
            (gpu, bus)
            for gpu, bus in zip(found.record.gpus, held.buses, strict=True)
            if gpu.bdf in there
        ]
        if pairs:
            kept = replace(held, buses=tuple(bus for _gpu, bus in pairs))
            gpus = tuple(gpu for gpu, _bus in pairs)
            handover.detach(hypervisor, domain, found.uuid, kept, gpus, lambda _line: None)
        hypervisor.save(domain, uuid=found.uuid)
    except VmSandboxError as again:
        exc.add_note(f"saving sandbox {found.record.name!r} again failed: {again}")


def _wait(
    hypervisor: Hypervisor, config: Config, record: SandboxRecord, uuid: str, progress: Progress
) -> float:
    """Wait until the restored guest's sshd accepts the sandbox key (it ran when it was
    saved: no boot to wait for); the seconds waited."""
    files = SandboxFiles.of(config, record.stem)
    watch = boot.BootWatch(hypervisor, record.name, record.domain, files, False, uuid=uuid)
    endpoint = boot.endpoint(watch, record.ssh, timeout=SSH_TIMEOUT_S)
    keys = files.keys(record.host_key_alias)
    return boot.wait_for_ssh(watch, endpoint, keys, timeout=SSH_TIMEOUT_S, progress=progress)


def reach(
    hypervisor: Hypervisor,
    config: Config,
    record: SandboxRecord,
    uuid: str,
    guest_run: handover.GuestRun,
    progress: Progress,
    started: float,
    claim: str = "",
) -> Reached:
    """Wake the restored guest of ``record`` (its clock set, its random number generator
    reseeded) and make sure its sshd answers with the pinned host key; the seconds since
    ``started`` (the restore's start, ``time.monotonic``). A claim of a parked pooled guest
    (pool/park.py) wakes it the same way, and with ``claim`` gives it that hostname in the
    same exchange where the guest serves ``wake`` (``Reached.claimed``).

    The guest ran when it was saved, so there is no boot to wait for: a guest that serves the
    control channel's ``wake`` sets its clock and checks that its sshd runs at once, and sshd's
    banner on the guest's port shows that it answers there. Its host key was proven when the
    sandbox was made (as for a pool claim) and every login checks it again: the restored guest
    is that same guest, memory and disk. A claim that the wake took reads no banner: it stands
    on the guest's own check that its sshd runs, as the claim of a running pooled guest does
    (the guest answered SSH with its pinned key when it entered the pool, and its restored QEMU
    listens on its port, or the restore failed). Other guests (a channel libvirt says the guest
    had closed when it was saved, an image without one) get the clock over SSH, the command's
    own login being the proof that SSH answers; only when that does not answer within QUICK_S is
    the boot wait, with its diagnostics, run first."""
    files = SandboxFiles.of(config, record.stem)
    if (
        record.ssh.port is not None
        and files.control.exists()
        and _channel_open(hypervisor, record.domain, uuid)
        and _woken(files, claim)
    ):
        if not claim:
            ssh.banner(ssh.Endpoint(record.ssh.host, record.ssh.port, record.ssh.user))
        progress(f"{record.name} woken through its control channel")
        return Reached(round(time.monotonic() - started, 3), claimed=bool(claim))
    progress(f"setting the clock of {record.name} over SSH")
    deadline = time.monotonic() + QUICK_S
    while record.ssh.port is not None and time.monotonic() < deadline:
        try:
            _wake_over_ssh(record, files, guest_run)
            return Reached(round(time.monotonic() - started, 3))
        except (Unavailable, DeadlineExceeded, EOFError, OSError):
            time.sleep(QUICK_POLL_S)
    _wait(hypervisor, config, record, uuid, progress)
    _wake_over_ssh(record, files, guest_run)
    return Reached(round(time.monotonic() - started, 3))


class Reached(NamedTuple):
    """A restored guest reached: seconds since its restore began, and whether the wake gave
    it the claim's hostname too."""

    seconds: float
    claimed: bool = False


def _channel_open(hypervisor: Hypervisor, domain: str, uuid: str) -> bool:
    """Whether libvirt says the restored guest has its control channel's port open. libvirt
    reads the port closed while QEMU starts, before the guest's memory is loaded, and learns
    that it is open from QEMU's event once the guest runs, handled by a libvirt worker: on a
    busy host a read right after the restore still said "disconnected" and the resume set
    the clock over SSH (2.4 s instead of 1.1). So "disconnected" is read again for up to
    CHANNEL_WAIT_S before the guest is taken for one whose channel was closed."""
    deadline = time.monotonic() + CHANNEL_WAIT_S
    while True:
        state = hypervisor.channel_state(domain, CONTROL_PORT, uuid=uuid)
        if state != "disconnected" or time.monotonic() >= deadline:
            return state != "disconnected"
        time.sleep(CHANNEL_POLL_S)


def _woken(files: SandboxFiles, claim: str = "") -> bool:
    """Whether the guest took the control channel's ``wake`` (and ``claim``) within WAKE_S.
    A guest saved before its channel's server ran may not answer at all: the clock then goes
    over SSH."""
    try:
        return control.wake(files.control, guest=files.name, timeout=WAKE_S, claim=claim)
    except VmSandboxError:
        return False


def _wake_over_ssh(
    record: SandboxRecord, files: SandboxFiles, guest_run: handover.GuestRun
) -> None:
    """The clock set with ``date`` and bytes the host drew written to /dev/urandom (mixed
    in, not credited), through one SSH login and sudo."""
    run = handover.guest_runner(guest_run, record, files)
    seed = os.urandom(control.SEED_BYTES).hex()
    script = f"date -u -s @{time.time():.6f} >/dev/null; echo {seed} > /dev/urandom"
    result = run(f"sudo -n sh -c {shlex.quote(script)}", timeout=30)
    if result.exit_status != 0:
        raise FailedPrecondition(
            f"sandbox {record.name!r}: setting the guest's clock after its resume failed "
            f"(exit {result.exit_status}): {result.stderr.strip()[-200:]}",
            details={"name": record.name},
        )
