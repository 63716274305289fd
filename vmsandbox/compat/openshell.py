"""OpenShell: the GPU part of a sandbox spec (``SandboxSpec``), in its proto3 JSON form.

The spec is read as OpenShell's Python package (``openshell`` 0.1.5) reads it:
``google.protobuf.json_format`` into its generated ``SandboxSpec``, whose ``ResourceRequirements``,
``GpuResourceRequirements`` and ``SandboxTemplate`` are those of NVIDIA/OpenShell main at commit
2f7fb655 (``proto/openshell.proto``). The rules after parsing are OpenShell's Rust code at that
commit: ``crates/openshell-server/src/grpc/validation.rs`` (``validate_gpu_request_fields``),
``crates/openshell-server/src/compute/mod.rs`` (``select_driver_config``),
``crates/openshell-core/src/gpu.rs`` (``validate_specific_gpu_device_request``),
``crates/openshell-core/src/proto_struct.rs`` (``deserialize_optional_non_empty_string_list``)
and the VM driver's ``crates/openshell-driver-vm/src/driver.rs`` (``VmSandboxDriverConfig``,
``vm_gpu_device_id``). tests/unit/compat/test_compat_platforms.py feeds the same specs to the
package.

OpenShell's verdict, kept:

- Field names: each field by its proto name or its proto3 JSON name (``resource_requirements``
  or ``resourceRequirements``, ``driver_config`` or ``driverConfig``); a message given under
  both names is merged, as json_format does. A key that is neither is refused, at every level
  of the spec, so a misspelt key never becomes a sandbox without a GPU. JSON ``null`` means
  "not given". As json_format does, an empty list or string in place of a message reads as an
  empty message; any other non-object is refused.
- ``resource_requirements.gpu``: an object whose presence, even ``{}``, asks for GPUs. Its
  only field is ``count`` (``optional uint32``): omitted means one GPU; 0 is refused. The count
  is a JSON number with no fraction (``2``, ``2.0``, ``1e2``) or a string read the way
  json_format reads it (``"2"``, ``"2.0"``, ``"1e2"``; no spaces), at most 2^32-1.
- Device ids come from the driver-keyed ``template.driver_config`` (a JSON object): the
  gateway passes the ``vm`` block, which must be an object (``null`` included is refused), to
  the VM driver, which allows only ``gpu_device_ids``. Once given, that is a non-empty list of
  strings, none blank, none repeated. Ids need a GPU request, and the count, 1 when omitted,
  must equal the number of ids: two ids without a count are refused ("gpu count (1) must
  match ... length (2)").
- ``resource_requirements.gpu.device_ids`` and a ``driver_config`` at the top of the spec are
  not fields of the spec: refused, pointing at ``template.driver_config.vm.gpu_device_ids``.

Deliberately different:

- More than one GPU per sandbox (OpenShell's VM driver passes one).
- Device ids must be ones vmsandbox can resolve (PCI address, NVIDIA or ROCm UUID, DRM card
  name or inventory index), and two spellings of one GPU are a repeat.
- The spec before OpenShell 2c545893 and 1dc59853 is read too: ``gpu: true`` asks for one
  GPU, ``gpu_device: "ID"`` (also ``gpuDevice``; it requires ``gpu: true``, as OpenShell's CLI
  did) names it, ``gpu: false`` and ``gpu_device: ""`` mean not given. With both
  ``resource_requirements.gpu`` and ``gpu: true`` the count comes from ``resource_requirements``;
  ``gpu_device`` and ``gpu_device_ids`` given together must name the same GPUs.
- The other fields of the spec and of ``template`` (log level, environment, policy, image, ...)
  are not read here: their names are checked, their values are left to their own readers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from vmsandbox.compat._wire import RUST_WHITESPACE, optional_bool, optional_str, proto3_int
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


def _not_read(value: object, field: str) -> object:
    """A field that is not about GPUs: its value is its own reader's business."""
    return value


def _count(value: object, field: str) -> int:
    """``count``: a uint32 as json_format reads it; 0 is refused by the gateway."""
    allowed = (
        "a whole number of GPUs (a uint32: a JSON number with no fraction, or a string such as '2')"
    )
    count = proto3_int(value, field, allowed)
    if not 0 <= count <= _UINT32_MAX:
        raise invalid(field, value, f"{field} must be {allowed}, got {shown(value)}")
    if count == 0:
        raise invalid(
            field, value, f"{field}: gpu count must be greater than 0, got {shown(value)}"
        )
    return count


def _struct(value: object, field: str) -> Mapping[object, object]:
    """A ``google.protobuf.Struct``: a JSON object."""
    if not isinstance(value, Mapping):
        raise invalid(field, value, f"{field} must be an object, got {shown(value)}")
    return value


def _legacy_str(value: object, field: str) -> str | None:
    return optional_str(value, field)


def _legacy_bool(value: object, field: str) -> bool | None:
    return optional_bool(value, field)


