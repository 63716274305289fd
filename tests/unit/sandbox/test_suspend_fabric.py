"""Suspend and resume of GPU sandboxes in shared NVSwitch mode (sandbox/suspend.py, resume.py)
on the in-memory hypervisor, the HGX fake host with its NVSwitches (GPUs made AMD cards,
framework/gpu_guests.py) and the fake fmpm (tests/fixtures/fmpm, H100 table): a suspend
deactivates the sandbox's Fabric Manager partition once its GPUs are out of the guest, a
resume activates a free partition of the same size, and a suspend or resume that failed or
was killed halfway never leaves a partition active under no guest, nor deactivates one whose
GPUs are in a guest."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from framework import gpu_guests
from framework.fabric import FAKE_FMPM
from framework.fake_hypervisor import FakeHypervisor, refuse, unit_config
from framework.gpu_guests import FakeGuest, amd_board, board_manager, buses, held_by, record

from vmsandbox.config import Config
from vmsandbox.errors import FailedPrecondition, ResourceExhausted
from vmsandbox.gpu.custody.store import CustodyStore
from vmsandbox.host.model import Inventory
from vmsandbox.sandbox import resume, suspend
from vmsandbox.sandbox.holds import Holds
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.sandbox.record import SandboxRecord

DRIVER = "535.216.01"  # Fabric Manager's release, and the image's NVIDIA driver


class Killed(BaseException):
    """The process killed here: nothing of the call runs after it, not even its recovery."""


@pytest.fixture
def config(tmp_path: Path) -> Config:
    """A host in shared NVSwitch mode (FABRIC_MODE=1) with the fake fmpm, whose Fabric Manager
    and ``tiny`` image's NVIDIA driver are both DRIVER."""
    fm_config = tmp_path / "fabricmanager.cfg"
    fm_config.write_text("FABRIC_MODE=1\n")
    made = unit_config(
        tmp_path, fmpm=str(FAKE_FMPM), fm_version=DRIVER, fabric_manager_config=fm_config
    )
    meta = made.images / "tiny" / "current" / "meta.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "nvidia_driver_version": DRIVER}))
    return made


@pytest.fixture(scope="module")
def board(hgx: Inventory) -> Inventory:
    return amd_board(hgx, switches=True)


@pytest.fixture
def guest(hv: FakeHypervisor, board: Inventory) -> FakeGuest:
    return FakeGuest(hv, board)


@pytest.fixture
def manager(
    config: Config, hv: FakeHypervisor, board: Inventory, guest: FakeGuest, fm: Path
) -> Iterator[SandboxManager]:
    with board_manager(config, hv, board, guest) as made:
        yield made


def gpu_box(manager: SandboxManager, name: str = "box", count: int = 2) -> SandboxRecord:
    return gpu_guests.gpu_box(manager, name, count)


def active(fm: Path) -> list[int]:
    file = fm / "active.json"
    return sorted(json.loads(file.read_text())) if file.exists() else []


def calls(fm: Path) -> list[str]:
    log = fm / "calls.log"
    return log.read_text().splitlines() if log.exists() else []


def ledger(config: Config) -> dict[int, str]:
    """Partition -> the sandbox leasing it."""
    folder = config.state_dir / "fabric"
    entries = folder.glob("*.json") if folder.is_dir() else []
    return {int(p.stem): json.loads(p.read_text())["sandbox"] for p in entries}


def partition_held(config: Config, hv: FakeHypervisor, name: str = "box") -> int | None:
    """The partition the sandbox's hold names (None: none)."""
    hold = Holds(config).get(hv.domains[f"vmsbx-{name}"].uuid)
    assert hold is not None
    return hold.partition


def free(config: Config, bdfs: list[str]) -> bool:
    return all(CustodyStore(config).get(bdf).state == "free" for bdf in bdfs)


