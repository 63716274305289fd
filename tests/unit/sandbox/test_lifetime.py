"""Lifetimes on the fake hypervisor (tests/framework/fake_hypervisor.py): a ttl becomes the
record's expiry, extend pushes it later, reap destroys what has expired by its identity and
nothing at all when libvirt cannot list every sandbox."""

from __future__ import annotations

import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
from framework.fake_hypervisor import FakeHypervisor, unit_config

from vmsandbox.errors import FailedPrecondition, InvalidArgument, Unavailable
from vmsandbox.sandbox import expiry
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.sandbox.record import SandboxRecord
from vmsandbox.sandbox.spec import SandboxSpec


def spec(name: str, ttl: float | None = None) -> SandboxSpec:
    return SandboxSpec(name=name, image="tiny", memory_mib=256, disk_gib=1, ttl=ttl)


def age(hv: FakeHypervisor, name: str, seconds: float) -> None:
    """Move sandbox ``name``'s expiry ``seconds`` into the past, as time passing would."""
    dom = hv.domains[f"vmsbx-{name}"]
    assert dom.data is not None
    record = SandboxRecord.from_dict(dom.data)
    assert record.expires_at is not None
    end = expiry.parse(record.expires_at)
    assert end is not None
    earlier = expiry.stamp(end - timedelta(seconds=seconds))
    dom.data = replace(record, expires_at=earlier).to_dict()


def test_a_ttl_becomes_the_records_expiry_and_the_time_left(manager: SandboxManager) -> None:
    sandbox = manager.create(spec("short", ttl=7200), wait=False)
    assert sandbox.expires_at is not None
    left = sandbox.to_dict()["expires_in_seconds"]
    assert 7190 <= left <= 7200
    forever = manager.create(spec("long"), wait=False)
    assert forever.expires_at is None and forever.to_dict()["expires_in_seconds"] is None


@pytest.mark.parametrize("ttl", [0, -1, float("nan"), float("inf"), 400 * 86400, "2h", True])
def test_a_ttl_that_is_no_lifetime_is_refused_naming_the_field(ttl: object) -> None:
    with pytest.raises(InvalidArgument, match="ttl") as caught:
        spec("x", ttl=ttl)  # type: ignore[arg-type]
    assert caught.value.details["field"] == "ttl"


def test_reap_destroys_the_expired_and_keeps_the_rest(
    manager: SandboxManager, hv: FakeHypervisor
) -> None:
    manager.create(spec("old", ttl=60), wait=False)
    manager.create(spec("young", ttl=3600), wait=False)
    manager.create(spec("forever"), wait=False)
    age(hv, "old", 120)
    reaped = manager.reap()
    assert reaped.destroyed == ["old"] and reaped.failed == {}
    assert sorted(s.name for s in manager.list()) == ["forever", "young"]
    assert manager.reap().destroyed == []


def test_reap_with_libvirt_failing_to_list_destroys_nothing(
    manager: SandboxManager, hv: FakeHypervisor
) -> None:
    manager.create(spec("old", ttl=60), wait=False)
    age(hv, "old", 120)

    def down(_prefix: str) -> None:
        raise Unavailable("libvirtd went away while listing domains")

    hv.before["list"] = down
    calls = len(hv.calls)
    with pytest.raises(Unavailable):
        manager.reap()
    assert not [call for call in hv.calls[calls:] if call[0] in ("stop", "undefine")]
    del hv.before["list"]
    assert [s.name for s in manager.list()] == ["old"]


def test_reap_reports_a_sandbox_it_cannot_destroy_and_reaps_the_others(
    manager: SandboxManager, hv: FakeHypervisor
) -> None:
    for name in ("stuck", "gone"):
        manager.create(spec(name, ttl=60), wait=False)
        age(hv, name, 120)

    def refuse_stuck(domain: str) -> None:
        if domain == "vmsbx-stuck":
            raise FailedPrecondition("the domain cannot be stopped")

    hv.before["stop"] = refuse_stuck
    reaped = manager.reap()
    assert reaped.destroyed == ["gone"]
    assert reaped.failed["stuck"]["code"] == "FAILED_PRECONDITION"


def test_extend_pushes_the_expiry_and_saves_an_expired_sandbox(
    manager: SandboxManager, hv: FakeHypervisor
) -> None:
    manager.create(spec("box", ttl=600), wait=False)
    before = manager.get("box").to_dict()["expires_in_seconds"]
    after = manager.extend("box", 3600).to_dict()["expires_in_seconds"]
    assert 3590 <= after - before <= 3600
    age(hv, "box", 10_000)  # expired now: extend counts from now
    assert manager.get("box").to_dict()["expires_in_seconds"] == 0
    assert 1790 <= manager.extend("box", 1800).to_dict()["expires_in_seconds"] <= 1800
    assert manager.reap().destroyed == []


def test_extend_refuses_a_sandbox_without_a_lifetime_and_a_bad_duration(
    manager: SandboxManager,
) -> None:
    manager.create(spec("forever"), wait=False)
    with pytest.raises(FailedPrecondition, match="no lifetime"):
        manager.extend("forever", 60)
    manager.create(spec("box", ttl=60), wait=False)
    with pytest.raises(InvalidArgument, match="duration"):
        manager.extend("box", -5)


def test_an_unreadable_expiry_is_never_taken_for_a_past_one(
    manager: SandboxManager, hv: FakeHypervisor
) -> None:
    manager.create(spec("odd", ttl=60), wait=False)
    dom = hv.domains["vmsbx-odd"]
    assert dom.data is not None
    dom.data = {**dom.data, "expires_at": "yesterday"}
    assert manager.reap().destroyed == []
    assert manager.get("odd").to_dict()["expires_in_seconds"] is None


def test_another_state_directorys_expired_sandbox_is_left_to_its_own_reaper(
    tmp_path: Path, hv: FakeHypervisor
) -> None:
    other = unit_config(tmp_path / "other")
    with SandboxManager(other, hypervisor=hv, reconcile=False) as theirs:
        theirs.create(spec("theirs", ttl=60), wait=False)
    age(hv, "theirs", 120)
    with SandboxManager(unit_config(tmp_path / "ours"), hypervisor=hv, reconcile=False) as ours:
        assert ours.reap().destroyed == []
    assert "vmsbx-theirs" in hv.domains


def test_the_reaper_reaps_every_round_and_outlives_a_failed_one() -> None:
    """``vmsandbox serve``'s reaper: a round that fails (libvirtd away) is logged and the next
    one runs; ``close`` stops it."""
    import threading

    from vmsandbox.sandbox.lifetime import Reaped, Reaper

    rounds: list[int] = []
    enough = threading.Event()

    def reap_once() -> Reaped:
        rounds.append(len(rounds))
        if len(rounds) == 1:
            raise Unavailable("libvirtd went away")
        if len(rounds) >= 3:
            enough.set()
        return Reaped(destroyed=["old"])

    reaper = Reaper(reap_once, every=0.01)
    reaper.start()
    assert enough.wait(10)
    reaper.close()
    done = len(rounds)
    time.sleep(0.05)
    assert len(rounds) == done >= 3
