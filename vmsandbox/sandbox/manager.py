"""SandboxManager: the path of one sandbox, from request to a running, reachable VM, and back.

It orchestrates and nothing else: each step is the work of a module of this package (the
package's docstring says which), libvirt is behind vm/hypervisor.py's ``Hypervisor`` and the
source of truth: every sandbox is a persistent domain whose metadata holds its record. Names
find sandboxes; a found sandbox's identity is its domain's UUID (``Sandbox.uuid``), which
``destroy``, ``stop`` and ``start`` take to act on that sandbox only.
"""

from __future__ import annotations

import builtins
import contextlib
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from vmsandbox.config import Config
from vmsandbox.errors import FailedPrecondition
from vmsandbox.guest import ssh
from vmsandbox.host.numa import host_cpus_by_node
from vmsandbox.image.store import BaseImage, ImageStore
from vmsandbox.lock import host_lock
from vmsandbox.progress import Progress, silent
from vmsandbox.sandbox import (
    create,
    custody,
    dryrun,
    health,
    lifetime,
    power,
    reserve,
    runner,
    teardown,
)
from vmsandbox.sandbox import plan as planner
from vmsandbox.sandbox.access import SandboxAccess
from vmsandbox.sandbox.boot import check_timeout
from vmsandbox.sandbox.create import Creation
from vmsandbox.sandbox.handle import Sandbox
from vmsandbox.sandbox.pool.keeper import WarmPool
from vmsandbox.sandbox.pool.shapes import check_not_pooled_name, is_pool_guest
from vmsandbox.sandbox.reconcile import reconcile as reconcile_sandboxes
from vmsandbox.sandbox.record import (
    STATE_READY,
    SandboxFiles,
    prepare_state_dirs,
)
from vmsandbox.sandbox.resume import resume as resume_sandbox
from vmsandbox.sandbox.settle import UNSETTLED, require_running, settle, settle_all
from vmsandbox.sandbox.spec import SandboxSpec, generate_name
from vmsandbox.sandbox.store import SandboxStore
from vmsandbox.sandbox.suspend import suspend as suspend_sandbox
from vmsandbox.vm import virt
from vmsandbox.vm.hypervisor import Hypervisor, LibvirtHypervisor

if TYPE_CHECKING:
    import libvirt

    from vmsandbox.host.model import Gpu, Inventory


