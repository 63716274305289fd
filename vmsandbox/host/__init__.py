"""Host GPU inventory: GPUs by PCI address, IOMMU groups, bindability, who holds them.

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
