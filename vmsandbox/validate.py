"""Checks of the plain values that callers hand to every layer: sandbox names, image names and
whole positive numbers (counts and sizes).

Each rule lives here once, below everything that takes such a value (the spec, the image store,
the guest's control channel, the ``[pool]`` table of the configuration), and each failure is an
``InvalidArgument`` naming the field, the value and what is allowed.
"""

from __future__ import annotations

import math
import re

from vmsandbox.errors import InvalidArgument

NAME_MAX = 48
_NAME_RE = re.compile(r"^[a-z0-9](?:[a-z0-9-]*[a-z0-9])?\Z")  # \Z: "$" also matches before "\n"
IMAGE_NAME_MAX = 64
_IMAGE_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*\Z")


def validate_name(name: object, what: str = "name") -> str:
    """A sandbox name: lowercase letters, digits and inner dashes, at most NAME_MAX chars."""
    if not isinstance(name, str) or not name or len(name) > NAME_MAX or not _NAME_RE.match(name):
        raise InvalidArgument(
            f"{what} {name!r} is not valid: use 1-{NAME_MAX} lowercase letters, digits and dashes, "
            "starting and ending with a letter or digit",
            details={"field": what, "value": repr(name)},
        )
    return name


def validate_image_name(name: object) -> str:
    """An image name: lowercase letters, digits, '.', '_' and '-', not starting with a dot."""
    if (
        not isinstance(name, str)
        or not name
        or len(name) > IMAGE_NAME_MAX
        or not _IMAGE_NAME_RE.match(name)
    ):
        raise InvalidArgument(
            f"image {name!r} is not valid: use 1-{IMAGE_NAME_MAX} lowercase letters, digits, "
            "'.', '_' and '-', starting with a letter or digit",
            details={"field": "image", "value": repr(name)},
        )
    return name


def positive_int(value: object, what: str) -> int:
    """A whole number of at least 1 (a bool is not one)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgument(
            f"{what} must be a positive integer, got {value!r}",
            details={"field": what, "value": repr(value)},
        )
    return value


# Durations: a whole number of seconds ("90"), or numbers with units ("30m", "2h", "1d",
# "1h30m", "1.5h"). A lifetime longer than DURATION_MAX_S is refused rather than stored: no
# sandbox is meant to outlive a year, and the bound keeps every expiry a valid timestamp.
DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
DURATION_MAX_S = 366 * 86400
_DURATION_RE = re.compile(r"(?:(\d+(?:\.\d+)?)([smhd]))+?\Z")
_DURATION_PART_RE = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
DURATION_ALLOWED = "a duration above 0 such as 90 (seconds), 30m, 2h, 1d or 1h30m, at most 366d"


def parse_duration(text: object, what: str = "ttl") -> int:
    """Whole seconds (rounded up) of a duration: a plain number of seconds or numbers with
    units s, m, h, d, one after another. INVALID_ARGUMENT naming ``what``, the value and what
    is allowed for anything else, and for zero, negative and overlong durations."""
    seconds: float | None = None
    if isinstance(text, str):
        spelled = text.strip().lower()
        if spelled.isascii() and re.fullmatch(r"\d+(?:\.\d+)?", spelled):
            seconds = float(spelled)
        elif spelled.isascii() and _DURATION_RE.match(spelled):
            seconds = sum(
                float(number) * DURATION_UNITS[unit]
                for number, unit in _DURATION_PART_RE.findall(spelled)
            )
    return check_duration(seconds, what, shown=text)


def check_duration(seconds: object, what: str = "ttl", *, shown: object = None) -> int:
    """Whole seconds (rounded up) of a number of seconds above 0 and at most DURATION_MAX_S;
    INVALID_ARGUMENT naming ``what``, the value (``shown``, or ``seconds``) and what is allowed."""
    value = seconds if shown is None else shown
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, int | float)
        or not 0 < seconds <= DURATION_MAX_S  # NaN fails this too
    ):
        raise InvalidArgument(
            f"{what} {value!r} is not valid: use {DURATION_ALLOWED}",
            details={"field": what, "value": repr(value), "allowed": DURATION_ALLOWED},
        )
    return math.ceil(seconds)


def format_duration(seconds: float) -> str:
    """``seconds`` for people, to the minute beyond an hour: 45s, 12m30s, 2h05m, 3d04h."""
    left = max(0, math.ceil(seconds))
    days, rest = divmod(left, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"
