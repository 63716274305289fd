"""The steps that make a sandbox, each with the undo that takes it back.

``create`` runs ``CREATE_STEPS`` (runner.py): it reads the host without the host lock
(``look``), then under the lock reserves the name, the GPUs, the SSH port and the domain's UUID
in one hold (holds.py, ``reserve``), and lets the lock go. The slow work follows outside it:
Fabric Manager's activation, keys, overlay, seed. The domain is defined under the lock again,
QEMU started and waited for outside it, and the last step commits the state and settles the
hold under it. Every locked step after ``reserve`` first checks that the create still owns its
hold: a destroy may have taken it over.

Undos act on what the create made, by identity: the domain by the UUID it reserved, the files
only while it owns the hold that reserves their name, the partition by the lease naming that
UUID. An undo never reaches a domain or files another call made under the same name. The
fabric undo runs after QEMU is stopped (newest first), so a partition is deactivated only once
no guest runs on its GPUs.

The warm pool's paths (``FILL_STEPS``, ``CLAIM_STEPS``) are pool/steps.py's, built from these
steps and undos.
"""

from __future__ import annotations

import contextlib
import functools
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vmsandbox.errors import FailedPrecondition
from vmsandbox.gpu.fabric.lease import FabricLease
from vmsandbox.guest import control, ssh
from vmsandbox.guest.keys import KeyPair, SandboxKeys
from vmsandbox.guest.seed import network_config, write_seed
from vmsandbox.guest.ssh import Endpoint
from vmsandbox.image.store import BaseImage, make_overlay
from vmsandbox.progress import Progress
from vmsandbox.sandbox import boot, plan, reserve
from vmsandbox.sandbox.holds import Hold, Holds, settled, unwritable
from vmsandbox.sandbox.record import (
    STATE_DEFINED,
    STATE_READY,
    STATE_STARTED,
    SandboxFiles,
    SandboxRecord,
)
from vmsandbox.sandbox.spec import SandboxSpec
from vmsandbox.vm import netguard
from vmsandbox.vm.domain import DOMAIN_PREFIX
from vmsandbox.vm.hypervisor import Hypervisor
from vmsandbox.vm.process import Ownership

if TYPE_CHECKING:
    from vmsandbox.config import Config
    from vmsandbox.gpu.allocator import Allocation
    from vmsandbox.gpu.hotplug import HotplugPlan
    from vmsandbox.host.model import Gpu

# Tries at starting QEMU when the forwarded SSH port was taken between choosing and starting.
PORT_TRIES = 3


@dataclass
class Remains:
    """What undos work from: the domain (by the UUID the sandbox has), the files, the
    configuration (the state directory holds the ledgers), the owner of the transition and,
    when it is still readable, the record."""

    hypervisor: Hypervisor
    config: Config
    name: str
    files: SandboxFiles
    record: SandboxRecord | None = None
    uuid: str = ""  # "" until the reservation names one: nothing of a domain to undo
    owner: Ownership | None = None

    @property
    def domain(self) -> str:
        """The domain carries the files' name: a claimed pooled guest keeps its own."""
        return DOMAIN_PREFIX + self.files.name

    @property
    def holds(self) -> Holds:
        return Holds(self.config)

    def mine(self) -> Hold | None:
        """The hold of this transition's sandbox while the transition owns it (under the
        lock); None when it never had one or someone else (a destroy) has taken it over."""
        hold = self.holds.get(self.uuid)
        if hold is None or self.owner is None or not hold.owned_by(self.owner.identity):
            return None
        return hold

    def own(self) -> Hold:
        """``mine``, or FAILED_PRECONDITION when the sandbox was taken from this transition."""
        hold = self.mine()
        if hold is None:
            raise FailedPrecondition(
                f"sandbox {self.name!r} was removed (destroyed, or taken apart as left over) "
                "while this call was making it",
                details={"name": self.name, "uuid": self.uuid},
            )
        return hold


