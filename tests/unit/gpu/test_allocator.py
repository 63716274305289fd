"""GPU selection (vmsandbox.gpu.allocator.select) on inventories discovered on the fake hosts.

Each host's inventory comes from ``discover()`` run under umockdev (tests/framework/fake_hosts.py),
once per module; tests mark GPUs as held with ``dataclasses.replace``, as the manager does
with what libvirt reports.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
from framework.inventories import HGX, discover_hosts
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vmsandbox.errors import (
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    VmSandboxError,
)
from vmsandbox.gpu.allocator import select
from vmsandbox.gpu.request import GpuRequest, memory_satisfies, model_matches
from vmsandbox.host.discover import IOMMU_OFF
from vmsandbox.host.model import Gpu, Inventory

HOSTS = [
    "hgx_h100",
    "workstation_rtx2080ti",
    "iommu_off",
    "shared_group_nic",
    "boot_vga",
    "mi300x",
]
H100_UUID = "GPU-5f0c2a9e-41d3-4b7e-9c1a-0123456789ab"
CODES = {"INVALID_ARGUMENT", "FAILED_PRECONDITION", "RESOURCE_EXHAUSTED"}


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Inventory]:
    """Every fake host, NVML off and an empty /proc; ``hgx_nvml``: the HGX host with NVML
    answering for GPU 0000:41:00.0, so that it has a UUID."""
    plain = {"use_nvml": False, "proc_root": str(tmp_path_factory.mktemp("proc"))}
    device = {
        "bus_id": "00000000:41:00.0",
        "name": "NVIDIA H100 80GB HBM3",
        "memory_mib": 81559,
        "uuid": H100_UUID,
        "pids": [],
    }
    nvml = {"nvml": {"devices": [device]}, "proc_root": plain["proc_root"]}
    return discover_hosts(
        {host: (host, plain) for host in HOSTS} | {"hgx_nvml": ("hgx_h100", nvml)}
    )


@pytest.fixture(scope="module")
def hgx(hosts: dict[str, Inventory]) -> Inventory:
    return hosts["hgx_h100"]


@pytest.fixture(scope="module")
def hgx_nvml(hosts: dict[str, Inventory]) -> Inventory:
    return hosts["hgx_nvml"]


def held(inventory: Inventory, **holders: str) -> Inventory:
    """``inventory`` with GPUs held by domains: ``held(inv, **{"0000:18:00.0": "vm-a"})``."""
    gpus = tuple(replace(gpu, in_use_by=holders.get(gpu.bdf)) for gpu in inventory.gpus)
    return replace(inventory, gpus=gpus)


def bdfs(gpus: list[Gpu]) -> list[str]:
    return [gpu.bdf for gpu in gpus]


# -- placement -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("count", "expected"),
    [
        (1, HGX[:1]),
        (2, HGX[:2]),  # a switch pair
        (3, HGX[:3]),  # one node: a whole pair and one of the other pair
        (4, HGX[:4]),  # one node
        (5, HGX[:5]),  # a whole node, then one GPU of the other
        (6, HGX[:6]),
        (8, HGX),
    ],
)
def test_count_keeps_gpus_on_one_node_and_switch(
    hgx: Inventory, count: int, expected: list[str]
) -> None:
    assert bdfs(select(GpuRequest(count=count), hgx)) == expected


def test_a_half_used_pair_is_filled_first_and_whole_pairs_kept(hgx: Inventory) -> None:
    inventory = held(hgx, **{HGX[0]: "vmsbx-a"})
    # one GPU: the partner of the held one, so that pairs stay whole
    assert bdfs(select(GpuRequest(count=1), inventory)) == [HGX[1]]
    # two GPUs: the free pair on node 0 rather than split 19 and 41
    assert bdfs(select(GpuRequest(count=2), inventory)) == [HGX[2], HGX[3]]
    # four: node 0 has three left, node 1 all four
    assert bdfs(select(GpuRequest(count=4), inventory)) == HGX[4:]


def test_a_shared_switch_beats_best_fit(hgx: Inventory) -> None:
    # node 0 keeps 19 and 42, behind different switches: node 1's whole pair is better
    inventory = held(hgx, **{HGX[0]: "vmsbx-a", HGX[2]: "vmsbx-b"})
    assert bdfs(select(GpuRequest(count=2), inventory)) == [HGX[4], HGX[5]]
    assert bdfs(select(GpuRequest(count=3), inventory)) == HGX[4:7]


def test_a_gpu_held_by_a_foreign_domain_is_never_chosen(hgx: Inventory) -> None:
    inventory = held(hgx, **{HGX[5]: "other-team-vm"})
    assert bdfs(select(GpuRequest(count=7), inventory)) == HGX[:5] + HGX[6:]
    assert bdfs(select(GpuRequest(all=True), inventory)) == HGX[:5] + HGX[6:]
    with pytest.raises(ResourceExhausted) as caught:
        select(GpuRequest(count=8), inventory)
    assert caught.value.details == {
        "wanted": 8,
        "free": 7,
        "available": 8,
        "held_by": {HGX[5]: "other-team-vm"},
    }
    assert "0000:9b:00.0 by domain 'other-team-vm'" in caught.value.message
    assert "only 7 of the 8 suitable GPUs are free" in caught.value.message


def test_gpus_without_numa_or_switch_information(hosts: dict[str, Inventory]) -> None:
    workstation = hosts["workstation_rtx2080ti"]
    # the iGPU is the boot VGA device: only the RTX 2080 Ti can go
    assert bdfs(select(GpuRequest(), workstation)) == ["0000:0a:00.0"]
    assert bdfs(select(GpuRequest(all=True), workstation)) == ["0000:0a:00.0"]


# -- named devices -------------------------------------------------------------------------


def test_devices_by_bdf_index_and_uuid_in_the_order_given(hgx_nvml: Inventory) -> None:
    request = GpuRequest(devices=("c2:00.0", "0", H100_UUID.upper()))
    assert bdfs(select(request, hgx_nvml)) == ["0000:c2:00.0", "0000:18:00.0", "0000:41:00.0"]


def test_unknown_device_lists_the_valid_ids(hgx_nvml: Inventory) -> None:
    with pytest.raises(InvalidArgument) as caught:
        select(GpuRequest(devices=("0000:17:00.0",)), hgx_nvml)
    valid = caught.value.details["valid_ids"]
    assert valid[:3] == ["0000:18:00.0", "0", "0000:19:00.0"]
    assert H100_UUID in valid and "7" in valid and len(valid) == 17
    assert caught.value.details["value"] == "0000:17:00.0"
    assert "no GPU '0000:17:00.0' on this host; valid ids: 0000:18:00.0, 0, " in str(caught.value)
    for unknown in ("8", "GPU-00000000-0000-0000-0000-000000000000"):
        with pytest.raises(InvalidArgument):
            select(GpuRequest(devices=(unknown,)), hgx_nvml)


def test_no_gpus_at_all() -> None:
    empty = Inventory(gpus=(), fabric=(), iommu=True, pci_devices=12, nvml=False)
    with pytest.raises(InvalidArgument, match="valid ids: none: this host has no GPUs"):
        select(GpuRequest(devices=("0",)), empty)
    for request in (GpuRequest(), GpuRequest(all=True)):
        with pytest.raises(FailedPrecondition, match=r"; this host has no GPUs$") as caught:
            select(request, empty)
        assert caught.value.details["gpus"] == 0


def test_two_ids_naming_one_gpu(hgx_nvml: Inventory) -> None:
    with pytest.raises(InvalidArgument) as caught:
        select(GpuRequest(devices=("41:00.0", "2")), hgx_nvml)
    assert "'0000:41:00.0' and '2' both name GPU 0000:41:00.0" in str(caught.value)
    assert caught.value.details == {"field": "devices", "value": "2", "bdf": "0000:41:00.0"}
    with pytest.raises(InvalidArgument, match=r"both name GPU 0000:41:00\.0"):
        select(GpuRequest(devices=(H100_UUID, "0000:41:00.0")), hgx_nvml)


def test_named_device_that_is_not_bindable(hosts: dict[str, Inventory]) -> None:
    with pytest.raises(FailedPrecondition) as caught:
        select(GpuRequest(devices=("04:00.0",)), hosts["shared_group_nic"])
    reasons = caught.value.details["not_bindable"]["0000:04:00.0"]
    assert len(reasons) == 2 and reasons[0].startswith("IOMMU group 7 also holds 0000:03:00.0")
    assert "0000:04:00.0: IOMMU group 7 also holds 0000:03:00.0" in caught.value.message
    with pytest.raises(FailedPrecondition, match="it is the boot VGA device"):
        select(GpuRequest(devices=("1",)), hosts["workstation_rtx2080ti"])


def test_named_device_held_by_a_domain(hgx: Inventory) -> None:
    inventory = held(hgx, **{HGX[2]: "vmsbx-x", HGX[3]: "foreign"})
    with pytest.raises(ResourceExhausted) as caught:
        select(GpuRequest(devices=(HGX[0], HGX[2], HGX[3])), inventory)
    assert caught.value.details == {"held_by": {HGX[2]: "vmsbx-x", HGX[3]: "foreign"}}
    assert "0000:41:00.0 by domain 'vmsbx-x', 0000:42:00.0 by domain 'foreign'" in str(caught.value)


def test_named_device_failing_a_filter(hosts: dict[str, Inventory]) -> None:
    hgx = hosts["hgx_h100"]
    with pytest.raises(InvalidArgument) as caught:
        select(GpuRequest(devices=("0",), vendor="amd"), hgx)
    assert caught.value.details["field"] == "vendor"
    assert "0000:18:00.0 fails vendor (it is an nvidia GPU, not amd)" in caught.value.message
    with pytest.raises(InvalidArgument) as caught:
        select(GpuRequest(devices=("0",), model="A100", min_memory_mib=100_000), hgx)
    assert caught.value.details == {
        "field": "model",
        "filtered_out": {
            "0000:18:00.0": {
                "model": "its name 'GH100 [H100 SXM5 80GB]' does not match 'A100'",
                "min_memory_mib": "it has 81559 MiB, 100000 MiB asked",
            }
        },
    }
    # unknown memory never satisfies a minimum
    with pytest.raises(InvalidArgument, match="it has an unknown amount, 1 MiB asked"):
        select(GpuRequest(devices=("0",), min_memory_mib=1), hosts["workstation_rtx2080ti"])
    # a filter failure is reported before the GPU being held
    with pytest.raises(InvalidArgument):
        select(GpuRequest(devices=("0",), model="A100"), held(hgx, **{HGX[0]: "vm"}))


def test_named_devices_that_pass_the_filters(hgx: Inventory) -> None:
    request = GpuRequest(devices=("3",), vendor="nvidia", model="H100", min_memory_mib=81920)
    assert bdfs(select(request, hgx)) == [HGX[3]]


# -- more than the host can give -----------------------------------------------------------


def test_more_gpus_than_the_host_has(hgx: Inventory) -> None:
    with pytest.raises(FailedPrecondition) as caught:
        select(GpuRequest(count=9), held(hgx, **{HGX[0]: "vm"}))
    assert caught.value.message == (
        "this host can never give 9 GPUs: it has 8 GPUs, 8 of them bindable and matching "
        "the request"
    )
    assert caught.value.details == {
        "wanted": 9,
        "max_gpus": 16,
        "available": 8,
        "gpus": 8,
        "not_bindable": {},
        "filtered_out": {},
        "iommu": True,
    }


def test_more_gpus_than_a_sandbox_may_take(hgx: Inventory) -> None:
    with pytest.raises(FailedPrecondition, match="3 GPUs asked, but a sandbox takes at most 2"):
        select(GpuRequest(count=3), hgx, max_gpus=2)
    with pytest.raises(FailedPrecondition, match="names 3 GPUs, but a sandbox takes at most 2"):
        select(GpuRequest(devices=("0", "1", "2")), hgx, max_gpus=2)
    # all=True takes every free GPU up to the limit, best placed
    assert bdfs(select(GpuRequest(all=True), hgx, max_gpus=4)) == HGX[:4]


def test_iommu_off_says_so(hosts: dict[str, Inventory]) -> None:
    for request in (GpuRequest(), GpuRequest(all=True)):
        with pytest.raises(FailedPrecondition) as caught:
            select(request, hosts["iommu_off"])
        assert caught.value.message.endswith(
            f"0 of them bindable and matching the request; {IOMMU_OFF}"
        )
        assert caught.value.details["iommu"] is False


def test_non_bindable_gpus_are_listed_with_their_reason(hosts: dict[str, Inventory]) -> None:
    with pytest.raises(FailedPrecondition) as caught:
        select(GpuRequest(), hosts["shared_group_nic"])
    assert "; 1 GPU cannot be passed to a guest (0000:04:00.0: IOMMU group 7 also holds" in (
        caught.value.message
    )
    assert list(caught.value.details["not_bindable"]) == ["0000:04:00.0"]


def test_filters_that_nothing_matches(hosts: dict[str, Inventory]) -> None:
    with pytest.raises(FailedPrecondition) as caught:
        select(GpuRequest(vendor="amd"), hosts["hgx_h100"])
    message = caught.value.message
    assert "8 GPUs fail the request's filters (0000:18:00.0: fails vendor (it is an nvidia" in (
        message
    )
    assert message.endswith("; and 5 more)")
    assert len(caught.value.details["filtered_out"]) == 8
    with pytest.raises(FailedPrecondition, match="fails min_memory_mib"):
        select(GpuRequest(min_memory_mib=1), hosts["workstation_rtx2080ti"])
    with pytest.raises(FailedPrecondition, match="fails model"):
        select(GpuRequest(count=2, model="A100"), hosts["hgx_h100"])
    with pytest.raises(FailedPrecondition, match="fails min_memory_mib"):
        select(GpuRequest(min_memory_mib=100_000), hosts["hgx_h100"])


def test_filters_that_match(hosts: dict[str, Inventory]) -> None:
    hgx = hosts["hgx_h100"]
    assert bdfs(select(GpuRequest(count=2, model="h100 sxm5"), hgx)) == HGX[:2]
    # 81559 MiB is within 1% of 80 GiB
    assert bdfs(select(GpuRequest(count=2, min_memory_mib=81920), hgx)) == HGX[:2]
    request = GpuRequest(vendor="amd", min_memory_mib=192 * 1024)
    assert bdfs(select(request, hosts["mi300x"])) == ["0000:03:00.0"]


def test_all_when_everything_is_held(hgx: Inventory) -> None:
    holders = {bdf: f"vm-{i}" for i, bdf in enumerate(HGX)}
    with pytest.raises(ResourceExhausted) as caught:
        select(GpuRequest(all=True), held(hgx, **holders))
    assert caught.value.details["held_by"] == holders
    assert caught.value.message.startswith(
        "every free GPU asked, but only 0 of the 8 suitable GPUs are free; in use: "
        "0000:18:00.0 by domain 'vm-0', "
    )
    with pytest.raises(ResourceExhausted, match="only 0 of the 8 suitable GPUs are free"):
        select(GpuRequest(), held(hgx, **holders))


# -- properties ----------------------------------------------------------------------------


def passes(request: GpuRequest, gpu: Gpu) -> bool:
    """The request's filters, straight from their definition in gpuquery."""
    return (
        (request.vendor is None or gpu.vendor == request.vendor)
        and (
            request.model is None
            or (gpu.name is not None and model_matches(request.model, gpu.name))
        )
        and (
            request.min_memory_mib is None
            or (
                gpu.memory_mib is not None
                and memory_satisfies(request.min_memory_mib, gpu.memory_mib)
            )
        )
    )


