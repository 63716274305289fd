"""SandboxManager: the path of one sandbox, from request to a running, reachable VM, and back.

It orchestrates and nothing else: each step is the work of a module of this package (the
package's docstring says which), libvirt is behind vm/hypervisor.py's ``Hypervisor`` and the
source of truth: every sandbox is a persistent domain whose metadata holds its record.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import IO, TYPE_CHECKING, Any

from vmsandbox.config import Config
from vmsandbox.errors import FailedPrecondition, NotFound
from vmsandbox.guest import ssh
from vmsandbox.guest.keys import SandboxKeys
from vmsandbox.host.numa import host_cpus_by_node
from vmsandbox.image.store import BaseImage, ImageStore
from vmsandbox.lock import host_lock
from vmsandbox.progress import Progress, silent
from vmsandbox.sandbox import lifecycle, power
from vmsandbox.sandbox import plan as planner
from vmsandbox.sandbox.boot import check_timeout
from vmsandbox.sandbox.handle import Sandbox
from vmsandbox.sandbox.pool import check_not_pooled_name, is_pool_guest
from vmsandbox.sandbox.reconcile import reconcile as reconcile_sandboxes
from vmsandbox.sandbox.record import (
    DOMAIN_PREFIX,
    STATE_READY,
    SandboxFiles,
    SandboxRecord,
    prepare_state_dirs,
)
from vmsandbox.sandbox.spec import SandboxSpec, generate_name
from vmsandbox.sandbox.store import SandboxStore
from vmsandbox.sandbox.warmpool import WarmPool
from vmsandbox.validate import validate_name
from vmsandbox.vm import virt
from vmsandbox.vm.hypervisor import Hypervisor, LibvirtHypervisor

if TYPE_CHECKING:
    import libvirt

    from vmsandbox.gpu.allocator import Allocation
    from vmsandbox.host.model import Gpu, Inventory


class SandboxManager:
    """Create, find, use, stop, start and destroy sandboxes on one host.

    ``checkpoint(stage)`` is called after each create step (see lifecycle.py); the crash tests
    install one that stops there to be killed. ``hypervisor`` defaults to libvirt at
    ``config.uri``; unit tests hand in a fake.
    """

    checkpoint: Callable[[str], None] = staticmethod(lifecycle.no_checkpoint)

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

    def locked(self) -> contextlib.AbstractContextManager[None]:
        return host_lock(self.config.lock_path)

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
        then (``refill``) starts a background ``vmsandbox pool fill``; else it boots cold.

        Any failure undoes every step this call made (lifecycle.py) before the error
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
        creation = lifecycle.Creation(
            hypervisor=self.hypervisor,
            name=name,
            config=self.config,
            files=SandboxFiles.of(self.config, name),
            spec=spec,
            image=image,
            virt_type=virt.for_sandbox(spec.virt_type, self.config, image.kernel, say),
            progress=say,
            exists=lambda n: self.store.lookup(n) is not None,
            allocate=functools.partial(self.allocate, spec),
            free_port=self.store.free_port,
            host_cpus=host_cpus_by_node,
            timeout=timeout,
            start=start,
            wait=wait,
            verify=verify,
        )
        skip = lifecycle.STARTING if not start else frozenset()
        steps = tuple(step for step in lifecycle.CREATE_STEPS if step.name not in skip)
        lifecycle.run(steps, creation, self.locked, self.checkpoint)
        assert creation.record is not None  # made by the define step
        record, state = creation.record, creation.state
        sandbox = self.store.view(record, state)
        sandbox.boot_seconds = creation.boot_seconds
        lifecycle.check_verification(creation, self.locked, keep=keep_on_failure)
        say(f"sandbox {name} is {state}")
        return sandbox

    def verify(self, name: str) -> dict[str, Any]:
        """Re-run the in-guest GPU verification of a running sandbox; the report is stored."""
        record, state = self.store.get(name)
        files = SandboxFiles.of(self.config, record.stem)
        report = lifecycle.verify_guest(record, self._endpoint(record), files)
        self.store.put(replace(record, verification=report), state)
        return report

    def dry_run(self, spec: SandboxSpec) -> tuple[str, list[Gpu]]:
        """The domain XML and GPUs that ``create`` would use now; defines and writes nothing.

        Needs no built image: an image that is not built yet is shown at the path it will have.
        On NVSwitch boards Fabric Manager's table is read (shared mode) but nothing activated;
        the XML names the partition in its record, or carries the NVSwitches (full passthrough).
        """
        self.check_caps(spec)
        name = spec.name or generate_name()
        try:
            image: BaseImage | None = self.images.get(spec.image)
        except NotFound:
            image = None
        virt_type = virt.for_sandbox(spec.virt_type, self.config, None, self.progress)
        with self.locked():
            chosen = self.allocate(spec)
            port = self.store.free_port() if self.config.network == "user" else None
        planned = planner.plan(
            spec,
            name=name,
            config=self.config,
            image=image,
            virt_type=virt_type,
            allocation=chosen,
            port=port,
            host_cpus=host_cpus_by_node() if chosen else None,
        )
        return planned.xml(), list(planned.gpus)

    def allocate(self, spec: SandboxSpec) -> Allocation | None:
        """Under the host lock: the GPUs for ``spec`` (None: it asks for none), free on every
        domain of the connection; on NVSwitch boards with their Fabric Manager partition (FM's
        table is read now) or, in full passthrough, the NVSwitches."""
        if spec.gpu is None:
            return None  # importing the allocator loads pyudev: only GPU requests pay for it
        from vmsandbox.gpu.fabric import policy, state

        inventory = self.gpus()
        fabric = state.read(self.config, inventory)
        return policy.allocate(spec.gpu, inventory, max_gpus=self.config.max_gpus, fabric=fabric)

    def gpus(self) -> Inventory:
        """The host's GPU inventory, with ``in_use_by`` read from all libvirt domains."""
        from vmsandbox.host import discover

        return discover(in_use=self.hypervisor.hostdev_holders())

    # -- read ---------------------------------------------------------------------------------

    def get(self, name: str) -> Sandbox:
        record, state = self.store.get(name)
        return self.store.view(self.store.with_address(record, state), state)

    def list(self) -> list[Sandbox]:
        """The sandboxes (pooled guests not claimed yet are the pool's: ``pool.show``)."""
        return sorted(
            (self.store.view(r, s) for r, s in self.store.all() if not is_pool_guest(r)),
            key=lambda sandbox: sandbox.name,
        )

    # -- use ----------------------------------------------------------------------------------

    def keys_of(self, sandbox: Sandbox) -> SandboxKeys:
        stem = sandbox.domain.removeprefix(DOMAIN_PREFIX)  # a claimed guest's files keep its name
        return SandboxFiles.of(self.config, stem).keys(sandbox.host_key_alias)

    def _endpoint(self, record: SandboxRecord) -> ssh.Endpoint:
        if record.ssh.port is None:
            raise FailedPrecondition(f"sandbox {record.name!r} has no SSH endpoint yet")
        return ssh.Endpoint(record.ssh.host, record.ssh.port, record.ssh.user)

    def exec(
        self,
        name: str,
        command: Sequence[str] | str,
        *,
        timeout: float | None = None,
        stdout: IO[bytes] | None = None,
        stderr: IO[bytes] | None = None,
    ) -> ssh.ExecResult:
        """Run a command in the sandbox: a list is quoted word by word; a string is a shell line."""
        sandbox = self.get(name)
        if sandbox.ssh is None:
            raise FailedPrecondition(f"sandbox {name!r} has no SSH endpoint yet")
        check_timeout(timeout)
        command = ssh.shell_command(command)
        keys = self.keys_of(sandbox)
        return ssh.run(sandbox.ssh, keys, command, timeout=timeout, stdout=stdout, stderr=stderr)

    def ssh_argv(self, name: str, command: Sequence[str] = ()) -> list[str]:
        """The OpenSSH command line that logs into the sandbox with its pinned host key."""
        sandbox = self.get(name)
        if sandbox.ssh is None:
            raise FailedPrecondition(f"sandbox {name!r} has no SSH endpoint yet")
        return ssh.ssh_argv(sandbox.ssh, self.keys_of(sandbox), command)

    # -- power (power.py) ----------------------------------------------------------------------

    def stop(self, name: str, *, grace: float = 60.0) -> Sandbox:
        """Shut the guest down, disk and GPUs kept: its power button, then power off after
        ``grace`` seconds. Idempotent: a sandbox that does not run is left as it is."""
        check_timeout(grace, field="grace")
        record, state = self.store.get(name)
        power.check_powerable(record, state)
        power.stop(self.hypervisor, record.domain, grace=grace)
        return self.store.view(*self.store.get(name))

    def start(
        self, name: str, *, wait: bool = True, verify: bool = True, timeout: float | None = None
    ) -> Sandbox:
        """Start a stopped (or only defined) sandbox, its GPUs passed through again; with
        ``wait``, return once it is ready (``wait``). Idempotent: a running sandbox is returned
        as it is. A GPU gone from the host: FAILED_PRECONDITION, the sandbox left as it was."""
        check_timeout(timeout)
        record, state = self.store.get(name)
        files = SandboxFiles.of(self.config, record.stem)
        if power.start(self.hypervisor, record, state, files) and wait:
            return self.wait(name, verify=verify, timeout=timeout)
        return self.store.view(*self.store.get(name))

    def wait(self, name: str, *, verify: bool = True, timeout: float | None = None) -> Sandbox:
        """Wait until a started sandbox answers SSH, verify its GPUs (``verify``) and mark it
        ready; a guest that does not come up is marked failed, the reason in its record."""
        check_timeout(timeout)
        record, _state = self.store.get(name)
        record, waited = power.wait(
            self.hypervisor, self.config, record, self.progress, verify=verify, timeout=timeout
        )
        sandbox = self.store.view(record, STATE_READY)
        sandbox.boot_seconds = waited
        return sandbox

    def set_generation(self, name: str, generation: str) -> Sandbox:
        """Record the runtime generation an OpenShell gateway last started the sandbox with."""
        with self.locked():
            return self.store.update(name, generation=generation)

    # -- destroy ------------------------------------------------------------------------------

    def destroy(self, name: str) -> None:
        """Stop and remove the sandbox: domain, NVRAM, overlay, seed, keys, console and QEMU
        logs, then its Fabric Manager partition (NVSwitch boards). Idempotent in effect:
        whatever is left of it is removed; NOT_FOUND only when nothing of it existed;
        FAILED_PRECONDITION naming what could not be removed."""
        validate_name(name)
        found = self.store.lookup(name)
        if found is not None:  # stopped before the lock: a hung QEMU must not hold it
            self.hypervisor.stop(found[0].domain)
        with self.locked():  # looked up again: a create may have defined it meanwhile
            found = self.store.lookup(name)
            files = SandboxFiles.of(self.config, found[0].stem if found else name)
            if found is None and not files.existing():
                raise NotFound(f"sandbox {name!r} does not exist", details={"name": name})
            record = found[0] if found else None
            remains = lifecycle.Remains(self.hypervisor, self.config, name, files, record)
            lifecycle.teardown(remains, contextlib.nullcontext)

    # -- repair -------------------------------------------------------------------------------

    def reconcile(self) -> dict[str, list[str]]:
        """Finish removing half-made sandboxes of this state directory and release fabric
        partitions whose sandbox is gone (reconcile.py); returns what was removed, the
        partitions released and what could not be fixed."""
        with self.locked():
            local = [
                (record, state) for record, state in self.store.all() if self.store.local(record)
            ]
            return reconcile_sandboxes(self.hypervisor, self.config, local).to_dict()
