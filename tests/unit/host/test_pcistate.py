"""A PCI function's live state (host/pcistate.py) on a fake sysfs of plain files
(tests/framework/fake_sysfs.py): config space, power state, the bridge above it."""

from __future__ import annotations

from pathlib import Path

import pytest
from framework import fake_sysfs

from vmsandbox.host import pcistate

BDF = "0000:01:00.0"


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    return tmp_path / "devices"


def test_a_healthy_gpu_answers(tree: Path) -> None:
    fake_sysfs.gpu(tree, BDF)
    assert pcistate.not_answering(BDF, str(tree)) is None
    assert pcistate.power_state(BDF, str(tree)) == "D0"


def test_all_ones_config_space_does_not_answer(tree: Path) -> None:
    fake_sysfs.gpu(tree, BDF, all_ones=True)
    assert "all ones" in (pcistate.not_answering(BDF, str(tree)) or "")


def test_d3cold_that_stays_after_the_read_does_not_answer(tree: Path) -> None:
    fake_sysfs.gpu(tree, BDF, power_state="D3cold")
    assert pcistate.not_answering(BDF, str(tree)) == "it is in D3cold, not D0"


def test_without_power_state_the_pm_capability_says(tree: Path) -> None:
    folder = fake_sysfs.gpu(tree, BDF, power_state=None)
    (folder / "config").write_bytes(fake_sysfs.config_space(0x10DE, 0x20B0, state=3))
    assert pcistate.power_state(BDF, str(tree)) == "D3hot"


def test_a_function_gone_from_sysfs_does_not_answer(tree: Path) -> None:
    assert "cannot be read" in (pcistate.not_answering(BDF, str(tree)) or "")


def test_wait_gives_up_with_the_last_words(tree: Path) -> None:
    fake_sysfs.gpu(tree, BDF, all_ones=True)
    ticks = iter(range(100))
    with pytest.raises(
        pcistate.DeviceGone, match=r"all ones \(the device does not answer\), still after 3 s"
    ):
        pcistate.wait_answering(
            BDF, 3, str(tree), clock=lambda: float(next(ticks)), sleep=lambda _s: None
        )


def test_the_parent_bridge_is_the_folder_above(tmp_path: Path) -> None:
    real = tmp_path / "pci0000:00" / "0000:00:06.0" / BDF
    real.mkdir(parents=True)
    (tmp_path / "devices").mkdir()
    (tmp_path / "devices" / BDF).symlink_to(real)
    (tmp_path / "devices" / "0000:00:06.0").symlink_to(real.parent)
    assert pcistate.parent_bridge(BDF, str(tmp_path / "devices")) == "0000:00:06.0"
    assert pcistate.parent_bridge("0000:00:06.0", str(tmp_path / "devices")) is None
    assert pcistate.siblings(BDF, str(tmp_path / "devices")) == []


def test_memory_decoding_is_switched_on_for_the_block_and_back_off(tree: Path) -> None:
    folder = fake_sysfs.gpu(tree, BDF)
    (folder / "enable").write_text("0")
    with pcistate.memory_decoding(BDF, str(tree)):
        assert (folder / "enable").read_text() == "1"
    assert (folder / "enable").read_text() == "0"
