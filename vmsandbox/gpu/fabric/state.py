"""The fabric of this host as configured: its model and, in shared NVSwitch mode, FM's table.

``read`` asks Fabric Manager (through fmpm) only when the host has NVSwitches and
``fabricmanager.cfg`` says shared NVSwitch mode; a host without NVSwitches costs nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from vmsandbox.config import Config
from vmsandbox.gpu.fabric.fmpm import Fmpm
from vmsandbox.gpu.fabric.mode import SHARED, FabricMode, detect
from vmsandbox.gpu.fabric.partitions import PartitionTable
from vmsandbox.host.model import Inventory


@dataclass(frozen=True)
class Fabric:
    """The fabric as the allocator needs it: the model, FM's partition table (shared mode
    only) and, per active partition, the domain that holds its GPUs (id -> domain name)."""

    mode: FabricMode
    table: PartitionTable | None = None
    owners: Mapping[int, str] = field(default_factory=dict)


def client(config: Config) -> Fmpm:
    """The fmpm client that ``config`` describes."""
    return Fmpm(
        binary=config.fmpm,
        unix_socket=config.fm_unix_socket or None,
        hostname=config.fm_hostname or None,
        timeout=config.fmpm_timeout,
    )


def read(config: Config, inventory: Inventory) -> Fabric:
    """The host's fabric; in shared mode FM's table is read now (UNAVAILABLE when FM cannot
    be reached, FAILED_PRECONDITION when fmpm is missing)."""
    mode = detect(inventory, config.fabric_manager_config)
    if mode.kind != SHARED:
        return Fabric(mode)
    table = client(config).list()
    return Fabric(mode, table, owners(table, inventory))


def owners(table: PartitionTable, inventory: Inventory) -> dict[int, str]:
    """Active partition id -> the domain holding one of its GPUs (libvirt's ``<hostdev>``)."""
    held = {gpu.bdf: gpu.in_use_by for gpu in inventory.gpus if gpu.in_use_by is not None}
    found: dict[int, str] = {}
    for partition in table.active():
        holder = next((held[bdf] for bdf in sorted(partition.bdfs) if bdf in held), None)
        if holder is not None:
            found[partition.id] = holder
    return found


def with_reservations(fabric: Fabric, inventory: Inventory, reserved: Mapping[int, str]) -> Fabric:
    """The fabric as the allocation under the host lock sees it: the partitions that
    reservations hold (partition id -> holder; their activation runs outside the lock, so FM
    may not list them active yet) count as active, and the owners are read again from
    ``inventory``'s holders (``host.model.with_holders``)."""
    if fabric.table is None:
        return fabric
    table = replace(
        fabric.table,
        partitions=tuple(
            replace(p, active=p.active or p.id in reserved) for p in fabric.table.partitions
        ),
    )
    found = owners(table, inventory)
    for partition_id, holder in reserved.items():
        found.setdefault(partition_id, holder)
    return Fabric(fabric.mode, table, found)
