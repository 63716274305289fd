"""OpenSandbox: the GPU entries of ``CreateSandboxRequest.resourceLimits`` (strings to strings).

- ``gpu``: ``"N"`` asks for N GPUs (ASCII digits, surrounding spaces allowed, N >= 1);
  ``"all"`` in any case asks for every free GPU.
- ``nvidia.com/gpu``, ``amd.com/gpu``: ``"N"`` GPUs of that vendor. ``"all"`` is rejected there,
  as Kubernetes rejects a non-integer extended resource.
- ``gpu`` together with a vendor key must ask for the same N; both vendor keys together are
  rejected (one request has one vendor).
- Rejected, where upstream parsing would accept or drop them: "0", "-1", "1.5", "+2", "1_0",
  "", non-ASCII digits, values that are not strings, and keys that differ from a GPU key only
  in case or surrounding spaces (a likely typo). Other keys (cpu, memory) are ignored.
- No ``resourceLimits`` at all (None) means no GPU.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from vmsandbox.compat._wire import as_mapping, count_from_text
from vmsandbox.gpuquery import invalid, shown
from vmsandbox.spec import GpuRequest

_GENERIC = "gpu"
_VENDOR_KEYS = {"nvidia.com/gpu": "nvidia", "amd.com/gpu": "amd"}
_GPU_KEYS = (_GENERIC, *_VENDOR_KEYS)
_ALL_RE = re.compile(r"\s*all\s*", re.I | re.A)


def _field(key: str) -> str:
    return f'resourceLimits["{key}"]'


def gpu_request(resource_limits: Mapping[str, str] | None) -> GpuRequest | None:
    """The GpuRequest of an OpenSandbox ``resourceLimits`` map; None when it asks for no GPU."""
    if resource_limits is None:
        return None
    limits = as_mapping(resource_limits, "resourceLimits")
    for key in limits:
        if isinstance(key, str) and key not in _GPU_KEYS and key.strip().lower() in _GPU_KEYS:
            raise invalid(
                _field(key),
                key,
                f"{_field(key)} is not a GPU resource name: did you mean "
                f"{shown(key.strip().lower())}? Resource names are case-sensitive",
            )

    generic = None
    every_gpu = False
    if _GENERIC in limits:
        value = limits[_GENERIC]
        every_gpu = isinstance(value, str) and _ALL_RE.fullmatch(value) is not None
        generic = None if every_gpu else count_from_text(value, _field(_GENERIC))
    vendors = [(key, vendor, _vendor_count(limits, key)) for key, vendor in _VENDOR_KEYS.items()]
    vendors = [(key, vendor, count) for key, vendor, count in vendors if count is not None]
    if len(vendors) > 1:
        (first, _, _), (second, _, _) = vendors
        raise invalid(
            _field(second),
            limits[second],
            f"{_field(second)} {shown(limits[second])} comes with {_field(first)} "
            f"{shown(limits[first])}: a sandbox takes GPUs of one vendor, give one of them",
        )
    if not vendors:
        if every_gpu:
            return GpuRequest(all=True)
        return None if generic is None else GpuRequest(count=generic)

    key, vendor, count = vendors[0]
    if every_gpu or (generic is not None and generic != count):
        raise invalid(
            _field(_GENERIC),
            limits[_GENERIC],
            f"{_field(_GENERIC)} {shown(limits[_GENERIC])} disagrees with {_field(key)} "
            f"{shown(limits[key])}: give the same number in both, or only {_field(key)}",
        )
    return GpuRequest(count=count, vendor=vendor)


def _vendor_count(limits: Mapping[object, object], key: str) -> int | None:
    """The count under a vendor key, None when the key is absent; "all" is not a count."""
    if key not in limits:
        return None
    value = limits[key]
    if isinstance(value, str) and _ALL_RE.fullmatch(value):
        raise invalid(
            _field(key),
            value,
            f"{_field(key)} {shown(value)} is not allowed: an extended resource takes a whole "
            f'number of GPUs, as in Kubernetes; use {_field(_GENERIC)} = "all" for every free GPU',
        )
    return count_from_text(value, _field(key))
