"""OpenShell: the GPU part of a sandbox spec, in its JSON form.

Fields read (everything else in the spec is not about GPUs and is left to its own reader):

- ``resource_requirements.gpu``: an object whose presence, even ``{}``, asks for GPUs.
  ``count``: an integer >= 1; omitted means one GPU, or as many as the device ids name.
  ``device_ids``: a non-empty list of device ids.
- ``driver_config.vm.gpu_device_ids``: a non-empty list of device ids. The driver-keyed
  ``driver_config`` may sit at the top of the spec or in ``template``, where OpenShell's public
  ``SandboxTemplate`` carries it; the ``vm`` block allows no other keys.
- Legacy: ``gpu: true`` asks for one GPU; ``gpu_device: "ID"`` (with ``gpu: true``) names it.

Unlike OpenShell's own VM driver, which passes one GPU at most, counts above 1 are accepted.

Edge cases, decided here:

- JSON ``null`` means "not given"; so do ``gpu: false`` and ``gpu_device: ""``, which are the
  proto3 defaults a serialiser may write out.
- ``resource_requirements.gpu`` together with ``gpu: true`` is one request; the count comes from
  ``resource_requirements.gpu``.
- ``gpu_device`` without ``gpu: true`` is rejected, as OpenShell does ("gpu_device requires
  gpu=true"), even when ``resource_requirements.gpu`` is present.
- Every device list given (``device_ids``, ``gpu_device_ids``, ``gpu_device``) must name the
  same GPUs, compared by canonical id (an index and a PCI address count as different); the
  order of the first one given is kept.
- Device ids with no GPU request (``gpu_device_ids`` alone) are rejected, not dropped.
- ``resource_requirements``, ``resource_requirements.gpu``, ``template``, ``driver_config`` or
  ``driver_config.vm`` that is not an object is rejected, as is ``driver_config`` given both at
  the top and in ``template``. Unknown keys in ``resource_requirements.gpu`` and in
  ``driver_config.vm`` are rejected; other keys of ``resource_requirements`` (future resources)
  and of ``driver_config`` (other drivers' blocks) are ignored.
"""

from __future__ import annotations

from collections.abc import Mapping

from vmsandbox.compat._wire import (
    as_mapping,
    device_id_list,
    optional_bool,
    optional_count,
    optional_mapping,
    optional_str,
    reject_unknown_keys,
)
from vmsandbox.gpuquery import check_count_matches_devices, invalid, normalise_device_id, shown
from vmsandbox.spec import GpuRequest

_GPU_KEYS = frozenset({"count", "device_ids"})
_VM_KEYS = frozenset({"gpu_device_ids"})
_GPU = "resource_requirements.gpu"


def gpu_request(spec: Mapping[str, object]) -> GpuRequest | None:
    """The GpuRequest of an OpenShell sandbox spec; None when it asks for no GPU."""
    spec = as_mapping(spec, "spec")
    legacy = optional_bool(spec.get("gpu"), "gpu")
    legacy_device = optional_str(spec.get("gpu_device"), "gpu_device")
    requirements = optional_mapping(spec.get("resource_requirements"), "resource_requirements")
    gpu = None if requirements is None else optional_mapping(requirements.get("gpu"), _GPU)
    if legacy_device and not legacy:
        raise invalid(
            "gpu_device",
            legacy_device,
            f"gpu_device {shown(legacy_device)} requires gpu=true: set gpu: true or drop "
            "gpu_device",
        )

    sources: list[tuple[str, tuple[str, ...]]] = []
    if gpu is not None:
        reject_unknown_keys(gpu, _GPU_KEYS, _GPU)
        if gpu.get("device_ids") is not None:
            field = f"{_GPU}.device_ids"
            sources.append((field, device_id_list(gpu["device_ids"], field)))
    vm_field, vm = _vm_block(spec)
    if vm is not None and vm.get("gpu_device_ids") is not None:
        field = f"{vm_field}.gpu_device_ids"
        sources.append((field, device_id_list(vm["gpu_device_ids"], field)))
    if legacy_device:
        sources.append(("gpu_device", (normalise_device_id(legacy_device, "gpu_device"),)))

    if gpu is None and not legacy:
        if sources:
            field, devices = sources[0]
            raise invalid(
                field,
                list(devices),
                f"{field} {list(devices)} names GPUs but the spec asks for none: add {_GPU} "
                "(or gpu: true)",
            )
        return None
    count = None if gpu is None else optional_count(gpu.get("count"), f"{_GPU}.count")
    devices = _same_devices(sources)
    if sources:
        check_count_matches_devices(count, devices, f"{_GPU}.count", sources[0][0])
    return GpuRequest(count=count, devices=devices)


def _vm_block(spec: Mapping[object, object]) -> tuple[str, Mapping[object, object] | None]:
    """The VM driver's block of ``driver_config`` (top level or in ``template``), and its path."""
    template = optional_mapping(spec.get("template"), "template")
    top = spec.get("driver_config")
    nested = None if template is None else template.get("driver_config")
    if top is not None and nested is not None:
        raise invalid(
            "driver_config",
            top,
            "driver_config is given both at the top of the spec and in template: give it once",
        )
    field = "driver_config" if nested is None else "template.driver_config"
    config = optional_mapping(top if nested is None else nested, field)
    vm = None if config is None else optional_mapping(config.get("vm"), f"{field}.vm")
    if vm is not None:
        reject_unknown_keys(vm, _VM_KEYS, f"{field}.vm")
    return f"{field}.vm", vm


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
