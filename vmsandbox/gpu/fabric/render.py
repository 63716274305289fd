"""The fabric part of ``vmsandbox gpus``: the model and FM's partitions, as text and as JSON.

Each partition shows its id, size, GPUs by BDF, whether FM has it active, and its state:
``free``, ``held by <domain>`` (an active partition whose GPUs a domain holds), ``active, no
domain`` (activated outside vmsandbox, or left by a killed create until reconcile), or
``blocked`` with why (it overlaps an active partition, or a domain holds one of its GPUs).
An FM that cannot be reached is shown, not raised: the GPU list above it stays useful.
"""

from __future__ import annotations

from typing import Any

from vmsandbox.config import Config
from vmsandbox.errors import VmSandboxError
from vmsandbox.gpu.fabric.mode import NONE, SHARED, detect
from vmsandbox.gpu.fabric.partitions import Partition
from vmsandbox.gpu.fabric.policy import blockers
from vmsandbox.gpu.fabric.state import Fabric, read
from vmsandbox.host.model import Inventory

HEADER = ("PARTITION", "SIZE", "ACTIVE", "STATE", "GPUS")


def report(config: Config, inventory: Inventory) -> tuple[str, dict[str, Any]]:
    """(text, JSON object) of the host's fabric; text is empty on a host without NVSwitch."""
    try:
        fabric = read(config, inventory)
    except VmSandboxError as exc:
        mode = detect(inventory, config.fabric_manager_config)
        data = {**mode.to_dict(), "partitions": None, "error": exc.to_dict()}
        text = f"\nfabric: {mode.kind} ({mode.source})\npartitions: unavailable: {exc.code}: "
        return text + exc.message + "\n", data
    data = {**fabric.mode.to_dict(), "partitions": None}
    if fabric.mode.kind == NONE:
        return "", data
    lines = ["", f"fabric: {fabric.mode.kind} ({fabric.mode.source})"]
    if fabric.mode.kind == SHARED and fabric.table is not None:
        rows = [_row(p, inventory, fabric) for p in fabric.table.partitions]
        data["partitions"] = [
            {**p.to_dict(), "state": row[3]}
            for p, row in zip(fabric.table.partitions, rows, strict=True)
        ]
        lines += ["Fabric Manager partitions:", *_grid(rows)]
    return "\n".join(lines) + "\n", data


def _row(partition: Partition, inventory: Inventory, fabric: Fabric) -> tuple[str, ...]:
    if partition.active:
        owner = fabric.owners.get(partition.id)
        state = f"held by {owner}" if owner else "active, no domain"
    else:
        why = blockers(partition, inventory, fabric)
        state = f"blocked: {', '.join(why)}" if why else "free"
    return (
        str(partition.id),
        str(partition.size),
        "yes" if partition.active else "no",
        state,
        ",".join(sorted(partition.bdfs)),
    )


def _grid(rows: list[tuple[str, ...]]) -> list[str]:
    """Left-aligned columns two spaces apart; the last (GPUs) is not padded."""
    widths = [max(len(row[col]) for row in [HEADER, *rows]) for col in range(len(HEADER))]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in [HEADER, *rows]
    ]
