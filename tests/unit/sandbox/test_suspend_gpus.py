"""Suspend and resume of GPU sandboxes (sandbox/suspend.py, resume.py, handover.py) against the
in-memory hypervisor, whose managed save refuses a guest holding a host device as libvirt does,
the HGX fake host's GPUs as umockdev discovery sees them (made AMD cards, so the verification
is the PCI check), and a fake guest that answers the GPU hand-over program, the wait for the
GPUs below their ports and lspci (framework/gpu_guests.py). A GPU is never held by two
sandboxes; a resume without free GPUs of the model leaves the sandbox suspended."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from framework.fake_hypervisor import FakeHypervisor
from framework.gpu_guests import (
    BoardManager,
    FakeGuest,
    amd_board,
    board_manager,
    buses,
    gpu_box,
    held_by,
    record,
)

from vmsandbox.config import Config
from vmsandbox.errors import FailedPrecondition, ResourceExhausted
from vmsandbox.gpu.custody.store import CustodyStore
from vmsandbox.host.model import Inventory
from vmsandbox.sandbox.holds import Holds
from vmsandbox.sandbox.manager import SandboxManager


@pytest.fixture(scope="module")
def board(hgx: Inventory) -> Inventory:
    """The HGX fake host's eight GPUs as AMD cards, without its NVSwitches."""
    return amd_board(hgx)


@pytest.fixture
def guest(hv: FakeHypervisor, board: Inventory) -> FakeGuest:
    return FakeGuest(hv, board)


@pytest.fixture
def manager(
    config: Config, hv: FakeHypervisor, board: Inventory, guest: FakeGuest
) -> Iterator[SandboxManager]:
    with board_manager(config, hv, board, guest) as made:
        yield made


def test_a_suspend_lets_the_gpus_go_in_the_guest_detaches_and_releases_them(
    manager: SandboxManager, hv: FakeHypervisor, config: Config, guest: FakeGuest
) -> None:
    made = gpu_box(manager, count=2)
    slots = buses(hv)
    sandbox = manager.suspend("box")
    assert sandbox.state == "suspended" and hv.domains["vmsbx-box"].saved
    assert any("python3 - quiesce 1002:74a1" in c for c in guest.commands)
    assert held_by(config, hv) == set() and record(hv).gpus == ()
    for gpu in made.gpus:  # released through custody, sanitized, free for the next tenant
        assert CustodyStore(config).get(gpu.bdf).state == "free"
        assert (CustodyStore(config).gpus / f"{gpu.bdf}.json").exists()
    kept = record(hv).suspended
    assert kept is not None and kept.gpus == made.gpus and list(kept.buses) == slots
    assert sandbox.suspended is not None and len(sandbox.suspended["gpus"]) == 2


def test_processes_that_hold_a_gpu_refuse_the_suspend_unless_forced(
    manager: SandboxManager, hv: FakeHypervisor, config: Config, guest: FakeGuest
) -> None:
    made = gpu_box(manager)
    guest.holders = {"4242": "python3 train.py"}
    with pytest.raises(FailedPrecondition, match=r"4242 \(python3 train.py\).*--force"):
        manager.suspend("box")
    assert hv.domains["vmsbx-box"].running and record(hv).gpus == made.gpus
    assert record(hv).suspended is None and held_by(config, hv) == {made.gpus[0].bdf}
    assert manager.get("box").state == "ready"
    assert manager.suspend("box", force=True).state == "suspended"


def test_a_sandbox_with_nvswitches_is_refused_before_anything_is_touched(
    manager: SandboxManager, hv: FakeHypervisor, config: Config, guest: FakeGuest
) -> None:
    """Full passthrough: the NVSwitches passed along cannot leave a running guest. The suspend
    says so, and the guest, its GPUs and its hold stay as they were."""
    made = gpu_box(manager)
    dom = hv.domains["vmsbx-box"]
    dom.data = {**(dom.data or {}), "switches": ["0000:05:00.0"]}
    before = manager.get("box").state
    words = r"NVSwitches 0000:05:00.0 are passed to it \(full passthrough\)"
    with pytest.raises(FailedPrecondition, match=f"cannot be suspended: {words}") as caught:
        manager.suspend("box")
    assert caught.value.details["name"] == "box"
    assert dom.running and dom.saved is None and record(hv).suspended is None
    assert held_by(config, hv) == {made.gpus[0].bdf}
    assert not any("quiesce" in c for c in guest.commands)
    assert manager.get("box").state == before


