"""Which GPUs a sandbox gets: a ``GpuRequest`` resolved, checked and placed on the inventory.

``select`` is a pure function of the request and the inventory. The caller fills
``Gpu.in_use_by`` from the ``<hostdev>`` elements of *every* libvirt domain, ours or another's
(``vmsandbox.host.libvirt_hostdev_holders``), and calls ``select`` and then defines the domain
under the host-wide lock, so two sandboxes never get the same GPU.

Errors, most permanent first (a request with several problems gets the first that applies):

- INVALID_ARGUMENT: a named device is not on this host, two ids name one GPU, or a named
  device fails the request's own vendor, model or memory filter.
- FAILED_PRECONDITION: the host can never give this: more GPUs than a sandbox may take
  (``max_gpus``) or than the host has bindable and matching; a named device is not bindable.
- FAILED_PRECONDITION too when the request could be met only with GPUs an operator must check
  first (quarantined or failed: ``vmsandbox.gpu.custody``); the message names them and why.
- RESOURCE_EXHAUSTED (retryable): enough suitable GPUs exist but other domains hold them, or
  they are being sanitized or reset (their custody is not free yet).

``details`` carries the data behind each message: ``valid_ids``, ``held_by`` (BDF -> domain),
``not_bindable`` (BDF -> reasons), ``filtered_out`` (BDF -> failed filters) and the counts.

The entry point the manager uses is ``vmsandbox.gpu.fabric.policy.allocate``: ``select`` on a host
without NVSwitches, and on an NVSwitch board the fabric policy, which takes whole Fabric
Manager partitions in shared NVSwitch mode and allows only the shapes that work in full
passthrough. Its errors keep the same order; the policy's docstring lists them.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING, Any

from vmsandbox.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from vmsandbox.gpu.custody.state import FAILED, FREE, QUARANTINED, is_allocatable
from vmsandbox.gpu.request import GpuRequest, memory_satisfies, model_matches
from vmsandbox.host.discover import IOMMU_OFF
from vmsandbox.host.model import FabricDevice, Gpu, Inventory

if TYPE_CHECKING:
    from vmsandbox.gpu.fabric.partitions import Partition

DEFAULT_MAX_GPUS = 16
_LISTED = 3  # GPUs named one by one in a message before "and N more"

# Placement levels, outermost first: GPUs with an unknown NUMA node count as one node; a GPU
# behind no switch shares it with nobody, so it is a group of its own; likewise a GPU with no
# IOMMU group. The IOMMU group is the unit VFIO hands to one guest: the group's other GPUs are
# held with it, so a request is best served by whole groups.
_Level = Callable[[Gpu], Hashable]
_LEVELS: tuple[_Level, ...] = (
    lambda gpu: gpu.numa_node,
    lambda gpu: gpu.pcie_switch or gpu.bdf,
    lambda gpu: gpu.bdf if gpu.iommu_group is None else gpu.iommu_group,
)


@dataclass(frozen=True)
class Allocation:
    """What a sandbox gets: its GPUs (sorted by BDF), the Fabric Manager partition that
    connects them (shared NVSwitch mode), and NVSwitches passed along (full passthrough)."""

    gpus: tuple[Gpu, ...]
    partition: Partition | None = None
    switches: tuple[FabricDevice, ...] = ()


def select(
    request: GpuRequest, inventory: Inventory, *, max_gpus: int = DEFAULT_MAX_GPUS
) -> list[Gpu]:
    """The GPUs for ``request``: named devices in the order given, else the best placed.

    Only bindable, free GPUs (``in_use_by is None`` and custody ``free``) that pass the
    request's filters are ever chosen. ``all=True`` takes every such GPU, at most
    ``max_gpus`` of them.

    Placement of ``count`` GPUs among the free ones compares the possible choices by, in
    order: (1) fewest NUMA nodes spanned, (2) fewest PCIe switches spanned, (3) fewest IOMMU
    groups spanned, (4) best fit: take from the node, then the switch, then the IOMMU group,
    with the fewest free GPUs that can hold them, so whole nodes, switch pairs and groups stay
    free for larger requests and a one-GPU request takes a GPU alone in its group before one
    whose group holds others (they would be held with it), (5) lowest BDFs. When no node
    can hold them all, whole nodes are taken largest first and the rest placed the same way.
    On an HGX board (two GPUs per switch, four per node) count 2 takes a switch pair, count 4
    a node, and with one GPU of a pair held, count 1 takes its partner while count 2 takes a
    whole free pair. The result is sorted by BDF.
    """
    if request.devices:
        return _named(request, inventory, max_gpus)
    wanted = request.wanted()
    share = _unified_share(request, inventory)
    matching = [
        gpu for gpu in inventory.gpus if gpu.bindable and not request_misses(request, gpu, share)
    ]
    if not matching or (wanted is not None and (wanted > max_gpus or wanted > len(matching))):
        raise _never(request, inventory, wanted, matching, max_gpus)
    free = [gpu for gpu in matching if is_allocatable(gpu)]
    take = min(len(free), max_gpus) if wanted is None else wanted
    if not take or take > len(free):
        raise _held(wanted, matching, free)
    return sorted(_place(free, take, _LEVELS), key=lambda gpu: gpu.bdf)


def _named(request: GpuRequest, inventory: Inventory, max_gpus: int) -> list[Gpu]:
    gpus = resolve_devices(request.devices, inventory)
    share = _unified_share(request, inventory)
    filtered = {gpu.bdf: misses for gpu in gpus if (misses := request_misses(request, gpu, share))}
    if filtered:
        first_misses = next(iter(filtered.values()))
        raise InvalidArgument(
            f"devices: {_count(len(filtered), 'named GPU')} fail the request's filters: "
            + "; ".join(f"{bdf} {_failed(misses)}" for bdf, misses in filtered.items()),
            details={"field": next(iter(first_misses)), "filtered_out": filtered},
        )
    if len(gpus) > max_gpus:
        raise FailedPrecondition(
            f"devices names {len(gpus)} GPUs, but a sandbox takes at most {max_gpus}",
            details={"wanted": len(gpus), "max_gpus": max_gpus},
        )
    blocked = {gpu.bdf: list(gpu.reasons) for gpu in gpus if not gpu.bindable}
    if blocked:
        listed = "; ".join(f"{bdf}: {', '.join(reasons)}" for bdf, reasons in blocked.items())
        raise FailedPrecondition(
            f"devices: {_count(len(blocked), 'named GPU')} cannot be passed to a guest: {listed}",
            details={"not_bindable": blocked},
        )
    out = {gpu.bdf: gpu for gpu in gpus if gpu.in_use_by is None and gpu.custody != FREE}
    sick = {bdf: gpu for bdf, gpu in out.items() if gpu.custody in (QUARANTINED, FAILED)}
    if sick:
        raise FailedPrecondition(
            f"devices: {_quarantined(list(sick.values()), 'named GPU')}",
            details={"custody": {bdf: _custody(gpu) for bdf, gpu in sick.items()}},
        )
    held = {gpu.bdf: gpu.in_use_by for gpu in gpus if gpu.in_use_by is not None}
    waiting = {bdf: gpu.custody for bdf, gpu in out.items()}
    if held or waiting:
        busy = [f"in use: {_holders(held)}"] if held else []
        busy += [f"{bdf} is {state}" for bdf, state in waiting.items()]
        raise ResourceExhausted(
            f"devices: {_count(len(held) + len(waiting), 'named GPU')} not free ("
            + "; ".join(busy)
            + "); retry once they are released",
            details={"held_by": held, **({"custody": waiting} if waiting else {})},
        )
    return gpus


def resolve_devices(device_ids: Sequence[str], inventory: Inventory) -> list[Gpu]:
    """The GPUs that canonical device ids name: BDF, ``GPU-`` UUID, DRM card or index."""
    gpus: dict[str, Gpu] = {}
    named_as: dict[str, str] = {}
    for device_id in device_ids:
        gpu = inventory.by_device_id(device_id)
        if gpu is None:
            valid = [ident for gpu in inventory.gpus for ident in gpu.device_ids()]
            choices = ", ".join(valid) if valid else "none: this host has no GPUs"
            raise InvalidArgument(
                f"devices: no GPU {device_id!r} on this host; valid ids: {choices}",
                details={"field": "devices", "value": device_id, "valid_ids": valid},
            )
        if gpu.bdf in gpus:
            raise InvalidArgument(
                f"devices: {named_as[gpu.bdf]!r} and {device_id!r} both name GPU {gpu.bdf}: "
                "list each GPU once",
                details={"field": "devices", "value": device_id, "bdf": gpu.bdf},
            )
        gpus[gpu.bdf] = gpu
        named_as[gpu.bdf] = device_id
    return list(gpus.values())


def _unified_share(request: GpuRequest, inventory: Inventory) -> int | None:
    """MiB of the unified memory pool each asked-for GPU may count on, as FlowMesh reckons it.

    FlowMesh (``unified_gpu_memory_satisfies`` in src/shared/utils/hardware.py): on a host whose
    GPUs use the host's memory, the pool divided by the number of GPUs asked for (1 for every
    free GPU) stands in for each GPU's own memory.
    """
    if inventory.unified_memory_mib is None:
        return None
    return inventory.unified_memory_mib // (request.wanted() or 1)


def request_misses(
    request: GpuRequest, gpu: Gpu, unified_share: int | None = None
) -> dict[str, str]:
    """Each filter of ``request`` that ``gpu`` fails: field name -> why.

    ``unified_share`` stands in for the memory of a GPU whose ``memory_source`` is "unified".
    """
    misses = {}
    if request.vendor is not None and gpu.vendor != request.vendor:
        misses["vendor"] = f"it is an {gpu.vendor} GPU, not {request.vendor}"
    if request.model is not None and not (gpu.name and model_matches(request.model, gpu.name)):
        name = f"{gpu.name!r} does not match" if gpu.name else "is unknown, so it cannot match"
        misses["model"] = f"its name {name} {request.model!r}"
    memory = gpu.memory_mib
    if memory is None and gpu.memory_source == "unified":
        memory = unified_share
    if request.min_memory_mib is not None and not (
        memory is not None and memory_satisfies(request.min_memory_mib, memory)
    ):
        if gpu.memory_mib is not None:
            has = f"{gpu.memory_mib} MiB"
        elif memory is not None:
            has = f"a {memory} MiB share of the host's unified memory"
        else:
            has = "an unknown amount"
        misses["min_memory_mib"] = f"it has {has}, {request.min_memory_mib} MiB asked"
    return misses


def _failed(misses: dict[str, str]) -> str:
    """``fails vendor (why), model (why)``."""
    return "fails " + ", ".join(f"{field} ({why})" for field, why in misses.items())


def _place(gpus: Sequence[Gpu], n: int, levels: Sequence[_Level]) -> list[Gpu]:
    """``n`` of ``gpus`` (sorted by BDF), chosen as ``select``'s docstring says."""
    if not levels or n == len(gpus):
        return list(gpus[:n])
    level, deeper = levels[0], levels[1:]
    groups: dict[Hashable, list[Gpu]] = {}
    for gpu in gpus:
        groups.setdefault(level(gpu), []).append(gpu)
    fitting = [group for group in groups.values() if len(group) >= n]
    if fitting:
        options = [(_place(group, n, deeper), len(group)) for group in fitting]
        return min(
            options,
            key=lambda option: (
                [len({key(gpu) for gpu in option[0]}) for key in deeper],
                option[1],
                [gpu.bdf for gpu in option[0]],
            ),
        )[0]
    # No group holds them all: whole groups, largest first, then the rest placed among the
    # groups left (at least one of which can hold it).
    rest = sorted(groups.values(), key=lambda group: (-len(group), group[0].bdf))
    taken: list[Gpu] = []
    while len(rest[0]) <= n - len(taken):
        taken += rest.pop(0)
    if len(taken) < n:
        left = sorted(chain.from_iterable(rest), key=lambda gpu: gpu.bdf)
        taken += _place(left, n - len(taken), levels)
    return taken


