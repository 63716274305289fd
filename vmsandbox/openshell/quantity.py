"""Kubernetes resource quantities (``"500m"``, ``"2"``, ``"4Gi"``, ``"1e9"``), as OpenShell's
DriverResourceRequirements carries them, turned into whole vCPUs and MiB.

Grammar (Kubernetes' ``resource.Quantity``): a signed decimal number, then either an exponent
(``e``/``E`` and an integer) or one suffix: binary ``Ki Mi Gi Ti Pi Ei``, decimal
``n u m k M G T P E`` or none. A VM gets whole vCPUs and whole MiB, so values round up.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation

from vmsandbox.errors import InvalidArgument

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
    "k": Decimal("1e3"),
    "M": Decimal("1e6"),
    "G": Decimal("1e9"),
    "T": Decimal("1e12"),
    "P": Decimal("1e15"),
    "E": Decimal("1e18"),
}
_QUANTITY_RE = re.compile(
    r"^(?P<number>[+-]?(?:\d+\.?\d*|\.\d+))(?:(?P<exp>[eE][+-]?\d+)|(?P<suffix>[KMGTPE]i|[numkMGTPE]?))\Z"
)
_ALLOWED = "a Kubernetes quantity such as '500m', '2', '4Gi' or '1e9'"


def parse(text: str, field: str) -> Decimal:
    """The value of a quantity, in base units (cores, bytes); must be above zero."""
    match = _QUANTITY_RE.match(text)
    if match is None or len(text) > 64:
        raise InvalidArgument(
            f"{field} {text!r} is not {_ALLOWED}", details={"field": field, "value": text}
        )
    try:
        number = Decimal(match["number"])
        if match["exp"]:
            value = number.scaleb(int(match["exp"][1:]))
        elif match["suffix"] in _BINARY:
            value = number * _BINARY[match["suffix"]]
        else:
            value = number * _DECIMAL[match["suffix"]]
    except (InvalidOperation, ValueError, OverflowError) as exc:
        raise InvalidArgument(
            f"{field} {text!r} is not {_ALLOWED}", details={"field": field, "value": text}
        ) from exc
    if value <= 0:
        raise InvalidArgument(
            f"{field} {text!r} must be above zero", details={"field": field, "value": text}
        )
    return value


def vcpus(request: str, limit: str, field: str, default: int) -> int:
    """The vCPUs for a CPU request and limit (empty: not given): the limit when given (a VM's
    vCPUs are its ceiling), else the request, rounded up to whole cores."""
    return _sized(request, limit, field, default, Decimal(1))


def memory_mib(request: str, limit: str, field: str, default: int) -> int:
    """The memory in MiB for a request and limit (empty: not given), as ``vcpus`` chooses."""
    return _sized(request, limit, field, default, Decimal(2**20))


def _sized(request: str, limit: str, field: str, default: int, unit: Decimal) -> int:
    wanted = parse(request, f"{field}_request") if request else None
    ceiling = parse(limit, f"{field}_limit") if limit else None
    if wanted is not None and ceiling is not None and ceiling < wanted:
        raise InvalidArgument(
            f"{field}_limit {limit!r} is below {field}_request {request!r}",
            details={"field": f"{field}_limit", "value": limit},
        )
    chosen = ceiling if ceiling is not None else wanted
    if chosen is None:
        return default
    units = chosen / unit
    if units > 2**40:  # far above any cap; keeps the integer small for the messages
        raise InvalidArgument(
            f"{field} {limit or request!r} is far beyond any host",
            details={"field": f"{field}_limit" if limit else f"{field}_request"},
        )
    return max(1, math.ceil(units))
