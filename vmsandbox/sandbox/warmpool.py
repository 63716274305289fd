"""The warm pool at work: filling it, claiming a guest from it, showing and draining it.

pool.py says what a shape is; this module boots pooled guests and hands them out, through two
lifecycle paths of their own: ``FILL_STEPS`` make a pooled guest (the create steps behind a
locked check that the shape's pool has room, ending in state ``pooled``), and ``CLAIM_STEPS``
turn a pooled guest into the sandbox (a locked step that takes one and rewrites its record,
then its hostname, through the guest's control channel or else over SSH). Both leave a record
in state ``creating`` while they work, so a killed fill or claim is taken apart by reconcile
like a killed create. Pooled guests hold no GPU, so the fabric step of a fill has nothing to do.
A GPU sandbox claims a GPU-ready guest (spare root ports, gpu/hotplug.py) through
``GPU_CLAIM_STEPS``: its GPUs are chosen and attached live, seen and verified (gpuclaim.py).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from vmsandbox.config import PoolShape
from vmsandbox.errors import FailedPrecondition, NotFound
from vmsandbox.gpu import hotplug
from vmsandbox.gpu.record import GpuRecord
from vmsandbox.guest import control, ssh
from vmsandbox.guest.ssh import Endpoint
from vmsandbox.sandbox import gpuclaim, lifecycle
from vmsandbox.sandbox.pool import NoPooledGuest, PoolFull, fits, holds, is_pool_guest, shape_spec
from vmsandbox.sandbox.record import STATE_CREATING, STATE_POOLED, SandboxFiles, SandboxRecord
from vmsandbox.sandbox.timing import StepTimes
from vmsandbox.vm import virt
from vmsandbox.vm.process import ProcessIdentity

if TYPE_CHECKING:
    from vmsandbox.config import Config
    from vmsandbox.gpu.allocator import Allocation
    from vmsandbox.guest.keys import SandboxKeys
    from vmsandbox.host.model import Inventory
    from vmsandbox.image.store import BaseImage, ImageStore
    from vmsandbox.progress import Progress
    from vmsandbox.sandbox.handle import Sandbox
    from vmsandbox.sandbox.spec import SandboxSpec
    from vmsandbox.sandbox.store import SandboxStore
    from vmsandbox.vm.hypervisor import Hypervisor


# -- the steps ----------------------------------------------------------------------------------


def _room(c: lifecycle.Creation) -> None:
    """Fill: stop when the shape's pool is full (guests still booting count)."""
    if not c.room():
        raise PoolFull(c.spec.image)


def _settle(c: lifecycle.Creation) -> None:
    """Fill: wait until the guest's boot has finished (late units such as cloud-init's last
    stages hold its vCPU): a claim then finds an idle guest that answers at once."""
    if not c.wait:
        return
    assert c.record is not None and c.endpoint is not None  # made by define and wait
    keys = c.files.keys(c.record.host_key_alias)
    # As root first: the user's systemctl needs the system bus, which the project's images
    # start after sshd (it fails at once while the bus is not up); root's talks to systemd.
    wait = "systemctl is-system-running --wait"
    command = f"command -v systemctl >/dev/null && {{ sudo -n {wait} || {wait}; }}"
    ssh.run(c.endpoint, keys, f"{command} >/dev/null 2>&1; true", timeout=c.timeout or 300)


def _pooled(c: lifecycle.Creation) -> None:
    """Fill: the guest answered SSH; it is ready to be claimed."""
    assert c.record is not None  # made by the define step
    c.state = STATE_POOLED
    c.hypervisor.set_metadata(c.domain, c.record.to_dict(), c.state)


def _claim(c: lifecycle.Creation) -> None:
    """Take a ready pooled guest of the spec's shape and make it this sandbox: its record gets
    the sandbox's name, labels, credential and creator, and the GPUs chosen for it (before any
    is attached: a killed claim leaves a record that says what to give back), state creating
    until it is ready."""
    found = c.take_pooled()
    if found is None:
        raise NoPooledGuest(c.spec.image)
    c.files = SandboxFiles.of(c.config, found.stem)  # from here on undos remove that guest
    partition = c.allocation.partition if c.allocation else None
    c.record = replace(
        found,
        name=c.name,
        guest=found.stem,
        labels=dict(c.spec.labels),
        credential=c.spec.credential,
        created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        creator=ProcessIdentity.current(),
        gpus=tuple(GpuRecord.of(gpu) for gpu in c.gpus),
        fabric_partition=partition.id if partition else None,
    )
    c.hypervisor.set_metadata(c.domain, c.record.to_dict(), STATE_CREATING)


