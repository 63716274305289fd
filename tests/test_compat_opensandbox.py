"""OpenSandbox resourceLimits -> GpuRequest."""

from __future__ import annotations

import pytest

from vmsandbox.compat.opensandbox import gpu_request
from vmsandbox.errors import InvalidArgument
from vmsandbox.spec import GpuRequest

GPU, NV, AMD = '["gpu"]', '["nvidia.com/gpu"]', '["amd.com/gpu"]'


@pytest.mark.parametrize(
    ("limits", "expected"),
    [
        (None, None),
        ({}, None),
        ({"cpu": "2", "memory": "4Gi"}, None),
        ({"gpu": "1"}, GpuRequest(count=1)),
        ({"gpu": "4"}, GpuRequest(count=4)),
        ({"gpu": " 2 "}, GpuRequest(count=2)),
        ({"gpu": "02"}, GpuRequest(count=2)),
        ({"gpu": "all"}, GpuRequest(all=True)),
        ({"gpu": "ALL"}, GpuRequest(all=True)),
        ({"gpu": " All "}, GpuRequest(all=True)),
        ({"nvidia.com/gpu": "2"}, GpuRequest(count=2, vendor="nvidia")),
        ({"amd.com/gpu": "1"}, GpuRequest(count=1, vendor="amd")),
        ({"gpu": "2", "nvidia.com/gpu": "2"}, GpuRequest(count=2, vendor="nvidia")),
        ({"gpu": "3", "amd.com/gpu": " 3", "cpu": "8"}, GpuRequest(count=3, vendor="amd")),
        ({"cpu": 2, "gpu": "1"}, GpuRequest(count=1)),  # other keys are not ours
    ],
)
def test_accepted(limits: dict | None, expected: GpuRequest | None) -> None:
    assert gpu_request(limits) == expected


@pytest.mark.parametrize(
    ("limits", "field", "says"),
    [
        ({"gpu": "0"}, GPU, "greater than 0"),
        ({"gpu": "00"}, GPU, "greater than 0"),
        ({"gpu": "-1"}, GPU, "greater than 0"),
        ({"gpu": "1.5"}, GPU, "greater than 0"),
        ({"gpu": "+2"}, GPU, "greater than 0"),
        ({"gpu": "1_0"}, GPU, "greater than 0"),
        ({"gpu": ""}, GPU, "greater than 0"),
        ({"gpu": " "}, GPU, "greater than 0"),
        ({"gpu": "bad"}, GPU, "greater than 0"),
        ({"gpu": "\u0663"}, GPU, "greater than 0"),  # an Arabic-Indic digit
        ({"gpu": "\uff11"}, GPU, "greater than 0"),  # a fullwidth digit
        ({"gpu": "1e3"}, GPU, "greater than 0"),
        ({"gpu": "all gpus"}, GPU, "greater than 0"),
        ({"gpu": 1}, GPU, "greater than 0"),
        ({"gpu": True}, GPU, "greater than 0"),
        ({"gpu": None}, GPU, "greater than 0"),
        ({"gpu": ["1"]}, GPU, "greater than 0"),
        ({"nvidia.com/gpu": "all"}, NV, "extended resource"),
        ({"amd.com/gpu": "ALL"}, AMD, "extended resource"),
        ({"nvidia.com/gpu": "0"}, NV, "greater than 0"),
        ({"nvidia.com/gpu": 2}, NV, "greater than 0"),
        ({"gpu": "1", "nvidia.com/gpu": "2"}, GPU, "disagrees"),
        ({"gpu": "all", "nvidia.com/gpu": "2"}, GPU, "disagrees"),
        ({"nvidia.com/gpu": "1", "amd.com/gpu": "1"}, AMD, "one vendor"),
        ({"GPU": "1"}, '["GPU"]', "case-sensitive"),
        ({" gpu": "1"}, '[" gpu"]', "did you mean"),
        ({"NVIDIA.com/gpu": "1"}, '["NVIDIA.com/gpu"]', "did you mean"),
        ("gpu=1", "resourceLimits", "object"),
        (["gpu"], "resourceLimits", "object"),
    ],
)
def test_rejected(limits: object, field: str, says: str) -> None:
    field = field if field == "resourceLimits" else f"resourceLimits{field}"
    with pytest.raises(InvalidArgument) as caught:
        gpu_request(limits)  # type: ignore[arg-type]
    err = caught.value
    assert err.code == "INVALID_ARGUMENT"
    assert err.details["field"] == field
    assert field in err.message or field == "resourceLimits"
    assert says in err.message