class SandboxManager(SandboxAccess):
    """Create, find, use, stop, start and destroy sandboxes on one host.

    ``checkpoint(stage)`` is called after each create step (see create.py); the crash tests
    install one that stops there to be killed. ``hypervisor`` defaults to libvirt at
    ``config.uri``; unit tests hand in a fake.
    """

    checkpoint: Callable[[str], None] = staticmethod(runner.no_checkpoint)
    guest_run: Callable[..., ssh.ExecResult] = staticmethod(ssh.run)  # suspend's, resume's

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
        self.store = SandboxStore(self.hypervisor, self.config)
        self.pool = WarmPool(self)
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

    def locked(self, purpose: str = "") -> contextlib.AbstractContextManager[None]:
        """The host lock, for a short state transition (vmsandbox/lock.py)."""
        return host_lock(self.config.lock_path, self.config.lock_timeout, purpose)

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

        A started spec of a ``[pool]`` shape claims a ready pooled guest (GPUs attached live),
        then (``refill``) starts a background ``vmsandbox pool fill``; else it boots cold, and
        (``refill``) starts one when the pool is short of guests.

        Any failure undoes every step this call made (create.py) before the error
        propagates, which also frees the GPUs it had chosen.
        """
        say = progress or self.progress
        check_timeout(timeout)
        self.check_caps(spec)
        check_not_pooled_name(spec.name)
        image = self.images.get(spec.image)
        planner.check_disk(spec, image)
        name = spec.name or generate_name()
        claim = start and self.pool.claim(spec, name, image, say, verify, keep_on_failure)
        if claim:
            if refill:
                self.pool.refill_in_background()
            return claim
        creation = self._creation(spec, name, image, say, timeout=timeout)
        creation.start, creation.wait, creation.verify = start, wait, verify
        creation.keep = keep_on_failure
        skip = create.STARTING if not start else frozenset()
        steps = tuple(step for step in create.CREATE_STEPS if step.name not in skip)
        runner.run(steps, creation, self.locked, self.checkpoint)
        assert creation.record is not None  # made by the define step
        sandbox = self.store.view(creation.record, creation.state, creation.uuid)
        create.check_verification(creation)  # a sandbox kept although its check failed
        say(f"sandbox {name} is {creation.state}")
        if refill and start:
            self.pool.refill_if_short()  # a claim without refill, or a burst, left it short
        return sandbox

    def _creation(
        self, spec: SandboxSpec, name: str, image: BaseImage, say: Progress, **more: Any
    ) -> Creation:
        return Creation(
            hypervisor=self.hypervisor,
            name=name,
            config=self.config,
            files=SandboxFiles.of(self.config, name),
            spec=spec,
            image=image,
            virt_type=virt.for_sandbox(spec.virt_type, self.config, image.kernel, say),
            progress=say,
            look=lambda: self.look(spec),
            host_cpus=host_cpus_by_node,
            **more,
        )

    def verify(self, name: str) -> dict[str, Any]:
        """Re-run the in-guest GPU verification of a running sandbox; the report is stored (in
        that sandbox only: NOT_FOUND when it was removed meanwhile). FAILED_PRECONDITION for a
        guest that does not run, UNAVAILABLE for one whose sshd does not answer with the pinned
        host key (a sandbox without GPUs is checked for that)."""
        sandbox = self.get(name)
        require_running(sandbox, "verify")
        found = self.store.require(name, sandbox.uuid)
        files = SandboxFiles.of(self.config, found.record.stem)
        endpoint = self._endpoint(found.record)
        ssh.prove_host_key(endpoint, files.keys(found.record.host_key_alias))
        report = create.verify_guest(found.record, endpoint, files)
        with self.locked("record a verification"):
            self.store.commit(found, lambda now: replace(now, verification=report))
        health.from_verification(self, found.record, report)  # Xids that quarantine a GPU
        return report

    def dry_run(self, spec: SandboxSpec) -> tuple[str, builtins.list[Gpu]]:
        """The domain XML and GPUs that ``create`` would use now, refusing what it refuses;
        defines and writes nothing (dryrun.py)."""
        planned = dryrun.dry_run(self, spec)
        return planned.xml(), list(planned.gpus)

    def look(self, spec: SandboxSpec) -> reserve.HostView:
        """What a create of ``spec`` reads before it reserves (``reserve.look``)."""
        return reserve.look(self.hypervisor, self.config, spec.gpu is not None, self.gpus)

    def gpus(self, in_use: Mapping[str, str] | None = None) -> Inventory:
        """The host's GPU inventory, with ``in_use_by`` from ``in_use`` (BDF -> domain), read
        from all libvirt domains when not given, and each GPU's custody (custody.py)."""
        from vmsandbox.host import discover

        holders = self.hypervisor.hostdev_holders() if in_use is None else in_use
        found = discover(in_use=holders, require_reset=self.config.require_gpu_reset)
        return custody.shown(self.config, found)

    # -- read ---------------------------------------------------------------------------------

    def get(self, name: str, *, uuid: str | None = None) -> Sandbox:
        """Sandbox ``name``; with ``uuid``, only the sandbox of that identity (NOT_FOUND). A
        state that said only what the last call saw is looked at again first (settle.py)."""
        found = settle(self.store, self.locked, self.store.require(name, uuid))
        record = self.store.with_address(found.record, found.state, found.uuid)
        return self.store.view(record, found.state, found.uuid)

    def list(self) -> list[Sandbox]:
        """The sandboxes, their states settled as ``get``'s (pooled guests not claimed yet are
        the pool's: ``pool.show``)."""
        found = [f for f in self.store.found() if not is_pool_guest(f.record)]
        settled = settle_all(self.store, self.locked, found)
        views = (self.store.view(f.record, f.state, f.uuid) for f in settled)
        return sorted(views, key=lambda sandbox: sandbox.name)

    # -- power (power.py) ----------------------------------------------------------------------

    def stop(self, name: str, *, grace: float = 60.0, uuid: str | None = None) -> Sandbox:
        """Shut the guest down, disk and GPUs kept: its power button, then power off after
        ``grace`` seconds. Idempotent: a sandbox that does not run is left as it is. With
        ``uuid``: only the sandbox with that identity (NOT_FOUND otherwise)."""
        check_timeout(grace, field="grace")
        found = self.store.require(name, uuid)
        power.check_powerable(found.record, found.state)
        power.stop(
            self.hypervisor, found.record.domain, grace=grace, uuid=found.uuid, say=self.progress
        )
        return self.get(name, uuid=found.uuid)

    def start(
        self,
        name: str,
        *,
        wait: bool = True,
        verify: bool = True,
        timeout: float | None = None,
        uuid: str | None = None,
    ) -> Sandbox:
        """Start a stopped (or only defined) sandbox, its GPUs passed through again; with
        ``wait``, return once it is ready. Idempotent: a running sandbox is returned as it is,
        after a wait for it when it shows ``started`` or ``failed`` (settle.py). A GPU gone from
        the host: FAILED_PRECONDITION, the sandbox left as it was; an SSH port taken meanwhile
        moves."""
        check_timeout(timeout)
        found = self.store.require(name, uuid)
        unsettled = self.store.view(found.record, found.state, found.uuid).state in UNSETTLED
        if (power.start(self.hypervisor, self.config, found, self.locked) or unsettled) and wait:
            return self.wait(name, verify=verify, timeout=timeout, uuid=found.uuid)
        return self.get(name, uuid=found.uuid)

    def wait(
        self,
        name: str,
        *,
        verify: bool = True,
        timeout: float | None = None,
        uuid: str | None = None,
    ) -> Sandbox:
        """Wait until a started sandbox (with ``uuid``: of that identity) answers SSH, verify
        its GPUs and mark it ready, or failed with why (NOT_FOUND when removed meanwhile)."""
        check_timeout(timeout)
        found = self.store.require(name, uuid)
        how = (self.progress, self.locked, verify, timeout)
        record, waited = power.wait(self.hypervisor, self.config, found, *how)
        sandbox = self.store.view(record, STATE_READY, found.uuid)
        sandbox.boot_seconds = waited
        return sandbox

    def set_generation(self, name: str, generation: str, *, uuid: str | None = None) -> Sandbox:
        """Record the runtime generation an OpenShell gateway last started the sandbox with
        (with ``uuid``: only in the sandbox of that identity, NOT_FOUND otherwise)."""
        with self.locked("record a runtime generation"):
            return self.store.update(name, uuid=uuid, generation=generation)

    # -- suspend and resume (suspend.py, resume.py) ------------------------------------------

    def suspend(self, name: str, *, force: bool = False, uuid: str | None = None) -> Sandbox:
        """Save the running guest's memory to disk and give its GPUs back (suspend.py);
        idempotent for a suspended sandbox. ``force`` ends guest processes that hold a GPU."""
        found = self.store.require(name, uuid)
        how = self.store, self.locked, found
        suspend_sandbox(*how, force=force, progress=self.progress, guest_run=self.guest_run)
        return self.get(name, uuid=found.uuid)

    def resume(self, name: str, *, verify: bool = True, uuid: str | None = None) -> Sandbox:
        """Restore a suspended sandbox and return once SSH answers, GPUs of its model taken
        again (resume.py); idempotent for a running one. RESOURCE_EXHAUSTED (still suspended)
        when no such GPUs are free."""
        found = self.store.require(name, uuid)
        how = self.progress, self.gpus, self.guest_run, verify
        return self.get(name, uuid=resume_sandbox(self.store, self.locked, found, *how).uuid)

    # -- lifetime (lifetime.py) --------------------------------------------------------------

    def extend(self, name: str, seconds: float) -> Sandbox:
        """Push the end of sandbox ``name``'s lifetime ``seconds`` later (from now, once it has
        passed); FAILED_PRECONDITION for a sandbox created without one (``SandboxSpec.ttl``)."""
        return lifetime.extend(self.store, self.locked, name, seconds)

    def reap(self) -> lifetime.Reaped:
        """Destroy this state directory's sandboxes whose lifetime has ended; what was
        destroyed, and what could not be and why. A libvirt error listing the sandboxes
        propagates before anything is destroyed."""
        return lifetime.reap(self.store, lambda name, uuid: self.destroy(name, uuid=uuid))

    # -- destroy ------------------------------------------------------------------------------

    def destroy(self, name: str, *, uuid: str | None = None, pooled_only: bool = False) -> None:
        """Stop and remove the sandbox: domain, NVRAM, overlay, seed, keys, console and QEMU
        logs, its Fabric Manager partition (teardown.py). Idempotent in effect: what is left of
        it is removed; NOT_FOUND only when nothing of it existed (with ``uuid``: when the
        sandbox of that identity is gone); FAILED_PRECONDITION naming what could not be
        removed. ``pooled_only``: only an unclaimed pooled guest."""
        teardown.destroy(self.store, self.locked, name, uuid=uuid, pooled_only=pooled_only)

    # -- repair -------------------------------------------------------------------------------

    def reconcile(self) -> dict[str, builtins.list[str]]:
        """Finish removing what killed or failed calls left half-made here and release fabric
        partitions whose sandbox is gone (reconcile.py): what was removed, released, left."""
        return reconcile_sandboxes(self.hypervisor, self.config, self.locked).to_dict()
