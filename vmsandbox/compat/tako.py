"""Tako: a job type's GPU settings, ``gpu: {enabled, vendor, count, device_ids}``.

Tako reads a job type with two readers, and the released ``tako-vm`` 0.3.0 (which
tests/unit/compat/test_compat_platforms.py runs) has both: ``tako_vm/config.py``
``JobTypeGPUConfig`` (a pydantic model, for the config file) and ``tako_vm/job_types.py``
``JobType.from_dict`` (the registry JSON, which reads each field with ``bool()``, ``list()`` or as
it comes, then checks the result with the same model). A setting is taken here as both read it:
where they agree it means what it means to Tako; where they disagree, or either refuses it, it is
refused.

Tako's verdict, kept:

- No ``gpu`` block, or ``enabled`` false or missing with no other field set: no GPU. An empty
  ``device_ids`` means "not set", so the shipped default
  ``{"enabled": false, "vendor": null, "count": null, "device_ids": []}`` is no GPU.
- ``enabled``: true or false, also ``1``/``0`` and the strings both readers take as true
  ("true", "yes", "on", "y", "t", "1", any case). ``null``, and "false", "no", "off" and the
  like (``from_dict`` reads any non-empty string as true, the model reads them as false), are
  refused.
- A vendor, a count or device ids while not enabled are refused; ``enabled: true`` needs
  ``vendor``, "nvidia" or "amd" after trimming and lower-casing.
- ``count``: 1 to 16, read as pydantic reads an integer (``2``, ``2.0``, ``"2"``, ``" 2 "``,
  ``true`` as 1).
- ``device_ids``: a list of 1 to 16 strings, none empty after trimming, none with a comma, none
  repeated case-insensitively; ``null`` or a string is refused. ``count`` and ``device_ids``
  exclude each other. Unknown keys in ``gpu`` are refused.
- ``enabled`` and ``vendor`` alone: every free GPU of that vendor.
- ``job_type_gpu_request`` reads a whole job type, where the legacy top-level fields
  ``gpu_enabled``, ``gpu_vendor``, ``gpu_count`` and ``gpu_device_ids`` stand for the keys of
  ``gpu``, as in ``JobType.from_dict`` (a falsy ``gpu`` value is no block there).

Deliberately different:

- A ``count`` with vendor "amd" is accepted: a VM passes N AMD GPUs through, where Tako's
  container runtime cannot.
- Device ids must be ones vmsandbox can resolve (PCI address, NVIDIA or ROCm UUID, DRM card
  name or inventory index), checked here rather than at start time; two spellings of one GPU
  are a repeat.
- A legacy top-level field and the same key in ``gpu`` with different values are refused:
  ``from_dict`` takes the top-level one and drops the other.
"""

from __future__ import annotations

from collections.abc import Mapping

from vmsandbox.compat._wire import as_mapping, pydantic_int, reject_unknown_keys
from vmsandbox.gpu.request import GpuRequest, invalid, normalise_device_ids, normalise_vendor, shown

MAX_GPUS = 16
_KEYS = ("enabled", "vendor", "count", "device_ids")
# Strings both readers take as true: pydantic's words for true, all non-empty, so bool() agrees.
_TRUE_WORDS = frozenset({"1", "on", "t", "true", "y", "yes"})
_ABSENT = object()


def gpu_request(gpu: Mapping[str, object] | None) -> GpuRequest | None:
    """The GpuRequest of a Tako job type's ``gpu`` object; None when it asks for no GPU."""
    if gpu is None:
        return None
    block = as_mapping(gpu, "gpu")
    reject_unknown_keys(block, _KEYS, "gpu")
    return _request({key: (f"gpu.{key}", block.get(key, _ABSENT)) for key in _KEYS})


def job_type_gpu_request(job_type: Mapping[str, object]) -> GpuRequest | None:
    """The GpuRequest of a whole Tako job type: ``gpu`` and the legacy ``gpu_*`` fields.

    Other keys of the job type (name, requirements, limits) are not about GPUs and are left
    to their own reader.
    """
    job = as_mapping(job_type, "job type")
    block = as_mapping(job.get("gpu") or {}, "gpu")
    reject_unknown_keys(block, _KEYS, "gpu")
    fields: dict[str, tuple[str, object]] = {}
    for key in _KEYS:
        nested, legacy = block.get(key, _ABSENT), job.get(f"gpu_{key}", _ABSENT)
        if legacy is _ABSENT:
            fields[key] = (f"gpu.{key}", nested)
            continue
        if key == "enabled" and legacy is None:
            legacy = False  # only from_dict reads the legacy fields: bool(None)
        if nested not in (_ABSENT, None) and not _unset(nested) and nested != legacy:
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
    """Tako's checks on the four settings, each given as (field name, value or _ABSENT)."""
    enabled_field, raw_enabled = fields["enabled"]
    enabled = _enabled(raw_enabled, enabled_field)
    vendor_field, raw_vendor = fields["vendor"]
    vendor = None
    if raw_vendor is not _ABSENT and raw_vendor is not None:
        vendor = normalise_vendor(raw_vendor, vendor_field)
    count_field, raw_count = fields["count"]
    count = None
    if raw_count is not _ABSENT and raw_count is not None:
        count = _count(raw_count, count_field)
    ids_field, raw_ids = fields["device_ids"]
    device_ids = None if raw_ids is _ABSENT else _device_ids(raw_ids, ids_field)
    if not enabled:
        given = ((vendor_field, vendor), (count_field, count), (ids_field, device_ids))
        for field, value in given:
            if value is not None:
                raw = dict(fields.values())[field]
                raise invalid(
                    field,
                    raw,
                    f"{field} is set to {shown(raw)} but {enabled_field} is not true: set "
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
            raw_count,
            f"{count_field} and {ids_field} are mutually exclusive: give a number of GPUs or "
            "the devices, not both",
        )
    if count is not None:
        return GpuRequest(count=count, vendor=vendor)
    if device_ids is not None:
        return GpuRequest(devices=device_ids, vendor=vendor)
    return GpuRequest(all=True, vendor=vendor)


def _enabled(value: object, field: str) -> bool:
    """``enabled`` where both readers read it the same: pydantic's bool and Python's bool()."""
    if value is _ABSENT:
        return False
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _TRUE_WORDS:
        return True
    raise invalid(
        field,
        value,
        f"{field} must be true or false, got {shown(value)}: Tako's two readers of a job type "
        "read it differently, or refuse it",
    )


def _count(value: object, field: str) -> int:
    allowed = f"a whole number between 1 and {MAX_GPUS}"
    count = pydantic_int(value, field, allowed)
    if not 1 <= count <= MAX_GPUS:
        raise invalid(field, value, f"{field} must be {allowed}, got {shown(value)}")
    return count


def _device_ids(value: object, field: str) -> tuple[str, ...] | None:
    """The ids, canonical; None for an empty list (not set)."""
    if not isinstance(value, list | tuple) or len(value) > MAX_GPUS:
        raise invalid(
            field,
            value,
            f"{field} must be a list of up to {MAX_GPUS} device ids, got {shown(value)}",
        )
    if not value:
        return None
    seen: set[str] = set()
    for item in value:
        key = item.strip().lower() if isinstance(item, str) else None
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
