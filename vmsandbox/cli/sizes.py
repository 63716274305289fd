"""Sizes typed by people: ``2048``, ``2G``, ``2GiB``, ``512M`` (binary units, as virsh reads)."""

from __future__ import annotations

import re

from vmsandbox.errors import InvalidArgument

_UNITS: dict[str, float] = {"k": 1 / 1024, "m": 1, "g": 1024, "t": 1024 * 1024}
_SIZE_RE = re.compile(r"^\s*([0-9]{1,12})\s*([kKmMgGtT]?)(?:i?[bB]|i)?\s*$")


def parse_size_mib(text: str, *, field: str, default_unit: str) -> int:
    """Parse a size into MiB. A bare number is in ``default_unit`` ("MiB" or "GiB")."""
    match = _SIZE_RE.match(text) if isinstance(text, str) and text.isascii() else None
    if not match:
        raise InvalidArgument(
            f"{field} {text!r} is not a size; use a whole number with an optional unit "
            "K, M, G or T (binary: 1G = 1024 MiB), e.g. 2048 or 2G",
            details={"field": field, "value": text},
        )
    number, unit = int(match.group(1)), match.group(2).lower()
    factor = _UNITS[unit] if unit else (1024 if default_unit == "GiB" else 1)
    mib = number * factor
    if mib < 1 or mib != int(mib):
        raise InvalidArgument(
            f"{field} {text!r} must be at least 1 MiB and a whole number of MiB",
            details={"field": field, "value": text},
        )
    return int(mib)
