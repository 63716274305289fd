"""The steps that make a sandbox, each with the undo that takes it back.

``create`` runs ``CREATE_STEPS`` in order; when one fails, the undos of the steps that ran (the
failing one included: it may have done half its work) run newest first. ``destroy`` and
reconcile run every undo (``teardown``): undos are idempotent and work from what is stored
(domain name, files, record), so a sandbox left half-made by a killed process is taken apart
the same way. On NVSwitch boards in shared NVSwitch mode the ``fabric`` step activates the
sandbox's Fabric Manager partition right after its GPUs are chosen; its undo deactivates it, and
runs after ``define``'s undo (newest first), so only once the domain holding the GPUs is gone.

Steps marked ``locked`` run under the host lock (names, ports and GPUs are chosen there, and the
domain is defined before the lock is let go); their undos run under it too.

The warm pool's paths (``FILL_STEPS``, ``CLAIM_STEPS``) are warmpool.py's, built from these
steps and undos.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from vmsandbox.errors import (
    AlreadyExists,
    FailedPrecondition,
    GuestVerificationFailed,
    ResourceExhausted,
    VmSandboxError,
)
from vmsandbox.gpu.fabric.lease import FabricLease
from vmsandbox.guest import control, ssh
from vmsandbox.guest.keys import KeyPair, SandboxKeys
from vmsandbox.guest.seed import network_config, write_seed
from vmsandbox.guest.ssh import Endpoint
from vmsandbox.image.store import BaseImage, make_overlay
from vmsandbox.progress import Progress
from vmsandbox.sandbox import boot, plan
from vmsandbox.sandbox.record import (
    DOMAIN_PREFIX,
    STATE_CREATING,
    STATE_DEFINED,
    STATE_READY,
    STATE_STARTED,
    SandboxFiles,
    SandboxRecord,
)
from vmsandbox.sandbox.spec import SandboxSpec
from vmsandbox.vm.hypervisor import Hypervisor
from vmsandbox.vm.process import ProcessIdentity

if TYPE_CHECKING:
    from vmsandbox.config import Config
    from vmsandbox.gpu.allocator import Allocation
    from vmsandbox.gpu.hotplug import HotplugPlan
    from vmsandbox.host.model import Gpu

# Tries at starting QEMU when the forwarded SSH port was taken between choosing and starting.
PORT_TRIES = 3


@dataclass
class Remains:
    """What undos work from: the domain, the files, the configuration (the state directory
    holds the fabric ledger) and, when it is still readable, the record."""

    hypervisor: Hypervisor
    config: Config
    name: str
    files: SandboxFiles
    record: SandboxRecord | None = None

    @property
    def domain(self) -> str:
        """The domain carries the files' name: a claimed pooled guest keeps its own."""
        return DOMAIN_PREFIX + self.files.name


@dataclass(kw_only=True)
class Creation(Remains):
    """One create in progress: its inputs, and what each step has made so far."""

    spec: SandboxSpec
    image: BaseImage
    virt_type: str
    progress: Progress
    exists: Callable[[str], bool]  # whether a sandbox of that name exists
    # Under the lock: GPUs and their partition or NVSwitches (None: no GPU asked for).
    allocate: Callable[[], Allocation | None]
    free_port: Callable[[], int]
    host_cpus: Callable[[], dict[int, list[int]]]  # host CPUs per NUMA node, for pinning
    timeout: float | None = None
    start: bool = True
    wait: bool = True
    verify: bool = True
    state: str = STATE_CREATING
    allocation: Allocation | None = None
    mac: str = field(default_factory=plan.new_mac)
    pairs: tuple[KeyPair, KeyPair] | None = None
    planned: plan.SandboxPlan | None = None
    endpoint: Endpoint | None = None
    boot_seconds: float | None = None
    # The warm pool: whether the fill's shape has room (under the lock), the pooled guest a
    # claim takes (under the lock; None when there is none ready), and the spare root ports a
    # GPU-ready shape's guest boots with (gpu/hotplug.py).
    room: Callable[[], bool] = lambda: False
    take_pooled: Callable[[], SandboxRecord | None] = lambda: None
    hotplug: HotplugPlan | None = None
    # How commands run in the guest (ssh.run; the unit tests hand in a fake guest).
    guest_run: Callable[..., ssh.ExecResult] = ssh.run

    @property
    def gpus(self) -> list[Gpu]:
        return list(self.allocation.gpus) if self.allocation else []


