"""Powering a sandbox off and on with its disk and GPUs kept, and waiting for a started guest.

A stopped sandbox keeps its GPUs: the hostdevs of an inactive domain still count as held
(vmsandbox.host.holders), so no other sandbox takes them meanwhile. Starting passes them through
again; when one has gone from the host (removed, or taken by a host driver) libvirt refuses, and
the sandbox is left as it was. Readiness and boot failure are written to the domain's metadata,
so a watcher of libvirt's metadata events (the OpenShell driver) learns of them.

A start whose forwarded SSH port another program took meanwhile (QEMU cannot bind it) moves
the forward to a free port, reserved under the host lock, and starts again.

Each acts on the sandbox its caller looked up, by its domain UUID (``Found.uuid``): a stop
presses that domain's power button, a wait watches that domain, and what a wait learned is
committed under the host lock only while that sandbox is still there (``SandboxStore.commit``),
never onto a later sandbox that took the name.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import replace

from vmsandbox.config import Config
from vmsandbox.errors import FailedPrecondition, Internal, VmSandboxError
from vmsandbox.guest import control
from vmsandbox.image.store import ImageStore
from vmsandbox.progress import Progress, silent
from vmsandbox.sandbox import boot, create, reserve
from vmsandbox.sandbox.holds import Holds, owners_folder
from vmsandbox.sandbox.record import (
    STATE_CREATING,
    STATE_FAILED,
    STATE_PARKED,
    STATE_POOLED,
    STATE_READY,
    STATE_RESUMING,
    STATE_STARTING,
    STATE_SUSPENDED,
    STATE_SUSPENDING,
    SandboxFiles,
    SandboxRecord,
)
from vmsandbox.sandbox.store import Found, SandboxStore
from vmsandbox.vm import netguard
from vmsandbox.vm.domain import with_ssh_port
from vmsandbox.vm.hypervisor import Hypervisor
from vmsandbox.vm.process import process_owner

POLL_S = 0.5
PRESS_AGAIN_S = 2.0
PORT_TRIES = 3
Lock = Callable[[], contextlib.AbstractContextManager[None]]


def stop(
    hypervisor: Hypervisor,
    domain: str,
    *,
    grace: float,
    uuid: str | None = None,
    say: Progress = silent,
) -> None:
    """Press the guest's power button (again every PRESS_AGAIN_S), and power it off when it
    still runs after ``grace`` seconds. Nothing to do for a domain that does not run (with
    ``uuid``: for the domain of that UUID only, whatever has its name now). ``say`` hears each
    step, so a stop that takes seconds is not silent.

    A press is lost when nothing in the guest listens yet: a guest that has just answered SSH
    may still be loading its ACPI button driver or starting logind (the project's lean images
    start both after sshd), and a stop right after a create must not wait out the whole
    grace."""
    start = time.monotonic()
    deadline = start + grace
    presses = 0
    while hypervisor.running(domain, uuid=uuid) and time.monotonic() < deadline:
        if time.monotonic() >= start + presses * PRESS_AGAIN_S:
            say(f"pressing the power button of {domain} (power off after {grace:g}s)")
            hypervisor.shutdown(domain, uuid=uuid)
            presses += 1
        time.sleep(POLL_S)
    if hypervisor.running(domain, uuid=uuid):
        say(f"{domain} still runs after {grace:g}s: powering it off")
        hypervisor.stop(domain, uuid=uuid)
    elif presses:
        say(f"{domain} shut down after {time.monotonic() - start:.1f}s")


def check_powerable(record: SandboxRecord, state: str) -> None:
    """FAILED_PRECONDITION for a sandbox still being created, and for a pooled guest nobody has
    claimed (the pool keeps it running for a claim; ``pool drain`` removes it)."""
    if state == STATE_CREATING:
        raise FailedPrecondition(
            f"sandbox {record.name!r} is still being created", details={"name": record.name}
        )
    if state in (STATE_POOLED, STATE_PARKED):
        raise FailedPrecondition(
            f"{record.name!r} is a guest of the warm pool, not a sandbox; "
            "'vmsandbox pool drain' removes it",
            details={"name": record.name},
        )


def start(hypervisor: Hypervisor, config: Config, found: Found, lock: Lock) -> bool:
    """Start a sandbox that does not run; False when it runs already (nothing done). QEMU makes
    the control channel's socket anew: it is made the owner's alone (``control.restrict``).

    It is stored as ``starting`` by this process first (so it shows starting, not stopped,
    between the call and QEMU running). A refused start restores the record and state it had,
    and the error (FAILED_PRECONDITION with libvirt's words for a GPU that is gone) propagates.
    """
    record, state, uuid = found.record, found.state, found.uuid or None
    domain = record.domain  # a claimed pooled guest's domain keeps the guest's name
    check_powerable(record, state)
    if state in (STATE_SUSPENDED, STATE_SUSPENDING, STATE_RESUMING):  # libvirt would restore it
        raise FailedPrecondition(
            f"sandbox {record.name!r} is {state}; 'vmsandbox resume {record.name}' restores it",
            details={"name": record.name, "state": state},
        )
    if hypervisor.running(domain, uuid=uuid):
        return False
    netguard.before_start(config)
    starter = process_owner(owners_folder(config))
    starting = replace(record, failure=None, starter=starter)
    hypervisor.set_metadata(domain, starting.to_dict(), STATE_STARTING, uuid=uuid)
    try:
        for attempt in range(1, PORT_TRIES + 1):
            try:
                hypervisor.start(domain, uuid=uuid)
                break
            except FailedPrecondition as exc:
                taken = "host forwarding" in exc.message and record.ssh.port is not None
                if not taken or attempt == PORT_TRIES:
                    raise
                starting = _new_port(hypervisor, config, found.uuid, starting, lock)
    except BaseException as exc:
        try:
            restored = replace(starting, starter=None).to_dict()
            hypervisor.set_metadata(domain, restored, state, uuid=uuid)
        except VmSandboxError as restore:  # the start's error stays the one the caller sees
            exc.add_note(f"restoring the state of sandbox {record.name!r} failed: {restore}")
        raise
    control.restrict(SandboxFiles.of(config, record.stem).control)
    return True


def _new_port(
    hypervisor: Hypervisor, config: Config, uuid: str, record: SandboxRecord, lock: Lock
) -> SandboxRecord:
    """Move the domain's SSH forward to a port reserved now (the old one was taken)."""
    view = reserve.HostView(tuple(hypervisor.every_domain()))
    with lock():
        holds = Holds(config)
        port = reserve.pick_port(reserve.taken(view, holds))
        hold = holds.get(uuid)
        if hold is not None:
            holds.put(replace(hold, port=port))
        definition = hypervisor.definition(record.domain, uuid=uuid)
        hypervisor.define(with_ssh_port(definition, port))
        moved = replace(record, ssh=replace(record.ssh, port=port))
        hypervisor.set_metadata(record.domain, moved.to_dict(), STATE_STARTING, uuid=uuid)
    return moved


def wait(
    hypervisor: Hypervisor,
    config: Config,
    found: Found,
    progress: Progress,
    lock: Lock,
    verify: bool,
    timeout: float | None,
) -> tuple[SandboxRecord, float]:
    """Wait until the started guest of ``found`` (its domain UUID) answers SSH (failing fast as
    boot.py does), verify its GPUs from inside (``verify``) and store it ready; return the
    record and the seconds waited.

    A guest that does not come up is stored ``failed`` with the error's code and message as its
    ``failure``, and the error propagates; a failed verification is stored (ready, with its
    report) and raised as GuestVerificationFailed. Either is committed under ``lock`` into the
    record the sandbox has then, only while it is still that sandbox (``SandboxStore.commit``):
    NOT_FOUND when it was removed meanwhile, whatever has its name now.
    """
    record = found.record
    domain = record.domain
    files = SandboxFiles.of(config, record.stem)
    store = SandboxStore(hypervisor, config)
    limit = timeout or boot.boot_timeout(config.boot_timeout, record.memory_mib, len(record.gpus))
    sshd = reports_sshd(config, record)
    watch = boot.BootWatch(hypervisor, record.name, domain, files, sshd, uuid=found.uuid)
    try:
        endpoint = boot.endpoint(watch, record.ssh, timeout=limit)
        if record.ssh.port is None:  # the DHCP address is kept: get/exec/ssh use it
            record = replace(record, ssh=replace(record.ssh, host=endpoint.host, port=22))
        keys = files.keys(record.host_key_alias)
        waited = boot.wait_for_ssh(watch, endpoint, keys, timeout=limit, progress=progress)
        report = create.verify_guest(record, endpoint, files) if verify else None
    except Exception as exc:  # any failure ends the wait with a state, never "starting"
        error = exc if isinstance(exc, VmSandboxError) else _internal(record, exc)
        failure = {"code": error.code, "message": error.message}
        with contextlib.suppress(VmSandboxError), lock():  # the boot's error is the one to see
            store.commit(found, lambda now: replace(now, failure=failure), STATE_FAILED)
        if error is exc:
            raise
        raise error from exc
    learned = record.ssh if found.record.ssh.port is None else None  # the DHCP address

    def ready(now: SandboxRecord) -> SandboxRecord:
        return replace(
            now, ssh=learned or now.ssh, verification=report, failure=None, boot_seconds=waited
        )

    with lock():
        record = store.commit(found, ready, STATE_READY).record
    if report is not None and not report["ok"]:
        from vmsandbox.guest.verify import VerificationReport, raise_if_failed

        raise_if_failed(VerificationReport.from_dict(report), subject=f"sandbox {record.name!r}")
    return record, waited


def _internal(record: SandboxRecord, exc: Exception) -> Internal:
    return Internal(
        f"waiting for sandbox {record.name!r} failed: {type(exc).__name__}: {exc}",
        details={"name": record.name},
    )


def reports_sshd(config: Config, record: SandboxRecord) -> bool:
    """Whether the sandbox's image build says on the console when sshd has started (False
    when the build is gone: the wait then knocks as for any image)."""
    builds = ImageStore(config.images).builds(record.image)
    return any(image.id == record.image_id and image.reports_sshd for image in builds)
