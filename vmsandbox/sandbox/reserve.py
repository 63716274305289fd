"""What a transition reads before it takes the host lock, and what it decides under it.

A create, claim or fill first reads the host without the lock (``HostView``: every libvirt
domain with its UUID and held PCI devices, and for a GPU request the inventory and Fabric
Manager's table): slow work, seconds with NVML and 100 domains. Under the lock it reads only
the reservations (holds.py, a few small files) and puts them on top of the view (``taken``):
holds are current, and say everything about this state directory's sandboxes; the view adds
what holds do not describe (other tools' and other state directories' domains, and sandboxes
made before holds existed), less the domains dropped since it was read (tombstones), the
Fabric Manager partitions still in the lease ledger (an orphan's partition stays taken until
reconcile has deactivated it and dropped its lease, gpu/fabric/lease.py), and each GPU's
custody (only free GPUs are given: ``vmsandbox.gpu.custody``). The name, port and GPUs are
then chosen from that (``check_name``, ``pick_port``, ``allocate``), and the hold written before
the lock is given back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vmsandbox.errors import AlreadyExists, FailedPrecondition
from vmsandbox.gpu.custody.state import Custody
from vmsandbox.gpu.custody.store import CustodyStore
from vmsandbox.gpu.fabric.lease import FabricLease
from vmsandbox.sandbox import plan
from vmsandbox.sandbox.holds import Hold, Holds
from vmsandbox.sandbox.record import SandboxRecord, names_domain
from vmsandbox.vm.domain import DOMAIN_PREFIX
from vmsandbox.vm.hypervisor import Hypervisor, Stored

if TYPE_CHECKING:
    from vmsandbox.config import Config
    from vmsandbox.gpu.allocator import Allocation
    from vmsandbox.gpu.fabric.state import Fabric
    from vmsandbox.gpu.request import GpuRequest
    from vmsandbox.host.model import Inventory


@dataclass(frozen=True)
class HostView:
    """The host as read outside the lock: every domain, and for GPU requests the inventory
    (``in_use_by`` from those domains) and the fabric."""

    domains: tuple[Stored, ...]
    inventory: Inventory | None = None
    fabric: Fabric | None = None

    def ours(self, config: Config) -> list[tuple[SandboxRecord, Stored]]:
        """This state directory's sandboxes among the domains, with their stored form."""
        found = []
        for stored in self.domains:
            if stored.data is None or not names_domain(stored.data, stored.domain):
                continue
            try:
                record = SandboxRecord.from_dict(stored.data)
            except FailedPrecondition:
                continue  # a newer vmsandbox's record: never ours to pick
            if local(config, record):
                found.append((record, stored))
        return found


@dataclass
class Taken:
    """What is taken now (under the lock): sandbox names, SSH ports, PCI devices (BDF ->
    holding domain), Fabric Manager partitions (id -> holding domain), the holds, and each
    GPU's custody record (by BDF)."""

    names: set[str] = field(default_factory=set)
    ports: set[int] = field(default_factory=set)
    holders: dict[str, str] = field(default_factory=dict)
    partitions: dict[int, str] = field(default_factory=dict)
    holds: dict[str, Hold] = field(default_factory=dict)
    custody: dict[str, Custody] = field(default_factory=dict)


def look(
    hypervisor: Hypervisor,
    config: Config,
    gpus: bool,
    inventory: Callable[[Mapping[str, str]], Inventory],
) -> HostView:
    """What a create reads before it reserves, outside the host lock: every domain, and with
    ``gpus`` the inventory (``inventory(holders)``: sysfs, NVML, host processes) and the
    fabric (Fabric Manager's table, read now in shared NVSwitch mode)."""
    domains = tuple(hypervisor.every_domain())
    if not gpus:
        return HostView(domains)
    from vmsandbox.gpu.fabric import state

    found = inventory({bdf: d.domain for d in domains for bdf in d.hostdevs})
    return HostView(domains, found, state.read(config, found))


