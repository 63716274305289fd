"""PCI functions as sysfs shows them.

Two levels of reading, for speed. The sweep over every function (a host has 100 to 300) reads
two things per function straight from sysfs: the kernel's ``uevent`` file (PCI_ID, PCI_CLASS,
DRIVER) and the ``iommu_group`` link. libudev's enumerator would cost about 0.25 ms per
function (it builds a full device, reads the udev database, resolves each path component),
50 ms on a 200-function host under umockdev, so it is not used for the sweep. The few
functions the inventory looks at closely (GPUs, fabric devices, group members that block a
GPU) are opened as pyudev devices: their attributes (``numa_node``, ``resource``, ``boot_vga``),
udev properties (hwdb names, which on a real host live in the udev database, not in
``uevent``) and parent come from pyudev, each read once.
"""

from __future__ import annotations

import os
import threading
from functools import cached_property
from typing import TYPE_CHECKING

from .pci_ids import pci_id

if TYPE_CHECKING:  # imported on first use: parsers that need only vmsandbox.host.bdf skip it
    import pyudev

SYS_PCI_DEVICES = "/sys/bus/pci/devices"
PCI_BRIDGE_CLASS = 0x0604


_this_thread = threading.local()


def udev_context() -> pyudev.Context:
    """This thread's pyudev context. libudev is not thread-safe (a context and the devices made
    from it take references on each other without atomics), and ``vmsandbox serve`` looks at
    the host from several RPC threads at once; so each thread has a context of its own, made
    on its first look (it runs ``ldconfig -p`` to find libudev)."""
    context = getattr(_this_thread, "udev", None)
    if context is None:
        import pyudev

        context = _this_thread.udev = pyudev.Context()
    return context


def _read_uevent(path: str) -> dict[str, str]:
    """``KEY=value`` lines of a device's ``uevent`` file (os.open: one read, no buffering)."""
    try:
        fd = os.open(f"{path}/uevent", os.O_RDONLY)
    except OSError:
        return {}
    try:
        text = os.read(fd, 65536).decode("utf-8", errors="replace")
    finally:
        os.close(fd)
    values = {}
    for line in text.split("\n"):
        key, _, value = line.partition("=")
        values[key] = value
    return values


def _read_group(path: str) -> int | None:
    try:
        return int(os.readlink(f"{path}/iommu_group").rpartition("/")[2])
    except (OSError, ValueError):
        return None


class PciFunction:
    """One PCI function (``0000:bb:dd.f``) of the host."""

    def __init__(self, bdf: str, sys_path: str) -> None:
        self.bdf = bdf
        self.sys_path = sys_path
        uevent = _read_uevent(sys_path)
        vendor, _, device = uevent.get("PCI_ID", "0:0").partition(":")
        self.vendor_id = pci_id(vendor)
        self.device_id = pci_id(device or "0")
        self.class_code = int(uevent.get("PCI_CLASS", "0"), 16)
        self.driver: str | None = uevent.get("DRIVER")
        self.iommu_group = _read_group(sys_path)

    def __repr__(self) -> str:
        return f"PciFunction({self.bdf!r})"

    @property
    def class_id(self) -> str:
        """``0x030200`` form."""
        return f"0x{self.class_code:06x}"

    @property
    def is_bridge(self) -> bool:
        """A PCI-to-PCI bridge (root port, switch port): never passed to a guest."""
        return self.class_code >> 8 == PCI_BRIDGE_CLASS

    @cached_property
    def _device(self) -> pyudev.Device:
        import pyudev

        return pyudev.Devices.from_sys_path(udev_context(), self.sys_path)

    def _attribute(self, name: str) -> str | None:
        value = self._device.attributes.get(name)
        return None if value is None else value.decode("utf-8", errors="replace").strip()

    @cached_property
    def numa_node(self) -> int | None:
        """NUMA node, None when the platform does not say (-1 or absent)."""
        value = self._attribute("numa_node")
        node = int(value) if value else -1
        return None if node < 0 else node

    @cached_property
    def resource(self) -> str | None:
        """Text of the ``resource`` attribute: one ``start end flags`` line per resource."""
        return self._attribute("resource")

    @cached_property
    def boot_vga(self) -> bool:
        """Whether firmware initialised this device as the console VGA device."""
        return self._attribute("boot_vga") == "1"

    @cached_property
    def reset_methods(self) -> tuple[str, ...]:
        """How the kernel can reset the function: the words of ``reset_method`` (Linux 5.15
        and later: "flr bus", "pm", ...; the file is absent when there is none); on older
        kernels, whose ``reset`` file exists only when there is one, ("reset",)."""
        listed = self._attribute("reset_method")
        if listed is not None:
            return tuple(listed.split())
        return ("reset",) if os.path.exists(f"{self.sys_path}/reset") else ()

    @cached_property
    def unique_id(self) -> str | None:
        """amdgpu's ``unique_id`` attribute: the 16 hex digits behind ROCm's GPU UUID."""
        return self._attribute("unique_id") or None

    @cached_property
    def drm_cards(self) -> tuple[str, ...]:
        """Names of the DRM card nodes below the function (``card1``), in number order."""
        try:
            names = os.listdir(f"{self.sys_path}/drm")
        except OSError:
            return ()
        cards = [name for name in names if name.startswith("card") and name[4:].isdecimal()]
        return tuple(sorted(cards, key=lambda name: int(name[4:])))

    @cached_property
    def hwdb_name(self) -> str | None:
        """Model name from udev's hwdb (``ID_MODEL_FROM_DATABASE``), if udev set one."""
        name: str | None = self._device.properties.get("ID_MODEL_FROM_DATABASE")
        return name

    @cached_property
    def hwdb_class_name(self) -> str | None:
        """Subclass name from udev's hwdb (``ID_PCI_SUBCLASS_FROM_DATABASE``)."""
        name: str | None = self._device.properties.get("ID_PCI_SUBCLASS_FROM_DATABASE")
        return name

    @cached_property
    def parent_bdf(self) -> str | None:
        """BDF of the bridge this function sits behind; None on a root bus."""
        parent = self._device.parent
        if parent is None or parent.subsystem != "pci":
            return None
        bdf: str = parent.sys_name
        return bdf


def scan_pci() -> dict[str, PciFunction]:
    """Every PCI function of the host, by BDF, in BDF order (none when sysfs has no PCI bus)."""
    try:
        names = sorted(os.listdir(SYS_PCI_DEVICES))
    except FileNotFoundError:
        return {}
    return {name: PciFunction(name, f"{SYS_PCI_DEVICES}/{name}") for name in names}