@dataclass(kw_only=True)
class Creation(Remains):
    """One create in progress: its inputs, and what each step has made so far."""

    spec: SandboxSpec
    image: BaseImage
    virt_type: str
    progress: Progress
    # Outside the lock: the host as the choices will start from (reserve.HostView).
    look: Callable[[], reserve.HostView]
    host_cpus: Callable[[], dict[int, list[int]]]  # host CPUs per NUMA node, for pinning
    timeout: float | None = None
    start: bool = True
    wait: bool = True
    verify: bool = True
    keep: bool = False  # keep a sandbox whose in-guest check failed (for inspection)
    doing: str = "create"  # what the hold says is at work: create, fill, claim
    state: str = "creating"
    view: reserve.HostView | None = None
    port: int | None = None
    allocation: Allocation | None = None
    mac: str = field(default_factory=plan.new_mac)
    pairs: tuple[KeyPair, KeyPair] | None = None
    planned: plan.SandboxPlan | None = None
    endpoint: Endpoint | None = None
    boot_seconds: float | None = None
    hostname_set: bool = False  # a parked guest's claim: its wake set the hostname (park.py)
    # The warm pool: a fill's shape key and image build (its hold counts for the shape's room,
    # ``room`` says under the lock whether there is any), and the spare root ports a GPU-ready
    # shape's guest boots with (gpu/hotplug.py).
    pool_key: str | None = None
    room: Callable[[reserve.Taken], bool] = lambda _now: True
    hotplug: HotplugPlan | None = None
    # How commands run in the guest (ssh.run; the unit tests hand in a fake guest).
    guest_run: Callable[..., ssh.ExecResult] = ssh.run
    # The host lock, for a step that takes it again by itself (set by runner.run).
    lock: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext

    @property
    def gpus(self) -> list[Gpu]:
        return list(self.allocation.gpus) if self.allocation else []

    def allocate(self, now: reserve.Taken) -> Allocation | None:
        """Under the lock: the spec's GPUs on the view with today's holders (reserve.py)."""
        assert self.view is not None  # read by the look step
        max_gpus = self.config.max_gpus
        return reserve.allocate(self.spec.gpu, self.view, now, max_gpus)


@dataclass(frozen=True)
class Step:
    """One step: ``do`` makes something, ``undo`` takes it back (idempotent, from what is
    stored). ``locked`` steps run under the host lock; an undo runs under it when
    ``undo_locked`` says so (by default when its step does)."""

    name: str
    do: Callable[[Creation], None]
    undo: Callable[[Remains], None] | None = None
    locked: bool = False
    undo_locked: bool | None = None

    @property
    def undo_under_lock(self) -> bool:
        return self.locked if self.undo_locked is None else self.undo_locked


# -- the steps ----------------------------------------------------------------------------------


def _look(c: Creation) -> None:
    c.view = c.look()


def _reserve(c: Creation) -> None:
    """Under the lock: the name (free of sandboxes and reservations), the GPUs, the port and
    the domain's UUID, written in one hold owned by this create."""
    assert c.view is not None and c.owner is not None
    holds = c.holds
    now = reserve.taken(c.view, holds)
    reserve.check_name(c.name, now, c.hypervisor)
    if not c.room(now):
        from vmsandbox.sandbox.pool.shapes import PoolFull

        raise PoolFull(c.spec.image)
    c.files.remove()  # files with no domain and no reservation: a killed create's leftovers
    c.allocation = c.allocate(now)
    c.port = reserve.pick_port(now) if c.config.network == "user" else None
    c.uuid = str(uuid.uuid4())
    partition = c.allocation.partition if c.allocation else None
    holds.put(
        Hold(
            uuid=c.uuid,
            name=c.name,
            stem=c.files.name,
            gpus=reserve.held_functions(c.allocation),
            port=c.port,
            partition=partition.id if partition else None,
            pool=c.pool_key,
            image_id=c.image.id if c.pool_key else None,
            owner=c.owner.identity,
            doing=c.doing,
        )
    )
    show_gpus(c)


def show_gpus(c: Creation) -> None:
    if c.allocation is None:
        return
    c.progress("GPUs: " + ", ".join(f"{g.bdf} ({g.name or g.device_id})" for g in c.gpus))
    if c.allocation.switches:
        c.progress("NVSwitches: " + ", ".join(s.bdf for s in c.allocation.switches))


