"""Host GPU inventory: GPUs by PCI address, IOMMU groups, bindability, who holds them.

Modules: ``discover`` (the inventory: which GPUs the host has and whether each can go to a
guest) and ``model`` (its result types: ``Gpu``, ``FabricDevice``, ``Inventory``), read from
sysfs (``sysfs``: PCI functions, their IOMMU groups, drivers and reset methods; ``bars``: their
memory BARs; ``numa``: which host CPUs each NUMA node has) with names and memory from NVML
(``nvml``, optional) or a built-in table and the system's ``pci.ids`` (``pci_ids``); PCI
addresses in one grammar (``bdf``); who holds a GPU: host processes with its device nodes open
(``processes``) and libvirt domains with it in a ``<hostdev>`` (``holders``); the text table of
``vmsandbox gpus`` (``table``). ``python -m vmsandbox.host`` prints the inventory as JSON.

What a GPU's custody between tenants reads and does on the host (``vmsandbox.gpu.custody``
decides): a function's live config space, power state and bridge (``pcistate``), its reset
by the kernel (``pcireset``), the hardware memory clear of NVIDIA GPUs (``nvclear``), the
kernel's log read from a cursor (``kernlog``) and the AER errors in it (``aer``).

``libvirt_hostdev_holders`` is loaded on first use so that discovery alone does not pay for
importing libvirt.

Imports: the shared core only (the lowest package: every other one may use it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .discover import discover
from .model import Bar, FabricDevice, Gpu, Inventory
from .nvml import NvmlApi, NvmlError
from .table import render_table

if TYPE_CHECKING:
    from .holders import libvirt_hostdev_holders

__all__ = [
    "Bar",
    "FabricDevice",
    "Gpu",
    "Inventory",
    "NvmlApi",
    "NvmlError",
    "discover",
    "libvirt_hostdev_holders",
    "render_table",
]


def __getattr__(name: str) -> Any:
    if name == "libvirt_hostdev_holders":
        from .holders import libvirt_hostdev_holders

        return libvirt_hostdev_holders
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