def _never(
    request: GpuRequest,
    inventory: Inventory,
    wanted: int | None,
    matching: list[Gpu],
    max_gpus: int,
) -> FailedPrecondition:
    """The host cannot ever satisfy the request: say how many, and why not more."""
    asked = _count(wanted, "GPU") if wanted is not None else "any GPU"
    details: dict[str, Any] = {"wanted": wanted, "max_gpus": max_gpus, "available": len(matching)}
    if wanted is not None and wanted > max_gpus:
        return FailedPrecondition(
            f"{asked} asked, but a sandbox takes at most {max_gpus}", details=details
        )
    not_bindable = {gpu.bdf: list(gpu.reasons) for gpu in inventory.gpus if not gpu.bindable}
    share = _unified_share(request, inventory)
    filtered = {
        gpu.bdf: misses
        for gpu in inventory.gpus
        if gpu.bindable and (misses := request_misses(request, gpu, share))
    }
    details |= {"gpus": len(inventory.gpus), "not_bindable": not_bindable}
    details |= {"filtered_out": filtered, "iommu": inventory.iommu}
    if not inventory.gpus:
        parts = ["this host has no GPUs"]
    elif not inventory.iommu:
        parts = [IOMMU_OFF]
    else:
        parts = []
        if not_bindable:
            first = {bdf: reasons[0] for bdf, reasons in not_bindable.items()}
            parts.append(
                f"{_count(len(first), 'GPU')} cannot be passed to a guest ({_some(first)})"
            )
        if filtered:
            failed = {bdf: _failed(misses) for bdf, misses in filtered.items()}
            parts.append(
                f"{_count(len(failed), 'GPU')} fail the request's filters ({_some(failed)})"
            )
    return FailedPrecondition(
        "; ".join(
            [
                f"this host can never give {asked}: it has {_count(len(inventory.gpus), 'GPU')}, "
                f"{len(matching)} of them bindable and matching the request",
                *parts,
            ]
        ),
        details=details,
    )