def _unreserve(r: Remains) -> None:
    """Drop the hold, once everything it reserved is given back (under the lock): while its
    domain or files are still there (an undo before this one failed), the hold stays, for
    reconcile. A tombstone only when a domain was defined for it (``record``)."""
    if r.mine() is None:
        return
    stored = r.hypervisor.metadata(r.domain)
    if (stored is not None and stored.uuid == r.uuid) or r.files.existing():
        return
    r.holds.drop(r.uuid, tombstone=r.record is not None)


def _activate(c: Creation) -> None:
    """Shared NVSwitch mode: activate the chosen partition, outside the lock (fmpm may take
    minutes; the hold reserves the partition meanwhile). The image's NVIDIA driver must be
    Fabric Manager's release; the lease, naming the domain's UUID, is recorded before fmpm is
    asked."""
    partition = c.allocation.partition if c.allocation else None
    if partition is None:
        return
    c.progress(f"activating Fabric Manager partition {partition.id}")
    driver = c.image.meta.get("nvidia_driver_version")
    FabricLease(c.config).activate(
        partition.id, c.uuid, c.name, image=c.image.name, image_driver=driver
    )


def _release(r: Remains) -> None:
    """Deactivate the partition leased to the sandbox's UUID (its guest is stopped by now)
    and forget the lease; nothing is asked of Fabric Manager when it holds none."""
    if r.uuid:
        FabricLease(r.config).release(r.uuid, r.name)


def _keys(c: Creation) -> None:
    with _host_files(f"writing the keys of sandbox {c.name!r}", c.files.keys_dir):
        _keys, client, host = SandboxKeys.create(c.files.keys_dir, c.domain)
    c.pairs = (client, host)


def _overlay(c: Creation) -> None:
    c.progress(f"creating overlay on {c.image.name} ({c.image.id}), {c.spec.disk_gib} GiB")
    make_overlay(c.image.disk, c.files.overlay, c.spec.disk_gib)


def _seed(c: Creation) -> None:
    assert c.pairs is not None  # made by the keys step
    with _host_files(f"writing the seed of sandbox {c.name!r}", c.files.seed):
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


def _remove_files(r: Remains) -> None:
    """Remove the files, under the lock and only while this transition owns the hold that
    reserves their name: once it is dropped, another create may be writing files of that
    name."""
    if r.mine() is not None:
        r.files.remove()


def _define(c: Creation) -> None:
    c.own()
    c.planned = plan.plan(
        c.spec,
        name=c.name,
        config=c.config,
        image=c.image,
        virt_type=c.virt_type,
        allocation=c.allocation,
        port=c.port,
        mac=c.mac,
        host_cpus=c.host_cpus() if c.gpus else None,
        files=c.files,
        creator=c.owner.identity if c.owner else None,
        hotplug=c.hotplug,
        domain_uuid=c.uuid,
    )
    c.record = c.planned.record
    c.hypervisor.define(c.planned.xml())


def _undefine(r: Remains) -> None:
    """Stop (normally done already) and remove the domain with the reserved UUID."""
    if r.uuid:
        r.hypervisor.stop(r.domain, uuid=r.uuid)
        r.hypervisor.undefine(r.domain, uuid=r.uuid)


def _start(c: Creation) -> None:
    """Start QEMU; when the forwarded port was taken meanwhile (QEMU cannot bind it), reserve
    another port (under the lock), redefine and try again."""
    assert c.planned is not None
    c.progress(f"starting {c.domain} ({c.virt_type})")
    netguard.before_start(c.config)
    for attempt in range(1, PORT_TRIES + 1):
        try:
            c.hypervisor.start(c.domain, uuid=c.uuid)
            control.restrict(c.files.control)
            return
        except FailedPrecondition as exc:
            if "host forwarding" not in exc.message or attempt == PORT_TRIES:
                raise
            c.progress(f"SSH port {c.planned.record.ssh.port} was taken meanwhile; another one")
            with c.lock():
                hold = c.own()
                assert c.view is not None
                c.port = reserve.pick_port(reserve.taken(c.view, c.holds))
                c.holds.put(replace(hold, port=c.port))
                c.planned = plan.with_port(c.planned, c.port)
                c.record = c.planned.record
                c.hypervisor.define(c.planned.xml())


