"""Tako job type gpu object -> GpuRequest."""

from __future__ import annotations

import pytest

from vmsandbox.compat.tako import gpu_request
from vmsandbox.errors import InvalidArgument
from vmsandbox.spec import GpuRequest

A, B = "0000:41:00.0", "0000:c1:00.0"
UUID = "GPU-0a1b2c3d-4e5f-6789-abcd-ef0123456789"
ON = {"enabled": True, "vendor": "nvidia"}


@pytest.mark.parametrize(
    ("gpu", "expected"),
    [
        (None, None),
        ({}, None),
        ({"enabled": False}, None),
        ({"enabled": None}, None),
        ({"enabled": False, "vendor": None, "count": None, "device_ids": None}, None),
        (ON, GpuRequest(all=True, vendor="nvidia")),
        ({"enabled": True, "vendor": " AMD "}, GpuRequest(all=True, vendor="amd")),
        ({**ON, "count": 1}, GpuRequest(count=1, vendor="nvidia")),
        ({**ON, "count": 16}, GpuRequest(count=16, vendor="nvidia")),
        ({"enabled": True, "vendor": "amd", "count": 4}, GpuRequest(count=4, vendor="amd")),
        ({**ON, "device_ids": ["41:00.0"]}, GpuRequest(devices=(A,), vendor="nvidia")),
        (
            {**ON, "device_ids": [" 41:00.0 ", UUID.upper(), "0"]},
            GpuRequest(devices=(A, UUID, "0"), vendor="nvidia"),
        ),
        (
            {**ON, "device_ids": [str(i) for i in range(16)]},
            GpuRequest(devices=tuple(str(i) for i in range(16)), vendor="nvidia"),
        ),
        ({**ON, "count": None, "device_ids": [A, B]}, GpuRequest(devices=(A, B), vendor="nvidia")),
    ],
)
def test_accepted(gpu: dict | None, expected: GpuRequest | None) -> None:
    assert gpu_request(gpu) == expected


@pytest.mark.parametrize(
    ("gpu", "field", "says"),
    [
        ({"vendor": "nvidia"}, "gpu.vendor", "gpu.enabled is not true"),
        ({"enabled": False, "count": 2}, "gpu.count", "gpu.enabled is not true"),
        ({"enabled": False, "device_ids": [A]}, "gpu.device_ids", "gpu.enabled is not true"),
        ({"enabled": False, "count": 0}, "gpu.count", "gpu.enabled is not true"),
        ({"enabled": "true", "vendor": "nvidia"}, "gpu.enabled", "true or false"),
        ({"enabled": 1, "vendor": "nvidia"}, "gpu.enabled", "true or false"),
        ({"enabled": True}, "gpu.vendor", "required"),
        ({"enabled": True, "count": 1}, "gpu.vendor", "required"),
        ({"enabled": True, "vendor": "intel"}, "gpu.vendor", "nvidia or amd"),
        ({"enabled": True, "vendor": ""}, "gpu.vendor", "nvidia or amd"),
        ({"enabled": True, "vendor": 1}, "gpu.vendor", "nvidia or amd"),
        ({**ON, "count": 2, "device_ids": [A, B]}, "gpu.count", "mutually exclusive"),
        ({**ON, "count": 0}, "gpu.count", "between 1 and 16"),
        ({**ON, "count": 17}, "gpu.count", "between 1 and 16"),
        ({**ON, "count": -1}, "gpu.count", "between 1 and 16"),
        ({**ON, "count": 2.0}, "gpu.count", "between 1 and 16"),
        ({**ON, "count": "2"}, "gpu.count", "between 1 and 16"),
        ({**ON, "count": True}, "gpu.count", "between 1 and 16"),
        ({**ON, "device_ids": []}, "gpu.device_ids", "list of 1 to 16"),
        ({**ON, "device_ids": [str(i) for i in range(17)]}, "gpu.device_ids", "list of 1 to 16"),
        ({**ON, "device_ids": A}, "gpu.device_ids", "list of 1 to 16"),
        ({**ON, "device_ids": [""]}, "gpu.device_ids", "non-empty string without commas"),
        ({**ON, "device_ids": ["  "]}, "gpu.device_ids", "non-empty string without commas"),
        ({**ON, "device_ids": ["0,1"]}, "gpu.device_ids", "non-empty string without commas"),
        ({**ON, "device_ids": [3]}, "gpu.device_ids", "non-empty string without commas"),
        ({**ON, "device_ids": [UUID, UUID.lower()]}, "gpu.device_ids", "more than once"),
        ({**ON, "device_ids": ["41:00.0", " 41:00.0"]}, "gpu.device_ids", "more than once"),
        ({**ON, "device_ids": ["41:00.0", A]}, "gpu.device_ids", "twice"),
        ({**ON, "device_ids": ["gpu0"]}, "gpu.device_ids", "not a device id"),
        ({**ON, "devices": [A]}, "gpu", "unknown key"),
        ({"enabled": False, "type": "H100"}, "gpu", "unknown key"),
        (True, "gpu", "object"),
        ([ON], "gpu", "object"),
    ],
)
def test_rejected(gpu: object, field: str, says: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        gpu_request(gpu)  # type: ignore[arg-type]
    err = caught.value
    assert err.code == "INVALID_ARGUMENT"
    assert err.details["field"] == field
    assert field in err.message
    assert says in err.message
