"""The parked pool against the in-memory hypervisor (tests/framework/fake_hypervisor.py, which
models managed save): a ``park`` shape's guests saved while they wait, shown ``parked``, left
alone by reconcile, restored by a claim, removed when their restore fails (the create then
boots cold) and by a drain. There is no guest: the wake after the restore (resume.py's, tested
there) is stubbed, and the hostname goes through a fake ``guest_run``. test_pool.py parks and
claims a real guest.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from framework.fake_hypervisor import FakeHypervisor, refuse, unit_config
from framework.fake_pool import pooled_guest

from vmsandbox.config import Config, PoolShape, parse_pool
from vmsandbox.errors import FailedPrecondition, InvalidArgument
from vmsandbox.guest.ssh import ExecResult
from vmsandbox.sandbox.holds import Holds
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.sandbox.pool import park
from vmsandbox.sandbox.spec import SandboxSpec
from vmsandbox.vm.process import ProcessIdentity

MIB = 1 << 20
DEAD = ProcessIdentity(pid=1, start="0", boot="another boot")
OTHER = ProcessIdentity.current()  # a live transition's owner
SHAPE = {"image": "tiny", "memory_mib": 256, "disk_gib": 1, "count": 1, "park": True}
HIT = SandboxSpec(name="hit", image="tiny", memory_mib=256, disk_gib=1)


@pytest.fixture
def config(tmp_path: Path) -> Config:
    """A state directory, an image store holding ``tiny``, a parked pool of one guest."""
    return unit_config(tmp_path, pool={"small": SHAPE})


@pytest.fixture
def woken(manager: SandboxManager, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The restored guests woken (stubbed); hostnames set through a guest_run that succeeds."""
    seen: list[str] = []

    def reach(_hv: Any, _config: Any, record: Any, *_rest: Any) -> park.resume.Reached:
        seen.append(record.name)
        return park.resume.Reached(0.1)

    monkeypatch.setattr(park.resume, "reach", reach)
    manager.pool.guest_run = lambda *_args, **_kw: ExecResult(0, "", "")
    return seen


def test_park_is_true_or_false() -> None:
    (shape,) = parse_pool({"big": {"image": "minimal", "park": True}})
    assert shape == PoolShape("big", "minimal", 1, 1024, 4, 1, park=True)
    assert shape.to_dict()["park"] is True
    with pytest.raises(InvalidArgument, match="allowed: true or false") as caught:
        parse_pool({"big": {"image": "minimal", "park": "yes"}})
    assert (caught.value.details["field"], caught.value.details["value"]) == (
        "pool.big.park",
        "'yes'",
    )


def test_a_parked_guest_holds_no_memory_and_is_shown_parked(
    manager: SandboxManager, config: Config, hv: FakeHypervisor
) -> None:
    guest = pooled_guest(manager)
    dom = hv.domains[f"vmsbx-{guest}"]
    assert (dom.state, dom.running) == ("parked", False)
    assert dom.saved is not None and dom.saved > 0
    (hold,) = Holds(config).all().values()
    assert (hold.pool, hold.owner, hold.saved_bytes) == ("small", None, dom.saved)
    (shape,) = manager.pool.show()
    assert shape["park"] is True and shape["ready"] == 1
    assert shape["guests"] == [{"name": guest, "state": "parked"}]
    assert manager.list() == []


def test_reconcile_keeps_a_parked_guest_and_its_save(
    manager: SandboxManager, hv: FakeHypervisor
) -> None:
    guest = pooled_guest(manager)
    saved = hv.domains[f"vmsbx-{guest}"].saved
    manager.reconcile()
    assert hv.domains[f"vmsbx-{guest}"].saved == saved
    assert manager.pool.show()[0]["guests"] == [{"name": guest, "state": "parked"}]


def test_a_claim_restores_a_parked_guest(
    manager: SandboxManager, config: Config, hv: FakeHypervisor, woken: list[str]
) -> None:
    guest = pooled_guest(manager)
    sandbox = manager.create(HIT)
    dom = hv.domains[f"vmsbx-{guest}"]
    assert (sandbox.name, sandbox.domain, sandbox.state) == ("hit", f"vmsbx-{guest}", "ready")
    assert (dom.running, dom.saved, dom.state) == (True, None, "ready")
    assert woken == ["hit"]
    assert sandbox.stage_seconds is not None and "restore" in sandbox.stage_seconds
    (hold,) = Holds(config).all().values()
    assert (hold.name, hold.saved_bytes, hold.pool) == ("hit", 0, None)


