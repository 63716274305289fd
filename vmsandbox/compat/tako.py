"""Tako: a job type's ``gpu`` object, ``{enabled, vendor, count, device_ids}``.

Tako's rules, kept:

- ``enabled`` false or missing, and no other field: no GPU. Another field set (not null) while
  not enabled is rejected.
- ``enabled: true`` needs ``vendor``: "nvidia" or "amd" after trimming and lower-casing.
- ``count`` (1..16) and ``device_ids`` (1..16 ids; none empty, none with a comma, none repeated
  case-insensitively after trimming) exclude each other. Unknown keys are rejected.
- ``enabled`` and ``vendor`` alone: every free GPU of that vendor.

Beyond Tako: a ``count`` with vendor "amd" is accepted (a VM passes N AMD GPUs through; Tako's
container runtime could not), and device ids must be ones vmsandbox can resolve (PCI address,
NVIDIA UUID or inventory index), checked here rather than at start time.
"""

from __future__ import annotations

from collections.abc import Mapping

from vmsandbox.compat._wire import optional_bool, optional_mapping, reject_unknown_keys
from vmsandbox.gpuquery import invalid, normalise_device_ids, normalise_vendor, shown
from vmsandbox.spec import GpuRequest

MAX_GPUS = 16
_KNOWN = frozenset({"enabled", "vendor", "count", "device_ids"})


def gpu_request(gpu: Mapping[str, object] | None) -> GpuRequest | None:
    """The GpuRequest of a Tako job type's ``gpu`` object; None when it asks for no GPU."""
    block = optional_mapping(gpu, "gpu")
    if block is None:
        return None
    reject_unknown_keys(block, _KNOWN, "gpu")
    enabled = optional_bool(block.get("enabled"), "gpu.enabled")
    if not enabled:
        for key in ("vendor", "count", "device_ids"):
            if block.get(key) is not None:
                raise invalid(
                    f"gpu.{key}",
                    block[key],
                    f"gpu.{key} is set to {shown(block[key])} but gpu.enabled is not true: set "
                    f"gpu.enabled to true, or remove gpu.{key}",
                )
        return None

    if block.get("vendor") is None:
        raise invalid(
            "gpu.vendor", None, "gpu.vendor is required when gpu.enabled is true: use nvidia or amd"
        )
    vendor = normalise_vendor(block["vendor"], "gpu.vendor")
    count, device_ids = block.get("count"), block.get("device_ids")
    if count is not None and device_ids is not None:
        raise invalid(
            "gpu.count",
            count,
            "gpu.count and gpu.device_ids are mutually exclusive: give a number of GPUs or the "
            "devices, not both",
        )
    if count is not None:
        return GpuRequest(count=_count(count), vendor=vendor)
    if device_ids is not None:
        return GpuRequest(devices=_device_ids(device_ids), vendor=vendor)
    return GpuRequest(all=True, vendor=vendor)


def _count(value: object) -> int:
    if type(value) is not int or not 1 <= value <= MAX_GPUS:
        raise invalid(
            "gpu.count",
            value,
            f"gpu.count must be a whole number between 1 and {MAX_GPUS}, got {shown(value)}",
        )
    return value


def _device_ids(value: object) -> tuple[str, ...]:
    field = "gpu.device_ids"
    if not isinstance(value, list | tuple) or not 1 <= len(value) <= MAX_GPUS:
        raise invalid(
            field,
            value,
            f"{field} must be a list of 1 to {MAX_GPUS} device ids, got {shown(value)}",
        )
    seen: set[str] = set()
    for item in value:
        key = item.strip().casefold() if isinstance(item, str) else None
        if not key or "," in key:
            raise invalid(
                field,
                item,
                f"{field} entry {shown(item)} is not allowed: each id must be a non-empty string "
                "without commas",
            )
        if key in seen:
            raise invalid(field, item, f"{field} lists {shown(item)} more than once")
        seen.add(key)
    return normalise_device_ids(value, field)
