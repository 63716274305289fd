"""Property tests: any JSON-like input gives a GpuRequest, None or InvalidArgument, nothing else."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

from hypothesis import event, given, settings
from hypothesis import strategies as st

from vmsandbox.compat import flowmesh, opensandbox, openshell, tako
from vmsandbox.compat.cliflags import gpu_request_from_flags, parse_gpu_flag_value
from vmsandbox.errors import InvalidArgument
from vmsandbox.gpu.request import GpuRequest

FUZZ = settings(max_examples=250, deadline=None)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.text(max_size=8), inner, max_size=4),
    ),
    max_leaves=12,
)
# Shaped inputs: the platform's keys, each holding a plausible value three times in four and
# anything at all otherwise, so both the accepting paths and the deeper checks get exercised.
device_ids = st.sampled_from(
    [
        "41:00.0",
        "0000:41:00.0",
        "pci_0000_c1_00_0",
        "GPU-0A1B2C3D-4E5F-6789-ABCD-EF0123456789",
        "GPU-3f5a9c0e71b2d486",  # ROCm
        "card1",
        "3",
    ]
)
id_lists = st.lists(device_ids, min_size=1, max_size=3)


def mostly(good: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(good, good, good, json_values)


def optional_keys(**fields: st.SearchStrategy) -> st.SearchStrategy[dict]:
    """Dicts holding any subset of ``fields``; now and then an extra, unknown key."""
    extra = st.dictionaries(st.text(max_size=6), json_values, min_size=1, max_size=1)
    return st.fixed_dictionaries({}, optional=fields).flatmap(
        lambda d: st.one_of(st.just(d), st.just(d), st.just(d), extra.map(d.__or__))
    )


openshell_specs = optional_keys(
    gpu=mostly(st.booleans()),
    gpu_device=mostly(device_ids),
    resource_requirements=mostly(
        optional_keys(
            gpu=mostly(optional_keys(count=mostly(st.one_of(st.integers(0, 4), st.just("2")))))
        )
    ),
    template=mostly(
        optional_keys(
            driver_config=mostly(
                optional_keys(vm=mostly(optional_keys(gpu_device_ids=mostly(id_lists))))
            )
        )
    ),
)
limit_values = mostly(st.sampled_from(["1", " 2 ", "+4", "", "all", "ALL", "0", "1_0"]))
opensandbox_limits = optional_keys(
    **{"gpu": limit_values, "nvidia.com/gpu": limit_values, "amd.com/gpu": limit_values}
)
flowmesh_blocks = optional_keys(
    count=mostly(st.integers(0, 4)),
    type=mostly(st.sampled_from(["H100", "a100-sxm4-80gb", "any", "", "*"])),
    memory=mostly(
        st.sampled_from(["80Gi", "80 gib", "512mi", "1.5Gi", "80B", "1Pi", "", "0", 0, 2.0**34])
    ),
)
tako_fields = {
    "count": mostly(st.integers(0, 17)),
    "device_ids": mostly(st.one_of(id_lists, st.just([]))),
}
tako_blocks = st.one_of(
    optional_keys(
        enabled=mostly(st.booleans()),
        vendor=mostly(st.sampled_from(["nvidia", " AMD ", "intel"])),
        **tako_fields,
    ),
    st.fixed_dictionaries(
        {"enabled": st.just(True), "vendor": st.sampled_from(["nvidia", " AMD "])},
        optional=tako_fields,
    ),
)


def mostly_none(good: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(st.none(), st.none(), good, st.text(max_size=8))


def check(adapter: Callable[[object], GpuRequest | None], value: object) -> None:
    try:
        result = adapter(value)
    except InvalidArgument as err:
        event("rejected")
        assert err.code == "INVALID_ARGUMENT"
        assert isinstance(err.details["field"], str) and err.details["field"] in err.message
        assert isinstance(err.details["value"], str)
        return
    event("no GPU" if result is None else "GpuRequest")
    assert result is None or isinstance(result, GpuRequest)
    if result is not None:  # already canonical: building it again changes nothing
        assert GpuRequest(**dataclasses.asdict(result)) == result


@FUZZ
@given(st.one_of(openshell_specs, openshell_specs, json_values))
def test_openshell_fuzz(spec: object) -> None:
    check(openshell.gpu_request, spec)


@FUZZ
@given(st.one_of(opensandbox_limits, opensandbox_limits, json_values))
def test_opensandbox_fuzz(limits: object) -> None:
    check(opensandbox.gpu_request, limits)


@FUZZ
@given(st.one_of(flowmesh_blocks, flowmesh_blocks, json_values))
def test_flowmesh_fuzz(block: object) -> None:
    check(flowmesh.gpu_request, block)


@FUZZ
@given(st.one_of(tako_blocks, tako_blocks, json_values))
def test_tako_fuzz(block: object) -> None:
    check(tako.gpu_request, block)


legacy_tako_jobs = st.fixed_dictionaries(
    {"name": st.just("job")},
    optional={
        "gpu": tako_blocks,
        "gpu_enabled": mostly(st.booleans()),
        "gpu_vendor": mostly(st.sampled_from(["nvidia", "amd"])),
        "gpu_count": mostly(st.integers(0, 3)),
        "gpu_device_ids": mostly(st.one_of(id_lists, st.just([]))),
    },
)


@FUZZ
@given(st.one_of(legacy_tako_jobs, legacy_tako_jobs, json_values))
def test_tako_job_type_fuzz(job_type: object) -> None:
    check(tako.job_type_gpu_request, job_type)


@FUZZ
@given(
    gpu=st.one_of(st.none(), st.none(), st.integers(-1, 4)),
    gpu_count=st.one_of(st.none(), st.none(), st.integers(-1, 4)),
    gpu_devices=st.lists(st.one_of(device_ids, device_ids, st.text(max_size=12)), max_size=3),
    gpu_all=st.booleans(),
    gpu_vendor=mostly_none(st.sampled_from(["nvidia", "AMD"])),
    gpu_model=mostly_none(st.sampled_from(["H100", "a100 80gb"])),
    gpu_memory=mostly_none(st.sampled_from(["80Gi", "40GB", "1.5Ti"])),
)
def test_cliflags_fuzz(**flags: object) -> None:
    check(lambda kwargs: gpu_request_from_flags(**kwargs), flags)


@FUZZ
@given(st.one_of(st.text(max_size=12), st.from_regex(r"\+?[0-9]{1,12}", fullmatch=True)))
def test_parse_gpu_flag_value_fuzz(text: str) -> None:
    try:
        count = parse_gpu_flag_value(text)
    except InvalidArgument:
        return
    assert 1 <= count < 2**32 and count == int(text)  # what Rust's u32 parser reads


@FUZZ
@given(st.integers(1, 10**6))
def test_opensandbox_any_count_round_trips(count: int) -> None:
    assert opensandbox.gpu_request({"gpu": str(count)}) == GpuRequest(count, vendor="nvidia")
    vendor = opensandbox.gpu_request({"nvidia.com/gpu": f" {count}", "gpu": str(count)})
    assert vendor == GpuRequest(count=count, vendor="nvidia")
    assert opensandbox.gpu_request({"amd.com/gpu": str(count)}) == GpuRequest(count, vendor="amd")


@FUZZ
@given(
    st.lists(
        st.tuples(st.integers(0, 0xFF), st.integers(0, 0x1F), st.integers(0, 7)),
        min_size=1,
        max_size=8,
        unique=True,
    ),
    st.randoms(use_true_random=False),
    st.booleans(),
)
def test_openshell_device_lists_in_any_order(
    addresses: list[tuple[int, int, int]], rng: random.Random, with_count: bool
) -> None:
    canonical = [f"0000:{bus:02x}:{slot:02x}.{fn}" for bus, slot, fn in addresses]
    libvirt = [f"pci_0000_{bus:02X}_{slot:02X}_{fn}" for bus, slot, fn in addresses]
    order = list(range(len(libvirt)))
    rng.shuffle(order)
    gpu = {"count": len(canonical)} if with_count else {}
    spec = {
        "resource_requirements": {"gpu": gpu},
        "template": {"driver_config": {"vm": {"gpu_device_ids": [libvirt[i] for i in order]}}},
    }
    if not with_count and len(canonical) > 1:  # OpenShell: an omitted count means 1
        try:
            openshell.gpu_request(spec)
        except InvalidArgument as err:
            assert "gpu count (1" in err.message
            return
        raise AssertionError("an omitted count with several device ids was accepted")
    expected = GpuRequest(count=gpu.get("count"), devices=tuple(canonical[i] for i in order))
    assert openshell.gpu_request(spec) == expected
