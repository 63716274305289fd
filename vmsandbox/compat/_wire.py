"""Checks for JSON-shaped input shared by the platform adapters.

Values arrive as decoded JSON (dicts, lists, str, int, float, bool, None) or anything else a
caller hands over; each check accepts exactly one shape and raises ``InvalidArgument`` naming the
field, the value and what is allowed, so no other exception escapes an adapter. JSON ``null``
reads as "not given" throughout, as proto3 JSON does.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping

from vmsandbox.gpu.request import invalid, shown


def as_mapping(value: object, field: str) -> Mapping[object, object]:
    """A JSON object."""
    if not isinstance(value, Mapping):
        raise invalid(field, value, f"{field} must be an object, got {shown(value)}")
    return value


def optional_mapping(value: object, field: str) -> Mapping[object, object] | None:
    """A JSON object, or None when absent or null."""
    return None if value is None else as_mapping(value, field)


def reject_unknown_keys(
    mapping: Mapping[object, object], known: Collection[str], field: str
) -> None:
    """Keys outside ``known`` are mistakes the platform would drop silently: name them."""
    unknown = sorted((key for key in mapping if key not in known), key=shown)
    if unknown:
        raise invalid(
            field,
            unknown[0],
            f"{field} has unknown key(s) {', '.join(map(shown, unknown))}: allowed are "
            f"{', '.join(sorted(known))}",
        )


def optional_bool(value: object, field: str) -> bool | None:
    """``true`` or ``false``, or None when absent or null; no 0/1 or strings."""
    if value is None or isinstance(value, bool):
        return value
    raise invalid(field, value, f"{field} must be true or false, got {shown(value)}")


def optional_str(value: object, field: str) -> str | None:
    """A string, or None when absent or null."""
    if value is None or isinstance(value, str):
        return value
    raise invalid(field, value, f"{field} must be a string, got {shown(value)}")


_COUNT_TEXT_RE = re.compile(r"\s*([0-9]{1,9})\s*", re.A)


def count_from_text(value: object, field: str) -> int:
    """A number of GPUs written as a string: ASCII digits, surrounding spaces allowed, >= 1.

    Stricter than ``int()``, which also takes "+2", "1_0" and non-ASCII digits.
    """
    match = _COUNT_TEXT_RE.fullmatch(value) if isinstance(value, str) else None
    if not match or int(match.group(1)) < 1:
        raise invalid(
            field,
            value,
            f"{field} must be a whole number of GPUs greater than 0 written in digits, such as "
            f"'1' or '4', got {shown(value)}",
        )
    return int(match.group(1))