def test_a_wake_that_took_the_claim_leaves_the_hostname_step_nothing_to_do(
    manager: SandboxManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guest's wake and claim went in one exchange: no second request, no SSH login."""
    pooled_guest(manager)
    claimed: list[str] = []

    def reach(*args: Any) -> park.resume.Reached:
        claimed.append(args[-1])  # the claim's name, given to the wake
        return park.resume.Reached(0.1, claimed=True)

    def no_login(*_args: Any, **_kw: Any) -> ExecResult:
        raise AssertionError("the hostname went over SSH")

    monkeypatch.setattr(park.resume, "reach", reach)
    manager.pool.guest_run = no_login
    sandbox = manager.create(HIT)
    assert (sandbox.state, claimed) == ("ready", ["hit"])


def test_a_claimed_guests_save_counts_against_the_limit_until_it_is_restored(
    manager: SandboxManager, config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another suspend or park meanwhile must not take the room the save still fills."""
    pooled_guest(manager)
    counted: list[int] = []

    def reach(*_args: Any) -> park.resume.Reached:
        (hold,) = Holds(config).all().values()
        counted.append(hold.saved_bytes)
        return park.resume.Reached(0.1)

    monkeypatch.setattr(park.resume, "reach", reach)
    manager.pool.guest_run = lambda *_args, **_kw: ExecResult(0, "", "")
    manager.create(HIT)
    assert counted and counted[0] > 0
    (hold,) = Holds(config).all().values()
    assert hold.saved_bytes == 0


def test_a_guest_that_fails_to_restore_is_removed_and_the_create_boots_cold(
    manager: SandboxManager, hv: FakeHypervisor, woken: list[str]
) -> None:
    guest = pooled_guest(manager)
    corrupt = refuse("the save image is corrupt")
    hv.before["start"] = lambda domain: corrupt(domain) if domain == f"vmsbx-{guest}" else None
    sandbox = manager.create(HIT, wait=False)
    assert sandbox.domain == "vmsbx-hit" and woken == []
    assert f"vmsbx-{guest}" not in hv.domains  # taken apart with its save, never handed out


def test_a_drain_removes_a_parked_guest_with_its_save(
    manager: SandboxManager, config: Config, hv: FakeHypervisor
) -> None:
    guest = pooled_guest(manager)
    assert manager.pool.drain() == [guest]
    assert hv.domains == {} and Holds(config).all() == {}


def test_a_park_past_max_saved_gib_leaves_the_guest_running(
    manager: SandboxManager, config: Config, hv: FakeHypervisor
) -> None:
    manager.config = manager.pool.config = replace(config, max_saved_gib=0)
    guest = pooled_guest(manager)
    dom = hv.domains[f"vmsbx-{guest}"]
    assert (dom.state, dom.running, dom.saved) == ("pooled", True, None)
    (hold,) = Holds(manager.config).all().values()
    assert hold.saved_bytes == 0


def test_a_parked_guest_cannot_be_started_as_a_sandbox(
    manager: SandboxManager, hv: FakeHypervisor
) -> None:
    guest = pooled_guest(manager)
    with pytest.raises(FailedPrecondition, match="is a guest of the warm pool"):
        manager.start(guest)
    assert hv.domains[f"vmsbx-{guest}"].running is False


# -- a guest left running by a full max_saved_gib, parked once there is room ------------------


@pytest.fixture
def left_running(manager: SandboxManager, config: Config) -> str:
    """A pooled guest of the park shape that stayed running (max_saved_gib 0), then the limit
    raised again."""
    manager.config = manager.pool.config = replace(config, max_saved_gib=0)
    guest = pooled_guest(manager)
    manager.config = manager.pool.config = config
    return guest


def change_hold(manager: SandboxManager, **changes: Any) -> None:
    """The pool's one hold changed, under the lock, as another call would change it."""
    with manager.locked():
        holds = Holds(manager.config)
        (hold,) = holds.all().values()
        holds.put(replace(hold, **changes))


def test_a_guest_left_running_is_parked_by_the_next_fill_once_there_is_room(
    manager: SandboxManager, config: Config, hv: FakeHypervisor, left_running: str
) -> None:
    assert manager.pool._room_left()  # a create's refill_if_short starts a filler for it
    assert manager.pool.fill() == []  # no guest to boot: the shape has its one
    dom = hv.domains[f"vmsbx-{left_running}"]
    assert (dom.state, dom.running, dom.saved is not None) == ("parked", False, True)
    (hold,) = Holds(config).all().values()
    assert hold.saved_bytes == dom.saved and hold.owner is None and hold.doing == ""
    assert not manager.pool._room_left()


def test_a_guest_being_claimed_is_not_parked(
    manager: SandboxManager, config: Config, hv: FakeHypervisor, left_running: str
) -> None:
    change_hold(manager, owner=OTHER, doing="claim")
    assert park.park_waiting(config, hv, manager.locked, manager.pool.guests(), print) == []
    dom = hv.domains[f"vmsbx-{left_running}"]
    assert (dom.running, dom.saved) == (True, None)


def test_a_save_that_fails_leaves_the_guest_running_and_claimable(
    manager: SandboxManager, config: Config, hv: FakeHypervisor, left_running: str
) -> None:
    hv.before["save"] = refuse("no room on the disk")
    assert park.park_waiting(config, hv, manager.locked, manager.pool.guests(), print) == []
    dom = hv.domains[f"vmsbx-{left_running}"]
    assert (dom.state, dom.running, dom.saved) == ("pooled", True, None)
    (hold,) = Holds(config).all().values()
    assert (hold.saved_bytes, hold.owner, hold.pool) == (0, None, "small")
    assert manager.pool.fill() == []  # tries once, does not spin on it


def test_a_park_killed_halfway_leaves_the_guest_to_reconcile(
    manager: SandboxManager, config: Config, hv: FakeHypervisor, left_running: str
) -> None:
    change_hold(manager, owner=DEAD, doing="park", saved_bytes=256 * MIB)
    manager.reconcile()
    assert hv.domains == {} and Holds(config).all() == {}
