"""Which guest PCI address each host GPU and companion function got.

``vmsandbox.gpu.passthrough`` puts GPU k (in hostdev order) behind its own root port, after the
domain's other ports, so the GPUs sit on consecutive guest buses: GPU k at ``base + k``, device
00 function 0, even when a GPU before it failed to show up (its empty port keeps its bus). A
card's other functions (companions) share its guest bus and device with their host function
numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vmsandbox.host.bdf import parse_bdf

from .parse import PciFunction
from .report import ExpectedGpu

PCI_BRIDGE_CLASS = "0604"


@dataclass(frozen=True)
class Placement:
    """Guest addresses, None where a function was not found: ``gpus[k]`` for GPU k,
    ``companions[k][j]`` for its companion j (both in the order of the GPUs passed)."""

    gpus: tuple[str | None, ...]
    companions: tuple[tuple[str | None, ...], ...]


def map_addresses(gpus: Sequence[ExpectedGpu], functions: Sequence[PciFunction]) -> Placement:
    """Give each GPU and companion its guest address.

    The base bus is the one under which most GPUs are where their ids say; ties go to the base
    the root ports predict (one bus per port, the GPUs' ports last). GPUs left over take the
    free functions with their ids in address order. A companion sits in its GPU's guest slot
    with its host function number, or else takes the first free function with its ids.
    """
    free = sorted(functions, key=lambda function: function.address)
    wanted = [gpu.ids for gpu in gpus]
    # The function 0 of device 00 on each bus of domain 0: where a passed GPU sits. Every other
    # function of a multi-function card is a companion and names no bus of its own.
    first: dict[int, PciFunction] = {}
    for function in free:
        parsed = parse_bdf(function.address)
        if parsed and parsed.domain == 0 and parsed.slot == 0 and parsed.function == 0:
            first[parsed.bus] = function
    ports = sum(
        1
        for f in free
        if f.class_id == PCI_BRIDGE_CLASS and (a := parse_bdf(f.address)) and a[:2] == (0, 0)
    )
    predicted = ports - len(gpus) + 1

    def ids_at(bus: int) -> tuple[str, str] | None:
        function = first.get(bus)
        return function.ids if function else None

    def placed(base: int) -> int:
        return sum(1 for k, ids in enumerate(wanted) if ids_at(base + k) == ids)

    addresses: list[str | None] = [None] * len(gpus)
    bases = {bus - k for k, ids in enumerate(wanted) for bus, f in first.items() if f.ids == ids}
    if bases:
        base = max(sorted(bases), key=lambda b: (placed(b), b == predicted))
        for k, ids in enumerate(wanted):
            if ids_at(base + k) == ids:
                addresses[k] = first[base + k].address
                free.remove(first[base + k])
    for k, ids in enumerate(wanted):
        if addresses[k] is None:
            match = next((f for f in free if f.ids == ids), None)
            if match is not None:
                addresses[k] = match.address
                free.remove(match)
    # Companions in their GPU's guest slot first, so that a card whose GPU is missing takes
    # no function of another card; then whatever is left with the companion's ids.
    companions: list[list[str | None]] = [[None] * len(gpu.companions) for gpu in gpus]
    for k, (gpu, address) in enumerate(zip(gpus, addresses, strict=True)):
        guest = parse_bdf(address) if address else None
        for j, (bdf, ids) in enumerate(zip(gpu.companions, gpu.companion_ids, strict=True)):
            host = parse_bdf(bdf)
            if guest is None or host is None:
                continue
            same_slot = str(guest._replace(function=host.function))
            match = next((f for f in free if f.ids == ids and f.address == same_slot), None)
            if match is not None:
                companions[k][j] = match.address
                free.remove(match)
    for k, gpu in enumerate(gpus):
        for j, ids in enumerate(gpu.companion_ids):
            if companions[k][j] is None:
                match = next((f for f in free if f.ids == ids), None)
                if match is not None:
                    companions[k][j] = match.address
                    free.remove(match)
    return Placement(gpus=tuple(addresses), companions=tuple(tuple(c) for c in companions))
