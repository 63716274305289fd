"""OpenShell: the GPU part of a sandbox spec (``SandboxSpec``), in its proto3 JSON form.

Rules read in NVIDIA/OpenShell main at commit 2f7fb655: ``proto/openshell.proto``
(``ResourceRequirements``, ``GpuResourceRequirements``, ``SandboxTemplate.driver_config``),
``crates/openshell-core/src/gpu.rs`` (``effective_driver_gpu_count``,
``validate_specific_gpu_device_request`` and its tests), ``crates/openshell-core/src/
proto_struct.rs`` (``deserialize_optional_non_empty_string_list``),
``crates/openshell-server/src/compute/mod.rs`` (``select_driver_config``) and the VM driver's
validation in ``crates/openshell-driver-vm/src/driver.rs`` (``VmSandboxDriverConfig``,
``vm_gpu_device_id`` and its ``validate_vm_sandbox_*`` tests).

OpenShell's verdict, kept:

- ``resource_requirements.gpu``: an object whose presence, even ``{}``, asks for GPUs. Its
  only field is ``count`` (``optional uint32``): omitted means one GPU; 0 is rejected. Proto3
  JSON takes a number or a decimal string.
- Device ids come from the driver-keyed ``template.driver_config``: the gateway passes the
  ``vm`` block to the VM driver, which allows only ``gpu_device_ids``, a non-empty list of
  non-blank strings without repeats. Ids need a GPU request, and the count, 1 when omitted,
  must equal the number of ids: two ids without a count are rejected ("gpu count (1) must
  match ... length (2)").
- ``resource_requirements.gpu.device_ids`` is reserved in main's proto (device selection moved
  to ``driver_config`` in 1dc59853, 2026-06-11), so it is rejected, pointing at the new place;
  so is a ``driver_config`` at the top of the spec, where main has none.
- Legacy, from the spec before 1dc59853: ``gpu: true`` asks for one GPU, ``gpu_device: "ID"``
  (which requires ``gpu: true``, as OpenShell's CLI did) names it. JSON ``null``, ``gpu: false``
  and ``gpu_device: ""`` mean "not given", as proto3 defaults do.

Also decided here: with both ``resource_requirements.gpu`` and ``gpu: true`` the count comes
from ``resource_requirements.gpu``; ``gpu_device`` and ``gpu_device_ids`` given together must
name the same GPUs (compared by canonical id); the first list's order is kept. Other keys of
the spec, of ``resource_requirements`` and of ``template.driver_config`` (other drivers'
blocks) are not about GPUs here and are left to their own readers.

Deliberately different: more than one GPU per sandbox (OpenShell's VM driver passes one), and
device ids must be ones vmsandbox can resolve (PCI address, NVIDIA or ROCm UUID, DRM card name
or inventory index).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from vmsandbox.compat._wire import (
    as_mapping,
    optional_bool,
    optional_mapping,
    optional_str,
    reject_unknown_keys,
)
from vmsandbox.gpu.request import (
    GpuRequest,
    invalid,
    normalise_device_id,
    normalise_device_ids,
    shown,
)

_GPU = "resource_requirements.gpu"
_VM = "template.driver_config.vm"
_IDS = f"{_VM}.gpu_device_ids"
_UINT32_MAX = 2**32 - 1
_DECIMAL_RE = re.compile(r"[0-9]{1,10}", re.A)


def gpu_request(spec: Mapping[str, object]) -> GpuRequest | None:
    """The GpuRequest of an OpenShell sandbox spec; None when it asks for no GPU."""
    spec = as_mapping(spec, "spec")
    if spec.get("driver_config") is not None:
        raise invalid(
            "driver_config",
            spec["driver_config"],
            f"driver_config is not a field of the sandbox spec: put it in template, as "
            f"{_VM}.gpu_device_ids for GPU devices",
        )
    legacy = optional_bool(spec.get("gpu"), "gpu")
    legacy_device = optional_str(spec.get("gpu_device"), "gpu_device")
    if legacy_device and not legacy:
        raise invalid(
            "gpu_device",
            legacy_device,
            f"gpu_device {shown(legacy_device)} requires gpu=true: set gpu: true or drop "
            "gpu_device",
        )
    requirements = optional_mapping(spec.get("resource_requirements"), "resource_requirements")
    gpu = None if requirements is None else optional_mapping(requirements.get("gpu"), _GPU)
    count = None
    if gpu is not None:
        if gpu.get("device_ids") is not None:
            raise invalid(
                f"{_GPU}.device_ids",
                gpu["device_ids"],
                f"{_GPU}.device_ids is reserved in OpenShell's spec: name the devices in "
                f"{_IDS} and give their number in {_GPU}.count",
            )
        reject_unknown_keys(gpu, ("count",), _GPU)
        count = _count(gpu.get("count"))

    sources: list[tuple[str, tuple[str, ...]]] = []
    ids = _vm_device_ids(spec)
    if ids is not None:
        sources.append((_IDS, ids))
    if legacy_device:
        sources.append(("gpu_device", (normalise_device_id(legacy_device, "gpu_device"),)))
    if gpu is None and not legacy:
        if sources:
            field, devices = sources[0]
            raise invalid(
                field,
                list(devices),
                f"{field} requires a gpu request: add {_GPU} (with count {len(devices)})",
            )
        return None
    devices = _same_devices(sources)
    if devices and (count or 1) != len(devices):
        raise invalid(
            f"{_GPU}.count",
            count,
            f"gpu count ({count or 1}{'' if count else ', as it is omitted'}) must match "
            f"{sources[0][0]} length ({len(devices)}): set {_GPU}.count to {len(devices)}",
        )
    return GpuRequest(count=count, devices=devices)


def _count(value: object) -> int | None:
    """``count``: a JSON number or a decimal string (proto3 JSON), 1 to 2^32-1, or None."""
    field = f"{_GPU}.count"
    if value is None:
        return None
    if isinstance(value, str) and _DECIMAL_RE.fullmatch(value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value > _UINT32_MAX:
        raise invalid(
            field,
            value,
            f"{field} must be a whole number of GPUs (a uint32, as a JSON number or a decimal "
            f"string), got {shown(value)}",
        )
    if value < 1:
        raise invalid(field, value, f"{field}: gpu count must be greater than 0, got {value}")
    return value


def _vm_device_ids(spec: Mapping[object, object]) -> tuple[str, ...] | None:
    """``template.driver_config.vm.gpu_device_ids``, canonical; None when not given."""
    template = optional_mapping(spec.get("template"), "template")
    config = None
    if template is not None:
        config = optional_mapping(template.get("driver_config"), "template.driver_config")
    vm = None if config is None else config.get("vm")
    if vm is None:
        return None
    if not isinstance(vm, Mapping):
        raise invalid(_VM, vm, f"{_VM} must be an object, got {shown(vm)}")
    reject_unknown_keys(vm, ("gpu_device_ids",), _VM)
    ids = vm.get("gpu_device_ids")
    if ids is None:
        return None
    if not isinstance(ids, list | tuple) or not ids:
        raise invalid(_IDS, ids, f"{_IDS} must be a non-empty list of device ids, got {shown(ids)}")
    for item in ids:
        if ids.count(item) > 1:
            raise invalid(_IDS, item, f"{_IDS} contains duplicate device ID {shown(item)}")
    return normalise_device_ids(ids, _IDS)


def _same_devices(sources: list[tuple[str, tuple[str, ...]]]) -> tuple[str, ...]:
    """The devices every given list names; lists that disagree are rejected."""
    if not sources:
        return ()
    first_field, first = sources[0]
    for field, devices in sources[1:]:
        if set(devices) != set(first):
            raise invalid(
                field,
                list(devices),
                f"{field} {list(devices)} and {first_field} {list(first)} name different GPUs: "
                "give the same devices in both, or only one of them",
            )
    return first
