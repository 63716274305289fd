"""The host's readers on what a real NVIDIA GPU's sysfs and NVML said: the recording in
tests/fixtures/real/h200-580.159.04 (see its README), one H200 on driver 580.159.04 in a
virtual machine without an IOMMU of its own."""

from __future__ import annotations

import json
from typing import Any

from framework import paths

from vmsandbox.host import pci_ids, pcistate
from vmsandbox.host.bars import parse_resource, prefetchable_64bit_total
from vmsandbox.host.model import Bar

REAL = paths.FIXTURES / "real" / "h200-580.159.04"
BDF = "0000:00:06.0"
MIB, GIB = 1 << 20, 1 << 30


def recorded(name: str) -> Any:
    return json.loads((REAL / "host" / f"{name}.json").read_text())


def test_the_bars_of_a_real_h200() -> None:
    bars = parse_resource(recorded("sysfs")[BDF]["resource"])

    assert bars == (
        Bar(0, 16 * MIB, is_64bit=True, prefetchable=True),
        Bar(2, 256 * GIB, is_64bit=True, prefetchable=True),
        Bar(4, 32 * MIB, is_64bit=True, prefetchable=True),
    )
    (gpu,) = recorded("inventory")["gpus"]
    assert prefetchable_64bit_total(bars) == gpu["bar_64bit_prefetchable_total"]


def test_the_power_state_is_read_from_a_real_config_space() -> None:
    config = bytes.fromhex(recorded("sysfs")[BDF]["config_hex"])

    assert pcistate.pm_state(config) == "D0"
    assert recorded("sysfs")[BDF]["power_state"].strip() == "D0"
    assert recorded("readers")[BDF]["config_pm_state"] == "D0"


def test_the_built_in_name_and_memory_of_the_h200_are_what_nvml_says() -> None:
    (gpu,) = recorded("nvml-extra")["gpus"]
    part = pci_ids.known_part("0x10de", "0x2335")

    assert part is not None
    assert (part.name, part.memory_mib) == (gpu["name"], gpu["memory"]["total"] // MIB)


def test_discover_named_the_gpu_from_nvml_and_refused_it_without_an_iommu() -> None:
    (gpu,) = recorded("inventory")["gpus"]

    assert (gpu["name"], gpu["memory_mib"], gpu["memory_source"]) == ("NVIDIA H200", 143771, "nvml")
    assert gpu["driver"] == "nvidia" and gpu["numa_node"] is None
    assert not gpu["bindable"] and "IOMMU is off" in gpu["reasons"][0]
