"""The GPUs a resume takes (resume.py): free GPUs of the models its suspended sandbox had, one
per old GPU in its guest-slot order, at any host address; in shared NVSwitch mode the GPUs of a
free Fabric Manager partition of the size it had, chosen by the fabric policy as a create's
are, and that partition's activation before the memory is restored.
"""

from __future__ import annotations

from dataclasses import replace

from vmsandbox.config import Config
from vmsandbox.errors import FailedPrecondition, ResourceExhausted
from vmsandbox.gpu.fabric.lease import FabricLease
from vmsandbox.gpu.fabric.policy import blocked_text
from vmsandbox.gpu.record import GpuRecord
from vmsandbox.image.store import ImageStore
from vmsandbox.progress import Progress
from vmsandbox.sandbox import reserve
from vmsandbox.sandbox.holds import Holds
from vmsandbox.sandbox.record import SandboxRecord
from vmsandbox.sandbox.suspension import Suspension


def matching(held: Suspension, free: list[GpuRecord]) -> tuple[GpuRecord, ...] | None:
    """GPUs among ``free`` of the models ``held`` had, one per old GPU in its slot order (a
    pure choice); None when there are not enough."""
    left = list(free)
    chosen = []
    for old in held.gpus:
        same = next((gpu for gpu in left if _model(gpu) == _model(old)), None)
        if same is None:
            return None
        left.remove(same)
        chosen.append(same)
    return tuple(chosen)


def reserve_for(
    config: Config,
    record: SandboxRecord,
    held: Suspension,
    view: reserve.HostView,
    holds: Holds,
) -> tuple[tuple[GpuRecord, ...], int | None]:
    """Free GPUs of the suspended ones' models: held by no domain or reservation, and free in
    their custody (reset and cleared since their last tenant), in the old GPUs' slot order;
    in shared NVSwitch mode with the id of the partition they make up. RESOURCE_EXHAUSTED
    when too few are."""
    from vmsandbox.gpu.custody.state import FREE, with_custody
    from vmsandbox.host.model import with_holders

    assert view.inventory is not None
    now = reserve.taken(view, holds)
    if view.fabric is not None and view.fabric.table is not None:
        return _partition(config, record, held, view, now)
    inventory = with_custody(with_holders(view.inventory, now.holders), now.custody)
    free = [
        GpuRecord.of(gpu)
        for gpu in inventory.gpus
        if gpu.bindable and gpu.in_use_by is None and gpu.custody == FREE
    ]
    chosen = matching(held, free)
    if chosen is None:
        models = _models(held)
        raise ResourceExhausted(
            f"sandbox {record.name!r} cannot be resumed now: it needs {len(held.gpus)} free "
            f"GPU(s) of model {models} and {len(free)} GPU(s) of any model are free; it stays "
            "suspended, nothing lost: resume it once GPUs are free",
            details={"name": record.name, "gpus": len(held.gpus), "models": models},
        )
    return chosen, None


def _partition(
    config: Config,
    record: SandboxRecord,
    held: Suspension,
    view: reserve.HostView,
    now: reserve.Taken,
) -> tuple[tuple[GpuRecord, ...], int]:
    """Shared NVSwitch mode: the GPUs of a free Fabric Manager partition of the size the
    sandbox had, all of the suspended GPUs' models, chosen by the fabric policy among the
    host's GPUs of those models (as a create of that many GPUs would be), and the
    partition's id. RESOURCE_EXHAUSTED when none is free; FAILED_PRECONDITION when the host
    has no partition of that size of those models."""
    from vmsandbox.gpu.request import GpuRequest

    assert view.inventory is not None
    size = held.partition_size or len(held.gpus)
    models = {_model(gpu) for gpu in held.gpus}
    same = tuple(gpu for gpu in view.inventory.gpus if _model(GpuRecord.of(gpu)) in models)
    only = replace(view, inventory=replace(view.inventory, gpus=same))
    stays = "it stays suspended, nothing lost"
    try:
        allocation = reserve.allocate(GpuRequest(count=size), only, now, config.max_gpus)
    except ResourceExhausted as exc:
        why = blocked_text(exc.details.get("blocked", {})) or exc.message
        raise ResourceExhausted(
            f"sandbox {record.name!r} cannot be resumed now: it needs a free Fabric Manager "
            f"partition of {size} GPU(s) of model {_models(held)} ({why}); {stays}: resume "
            "it once one is free",
            details={"name": record.name, "partition_size": size, **exc.details},
        ) from exc
    except FailedPrecondition as exc:
        exc.add_note(f"sandbox {record.name!r} cannot be resumed here: {stays}")
        raise
    assert allocation is not None and allocation.partition is not None  # shared mode
    chosen = matching(held, [GpuRecord.of(gpu) for gpu in allocation.gpus])
    if chosen is None:  # a partition of mixed models: not the GPUs the guest had
        raise ResourceExhausted(
            f"sandbox {record.name!r} cannot be resumed now: partition "
            f"{allocation.partition.id}, the free one of {size} GPU(s), does not hold GPUs of "
            f"model {_models(held)} in the number it had; {stays}",
            details={"name": record.name, "partition": allocation.partition.id},
        )
    return chosen, allocation.partition.id


def _model(gpu: GpuRecord) -> tuple[str, str, int]:
    """What ``matching`` calls the same model: vendor and device id, number of functions."""
    return gpu.vendor_id.lower(), gpu.device_id.lower(), len(gpu.companions)


def _models(held: Suspension) -> str:
    return ", ".join(sorted({gpu.name or gpu.device_id for gpu in held.gpus}))


def activate(config: Config, record: SandboxRecord, uuid: str, progress: Progress) -> None:
    """Shared NVSwitch mode: the partition reserved activated, outside the lock, before the
    guest is restored (its hold reserves the partition meanwhile), as create's fabric step
    does: the image's NVIDIA driver (its build's ``nvidia_driver_version``) must be Fabric
    Manager's release, and the lease, naming the domain's UUID, is written before fmpm is
    asked."""
    partition = record.fabric_partition
    if partition is None:
        return
    progress(f"activating Fabric Manager partition {partition}")
    builds = ImageStore(config.images).builds(record.image)
    meta = next((image.meta for image in builds if image.id == record.image_id), {})
    FabricLease(config).activate(
        partition,
        uuid,
        record.name,
        image=record.image,
        image_driver=meta.get("nvidia_driver_version"),
    )