def local(config: Config, record: SandboxRecord) -> bool:
    """Whether ``config``'s state directory made the sandbox (its record names our keys)."""
    return record.keys == str(config.sandboxes / record.stem)


def taken(view: HostView, holds: Holds) -> Taken:
    """Under the lock: the holds, and what the view shows beyond them (module docstring)."""
    now = Taken(holds=holds.all(), custody=CustodyStore(holds.config).all())
    gone = holds.gone()
    for stored in view.domains:
        if stored.uuid in now.holds or stored.uuid in gone:
            continue
        for bdf in stored.hostdevs:
            now.holders.setdefault(bdf, stored.domain)
        if stored.domain.startswith(DOMAIN_PREFIX):
            now.names.add(stored.domain.removeprefix(DOMAIN_PREFIX))
        data = stored.data or {}
        if isinstance(data.get("name"), str):
            now.names.add(data["name"])
        ssh = data.get("ssh")
        port = ssh.get("port") if isinstance(ssh, dict) else None
        if isinstance(port, int):
            now.ports.add(port)
        if isinstance(data.get("fabric_partition"), int):
            now.partitions.setdefault(data["fabric_partition"], stored.domain)
    for hold in now.holds.values():
        now.names.update((hold.name, hold.stem))
        if hold.port is not None:
            now.ports.add(hold.port)
        for bdf in hold.gpus:
            now.holders[bdf] = hold.domain
        if hold.partition is not None:
            now.partitions[hold.partition] = hold.domain
    for lease in FabricLease(holds.config).leases():
        now.partitions.setdefault(lease.partition, DOMAIN_PREFIX + lease.sandbox)
    return now


def check_name(name: str, now: Taken, hypervisor: Hypervisor) -> None:
    """ALREADY_EXISTS when a sandbox (or a reservation) has ``name``; FAILED_PRECONDITION for
    a domain of that name that vmsandbox did not make. One libvirt lookup, for a domain
    defined since the view was read by something that takes no reservation."""
    if name in now.names:
        raise AlreadyExists(f"sandbox {name!r} already exists", details={"name": name})
    stored = hypervisor.metadata(DOMAIN_PREFIX + name)
    if stored is None:
        return
    if stored.data is None or not names_domain(stored.data, stored.domain):
        raise FailedPrecondition(
            f"domain {stored.domain!r} exists but was not made by vmsandbox; not touching it",
            details={"name": name},
        )
    raise AlreadyExists(f"sandbox {name!r} already exists", details={"name": name})


def pick_port(now: Taken) -> int:
    """A loopback port for the SSH forward that no sandbox holds and nothing listens on."""
    return plan.free_port(set(now.ports))


def allocate(
    request: GpuRequest | None, view: HostView, now: Taken, max_gpus: int
) -> Allocation | None:
    """The GPUs for ``request`` on the view's inventory with today's holders on top (pure:
    no I/O), and their Fabric Manager partition or NVSwitches; None without a request."""
    if request is None:
        return None
    from vmsandbox.gpu.custody.state import with_custody
    from vmsandbox.gpu.fabric import policy
    from vmsandbox.gpu.fabric.state import with_reservations
    from vmsandbox.host.model import with_holders

    assert view.inventory is not None and view.fabric is not None  # read for GPU requests
    inventory = with_custody(with_holders(view.inventory, now.holders), now.custody)
    fabric = with_reservations(view.fabric, inventory, now.partitions)
    return policy.allocate(request, inventory, max_gpus=max_gpus, fabric=fabric)


def held_functions(allocation: Allocation | None) -> tuple[str, ...]:
    """Every PCI function an allocation passes to its guest: GPUs, companions, NVSwitches."""
    if allocation is None:
        return ()
    found = [bdf for gpu in allocation.gpus for bdf in (gpu.bdf, *gpu.companions)]
    return tuple(found + [switch.bdf for switch in allocation.switches])
