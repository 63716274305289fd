"""A dry run of create: the domain and GPUs a create of a spec would use now, defining and
writing nothing.

It refuses what create refuses, with the same error: a spec over the host's caps, a name kept
for the warm pool or already taken (ALREADY_EXISTS), an image that is not built (NOT_FOUND),
a disk smaller than its image, GPUs this host cannot give (FAILED_PRECONDITION, saying that a
dry run without ``--gpu`` shows the domain on a host that has none). On NVSwitch boards Fabric
Manager's table is read (shared mode) but nothing activated; the XML names the partition in its
record, or carries the NVSwitches (full passthrough).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Protocol

from vmsandbox.errors import FailedPrecondition
from vmsandbox.host.numa import host_cpus_by_node
from vmsandbox.sandbox import plan as planner
from vmsandbox.sandbox import reserve
from vmsandbox.sandbox.holds import Holds
from vmsandbox.sandbox.pool.shapes import check_not_pooled_name
from vmsandbox.sandbox.spec import SandboxSpec, generate_name
from vmsandbox.vm import virt

if TYPE_CHECKING:
    from vmsandbox.config import Config
    from vmsandbox.image.store import ImageStore
    from vmsandbox.progress import Progress
    from vmsandbox.vm.hypervisor import Hypervisor

NO_GPU_HINT = (
    "a dry run plans against this host's GPUs; 'vmsandbox create NAME --dry-run' without the "
    "--gpu flags shows the domain it would define here"
)


class Planner(Protocol):
    """What a dry run uses of the manager it plans for (``SandboxManager`` is one)."""

    config: Config
    hypervisor: Hypervisor
    images: ImageStore
    progress: Progress

    def locked(self, purpose: str = "") -> contextlib.AbstractContextManager[None]: ...

    def look(self, spec: SandboxSpec) -> reserve.HostView: ...


def dry_run(manager: Planner, spec: SandboxSpec) -> planner.SandboxPlan:
    """The plan (record, domain XML, GPUs) that ``manager.create(spec)`` would carry out now."""
    config = manager.config
    planner.check_caps(spec, config)
    check_not_pooled_name(spec.name)
    image = manager.images.get(spec.image)
    planner.check_disk(spec, image)
    name = spec.name or generate_name()
    # No probe boot for virt type auto: the cached answer, or TCG (vm/virt.py).
    virt_type = virt.for_sandbox(spec.virt_type, config, None, manager.progress)
    view = manager.look(spec)
    with manager.locked("dry run"):
        now = reserve.taken(view, Holds(config))
        reserve.check_name(name, now, manager.hypervisor)
        try:
            chosen = reserve.allocate(spec.gpu, view, now, config.max_gpus)
        except FailedPrecondition as exc:
            if view.inventory is not None and view.inventory.gpus:
                raise
            raise FailedPrecondition(f"{exc.message}; {NO_GPU_HINT}", details=exc.details) from exc
        port = reserve.pick_port(now) if config.network == "user" else None
    return planner.plan(
        spec,
        name=name,
        config=config,
        image=image,
        virt_type=virt_type,
        allocation=chosen,
        port=port,
        host_cpus=host_cpus_by_node() if chosen else None,
    )
