"""OpenShell sandbox spec -> GpuRequest."""

from __future__ import annotations

import pytest

from vmsandbox.compat.openshell import gpu_request
from vmsandbox.errors import InvalidArgument
from vmsandbox.spec import GpuRequest

A, B = "0000:41:00.0", "0000:c1:00.0"
UUID = "GPU-0a1b2c3d-4e5f-6789-abcd-ef0123456789"


def rr(**gpu: object) -> dict:
    return {"resource_requirements": {"gpu": gpu}}


def vm(ids: object, **extra: object) -> dict:
    return {"driver_config": {"vm": {"gpu_device_ids": ids, **extra}}}


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ({}, None),
        ({"log_level": "info", "environment": {"A": "1"}}, None),
        ({"resource_requirements": {}}, None),
        ({"resource_requirements": None}, None),
        ({"resource_requirements": {"gpu": None}}, None),
        ({"gpu": False}, None),
        ({"gpu": None}, None),
        ({"gpu": False, "gpu_device": ""}, None),
        ({"driver_config": {"vm": {}}}, None),
        ({"driver_config": {"vm": None, "docker": {"x": 1}}}, None),
        (rr(), GpuRequest()),
        (rr(count=None), GpuRequest()),
        (rr(count=1), GpuRequest(count=1)),
        (rr(count=4), GpuRequest(count=4)),  # more than OpenShell's VM driver's one
        (rr(device_ids=["41:00.0", "pci_0000_c1_00_0"]), GpuRequest(devices=(A, B))),
        (rr(count=2, device_ids=[A, B]), GpuRequest(count=2, devices=(A, B))),
        (rr(device_ids=[UUID.upper(), "3"]), GpuRequest(devices=(UUID, "3"))),
        ({**rr(), **vm([A])}, GpuRequest(devices=(A,))),
        ({**rr(count=2), **vm([A, B])}, GpuRequest(count=2, devices=(A, B))),
        ({**rr(device_ids=[A, B]), **vm([B, A])}, GpuRequest(devices=(A, B))),
        (
            {**rr(), "template": {"driver_config": {"vm": {"gpu_device_ids": [A]}}}},
            GpuRequest(devices=(A,)),
        ),
        ({"gpu": True}, GpuRequest()),
        ({"gpu": True, "gpu_device": "41:00.0"}, GpuRequest(devices=(A,))),
        ({"gpu": True, "gpu_device": ""}, GpuRequest()),
        ({"gpu": True, **vm([A])}, GpuRequest(devices=(A,))),
        ({"gpu": True, **rr(count=2)}, GpuRequest(count=2)),
        ({"gpu": False, **rr(count=2)}, GpuRequest(count=2)),
        ({"gpu": True, "gpu_device": A, **rr(device_ids=[A])}, GpuRequest(devices=(A,))),
    ],
)
def test_accepted(spec: dict, expected: GpuRequest | None) -> None:
    assert gpu_request(spec) == expected


@pytest.mark.parametrize(
    ("spec", "field", "says"),
    [
        (rr(count=0), "resource_requirements.gpu.count", "must be greater than 0"),
        (rr(count=-1), "resource_requirements.gpu.count", "must be greater than 0"),
        (rr(count=1.5), "resource_requirements.gpu.count", "whole number"),
        (rr(count=2.0), "resource_requirements.gpu.count", "whole number"),
        (rr(count="2"), "resource_requirements.gpu.count", "whole number"),
        (rr(count=True), "resource_requirements.gpu.count", "whole number"),
        (rr(device_ids=[]), "resource_requirements.gpu.device_ids", "non-empty list"),
        (rr(device_ids=A), "resource_requirements.gpu.device_ids", "non-empty list"),
        (rr(device_ids=[""]), "resource_requirements.gpu.device_ids", "not a device id"),
        (rr(device_ids=[None]), "resource_requirements.gpu.device_ids", "not a device id"),
        (rr(device_ids=["gpu0"]), "resource_requirements.gpu.device_ids", "not a device id"),
        (
            rr(device_ids=["41:00.0", "0000:41:00.0"]),
            "resource_requirements.gpu.device_ids",
            "twice",
        ),
        (rr(count=1, device_ids=[A, B]), "resource_requirements.gpu.count", "does not match"),
        (rr(count=3, device_ids=[A, B]), "resource_requirements.gpu.count", "does not match"),
        ({**rr(count=1), **vm([A, B])}, "resource_requirements.gpu.count", "does not match"),
        (rr(cont=1), "resource_requirements.gpu", "unknown key"),
        ({"resource_requirements": {"gpu": True}}, "resource_requirements.gpu", "object"),
        ({"resource_requirements": {"gpu": 1}}, "resource_requirements.gpu", "object"),
        ({"resource_requirements": []}, "resource_requirements", "object"),
        ({"resource_requirements": "gpu"}, "resource_requirements", "object"),
        (vm([A]), "driver_config.vm.gpu_device_ids", "asks for none"),
        ({"gpu": False, **vm([A])}, "driver_config.vm.gpu_device_ids", "asks for none"),
        ({**rr(), **vm([])}, "driver_config.vm.gpu_device_ids", "non-empty list"),
        ({**rr(), **vm([""])}, "driver_config.vm.gpu_device_ids", "not a device id"),
        ({**rr(), **vm([A, A])}, "driver_config.vm.gpu_device_ids", "twice"),
        ({**rr(), **vm([A], vcpus=4)}, "driver_config.vm", "unknown key"),
        ({**rr(), "driver_config": {"vm": [A]}}, "driver_config.vm", "object"),
        ({**rr(), "driver_config": {"vm": "41:00.0"}}, "driver_config.vm", "object"),
        ({**rr(), "driver_config": [A]}, "driver_config", "object"),
        ({**rr(device_ids=[A]), **vm([B])}, "driver_config.vm.gpu_device_ids", "different GPUs"),
        ({**rr(device_ids=[A]), **vm([A, B])}, "driver_config.vm.gpu_device_ids", "different"),
        (
            {**rr(), "template": {"driver_config": {"vm": {"gpu_device_ids": []}}}},
            "template.driver_config.vm.gpu_device_ids",
            "non-empty list",
        ),
        (
            {**rr(), **vm([A]), "template": {"driver_config": {"vm": {}}}},
            "driver_config",
            "once",
        ),
        ({**rr(), "template": "x"}, "template", "object"),
        ({"gpu_device": A}, "gpu_device", "requires gpu=true"),
        ({"gpu": False, "gpu_device": A}, "gpu_device", "requires gpu=true"),
        ({**rr(), "gpu_device": A}, "gpu_device", "requires gpu=true"),
        ({"gpu": True, "gpu_device": "bogus"}, "gpu_device", "not a device id"),
        ({"gpu": True, "gpu_device": 3}, "gpu_device", "must be a string"),
        ({"gpu": True, "gpu_device": A, **vm([B])}, "gpu_device", "different GPUs"),
        ({"gpu": "true"}, "gpu", "true or false"),
        ({"gpu": 1}, "gpu", "true or false"),
        (None, "spec", "object"),
        ([], "spec", "object"),
    ],
)
def test_rejected(spec: object, field: str, says: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        gpu_request(spec)  # type: ignore[arg-type]
    err = caught.value
    assert err.code == "INVALID_ARGUMENT"
    assert err.details["field"] == field
    assert field in err.message
    assert says in err.message
