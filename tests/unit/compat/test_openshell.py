"""OpenShell sandbox spec -> GpuRequest.

Each row names the NVIDIA/OpenShell file (main at commit 2f7fb655, or the spec before
1dc59853 for the legacy fields) its rule comes from, JSON for google.protobuf.json_format (what
the released openshell package parses a spec with), or "vmsandbox" where vmsandbox deliberately
differs (see vmsandbox/compat/openshell.py). tests/unit/compat/test_compat_platforms.py runs the
same kind of specs through the released package itself.
"""

from __future__ import annotations

import pytest

from vmsandbox.compat.openshell import gpu_request
from vmsandbox.errors import InvalidArgument
from vmsandbox.gpu.request import GpuRequest

A, B = "0000:41:00.0", "0000:c1:00.0"
UUID = "GPU-0a1b2c3d-4e5f-6789-abcd-ef0123456789"
PROTO = "proto/openshell.proto"
JSON = "google.protobuf.json_format"
GPU_RS = "crates/openshell-core/src/gpu.rs"
VM_DRIVER = "crates/openshell-driver-vm/src/driver.rs"
STRUCT = "crates/openshell-core/src/proto_struct.rs"
SELECT = "crates/openshell-server/src/compute/mod.rs select_driver_config"
LEGACY = "proto/openshell.proto before 1dc59853 (gpu, gpu_device)"
IDS = "template.driver_config.vm.gpu_device_ids"
COUNT = "resource_requirements.gpu.count"
VM = "template.driver_config.vm"
# validate_vm_sandbox_rejects_multiple_gpu_device_ids_without_gpu_count and ..._mismatched_...
MISMATCH_1_2 = f"gpu count (1, as it is omitted) must match {IDS} length (2)"
MISMATCH_2_1 = f"gpu count (2) must match {IDS} length (1)"


def rr(**gpu: object) -> dict:
    return {"resource_requirements": {"gpu": gpu}}


def vm(ids: object, **extra: object) -> dict:
    return {"template": {"driver_config": {"vm": {"gpu_device_ids": ids, **extra}}}}


@pytest.mark.parametrize(
    ("source", "spec", "expected"),
    [
        (PROTO, {}, None),
        (PROTO, {"log_level": "info", "environment": {"A": "1"}}, None),
        (PROTO, {"resource_requirements": {}}, None),
        (PROTO, {"resource_requirements": None}, None),
        (PROTO, {"resource_requirements": {"gpu": None}}, None),
        (LEGACY, {"gpu": False}, None),
        (LEGACY, {"gpu": None}, None),
        (LEGACY, {"gpu": False, "gpu_device": ""}, None),
        (SELECT, {"template": {"driver_config": {"vm": {}}}}, None),
        (SELECT, {"template": {"driver_config": {"docker": {"x": 1}}}}, None),
        (SELECT, {"template": {"image": "x", "driver_config": None}}, None),
        (GPU_RS, rr(), GpuRequest()),
        (GPU_RS, rr(count=None), GpuRequest()),
        (GPU_RS, rr(count=1), GpuRequest(count=1)),
        (PROTO, rr(count="2"), GpuRequest(count=2)),  # proto3 JSON: uint32 as a string
        (JSON, rr(count=2.0), GpuRequest(count=2)),
        (JSON, rr(count=1e2), GpuRequest(count=100)),
        (JSON, rr(count="1e2"), GpuRequest(count=100)),
        (JSON, rr(count="2.0"), GpuRequest(count=2)),
        (JSON, {"resourceRequirements": {"gpu": {"count": 2}}}, GpuRequest(count=2)),
        (
            JSON,
            {"resource_requirements": {"gpu": {"count": 2}}, "resourceRequirements": {}},
            GpuRequest(count=2),
        ),
        (JSON, {"resourceRequirements": {"gpu": {}}, **vm([A])}, GpuRequest(devices=(A,))),
        (
            JSON,
            {**rr(), "template": {"driverConfig": {"vm": {"gpu_device_ids": [A]}}}},
            GpuRequest(devices=(A,)),
        ),
        (JSON, {"resource_requirements": []}, None),  # json_format: an empty message
        (JSON, [], None),
        (JSON, {"log_level": "info", "tty": True, "command": ["sh"]}, None),
        ("vmsandbox: more than one GPU", rr(count=4), GpuRequest(count=4)),
        (VM_DRIVER, {**rr(), **vm([A])}, GpuRequest(devices=(A,))),
        (VM_DRIVER, {**rr(count=1), **vm(["41:00.0"])}, GpuRequest(count=1, devices=(A,))),
        (GPU_RS, {**rr(count=2), **vm([A, "pci_0000_c1_00_0"])}, GpuRequest(2, (A, B))),
        (GPU_RS, {**rr(count=2), **vm([UUID.upper(), "3"])}, GpuRequest(2, (UUID, "3"))),
        (
            SELECT,
            {**rr(), "template": {"driver_config": {"vm": {"gpu_device_ids": [A]}, "k8s": 1}}},
            GpuRequest(devices=(A,)),
        ),
        (LEGACY, {"gpu": True}, GpuRequest()),
        (LEGACY, {"gpu": True, "gpu_device": "41:00.0"}, GpuRequest(devices=(A,))),
        (LEGACY, {"gpu": True, "gpu_device": ""}, GpuRequest()),
        (LEGACY, {"gpu": True, **vm([A])}, GpuRequest(devices=(A,))),
        (LEGACY, {"gpu": True, **rr(count=2)}, GpuRequest(count=2)),
        (LEGACY, {"gpu": False, **rr(count=2)}, GpuRequest(count=2)),
        (LEGACY, {"gpu": True, "gpu_device": A, **rr(), **vm([A])}, GpuRequest(devices=(A,))),
    ],
)
def test_accepted(source: str, spec: dict, expected: GpuRequest | None) -> None:
    assert gpu_request(spec) == expected, source


