"""FlowMesh resources.hardware.gpu -> GpuRequest.

Each row names the mlsys-io/FlowMesh file its rule comes from (parsing.py at 202106ee,
hardware.py and tests/shared/utils/test_hardware.py at 6f1ac4c2, the SSH session config and
tests/shared/test_spec_uses_gpu.py at 45e7d540), or "vmsandbox" where vmsandbox deliberately
differs (see vmsandbox/compat/flowmesh.py).
"""

from __future__ import annotations

import pytest

from vmsandbox.compat.flowmesh import gpu_request
from vmsandbox.errors import InvalidArgument
from vmsandbox.gpu.request import GpuRequest

GIB_80 = 80 * 1024  # MiB
PARSE = "src/shared/utils/parsing.py parse_mem_to_bytes"
HW = "src/shared/utils/hardware.py"
HW_TEST = "tests/shared/utils/test_hardware.py TestParseGpuMemoryBytes"
RESOLVE = "src/worker/executors/ssh_session/config.py _resolve_gpu_devices"
USES_GPU = "tests/shared/test_spec_uses_gpu.py TestSSH"
MODEL = "src/shared/tasks/components/resources.py GPURequirements"


@pytest.mark.parametrize(
    ("source", "block", "expected"),
    [
        (USES_GPU, None, None),
        (RESOLVE, {}, GpuRequest(all=True)),
        (RESOLVE, {"count": None, "type": None, "memory": None}, GpuRequest(all=True)),
        (RESOLVE, {"type": "", "memory": ""}, GpuRequest(all=True)),
        (RESOLVE, {"memory": 0}, GpuRequest(all=True)),
        (RESOLVE, {"memory": 0.0}, GpuRequest(all=True)),
        (RESOLVE, {"count": 0}, None),
        (RESOLVE, {"count": 0, "type": "H100", "memory": "80G"}, None),
        (RESOLVE, {"count": 0, "memory": "1.5Gi"}, None),  # the worker reads no further
        (USES_GPU, {"count": 1}, GpuRequest(count=1)),
        (RESOLVE, {"count": 3}, GpuRequest(count=3)),
        (RESOLVE, {"type": "H100"}, GpuRequest(model="H100")),
        (HW, {"type": " A10 "}, GpuRequest(model="A10")),
        (HW, {"type": "A100-SXM4-80GB", "count": 2}, GpuRequest(count=2, model="A100-SXM4-80GB")),
        (HW, {"type": "any"}, GpuRequest()),
        (HW, {"type": "ANY"}, GpuRequest()),
        (HW, {"type": "auto"}, GpuRequest()),
        (HW, {"type": " * "}, GpuRequest()),
        (HW, {"type": "   "}, GpuRequest()),
        (HW_TEST, {"memory": "40Gi"}, GpuRequest(min_memory_mib=40 * 1024)),
        (HW_TEST, {"memory": "512Mi"}, GpuRequest(min_memory_mib=512)),
        (HW_TEST, {"memory": "80GB"}, GpuRequest(min_memory_mib=GIB_80)),
        (PARSE, {"memory": "80G"}, GpuRequest(min_memory_mib=GIB_80)),
        (PARSE, {"memory": "80GiB"}, GpuRequest(min_memory_mib=GIB_80)),
        (PARSE, {"memory": "80 gib"}, GpuRequest(min_memory_mib=GIB_80)),
        (PARSE, {"memory": "80gb"}, GpuRequest(min_memory_mib=GIB_80)),
        (PARSE, {"memory": "80g"}, GpuRequest(min_memory_mib=GIB_80)),
        (PARSE, {"memory": "512mi"}, GpuRequest(min_memory_mib=512)),
        (PARSE, {"memory": " 1 t "}, GpuRequest(min_memory_mib=1024 * 1024)),
        (PARSE, {"memory": "1kB"}, GpuRequest(min_memory_mib=1)),  # rounded up to whole MiB
        (PARSE, {"memory": "80"}, GpuRequest(min_memory_mib=1)),  # no unit: bytes
        (PARSE, {"memory": "0"}, GpuRequest()),  # a constraint of 0 bytes: one GPU, any size
        (PARSE, {"memory": "0Gi"}, GpuRequest()),
        (HW_TEST, {"memory": 85899345920}, GpuRequest(min_memory_mib=GIB_80)),
        (HW_TEST, {"memory": 85899345920.0}, GpuRequest(min_memory_mib=GIB_80)),
        (HW_TEST, {"memory": 1048576}, GpuRequest(min_memory_mib=1)),
        (
            RESOLVE,
            {"count": 2, "type": "H100", "memory": "80G"},
            GpuRequest(count=2, model="H100", min_memory_mib=GIB_80),
        ),
    ],
)
def test_accepted(source: str, block: dict | None, expected: GpuRequest | None) -> None:
    assert gpu_request(block) == expected, source


