"""Which GPUs (and NVSwitches, and which partition) a request gets on an NVSwitch host.

A pure function of the request, the inventory and the fabric's state. ``allocate`` is the
entry point of every allocation: ``allocator.select`` on a host without NVSwitches, ``choose``
on one with them. Errors, most permanent first, as in ``allocator.select``:

Shared NVSwitch mode (``FABRIC_MODE=1``), GPUs come in whole FM partitions:

1. INVALID_ARGUMENT: a named device is not on this host or is named twice; named devices
   that are not exactly one partition's GPUs (the message lists the partitions of that size);
   a named device fails the request's filters.
2. FAILED_PRECONDITION: more GPUs than a sandbox may take; a named device is not bindable;
   no partition of exactly the size asked whose GPUs are all bindable and match the filters
   (the message names the sizes on offer).
3. RESOURCE_EXHAUSTED (retryable): such partitions exist but none is free. A partition is
   free when it is not active, overlaps no active partition (FM refuses overlapping
   activations) and no domain holds any of its GPUs.

Among free partitions the choice follows ``allocator.select``'s placement: (1) fewest NUMA
nodes, (2) fewest PCIe switches, (3) best fit: the one that overlaps the fewest other free
partitions, so larger partitions stay free, (4) lowest BDFs. ``all=True`` takes the largest
free partition a sandbox may hold.

Full passthrough (no FM for guests on this host), after the named devices resolve: one GPU
(no NVLink) as ``select`` places it, or every GPU of the board together with every NVSwitch
(the guest runs FM itself; ``all=True`` asks for that). 2 up to one less than the board is
FAILED_PRECONDITION naming shared NVSwitch mode as the fix; an NVSwitch held by a domain is
RESOURCE_EXHAUSTED.

vGPU mode (``FABRIC_MODE=2``) is FAILED_PRECONDITION: it does not pass whole GPUs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from vmsandbox.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from vmsandbox.gpu.allocator import (
    DEFAULT_MAX_GPUS,
    Allocation,
    request_misses,
    resolve_devices,
    select,
)
from vmsandbox.gpu.fabric.mode import FULL_PASSTHROUGH, SHARED, VGPU
from vmsandbox.gpu.fabric.partitions import Partition, PartitionTable
from vmsandbox.gpu.fabric.state import Fabric
from vmsandbox.gpu.request import GpuRequest
from vmsandbox.host.model import Gpu, Inventory


def allocate(
    request: GpuRequest,
    inventory: Inventory,
    *,
    max_gpus: int = DEFAULT_MAX_GPUS,
    fabric: Fabric | None = None,
) -> Allocation:
    """The allocation for ``request``: ``select`` when ``fabric`` is None or the host has no
    NVSwitch, else the fabric policy for the host's fabric model."""
    if fabric is None or not inventory.fabric:
        return Allocation(tuple(select(request, inventory, max_gpus=max_gpus)))
    return choose(request, inventory, fabric, max_gpus)


def choose(request: GpuRequest, inventory: Inventory, fabric: Fabric, max_gpus: int) -> Allocation:
    """The allocation for ``request`` on an NVSwitch host (see the module docstring)."""
    if fabric.mode.kind == SHARED:
        if fabric.table is None:
            raise ValueError("shared NVSwitch mode needs FM's partition table")
        return _shared(request, inventory, fabric, max_gpus)
    if fabric.mode.kind == FULL_PASSTHROUGH:
        return _full_passthrough(request, inventory, max_gpus)
    if fabric.mode.kind == VGPU:
        raise FailedPrecondition(
            f"Fabric Manager runs in vGPU mode ({fabric.mode.source}): vmsandbox passes whole "
            "GPUs, which needs FABRIC_MODE=1 (shared NVSwitch) or no Fabric Manager on the "
            "host (full passthrough)",
            details={"fabric_mode": fabric.mode.kind},
        )
    raise ValueError(f"not an NVSwitch fabric mode: {fabric.mode.kind!r}")


