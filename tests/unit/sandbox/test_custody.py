"""A sandbox's GPUs through their custody (sandbox/custody.py, holds.py, teardown.py, runner.py)
on the in-memory hypervisor, the HGX fake host's GPUs and a fake sysfs where they reset: every
release sanitizes before the GPU is free again, a failed sanitize quarantines, a sanitize a
killed process left is finished by reconcile, and quarantined GPUs are never given."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from framework import fake_sysfs
from framework.fake_hypervisor import FakeHypervisor, refuse, unit_config
from framework.gpu_guests import BoardManager
from framework.inventories import discover_hosts

from vmsandbox.config import Config
from vmsandbox.errors import FailedPrecondition, ResourceExhausted
from vmsandbox.gpu.custody import state
from vmsandbox.gpu.custody.state import Custody
from vmsandbox.gpu.custody.store import CustodyStore
from vmsandbox.gpu.request import GpuRequest
from vmsandbox.host.model import Inventory
from vmsandbox.lock import host_lock
from vmsandbox.sandbox import custody
from vmsandbox.sandbox.holds import Holds
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.sandbox.spec import SandboxSpec
from vmsandbox.vm.process import ProcessIdentity


@pytest.fixture(scope="module")
def board(tmp_path_factory: pytest.TempPathFactory) -> Inventory:
    case = {"use_nvml": False, "proc_root": str(tmp_path_factory.mktemp("proc"))}
    hgx = discover_hosts({"hgx": ("hgx_h100", case)})["hgx"]
    return replace(hgx, fabric=())


@pytest.fixture
def tree(tmp_path: Path, board: Inventory) -> Path:
    tree = tmp_path / "sys" / "devices"
    for gpu in board.gpus:
        fake_sysfs.gpu(tree, gpu.bdf)
    return tree


@pytest.fixture
def config(tmp_path: Path, tree: Path) -> Config:
    return unit_config(tmp_path, pci_sysfs=tree)


@pytest.fixture
def manager(config: Config, hv: FakeHypervisor, board: Inventory) -> Iterator[SandboxManager]:
    BoardManager.board = board
    with BoardManager(config, hypervisor=hv, reconcile=False) as mgr:
        yield mgr


def gpu_spec(count: int, name: str = "box") -> SandboxSpec:
    return SandboxSpec(
        name=name, image="tiny", memory_mib=256, disk_gib=1, gpu=GpuRequest(count=count)
    )


def states(config: Config) -> dict[str, str]:
    return {bdf: record.state for bdf, record in CustodyStore(config).all().items()}


def test_destroy_sanitizes_each_gpu_before_it_is_free(
    manager: SandboxManager, config: Config
) -> None:
    sandbox = manager.create(gpu_spec(2), wait=False)
    gpus = [gpu["bdf"] for gpu in sandbox.to_dict()["gpus"]]
    assert states(config) == {}  # a reservation holds them: assigned by it
    manager.destroy("box")
    assert states(config) == dict.fromkeys(gpus, state.FREE)
    logged = CustodyStore(config).sanitizes()
    assert sorted(entry["bdf"] for entry in logged) == sorted(gpus)
    assert all(entry["ok"] and "reset" in entry["steps"] for entry in logged)
    again = manager.create(gpu_spec(2, "next"), wait=False)
    assert sorted(gpu["bdf"] for gpu in again.to_dict()["gpus"]) == sorted(gpus)


def test_a_failed_creates_undo_sanitizes_its_gpus(
    manager: SandboxManager, config: Config, hv: FakeHypervisor
) -> None:
    hv.before["start"] = refuse("no VFIO here")
    with pytest.raises(FailedPrecondition, match="no VFIO here"):
        manager.create(gpu_spec(1))
    (record,) = CustodyStore(config).all().values()
    assert record.state == state.FREE and CustodyStore(config).sanitizes()[0]["ok"]


def test_a_gpu_whose_sanitize_fails_is_quarantined_and_never_given(
    manager: SandboxManager, config: Config, tree: Path, board: Inventory
) -> None:
    sandbox = manager.create(gpu_spec(1), wait=False)
    (bdf,) = [gpu["bdf"] for gpu in sandbox.to_dict()["gpus"]]
    fake_sysfs.gpu(tree, bdf, clear_done=False)
    manager.destroy("box")
    record = CustodyStore(config).get(bdf)
    assert record.state == state.QUARANTINED and record.reason.startswith("memory-clear:")
    with pytest.raises(FailedPrecondition) as caught:
        manager.create(gpu_spec(len(board.gpus), "all"), wait=False)
    assert f"1 matching GPU is quarantined: {bdf} (quarantined: memory-clear:" in str(caught.value)
    seven = manager.create(gpu_spec(len(board.gpus) - 1, "seven"), wait=False)
    assert bdf not in [gpu["bdf"] for gpu in seven.to_dict()["gpus"]]


def test_a_sanitize_a_killed_process_left_is_finished_by_reconcile(
    manager: SandboxManager, config: Config
) -> None:
    sandbox = manager.create(gpu_spec(1), wait=False)
    (bdf,) = [gpu["bdf"] for gpu in sandbox.to_dict()["gpus"]]
    manager.destroy("box")
    dead = ProcessIdentity(pid=1, start="0", boot="another boot")
    with host_lock(config.lock_path):  # as a destroy killed in the middle of its sanitize
        CustodyStore(config).put(Custody(bdf, state=state.SANITIZING, worker=dead), "killed")
    with pytest.raises(ResourceExhausted, match=f"being sanitized or reset: {bdf} .sanitizing"):
        manager.create(gpu_spec(len(manager.board.gpus), "all"), wait=False)
    manager.reconcile()
    assert CustodyStore(config).get(bdf).state == state.FREE


def test_dropping_a_hold_marks_its_gpus_sanitizing_in_the_same_lock_hold(
    manager: SandboxManager, config: Config
) -> None:
    sandbox = manager.create(gpu_spec(1), wait=False)
    (bdf,) = [gpu["bdf"] for gpu in sandbox.to_dict()["gpus"]]
    with host_lock(config.lock_path):
        Holds(config).drop(sandbox.uuid)
        assert CustodyStore(config).get(bdf).state == state.SANITIZING
    assert custody.sanitize(config, manager.locked, [bdf]) == []
    assert CustodyStore(config).get(bdf).state == state.FREE


def test_held_by_names_the_reservation(manager: SandboxManager, config: Config) -> None:
    sandbox = manager.create(gpu_spec(1), wait=False)
    (bdf,) = [gpu["bdf"] for gpu in sandbox.to_dict()["gpus"]]
    with host_lock(config.lock_path):
        assert custody.held_by(config, manager.hypervisor, bdf) == f"sandbox box ({sandbox.uuid})"


FOREIGN = """<domain type='qemu'><name>their-vm</name><uuid>{uuid}</uuid><devices>
<hostdev mode='subsystem' type='pci' managed='yes'><source>
<address domain='0x0000' bus='0x{bus}' slot='0x00' function='0x0'/></source></hostdev>
</devices></domain>"""


def test_another_tools_gpu_is_sanitized_once_its_domain_lets_it_go(
    manager: SandboxManager, config: Config, hv: FakeHypervisor, board: Inventory
) -> None:
    bdf = board.gpus[-1].bdf
    uuid = "6b1c0a57-2d64-4c10-9a3e-0d1f3b7c9e21"
    hv.define(FOREIGN.format(uuid=uuid, bus=bdf.split(":")[1]))
    manager.reconcile()
    record = CustodyStore(config).get(bdf)
    assert (record.state, record.owner) == (state.ASSIGNED, uuid)
    hv.undefine("their-vm")
    with pytest.raises(ResourceExhausted):  # not free until it was sanitized
        manager.create(gpu_spec(len(board.gpus), "all"), wait=False)
    manager.reconcile()
    assert CustodyStore(config).get(bdf).state == state.FREE
    assert CustodyStore(config).sanitizes()[-1]["bdf"] == bdf
