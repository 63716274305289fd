"""SandboxManager: the path of one sandbox, from request to a running, reachable VM, and back.

It orchestrates and nothing else. The record and files are record.py's; planning the domain is
plan.py's; the create steps and their undos are lifecycle.py's; the boot wait is boot.py's
(console reading: console.py); reconcile is reconcile.py's; libvirt is behind hypervisor.py's
``Hypervisor``. libvirt is the source of truth: every sandbox is a persistent domain whose
metadata holds its record: ``vmsbx-<name>`` when it was created cold, ``vmsbx-pool-<id>`` when it
was claimed from the warm pool (pool.py; its <title> and record carry the sandbox's name).
"""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import IO, TYPE_CHECKING, Any

from vmsandbox import guest, lifecycle, pool, virt
from vmsandbox import plan as planner
from vmsandbox.boot import check_timeout
from vmsandbox.config import Config
from vmsandbox.errors import FailedPrecondition, InvalidArgument, NotFound
from vmsandbox.hypervisor import Hypervisor, LibvirtHypervisor
from vmsandbox.images import BaseImage, ImageStore
from vmsandbox.keys import SandboxKeys
from vmsandbox.lock import host_lock
from vmsandbox.progress import Progress, silent
from vmsandbox.reconcile import reconcile as reconcile_sandboxes
from vmsandbox.record import (
    DOMAIN_PREFIX,
    STATE_CREATING,
    STATE_DEFINED,
    STATE_POOLED,
    SandboxFiles,
    SandboxRecord,
    names_domain,
    prepare_state_dirs,
)
from vmsandbox.sandbox import Sandbox
from vmsandbox.spec import SandboxSpec, generate_name, validate_name

if TYPE_CHECKING:
    import libvirt

    from vmsandbox.host.model import Gpu, Inventory


def _no_checkpoint(_stage: str) -> None:
    """The default crash checkpoint: nothing (tests install one that stops the create)."""