def _hostname(c: lifecycle.Creation) -> None:
    """Give the claimed guest the sandbox's name as its hostname: through its control channel
    where it has one, which checks that sshd still runs (its pinned host key was proven when
    the guest entered the pool); a guest of an older build that does not check it gets the
    hostname while a key exchange proves that its sshd answers with the pinned host key.
    Otherwise (stock or imported images, guests pooled before the channel) over SSH."""
    assert c.record is not None  # made by the claim step
    ssh = c.record.ssh
    assert ssh.port is not None  # pooled guests were waited for: their endpoint is known
    c.endpoint = Endpoint(ssh.host, ssh.port, ssh.user)
    keys = c.files.keys(c.record.host_key_alias)
    started = time.monotonic()
    if not c.files.control.exists():
        _hostname_over_ssh(c, keys)
    elif not control.claim(c.files.control, c.name, guest=c.files.name):
        proof = _Proof(c.endpoint, keys)
        proof.start()
        try:
            control.set_hostname(c.files.control, c.name, guest=c.files.name)
        finally:
            proof.join()
        if proof.error is not None:
            raise proof.error
    c.boot_seconds = round(time.monotonic() - started, 3)


class _Proof(threading.Thread):
    """ssh.prove_host_key in a thread of its own, beside the control channel's request."""

    def __init__(self, endpoint: Endpoint, keys: SandboxKeys) -> None:
        super().__init__(name="prove-host-key", daemon=True)
        self.endpoint = endpoint
        self.keys = keys
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            ssh.prove_host_key(self.endpoint, self.keys)
        except Exception as exc:  # raised again by the claim's own thread
            self.error = exc


def _hostname_over_ssh(c: lifecycle.Creation, keys: SandboxKeys) -> None:
    """The hostname through an SSH login and sudo, for guests without the control channel."""
    assert c.endpoint is not None and c.record is not None
    # One sudo running one shell, with builtins only (each program started costs tens of ms
    # under TCG): /etc/hosts first, since sudo looks up the host's name and a name missing from
    # /etc/hosts goes to DNS, which a sandbox without outbound network waits out.
    script = (
        "hosts=$(while IFS= read -r line; do case $line in 127.0.1.1[[:space:]]*) ;; "
        '*) printf "%s\\n" "$line" ;; esac; done < /etc/hosts) && '
        f'printf "%s\\n127.0.1.1 %s\\n" "$hosts" {c.name} > /etc/hosts && '
        f"echo {c.name} > /etc/hostname && echo {c.name} > /proc/sys/kernel/hostname"
    )
    command = f"sudo sh -c {shlex.quote(script)}"
    result = c.guest_run(c.endpoint, keys, command, timeout=60)
    if result.exit_status != 0:
        raise FailedPrecondition(
            f"setting the hostname of sandbox {c.name!r} in pooled guest {c.files.name!r} "
            f"failed (exit {result.exit_status}): {result.stderr.strip()}",
            details={"name": c.name, "guest": c.files.name},
        )


def _remove_guest(r: lifecycle.Remains) -> None:
    r.hypervisor.stop(r.domain)
    r.hypervisor.undefine(r.domain)
    r.files.remove()


def _create_step(name: str) -> lifecycle.Step:
    return next(step for step in lifecycle.CREATE_STEPS if step.name == name)


# A pooled guest: the create steps (no GPU to verify) behind the room check, ending in "pooled".
FILL_STEPS: tuple[lifecycle.Step, ...] = (
    lifecycle.Step("room", _room, locked=True),
    *(step for step in lifecycle.CREATE_STEPS if step.name not in ("verify", "ready")),
    lifecycle.Step("settle", _settle),
    lifecycle.Step("pooled", _pooled),
)
# Claiming a pooled guest. Its undo removes the guest: a half-claimed guest never goes back.
CLAIM_STEPS: tuple[lifecycle.Step, ...] = (
    _create_step("reserve"),
    lifecycle.Step("claim", _claim, _remove_guest, locked=True),
    lifecycle.Step("hostname", _hostname),
    _create_step("ready"),
)
# Claiming a GPU-ready pooled guest for a GPU sandbox (gpuclaim.py): GPUs chosen and the
# partition activated as in a create, the guest taken, the GPUs attached, seen and verified.
GPU_CLAIM_STEPS: tuple[lifecycle.Step, ...] = (
    _create_step("reserve"),
    lifecycle.Step("gpus", gpuclaim.allocate, locked=True),
    _create_step("fabric"),
    lifecycle.Step("claim", _claim, _remove_guest, locked=True),
    lifecycle.Step("attach", gpuclaim.attach, gpuclaim.detach, locked=True),
    lifecycle.Step("hostname", _hostname),
    lifecycle.Step("seen", gpuclaim.seen),
    lifecycle.Step("verify", gpuclaim.verified),
    _create_step("ready"),
)


