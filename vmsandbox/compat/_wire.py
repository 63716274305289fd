"""Checks for JSON-shaped input shared by the platform adapters.

Values arrive as decoded JSON (dicts, lists, str, int, float, bool, None) or anything else a
caller hands over; each check accepts exactly one shape and raises ``InvalidArgument`` naming the
field, the value and what is allowed, so no other exception escapes an adapter. Where a platform
reads a value with a library's lenient parser (protobuf's JSON reader, pydantic), the helper here
reads it the same way, so a value the platform takes means the same number here.
"""

from __future__ import annotations

import math
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


# Unicode White_Space, what Rust's str::trim strips (Python's str.strip also strips U+001C-1F).
RUST_WHITESPACE = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008"
    "\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
)


def proto3_int(value: object, field: str, allowed: str) -> int:
    """An integer field as ``google.protobuf.json_format`` reads it (the range is the caller's).

    A JSON integer, a float with no fraction (2.0, 1e2), or a string: no space in it, read by
    Python's ``int()`` (so "+2", "02", "1_0" and other scripts' digits), else by ``float()``
    when that gives a whole number ("2.0", "1e2"). ``allowed`` ends the error message.
    """
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise invalid(field, value, f"{field} must be {allowed}, got {shown(value)}")
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if value.is_integer():
            return int(value)
        raise invalid(field, value, f"{field} must be {allowed}, got {shown(value)}")
    if " " not in value:
        try:
            return int(value)
        except ValueError:
            number = _float_or_none(value)
            if number is not None and number.is_integer():
                return int(number)
    raise invalid(field, value, f"{field} must be {allowed}, got {shown(value)}")


def _float_or_none(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


# pydantic-core's integer syntax in a string, after trimming White_Space: a sign, ASCII digits
# with single underscores between them, and a fraction of zeros only.
_PYDANTIC_INT_RE = re.compile(r"[+-]?[0-9]{1,4300}(?:_[0-9]+)*(?:\.0+)?", re.A)


def pydantic_int(value: object, field: str, allowed: str) -> int:
    """An ``int`` field as pydantic (lax mode) reads it (the range is the caller's).

    A JSON integer; ``true``/``false`` as 1/0; a finite float with no fraction; a string such
    as " 2 ", "+2", "1_0" or "2.0". ``allowed`` ends the error message.
    """
    if isinstance(value, bool | int):
        return int(value)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        match = _PYDANTIC_INT_RE.fullmatch(value.strip(RUST_WHITESPACE))
        if match:
            return int(match.group().partition(".")[0])
    raise invalid(field, value, f"{field} must be {allowed}, got {shown(value)}")