class SandboxManager:
    """Create, find, use and destroy sandboxes on one host.

    ``checkpoint(stage)`` is called after each create step (see lifecycle.py); the crash tests
    install one that stops there to be killed. ``hypervisor`` defaults to libvirt at
    ``config.uri``; unit tests hand in a fake.
    """

    checkpoint: Callable[[str], None] = staticmethod(_no_checkpoint)

    def __init__(
        self,
        config: Config | None = None,
        *,
        progress: Progress = silent,
        reconcile: bool = True,
        hypervisor: Hypervisor | None = None,
        checkpoint: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config or Config.load()
        self.progress = progress
        self.hypervisor = hypervisor or LibvirtHypervisor(self.config.uri)
        if checkpoint is not None:
            self.checkpoint = checkpoint
        self.images = ImageStore(self.config.images)
        prepare_state_dirs(self.config)
        if reconcile:
            self.reconcile()

    @property
    def conn(self) -> libvirt.virConnect:
        """The libvirt connection (for tools beside the manager, such as the benchmarks)."""
        if not isinstance(self.hypervisor, LibvirtHypervisor):
            raise FailedPrecondition("this manager does not run on libvirt")
        return self.hypervisor.conn

    def close(self) -> None:
        self.hypervisor.close()

    def __enter__(self) -> SandboxManager:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _locked(self) -> contextlib.AbstractContextManager[None]:
        return host_lock(self.config.lock_path)

    def _sandboxes(self) -> list[tuple[SandboxRecord, str]]:
        """Our sandboxes (any state directory) with their recorded state. A record of a newer
        vmsandbox is refused when it is this state directory's, and skipped otherwise."""
        found = []
        for stored in self.hypervisor.list(DOMAIN_PREFIX):
            if stored.data is None or not names_domain(stored.data, stored.domain):
                continue
            try:
                found.append((SandboxRecord.from_dict(stored.data), stored.state))
            except FailedPrecondition:
                if str(stored.data.get("keys", "")).startswith(f"{self.config.sandboxes}/"):
                    raise
        return found

    def _lookup(self, name: str) -> tuple[SandboxRecord, str] | None:
        """Sandbox ``name`` by its record: domain ``vmsbx-<name>`` when created cold, else the
        claimed pooled guest whose record names it."""
        stored = self.hypervisor.metadata(DOMAIN_PREFIX + name)
        if stored is not None:
            if stored.data is None or not names_domain(stored.data, stored.domain):
                raise FailedPrecondition(
                    f"domain {stored.domain!r} exists but was not made by vmsandbox; "
                    "not touching it"
                )
            return SandboxRecord.from_dict(stored.data), stored.state
        return next(
            (found for found in self._sandboxes() if found[0].guest and found[0].name == name),
            None,
        )

    def _local(self, record: SandboxRecord) -> bool:
        """Whether this state directory made the sandbox (its record names our keys folder)."""
        return record.keys == str(SandboxFiles.of(self.config, record.stem).keys_dir)

    def _store(self, record: SandboxRecord, state: str) -> None:
        self.hypervisor.set_metadata(record.domain, record.to_dict(), state)

    # -- create -------------------------------------------------------------------------------

    def check_caps(self, spec: SandboxSpec) -> None:
        planner.check_caps(spec, self.config)

    def create(
        self,
        spec: SandboxSpec,
        *,
        wait: bool = True,
        start: bool = True,
        verify: bool = True,
        keep_on_failure: bool = False,
        timeout: float | None = None,
        progress: Progress | None = None,
        refill: bool = True,
    ) -> Sandbox:
        """Create and start a sandbox; with ``wait``, return once SSH accepts its key.

        ``start=False`` only defines it (GPUs held, state ``defined``); ``wait=False`` starts it
        without waiting (state ``started``). With ``verify`` (and ``wait``), the GPUs are
        checked from inside the guest; a failed check raises GuestVerificationFailed and
        removes the sandbox unless ``keep_on_failure``.

        A started spec of a ``[pool]`` shape claims a ready pooled guest when there is one
        (``boot_seconds`` is then the claim's SSH time) and, with ``refill``, starts a
        background ``vmsandbox pool fill`` without waiting for it; otherwise it boots cold.

        Any failure undoes every step this call made (lifecycle.py) before the error
        propagates, which also frees the GPUs it had chosen.
        """
        say = progress or self.progress
        check_timeout(timeout)
        self.check_caps(spec)
        if spec.name is not None and spec.name.startswith(pool.POOL_PREFIX):
            raise InvalidArgument(
                f"name {spec.name!r} starts with {pool.POOL_PREFIX!r}, which is kept for the "
                "warm pool's guests; choose another name",
                details={"field": "name", "value": spec.name},
            )
        image = self.images.get(spec.image)
        planner.check_disk(spec, image)
        name = spec.name or generate_name()
        shape = next((shape for shape in self.config.pool if shape.fits(spec)), None)
        if start and shape is not None:
            claimed = self._claim(spec, name, image, shape, say)
            if claimed is not None:
                if refill:
                    self._refill_in_background()
                return claimed
        creation = lifecycle.Creation(
            hypervisor=self.hypervisor,
            name=name,
            files=SandboxFiles.of(self.config, name),
            config=self.config,
            spec=spec,
            image=image,
            virt_type=self._virt_type(spec, image, say),
            progress=say,
            exists=lambda n: self._lookup(n) is not None,
            choose_gpus=functools.partial(self._choose_gpus, spec),
            free_port=self._free_port,
            host_cpus=_host_cpus,
            timeout=timeout,
            start=start,
            wait=wait,
            verify=verify,
        )
        skip = lifecycle.STARTING if not start else frozenset()
        steps = tuple(step for step in lifecycle.CREATE_STEPS if step.name not in skip)
        lifecycle.run(steps, creation, self._locked, self.checkpoint)
        assert creation.record is not None  # made by the define step
        record, state = creation.record, creation.state
        sandbox = self._sandbox(record, state)
        sandbox.boot_seconds = creation.boot_seconds
        lifecycle.check_verification(creation, self._locked, keep=keep_on_failure)
        say(f"sandbox {name} is {state}")
        return sandbox

    def _creation(
        self, spec: SandboxSpec, name: str, image: BaseImage, say: Progress
    ) -> lifecycle.Creation:
        """A pool path's creation (fill or claim): no GPUs, waited for."""
        return lifecycle.Creation(
            hypervisor=self.hypervisor,
            name=name,
            files=SandboxFiles.of(self.config, name),
            config=self.config,
            spec=spec,
            image=image,
            virt_type=self._virt_type(spec, image, say),
            progress=say,
            exists=lambda n: self._lookup(n) is not None,
            choose_gpus=list,
            free_port=self._free_port,
            host_cpus=_host_cpus,
            verify=False,
        )

    def _claim(
        self,
        spec: SandboxSpec,
        name: str,
        image: BaseImage,
        shape: pool.PoolShape,
        say: Progress,
    ) -> Sandbox | None:
        """Claim a ready pooled guest of ``shape`` as sandbox ``name``; None when none is
        ready (the caller boots cold)."""
        creation = self._creation(spec, name, image, say)

        def take() -> SandboxRecord | None:
            wanted = creation.virt_type
            for record, state in self._sandboxes():
                if (
                    state == STATE_POOLED
                    and pool.is_pool_guest(record)
                    and shape.holds(record)
                    and record.image_id == image.id
                    and record.virt_type == wanted
                    and self._local(record)
                ):
                    return record
            return None

        creation.take_pooled = take
        try:
            lifecycle.run(lifecycle.CLAIM_STEPS, creation, self._locked, self.checkpoint)
        except pool.NoPooledGuest:
            say(f"no pooled guest of shape {shape.key!r} is ready; booting one")
            return None
        assert creation.record is not None  # made by the claim step
        sandbox = self._sandbox(creation.record, creation.state)
        sandbox.boot_seconds = creation.boot_seconds
        say(f"sandbox {name} is {creation.state} (pooled guest {creation.files.name})")
        return sandbox

    def _refill_in_background(self) -> None:
        """Start ``vmsandbox pool fill`` as a process of its own (not waited for; it outlives
        this one). Its output goes to ``pool-fill.log`` in the state directory."""
        log = self.config.state_dir / "pool-fill.log"
        with open(log, "ab") as out:
            subprocess.Popen(
                [sys.executable, "-m", "vmsandbox.cli", "pool", "fill"],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,
                env={**os.environ, **self._env()},
            )

    def _env(self) -> dict[str, str]:
        """The settings a child CLI needs to act on this manager's libvirt and state."""
        return {
            "VMSANDBOX_URI": self.config.uri,
            "VMSANDBOX_STATE_DIR": str(self.config.state_dir),
            "VMSANDBOX_IMAGE_DIR": str(self.config.images),
        }

    # -- the warm pool ------------------------------------------------------------------------

    def pool(self) -> list[dict[str, Any]]:
        """Each ``[pool]`` shape with its wanted count and its guests (name, state)."""
        guests = self._pool_guests()
        shown = []
        for shape in self.config.pool:
            mine = [(r, s) for r, s in guests if shape.holds(r)]
            shown.append(
                {
                    **shape.to_dict(),
                    "ready": sum(1 for _r, state in mine if state == STATE_POOLED),
                    "guests": [{"name": r.name, "state": state} for r, state in mine],
                }
            )
        return shown

    def _pool_guests(self) -> list[tuple[SandboxRecord, str]]:
        """This state directory's unclaimed pooled guests."""
        return [
            (record, state)
            for record, state in self._sandboxes()
            if pool.is_pool_guest(record) and self._local(record)
        ]

    def fill_pool(self, *, progress: Progress | None = None, poll: float = 1.0) -> list[str]:
        """Boot pooled guests until every shape has its count ready; wait for guests other
        processes are booting. Returns the names of the guests this call made."""
        say = progress or self.progress
        made: list[str] = []
        while True:
            for shape in self.config.pool:
                made += self._fill_shape(shape, say)
            if not any(state == STATE_CREATING for _r, state in self._pool_guests()):
                return made
            self.reconcile()  # a filler that died leaves a guest to remove, not to wait for
            time.sleep(poll)

    def _fill_shape(self, shape: pool.PoolShape, say: Progress) -> list[str]:
        """Boot guests of ``shape`` one after the other until its pool is full. Ready guests
        of an older build of the image are removed first: no create would claim them."""
        image = self.images.get(shape.image)
        made = []
        for record, state in self._pool_guests():
            if state == STATE_POOLED and shape.holds(record) and record.image_id != image.id:
                say(f"removing pooled guest {record.name}: image {record.image_id} was rebuilt")
                with contextlib.suppress(NotFound):  # claimed or removed meanwhile
                    self.destroy(record.name)

        def room() -> bool:
            held = [
                record
                for record, _state in self._pool_guests()
                if shape.holds(record) and record.image_id == image.id
            ]
            return len(held) < shape.count

        while True:
            spec = shape.spec()
            assert spec.name is not None
            creation = self._creation(spec, spec.name, image, say)
            creation.room = room
            try:
                lifecycle.run(lifecycle.FILL_STEPS, creation, self._locked, self.checkpoint)
            except pool.PoolFull:
                return made
            say(f"pooled guest {spec.name} is ready")
            made.append(spec.name)

    def drain_pool(self) -> list[str]:
        """Remove every unclaimed pooled guest (ready or booting); returns their names."""
        removed = []
        for record, _state in self._pool_guests():
            with contextlib.suppress(NotFound):  # claimed or removed meanwhile
                self.destroy(record.name)
                removed.append(record.name)
        return removed

    def verify(self, name: str) -> dict[str, Any]:
        """Re-run the in-guest GPU verification of a running sandbox; the report is stored."""
        record, state = self._get(name)
        files = SandboxFiles.of(self.config, record.stem)
        report = lifecycle.verify_guest(record, self._endpoint(record), files)
        self._store(replace(record, verification=report), state)
        return report

    def dry_run(self, spec: SandboxSpec) -> tuple[str, list[Gpu]]:
        """The domain XML and GPUs that ``create`` would use now; defines and writes nothing.

        Needs no built image: an image that is not built yet is shown at the path it will have.
        """
        self.check_caps(spec)
        name = spec.name or generate_name()
        try:
            image: BaseImage | None = self.images.get(spec.image)
        except NotFound:
            image = None
        virt_type = self.config.virt_type if spec.virt_type == "auto" else spec.virt_type
        if virt_type == "auto":
            virt_type = virt.cached(cache=self.config.state_dir / "virt-probe.json") or "qemu"
        with self._locked():
            gpus = self._choose_gpus(spec)
            port = self._free_port() if self.config.network == "user" else None
        planned = planner.plan(
            spec,
            name=name,
            config=self.config,
            image=image,
            virt_type=virt_type,
            gpus=gpus,
            port=port,
            host_cpus=_host_cpus() if gpus else None,
        )
        return planned.xml(), gpus

    def _virt_type(self, spec: SandboxSpec, image: BaseImage, say: Progress) -> str:
        requested = spec.virt_type if spec.virt_type != "auto" else self.config.virt_type
        cache = self.config.state_dir / "virt-probe.json"
        if requested == "auto" and virt.cached(cache=cache) is None:
            say("probing whether KVM runs guests on this host (once, then cached)")
        return virt.resolve(requested, cache=cache, kernel=image.kernel)

    def _choose_gpus(self, spec: SandboxSpec) -> list[Gpu]:
        """Under the host lock: the GPUs for ``spec``, free on every domain of the connection."""
        if spec.gpu is None:
            return []
        from vmsandbox import allocator

        return allocator.select(spec.gpu, self.gpus(), max_gpus=self.config.max_gpus)

    def gpus(self) -> Inventory:
        """The host's GPU inventory, with ``in_use_by`` read from all libvirt domains."""
        from vmsandbox.host import discover

        return discover(in_use=self.hypervisor.hostdev_holders())

    def _free_port(self) -> int:
        """A loopback port that no sandbox of ours forwards and nothing listens on now."""
        return planner.free_port({record.ssh.port for record, _state in self._sandboxes()})

    # -- read ---------------------------------------------------------------------------------

    def _sandbox(self, record: SandboxRecord, state: str) -> Sandbox:
        running = self.hypervisor.running(record.domain)
        shown = state if running or state in (STATE_CREATING, STATE_DEFINED) else "stopped"
        return Sandbox.of(record, shown, SandboxFiles.of(self.config, record.stem))

    def _get(self, name: str) -> tuple[SandboxRecord, str]:
        validate_name(name)
        found = self._lookup(name)
        if found is None:
            raise NotFound(f"sandbox {name!r} does not exist", details={"name": name})
        return found

    def get(self, name: str) -> Sandbox:
        record, state = self._get(name)
        if record.ssh.port is None:  # libvirt network: learn the DHCP address once, keep it
            address = self.hypervisor.lease_address(record.domain)
            if address is not None:
                record = replace(record, ssh=replace(record.ssh, host=address, port=22))
                self._store(record, state)
        return self._sandbox(record, state)

    def list(self) -> list[Sandbox]:
        """The sandboxes (pooled guests not claimed yet are the pool's: ``pool``)."""
        return sorted(
            (
                self._sandbox(record, state)
                for record, state in self._sandboxes()
                if not pool.is_pool_guest(record)
            ),
            key=lambda sandbox: sandbox.name,
        )

    # -- use ----------------------------------------------------------------------------------

    def keys_of(self, sandbox: Sandbox) -> SandboxKeys:
        stem = sandbox.domain.removeprefix(DOMAIN_PREFIX)  # a claimed guest's files keep its name
        return SandboxFiles.of(self.config, stem).keys(sandbox.host_key_alias)

    def _endpoint(self, record: SandboxRecord) -> guest.Endpoint:
        if record.ssh.port is None:
            raise FailedPrecondition(f"sandbox {record.name!r} has no SSH endpoint yet")
        return guest.Endpoint(record.ssh.host, record.ssh.port, record.ssh.user)

    def exec(
        self,
        name: str,
        command: Sequence[str] | str,
        *,
        timeout: float | None = None,
        stdout: IO[bytes] | None = None,
        stderr: IO[bytes] | None = None,
    ) -> guest.ExecResult:
        """Run a command in the sandbox: a list is quoted word by word; a string is a shell line."""
        sandbox = self.get(name)
        if sandbox.ssh is None:
            raise FailedPrecondition(f"sandbox {name!r} has no SSH endpoint yet")
        check_timeout(timeout)
        command = guest.shell_command(command)
        keys = self.keys_of(sandbox)
        return guest.run(sandbox.ssh, keys, command, timeout=timeout, stdout=stdout, stderr=stderr)

    def ssh_argv(self, name: str, command: Sequence[str] = ()) -> list[str]:
        """The OpenSSH command line that logs into the sandbox with its pinned host key."""
        sandbox = self.get(name)
        if sandbox.ssh is None:
            raise FailedPrecondition(f"sandbox {name!r} has no SSH endpoint yet")
        return guest.ssh_argv(sandbox.ssh, self.keys_of(sandbox), command)

    # -- destroy ------------------------------------------------------------------------------

    def destroy(self, name: str) -> None:
        """Stop and remove the sandbox: domain, NVRAM, overlay, seed, keys, console and QEMU
        logs. Idempotent in effect: whatever is left of it is removed; NOT_FOUND only when
        nothing of it existed; FAILED_PRECONDITION naming what could not be removed."""
        validate_name(name)
        found = self._lookup(name)
        if found is not None:  # stopped before the lock: a hung QEMU must not hold it
            self.hypervisor.stop(found[0].domain)
        with self._locked():  # looked up again: a create may have defined it meanwhile
            found = self._lookup(name)
            files = SandboxFiles.of(self.config, found[0].stem if found else name)
            if found is None and not files.existing():
                raise NotFound(f"sandbox {name!r} does not exist", details={"name": name})
            remains = lifecycle.Remains(self.hypervisor, name, files, found[0] if found else None)
            lifecycle.teardown(remains, contextlib.nullcontext)

    # -- repair -------------------------------------------------------------------------------

    def reconcile(self) -> dict[str, list[str]]:
        """Finish removing half-made sandboxes of this state directory (reconcile.py); returns
        what was removed and what could not be fixed."""
        with self._locked():
            local = [(record, state) for record, state in self._sandboxes() if self._local(record)]
            return reconcile_sandboxes(self.hypervisor, self.config, local).to_dict()


def _host_cpus() -> dict[int, list[int]]:
    from vmsandbox import passthrough

    return passthrough.host_cpus_by_node()
