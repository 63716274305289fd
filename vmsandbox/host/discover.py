"""Host GPU inventory: which GPUs the host has and whether each can go to a guest.

What counts as a GPU: NVIDIA (0x10de) VGA and 3D controllers, AMD (0x1002) VGA and display
controllers and processing accelerators (MI300X). NVIDIA bridges of class 0x0680 are
NVSwitches: listed as fabric, never as GPUs.

A GPU is bindable (libvirt can detach it to vfio-pci for a guest) when the IOMMU is on, the GPU
has an IOMMU group, every other member of that group is a companion function of the same card,
a PCI bridge or already on vfio-pci, it is not the boot VGA device, no host process holds it
open, and the kernel can reset it: ``reset_method`` in sysfs names a secondary bus reset or a
Function Level Reset (``pcireset``: without one the next guest could read what the last left in
its memory; ``require_reset=False`` drops this rule, for hosts whose operator clears GPUs
otherwise).

Whether a libvirt domain already holds it is reported apart (``in_use_by``), and the IOMMU
group is the unit: a GPU is held when any function of its group is (VFIO gives a whole group
to one guest), so two GPUs behind a switch without ACS never go to two sandboxes.

``pcie_switch``: the GPU's parent bridge is a switch downstream port when that bridge has a PCI
parent of its own; that grandparent is the switch's upstream port. A GPU behind a root port
(whose parent is the host bridge, not a PCI function) gets None.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping

from . import pci_ids
from .bars import parse_resource, prefetchable_64bit_total
from .bdf import canonical_bdf, slot_of
from .model import FabricDevice, Gpu, Inventory, group_holder
from .nvml import NvmlApi, NvmlGpu, NvmlReport, read_nvml
from .pcireset import choose
from .processes import device_node_holders, drm_nodes, nvidia_minors, process_name
from .sysfs import PciFunction, scan_pci

NVIDIA = pci_ids.NVIDIA_VENDOR_ID
AMD = pci_ids.AMD_VENDOR_ID
VENDORS = {NVIDIA: "nvidia", AMD: "amd"}
# (vendor, class >> 8) of GPUs and of fabric devices
GPU_CLASSES = {(NVIDIA, 0x0300), (NVIDIA, 0x0302), (AMD, 0x0300), (AMD, 0x0380), (AMD, 0x1200)}
FABRIC_CLASSES = {(NVIDIA, 0x0680)}
VFIO_DRIVER = "vfio-pci"
NVIDIA_DRIVER = "nvidia"
AMDGPU_DRIVER = "amdgpu"
_UNIFIED_NAME_RE = re.compile(r"\b(?:gb10|tegra|thor)\b", re.I)
NO_RESET = (
    "the kernel has no reset method for it that resets a GPU (sysfs reset_method names neither "
    "bus nor flr), so the next guest could read what the last one left in its memory; set "
    "require_gpu_reset = false only if this host clears GPU memory by other means"
)
IOMMU_OFF = (
    "IOMMU is off on this host (no PCI device has an iommu_group); "
    "enable intel_iommu=on or amd_iommu=on"
)


def _kind(function: PciFunction) -> str | None:
    key = (function.vendor_id, function.class_code >> 8)
    if key in GPU_CLASSES:
        return "gpu"
    if key in FABRIC_CLASSES:
        return "fabric"
    return None


def _class_name(function: PciFunction) -> str:
    """Readable class of a device, for reasons: hwdb, then pci.ids, then the code."""
    return (
        function.hwdb_class_name
        or pci_ids.class_name(function.class_id)
        or f"PCI class {function.class_id}"
    )


def _name(function: PciFunction, nvml_name: str | None) -> str | None:
    """hwdb, then pci.ids, then NVML, then the built-in table."""
    if function.hwdb_name:
        return pci_ids.tidy_name(function.hwdb_name)
    name = pci_ids.device_name(function.vendor_id, function.device_id) or nvml_name
    if name:
        return name
    part = pci_ids.known_part(function.vendor_id, function.device_id)
    return part.name if part else None


def _host_holders(gpus: list[PciFunction], proc_root: str) -> dict[str, set[int]]:
    """PIDs holding each GPU open: its /dev/nvidiaN (nvidia driver) and its /dev/dri nodes."""
    minors = nvidia_minors((gpu.bdf for gpu in gpus if gpu.driver == NVIDIA_DRIVER), proc_root)
    nodes = {gpu.bdf: drm_nodes(gpu.sys_path) for gpu in gpus if gpu.driver}
    for bdf, minor in minors.items():
        nodes[bdf].append(f"/dev/nvidia{minor}")
    by_node = device_node_holders((node for names in nodes.values() for node in names), proc_root)
    return {bdf: set().union(*(by_node[node] for node in names)) for bdf, names in nodes.items()}


class _Host:
    """The scanned PCI functions and what the rules need to know about them."""

    def __init__(self, functions: dict[str, PciFunction]) -> None:
        self.functions = functions
        self.groups: dict[int, list[str]] = defaultdict(list)
        self.slots: dict[str, list[str]] = defaultdict(list)
        for bdf, function in functions.items():
            if function.iommu_group is not None:
                self.groups[function.iommu_group].append(bdf)
            self.slots[slot_of(bdf)].append(bdf)
        self.iommu = bool(self.groups)

    def companions(self, gpu: PciFunction) -> list[PciFunction]:
        """The other functions of the GPU's slot (HDMI audio, USB, UCSI)."""
        return [self.functions[bdf] for bdf in self.slots[slot_of(gpu.bdf)] if bdf != gpu.bdf]

    def group_members(self, gpu: PciFunction) -> list[PciFunction]:
        """The other devices of the GPU's IOMMU group."""
        if gpu.iommu_group is None:
            return []
        return [self.functions[bdf] for bdf in self.groups[gpu.iommu_group] if bdf != gpu.bdf]

    def pcie_switch(self, gpu: PciFunction) -> str | None:
        """Upstream port of the switch above the GPU (see the module docstring)."""
        parent = self.functions.get(gpu.parent_bdf) if gpu.parent_bdf else None
        if parent is None or parent.parent_bdf not in self.functions:
            return None
        return parent.parent_bdf

    def reasons(
        self,
        gpu: PciFunction,
        companions: tuple[str, ...],
        pids: set[int],
        proc_root: str,
        require_reset: bool = True,
    ) -> list[str]:
        """Readable sentences saying why the GPU cannot go to a guest; empty when it can."""
        reasons: list[str] = []
        if not self.iommu:
            reasons.append(IOMMU_OFF)
        elif gpu.iommu_group is None:
            reasons.append(
                "the GPU has no IOMMU group although the IOMMU is on, so VFIO cannot take it"
            )
        for member in self.group_members(gpu):
            if member.bdf in companions or member.is_bridge or member.driver == VFIO_DRIVER:
                continue
            driver = f"driver {member.driver}" if member.driver else "no driver"
            reasons.append(
                f"IOMMU group {gpu.iommu_group} also holds {member.bdf} "
                f"({_class_name(member)}, {driver}), which is not a companion, a bridge "
                "or on vfio-pci"
            )
        if gpu.boot_vga:
            reasons.append("it is the boot VGA device (boot_vga=1): the host console runs on it")
        if pids:
            held = ", ".join(
                f"pid {pid} ({process_name(pid, proc_root) or '?'})" for pid in sorted(pids)
            )
            reasons.append(f"host processes hold it open: {held}")
        if require_reset and choose(gpu.reset_methods) is None:
            reasons.append(NO_RESET)
        return reasons