# -- the pool of one manager ----------------------------------------------------------------------


class PoolOwner(Protocol):
    """What the warm pool uses of the manager that owns it (``SandboxManager`` is one): its
    configuration, libvirt, records and images, its host lock and crash checkpoint, and the
    allocation, inventory, destroy and reconcile of a cold create."""

    config: Config
    hypervisor: Hypervisor
    store: SandboxStore
    images: ImageStore
    progress: Progress
    checkpoint: Callable[[str], None]

    def locked(self) -> contextlib.AbstractContextManager[None]: ...

    def allocate(self, spec: SandboxSpec) -> Allocation | None: ...

    def gpus(self) -> Inventory: ...

    def destroy(self, name: str) -> None: ...

    def reconcile(self) -> dict[str, list[str]]: ...


class WarmPool:
    """The ``[pool]`` shapes of a manager's configuration and their guests in its libvirt."""

    def __init__(self, manager: PoolOwner) -> None:
        self.manager = manager
        self.config = manager.config
        # How a claim runs commands in its guest (the unit tests hand in a fake guest).
        self.guest_run: Callable[..., ssh.ExecResult] = ssh.run

    def creation(
        self, spec: SandboxSpec, name: str, image: BaseImage, say: Progress
    ) -> lifecycle.Creation:
        """A pool path's creation (fill or claim), waited for; the GPUs of a GPU claim are
        chosen by the manager's allocator."""
        m = self.manager
        return lifecycle.Creation(
            hypervisor=m.hypervisor,
            name=name,
            files=SandboxFiles.of(self.config, name),
            config=self.config,
            spec=spec,
            image=image,
            virt_type=virt.for_sandbox(spec.virt_type, self.config, image.kernel, say),
            progress=say,
            exists=lambda n: m.store.lookup(n) is not None,
            allocate=lambda: m.allocate(spec),  # pooled guests hold none; a GPU claim does
            free_port=m.store.free_port,
            # A pooled guest boots before its GPUs are known: never pinned to their NUMA node.
            host_cpus=dict,
            verify=False,  # a GPU claim sets it (claim's ``verify``)
            guest_run=self.guest_run,
        )

    def claim(
        self,
        spec: SandboxSpec,
        name: str,
        image: BaseImage,
        say: Progress,
        verify: bool = True,
        keep: bool = False,
    ) -> Sandbox | None:
        """Claim a ready pooled guest of the spec's shape as sandbox ``name``, with the GPUs
        it asks for attached (``verify``: and verified in the guest); None when the spec has
        no shape or none of its guests is ready with enough spare ports, and for a GPU spec
        that asks to ``keep`` a sandbox whose verification failed (a claim takes a failed
        guest apart): the caller boots cold."""
        shape = next((shape for shape in self.config.pool if fits(shape, spec)), None)
        if shape is None or (keep and spec.gpu is not None):
            return None
        m = self.manager
        creation = self.claiming(shape, spec, name, image, say)
        creation.verify = verify
        steps = GPU_CLAIM_STEPS if spec.gpu is not None else CLAIM_STEPS
        timing = StepTimes(m.checkpoint)
        try:
            lifecycle.run(steps, creation, m.locked, timing)
        except NoPooledGuest:
            say(f"no pooled guest of shape {shape.key!r} is ready; booting one")
            return None
        assert creation.record is not None  # made by the claim step
        sandbox = m.store.view(creation.record, creation.state)
        sandbox.boot_seconds = creation.boot_seconds
        sandbox.stage_seconds = timing.seconds
        say(f"sandbox {name} is {creation.state} (pooled guest {creation.files.name})")
        return sandbox

    def claiming(
        self, shape: PoolShape, spec: SandboxSpec, name: str, image: BaseImage, say: Progress
    ) -> lifecycle.Creation:
        """The creation of a claim of a ready guest of ``shape`` as sandbox ``name``: it takes
        one of the image's build and virt type with a spare port per GPU chosen."""
        creation = self.creation(spec, name, image, say)

        def take() -> SandboxRecord | None:
            for record, state in self.guests():
                ports = len(record.hotplug.buses) if record.hotplug else 0
                if (
                    state == STATE_POOLED
                    and holds(shape, record)
                    and record.image_id == image.id
                    and record.virt_type == creation.virt_type
                    and ports >= len(creation.gpus)
                ):
                    return record
            return None

        creation.take_pooled = take
        return creation

    def refill_in_background(self) -> None:
        """Start ``vmsandbox pool fill`` as a process of its own (not waited for; it outlives
        this one). Its output goes to ``pool-fill.log`` in the state directory."""
        env = {
            "VMSANDBOX_URI": self.config.uri,
            "VMSANDBOX_STATE_DIR": str(self.config.state_dir),
            "VMSANDBOX_IMAGE_DIR": str(self.config.images),
        }
        with open(self.config.state_dir / "pool-fill.log", "ab") as out:
            subprocess.Popen(
                [sys.executable, "-m", "vmsandbox.cli", "pool", "fill"],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,
                env={**os.environ, **env},
            )

    def show(self) -> list[dict[str, Any]]:
        """Each ``[pool]`` shape with its wanted count and its guests (name, state)."""
        guests = self.guests()
        shown = []
        for shape in self.config.pool:
            mine = [(r, s) for r, s in guests if holds(shape, r)]
            shown.append(
                {
                    **shape.to_dict(),
                    "ready": sum(1 for _r, state in mine if state == STATE_POOLED),
                    "guests": [{"name": r.name, "state": state} for r, state in mine],
                }
            )
        return shown

    def guests(self) -> list[tuple[SandboxRecord, str]]:
        """This state directory's unclaimed pooled guests."""
        store = self.manager.store
        return [(r, s) for r, s in store.all() if is_pool_guest(r) and store.local(r)]

    def fill(self, *, progress: Progress | None = None, poll: float = 1.0) -> list[str]:
        """Boot pooled guests until every shape has its count ready; wait for guests other
        processes are booting. Returns the names of the guests this call made."""
        say = progress or self.manager.progress
        made: list[str] = []
        while True:
            for shape in self.config.pool:
                made += self._fill_shape(shape, say)
            if not any(state == STATE_CREATING for _r, state in self.guests()):
                return made
            self.manager.reconcile()  # a filler that died leaves a guest to remove
            time.sleep(poll)

    def _fill_shape(self, shape: PoolShape, say: Progress) -> list[str]:
        """Boot guests of ``shape`` one after the other until its pool is full. Ready guests
        of an older build of the image are removed first: no create would claim them."""
        m = self.manager
        image = m.images.get(shape.image)
        made = []
        for record, state in self.guests():
            if state == STATE_POOLED and holds(shape, record) and record.image_id != image.id:
                say(f"removing pooled guest {record.name}: image {record.image_id} was rebuilt")
                with contextlib.suppress(NotFound):  # claimed or removed meanwhile
                    m.destroy(record.name)

        def room() -> bool:
            held = [r for r, _s in self.guests() if holds(shape, r) and r.image_id == image.id]
            return len(held) < shape.count

        ports: hotplug.HotplugPlan | None = None
        while True:
            spec = shape_spec(shape)
            assert spec.name is not None
            creation = self.creation(spec, spec.name, image, say)
            creation.room = room
            if shape.gpus and ports is None:
                ports = self.spare_ports(shape, creation.virt_type)
            creation.hotplug = ports
            try:
                lifecycle.run(FILL_STEPS, creation, m.locked, m.checkpoint)
            except PoolFull:
                return made
            say(f"pooled guest {spec.name} is ready")
            made.append(spec.name)

    def spare_ports(self, shape: PoolShape, virt_type: str) -> hotplug.HotplugPlan | None:
        """The spare root ports of a GPU-ready shape's guests, sized from this host's
        bindable GPUs; None (a plain pooled guest) when the host has none."""
        gpus = [gpu for gpu in self.manager.gpus().gpus if gpu.bindable]
        planned = hotplug.plan(
            gpus,
            shape.gpus,
            vcpus=shape.cpus,
            memory_mib=shape.memory_mib,
            virt_type=virt_type,
            firmware=self.config.gpu_firmware,
        )
        if planned is None:
            self.manager.progress(f"pool.{shape.key}: no bindable GPU here, no spare GPU ports")
        return planned

    def drain(self) -> list[str]:
        """Remove every unclaimed pooled guest (ready or booting); returns their names."""
        removed = []
        for record, _state in self.guests():
            with contextlib.suppress(NotFound):  # claimed or removed meanwhile
                self.manager.destroy(record.name)
                removed.append(record.name)
        return removed
