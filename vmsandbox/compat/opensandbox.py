"""OpenSandbox: the GPU entries of ``CreateSandboxRequest.resourceLimits`` (strings to strings).

Rules of the released ``opensandbox-server`` 1.1.1, which tests/unit/compat/test_compat_platforms.py
runs:
``api/schema.py`` (``CreateSandboxRequest``, ``ResourceLimits``: ``Dict[str, str]``),
``services/helpers.py`` (``parse_gpu_request``), the Docker runtime's
``services/docker/container_ops.py`` (``_resolve_resource_limits``, the ``DeviceRequest``) and
the Kubernetes runtime's ``services/k8s/provider_common.py``
(``_translate_resource_limits_for_k8s``).

OpenSandbox's verdict, kept:

- ``resourceLimits`` maps strings to strings: any other value, JSON ``null`` included, is the
  request model's 422, refused here too. No ``resourceLimits`` at all (None, as for a pooled
  sandbox) means no GPU.
- ``gpu`` means NVIDIA GPUs: Docker gets a device request for the NVIDIA runtime, Kubernetes
  ``nvidia.com/gpu``. It is read as Docker reads it: ``"N"`` asks for N (whatever Python's
  ``int()`` reads after trimming, such as " 2" or "+2"), ``"all"`` in any case asks for every
  free GPU, and anything else, ``""``, ``"0"``, ``"-1"``, ``"1.5"`` or ``"two"``, is the 400.
- ``nvidia.com/gpu`` and ``amd.com/gpu`` go to Kubernetes unchanged, as extended resources.
- Other keys (cpu, memory) are not about GPUs and are left alone.

Deliberately different:

- ``gpu: "all"``: Kubernetes refuses it (400); vmsandbox takes every free GPU, as Docker does.
  A ``gpu`` value Docker refuses is refused, where Kubernetes drops it and starts the sandbox
  without a GPU.
- ``nvidia.com/gpu`` and ``amd.com/gpu`` ask for GPUs of that vendor, as on Kubernetes, where
  Docker ignores them. Their value must be a whole number (ASCII digits, surrounding spaces
  allowed), as Kubernetes requires of an extended resource; OpenSandbox passes any string on.
- ``gpu`` with a different ``nvidia.com/gpu`` (Kubernetes overwrites the latter, Docker ignores
  it), ``gpu`` with ``amd.com/gpu``, or both vendor keys: refused, one sandbox, one answer.
- Keys that differ from a GPU key only in case or surrounding spaces (a likely typo that
  Docker ignores and Kubernetes takes as an unknown resource) are refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, cast

from vmsandbox.compat._wire import as_mapping, count_from_text
from vmsandbox.gpu.request import GpuRequest, invalid, shown

_GENERIC = "gpu"
_GENERIC_VENDOR = "nvidia"  # OpenSandbox maps "gpu" to nvidia.com/gpu
_VENDOR_KEYS = {"nvidia.com/gpu": "nvidia", "amd.com/gpu": "amd"}
_GPU_KEYS = (_GENERIC, *_VENDOR_KEYS)


def _field(key: str) -> str:
    return f'resourceLimits["{key}"]'


def gpu_request(resource_limits: Mapping[str, str] | None) -> GpuRequest | None:
    """The GpuRequest of an OpenSandbox ``resourceLimits`` map; None when it asks for no GPU."""
    if resource_limits is None:
        return None
    limits = as_mapping(resource_limits, "resourceLimits")
    for key, value in limits.items():
        if not isinstance(key, str) or not isinstance(value, str):
            field = _field(key) if isinstance(key, str) else "resourceLimits"
            raise invalid(
                field,
                value,
                f"{field} must be a string, got {shown(value)}: resourceLimits maps resource "
                "names to strings (OpenSandbox answers 422)",
            )
        if key not in _GPU_KEYS and key.strip().lower() in _GPU_KEYS:
            raise invalid(
                _field(key),
                key,
                f"{_field(key)} is not a GPU resource name: did you mean "
                f"{shown(key.strip().lower())}? Resource names are case-sensitive",
            )

    generic = _generic(cast("str | None", limits.get(_GENERIC)))  # every value is a str: above
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
            else "OpenSandbox's Docker runtime reads only gpu, Kubernetes writes it over the other"
        )
        raise invalid(
            _field(_GENERIC),
            limits[_GENERIC],
            f"{_field(_GENERIC)} {shown(limits[_GENERIC])} disagrees with {_field(key)} "
            f"{shown(limits[key])} ({why}): give only {_field(key)}",
        )
    return GpuRequest(count=count, vendor=vendor)


def _generic(value: str | None) -> int | Literal["all"] | None:
    """``gpu``'s value as Docker's ``_resolve_resource_limits`` reads it: a count, "all", or
    None when the key is absent."""
    field = _field(_GENERIC)
    if value is None:
        return None
    text = value.strip().lower()
    if text == "all":
        return "all"
    try:
        count = int(text)
    except ValueError:
        count = None
    if count is not None and count >= 1:
        return count
    raise invalid(
        field,
        value,
        f"{field} must be a whole number of GPUs greater than 0, such as '1' or '4', or "
        f"'all', got {shown(value)} (OpenSandbox answers 400)",
    )


def _vendor_count(limits: Mapping[object, object], key: str) -> int | None:
    """The count under a vendor key, None when the key is absent; "all" is not a count."""
    if key not in limits:
        return None
    value = limits[key]
    if isinstance(value, str) and value.strip().lower() == "all":
        raise invalid(
            _field(key),
            value,
            f"{_field(key)} {shown(value)} is not allowed: an extended resource takes a whole "
            f'number of GPUs, as in Kubernetes; use {_field(_GENERIC)} = "all" for every free GPU',
        )
    return count_from_text(value, _field(key))
