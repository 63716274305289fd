"""Tako job type GPU settings -> GpuRequest.

Each row names the file of the released tako-vm 0.3.0 its rule comes from (CONFIG and
FROM_DICT are Tako's two readers of a job type; vmsandbox takes what both read alike), or
"vmsandbox" where vmsandbox deliberately differs (see vmsandbox/compat/tako.py).
tests/unit/compat/test_compat_platforms.py runs the same kind of blocks through the released
package.
"""

from __future__ import annotations

import pytest

from vmsandbox.compat.tako import gpu_request, job_type_gpu_request
from vmsandbox.errors import InvalidArgument
from vmsandbox.gpu.request import GpuRequest

A, B = "0000:41:00.0", "0000:c1:00.0"
UUID = "GPU-0a1b2c3d-4e5f-6789-abcd-ef0123456789"
ON = {"enabled": True, "vendor": "nvidia"}
# tako_vm/job_types.json: the block every shipped job type carries
SHIPPED = {"enabled": False, "vendor": None, "count": None, "device_ids": []}
CONFIG = "tako_vm/config.py JobTypeGPUConfig"
SHIPPED_JSON = "tako_vm/job_types.json"
FROM_DICT = "tako_vm/job_types.py JobType.from_dict"


@pytest.mark.parametrize(
    ("source", "gpu", "expected"),
    [
        (FROM_DICT, None, None),
        (CONFIG, {}, None),
        (CONFIG, {"enabled": False}, None),
        (FROM_DICT, {"enabled": 1, "vendor": "nvidia"}, GpuRequest(all=True, vendor="nvidia")),
        (CONFIG, {"enabled": "Yes", "vendor": "nvidia"}, GpuRequest(all=True, vendor="nvidia")),
        (CONFIG, {**ON, "count": "2"}, GpuRequest(count=2, vendor="nvidia")),
        (CONFIG, {**ON, "count": " 2.0 "}, GpuRequest(count=2, vendor="nvidia")),
        (CONFIG, {**ON, "count": 2.0}, GpuRequest(count=2, vendor="nvidia")),
        (CONFIG, {**ON, "count": True}, GpuRequest(count=1, vendor="nvidia")),
        (SHIPPED_JSON, SHIPPED, None),
        (CONFIG, {"enabled": False, "device_ids": []}, None),
        (CONFIG, ON, GpuRequest(all=True, vendor="nvidia")),
        (CONFIG, {**ON, "device_ids": []}, GpuRequest(all=True, vendor="nvidia")),
        (CONFIG, {**SHIPPED, **ON}, GpuRequest(all=True, vendor="nvidia")),
        (CONFIG, {"enabled": True, "vendor": " AMD "}, GpuRequest(all=True, vendor="amd")),
        (CONFIG, {**ON, "count": 1}, GpuRequest(count=1, vendor="nvidia")),
        (CONFIG, {**ON, "count": 16}, GpuRequest(count=16, vendor="nvidia")),
        (CONFIG, {**ON, "count": 2, "device_ids": []}, GpuRequest(count=2, vendor="nvidia")),
        (
            "vmsandbox: a VM passes N AMD GPUs",
            {"enabled": True, "vendor": "amd", "count": 4},
            GpuRequest(count=4, vendor="amd"),
        ),
        (CONFIG, {**ON, "device_ids": ["41:00.0"]}, GpuRequest(devices=(A,), vendor="nvidia")),
        (
            CONFIG,
            {**ON, "device_ids": [" 41:00.0 ", UUID.upper(), "0"]},
            GpuRequest(devices=(A, UUID, "0"), vendor="nvidia"),
        ),
        (
            CONFIG,
            {"enabled": True, "vendor": "amd", "device_ids": ["GPU-3F5A9C0E71B2D486", "card2"]},
            GpuRequest(devices=("GPU-3f5a9c0e71b2d486", "card2"), vendor="amd"),
        ),
        (
            CONFIG,
            {**ON, "device_ids": [str(i) for i in range(16)]},
            GpuRequest(devices=tuple(str(i) for i in range(16)), vendor="nvidia"),
        ),
        (
            CONFIG,
            {**ON, "count": None, "device_ids": [A, B]},
            GpuRequest(devices=(A, B), vendor="nvidia"),
        ),
    ],
)
def test_accepted(source: str, gpu: dict | None, expected: GpuRequest | None) -> None:
    assert gpu_request(gpu) == expected, source