@st.composite
def inventories(draw: st.DrawFn, templates: list[Gpu]) -> Inventory:
    """Up to eight GPUs made from real ones, with random placement and state."""
    chosen = sorted(draw(st.lists(st.sampled_from(HGX), min_size=1, max_size=8, unique=True)))
    gpus = []
    for index, bdf in enumerate(chosen):
        template = draw(st.sampled_from(templates))
        bindable = draw(st.sampled_from([True, True, True, False]))
        gpus.append(
            replace(
                template,
                bdf=bdf,
                index=index,
                numa_node=draw(st.sampled_from([None, 0, 1])),
                pcie_switch=draw(st.sampled_from([None, "0000:16:00.0", "0000:3f:00.0"])),
                bindable=bindable,
                reasons=() if bindable else ("host processes hold it open: pid 1 (x)",),
                in_use_by=draw(st.sampled_from([None, None, None, "vmsbx-a", "foreign"])),
                memory_mib=draw(
                    st.sampled_from([template.memory_mib, template.memory_mib, None, 16384])
                ),
                uuid=draw(st.sampled_from([None, f"GPU-{index:08x}-0000-4000-8000-{index:012x}"])),
            )
        )
    return Inventory(gpus=tuple(gpus), fabric=(), iommu=True, pci_devices=len(gpus), nvml=False)


