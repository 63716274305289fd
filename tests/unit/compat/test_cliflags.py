"""CLI --gpu* flags -> GpuRequest.

``--gpu [COUNT]`` follows NVIDIA/OpenShell main (2f7fb655) crates/openshell-cli/src/main.rs
``parse_gpu_request``; ``--gpu-count`` and ``--gpu-device`` are the earlier spec's aliases.
"""

from __future__ import annotations

import argparse

import pytest

from vmsandbox.compat.cliflags import gpu_request_from_flags, parse_gpu_flag_value
from vmsandbox.errors import InvalidArgument
from vmsandbox.gpu.request import GpuRequest

A, B = "0000:41:00.0", "0000:c1:00.0"


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ({}, None),
        ({"gpu": 1}, GpuRequest(count=1)),
        ({"gpu": 3}, GpuRequest(count=3)),
        ({"gpu_count": 2}, GpuRequest(count=2)),
        ({"gpu": 2, "gpu_count": 2}, GpuRequest(count=2)),
        ({"gpu_devices": ["41:00.0", "pci_0000_c1_00_0"]}, GpuRequest(devices=(A, B))),
        (
            {"gpu_devices": ["GPU-3F5A9C0E71B2D486", "card1"], "gpu_vendor": "amd"},
            GpuRequest(devices=("GPU-3f5a9c0e71b2d486", "card1"), vendor="amd"),
        ),
        ({"gpu": 1, "gpu_devices": [A]}, GpuRequest(count=1, devices=(A,))),
        ({"gpu_count": 2, "gpu_devices": [A, B]}, GpuRequest(count=2, devices=(A, B))),
        ({"gpu_all": True}, GpuRequest(all=True)),
        (
            {"gpu_all": True, "gpu_vendor": "AMD", "gpu_model": "MI300X"},
            GpuRequest(all=True, vendor="amd", model="MI300X"),
        ),
        ({"gpu_vendor": "nvidia"}, GpuRequest(vendor="nvidia")),  # filters alone: one GPU
        ({"gpu_model": "H100"}, GpuRequest(model="H100")),
        ({"gpu_memory": "80GB"}, GpuRequest(min_memory_mib=76294)),
        (
            {"gpu": 2, "gpu_model": "h100", "gpu_memory": "80Gi"},
            GpuRequest(count=2, model="h100", min_memory_mib=81920),
        ),
    ],
)
def test_accepted(flags: dict, expected: GpuRequest | None) -> None:
    assert gpu_request_from_flags(**flags) == expected


@pytest.mark.parametrize(
    ("flags", "field", "says"),
    [
        ({"gpu": 0}, "--gpu", "greater than 0"),
        ({"gpu_count": 0}, "--gpu-count", "greater than 0"),
        ({"gpu_count": -2}, "--gpu-count", "greater than 0"),
        ({"gpu": 2, "gpu_count": 3}, "--gpu-count", "different numbers"),
        ({"gpu": 1, "gpu_count": 3}, "--gpu-count", "different numbers"),
        ({"gpu_all": True, "gpu": 1}, "--gpu", "--gpu-all"),
        ({"gpu_all": True, "gpu_count": 2}, "--gpu-count", "--gpu-all"),
        ({"gpu_all": True, "gpu_devices": [A]}, "--gpu-device", "--gpu-all"),
        ({"gpu": 1, "gpu_devices": [A, B]}, "--gpu", "does not match the 2 device(s)"),
        ({"gpu_count": 3, "gpu_devices": [A, B]}, "--gpu-count", "does not match"),
        ({"gpu_devices": ["bogus"]}, "--gpu-device", "not a device id"),
        ({"gpu_devices": ["0,1"]}, "--gpu-device", "not a device id"),
        ({"gpu_devices": [A, "41:00.0"]}, "--gpu-device", "twice"),
        ({"gpu_vendor": "intel"}, "--gpu-vendor", "nvidia or amd"),
        ({"gpu_model": " "}, "--gpu-model", "not a GPU model"),
        ({"gpu_memory": "80g"}, "--gpu-memory", "'40Gi'"),
        ({"gpu_memory": "0"}, "--gpu-memory", "greater than 0"),
        ({"gpu": 1, "gpu_memory": "lots"}, "--gpu-memory", "'80GB'"),
    ],
)
def test_rejected(flags: dict, field: str, says: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        gpu_request_from_flags(**flags)
    err = caught.value
    assert err.code == "INVALID_ARGUMENT"
    assert err.details["field"] == field
    assert field in err.message
    assert says in err.message


# parse_gpu_request: u32::from_str, then "GPU count must be greater than 0"
@pytest.mark.parametrize(
    ("text", "count"),
    [("1", 1), ("8", 8), ("02", 2), ("+2", 2), ("4294967295", 2**32 - 1), ("0" * 20 + "3", 3)],
)
def test_parse_gpu_flag_value(text: str, count: int) -> None:
    assert parse_gpu_flag_value(text) == count


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("0", "greater than 0"),
        ("-1", "positive integer"),
        ("4294967296", "positive integer"),
        (" 2 ", "positive integer"),
        ("1_0", "positive integer"),
        ("1.5", "positive integer"),
        ("", "positive integer"),
        ("two", "positive integer"),
        ("\u0663", "positive integer"),
        ("all", "positive integer"),
        ("9" * 5000, "positive integer"),
    ],
)
def test_parse_gpu_flag_value_rejected(text: str, says: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        parse_gpu_flag_value(text)
    assert caught.value.details["field"] == "--gpu"
    assert says in caught.value.message and "--gpu" in caught.value.message


def test_argparse_wiring() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpu", nargs="?", const=1, type=parse_gpu_flag_value)
    parser.add_argument("--gpu-count", type=int)
    parser.add_argument("--gpu-device", dest="gpu_devices", action="append", default=[])
    parser.add_argument("--gpu-all", action="store_true")
    for flag in ("--gpu-vendor", "--gpu-model", "--gpu-memory"):
        parser.add_argument(flag)

    def request(argv: list[str]) -> GpuRequest | None:
        return gpu_request_from_flags(**vars(parser.parse_args(argv)))

    assert request([]) is None
    assert request(["--gpu"]) == GpuRequest(count=1)
    assert request(["--gpu", "4"]) == GpuRequest(count=4)
    assert request(["--gpu-device", A, "--gpu-device", B]) == GpuRequest(devices=(A, B))
    assert request(["--gpu-all", "--gpu-vendor", "amd"]) == GpuRequest(all=True, vendor="amd")
    with pytest.raises(InvalidArgument):
        request(["--gpu", "--gpu-device", A, "--gpu-device", B])