@pytest.mark.parametrize(
    ("source", "gpu", "field", "says"),
    [
        (CONFIG, {"vendor": "nvidia"}, "gpu.vendor", "gpu.enabled is not true"),
        (CONFIG, {"enabled": False, "count": 2}, "gpu.count", "gpu.enabled is not true"),
        (CONFIG, {"enabled": False, "device_ids": [A]}, "gpu.device_ids", "is not true"),
        (CONFIG, {"enabled": False, "count": 0}, "gpu.count", "between 1 and 16"),
        (CONFIG, {"enabled": None}, "gpu.enabled", "true or false"),
        (FROM_DICT, {"enabled": "no", "vendor": "nvidia"}, "gpu.enabled", "read it differently"),
        (CONFIG, {**ON, "device_ids": None}, "gpu.device_ids", "list of up to 16"),
        (CONFIG, {"enabled": False, "vendor": "intel"}, "gpu.vendor", "nvidia or amd"),
        (FROM_DICT, {"enabled": "false", "vendor": "nvidia"}, "gpu.enabled", "true or false"),
        (CONFIG, {"enabled": 2, "vendor": "nvidia"}, "gpu.enabled", "true or false"),
        (CONFIG, {"enabled": True}, "gpu.vendor", "required"),
        (CONFIG, {"enabled": True, "count": 1}, "gpu.vendor", "required"),
        (CONFIG, {"enabled": True, "vendor": "intel"}, "gpu.vendor", "nvidia or amd"),
        (CONFIG, {"enabled": True, "vendor": ""}, "gpu.vendor", "nvidia or amd"),
        (CONFIG, {"enabled": True, "vendor": 1}, "gpu.vendor", "nvidia or amd"),
        (CONFIG, {**ON, "count": 2, "device_ids": [A, B]}, "gpu.count", "mutually exclusive"),
        (CONFIG, {**ON, "count": 0}, "gpu.count", "between 1 and 16"),
        (CONFIG, {**ON, "count": 17}, "gpu.count", "between 1 and 16"),
        (CONFIG, {**ON, "count": -1}, "gpu.count", "between 1 and 16"),
        (CONFIG, {**ON, "count": 2.5}, "gpu.count", "between 1 and 16"),
        (CONFIG, {**ON, "count": "2.5"}, "gpu.count", "between 1 and 16"),
        (CONFIG, {**ON, "count": "two"}, "gpu.count", "between 1 and 16"),
        (
            CONFIG,
            {**ON, "device_ids": [str(i) for i in range(17)]},
            "gpu.device_ids",
            "list of up to 16",
        ),
        (CONFIG, {**ON, "device_ids": A}, "gpu.device_ids", "list of up to 16"),
        (CONFIG, {**ON, "device_ids": [""]}, "gpu.device_ids", "without commas"),
        (CONFIG, {**ON, "device_ids": ["  "]}, "gpu.device_ids", "without commas"),
        (CONFIG, {**ON, "device_ids": ["0,1"]}, "gpu.device_ids", "without commas"),
        (CONFIG, {**ON, "device_ids": [3]}, "gpu.device_ids", "without commas"),
        (CONFIG, {**ON, "device_ids": [UUID, UUID.lower()]}, "gpu.device_ids", "more than once"),
        (CONFIG, {**ON, "device_ids": ["41:00.0", " 41:00.0"]}, "gpu.device_ids", "than once"),
        ("vmsandbox: one GPU named twice", {**ON, "device_ids": ["41:00.0", A]}, "", "twice"),
        ("vmsandbox: ids it can resolve", {**ON, "device_ids": ["gpu0"]}, "", "not a device id"),
        (CONFIG, {**ON, "devices": [A]}, "gpu", "unknown key"),
        (CONFIG, {"enabled": False, "type": "H100"}, "gpu", "unknown key"),
        (CONFIG, True, "gpu", "object"),
        (CONFIG, [ON], "gpu", "object"),
    ],
)
def test_rejected(source: str, gpu: object, field: str, says: str) -> None:
    field = field or "gpu.device_ids"
    with pytest.raises(InvalidArgument) as caught:
        gpu_request(gpu)  # type: ignore[arg-type]
    err = caught.value
    assert err.code == "INVALID_ARGUMENT", source
    assert err.details["field"] == field
    assert field in err.message
    assert says in err.message


