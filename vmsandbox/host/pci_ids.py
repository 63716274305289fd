"""Names and memory sizes of PCI devices that sysfs does not state.

Two sources: a built-in table of data-center GPUs (product name and the memory nvidia-smi
reports, in MiB) for hosts where NVML cannot answer (GPU on vfio-pci, AMD parts), and the
system's ``pci.ids`` file, read only when a name is missing and udev's hwdb gave none.
"""

from __future__ import annotations

import functools
import re
from typing import NamedTuple

PCI_IDS_PATH = "/usr/share/misc/pci.ids"
# Vendor and device ids are spelled as sysfs spells them everywhere in vmsandbox: "0x" and four
# lowercase hex digits. Tools that print them otherwise (lspci's "10de") go through ``pci_id``.
NVIDIA_VENDOR_ID = "0x10de"
AMD_VENDOR_ID = "0x1002"


class KnownPart(NamedTuple):
    """A GPU whose memory size follows from its PCI ID alone."""

    name: str
    memory_mib: int


# (vendor_id, device_id) -> part. Memory is the total nvidia-smi (or amd-smi) reports.
KNOWN_PARTS: dict[tuple[str, str], KnownPart] = {
    ("0x10de", "0x2330"): KnownPart("NVIDIA H100 80GB HBM3", 81559),
    ("0x10de", "0x2331"): KnownPart("NVIDIA H100 PCIe", 81559),
    ("0x10de", "0x2335"): KnownPart("NVIDIA H200", 143771),
    ("0x10de", "0x20b0"): KnownPart("NVIDIA A100-SXM4-40GB", 40960),
    ("0x10de", "0x20f1"): KnownPart("NVIDIA A100-PCIE-40GB", 40960),
    ("0x10de", "0x20b2"): KnownPart("NVIDIA A100-SXM4-80GB", 81920),
    ("0x10de", "0x20b5"): KnownPart("NVIDIA A100 80GB PCIe", 81920),
    ("0x10de", "0x27b8"): KnownPart("NVIDIA L4", 23034),
    ("0x10de", "0x26b9"): KnownPart("NVIDIA L40S", 46068),
    ("0x10de", "0x2236"): KnownPart("NVIDIA A10", 23028),
    ("0x10de", "0x1eb8"): KnownPart("Tesla T4", 15360),
    ("0x1002", "0x74a1"): KnownPart("AMD Instinct MI300X", 196608),
}

# Debian 12's pci.ids (2023.04.10), and the udev hwdb built from it, spell one H100 entry
# "GH100[H100 SXM5 80GB]"; every other entry, and later releases, put a space before "[".
_BRACKET_AFTER_WORD = re.compile(r"(?<=\S)\[")
_NEXT_SECTION = re.compile(r"^(?:[0-9a-f]{4}|C [0-9a-f]{2})  ", re.MULTILINE)


def pci_id(text: str) -> str:
    """A vendor or device id in vmsandbox's spelling: ``10DE``, ``0x10de`` -> ``0x10de``."""
    return "0x" + text.strip().lower().removeprefix("0x").zfill(4)


def known_part(vendor_id: str, device_id: str) -> KnownPart | None:
    """The built-in table entry for a PCI ID, if there is one."""
    return KNOWN_PARTS.get((vendor_id, device_id))


@functools.cache
def _pci_ids_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read()
    except OSError:
        return None


def _lookup(header: str, entry: str, path: str) -> str | None:
    """Name of the tab-indented ``entry`` inside the block that starts with line ``header``."""
    text = _pci_ids_text(path)
    if text is None:
        return None
    start = text.find(f"\n{header}  ")
    if start < 0:
        return None
    start += 1
    section_end = _NEXT_SECTION.search(text, start + len(header) + 2)
    end = section_end.start() if section_end else len(text)
    match = re.compile(rf"^\t{entry}  (.+)$", re.MULTILINE).search(text, start, end)
    return match[1].strip() if match else None


def tidy_name(name: str) -> str:
    """A pci.ids or hwdb name in the spelling of the rest of the file: a space before the
    bracketed marketing name (``GH100[H100 SXM5 80GB]`` -> ``GH100 [H100 SXM5 80GB]``)."""
    return _BRACKET_AFTER_WORD.sub(" [", name)


def device_name(vendor_id: str, device_id: str, path: str = PCI_IDS_PATH) -> str | None:
    """Device name from ``pci.ids`` (``0x10de``, ``0x2330`` -> ``GH100 [H100 SXM5 80GB]``)."""
    name = _lookup(vendor_id[2:].lower(), device_id[2:].lower(), path)
    return tidy_name(name) if name else None


def class_name(class_id: str, path: str = PCI_IDS_PATH) -> str | None:
    """PCI subclass name from ``pci.ids`` (``0x020000`` -> ``Ethernet controller``)."""
    digits = class_id[2:].lower()
    return _lookup(f"C {digits[:2]}", digits[2:4], path)