def _fabric(function: PciFunction, holders: Mapping[str, str]) -> FabricDevice:
    return FabricDevice(
        bdf=function.bdf,
        vendor=VENDORS[function.vendor_id],
        vendor_id=function.vendor_id,
        device_id=function.device_id,
        class_id=function.class_id,
        name=_name(function, None),
        driver=function.driver,
        numa_node=function.numa_node,
        iommu_group=function.iommu_group,
        in_use_by=holders.get(function.bdf),
    )


def _memory(
    function: PciFunction, nvml_gpu: NvmlGpu | None, name: str | None
) -> tuple[int | None, str]:
    """Memory in MiB and where the figure came from.

    A unified-memory GPU (GB10, Tegra, Thor: named as FlowMesh's worker/hw.py names them) has
    no memory of its own: "unified", and the host's pool stands in (``unified_memory_mib``).
    """
    if nvml_gpu is not None and nvml_gpu.memory_mib is not None:
        return nvml_gpu.memory_mib, "nvml"
    part = pci_ids.known_part(function.vendor_id, function.device_id)
    if part is not None:
        return part.memory_mib, "pci-id"
    if name is not None and _UNIFIED_NAME_RE.search(name):
        return None, "unified"
    return None, "unknown"


def _host_memory_mib(proc_root: str) -> int | None:
    """MemTotal of ``/proc/meminfo`` in MiB, None when it cannot be read."""
    try:
        with open(f"{proc_root}/meminfo", encoding="ascii", errors="replace") as meminfo:
            for line in meminfo:
                key, _, value = line.partition(":")
                if key == "MemTotal" and value.split()[1:] == ["kB"]:
                    return int(value.split()[0]) // 1024
    except (OSError, ValueError):
        return None
    return None