def blockers(partition: Partition, inventory: Inventory, fabric: Fabric) -> list[str]:
    """Why ``partition`` is not free now (empty when it is)."""
    assert fabric.table is not None
    why = []
    if partition.active:
        owner = fabric.owners.get(partition.id)
        why.append(f"active, held by domain {owner!r}" if owner else "active, held by no domain")
    else:
        why += [
            f"overlaps active partition {other.id}"
            for other in fabric.table.active()
            if other.bdfs & partition.bdfs
        ]
    for gpu in inventory.gpus:
        if gpu.bdf in partition.bdfs and gpu.in_use_by is not None:
            why.append(f"{gpu.bdf} held by domain {gpu.in_use_by!r}")
        elif gpu.bdf in partition.bdfs and gpu.custody != "free":
            why.append(f"{gpu.bdf} {gpu.custody} ({gpu.custody_reason or 'no reason recorded'})")
    return why


def _shared(request: GpuRequest, inventory: Inventory, fabric: Fabric, max_gpus: int) -> Allocation:
    assert fabric.table is not None
    if request.devices:
        return _named_partition(request, inventory, fabric, max_gpus)
    wanted = request.wanted()
    if wanted is not None and wanted > max_gpus:
        raise FailedPrecondition(
            f"{wanted} GPUs asked, but a sandbox takes at most {max_gpus}",
            details={"wanted": wanted, "max_gpus": max_gpus},
        )
    matching = {
        gpu.bdf for gpu in inventory.gpus if gpu.bindable and not request_misses(request, gpu)
    }
    offered = [p for p in fabric.table.partitions if p.bdfs <= matching]
    sizes = sorted({p.size for p in offered})
    if wanted is None:
        fitting = [p for p in offered if p.size <= max_gpus]
        free = [p for p in fitting if not blockers(p, inventory, fabric)]
        if free:
            wanted = max(p.size for p in free)
        elif fitting:
            wanted = max(p.size for p in fitting)
    if wanted is None or wanted not in sizes:
        raise _no_such_size(wanted, sizes, fabric.table, matching, inventory)
    candidates = [p for p in offered if p.size == wanted]
    blocked = {p.id: why for p in candidates if (why := blockers(p, inventory, fabric))}
    free = [p for p in candidates if p.id not in blocked]
    if not free:
        raise ResourceExhausted(
            f"{wanted} GPUs asked: none of the {len(candidates)} partitions of {wanted} GPUs "
            f"is free ({blocked_text(blocked)}); retry once one is released",
            details={"wanted": wanted, "blocked": blocked},
        )
    all_free = [p for p in offered if not blockers(p, inventory, fabric)]
    by_bdf = {gpu.bdf: gpu for gpu in inventory.gpus}
    best = min(free, key=lambda p: _placement(p, by_bdf, all_free))
    return Allocation(tuple(by_bdf[bdf] for bdf in sorted(best.bdfs)), partition=best)


def _named_partition(
    request: GpuRequest, inventory: Inventory, fabric: Fabric, max_gpus: int
) -> Allocation:
    assert fabric.table is not None
    named = {gpu.bdf for gpu in resolve_devices(request.devices, inventory)}
    partition = next((p for p in fabric.table.partitions if p.bdfs == named), None)
    if partition is None:
        same_size = [p for p in fabric.table.partitions if p.size == len(named)]
        choices = (
            "; ".join(f"partition {p.id}: {', '.join(sorted(p.bdfs))}" for p in same_size)
            or f"none: partitions here have {_sizes(fabric.table.sizes())} GPUs"
        )
        raise InvalidArgument(
            f"devices: in shared NVSwitch mode the GPUs named must be exactly one Fabric "
            f"Manager partition, and {', '.join(sorted(named))} are not; partitions of "
            f"{len(named)} GPUs: {choices}",
            details={
                "field": "devices",
                "value": sorted(named),
                "partitions": {p.id: sorted(p.bdfs) for p in same_size},
            },
        )
    gpus = select(request, inventory, max_gpus=max_gpus)  # filters, bindable, held by domains
    why = blockers(partition, inventory, fabric)
    if why:
        raise ResourceExhausted(
            f"devices: partition {partition.id} of the GPUs named is not free: "
            f"{', '.join(why)}; retry once it is released",
            details={"partition": partition.id, "blocked": why},
        )
    return Allocation(tuple(sorted(gpus, key=lambda gpu: gpu.bdf)), partition=partition)


