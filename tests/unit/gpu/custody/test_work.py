"""Custody at work (gpu/custody/work.py), on a fake sysfs: release, sanitize, a worker killed
mid-sanitize, an active partition, the operator's check and forced release."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from framework import fake_sysfs

from vmsandbox.config import Config
from vmsandbox.errors import FailedPrecondition
from vmsandbox.gpu.custody import state, work
from vmsandbox.gpu.custody.sanitize import Host
from vmsandbox.gpu.custody.state import Custody
from vmsandbox.gpu.custody.store import CustodyStore
from vmsandbox.lock import host_lock
from vmsandbox.vm.process import ProcessIdentity

BDF = "0000:01:00.0"
AUDIO = "0000:01:00.1"


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    tree = tmp_path / "sys" / "devices"
    fake_sysfs.gpu(tree, BDF)
    return tree


def make_config(tmp_path: Path, **overrides: Any) -> Config:
    (tmp_path / "state").mkdir(exist_ok=True)
    return Config.load(
        path="/nonexistent",
        state_dir=tmp_path / "state",
        pci_sysfs=tmp_path / "sys" / "devices",
        **overrides,
    )


@pytest.fixture
def config(tmp_path: Path, tree: Path) -> Config:
    return make_config(tmp_path)


def locker(config: Config) -> Any:
    @contextlib.contextmanager
    def lock() -> Iterator[None]:
        with host_lock(config.lock_path):
            yield

    return lock


def released(config: Config, *bdfs: str) -> list[str]:
    with host_lock(config.lock_path):
        return work.release(config, bdfs, "test")


def test_a_released_gpu_is_sanitized_then_free(config: Config) -> None:
    assert released(config, BDF, AUDIO) == [BDF]  # the audio function is no GPU: not recorded
    assert CustodyStore(config).get(BDF).state == state.SANITIZING
    (result,) = work.run_pending(config, locker(config))
    assert result.record.state == state.FREE and result.outcome is not None
    assert set(result.record.steps) >= {"reset", "alive", "memory-clear"}
    (logged,) = CustodyStore(config).sanitizes()
    assert logged["ok"] and logged["bdf"] == BDF


def test_a_failed_sanitize_quarantines(config: Config, tree: Path) -> None:
    fake_sysfs.gpu(tree, BDF, clear_done=False)
    released(config, BDF)
    (result,) = work.run_pending(config, locker(config), [BDF])
    assert result.record.state == state.QUARANTINED
    assert result.record.reason.startswith("memory-clear: memory clear finished not reported")


def test_a_worker_killed_mid_sanitize_leaves_it_sanitizing_for_the_next_pass(
    config: Config,
) -> None:
    released(config, BDF)
    dead = ProcessIdentity(pid=1, start="0", boot="another boot")
    with host_lock(config.lock_path):
        CustodyStore(config).change(BDF, lambda r: state.taken_up(r, dead), "killed")
    assert CustodyStore(config).get(BDF).state == state.SANITIZING  # never free unsanitized
    assert work.waiting(config) == [BDF]
    (result,) = work.run_pending(config, locker(config))
    assert result.record.state == state.FREE


def test_a_live_worker_is_left_alone(config: Config) -> None:
    released(config, BDF)
    with host_lock(config.lock_path):
        CustodyStore(config).change(
            BDF, lambda r: state.taken_up(r, ProcessIdentity.current()), "busy"
        )
    assert work.run_pending(config, locker(config), [BDF]) == []


def test_an_active_partition_keeps_it_sanitizing(config: Config, tree: Path) -> None:
    with host_lock(config.lock_path):
        work.release(config, [BDF], "test", partition=2)
    host = Host(sysfs=str(tree), partition_active=lambda p: p == 2)
    (result,) = work.run_pending(config, locker(config), [BDF], host=host)
    assert result.waiting and result.record.state == state.SANITIZING
    assert result.record.worker is None
    (result,) = work.run_pending(config, locker(config), [BDF], host=Host(sysfs=str(tree)))
    assert result.record.state == state.FREE


def test_with_sanitizing_off_a_released_gpu_is_free_at_once(tmp_path: Path, tree: Path) -> None:
    config = make_config(tmp_path, gpu_sanitize=False)
    assert released(config, BDF) == []
    assert CustodyStore(config).get(BDF).state == state.FREE


def test_check_resets_a_quarantined_gpu_and_frees_it(config: Config) -> None:
    with host_lock(config.lock_path):
        CustodyStore(config).put(Custody(BDF, state=state.QUARANTINED, reason="AER"), "test")
    result = work.check(config, locker(config), BDF, lambda: None)
    assert result.record.state == state.FREE


def test_check_refuses_a_held_gpu(config: Config) -> None:
    with pytest.raises(FailedPrecondition, match="held by domain vmsbx-a"):
        work.check(config, locker(config), BDF, lambda: "domain vmsbx-a")


def test_a_failed_check_is_failed_and_only_a_forced_release_frees_it(
    config: Config, tree: Path
) -> None:
    fake_sysfs.gpu(tree, BDF, all_ones=True)
    with host_lock(config.lock_path):
        CustodyStore(config).put(Custody(BDF, state=state.QUARANTINED, reason="AER"), "test")
    host = Host(sysfs=str(tree), reset_timeout=0.1)
    result = work.check(config, locker(config), BDF, lambda: None, host=host)
    assert result.record.state == state.FAILED and "all ones" in result.record.reason
    record = work.force_release(config, locker(config), BDF, "uid 0 (root)")
    assert record.state == state.FREE
    last = CustodyStore(config).read_log()[-1]
    assert (last["operator"], last["was"]) == ("uid 0 (root)", "failed")


def test_another_tools_domain_is_recorded_as_the_holder(config: Config) -> None:
    with host_lock(config.lock_path):
        work.assign_foreign(config, BDF, "uuid-of-vm", "their-vm")
    record = CustodyStore(config).get(BDF)
    assert (record.state, record.owner) == (state.ASSIGNED, "uuid-of-vm")
