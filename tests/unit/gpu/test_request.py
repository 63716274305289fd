"""GpuRequest and the GPU request vocabulary (vmsandbox.gpu.request)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vmsandbox.errors import InvalidArgument
from vmsandbox.gpu.request import (
    GpuRequest,
    MiB,
    bytes_to_mib,
    memory_satisfies,
    model_matches,
    normalise_device_id,
    parse_memory_quantity,
)
from vmsandbox.sandbox.spec import SandboxSpec

UUID = "GPU-0a1b2c3d-4e5f-6789-abcd-ef0123456789"
FAST = settings(max_examples=250, deadline=None)


def rejected(call, *args, **kwargs) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as caught:
        call(*args, **kwargs)
    assert caught.value.code == "INVALID_ARGUMENT"
    return caught.value


# --- device ids ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "canonical"),
    [
        ("0000:41:00.0", "0000:41:00.0"),
        ("41:00.0", "0000:41:00.0"),
        ("0000:C1:1F.7", "0000:c1:1f.7"),
        ("  41:00.1 ", "0000:41:00.1"),
        ("pci_0000_41_00_0", "0000:41:00.0"),
        ("PCI_0000_C1_00_0", "0000:c1:00.0"),
        ("00000000:41:00.0", "0000:41:00.0"),  # NVML's eight-digit domain
        ("10000:01:00.0", "10000:01:00.0"),  # a VMD domain stays as it is
        (UUID, UUID),
        (UUID.upper(), UUID),
        (UUID.lower(), UUID),
        ("0", "0"),
        ("3", "3"),
        ("03", "3"),
    ],
)
def test_device_id_spellings(raw: str, canonical: str) -> None:
    assert normalise_device_id(raw) == canonical


@pytest.mark.parametrize(
    "raw",
    [
        "",
        "   ",
        "gpu0",
        "41:00",
        "41:20.0",  # device numbers stop at 1f
        "41:00.8",  # functions stop at 7
        "1:00.0",
        "0000:41:00:0",
        "pci_0000_41_00",
        "GPU-0a1b2c3d",
        "0a1b2c3d-4e5f-6789-abcd-ef0123456789",  # a bare UUID: say which kind it is
        "MIG-0a1b2c3d-4e5f-6789-abcd-ef0123456789",
        "-1",
        "12345",
        "\u0663",  # a non-ASCII digit
        "0,1",
    ],
)
def test_device_id_rejected(raw: str) -> None:
    err = rejected(normalise_device_id, raw, "gpu.devices")
    assert err.details["field"] == "gpu.devices"
    assert repr(raw) in err.message
    assert "PCI address" in err.message


def test_device_id_mig_says_why() -> None:
    err = rejected(normalise_device_id, "MIG-0a1b2c3d-4e5f-6789-abcd-ef0123456789")
    assert "MIG" in err.message and "whole GPU" in err.message


@pytest.mark.parametrize("raw", [None, 3, 1.5, ["41:00.0"], b"41:00.0"])
def test_device_id_not_a_string(raw: object) -> None:
    rejected(normalise_device_id, raw)


@FAST
@given(
    st.integers(0, 0xFFFF),
    st.integers(0, 0xFF),
    st.integers(0, 0x1F),
    st.integers(0, 7),
    st.booleans(),
    st.sampled_from(["colon", "short", "libvirt"]),
)
def test_device_id_any_bdf_spelling_is_canonical(
    domain: int, bus: int, slot: int, function: int, upper: bool, style: str
) -> None:
    canonical = f"{domain:04x}:{bus:02x}:{slot:02x}.{function}"
    spelt = {
        "colon": canonical,
        "short": f"{bus:02x}:{slot:02x}.{function}",
        "libvirt": f"pci_{domain:04x}_{bus:02x}_{slot:02x}_{function}",
    }[style]
    spelt = spelt.upper() if upper else spelt
    expected = canonical if style != "short" else f"0000:{canonical[5:]}"
    assert normalise_device_id(spelt) == expected
    assert normalise_device_id(expected) == expected  # idempotent


@FAST
@given(st.text(max_size=40))
def test_device_id_any_text_is_canonical_or_rejected(raw: str) -> None:
    try:
        canonical = normalise_device_id(raw)
    except InvalidArgument:
        return
    assert normalise_device_id(canonical) == canonical


# --- memory quantities ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "size"),
    [
        ("80G", 80 * 10**9),
        ("80GB", 80 * 10**9),
        ("80Gi", 80 * 2**30),
        ("80GiB", 80 * 2**30),
        (" 80 GiB ", 80 * 2**30),
        ("1k", 1000),
        ("1K", 1000),
        ("1kB", 1000),
        ("1Ki", 1024),
        ("2M", 2 * 10**6),
        ("2Mi", 2 * 2**20),
        ("1T", 10**12),
        ("1Ti", 2**40),
        ("1P", 10**15),
        ("1Pi", 2**50),
        ("1E", 10**18),
        ("1Ei", 2**60),
        ("1.5Gi", 3 * 2**29),
        ("0.5k", 500),
        ("100", 100),
        ("100B", 100),
        (4096, 4096),
        (4096.0, 4096),
    ],
)
def test_memory_quantity_accepted(value: str | int, size: int) -> None:
    assert parse_memory_quantity(value, "memory") == size


@pytest.mark.parametrize(
    "value",
    [
        "",
        "0",
        "0Gi",
        "-1",
        "-80Gi",
        "80m",  # Kubernetes milli, not mega
        "80g",
        "80gb",
        "80Gib",
        "80GiBB",
        "80 G B",
        "1.0001k",  # not a whole number of bytes
        "0.1",
        "1e9",
        "Gi",
        "eighty",
        "1,5Gi",
        "\u0668\u0660Gi",  # Arabic-Indic digits
        0,
        -1,
        1.5,
        math.nan,
        math.inf,
        True,
        None,
        [80],
    ],
)
def test_memory_quantity_rejected(value: object) -> None:
    err = rejected(parse_memory_quantity, value, "--gpu-memory")
    assert err.details["field"] == "--gpu-memory"
    assert "--gpu-memory" in err.message and "'40Gi'" in err.message and "'80GB'" in err.message


def test_memory_quantity_binary_units_and_zero() -> None:
    for text in ("80G", "80GB", "80Gi", "80GiB"):
        assert parse_memory_quantity(text, "m", binary_units=True) == 80 * 2**30
    assert parse_memory_quantity("0", "m", allow_zero=True) == 0
    assert parse_memory_quantity(0.0, "m", allow_zero=True) == 0
    err = rejected(parse_memory_quantity, "80x", "m", binary_units=True)
    assert "binary" in err.message


@FAST
@given(
    st.integers(1, 10**6),
    st.sampled_from(["", "k", "K", "M", "G", "T", "P", "E"]),
    st.booleans(),
    st.booleans(),
)
def test_memory_quantity_units(number: int, prefix: str, binary: bool, suffix_b: bool) -> None:
    index = {"": 0, "k": 1, "K": 1, "M": 2, "G": 3, "T": 4, "P": 5, "E": 6}[prefix]
    unit = prefix + ("i" if binary and prefix else "") + ("B" if suffix_b else "")
    base = 1024 if binary and prefix else 1000
    assert parse_memory_quantity(f"{number}{unit}", "m") == number * base**index


@FAST
@given(
    st.one_of(
        st.text(max_size=30),
        st.integers(),
        st.floats(allow_nan=True, allow_infinity=True),
        st.none(),
        st.booleans(),
    )
)
def test_memory_quantity_never_raises_anything_else(value: object) -> None:
    try:
        size = parse_memory_quantity(value, "m")
    except InvalidArgument:
        return
    assert isinstance(size, int) and not isinstance(size, bool) and size > 0


def test_bytes_to_mib_rounds_up() -> None:
    assert bytes_to_mib(MiB) == 1
    assert bytes_to_mib(MiB + 1) == 2
    assert bytes_to_mib(1) == 1
    assert bytes_to_mib(80 * 10**9) == 76294
    assert bytes_to_mib(80 * 2**30) == 81920


# --- memory and model matching -----------------------------------------------------------

H100_MIB = 81559  # nvidia-smi on an H100 80GB HBM3
A100_40_MIB = 40960


def mib(text: str) -> int:
    return bytes_to_mib(parse_memory_quantity(text, "memory"))


@pytest.mark.parametrize(
    ("required", "device_mib", "ok"),
    [
        ("80GiB", H100_MIB, True),
        ("80GB", H100_MIB, True),
        ("80Gi", 81920, True),
        ("81Gi", H100_MIB, False),
        ("80GB", A100_40_MIB, False),
        ("48GiB", A100_40_MIB, False),
        ("40GB", A100_40_MIB, True),
        ("40Gi", A100_40_MIB, True),
        ("24Gi", 24564, True),  # an RTX 4090
        ("48Gi", 46068, False),  # an L40S is 48 GB, not 48 GiB
        ("48GB", 46068, True),
    ],
)
def test_memory_satisfies(required: str, device_mib: int, ok: bool) -> None:
    assert memory_satisfies(mib(required), device_mib) is ok


@FAST
@given(st.integers(1, 2**20), st.integers(0, 2**20))
def test_memory_satisfies_tolerance_bounds(required: int, device: int) -> None:
    result = memory_satisfies(required, device)
    if device >= required:
        assert result
    if device < required * 0.98:
        assert not result


@pytest.mark.parametrize(
    ("model", "name", "ok"),
    [
        ("H100", "NVIDIA H100 80GB HBM3", True),
        ("h100", "NVIDIA H100 80GB HBM3", True),
        ("h100 80gb", "NVIDIA H100 80GB HBM3", True),
        ("H100-80GB", "NVIDIA H100 80GB HBM3", True),
        ("80GB H100", "NVIDIA H100 80GB HBM3", False),  # words in order
        ("A100-SXM4-80GB", "NVIDIA A100-SXM4-80GB", True),
        ("a100 sxm4", "NVIDIA A100-SXM4-80GB", True),
        ("A100", "NVIDIA A100-SXM4-80GB", True),
        ("A10", "NVIDIA A100-SXM4-80GB", False),
        ("A10", "NVIDIA A100", False),
        ("A10", "NVIDIA A10G", False),
        ("A10", "NVIDIA A10", True),
        ("A10G", "NVIDIA A10G", True),
        ("H10", "NVIDIA H100", False),
        ("MI300X", "AMD Instinct MI300X", True),
        ("instinct_mi300x", "AMD Instinct MI300X", True),
        ("NVIDIA", "NVIDIA H100", True),
        ("AMD", "NVIDIA H100", False),
        ("---", "NVIDIA H100", False),
        ("H100", "", False),
    ],
)
def test_model_matches(model: str, name: str, ok: bool) -> None:
    assert model_matches(model, name) is ok


@FAST
@given(st.text(max_size=30), st.text(max_size=30), st.text(max_size=30))
def test_model_matches_itself_inside_a_name(prefix: str, model: str, suffix: str) -> None:
    if not any(ch.isalnum() for ch in model):
        return
    assert model_matches(model, f"{prefix} {model} {suffix}")
    assert model_matches(model.upper(), model.lower()) == model_matches(model, model.casefold())


# --- GpuRequest -----------------------------------------------------------------------------


def test_gpu_request_defaults_to_one_gpu() -> None:
    request = GpuRequest()
    assert request.count is None and request.wanted() == 1


@pytest.mark.parametrize(
    ("kwargs", "wanted"),
    [
        ({"count": 3}, 3),
        ({"devices": ("41:00.0", UUID, "2")}, 3),
        ({"devices": ["41:00.0"], "count": 1}, 1),
        ({"all": True}, None),
        ({"all": True, "vendor": "amd"}, None),
        ({"vendor": " NVIDIA ", "model": " H100 ", "min_memory_mib": 81920}, 1),
    ],
)
def test_gpu_request_wanted(kwargs: dict, wanted: int | None) -> None:
    assert GpuRequest(**kwargs).wanted() == wanted


def test_gpu_request_normalises() -> None:
    request = GpuRequest(
        devices=["pci_0000_41_00_0", UUID.upper(), "07"], vendor=" NVIDIA ", model=" H100 "
    )
    assert request.devices == ("0000:41:00.0", UUID, "7")
    assert request.vendor == "nvidia"
    assert request.model == "H100"
    assert request == GpuRequest(devices=("0000:41:00.0", UUID, "7"), vendor="nvidia", model="H100")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"count": 0}, "count"),
        ({"count": -1}, "count"),
        ({"count": True}, "count"),
        ({"count": 1.0}, "count"),
        ({"count": "2"}, "count"),
        ({"devices": "41:00.0"}, "devices"),
        ({"devices": ("41:00.0", "0000:41:00.0")}, "devices"),
        ({"devices": ("bogus",)}, "devices"),
        ({"devices": (3,)}, "devices"),
        ({"all": 1}, "all"),
        ({"all": True, "count": 2}, "count"),
        ({"all": True, "devices": ("41:00.0",)}, "devices"),
        ({"count": 2, "devices": ("41:00.0",)}, "count"),
        ({"vendor": "intel"}, "vendor"),
        ({"vendor": ""}, "vendor"),
        ({"vendor": 1}, "vendor"),
        ({"model": ""}, "model"),
        ({"model": "  "}, "model"),
        ({"model": "--"}, "model"),
        ({"model": 100}, "model"),
        ({"min_memory_mib": 0}, "min_memory_mib"),
        ({"min_memory_mib": True}, "min_memory_mib"),
        ({"min_memory_mib": 1.5}, "min_memory_mib"),
    ],
)
def test_gpu_request_rejected(kwargs: dict, field: str) -> None:
    err = rejected(GpuRequest, **kwargs)
    assert err.details["field"] == field
    assert field in err.message


def test_gpu_request_is_frozen_and_fits_a_sandbox_spec() -> None:
    request = GpuRequest(count=2)
    with pytest.raises(AttributeError):
        request.count = 3  # type: ignore[misc]
    assert SandboxSpec(gpu=request).gpu == request