def _held(
    wanted: int | None, matching: list[Gpu], free: list[Gpu]
) -> ResourceExhausted | FailedPrecondition:
    """Enough suitable GPUs exist, but domains hold too many of them, they are being
    sanitized, or they are out until an operator checks them: FAILED_PRECONDITION when even
    the GPUs held or being sanitized would not be enough without the quarantined ones."""
    held = {gpu.bdf: gpu.in_use_by for gpu in matching if gpu.in_use_by is not None}
    out = [gpu for gpu in matching if gpu.in_use_by is None and gpu.custody != FREE]
    sick = [gpu for gpu in out if gpu.custody in (QUARANTINED, FAILED)]
    waiting = {gpu.bdf: gpu.custody for gpu in out if gpu not in sick}
    asked = _count(wanted, "GPU") if wanted is not None else "every free GPU"
    parts = [
        f"{asked} asked, but only {len(free)} of the {len(matching)} suitable GPUs "
        f"{'is' if len(free) == 1 else 'are'} free"
    ]
    if held:
        parts.append(f"in use: {_holders(held)}")
    if waiting:
        parts.append(
            f"{_count(len(waiting), 'GPU')} being sanitized or reset: "
            + ", ".join(f"{bdf} ({state})" for bdf, state in waiting.items())
        )
    if sick:
        parts.append(_quarantined(sick, "matching GPU"))
    details: dict[str, Any] = {
        "wanted": wanted,
        "free": len(free),
        "available": len(matching),
        "held_by": held,
    }
    if out:
        details["custody"] = {gpu.bdf: _custody(gpu) for gpu in out}
    coming = len(free) + len(held) + len(waiting)
    short = not coming if wanted is None else coming < wanted
    if sick and short:
        return FailedPrecondition("; ".join(parts), details=details)
    return ResourceExhausted("; ".join(parts) + "; retry once they are released", details=details)


