"""PCI addresses in the one spelling the inventory uses: ``0000:bb:dd.f``, lowercase."""

from __future__ import annotations

import re

_BDF = re.compile(
    r"^(?:(?P<domain>[0-9a-fA-F]{1,8}):)?(?P<bus>[0-9a-fA-F]{1,2}):"
    r"(?P<slot>[0-9a-fA-F]{1,2})\.(?P<function>[0-7])$"
)


def format_bdf(domain: int, bus: int, slot: int, function: int) -> str:
    """Canonical BDF from its four numbers."""
    return f"{domain:04x}:{bus:02x}:{slot:02x}.{function:x}"


def canonical_bdf(text: str) -> str:
    """Canonical BDF from any common spelling.

    Accepts ``41:00.0``, ``0000:41:00.0`` and NVML's ``00000000:41:00.0``, in either case.
    Raises ValueError on anything else.
    """
    match = _BDF.match(text.strip())
    if match is None:
        raise ValueError(f"not a PCI address: {text!r}")
    return format_bdf(
        int(match["domain"] or "0", 16),
        int(match["bus"], 16),
        int(match["slot"], 16),
        int(match["function"], 16),
    )


def slot_of(bdf: str) -> str:
    """The ``domain:bus:slot`` part of a canonical BDF: functions of one card share it."""
    return bdf.rsplit(".", 1)[0]
