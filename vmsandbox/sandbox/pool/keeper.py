"""The warm pool at work: filling it, claiming a guest from it, showing and draining it.

shapes.py says what a shape is; steps.py has the steps that boot pooled guests and hand them
out. This module runs them for one manager:

- ``claim`` claims a ready guest of a create's shape (None: none was ready, boot cold);
- ``fill`` boots guests until every shape has its count; one filler at a time per state
  directory (``pool-fill.lock``): a burst of claims starts at most one background refill
  (``refill_in_background`` starts none while a filler runs, and a filler looks at the pool
  once more after it lets the lock go, so a claim it missed is made up);
- ``drain`` and a fill's removal of guests of an older image build remove only guests that
  are still unclaimed, checked under the host lock by their UUID: a claim in between keeps its
  sandbox.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from vmsandbox.config import PoolShape
from vmsandbox.errors import NotFound
from vmsandbox.gpu import hotplug
from vmsandbox.guest import ssh
from vmsandbox.sandbox import create, reserve, runner
from vmsandbox.sandbox.holds import Holds
from vmsandbox.sandbox.pool.park import RestoreFailed, park_waiting
from vmsandbox.sandbox.pool.shapes import (
    NoPooledGuest,
    PoolFull,
    fits,
    holds,
    is_pool_guest,
    shape_spec,
)
from vmsandbox.sandbox.pool.steps import CLAIM_STEPS, FILL_STEPS, GPU_CLAIM_STEPS
from vmsandbox.sandbox.record import (
    STATE_CREATING,
    STATE_PARKED,
    STATE_POOLED,
    SandboxFiles,
    SandboxRecord,
)
from vmsandbox.sandbox.suspend import GIB, MIB, saved_total
from vmsandbox.sandbox.timing import StepTimes
from vmsandbox.vm import virt

if TYPE_CHECKING:
    from vmsandbox.config import Config
    from vmsandbox.host.model import Inventory
    from vmsandbox.image.store import BaseImage, ImageStore
    from vmsandbox.progress import Progress
    from vmsandbox.sandbox.handle import Sandbox
    from vmsandbox.sandbox.spec import SandboxSpec
    from vmsandbox.sandbox.store import SandboxStore
    from vmsandbox.vm.hypervisor import Hypervisor


# The states of a pooled guest that a claim may take: running, or parked (saved to disk).
READY = (STATE_POOLED, STATE_PARKED)


class PoolOwner(Protocol):
    """What the warm pool uses of the manager that owns it (``SandboxManager`` is one): its
    configuration, libvirt, records and images, its host lock and crash checkpoint, what a
    create reads before it reserves, the inventory, destroy and reconcile."""

    config: Config
    hypervisor: Hypervisor
    store: SandboxStore
    images: ImageStore
    progress: Progress
    checkpoint: Callable[[str], None]

    def locked(self) -> contextlib.AbstractContextManager[None]: ...

    def look(self, spec: SandboxSpec) -> reserve.HostView: ...

    def gpus(self) -> Inventory: ...

    def destroy(self, name: str, *, uuid: str | None = None, pooled_only: bool = False) -> None: ...

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
    ) -> create.Creation:
        """A pool path's creation (fill or claim), waited for."""
        m = self.manager
        return create.Creation(
            hypervisor=m.hypervisor,
            name=name,
            files=SandboxFiles.of(self.config, name),
            config=self.config,
            spec=spec,
            image=image,
            virt_type=virt.for_sandbox(spec.virt_type, self.config, image.kernel, say),
            progress=say,
            look=lambda: m.look(spec),
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
        steps = GPU_CLAIM_STEPS if spec.gpu is not None else CLAIM_STEPS
        for _try in range(shape.count + 1):  # a parked guest that fails to restore is removed
            creation = self.claiming(shape, spec, name, image, say)
            creation.verify = verify
            timing = StepTimes(m.checkpoint)
            try:
                runner.run(steps, creation, m.locked, timing)
                break
            except NoPooledGuest:
                say(f"no pooled guest of shape {shape.key!r} is ready: creating {name} cold")
                return None
            except RestoreFailed as exc:
                say(f"{exc}; it was removed: claiming the next one")
        else:
            say(f"no parked guest of shape {shape.key!r} came back: creating {name} cold")
            return None
        assert creation.record is not None  # made by the claim step
        sandbox = m.store.view(creation.record, creation.state, creation.uuid)
        sandbox.stage_seconds = timing.seconds
        say(f"sandbox {name} is {creation.state} (pooled guest {creation.files.name})")
        return sandbox

    def claiming(
        self, shape: PoolShape, spec: SandboxSpec, name: str, image: BaseImage, say: Progress
    ) -> create.Creation:
        """The creation of a claim of a ready guest of ``shape`` as sandbox ``name``."""
        creation = self.creation(spec, name, image, say)
        creation.pool_key = shape.key
        creation.doing = "claim"
        return creation

    def refill_in_background(self) -> None:
        """Start ``vmsandbox pool fill --if-idle`` as a process of its own (not waited for; it
        outlives this one), unless a filler runs already. Its output goes to ``pool-fill.log``
        in the state directory."""
        if filling(self.config):
            return
        env = {
            "VMSANDBOX_URI": self.config.uri,
            "VMSANDBOX_STATE_DIR": str(self.config.state_dir),
            "VMSANDBOX_IMAGE_DIR": str(self.config.images),
        }
        with open(self.config.state_dir / "pool-fill.log", "ab") as out:
            subprocess.Popen(
                [sys.executable, "-m", "vmsandbox.cli", "pool", "fill", "--if-idle"],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,
                env={**os.environ, **env},
            )

    def refill_if_short(self) -> None:
        """``refill_in_background`` when a shape has fewer guests than its count (ready,
        booting or reserved): after a ``--no-refill`` claim or a burst of claims, any later
        create starts the refill."""
        if self.config.pool and not filling(self.config) and self._room_left():
            self.refill_in_background()

    def show(self) -> list[dict[str, Any]]:
        """Each ``[pool]`` shape with its wanted count and its guests (name, state)."""
        guests = self.guests()
        shown = []
        for shape in self.config.pool:
            mine = [(r, s) for r, s, _uuid in guests if holds(shape, r)]
            shown.append(
                {
                    **shape.to_dict(),
                    "ready": sum(1 for _r, state in mine if state in READY),
                    "guests": [{"name": r.name, "state": state} for r, state in mine],
                }
            )
        return shown

    def unshaped(self) -> list[dict[str, Any]]:
        """This state directory's unclaimed pooled guests that fit no ``[pool]`` shape (the
        configuration changed since they were booted): they still run and hold their memory
        (or, parked, their save file) until ``drain`` removes them."""
        return [
            {"name": r.name, "state": state, "image": r.image, "memory_mib": r.memory_mib}
            for r, state, _uuid in self.guests()
            if not any(holds(shape, r) for shape in self.config.pool)
        ]

    def guests(self) -> list[tuple[SandboxRecord, str, str]]:
        """This state directory's unclaimed pooled guests: record, state, domain UUID."""
        store = self.manager.store
        return [
            (found.record, found.state, found.uuid)
            for found in store.found()
            if is_pool_guest(found.record) and store.local(found.record)
        ]

    def fill(
        self, *, progress: Progress | None = None, poll: float = 1.0, if_idle: bool = False
    ) -> list[str]:
        """Boot pooled guests until every shape has its count ready; wait for guests other
        processes are booting. Returns the names of the guests this call made. One filler at
        a time: ``if_idle`` returns at once when another runs (it fills what this one would),
        else this one waits for its turn."""
        say = progress or self.manager.progress
        made: list[str] = []
        while True:
            with _fill_lock(self.config, wait=not if_idle) as mine:
                if not mine:
                    return made
                made += self._fill_all(say, poll)
                if any(shape.park for shape in self.config.pool):  # else no guest to list
                    m = self.manager
                    park_waiting(self.config, m.hypervisor, m.locked, self.guests(), say)
            # a claim after this filler's last look is made up (a park that failed is not
            # tried again at once)
            if not self._room_left(parks=False):
                return made

    def _fill_all(self, say: Progress, poll: float) -> list[str]:
        made: list[str] = []
        while True:
            for shape in self.config.pool:
                made += self._fill_shape(shape, say)
            if not any(state == STATE_CREATING for _r, state, _u in self.guests()):
                return made
            self.manager.reconcile()  # a filler that died leaves a guest to remove
            time.sleep(poll)

    def _room_left(self, *, parks: bool = True) -> bool:
        """Whether a filler has work: a shape short of guests, or (``parks``) a running
        guest of a ``park`` shape that the host's saves now have room for."""
        with self.manager.locked():
            current = Holds(self.config).all()
        room = self.config.max_saved_gib * GIB - saved_total(current)
        for shape in self.config.pool:
            mine = [hold for hold in current.values() if hold.pool == shape.key]
            if len(mine) < shape.count:
                return True
            waiting = [h for h in mine if h.owner is None and not h.saved_bytes]
            if parks and shape.park and waiting and shape.memory_mib * MIB <= room:
                return True
        return False

    def _fill_shape(self, shape: PoolShape, say: Progress) -> list[str]:
        """Boot guests of ``shape`` one after the other until its pool is full. Ready guests
        of an older build of the image are removed first: no create would claim them."""
        m = self.manager
        image = m.images.get(shape.image)
        made: list[str] = []
        for record, state, uuid in self.guests():
            if state in READY and holds(shape, record) and record.image_id != image.id:
                say(f"removing pooled guest {record.name}: image {record.image_id} was rebuilt")
                with contextlib.suppress(NotFound):  # claimed or removed meanwhile
                    m.destroy(record.name, uuid=uuid, pooled_only=True)

        def room(now: reserve.Taken) -> bool:
            held = [h for h in now.holds.values() if h.pool == shape.key and h.image_id == image.id]
            return len(held) < shape.count

        ports: hotplug.HotplugPlan | None = None
        while True:
            spec = shape_spec(shape)
            assert spec.name is not None
            creation = self.creation(spec, spec.name, image, say)
            creation.room = room
            creation.pool_key = shape.key
            creation.doing = "fill"
            if shape.gpus and ports is None:
                ports = self.spare_ports(shape, creation.virt_type)
            creation.hotplug = ports
            try:
                runner.run(FILL_STEPS, creation, m.locked, m.checkpoint)
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
        for record, _state, uuid in self.guests():
            with contextlib.suppress(NotFound):  # claimed or removed meanwhile
                self.manager.destroy(record.name, uuid=uuid, pooled_only=True)
                removed.append(record.name)
        return removed


def filling(config: Config) -> bool:
    """Whether a pool filler holds this state directory's fill lock now."""
    with _fill_lock(config, wait=False) as mine:
        return not mine


@contextlib.contextmanager
def _fill_lock(config: Config, *, wait: bool) -> Iterator[bool]:
    """The fill lock (``flock`` on ``pool-fill.lock``): True while held; False, at once,
    when another process holds it and ``wait`` is off."""
    fd = os.open(config.state_dir / "pool-fill.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)
