"""FlowMesh resources.hardware.gpu -> GpuRequest."""

from __future__ import annotations

import pytest

from vmsandbox.compat.flowmesh import gpu_request
from vmsandbox.errors import InvalidArgument
from vmsandbox.spec import GpuRequest

GIB_80 = 80 * 1024  # MiB


@pytest.mark.parametrize(
    ("block", "expected"),
    [
        (None, None),
        ({}, GpuRequest()),
        ({"count": None, "type": None, "memory": None}, GpuRequest()),
        ({"count": 0}, None),
        ({"count": 0, "type": "H100", "memory": "80G"}, None),
        ({"count": 1}, GpuRequest(count=1)),
        ({"count": 3}, GpuRequest(count=3)),
        ({"type": "H100"}, GpuRequest(model="H100")),
        ({"type": " A10 "}, GpuRequest(model="A10")),
        ({"type": "A100-SXM4-80GB", "count": 2}, GpuRequest(count=2, model="A100-SXM4-80GB")),
        ({"type": ""}, GpuRequest()),
        ({"type": "any"}, GpuRequest()),
        ({"type": "ANY"}, GpuRequest()),
        ({"type": "auto"}, GpuRequest()),
        ({"type": " * "}, GpuRequest()),
        ({"memory": "80G"}, GpuRequest(min_memory_mib=GIB_80)),
        ({"memory": "80GB"}, GpuRequest(min_memory_mib=GIB_80)),
        ({"memory": "80Gi"}, GpuRequest(min_memory_mib=GIB_80)),
        ({"memory": "80GiB"}, GpuRequest(min_memory_mib=GIB_80)),
        ({"memory": "512M"}, GpuRequest(min_memory_mib=512)),
        ({"memory": "1.5G"}, GpuRequest(min_memory_mib=1536)),
        ({"memory": 85899345920}, GpuRequest(min_memory_mib=GIB_80)),
        ({"memory": 85899345920.0}, GpuRequest(min_memory_mib=GIB_80)),
        ({"memory": 1}, GpuRequest(min_memory_mib=1)),  # rounded up to whole MiB
        ({"memory": "80"}, GpuRequest(min_memory_mib=1)),  # a plain number is bytes
        ({"memory": 0}, GpuRequest()),
        ({"memory": 0.0}, GpuRequest()),
        ({"memory": "0"}, GpuRequest()),
        ({"memory": "0Gi"}, GpuRequest()),
        (
            {"count": 2, "type": "H100", "memory": "80G"},
            GpuRequest(count=2, model="H100", min_memory_mib=GIB_80),
        ),
    ],
)
def test_accepted(block: dict | None, expected: GpuRequest | None) -> None:
    assert gpu_request(block) == expected


@pytest.mark.parametrize(
    ("block", "field", "says"),
    [
        ({"count": -1}, "resources.hardware.gpu.count", "greater than 0"),
        ({"count": 1.5}, "resources.hardware.gpu.count", "whole number"),
        ({"count": 1.0}, "resources.hardware.gpu.count", "whole number"),
        ({"count": "2"}, "resources.hardware.gpu.count", "whole number"),
        ({"count": True}, "resources.hardware.gpu.count", "whole number"),
        ({"count": False}, "resources.hardware.gpu.count", "whole number"),
        ({"count": 0, "type": 7}, "resources.hardware.gpu.type", "string"),
        ({"type": 100}, "resources.hardware.gpu.type", "string"),
        ({"type": "--"}, "resources.hardware.gpu.type", "not a GPU model"),
        ({"type": ["H100"]}, "resources.hardware.gpu.type", "string"),
        ({"memory": "80 bytes"}, "resources.hardware.gpu.memory", "'40Gi'"),
        ({"memory": "lots"}, "resources.hardware.gpu.memory", "'40Gi'"),
        ({"memory": "-1G"}, "resources.hardware.gpu.memory", "'80GB'"),
        ({"memory": -1}, "resources.hardware.gpu.memory", "'40Gi'"),
        ({"memory": 1.5}, "resources.hardware.gpu.memory", "'40Gi'"),
        ({"memory": float("nan")}, "resources.hardware.gpu.memory", "'40Gi'"),
        ({"memory": float("inf")}, "resources.hardware.gpu.memory", "'40Gi'"),
        ({"memory": "80g"}, "resources.hardware.gpu.memory", "binary"),
        ({"memory": True}, "resources.hardware.gpu.memory", "'40Gi'"),
        ({"memory": ["80G"]}, "resources.hardware.gpu.memory", "'40Gi'"),
        ({"memory": "0.3"}, "resources.hardware.gpu.memory", "whole number of bytes"),
        ({"gpus": 1}, "resources.hardware.gpu", "unknown key"),
        ({"count": 1, "vendor": "nvidia"}, "resources.hardware.gpu", "unknown key"),
        (True, "resources.hardware.gpu", "object"),
        (1, "resources.hardware.gpu", "object"),
        ("H100", "resources.hardware.gpu", "object"),
    ],
)
def test_rejected(block: object, field: str, says: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        gpu_request(block)  # type: ignore[arg-type]
    err = caught.value
    assert err.code == "INVALID_ARGUMENT"
    assert err.details["field"] == field
    assert field in err.message
    assert says in err.message