# tests/test_job_types.py: test_job_type_from_dict_supports_legacy_gpu_top_level_fields
LEGACY = {"name": "legacy-gpu", "gpu_enabled": True, "gpu_vendor": "amd"}


@pytest.mark.parametrize(
    ("job_type", "expected"),
    [
        ({"name": "default", "memory_limit": "512m", "gpu": SHIPPED}, None),
        ({"name": "no-gpu-key"}, None),
        ({"name": "null-gpu", "gpu": None}, None),
        (
            {"name": "gpu-job", "gpu": {**ON, "count": 2, "device_ids": []}},
            GpuRequest(count=2, vendor="nvidia"),
        ),
        (
            {**LEGACY, "gpu_device_ids": ["0", "1"]},
            GpuRequest(devices=("0", "1"), vendor="amd"),
        ),
        ({**LEGACY, "gpu": {**SHIPPED, "enabled": None}}, GpuRequest(all=True, vendor="amd")),
        (
            {"name": "mixed", "gpu_enabled": True, "gpu": {"vendor": "nvidia", "count": 2}},
            GpuRequest(count=2, vendor="nvidia"),
        ),
        (
            {**LEGACY, "gpu_count": 2, "gpu": {"enabled": True, "count": 2}},
            GpuRequest(count=2, vendor="amd"),
        ),
    ],
)
def test_job_type_accepted(job_type: dict, expected: GpuRequest | None) -> None:
    assert job_type_gpu_request(job_type) == expected


@pytest.mark.parametrize(
    ("job_type", "field", "says"),
    [
        ({"name": "x", "gpu_vendor": "nvidia"}, "gpu_vendor", "gpu.enabled is not true"),
        ({"name": "x", "gpu_enabled": "false", "gpu_vendor": "nvidia"}, "gpu_enabled", "true or"),
        ({**LEGACY, "gpu_device_ids": None}, "gpu_device_ids", "list of up to 16"),
        ({**LEGACY, "gpu": {"enabled": False}}, "gpu_enabled", "disagree"),
        ({**LEGACY, "gpu": SHIPPED}, "gpu_enabled", "disagree"),
        ({**LEGACY, "gpu": {"vendor": "nvidia"}}, "gpu_vendor", "Tako would take gpu_vendor"),
        ({**LEGACY, "gpu_count": 2, "gpu_device_ids": [A]}, "gpu_count", "mutually exclusive"),
        ({"name": "x", "gpu_enabled": True}, "gpu.vendor", "required when gpu_enabled"),
        ({"name": "x", "gpu": {"enabled": True, "gpus": 2}}, "gpu", "unknown key"),
        ({"name": "x", "gpu": "nvidia"}, "gpu", "object"),
        (["gpu"], "job type", "object"),
    ],
)
def test_job_type_rejected(job_type: object, field: str, says: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        job_type_gpu_request(job_type)  # type: ignore[arg-type]
    err = caught.value
    assert err.details["field"] == field
    assert field in err.message
    assert says in err.message