@dataclass(frozen=True)
class Step:
    """One create step: ``do`` makes something, ``undo`` takes it back (idempotent, from what
    is stored); ``locked`` steps run under the host lock."""

    name: str
    do: Callable[[Creation], None]
    undo: Callable[[Remains], None] | None = None
    locked: bool = False


# -- the steps ----------------------------------------------------------------------------------


def _reserve(c: Creation) -> None:
    if c.exists(c.name):
        raise AlreadyExists(f"sandbox {c.name!r} already exists", details={"name": c.name})
    c.files.remove()  # files without a domain are leftovers of a killed create


def _gpus(c: Creation) -> None:
    c.allocation = c.allocate()
    if c.allocation is None:
        return
    gpus = c.allocation.gpus
    c.progress("GPUs: " + ", ".join(f"{g.bdf} ({g.name or g.device_id})" for g in gpus))
    if c.allocation.switches:
        c.progress("NVSwitches: " + ", ".join(s.bdf for s in c.allocation.switches))


def _activate(c: Creation) -> None:
    """Shared NVSwitch mode: activate the chosen partition (the image's NVIDIA driver must be
    Fabric Manager's release; the lease is recorded before fmpm is asked)."""
    partition = c.allocation.partition if c.allocation else None
    if partition is None:
        return
    c.progress(f"activating Fabric Manager partition {partition.id}")
    driver = c.image.meta.get("nvidia_driver_version")
    FabricLease(c.config).activate(partition.id, c.name, image=c.image.name, image_driver=driver)


def _keys(c: Creation) -> None:
    with _host_files(f"writing the keys of sandbox {c.name!r} to {c.files.keys_dir}"):
        _keys, client, host = SandboxKeys.create(c.files.keys_dir, c.domain)
    c.pairs = (client, host)


def _overlay(c: Creation) -> None:
    c.progress(f"creating overlay on {c.image.name} ({c.image.id}), {c.spec.disk_gib} GiB")
    make_overlay(c.image.disk, c.files.overlay, c.spec.disk_gib)


def _seed(c: Creation) -> None:
    assert c.pairs is not None  # made by the keys step
    with _host_files(f"writing the seed of sandbox {c.name!r} to {c.files.seed}"):
        write_seed(
            c.files.seed,
            instance_id=str(uuid.uuid4()),
            hostname=c.name,
            user=c.config.ssh_user,
            client=c.pairs[0],
            host=c.pairs[1],
            network=network_config(c.mac, user_net=c.config.network == "user"),
            workdir=c.files.keys_dir,  # its files hold the host key: never outside the state dir
            guest=c.spec.guest,  # environment, secret files, main unit: in the 0600 seed only
        )


def _define(c: Creation) -> None:
    user_net = c.config.network == "user"
    c.planned = plan.plan(
        c.spec,
        name=c.name,
        config=c.config,
        image=c.image,
        virt_type=c.virt_type,
        allocation=c.allocation,
        port=c.free_port() if user_net else None,
        mac=c.mac,
        host_cpus=c.host_cpus() if c.gpus else None,
        files=c.files,
        creator=ProcessIdentity.current(),
        hotplug=c.hotplug,
    )
    c.record = c.planned.record
    c.hypervisor.define(c.planned.xml())


def _start(c: Creation) -> None:
    """Start QEMU; when the forwarded port was taken meanwhile (QEMU cannot bind it), plan
    another port, redefine and try again."""
    assert c.planned is not None
    c.progress(f"starting {c.domain} ({c.virt_type})")
    for attempt in range(1, PORT_TRIES + 1):
        try:
            c.hypervisor.start(c.domain)
            control.restrict(c.files.control)
            return
        except FailedPrecondition as exc:
            if "host forwarding" not in exc.message or attempt == PORT_TRIES:
                raise
            c.progress(f"SSH port {c.planned.record.ssh.port} was taken meanwhile; another one")
            c.planned = plan.with_port(c.planned, c.free_port())
            c.record = c.planned.record
            c.hypervisor.define(c.planned.xml())


