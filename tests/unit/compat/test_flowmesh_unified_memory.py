"""FlowMesh's unified-memory rule: a GPU with no memory of its own is sized from the host's pool.

mlsys-io/FlowMesh (6f1ac4c2): ``src/worker/hw.py`` marks GB10, Tegra and Thor GPUs as using
the host's memory and reports MemTotal as the shared pool; ``unified_gpu_memory_satisfies`` in
``src/shared/utils/hardware.py`` (tests: ``TestUnifiedGpuMemorySatisfies`` in
``tests/shared/utils/test_hardware.py``) lets the pool divided by the number of GPUs asked for
stand in for each GPU's memory. Checked here on the GB10 fake host, whose NVML (FakeNvml)
names the GPU and, as on a real GB10, gives no memory size.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from framework.fake_hosts import inventory_from_dict, probe

from vmsandbox.compat import flowmesh
from vmsandbox.errors import FailedPrecondition
from vmsandbox.gpu.allocator import select
from vmsandbox.gpu.request import GpuRequest
from vmsandbox.host.model import Inventory

GB10 = "000f:01:00.0"
POOL_MIB = 128 * 1024  # MemTotal of the fake /proc/meminfo
NVML = {
    "devices": [
        {
            "bus_id": "0000000F:01:00.0",
            "name": "NVIDIA GB10",
            "memory_mib": "Not Supported",
            "uuid": "GPU-5b1e7f3a-2c4d-4e6f-8a9b-0c1d2e3f4a5b",
            "pids": [],
        }
    ]
}


@pytest.fixture(scope="module")
def probed(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    proc = tmp_path_factory.mktemp("proc")
    (proc / "meminfo").write_text(f"MemTotal:       {POOL_MIB * 1024} kB\nMemFree: 1 kB\n")
    return probe(
        "gb10",
        [
            {"nvml": NVML, "proc_root": str(proc)},
            {"use_nvml": False, "proc_root": str(proc)},
            {"nvml": NVML, "proc_root": str(Path(proc, "missing"))},
        ],
    )


@pytest.fixture(scope="module")
def gb10(probed: list[dict[str, Any]]) -> Inventory:
    return inventory_from_dict(probed[0]["inventory"])


def test_discovery_marks_the_gpu_unified_and_reads_the_pool(probed: list[dict]) -> None:
    inventory = probed[0]["inventory"]
    [gpu] = inventory["gpus"]
    assert (gpu["bdf"], gpu["name"], gpu["bindable"]) == (GB10, "NVIDIA GB10", True)
    assert (gpu["memory_mib"], gpu["memory_source"]) == (None, "unified")
    assert gpu["uuid"] == NVML["devices"][0]["uuid"]  # NVML's other answers are kept
    assert inventory["host"]["unified_memory_mib"] == POOL_MIB
    assert inventory["host"]["notes"] == [f"NVML gives no memory size for {GB10}: Not Supported"]


def test_without_a_name_or_meminfo_nothing_is_guessed(probed: list[dict]) -> None:
    without_nvml, without_meminfo = probed[1]["inventory"], probed[2]["inventory"]
    assert without_nvml["gpus"][0]["memory_source"] == "unknown"  # no name: not known unified
    assert without_nvml["host"]["unified_memory_mib"] is None
    assert without_meminfo["gpus"][0]["memory_source"] == "unified"
    assert without_meminfo["host"]["unified_memory_mib"] is None


@pytest.mark.parametrize("memory", ["40Gi", "64 gib", "128G", 2**37])
def test_the_pool_meets_a_flowmesh_floor(gb10: Inventory, memory: object) -> None:
    request = flowmesh.gpu_request({"count": 1, "memory": memory})
    assert request is not None
    assert [gpu.bdf for gpu in select(request, gb10)] == [GB10]


def test_a_floor_above_the_pool_says_why(gb10: Inventory) -> None:
    request = flowmesh.gpu_request({"memory": "200Gi"})
    assert request is not None
    with pytest.raises(FailedPrecondition) as caught:
        select(request, gb10)
    assert f"a {POOL_MIB} MiB share of the host's unified memory" in caught.value.message


def test_the_pool_is_shared_by_the_gpus_asked_for(gb10: Inventory) -> None:
    # test_per_gpu_share_below_request: 128 GiB over 4 GPUs is 32 GiB each
    [gpu] = gb10.gpus
    four = replace(
        gb10,
        gpus=tuple(replace(gpu, bdf=f"000f:0{i + 1}:00.0", index=i, uuid=None) for i in range(4)),
    )
    assert len(select(GpuRequest(count=4, min_memory_mib=32 * 1024), four)) == 4
    assert len(select(GpuRequest(count=1, min_memory_mib=40 * 1024), four)) == 1
    with pytest.raises(FailedPrecondition) as caught:
        select(GpuRequest(count=4, min_memory_mib=40 * 1024), four)
    assert "a 32768 MiB share of the host's unified memory" in caught.value.message
    named = GpuRequest(devices=("000f:01:00.0", "000f:02:00.0"), min_memory_mib=64 * 1024)
    assert [g.bdf for g in select(named, four)] == ["000f:01:00.0", "000f:02:00.0"]


def test_a_gpu_of_unknown_memory_still_fails_a_floor(gb10: Inventory) -> None:
    [gpu] = gb10.gpus
    unknown = replace(gb10, gpus=(replace(gpu, memory_source="unknown"),))
    with pytest.raises(FailedPrecondition) as caught:
        select(GpuRequest(min_memory_mib=1024), unknown)
    assert "it has an unknown amount" in caught.value.message