@st.composite
def requests(draw: st.DrawFn, inventory: Inventory) -> GpuRequest:
    filters = {
        "vendor": draw(st.sampled_from([None, None, None, "nvidia", "amd"])),
        "model": draw(st.sampled_from([None, None, None, "H100", "RTX 2080 Ti", "MI300X"])),
        "min_memory_mib": draw(st.sampled_from([None, None, None, 16384, 81920])),
    }
    kind = draw(st.sampled_from(["default", "count", "all", "devices"]))
    if kind == "count":
        return GpuRequest(count=draw(st.integers(1, 4) | st.integers(5, 9)), **filters)
    if kind == "all":
        return GpuRequest(all=True, **filters)
    if kind == "default":
        return GpuRequest(**filters)
    picked = draw(
        st.lists(st.sampled_from(inventory.gpus), min_size=1, max_size=3, unique_by=bdf_of)
    )
    ids = [draw(st.sampled_from(spellings(gpu))) for gpu in picked]
    # now and then an id that names no GPU, or a GPU already named
    others = ["0000:ee:00.0", *(i for gpu in inventory.gpus for i in spellings(gpu))]
    ids += draw(st.lists(st.sampled_from(others).filter(lambda i: i not in ids), max_size=1))
    return GpuRequest(devices=tuple(ids), **filters)


