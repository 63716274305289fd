"""The host's readers on what real NVIDIA GPUs' sysfs and NVML said: the recordings in
tests/fixtures/real (see its README), one H100 or one H200 on driver 580.159.04, each in a
virtual machine without an IOMMU of its own."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from framework import paths
from framework.fake_hosts import probe

from vmsandbox.host import pci_ids, pcistate
from vmsandbox.host.bars import parse_resource, prefetchable_64bit_total
from vmsandbox.host.model import Bar

RECORDINGS = paths.FIXTURES / "real"
H100, H200 = RECORDINGS / "h100-580.159.04", RECORDINGS / "h200-580.159.04"
BDF = "0000:00:06.0"
MIB, GIB = 1 << 20, 1 << 30
# recording -> device id, name, memory MiB, the BAR of the GPU's memory
GPUS = {
    H100: ("0x2330", "NVIDIA H100 80GB HBM3", 81559, 128 * GIB),
    H200: ("0x2335", "NVIDIA H200", 143771, 256 * GIB),
}
each = pytest.mark.parametrize("recording", list(GPUS), ids=lambda path: path.name)


def recorded(recording: Path, name: str) -> Any:
    return json.loads((recording / "host" / f"{name}.json").read_text())


@each
def test_the_bars_of_a_real_gpu(recording: Path) -> None:
    bars = parse_resource(recorded(recording, "sysfs")[BDF]["resource"])

    assert bars == (
        Bar(0, 16 * MIB, is_64bit=True, prefetchable=True),
        Bar(2, GPUS[recording][3], is_64bit=True, prefetchable=True),
        Bar(4, 32 * MIB, is_64bit=True, prefetchable=True),
    )
    (gpu,) = recorded(recording, "inventory")["gpus"]
    assert prefetchable_64bit_total(bars) == gpu["bar_64bit_prefetchable_total"]


@each
def test_the_power_state_is_read_from_a_real_config_space(recording: Path) -> None:
    sysfs = recorded(recording, "sysfs")[BDF]

    assert pcistate.pm_state(bytes.fromhex(sysfs["config_hex"])) == "D0"
    assert sysfs["power_state"].strip() == "D0"
    assert recorded(recording, "readers")[BDF]["config_pm_state"] == "D0"


@each
def test_the_built_in_name_and_memory_are_what_nvml_says(recording: Path) -> None:
    (gpu,) = recorded(recording, "nvml-extra")["gpus"]
    part = pci_ids.known_part("0x10de", GPUS[recording][0])

    assert part is not None
    assert (part.name, part.memory_mib) == (gpu["name"], gpu["memory"]["total"] // MIB)


@each
def test_discover_named_the_gpu_from_nvml_and_refused_it_without_an_iommu(
    recording: Path,
) -> None:
    (gpu,) = recorded(recording, "inventory")["gpus"]
    _device, name, memory, _bar = GPUS[recording]

    assert (gpu["name"], gpu["memory_mib"], gpu["memory_source"]) == (name, memory, "nvml")
    assert gpu["driver"] == "nvidia" and gpu["numa_node"] is None
    assert not gpu["bindable"] and "IOMMU is off" in gpu["reasons"][0]


def test_discover_on_a_fake_host_made_of_the_recorded_sysfs_gives_the_recorded_inventory() -> None:
    """tests/fixtures/hosts/real_h100.umockdev carries the recorded GPU's attributes: the
    inventory discover makes of it under umockdev is the one it made on the real machine
    (pyudev reading the fake sysfs as it read the real one)."""
    real = recorded(H100, "inventory")
    (gpu,) = real["gpus"]
    nvml = {
        "devices": [
            {
                "bus_id": "00000000:00:06.0",
                "name": gpu["name"],
                "memory_mib": gpu["memory_mib"],
                "uuid": gpu["uuid"],
                "pids": [],
            }
        ]
    }
    (result,) = probe("real_h100", [{"nvml": nvml, "proc_root": "/nonexistent"}])
    # The recording machine had no pci.ids, so NVML named the GPU; a machine with one (as
    # this one may be) names it after pci.ids first.
    gpu["name"] = pci_ids.device_name("0x10de", "0x2330") or gpu["name"]
    assert result["inventory"] == real