def _wait(c: Creation) -> None:
    """Wait for the guest's sshd (failing fast when it cannot boot)."""
    if not c.wait:
        return
    assert c.record is not None  # made by the define step
    timeout = c.timeout or boot.boot_timeout(c.config.boot_timeout, c.spec.memory_mib, len(c.gpus))
    watch = boot.BootWatch(c.hypervisor, c.name, c.domain, c.files, c.image.reports_sshd)
    ssh = c.record.ssh
    c.endpoint = boot.endpoint(watch, ssh, timeout=timeout)
    if ssh.port is None:  # the DHCP address is kept in the record: get/exec/ssh use it
        c.record = replace(c.record, ssh=replace(ssh, host=c.endpoint.host, port=22))
    keys = c.files.keys(c.record.host_key_alias)
    c.boot_seconds = boot.wait_for_ssh(
        watch, c.endpoint, keys, timeout=timeout, progress=c.progress
    )


def _verify(c: Creation) -> None:
    """Check the guest's devices (GPUs) from inside it; the report goes into the record."""
    if not (c.wait and c.verify):
        return
    assert c.record is not None and c.endpoint is not None  # made by define and wait
    c.progress("verifying the guest's devices")
    report = verify_guest(c.record, c.endpoint, c.files)
    c.record = replace(c.record, verification=report)


def verify_guest(
    record: SandboxRecord,
    endpoint: Endpoint,
    files: SandboxFiles,
    guest_run: Callable[..., ssh.ExecResult] = ssh.run,
) -> dict[str, Any]:
    """The in-guest verification report of a booted sandbox's GPUs (and of their NVLink
    fabric when they talk through NVSwitches), its commands run by ``guest_run``."""
    from vmsandbox.guest import verify

    keys = files.keys(record.host_key_alias)
    expected = [verify.ExpectedGpu.of(gpu) for gpu in record.gpus]
    run = functools.partial(guest_run, endpoint, keys)
    return verify.verify(run, expected, fabric=record.on_fabric).to_dict()


def check_verification(
    c: Creation, lock: Callable[[], contextlib.AbstractContextManager[None]], *, keep: bool
) -> None:
    """GuestVerificationFailed when the in-guest check of a created sandbox failed; the sandbox
    is taken apart first unless ``keep`` (kept for inspection, as the caller asked)."""
    verification = c.record.verification if c.record else None
    if verification is None or verification["ok"]:
        return
    from vmsandbox.guest.verify import VerificationReport, raise_if_failed

    report = VerificationReport.from_dict(verification)
    try:
        raise_if_failed(report, subject=f"sandbox {c.name!r}", details={"kept": keep})
    except GuestVerificationFailed as exc:
        if not keep:
            clean_up_after(exc, c, lock)
        raise


def _mark(c: Creation) -> None:
    """Store the record with its final state: ready (SSH answered), started (not waited for),
    or defined (not started)."""
    assert c.record is not None  # made by the define step
    c.state = STATE_READY if c.wait and c.start else STATE_STARTED if c.start else STATE_DEFINED
    c.hypervisor.set_metadata(c.domain, c.record.to_dict(), c.state)


def _stop(r: Remains) -> None:
    r.hypervisor.stop(r.domain)


def _undefine(r: Remains) -> None:
    r.hypervisor.undefine(r.domain)


def _remove_files(r: Remains) -> None:
    r.files.remove()


def _release(r: Remains) -> None:
    """Deactivate the sandbox's partition (its domain is gone by now) and forget the lease;
    nothing is asked of Fabric Manager when the sandbox holds none."""
    FabricLease(r.config).release(r.name)


CREATE_STEPS: tuple[Step, ...] = (
    Step("reserve", _reserve, locked=True),
    Step("gpus", _gpus, locked=True),  # freed by undefining the domain that holds them
    Step("fabric", _activate, _release, locked=True),
    Step("keys", _keys, _remove_files, locked=True),
    Step("overlay", _overlay, _remove_files, locked=True),
    Step("seed", _seed, _remove_files, locked=True),
    Step("define", _define, _undefine, locked=True),
    Step("start", _start, _stop),
    Step("wait", _wait),
    Step("verify", _verify),
    Step("ready", _mark),
)
# Steps skipped by create(start=False).
STARTING = frozenset({"start", "wait", "verify"})


