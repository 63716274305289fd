"""PCI addresses: the one grammar every module reads them with, and the one spelling it writes.

Read: ``41:00.0``, ``0000:41:00.0`` and NVML's ``00000000:41:00.0``, in either case (a domain
of 4 to 8 hex digits or none, then 2-digit bus and device, then the function 0-7); on request
also libvirt's node device name ``pci_0000_41_00_0``. Written: ``0000:41:00.0``, lowercase.
"""

from __future__ import annotations

import re
from typing import NamedTuple

_HEX = "[0-9a-fA-F]"
# For embedding in the patterns of tool output (lspci, kernel log, nvidia-smi errors).
BDF_PATTERN = rf"(?:{_HEX}{{4,8}}:)?{_HEX}{{2}}:{_HEX}{{2}}\.[0-7]"
# ``domain:bus:device`` with no function, as NVIDIA's Xid lines name a GPU.
SLOT_PATTERN = rf"{_HEX}{{4,8}}:{_HEX}{{2}}:{_HEX}{{2}}"
MAX_DEVICE = 0x1F  # a PCI device number has 5 bits

_BDF = re.compile(
    rf"(?:(?P<domain>{_HEX}{{4,8}}):)?(?P<bus>{_HEX}{{2}}):(?P<slot>{_HEX}{{2}})\.(?P<function>[0-7])"
)
_LIBVIRT = re.compile(
    rf"[pP][cC][iI]_(?P<domain>{_HEX}{{4,8}})_(?P<bus>{_HEX}{{2}})_(?P<slot>{_HEX}{{2}})_(?P<function>[0-7])"
)
_SLOT = re.compile(rf"(?P<domain>{_HEX}{{4,8}}):(?P<bus>{_HEX}{{2}}):(?P<slot>{_HEX}{{2}})")


class Bdf(NamedTuple):
    """A PCI address as its four numbers; ``str()`` gives the canonical spelling."""

    domain: int
    bus: int
    slot: int
    function: int

    def __str__(self) -> str:
        return format_bdf(*self)

    @property
    def slot_address(self) -> str:
        """``domain:bus:device``: the functions of one card share it."""
        return f"{self.domain:04x}:{self.bus:02x}:{self.slot:02x}"


def format_bdf(domain: int, bus: int, slot: int, function: int) -> str:
    """Canonical BDF from its four numbers."""
    return f"{domain:04x}:{bus:02x}:{slot:02x}.{function:x}"


def parse_bdf(text: str, *, libvirt: bool = False) -> Bdf | None:
    """The address ``text`` spells (surrounding whitespace allowed), or None when it has not
    the shape of one; ``libvirt`` also accepts ``pci_0000_41_00_0``. The device number is not
    range-checked here (``canonical_bdf`` does), so callers can say what is wrong with it."""
    text = text.strip()
    match = _BDF.fullmatch(text) or (_LIBVIRT.fullmatch(text) if libvirt else None)
    if match is None:
        return None
    return Bdf(
        int(match["domain"] or "0", 16),
        int(match["bus"], 16),
        int(match["slot"], 16),
        int(match["function"], 16),
    )


def canonical_bdf(text: str) -> str:
    """Canonical BDF from any spelling ``parse_bdf`` reads; ValueError on anything else."""
    bdf = parse_bdf(text)
    if bdf is None or bdf.slot > MAX_DEVICE:
        raise ValueError(f"not a PCI address: {text!r}")
    return str(bdf)


def libvirt_address(text: str) -> dict[str, str]:
    """A PCI address as the attributes of libvirt's ``<address>``: ``0000:41:00.1`` ->
    domain ``0x0000``, bus ``0x41``, slot ``0x00``, function ``0x1``. ValueError if not one."""
    bdf = parse_bdf(canonical_bdf(text))
    assert bdf is not None  # canonical_bdf raised otherwise
    return {
        "domain": f"0x{bdf.domain:04x}",
        "bus": f"0x{bdf.bus:02x}",
        "slot": f"0x{bdf.slot:02x}",
        "function": f"0x{bdf.function:x}",
    }


def canonical_slot(text: str) -> str | None:
    """``0000:41:00`` from a ``domain:bus:device`` of any domain width or case; None if not one."""
    match = _SLOT.fullmatch(text.strip())
    if match is None:
        return None
    return f"{int(match['domain'], 16):04x}:{match['bus'].lower()}:{match['slot'].lower()}"


def slot_of(bdf: str) -> str:
    """The ``domain:bus:slot`` part of a canonical BDF: functions of one card share it."""
    return bdf.rsplit(".", 1)[0]