def _stop(r: Remains) -> None:
    if r.uuid:
        r.hypervisor.stop(r.domain, uuid=r.uuid)


def _wait(c: Creation) -> None:
    """Wait for the guest's sshd (failing fast when it cannot boot)."""
    if not c.wait:
        return
    assert c.record is not None  # made by the define step
    timeout = c.timeout or boot.boot_timeout(c.config.boot_timeout, c.spec.memory_mib, len(c.gpus))
    watch = boot.BootWatch(c.hypervisor, c.name, c.domain, c.files, c.image.reports_sshd, c.uuid)
    ssh_record = c.record.ssh
    c.endpoint = boot.endpoint(watch, ssh_record, timeout=timeout)
    if ssh_record.port is None:  # the DHCP address is kept in the record: get/exec/ssh use it
        c.record = replace(c.record, ssh=replace(ssh_record, host=c.endpoint.host, port=22))
    keys = c.files.keys(c.record.host_key_alias)
    c.boot_seconds = boot.wait_for_ssh(
        watch, c.endpoint, keys, timeout=timeout, progress=c.progress
    )
    c.record = replace(c.record, boot_seconds=c.boot_seconds)


def _verify(c: Creation) -> None:
    """Check the guest's devices (GPUs) from inside it; the report goes into the record. A
    failed check fails the create (its undos take the sandbox apart) unless ``keep``."""
    if not (c.wait and c.verify):
        return
    assert c.record is not None and c.endpoint is not None  # made by define and wait
    c.progress("verifying the guest's devices")
    report = verify_guest(c.record, c.endpoint, c.files, c.guest_run)
    c.record = replace(c.record, verification=report)
    if not c.keep:
        _raise_if_failed(c, kept=False)


def _mark(c: Creation) -> None:
    """Commit, under the lock: the record with its final state (ready: SSH answered; started:
    not waited for; defined: not started), and the hold settled."""
    assert c.record is not None  # made by the define step
    hold = c.own()
    c.state = STATE_READY if c.wait and c.start else STATE_STARTED if c.start else STATE_DEFINED
    c.hypervisor.set_metadata(c.domain, c.record.to_dict(), c.state, uuid=c.uuid)
    c.holds.put(settled(hold))


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


def check_verification(c: Creation) -> None:
    """GuestVerificationFailed for a sandbox kept (``keep``) although its check failed."""
    _raise_if_failed(c, kept=True)


def _raise_if_failed(c: Creation, *, kept: bool) -> None:
    verification = c.record.verification if c.record else None
    if verification is None or verification["ok"]:
        return
    from vmsandbox.guest.verify import VerificationReport, raise_if_failed

    report = VerificationReport.from_dict(verification)
    raise_if_failed(report, subject=f"sandbox {c.name!r}", details={"kept": kept})


def nothing(_c: Creation) -> None:
    """A step whose only purpose is its undo's place in the order."""


CREATE_STEPS: tuple[Step, ...] = (
    Step("look", _look),
    Step("reserve", _reserve, _unreserve, locked=True),
    Step("fabric", _activate, _release),
    Step("keys", _keys, _remove_files, undo_locked=True),
    Step("overlay", _overlay, _remove_files, undo_locked=True),
    Step("seed", _seed, _remove_files, undo_locked=True),
    Step("define", _define, _undefine, locked=True),
    Step("start", _start, _stop),
    Step("wait", _wait),
    Step("verify", _verify),
    Step("ready", _mark, locked=True),
)
# Steps skipped by create(start=False).
STARTING = frozenset({"start", "wait", "verify"})


@contextlib.contextmanager
def _host_files(doing: str, path: Path) -> Iterator[None]:
    """A failed write on the host as FAILED_PRECONDITION (RESOURCE_EXHAUSTED when the disk is
    full) naming what was being written and where (holds.unwritable)."""
    try:
        yield
    except OSError as exc:
        raise unwritable(doing, exc, path) from exc