def bdf_of(gpu: Gpu) -> str:
    return gpu.bdf


def spellings(gpu: Gpu) -> list[str]:
    """The ids that name ``gpu``: BDF, index and UUID."""
    return [gpu.bdf, str(gpu.index), *([gpu.uuid] if gpu.uuid else [])]


def expected_code(request: GpuRequest, inventory: Inventory, max_gpus: int) -> str | None:
    """Which error ``select`` must raise, or None when it must succeed."""
    if request.devices:
        by_id = {gpu.bdf: gpu for gpu in inventory.gpus}
        by_id |= {str(gpu.index): gpu for gpu in inventory.gpus}
        by_id |= {gpu.uuid: gpu for gpu in inventory.gpus if gpu.uuid}
        named = [by_id.get(device) for device in request.devices]
        if None in named or len({gpu.bdf for gpu in named}) < len(named):
            return "INVALID_ARGUMENT"
        if not all(passes(request, gpu) for gpu in named):
            return "INVALID_ARGUMENT"
        if len(named) > max_gpus or not all(gpu.bindable for gpu in named):
            return "FAILED_PRECONDITION"
        return "RESOURCE_EXHAUSTED" if any(gpu.in_use_by for gpu in named) else None
    matching = [gpu for gpu in inventory.gpus if gpu.bindable and passes(request, gpu)]
    free = [gpu for gpu in matching if gpu.in_use_by is None]
    wanted = request.wanted()
    if not matching or (wanted is not None and wanted > min(max_gpus, len(matching))):
        return "FAILED_PRECONDITION"
    return "RESOURCE_EXHAUSTED" if not free or (wanted or 0) > len(free) else None


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_select_never_returns_a_wrong_gpu(hosts: dict[str, Inventory], data: st.DataObject) -> None:
    templates = [
        hosts["hgx_h100"].gpus[0],
        hosts["workstation_rtx2080ti"].gpus[0],
        hosts["mi300x"].gpus[0],
    ]
    inventory = data.draw(inventories(templates))
    request = data.draw(requests(inventory))
    max_gpus = data.draw(st.sampled_from([16, 16, 8, 4, 2, 1]))
    expected = expected_code(request, inventory, max_gpus)
    try:
        got = select(request, inventory, max_gpus=max_gpus)
    except VmSandboxError as err:
        assert err.code in CODES
        assert err.code == expected, err.message
        return
    assert expected is None
    assert len({gpu.bdf for gpu in got}) == len(got)
    for gpu in got:
        assert gpu.bindable and gpu.in_use_by is None and passes(request, gpu)
    free = [g for g in inventory.gpus if g.bindable and g.in_use_by is None and passes(request, g)]
    assert len(got) == (request.wanted() or min(len(free), max_gpus))
    if request.devices:
        assert bdfs(got) == [
            next(g.bdf for g in inventory.gpus if device in spellings(g))
            for device in request.devices
        ]
    elif max(Counter(gpu.numa_node for gpu in free).values()) >= len(got):
        assert len({gpu.numa_node for gpu in got}) == 1  # one node when one node can do


