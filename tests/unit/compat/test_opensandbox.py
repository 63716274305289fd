"""OpenSandbox resourceLimits -> GpuRequest.

Each row names the file of the released opensandbox-server 1.1.1 (under
opensandbox_server/services/, or the request model in api/schema.py) its rule comes from, or
"vmsandbox" where vmsandbox deliberately differs (see vmsandbox/compat/opensandbox.py).
tests/unit/compat/test_compat_platforms.py runs the same kind of maps through the released package
itself.
"""

from __future__ import annotations

import pytest

from vmsandbox.compat.opensandbox import gpu_request
from vmsandbox.errors import InvalidArgument
from vmsandbox.gpu.request import GpuRequest

GPU, NV, AMD = '["gpu"]', '["nvidia.com/gpu"]', '["amd.com/gpu"]'
PARSE = "helpers.py parse_gpu_request"
K8S = "k8s/provider_common.py _translate_resource_limits_for_k8s"
DOCKER = "docker/container_ops.py _resolve_resource_limits"
MODEL = "CreateSandboxRequest: Dict[str, str]"
NVIDIA, AMD_VENDOR = "nvidia", "amd"


@pytest.mark.parametrize(
    ("source", "limits", "expected"),
    [
        (PARSE, None, None),
        (PARSE, {}, None),
        (K8S, {"cpu": "2", "memory": "4Gi"}, None),
        (K8S, {"gpu": "1"}, GpuRequest(count=1, vendor=NVIDIA)),
        (K8S, {"gpu": "4"}, GpuRequest(count=4, vendor=NVIDIA)),
        (PARSE, {"gpu": " 2 "}, GpuRequest(count=2, vendor=NVIDIA)),
        (PARSE, {"gpu": "02"}, GpuRequest(count=2, vendor=NVIDIA)),
        (PARSE, {"gpu": "+2"}, GpuRequest(count=2, vendor=NVIDIA)),
        (PARSE, {"gpu": "1_0"}, GpuRequest(count=10, vendor=NVIDIA)),  # int() reads it so
        (PARSE, {"gpu": "\u0663"}, GpuRequest(count=3, vendor=NVIDIA)),  # an Arabic-Indic 3
        (DOCKER, {"gpu": "all"}, GpuRequest(all=True, vendor=NVIDIA)),
        (DOCKER, {"gpu": "ALL"}, GpuRequest(all=True, vendor=NVIDIA)),
        (DOCKER, {"gpu": " All "}, GpuRequest(all=True, vendor=NVIDIA)),
        (K8S, {"nvidia.com/gpu": "2"}, GpuRequest(count=2, vendor=NVIDIA)),
        (K8S, {"amd.com/gpu": "1"}, GpuRequest(count=1, vendor=AMD_VENDOR)),
        (K8S, {"amd.com/gpu": " 3", "cpu": "8"}, GpuRequest(count=3, vendor=AMD_VENDOR)),
        (K8S, {"gpu": "2", "nvidia.com/gpu": "2"}, GpuRequest(count=2, vendor=NVIDIA)),
    ],
)
def test_accepted(source: str, limits: dict | None, expected: GpuRequest | None) -> None:
    assert gpu_request(limits) == expected, source


@pytest.mark.parametrize(
    ("source", "limits", "field", "says"),
    [
        (DOCKER, {"gpu": ""}, GPU, "answers 400"),
        (DOCKER, {"gpu": "", "nvidia.com/gpu": "2"}, GPU, "answers 400"),
        (MODEL, {"gpu": None}, GPU, "must be a string"),
        (MODEL, {"cpu": 2, "gpu": "1"}, '["cpu"]', "answers 422"),
        (DOCKER, {"gpu": "0"}, GPU, "answers 400"),
        (PARSE, {"gpu": "00"}, GPU, "greater than 0"),
        (PARSE, {"gpu": "-1"}, GPU, "greater than 0"),
        (PARSE, {"gpu": "1.5"}, GPU, "greater than 0"),
        (PARSE, {"gpu": " "}, GPU, "greater than 0"),
        (PARSE, {"gpu": "bad"}, GPU, "greater than 0"),
        (PARSE, {"gpu": "1e3"}, GPU, "greater than 0"),
        (PARSE, {"gpu": "all gpus"}, GPU, "greater than 0"),
        (PARSE, {"gpu": "9" * 5000}, GPU, "greater than 0"),  # past int()'s digit limit
        (MODEL, {"gpu": 1}, GPU, "must be a string"),
        (MODEL, {"gpu": True}, GPU, "must be a string"),
        (MODEL, {"gpu": ["1"]}, GPU, "must be a string"),
        (K8S, {"nvidia.com/gpu": "all"}, NV, "extended resource"),
        (K8S, {"amd.com/gpu": "ALL"}, AMD, "extended resource"),
        ("vmsandbox: a whole number", {"nvidia.com/gpu": "0"}, NV, "greater than 0"),
        ("vmsandbox: a whole number", {"nvidia.com/gpu": "+2"}, NV, "greater than 0"),
        (MODEL, {"nvidia.com/gpu": 2}, NV, "must be a string"),
        (K8S, {"gpu": "1", "nvidia.com/gpu": "2"}, GPU, "writes it over"),
        (K8S, {"gpu": "all", "nvidia.com/gpu": "2"}, GPU, "disagrees"),
        (K8S, {"gpu": "3", "amd.com/gpu": "3"}, GPU, "means NVIDIA GPUs"),
        (K8S, {"nvidia.com/gpu": "1", "amd.com/gpu": "1"}, AMD, "one vendor"),
        (K8S, {"GPU": "1"}, '["GPU"]', "case-sensitive"),
        (K8S, {" gpu": "1"}, '[" gpu"]', "did you mean"),
        (K8S, {"NVIDIA.com/gpu": "1"}, '["NVIDIA.com/gpu"]', "did you mean"),
        ("CreateSandboxRequest", "gpu=1", "resourceLimits", "object"),
        ("CreateSandboxRequest", ["gpu"], "resourceLimits", "object"),
    ],
)
def test_rejected(source: str, limits: object, field: str, says: str) -> None:
    field = field if field == "resourceLimits" else f"resourceLimits{field}"
    with pytest.raises(InvalidArgument) as caught:
        gpu_request(limits)  # type: ignore[arg-type]
    err = caught.value
    assert err.code == "INVALID_ARGUMENT", source
    assert err.details["field"] == field
    assert field in err.message or field == "resourceLimits"
    assert says in err.message
