"""A GPU's sanitize between two tenants (gpu/custody/sanitize.py) on a fake sysfs: each step
timed, each failure in the step's words, a GPU with an active partition not touched."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
from framework import fake_sysfs

from vmsandbox.config import Config
from vmsandbox.gpu.custody.sanitize import Host, NotYet, sanitize

BDF = "0000:01:00.0"


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    return tmp_path / "sys" / "devices"


def config(tmp_path: Path, **overrides: Any) -> Config:
    return Config.load(
        path="/nonexistent",
        state_dir=tmp_path / "state",
        pci_sysfs=tmp_path / "sys" / "devices",
        **overrides,
    )


def test_a_healthy_nvidia_gpu_passes_every_step(tmp_path: Path, tree: Path) -> None:
    folder = fake_sysfs.gpu(tree, BDF, reset_method="flr bus")
    outcome = sanitize(BDF, None, config(tmp_path), Host(sysfs=str(tree)))
    assert outcome.ok, outcome.words
    assert list(outcome.steps) == ["fabric", "unbind", "reset", "alive", "memory-clear", "scrub"]
    assert outcome.notes["reset"] == "bus"
    assert outcome.notes["memory-clear"] == "hardware clear (ampere)"
    assert (folder / "reset").read_text() == "1"


def test_a_host_driver_lets_go_and_gets_it_back(tmp_path: Path, tree: Path) -> None:
    fake_sysfs.gpu(tree, BDF, driver="nvidia")
    outcome = sanitize(BDF, None, config(tmp_path), Host(sysfs=str(tree)))
    assert outcome.ok and "rebind" in outcome.steps
    assert (tree.parent / "drivers" / "nvidia" / "unbind").read_text() == BDF
    assert (tree.parent / "drivers_probe").read_text() == BDF


def test_a_missing_reset_method_fails_at_reset(tmp_path: Path, tree: Path) -> None:
    fake_sysfs.gpu(tree, BDF, reset_method="pm")
    outcome = sanitize(BDF, None, config(tmp_path), Host(sysfs=str(tree)))
    assert (outcome.failed, outcome.words) == (
        "reset",
        "reset: the kernel has no SBR or FLR for it",
    )


def test_a_gpu_that_does_not_come_back_fails_at_alive(tmp_path: Path, tree: Path) -> None:
    fake_sysfs.gpu(tree, BDF, all_ones=True)
    outcome = sanitize(BDF, None, config(tmp_path), Host(sysfs=str(tree), reset_timeout=0.1))
    assert outcome.failed == "alive" and "all ones" in outcome.words


def test_a_stuck_memory_clear_fails_at_memory_clear(tmp_path: Path, tree: Path) -> None:
    fake_sysfs.gpu(tree, BDF, clear_done=False)
    outcome = sanitize(BDF, None, config(tmp_path), Host(sysfs=str(tree)))
    assert outcome.failed == "memory-clear"
    assert "memory clear finished not reported within 5 s" in outcome.words


def test_a_gpu_without_a_hardware_clear_needs_the_scrub_hook(tmp_path: Path, tree: Path) -> None:
    fake_sysfs.gpu(tree, BDF, vendor=0x1002, device=0x5046, klass=0x030000)
    outcome = sanitize(BDF, None, config(tmp_path), Host(sysfs=str(tree)))
    assert outcome.failed == "memory-clear" and "gpu_scrub_hook" in outcome.words
    calls: list[list[str]] = []

    def run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        calls.append(argv)
        assert kwargs["env"]["VMSANDBOX_GPU_BDF"] == BDF
        return subprocess.CompletedProcess(argv, 0, "", "")

    hooked = config(tmp_path, gpu_scrub_hook="/usr/local/sbin/scrub")
    outcome = sanitize(BDF, None, hooked, Host(sysfs=str(tree), run=run))
    assert outcome.ok and calls == [["/usr/local/sbin/scrub", BDF]]


def test_a_failing_scrub_hook_fails_at_scrub(tmp_path: Path, tree: Path) -> None:
    fake_sysfs.gpu(tree, BDF)
    hooked = config(tmp_path, gpu_scrub_hook="/bin/sh")

    def run(argv: list[str], **_kwargs: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(argv, 3, "", "BAR0 write refused\n")

    outcome = sanitize(BDF, None, hooked, Host(sysfs=str(tree), run=run))
    assert outcome.words == "scrub: the scrub hook exited 3: BAR0 write refused"


def test_nothing_but_a_gpu_is_ever_reset(tmp_path: Path, tree: Path) -> None:
    folder = fake_sysfs.gpu(tree, BDF, vendor=0x8086, device=0x10FB, klass=0x020000)
    outcome = sanitize(BDF, None, config(tmp_path), Host(sysfs=str(tree)))
    assert outcome.failed == "identity" and "not a GPU" in outcome.words
    assert (folder / "reset").read_text() == ""


def test_an_active_partition_is_no_fault_of_the_gpu(tmp_path: Path, tree: Path) -> None:
    folder = fake_sysfs.gpu(tree, BDF)
    with pytest.raises(NotYet, match="partition 3 is still active"):
        sanitize(BDF, 3, config(tmp_path), Host(sysfs=str(tree), partition_active=lambda p: True))
    assert (folder / "reset").read_text() == ""