# A message is {proto field name: sub-message or leaf reader}; its proto3 JSON names are the
# lowerCamelCase of the proto names (json_format takes both).
Schema = Mapping[str, "Schema | Callable[[object, str], object]"]
_GPU_SCHEMA: Schema = {"count": _count}
_TEMPLATE_SCHEMA: Schema = {
    "image": _not_read,
    "runtime_class_name": _not_read,
    "agent_socket": _not_read,
    "labels": _not_read,
    "annotations": _not_read,
    "environment": _not_read,
    "resources": _not_read,
    "user_namespaces": _not_read,
    "driver_config": _struct,
}
SPEC_SCHEMA: Schema = {
    "log_level": _not_read,
    "environment": _not_read,
    "template": _TEMPLATE_SCHEMA,
    "policy": _not_read,
    "providers": _not_read,
    "resource_requirements": {"gpu": _GPU_SCHEMA},
    "command": _not_read,
    "tty": _not_read,
    "provider_attachment_epoch": _not_read,
    "restart_policy": _not_read,
    "gpu": _legacy_bool,  # the spec before 2c545893
    "gpu_device": _legacy_str,  # the spec before 1dc59853
}
# Keys that are not fields but are likely meant for one, by the message they appear in: the
# refusal points at the field to use.
_HINTS = {
    ("spec", "driver_config"): "{where} is not a field of the sandbox spec: put driver_config in "
    f"template, as {_IDS} for GPU devices",
    (_GPU, "device_ids"): "{where} is not a field of OpenShell's spec: name the devices in "
    f"{_IDS} and give their number in {_GPU}.count",
}


def json_name(name: str) -> str:
    """The proto3 JSON name of a proto field name (``resource_requirements`` ->
    ``resourceRequirements``)."""
    first, *rest = name.split("_")
    return first + "".join(part[:1].upper() + part[1:] for part in rest)


def gpu_request(spec: Mapping[str, object]) -> GpuRequest | None:
    """The GpuRequest of an OpenShell sandbox spec; None when it asks for no GPU."""
    read: dict[str, Any] = {}
    _convert(spec, read, "spec", SPEC_SCHEMA)
    legacy = read.get("gpu")
    legacy_device = read.get("gpu_device")
    if legacy_device and not legacy:
        raise invalid(
            "gpu_device",
            legacy_device,
            f"gpu_device {shown(legacy_device)} requires gpu=true: set gpu: true or drop "
            "gpu_device",
        )
    gpu = read.get("resource_requirements", {}).get("gpu")
    count = None if gpu is None else gpu.get("count")

    sources: list[tuple[str, tuple[str, ...]]] = []
    ids = _vm_device_ids(read.get("template", {}).get("driver_config"))
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


def _convert(value: object, target: dict[str, Any], field: str, schema: Schema) -> None:
    """Read one proto3 JSON message into ``target`` as json_format does: key by key, in order,
    merging into what an earlier spelling of the same field gave; null clears a field."""
    for key, item in _message(value, field).items():
        name = _field_name(key, field, schema)
        path = name if field == "spec" else f"{field}.{name}"
        if item is None:
            target.pop(name, None)
            continue
        kind = schema[name]
        if isinstance(kind, Mapping):
            _convert(item, target.setdefault(name, {}), path, kind)
        else:
            target[name] = kind(item, path)


def _message(value: object, field: str) -> Mapping[object, object]:
    """A message's JSON object; json_format iterates what it gets, so ``[]`` and ``""`` read as
    an empty message."""
    if isinstance(value, Mapping):
        return value
    if isinstance(value, list | str) and not value:
        return {}
    raise invalid(field, value, f"{field} must be an object, got {shown(value)}")


def _field_name(key: object, field: str, schema: Schema) -> str:
    """The proto name ``key`` spells, by its proto or its proto3 JSON name."""
    for name in schema:
        if key in (name, json_name(name)):
            return name
    if isinstance(key, str):
        hint = _HINTS.get((field, key)) or _HINTS.get((field, _snake(key)))
        if hint is not None:
            where = key if field == "spec" else f"{field}.{key}"
            raise invalid(where, key, hint.format(where=where))
    names = ", ".join(f"{name} ({json_name(name)})" if "_" in name else name for name in schema)
    raise invalid(
        field,
        key,
        f"{field} has unknown key {shown(key)}: allowed are {names}",
    )


def _snake(key: str) -> str:
    """``deviceIds`` -> ``device_ids``."""
    return "".join(f"_{char.lower()}" if char.isupper() else char for char in key)


def _vm_device_ids(config: Mapping[object, object] | None) -> tuple[str, ...] | None:
    """``template.driver_config.vm.gpu_device_ids``, canonical; None when not given."""
    if config is None or "vm" not in config:
        return None
    vm = config["vm"]
    if not isinstance(vm, Mapping):
        raise invalid(_VM, vm, f"{_VM} must be an object, got {shown(vm)}")
    unknown = sorted((key for key in vm if key != "gpu_device_ids"), key=shown)
    if unknown:
        raise invalid(
            _VM,
            unknown[0],
            f"{_VM} has unknown key(s) {', '.join(map(shown, unknown))}: the VM driver allows "
            "only gpu_device_ids",
        )
    if "gpu_device_ids" not in vm:
        return None
    ids = vm["gpu_device_ids"]
    if not isinstance(ids, list) or not ids or not all(isinstance(item, str) for item in ids):
        raise invalid(
            _IDS, ids, f"{_IDS} must be a non-empty list of device id strings, got {shown(ids)}"
        )
    for index, item in enumerate(ids):
        if not item.strip(RUST_WHITESPACE):
            raise invalid(_IDS, item, f"{_IDS}[{index}] must be a non-empty string")
        if item in ids[:index]:
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
