"""Result types of host discovery: what a GPU, a fabric device and the host look like."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class Bar:
    """One memory BAR of a PCI function, from its sysfs ``resource`` file."""

    index: int
    size: int
    is_64bit: bool
    prefetchable: bool


@dataclass(frozen=True)
class Gpu:
    """A GPU as the inventory sees it. ``bdf`` is canonical: ``0000:bb:dd.f``, lowercase."""

    bdf: str
    vendor: str  # "nvidia" | "amd"
    vendor_id: str  # "0x10de"
    device_id: str  # "0x2330"
    class_id: str  # "0x030200"
    name: str | None
    driver: str | None
    numa_node: int | None
    iommu_group: int | None
    group_members: tuple[str, ...]
    companions: tuple[str, ...]
    # (vendor_id, device_id) of each companion, in the order of ``companions``
    companion_ids: tuple[tuple[str, str], ...]
    bars: tuple[Bar, ...]
    bar_64bit_prefetchable_total: int
    memory_mib: int | None
    memory_source: str  # "nvml" | "pci-id" | "unified" (the host's memory) | "unknown"
    uuid: str | None
    bindable: bool
    reasons: tuple[str, ...]
    in_use_by: str | None
    index: int  # position in the inventory, sorted by BDF
    pcie_switch: str | None = None  # BDF of the upstream switch port above the GPU, if any
    boot_vga: bool = False
    # DRM card nodes the host driver made for it ("card1"): AMD tools and some platforms name
    # GPUs this way. ``uuid`` is NVML's for NVIDIA, ROCm's ("GPU-" + sysfs unique_id) for AMD.
    drm_cards: tuple[str, ...] = ()
    # Its custody between tenants (vmsandbox.gpu.custody): "free" unless the host's records
    # say otherwise; only free GPUs are allocated. Discovery leaves it free.
    custody: str = "free"
    custody_reason: str = ""
    custody_since: str = ""

    def device_ids(self) -> tuple[str, ...]:
        """Every canonical device id that names this GPU (see ``vmsandbox.gpu.request``)."""
        uuid = (self.uuid[:4].upper() + self.uuid[4:].lower(),) if self.uuid else ()
        return (self.bdf, str(self.index), *uuid, *self.drm_cards)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["group_members"] = list(self.group_members)
        data["companions"] = list(self.companions)
        data["companion_ids"] = [list(pair) for pair in self.companion_ids]
        data["bars"] = [asdict(bar) for bar in self.bars]
        data["reasons"] = list(self.reasons)
        data["drm_cards"] = list(self.drm_cards)
        return data


@dataclass(frozen=True)
class FabricDevice:
    """A GPU fabric device (an NVIDIA NVSwitch): never passed as a GPU; in full passthrough
    the guest that takes every GPU of the board takes every NVSwitch too."""

    bdf: str
    vendor: str
    vendor_id: str
    device_id: str
    class_id: str
    name: str | None
    driver: str | None
    numa_node: int | None
    iommu_group: int | None
    in_use_by: str | None = None  # the libvirt domain whose XML holds it, as for GPUs

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Inventory:
    gpus: tuple[Gpu, ...]
    fabric: tuple[FabricDevice, ...]
    iommu: bool
    pci_devices: int
    nvml: bool  # whether NVML answered
    notes: tuple[str, ...] = field(default=())
    # host memory (MemTotal) that GPUs with memory_source "unified" share; None without them
    unified_memory_mib: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpus": [gpu.to_dict() for gpu in self.gpus],
            "fabric": [dev.to_dict() for dev in self.fabric],
            "host": {
                "iommu": self.iommu,
                "pci_devices": self.pci_devices,
                "gpus": len(self.gpus),
                "bindable": sum(1 for gpu in self.gpus if gpu.bindable),
                "free": sum(
                    1
                    for gpu in self.gpus
                    if gpu.bindable and gpu.in_use_by is None and gpu.custody == "free"
                ),
                "fabric": len(self.fabric),
                "nvml": self.nvml,
                "notes": list(self.notes),
                "unified_memory_mib": self.unified_memory_mib,
            },
        }

    def by_bdf(self, bdf: str) -> Gpu | None:
        return next((gpu for gpu in self.gpus if gpu.bdf == bdf), None)

    def by_device_id(self, device_id: str) -> Gpu | None:
        """The GPU a canonical device id names: BDF, index, UUID or DRM card name."""
        return next((gpu for gpu in self.gpus if device_id in gpu.device_ids()), None)


def group_holder(functions: Iterable[str], holders: Mapping[str, str]) -> str | None:
    """The holder of the first of ``functions`` (a GPU, its companions, the rest of its IOMMU
    group) that ``holders`` (BDF -> domain) names: VFIO gives a whole group to one guest, so
    a GPU is held when any function of its group is."""
    return next((holders[bdf] for bdf in functions if bdf in holders), None)


def with_holders(inventory: Inventory, holders: Mapping[str, str]) -> Inventory:
    """``inventory`` with every ``in_use_by`` read again from ``holders`` (BDF -> domain): the
    allocation under the host lock puts the reservations it finds there on top of the view
    discovery read before it."""
    gpus = tuple(
        replace(
            gpu,
            in_use_by=group_holder((gpu.bdf, *gpu.companions, *gpu.group_members), holders),
        )
        for gpu in inventory.gpus
    )
    fabric = tuple(replace(dev, in_use_by=holders.get(dev.bdf)) for dev in inventory.fabric)
    return replace(inventory, gpus=gpus, fabric=fabric)