def custody(inventory: Inventory, **states: str) -> Inventory:
    """``inventory`` with GPUs in custody states: ``custody(inv, **{"0000:18:00.0": "failed"})``."""
    return replace(
        inventory,
        gpus=tuple(
            replace(gpu, custody=states[gpu.bdf], custody_reason="AER: fatal error")
            if gpu.bdf in states
            else gpu
            for gpu in inventory.gpus
        ),
    )


def test_only_gpus_whose_custody_is_free_are_chosen(hgx: Inventory) -> None:
    inventory = custody(hgx, **{HGX[0]: "quarantined"})
    assert HGX[0] not in bdfs(select(GpuRequest(count=7), inventory))
    with pytest.raises(FailedPrecondition) as caught:  # waiting would not help
        select(GpuRequest(count=8), inventory)
    message = caught.value.message
    assert f"1 matching GPU is quarantined: {HGX[0]} (quarantined: AER: fatal error" in message
    assert "'vmsandbox gpus check BDF'" in message
    assert caught.value.details["custody"][HGX[0]]["state"] == "quarantined"
    sanitizing = custody(hgx, **{HGX[1]: "sanitizing"})
    with pytest.raises(ResourceExhausted, match=f"being sanitized or reset: {HGX[1]} .sanitizing"):
        select(GpuRequest(count=8), sanitizing)


def test_a_named_quarantined_gpu_is_refused_by_name(hgx: Inventory) -> None:
    inventory = custody(hgx, **{HGX[2]: "failed"})
    with pytest.raises(FailedPrecondition, match=f"1 named GPU is quarantined: {HGX[2]}"):
        select(GpuRequest(devices=(HGX[2],)), inventory)
