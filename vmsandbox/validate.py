"""Checks of the plain values that callers hand to every layer: sandbox names, image names and
whole positive numbers (counts and sizes).

Each rule lives here once, below everything that takes such a value (the spec, the image store,
the guest's control channel, the ``[pool]`` table of the configuration), and each failure is an
``InvalidArgument`` naming the field, the value and what is allowed.
"""

from __future__ import annotations

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