MEMORY = "resources.hardware.gpu.memory"


@pytest.mark.parametrize(
    ("source", "block", "field", "says"),
    [
        (RESOLVE, {"count": -1}, "resources.hardware.gpu.count", "greater than 0"),
        (MODEL, {"count": 1.5}, "resources.hardware.gpu.count", "whole number"),
        ("vmsandbox", {"count": 1.0}, "resources.hardware.gpu.count", "whole number"),
        ("vmsandbox", {"count": "2"}, "resources.hardware.gpu.count", "whole number"),
        ("vmsandbox", {"count": True}, "resources.hardware.gpu.count", "whole number"),
        ("vmsandbox", {"count": False}, "resources.hardware.gpu.count", "whole number"),
        (MODEL, {"count": 0, "type": 7}, "resources.hardware.gpu.type", "string"),
        (MODEL, {"type": 100}, "resources.hardware.gpu.type", "string"),
        ("vmsandbox", {"type": "--"}, "resources.hardware.gpu.type", "not a GPU model"),
        (MODEL, {"type": ["H100"]}, "resources.hardware.gpu.type", "string"),
        (PARSE, {"memory": "1.5Gi"}, MEMORY, "'40Gi'"),
        (PARSE, {"memory": "1.5G"}, MEMORY, "'80GB'"),
        (PARSE, {"memory": "80B"}, MEMORY, "whole number and a unit K, M, G or T"),
        (PARSE, {"memory": "1Pi"}, MEMORY, "'40Gi'"),
        (PARSE, {"memory": "80 bytes"}, MEMORY, "'40Gi'"),
        (PARSE, {"memory": "lots"}, MEMORY, "'40Gi'"),
        (PARSE, {"memory": "-1G"}, MEMORY, "'80GB'"),
        (PARSE, {"memory": "0.3"}, MEMORY, "'40Gi'"),
        (PARSE, {"memory": "  "}, MEMORY, "'40Gi'"),
        (PARSE, {"memory": "80\u212a"}, MEMORY, "'40Gi'"),  # the Kelvin sign is no k
        (PARSE, {"memory": "\u0668\u0660G"}, MEMORY, "'40Gi'"),  # nor are non-ASCII digits
        (HW, {"memory": -1}, MEMORY, "ignore a negative size"),
        (HW, {"memory": 1.5}, MEMORY, "truncate a fraction"),
        (HW, {"memory": float("nan")}, MEMORY, "'40Gi'"),
        (HW, {"memory": float("inf")}, MEMORY, "'40Gi'"),
        (MODEL, {"memory": True}, MEMORY, "'40Gi'"),
        (MODEL, {"memory": ["80G"]}, MEMORY, "'40Gi'"),
        (MODEL, {"gpus": 1}, "resources.hardware.gpu", "unknown key"),
        (MODEL, {"count": 1, "vendor": "nvidia"}, "resources.hardware.gpu", "unknown key"),
        (MODEL, True, "resources.hardware.gpu", "object"),
        (MODEL, 1, "resources.hardware.gpu", "object"),
        (MODEL, "H100", "resources.hardware.gpu", "object"),
    ],
)
def test_rejected(source: str, block: object, field: str, says: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        gpu_request(block)  # type: ignore[arg-type]
    err = caught.value
    assert err.code == "INVALID_ARGUMENT", source
    assert err.details["field"] == field
    assert field in err.message
    assert says in err.message