def _placement(
    partition: Partition, by_bdf: Mapping[str, Gpu], free: list[Partition]
) -> tuple[int, int, int, list[str]]:
    gpus = [by_bdf[bdf] for bdf in partition.bdfs]
    return (
        len({gpu.numa_node for gpu in gpus}),
        len({gpu.pcie_switch or gpu.bdf for gpu in gpus}),
        sum(1 for other in free if other.id != partition.id and other.bdfs & partition.bdfs),
        sorted(partition.bdfs),
    )


def _no_such_size(
    wanted: int | None,
    sizes: list[int],
    table: PartitionTable,
    matching: set[str],
    inventory: Inventory,
) -> FailedPrecondition:
    asked = "any GPU" if wanted is None else f"{wanted} GPU" + ("" if wanted == 1 else "s")
    if sizes:
        offer = f"its partitions that fit the request have {_sizes(sizes)} GPUs"
    elif table.partitions:
        offer = (
            f"it has partitions of {_sizes(table.sizes())} GPUs, but none whose GPUs are all "
            f"bindable and match the request ({len(matching)} of {len(inventory.gpus)} GPUs do)"
        )
    else:
        offer = "Fabric Manager offers no partitions"
    return FailedPrecondition(
        f"this host can never give {asked}: in shared NVSwitch mode GPUs come in whole Fabric "
        f"Manager partitions, and {offer}",
        details={"wanted": wanted, "sizes": sizes, "all_sizes": table.sizes()},
    )


def _full_passthrough(request: GpuRequest, inventory: Inventory, max_gpus: int) -> Allocation:
    board = len(inventory.gpus)
    if request.devices:
        resolve_devices(request.devices, inventory)  # unknown ids first: INVALID_ARGUMENT
    wanted = board if request.all else request.wanted()
    assert wanted is not None
    if wanted == 1 or wanted > board:
        return Allocation(tuple(select(request, inventory, max_gpus=max_gpus)))
    if wanted < board:
        raise FailedPrecondition(
            f"{wanted} GPUs asked, but on this NVSwitch board without Fabric Manager for guests "
            f"(full passthrough) a guest takes 1 GPU or all {board} together with every "
            "NVSwitch; for other sizes set up Fabric Manager in shared NVSwitch mode "
            "(FABRIC_MODE=1 in fabricmanager.cfg) and install fmpm",
            details={"wanted": wanted, "allowed": [1, board], "fix": "shared NVSwitch mode"},
        )
    whole = request if not request.all else replace(request, all=False, count=board)
    gpus = select(whole, inventory, max_gpus=max_gpus)
    held = {dev.bdf: dev.in_use_by for dev in inventory.fabric if dev.in_use_by is not None}
    if held:
        listed = ", ".join(f"{bdf} by domain {name!r}" for bdf, name in held.items())
        raise ResourceExhausted(
            f"all {board} GPUs asked, which take every NVSwitch too, but NVSwitches are in use: "
            f"{listed}; retry once they are released",
            details={"held_by": held},
        )
    return Allocation(tuple(gpus), switches=inventory.fabric)


def _sizes(sizes: list[int]) -> str:
    shown = [str(size) for size in sizes]
    return shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " or " + shown[-1]


def blocked_text(blocked: Mapping[Any, Sequence[str]]) -> str:
    """Why each partition is not free (``details["blocked"]`` of the RESOURCE_EXHAUSTED that
    ``choose`` raises), as its message says it."""
    return "; ".join(f"partition {pid}: {', '.join(why)}" for pid, why in blocked.items())