def _rocm_uuid(function: PciFunction) -> str | None:
    """ROCm's UUID of an amdgpu device: "GPU-" and the 16 hex digits of its ``unique_id``.

    amdgpu writes ``unique_id`` only on parts that have one (most Instinct and recent Radeon
    boards); other values are not a ROCm UUID and are left out.
    """
    if function.driver != AMDGPU_DRIVER or function.unique_id is None:
        return None
    text = function.unique_id.lower()
    if len(text) != 16 or any(c not in "0123456789abcdef" for c in text):
        return None
    return f"GPU-{text}"


def discover(
    in_use: Mapping[str, str] | None = None,
    *,
    use_nvml: bool = True,
    proc_root: str = "/proc",
    nvml: NvmlApi | None = None,
    require_reset: bool = True,
) -> Inventory:
    """Inventory of the host's GPUs and GPU fabric devices.

    ``in_use`` maps BDF -> name of the libvirt domain holding it (see
    ``libvirt_hostdev_holders``); a GPU is held by the holder of any function of its IOMMU
    group. ``nvml`` replaces pynvml (a test seam); NVML is asked only when ``use_nvml`` and
    some GPU is on the nvidia driver. ``proc_root`` is where /proc is. ``require_reset``: a
    GPU the kernel cannot reset is not bindable (see the module docstring).
    """
    host = _Host(scan_pci())
    holders = {canonical_bdf(bdf): name for bdf, name in (in_use or {}).items()}
    gpu_functions = [f for f in host.functions.values() if _kind(f) == "gpu"]
    fabric = [_fabric(f, holders) for f in host.functions.values() if _kind(f) == "fabric"]

    report = NvmlReport(False, {})
    if use_nvml and any(gpu.driver == NVIDIA_DRIVER for gpu in gpu_functions):
        report = read_nvml(nvml)
    host_pids = _host_holders(gpu_functions, proc_root)

    gpus = []
    for index, function in enumerate(gpu_functions):
        nvml_gpu = report.gpus.get(function.bdf) if function.driver == NVIDIA_DRIVER else None
        pids = host_pids.get(function.bdf, set()) | set(nvml_gpu.pids if nvml_gpu else ())
        companions = host.companions(function)
        companion_bdfs = tuple(c.bdf for c in companions)
        bars = parse_resource(function.resource)
        name = _name(function, nvml_gpu.name if nvml_gpu else None)
        memory_mib, memory_source = _memory(function, nvml_gpu, name)
        reasons = host.reasons(function, companion_bdfs, pids, proc_root, require_reset)
        members = tuple(m.bdf for m in host.group_members(function))
        gpus.append(
            Gpu(
                bdf=function.bdf,
                vendor=VENDORS[function.vendor_id],
                vendor_id=function.vendor_id,
                device_id=function.device_id,
                class_id=function.class_id,
                name=name,
                driver=function.driver,
                numa_node=function.numa_node,
                iommu_group=function.iommu_group,
                group_members=members,
                companions=companion_bdfs,
                companion_ids=tuple((c.vendor_id, c.device_id) for c in companions),
                bars=bars,
                bar_64bit_prefetchable_total=prefetchable_64bit_total(bars),
                memory_mib=memory_mib,
                memory_source=memory_source,
                uuid=nvml_gpu.uuid if nvml_gpu else _rocm_uuid(function),
                bindable=not reasons,
                reasons=tuple(reasons),
                # held when any function of its slot or its IOMMU group is (group_holder)
                in_use_by=group_holder((function.bdf, *companion_bdfs, *members), holders),
                index=index,
                pcie_switch=host.pcie_switch(function),
                boot_vga=function.boot_vga,
                drm_cards=function.drm_cards,
            )
        )
    unified = any(gpu.memory_source == "unified" for gpu in gpus)
    return Inventory(
        gpus=tuple(gpus),
        fabric=tuple(fabric),
        iommu=host.iommu,
        pci_devices=len(host.functions),
        nvml=report.answered,
        notes=report.notes,
        unified_memory_mib=_host_memory_mib(proc_root) if unified else None,
    )