def kill_at(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> None:
    """``module.name`` kills the call, which then leaves its state to reconcile."""

    def killed(*_args: object, **_kwargs: object) -> None:
        raise Killed

    monkeypatch.setattr(module, name, killed)
    monkeypatch.setattr(suspend, "recover", lambda *_a, **_k: None)
    monkeypatch.setattr(resume, "recover", lambda *_a, **_k: None)


def test_a_suspend_deactivates_the_partition_and_frees_its_gpus(
    manager: SandboxManager, hv: FakeHypervisor, config: Config, fm: Path
) -> None:
    made = gpu_box(manager)
    assert made.fabric_partition == 4 and active(fm) == [4] and ledger(config) == {4: "box"}
    sandbox = manager.suspend("box")
    assert sandbox.state == "suspended" and hv.domains["vmsbx-box"].saved
    assert calls(fm)[-2:] == ["-l", "-d 4"] and active(fm) == [] and ledger(config) == {}
    now = record(hv)
    assert now.fabric_partition is None and now.gpus == ()
    assert now.suspended is not None and now.suspended.partition_size == 2
    assert partition_held(config, hv) is None and held_by(config, hv) == set()
    assert free(config, [gpu.bdf for gpu in made.gpus])  # sanitized: not waiting for FM


def test_a_resume_activates_a_partition_of_the_same_size_and_attaches_its_gpus(
    manager: SandboxManager, hv: FakeHypervisor, config: Config, fm: Path, guest: FakeGuest
) -> None:
    made = gpu_box(manager)
    slots = buses(hv)
    manager.suspend("box")
    other = gpu_box(manager, "other")  # takes the partition the suspended sandbox gave back
    assert other.fabric_partition == 4
    sandbox = manager.resume("box")
    assert sandbox.state == "ready" and sandbox.verification and sandbox.verification["ok"]
    now = record(hv)
    assert now.fabric_partition not in (None, 4) and now.suspended is None
    assert calls(fm)[-1] == f"-a {now.fabric_partition}"
    assert active(fm) == sorted([4, now.fabric_partition])
    assert ledger(config) == {4: "other", now.fabric_partition: "box"}
    assert partition_held(config, hv) == now.fabric_partition
    assert len(now.gpus) == 2 and not {g.bdf for g in now.gpus} & {g.bdf for g in made.gpus}
    assert held_by(config, hv) == {gpu.bdf for gpu in now.gpus} and buses(hv) == slots
    assert any("python3 - revive" in c for c in guest.commands)
    manager.destroy("box")  # its new partition goes with it
    assert active(fm) == [4] and ledger(config) == {4: "other"}


def test_a_resume_without_a_free_partition_of_its_size_stays_suspended(
    manager: SandboxManager, hv: FakeHypervisor, config: Config, fm: Path
) -> None:
    gpu_box(manager)
    manager.suspend("box")
    gpu_box(manager, "all", count=8)  # partition 0: every GPU
    before, asked = record(hv), len(calls(fm))
    with pytest.raises(ResourceExhausted, match=r"partition of 2 GPU.*stays suspended") as caught:
        manager.resume("box")
    assert caught.value.details["partition_size"] == 2
    message = caught.value.message
    assert "(partition " in message and "retry once" not in message  # why each is not free
    assert calls(fm)[asked:] == ["-l"]  # FM's table read; nothing activated
    assert manager.get("box").state == "suspended" and record(hv) == before
    assert held_by(config, hv) == set() and partition_held(config, hv) is None
    assert active(fm) == [0] and ledger(config) == {0: "all"}
    manager.destroy("all")
    assert manager.resume("box").state == "ready"


def test_a_resume_whose_image_driver_is_not_fms_activates_nothing(
    manager: SandboxManager, hv: FakeHypervisor, config: Config, fm: Path
) -> None:
    made = gpu_box(manager)
    manager.suspend("box")
    meta = config.images / "tiny" / "current" / "meta.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "nvidia_driver_version": "550"}))
    with pytest.raises(FailedPrecondition, match="has NVIDIA driver 550, but this host's"):
        manager.resume("box")
    assert manager.get("box").state == "suspended" and active(fm) == [] and ledger(config) == {}
    assert held_by(config, hv) == set() and partition_held(config, hv) is None
    assert record(hv).fabric_partition is None and free(config, [g.bdf for g in made.gpus])


def test_a_resume_that_fails_after_the_activation_deactivates_the_partition(
    manager: SandboxManager, hv: FakeHypervisor, config: Config, fm: Path
) -> None:
    gpu_box(manager)
    manager.suspend("box")
    hv.before["attach"] = refuse("attach refused")
    with pytest.raises(FailedPrecondition, match="attach refused"):
        manager.resume("box")
    # restored, its GPUs never came: saved again, and the partition it activated deactivated
    activated = int(next(c for c in reversed(calls(fm)) if c.startswith("-a")).split()[1])
    assert calls(fm)[-1] == f"-d {activated}" and active(fm) == [] and ledger(config) == {}
    assert manager.get("box").state == "suspended" and held_by(config, hv) == set()
    assert partition_held(config, hv) is None and record(hv).fabric_partition is None
    del hv.before["attach"]
    assert manager.resume("box").state == "ready"


def test_a_suspend_whose_detach_fails_keeps_the_partition_of_the_gpus_in_the_guest(
    manager: SandboxManager, hv: FakeHypervisor, config: Config, fm: Path
) -> None:
    made = gpu_box(manager)
    hv.before["detach"] = refuse("detach refused")
    with pytest.raises(FailedPrecondition, match="detach refused"):
        manager.suspend("box")
    assert manager.get("box").state == "ready" and record(hv).fabric_partition == 4
    assert held_by(config, hv) == {gpu.bdf for gpu in made.gpus}
    assert partition_held(config, hv) == 4 and active(fm) == [4] and ledger(config) == {4: "box"}
    assert manager.reconcile()["fabric_partitions"] == []  # its GPUs are in the guest: kept
    assert active(fm) == [4]


def test_fm_down_at_suspend_leaves_the_partition_to_reconcile(
    manager: SandboxManager, hv: FakeHypervisor, config: Config, fm: Path
) -> None:
    """The GPUs are out of the guest, so the suspend goes on; the lease stays, the GPUs wait
    for it sanitizing, and reconcile deactivates it once FM answers."""
    made = gpu_box(manager)
    (fm / "unreachable").touch()
    assert manager.suspend("box").state == "suspended"
    assert ledger(config) == {4: "box"} and partition_held(config, hv) is None
    bdfs = [gpu.bdf for gpu in made.gpus]
    assert {CustodyStore(config).get(bdf).state for bdf in bdfs} == {"sanitizing"}
    assert "cannot be reached" in manager.reconcile()["problems"][0]
    assert ledger(config) == {4: "box"}
    (fm / "unreachable").unlink()
    assert manager.reconcile()["fabric_partitions"] == ["4"]
    assert active(fm) == [] and ledger(config) == {} and free(config, bdfs)
    assert manager.get("box").state == "suspended"


def test_a_suspend_killed_before_the_deactivation_is_ready_and_its_partition_released(
    manager: SandboxManager,
    hv: FakeHypervisor,
    config: Config,
    fm: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Killed once its GPUs were out of the guest, before the deactivation: reconcile settles it
    ready without GPUs, and its partition, which no guest's GPU is in, is deactivated."""
    made = gpu_box(manager)
    kill_at(monkeypatch, suspend, "_deactivate")
    with pytest.raises(Killed):
        manager.suspend("box")
    assert active(fm) == [4] and partition_held(config, hv) == 4
    report = manager.reconcile()
    assert report["settled"] == ["box: ready"] and report["fabric_partitions"] == ["4"]
    assert active(fm) == [] and ledger(config) == {} and partition_held(config, hv) is None
    assert record(hv).fabric_partition is None and record(hv).gpus == ()
    assert held_by(config, hv) == set() and free(config, [gpu.bdf for gpu in made.gpus])


def test_a_suspend_killed_after_the_deactivation_is_ready_without_a_partition(
    manager: SandboxManager,
    hv: FakeHypervisor,
    config: Config,
    fm: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made = gpu_box(manager)
    kill_at(monkeypatch, suspend, "_release")
    with pytest.raises(Killed):
        manager.suspend("box")
    assert active(fm) == [] and ledger(config) == {} and partition_held(config, hv) == 4
    assert manager.reconcile()["settled"] == ["box: ready"]
    assert partition_held(config, hv) is None and record(hv).fabric_partition is None
    assert held_by(config, hv) == set() and free(config, [gpu.bdf for gpu in made.gpus])


def test_a_resume_killed_after_the_activation_stays_suspended_and_deactivates_it(
    manager: SandboxManager, hv: FakeHypervisor, config: Config, fm: Path
) -> None:
    """Killed with its partition active, before the guest was restored: reconcile settles it
    suspended, with nothing held, and deactivates the partition."""
    gpu_box(manager)
    manager.suspend("box")
    with pytest.MonkeyPatch.context() as patch:
        kill_at(patch, resume.netguard, "before_start")
        with pytest.raises(Killed):
            manager.resume("box")
    taken = record(hv)
    assert taken.fabric_partition is not None and active(fm) == [taken.fabric_partition]
    report = manager.reconcile()
    assert report["settled"] == ["box: suspended"]
    assert report["fabric_partitions"] == [str(taken.fabric_partition)]
    assert active(fm) == [] and ledger(config) == {} and partition_held(config, hv) is None
    assert record(hv).fabric_partition is None and held_by(config, hv) == set()
    assert free(config, [gpu.bdf for gpu in taken.gpus])
    assert manager.resume("box").state == "ready"