# -- running them -------------------------------------------------------------------------------


def no_checkpoint(_stage: str) -> None:
    """The default crash checkpoint: nothing (tests install one that stops the create)."""


def run(
    steps: tuple[Step, ...],
    creation: Creation,
    lock: Callable[[], contextlib.AbstractContextManager[None]],
    checkpoint: Callable[[str], None],
) -> None:
    """Run ``steps``; on any failure undo the ones that ran, the failing one included (it may
    have made part of its work), newest first, and re-raise.

    ``checkpoint(stage)`` is called once the lock is taken (``locked``) and after each step:
    the crash tests stop a create there to kill it.
    """
    done: list[Step] = []
    try:
        index = 0
        while index < len(steps):
            if not steps[index].locked:
                _run_one(steps[index], creation, checkpoint, done)
                index += 1
                continue
            with lock():
                checkpoint("locked")
                while index < len(steps) and steps[index].locked:
                    _run_one(steps[index], creation, checkpoint, done)
                    index += 1
    except BaseException as exc:
        _note(exc, undo(done, creation, lock), creation.progress)
        raise


def clean_up_after(
    exc: BaseException,
    creation: Creation,
    lock: Callable[[], contextlib.AbstractContextManager[None]],
) -> None:
    """Undo every step of a create that failed after its steps ran; a failing undo is noted on
    ``exc`` and never replaces it."""
    _note(exc, undo(CREATE_STEPS, creation, lock), creation.progress)


def _note(exc: BaseException, failures: list[str], progress: Progress) -> None:
    for failure in failures:
        exc.add_note(f"cleanup after the failed create also failed: {failure}")
        progress(f"cleanup failed: {failure}")


def _run_one(
    step: Step, creation: Creation, checkpoint: Callable[[str], None], done: list[Step]
) -> None:
    done.append(step)  # before it runs: a step that fails halfway is undone too
    step.do(creation)
    checkpoint(step.name)


def undo(
    steps: list[Step] | tuple[Step, ...],
    remains: Remains,
    lock: Callable[[], contextlib.AbstractContextManager[None]],
) -> list[str]:
    """Run the undos of ``steps`` newest first (unlocked ones before taking the lock, the rest
    under it) and every one even when one fails; return the failures' messages."""
    failures: list[str] = []
    pending = [step for step in reversed(steps) if step.undo is not None]
    seen: set[Any] = set()

    def run_undo(step: Step) -> None:
        if step.undo in seen:
            return  # one undo serves several steps (the files)
        seen.add(step.undo)
        try:
            assert step.undo is not None
            step.undo(remains)
        except VmSandboxError as exc:
            failures.append(exc.message)
        except OSError as exc:
            failures.append(f"{step.name}: {exc}")

    for step in [step for step in pending if not step.locked]:
        run_undo(step)
    locked = [step for step in pending if step.locked]
    if locked:
        with lock():
            for step in locked:
                run_undo(step)
    return failures


def teardown(remains: Remains, lock: Callable[[], contextlib.AbstractContextManager[None]]) -> None:
    """Take a sandbox apart completely (every undo); FAILED_PRECONDITION naming what is left."""
    failures = undo(CREATE_STEPS, remains, lock)
    if failures:
        raise FailedPrecondition(
            f"sandbox {remains.name!r} was not removed completely: {'; '.join(failures)}",
            details={"remaining": [str(path) for path in remains.files.existing()]},
        )


@contextlib.contextmanager
def _host_files(doing: str) -> Iterator[None]:
    """Turn a failed write on the host into FAILED_PRECONDITION (RESOURCE_EXHAUSTED when the
    disk is full), naming what was being written."""
    try:
        yield
    except OSError as exc:
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        raise (ResourceExhausted if full else FailedPrecondition)(
            f"{doing}: {exc.strerror or exc}" + (f" ({exc.filename})" if exc.filename else ""),
            details={"errno": errno.errorcode.get(exc.errno or 0, str(exc.errno))},
        ) from exc
