"""Sizes typed by people, one rule for every size flag of the command (``--memory``, ``--disk``,
``--gpu-memory``):

- a whole or decimal number, then an optional unit, in any case;
- ``K``, ``M``, ``G``, ``T``, alone or with ``i`` or ``iB`` (``G``, ``Gi``, ``GiB``), are binary,
  as virsh and libvirt read them: 1G = 1024 MiB;
- ``KB``, ``MB``, ``GB``, ``TB`` are decimal, as disk and GPU makers write them: 1GB = 10^9 bytes;
- a bare number is in the flag's own unit: MiB for ``--memory`` and ``--gpu-memory``, GiB for
  ``--disk``;
- the size is rounded up to a whole unit of what it sizes (MiB of memory, GiB of disk), so a
  sandbox never gets less than was asked for.

(The Python API's ``GpuRequest`` and the OpenShell driver read Kubernetes quantities instead,
where a bare ``G`` is decimal: those are the platforms' rules, kept for compatibility.)
"""

from __future__ import annotations

import re
from fractions import Fraction

from vmsandbox.errors import InvalidArgument

MIB = 2**20
GIB = 2**30
_POWERS = {"k": 1, "m": 2, "g": 3, "t": 4}
_SIZE_RE = re.compile(r"^\s*([0-9]{1,12})(?:\.([0-9]{1,6}))?\s*(?:([kmgt])(ib|i|b)?)?\s*\Z", re.I)
EXAMPLES = {"MiB": "2048 or 2G", "GiB": "20 or 20G"}
RULE = (
    "K, M, G, T alone or with i/iB are binary (1G = 1024 MiB), KB, MB, GB, TB decimal "
    "(1GB = 1000 MB)"
)


def parse_size_bytes(text: str, *, field: str, default_unit: str, example: str = "") -> int:
    """A size in bytes (whole); ``default_unit`` ("MiB" or "GiB") is a bare number's unit.
    INVALID_ARGUMENT naming the flag, the text, the rule and an example otherwise."""
    match = _SIZE_RE.match(text) if isinstance(text, str) and text.isascii() else None
    if not match:
        raise InvalidArgument(
            f"{field} {text!r} is not a size; use a number with an optional unit: {RULE}; "
            f"a bare number is {default_unit}; e.g. {example or EXAMPLES[default_unit]}",
            details={"field": field, "value": text},
        )
    whole, fraction, letter, suffix = match.groups()
    number = Fraction(f"{whole}.{fraction or 0}")
    if letter is None:
        size = number * (GIB if default_unit == "GiB" else MIB)
    else:
        base = 1000 if (suffix or "").lower() == "b" else 1024
        size = number * base ** _POWERS[letter.lower()]
    if size < 1:
        raise InvalidArgument(
            f"{field} {text!r} must be more than 0",
            details={"field": field, "value": text},
        )
    return -(-size.numerator // size.denominator)


def parse_size_mib(text: str, *, field: str, default_unit: str, example: str = "") -> int:
    """A size in whole MiB, rounded up (``parse_size_bytes``)."""
    return -(
        -parse_size_bytes(text, field=field, default_unit=default_unit, example=example) // MIB
    )


def parse_size_gib(text: str, *, field: str) -> int:
    """A size in whole GiB, rounded up; a bare number is GiB."""
    return -(-parse_size_bytes(text, field=field, default_unit="GiB") // GIB)