@pytest.mark.parametrize(
    ("source", "spec", "field", "says"),
    [
        (GPU_RS, rr(count=0), COUNT, "gpu count must be greater than 0"),
        (PROTO, rr(count=-1), COUNT, "uint32"),
        (PROTO, rr(count=2**32), COUNT, "uint32"),
        (PROTO, rr(count=1.5), COUNT, "whole number"),
        (JSON, rr(count=" 2"), COUNT, "whole number"),
        (JSON, rr(count="2.5"), COUNT, "whole number"),
        (JSON, rr(count=float("inf")), COUNT, "whole number"),
        (PROTO, rr(count=True), COUNT, "whole number"),
        (PROTO, rr(device_ids=[A]), "resource_requirements.gpu.device_ids", IDS),
        (PROTO, rr(cont=1), "resource_requirements.gpu", "unknown key"),
        (
            JSON,
            {"resource_requirements": {"gpus": {"count": 2}}},
            "resource_requirements",
            "'gpus'",
        ),
        (
            JSON,
            {"resource_requirements": {"gpus": {}, "gpu": {}}},
            "resource_requirements",
            "unknown key",
        ),
        (JSON, {"resource_requirement": {"gpu": {}}}, "spec", "unknown key"),
        (JSON, {"template": {"driverconfig": {}}}, "template", "driver_config (driverConfig)"),
        (JSON, {"resource_requirements": ["gpu"]}, "resource_requirements", "object"),
        (PROTO, {"resource_requirements": {"gpu": True}}, "resource_requirements.gpu", "object"),
        (PROTO, {"resource_requirements": {"gpu": 1}}, "resource_requirements.gpu", "object"),
        (PROTO, {"driver_config": {"vm": {"gpu_device_ids": [A]}}}, "driver_config", "template"),
        (GPU_RS, vm([A]), IDS, "requires a gpu request"),
        (GPU_RS, {"gpu": False, **vm([A])}, IDS, "requires a gpu request"),
        (VM_DRIVER, {**rr(), **vm([A, B])}, COUNT, MISMATCH_1_2),
        (VM_DRIVER, {**rr(count=2), **vm([A])}, COUNT, MISMATCH_2_1),
        (GPU_RS, {**rr(count=3), **vm([A, B])}, COUNT, "must match"),
        (STRUCT, {**rr(), **vm([])}, IDS, "non-empty list"),
        (STRUCT, {**rr(), **vm(A)}, IDS, "non-empty list"),
        (STRUCT, {**rr(), **vm([""])}, IDS, "must be a non-empty string"),
        (STRUCT, {**rr(), **vm([" "])}, IDS, "must be a non-empty string"),
        (STRUCT, {**rr(), **vm([None])}, IDS, "list of device id strings"),
        (STRUCT, {**rr(), **vm(None)}, IDS, "non-empty list"),
        (SELECT, {**rr(), "template": {"driver_config": {"vm": None}}}, VM, "must be an object"),
        (GPU_RS, {**rr(count=2), **vm([A, A])}, IDS, "duplicate device ID"),
        ("vmsandbox: one GPU named twice", {**rr(count=2), **vm([A, "41:00.0"])}, IDS, "twice"),
        ("vmsandbox: ids it can resolve", {**rr(), **vm(["gpu0"])}, IDS, "not a device id"),
        (VM_DRIVER, {**rr(), **vm([A], vcpus=4)}, VM, "unknown key"),
        (SELECT, {**rr(), "template": {"driver_config": {"vm": [A]}}}, VM, "must be an object"),
        (SELECT, {**rr(), "template": {"driver_config": [A]}}, "template.driver_config", "object"),
        (PROTO, {**rr(), "template": "x"}, "template", "object"),
        (LEGACY, {"gpu_device": A}, "gpu_device", "requires gpu=true"),
        (LEGACY, {"gpu": False, "gpu_device": A}, "gpu_device", "requires gpu=true"),
        (LEGACY, {**rr(), "gpu_device": A}, "gpu_device", "requires gpu=true"),
        (LEGACY, {"gpu": True, "gpu_device": "bogus"}, "gpu_device", "not a device id"),
        (LEGACY, {"gpu": True, "gpu_device": 3}, "gpu_device", "must be a string"),
        ("vmsandbox", {"gpu": True, "gpu_device": A, **vm([B])}, "gpu_device", "different GPUs"),
        (LEGACY, {"gpu": "true"}, "gpu", "true or false"),
        (LEGACY, {"gpu": 1}, "gpu", "true or false"),
        (PROTO, None, "spec", "object"),
        (PROTO, 7, "spec", "object"),
        (PROTO, {"gpu": {}}, "gpu", "true or false"),
    ],
)
def test_rejected(source: str, spec: object, field: str, says: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        gpu_request(spec)  # type: ignore[arg-type]
    err = caught.value
    assert err.code == "INVALID_ARGUMENT", source
    assert err.details["field"] == field
    assert field in err.message
    assert says in err.message
