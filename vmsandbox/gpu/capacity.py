"""What a host can still place: per GPU count, how many sandboxes of that many GPUs fit now, one
after another, and how many would fit on the empty host.

The count is found by running the host's own allocation policy (``fabric.policy.allocate``) on a
copy of the inventory, marking what each allocation took as held, until the policy refuses. So
the numbers follow every rule the allocator follows: whole IOMMU groups, whole Fabric Manager
partitions (an active partition blocks those it overlaps), the 1-or-all shapes of full
passthrough, the host's ``max_gpus``, the GPUs it cannot bind and the GPUs whose custody is not
free (being sanitized, or out until they are well). A fleet reads them to keep its
scheduler's view of a host equal to what the host itself would allow.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, replace

from vmsandbox.errors import VmSandboxError
from vmsandbox.gpu.allocator import Allocation
from vmsandbox.gpu.custody.state import FREE, OUT, is_allocatable
from vmsandbox.gpu.fabric.policy import allocate
from vmsandbox.gpu.fabric.state import Fabric
from vmsandbox.gpu.request import GpuRequest
from vmsandbox.host.model import Inventory

SIMULATED = "(counting)"  # the holder written on what a counted allocation took


@dataclass(frozen=True)
class Capacity:
    """Per GPU count: how many sandboxes of that many GPUs fit now (``free``) and on the empty
    host (``total``); ``single_numa`` counts only placements whose GPUs share one NUMA node. Per
    model name: bindable GPUs in all and free now."""

    total: Mapping[int, int]
    free: Mapping[int, int]
    single_numa_total: Mapping[int, int]
    single_numa_free: Mapping[int, int]
    models_total: Mapping[str, int]
    models_free: Mapping[str, int]


def measure(inventory: Inventory, fabric: Fabric | None, max_gpus: int) -> Capacity:
    """The capacity of a host whose inventory (``in_use_by`` filled) and fabric are given."""
    empty_inventory, empty_fabric = empty(inventory, fabric)
    bindable = [gpu for gpu in inventory.gpus if gpu.bindable and gpu.custody not in OUT]
    sizes = range(1, min(len(bindable), max_gpus) + 1)
    return Capacity(
        total={n: fits(n, empty_inventory, empty_fabric, max_gpus) for n in sizes},
        free={n: fits(n, inventory, fabric, max_gpus) for n in sizes},
        single_numa_total={
            n: fits(n, empty_inventory, empty_fabric, max_gpus, single_numa=True) for n in sizes
        },
        single_numa_free={n: fits(n, inventory, fabric, max_gpus, single_numa=True) for n in sizes},
        models_total=dict(Counter(gpu.name or "unknown" for gpu in bindable)),
        models_free=dict(Counter(gpu.name or "unknown" for gpu in bindable if is_allocatable(gpu))),
    )


def fits(
    count: int,
    inventory: Inventory,
    fabric: Fabric | None,
    max_gpus: int,
    *,
    single_numa: bool = False,
) -> int:
    """How many sandboxes of ``count`` GPUs the policy gives one after another (with
    ``single_numa``: until it would give one whose GPUs span NUMA nodes)."""
    placed = 0
    request = GpuRequest(count=count)
    while True:
        try:
            allocation = allocate(request, inventory, max_gpus=max_gpus, fabric=fabric)
        except VmSandboxError:
            return placed
        if single_numa and len({gpu.numa_node for gpu in allocation.gpus}) > 1:
            return placed
        placed += 1
        inventory, fabric = take(allocation, inventory, fabric)


def take(
    allocation: Allocation, inventory: Inventory, fabric: Fabric | None
) -> tuple[Inventory, Fabric | None]:
    """The inventory and fabric after ``allocation`` was made: its GPUs and NVSwitches held,
    its partition active."""
    taken = {gpu.bdf for gpu in allocation.gpus}
    switches = {device.bdf for device in allocation.switches}
    inventory = replace(
        inventory,
        gpus=tuple(
            replace(gpu, in_use_by=SIMULATED) if gpu.bdf in taken else gpu for gpu in inventory.gpus
        ),
        fabric=tuple(
            replace(device, in_use_by=SIMULATED) if device.bdf in switches else device
            for device in inventory.fabric
        ),
    )
    if fabric is not None and fabric.table is not None and allocation.partition is not None:
        chosen = allocation.partition.id
        table = replace(
            fabric.table,
            partitions=tuple(
                replace(p, active=True) if p.id == chosen else p for p in fabric.table.partitions
            ),
        )
        fabric = replace(fabric, table=table, owners={**fabric.owners, chosen: SIMULATED})
    return inventory, fabric


def empty(inventory: Inventory, fabric: Fabric | None) -> tuple[Inventory, Fabric | None]:
    """The same host with nothing held: no GPU or NVSwitch in use, no partition active. A GPU
    that is out until an operator acts (quarantined, failed) or its automatic reset (suspect)
    stays out: it is not capacity until it is well again."""
    inventory = replace(
        inventory,
        gpus=tuple(
            replace(gpu, in_use_by=None, custody=gpu.custody if gpu.custody in OUT else FREE)
            for gpu in inventory.gpus
        ),
        fabric=tuple(replace(device, in_use_by=None) for device in inventory.fabric),
    )
    if fabric is not None and fabric.table is not None:
        table = replace(
            fabric.table,
            partitions=tuple(replace(p, active=False) for p in fabric.table.partitions),
        )
        fabric = replace(fabric, table=table, owners={})
    return inventory, fabric