def _quarantined(gpus: Sequence[Gpu], noun: str) -> str:
    """``2 matching GPUs are quarantined: BDF (reason, since ...); ...``, and what to do."""
    verb = "is" if len(gpus) == 1 else "are"
    listed = "; ".join(
        f"{gpu.bdf} ({gpu.custody}: {gpu.custody_reason or 'no reason recorded'}, since "
        f"{gpu.custody_since or '?'})"
        for gpu in gpus[:_LISTED]
    )
    if len(gpus) > _LISTED:
        listed += f"; and {len(gpus) - _LISTED} more"
    return (
        f"{_count(len(gpus), noun)} {verb} quarantined: {listed}; an operator's "
        "'vmsandbox gpus check BDF' resets and re-checks one"
    )


def _custody(gpu: Gpu) -> dict[str, str]:
    return {"state": gpu.custody, "reason": gpu.custody_reason, "since": gpu.custody_since}


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _holders(held: dict[str, str]) -> str:
    return ", ".join(f"{bdf} by domain {domain!r}" for bdf, domain in held.items())


def _some(texts: dict[str, str]) -> str:
    """The first few ``bdf: text`` items, then how many more."""
    items = [f"{bdf}: {text}" for bdf, text in list(texts.items())[:_LISTED]]
    if len(texts) > _LISTED:
        items.append(f"and {len(texts) - _LISTED} more")
    return "; ".join(items)
