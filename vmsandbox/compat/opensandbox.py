"""OpenSandbox: the GPU entries of ``CreateSandboxRequest.resourceLimits`` (strings to strings).

Rules read in alibaba/OpenSandbox at commit 4db3a993:
``server/opensandbox_server/services/helpers.py`` (``parse_gpu_request``),
``server/opensandbox_server/services/k8s/provider_common.py``
(``_translate_resource_limits_for_k8s``) and ``services/docker/container_ops.py`` (the
Docker ``DeviceRequest``).

OpenSandbox's verdict, kept:

- ``gpu`` means NVIDIA GPUs: Kubernetes gets it as ``nvidia.com/gpu``, Docker as a device
  request for the NVIDIA runtime. ``"N"`` asks for N (whatever Python's ``int()`` reads after
  trimming, such as " 2" or "+2"); ``"all"`` in any case asks for every free GPU; ``""``
  means not set.
- ``nvidia.com/gpu`` and ``amd.com/gpu`` go to Kubernetes as extended resources, which take a
  whole number: ``"N"`` GPUs of that vendor (ASCII digits, surrounding spaces allowed).
  ``"all"`` is rejected there, as OpenSandbox rejects it for Kubernetes.
- Other keys (cpu, memory) are not about GPUs and are left alone. No ``resourceLimits`` at
  all (None) means no GPU.

Rejected with INVALID_ARGUMENT where OpenSandbox silently does something wrong:

- A ``gpu`` value it cannot read or that is not positive ("0", "-1", "1.5", "two"):
  ``parse_gpu_request`` logs a warning and the sandbox starts without a GPU.
- ``gpu`` with a different ``nvidia.com/gpu``: the Kubernetes translation overwrites the
  latter. ``gpu`` with ``amd.com/gpu``, or both vendor keys: one sandbox, two vendors.
- Keys that differ from a GPU key only in case or surrounding spaces (a likely typo that
  Kubernetes would take as an unknown resource). Values that are not strings.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from vmsandbox.compat._wire import as_mapping, count_from_text
from vmsandbox.gpu.request import GpuRequest, invalid, shown

_GENERIC = "gpu"
_GENERIC_VENDOR = "nvidia"  # OpenSandbox maps "gpu" to nvidia.com/gpu
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

    generic = _generic(limits.get(_GENERIC))
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
        if generic is None:
            return None
        if generic == "all":
            return GpuRequest(all=True, vendor=_GENERIC_VENDOR)
        return GpuRequest(count=generic, vendor=_GENERIC_VENDOR)

    key, vendor, count = vendors[0]
    if generic is not None and (vendor != _GENERIC_VENDOR or generic != count):
        why = (
            f"{_field(_GENERIC)} means NVIDIA GPUs"
            if vendor != _GENERIC_VENDOR
            else "OpenSandbox would overwrite one with the other"
        )
        raise invalid(
            _field(_GENERIC),
            limits[_GENERIC],
            f"{_field(_GENERIC)} {shown(limits[_GENERIC])} disagrees with {_field(key)} "
            f"{shown(limits[key])} ({why}): give only {_field(key)}",
        )
    return GpuRequest(count=count, vendor=vendor)


def _generic(value: object) -> int | str | None:
    """``gpu``'s value as ``parse_gpu_request`` reads it: a count, "all", or None (not set)."""
    field = _field(_GENERIC)
    if value is None or value == "":
        return None
    if isinstance(value, str):
        if _ALL_RE.fullmatch(value):
            return "all"
        try:
            count = int(value.strip())
        except ValueError:
            count = None
        if count is not None and count >= 1:
            return count
    raise invalid(
        field,
        value,
        f"{field} must be a whole number of GPUs greater than 0, such as '1' or '4', or "
        f"'all', got {shown(value)}: OpenSandbox would start the sandbox without a GPU",
    )


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
