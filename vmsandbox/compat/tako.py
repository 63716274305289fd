"""Tako: a job type's GPU settings, ``gpu: {enabled, vendor, count, device_ids}``.

Rules read in outerport/TakoVM at commit 3d240242: ``tako_vm/config.py``
(``JobTypeGPUConfig``), ``tako_vm/job_types.py`` (``JobType.from_dict``, the legacy top-level
fields), ``tako_vm/job_types.json`` (the shipped job types), with tests
``tests/test_config.py`` and ``tests/test_job_types.py``.

Tako's verdict, kept:

- ``enabled`` false or missing, and no other field set: no GPU. Tako writes every job type
  with ``"device_ids": []`` and an empty list means "not set", so its shipped default
  ``{"enabled": false, "vendor": null, "count": null, "device_ids": []}`` is no GPU, and
  ``device_ids: []`` next to a ``count`` or alone is ignored.
- A vendor, a count or device ids while not enabled are rejected.
- ``enabled: true`` needs ``vendor``: "nvidia" or "amd" after trimming and lower-casing.
- ``count`` (1..16) and ``device_ids`` (1..16 ids; none empty, none with a comma, none repeated
  case-insensitively after trimming) exclude each other. Unknown keys in ``gpu`` are rejected.
- ``enabled`` and ``vendor`` alone: every free GPU of that vendor.
- ``job_type_gpu_request`` reads a whole job type, where the legacy top-level fields
  ``gpu_enabled``, ``gpu_vendor``, ``gpu_count`` and ``gpu_device_ids`` stand for the keys of
  ``gpu``, as in ``JobType.from_dict``.

Rejected with INVALID_ARGUMENT where Tako silently does something wrong:

- ``enabled`` that is not true or false: ``JobType.from_dict`` reads the string "false" as
  true (``bool()``), while the config model reads it as false.
- A ``count`` that is not a JSON integer ("2", 2.0, true): ``from_dict`` keeps it unchecked.
- A legacy top-level field and the same key in ``gpu`` with different values: Tako takes the
  top-level one and drops the other.

Deliberately different: a ``count`` with vendor "amd" is accepted (a VM passes N AMD GPUs
through; Tako's container runtime cannot), and device ids must be ones vmsandbox can resolve
(PCI address, NVIDIA or ROCm UUID, DRM card name or inventory index), checked here rather
than at start time.
"""

from __future__ import annotations

from collections.abc import Mapping

from vmsandbox.compat._wire import (
    as_mapping,
    optional_bool,
    optional_mapping,
    reject_unknown_keys,
)
from vmsandbox.gpu.request import GpuRequest, invalid, normalise_device_ids, normalise_vendor, shown

MAX_GPUS = 16
_KEYS = ("enabled", "vendor", "count", "device_ids")


def gpu_request(gpu: Mapping[str, object] | None) -> GpuRequest | None:
    """The GpuRequest of a Tako job type's ``gpu`` object; None when it asks for no GPU."""
    block = optional_mapping(gpu, "gpu")
    if block is None:
        return None
    reject_unknown_keys(block, _KEYS, "gpu")
    return _request({key: (f"gpu.{key}", block.get(key)) for key in _KEYS})


def job_type_gpu_request(job_type: Mapping[str, object]) -> GpuRequest | None:
    """The GpuRequest of a whole Tako job type: ``gpu`` and the legacy ``gpu_*`` fields.

    Other keys of the job type (name, requirements, limits) are not about GPUs and are left
    to their own reader.
    """
    job = as_mapping(job_type, "job type")
    block = optional_mapping(job.get("gpu"), "gpu") or {}
    reject_unknown_keys(block, _KEYS, "gpu")
    fields: dict[str, tuple[str, object]] = {}
    for key in _KEYS:
        nested, legacy = block.get(key), job.get(f"gpu_{key}")
        if legacy is None:
            fields[key] = (f"gpu.{key}", nested)
            continue
        if nested is not None and not _unset(nested) and nested != legacy:
            raise invalid(
                f"gpu_{key}",
                legacy,
                f"gpu_{key} {shown(legacy)} and gpu.{key} {shown(nested)} disagree: Tako would "
                f"take gpu_{key} and drop gpu.{key}; give one of them",
            )
        fields[key] = (f"gpu_{key}", legacy)
    return _request(fields)


def _unset(value: object) -> bool:
    """An empty list: Tako writes ``device_ids: []`` for "not set"."""
    return isinstance(value, list | tuple) and not value


def _request(fields: Mapping[str, tuple[str, object]]) -> GpuRequest | None:
    """Tako's checks on the four settings, each given as (field name, value)."""
    enabled_field, raw_enabled = fields["enabled"]
    enabled = optional_bool(raw_enabled, enabled_field)
    vendor_field, raw_vendor = fields["vendor"]
    vendor = None if raw_vendor is None else normalise_vendor(raw_vendor, vendor_field)
    count_field, count = fields["count"]
    ids_field, device_ids = fields["device_ids"]
    if _unset(device_ids):
        device_ids = None
    if not enabled:
        for field, value in (fields["vendor"], (count_field, count), (ids_field, device_ids)):
            if value is not None:
                raise invalid(
                    field,
                    value,
                    f"{field} is set to {shown(value)} but {enabled_field} is not true: set "
                    f"{enabled_field} to true, or remove {field}",
                )
        return None

    if vendor is None:
        raise invalid(
            vendor_field,
            None,
            f"{vendor_field} is required when {enabled_field} is true: use nvidia or amd",
        )
    if count is not None and device_ids is not None:
        raise invalid(
            count_field,
            count,
            f"{count_field} and {ids_field} are mutually exclusive: give a number of GPUs or "
            "the devices, not both",
        )
    if count is not None:
        return GpuRequest(count=_count(count, count_field), vendor=vendor)
    if device_ids is not None:
        return GpuRequest(devices=_device_ids(device_ids, ids_field), vendor=vendor)
    return GpuRequest(all=True, vendor=vendor)


def _count(value: object, field: str) -> int:
    if type(value) is not int or not 1 <= value <= MAX_GPUS:
        raise invalid(
            field,
            value,
            f"{field} must be a whole number between 1 and {MAX_GPUS}, got {shown(value)}",
        )
    return value


def _device_ids(value: object, field: str) -> tuple[str, ...]:
    if not isinstance(value, list | tuple) or not 1 <= len(value) <= MAX_GPUS:
        raise invalid(
            field,
            value,
            f"{field} must be a list of up to {MAX_GPUS} device ids, got {shown(value)}",
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