def test_a_resume_takes_a_free_gpu_of_the_model_at_the_old_slot_and_verifies(
    manager: SandboxManager, hv: FakeHypervisor, config: Config, guest: FakeGuest
) -> None:
    made = gpu_box(manager)
    slots = buses(hv)
    manager.suspend("box")
    other = gpu_box(manager, "other")  # takes the card the suspended sandbox let go
    assert other.gpus[0].bdf == made.gpus[0].bdf
    sandbox = manager.resume("box")
    assert sandbox.state == "ready" and sandbox.verification and sandbox.verification["ok"]
    now = record(hv)
    assert now.gpus[0].bdf != made.gpus[0].bdf and now.suspended is None
    assert buses(hv) == slots
    assert held_by(config, hv) == {now.gpus[0].bdf}
    assert held_by(config, hv, "other") == {made.gpus[0].bdf}
    assert any("python3 - revive" in c for c in guest.commands)


def test_a_resume_without_free_gpus_of_the_model_stays_suspended(
    manager: SandboxManager, hv: FakeHypervisor, config: Config
) -> None:
    gpu_box(manager)
    manager.suspend("box")
    gpu_box(manager, "all", count=8)
    with pytest.raises(ResourceExhausted, match="stays suspended"):
        manager.resume("box")
    assert manager.get("box").state == "suspended" and hv.domains["vmsbx-box"].saved
    assert held_by(config, hv) == set()
    manager.destroy("all")
    assert manager.resume("box").state == "ready"


def test_a_resume_never_takes_a_gpu_that_is_not_free_in_its_custody(
    manager: SandboxManager, hv: FakeHypervisor, config: Config
) -> None:
    """A quarantined GPU (as one sanitizing or being reset) is held by nobody, yet not free."""
    gpu_box(manager)
    manager.suspend("box")
    rest = gpu_box(manager, "rest", count=7)
    (left,) = [g.bdf for g in BoardManager.board.gpus if g.bdf not in {x.bdf for x in rest.gpus}]
    custody = CustodyStore(config)
    with manager.locked():
        custody.put(custody.get(left).moved("quarantined", reason="AER fatal"), "test")
    with pytest.raises(ResourceExhausted, match="stays suspended"):
        manager.resume("box")
    assert manager.get("box").state == "suspended" and held_by(config, hv) == set()


def test_a_failed_attach_leaves_it_suspended_with_no_gpu_held(
    manager: SandboxManager, hv: FakeHypervisor, config: Config
) -> None:
    gpu_box(manager)
    manager.suspend("box")

    def fail(_domain: str) -> None:
        raise FailedPrecondition("attach refused")

    hv.before["attach"] = fail
    with pytest.raises(FailedPrecondition, match="attach refused"):
        manager.resume("box")
    # restored, but its GPU never came: saved again, suspended, no GPU held (never two holders)
    assert manager.get("box").state == "suspended" and held_by(config, hv) == set()
    assert record(hv).suspended is not None and hv.domains["vmsbx-box"].saved
    del hv.before["attach"]
    assert manager.resume("box").state == "ready"


def test_a_resume_whose_gpu_is_never_seen_detaches_it_and_stays_suspended(
    manager: SandboxManager, hv: FakeHypervisor, config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vmsandbox.errors import DeadlineExceeded
    from vmsandbox.sandbox import handover

    gpu_box(manager)
    manager.suspend("box")

    def unseen(*_args: Any) -> None:
        raise DeadlineExceeded("the guest did not see GPU")

    monkeypatch.setattr(handover, "wait_until_seen", unseen)
    with pytest.raises(DeadlineExceeded):
        manager.resume("box")
    assert manager.get("box").state == "suspended" and held_by(config, hv) == set()


def test_a_resume_killed_with_gpus_reserved_gives_them_back_at_reconcile(
    manager: SandboxManager, hv: FakeHypervisor, config: Config
) -> None:
    """Killed after it reserved a GPU, before it restored the guest: the sandbox stays
    suspended and the GPU it reserved is let go."""
    from vmsandbox.lock import host_lock
    from vmsandbox.vm.process import ProcessIdentity

    made = gpu_box(manager)
    manager.suspend("box")
    uuid = hv.domains["vmsbx-box"].uuid
    with host_lock(config.lock_path, 5):
        holds = Holds(config)
        hold = holds.get(uuid)
        assert hold is not None
        dead = ProcessIdentity(pid=1, start="0", boot="another boot")
        holds.put(replace(hold, gpus=(made.gpus[0].bdf,), owner=dead, doing="resume"))
    manager.store.put(replace(record(hv), gpus=made.gpus), "resuming", uuid)
    assert held_by(config, hv) == {made.gpus[0].bdf}
    assert manager.reconcile()["settled"] == ["box: suspended"]
    assert held_by(config, hv) == set() and manager.get("box").state == "suspended"
    assert manager.resume("box").state == "ready"
