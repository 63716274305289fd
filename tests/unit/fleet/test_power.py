"""Stop and start through the fleet without a cluster: Ray's claims replaced by a dictionary
with GPUs per host, the agents by answers per host, the records by a dictionary store. A stop
the host maps to suspend gives the claim back and keeps the record; a start resumes on the
host that holds the save only, taking a claim of the same shape there first, RESOURCE_EXHAUSTED
(nothing held, still suspended) when that host has no room, UNAVAILABLE when it is lost."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from vmsandbox.errors import AlreadyExists, NotFound, ResourceExhausted, Unavailable
from vmsandbox.fleet import claims, model, power
from vmsandbox.fleet.claims import Claim
from vmsandbox.fleet.model import HostView, Record, Wish
from vmsandbox.fleet.records import Records

TWO = Wish(gpus=2).bundle()
STOP = b""


class Table:
    def __init__(self, *ready: str, lost: tuple[str, ...] = ()) -> None:
        self.views = {name: HostView(name, "ready", info={}) for name in ready}
        self.views.update({name: HostView(name, "lost") for name in lost})


@dataclass
class FakeFleet:
    answers: dict[str, dict[str, Any]]
    table: Table
    records: Records
    gateway: str = "gw"
    place_timeout: float = 1.0
    asked: list[str] = field(default_factory=list)

    def call(self, host: str, method: str, *args: Any) -> dict[str, Any]:
        self.asked.append(f"{args[2]} {host}")
        return self.answers.get(args[2], {"found": True, "state": "running"})

    def legacy_host(self, sandbox_id: str) -> str | None:
        return None


class Ray:
    """Claims as name -> (host, bundle); each host has ``gpus`` GPUs."""

    def __init__(self, gpus: dict[str, float]) -> None:
        self.gpus = gpus
        self.made: dict[str, tuple[str, dict[str, float]]] = {}

    def free(self, host: str) -> float:
        return self.gpus[host] - sum(
            b.get(model.GPU, 0.0) for h, b in self.made.values() if h == host
        )

    def place(self, name: str, bundle: dict, wait: float, selector: dict) -> str | None:
        host = selector[model.LABEL_HOST][3:-1]
        if name in self.made:
            raise AlreadyExists(f"claim {name!r} exists")
        if self.free(host) < bundle.get(model.GPU, 0.0):
            return None
        self.made[name] = (host, dict(bundle))
        return "node-" + host

    def find(self, name: str) -> Claim | None:
        if name not in self.made:
            return None
        host, bundle = self.made[name]
        return Claim(name, "CREATED", bundle, "node-" + host)


@pytest.fixture
def ray(monkeypatch: pytest.MonkeyPatch) -> Ray:
    fake = Ray({"a": 2.0, "b": 2.0})
    monkeypatch.setattr(claims, "place", fake.place)
    monkeypatch.setattr(claims, "find", fake.find)
    monkeypatch.setattr(claims, "remove", lambda name: fake.made.pop(name, None) is not None)
    return fake


def suspended_on_stop() -> dict[str, dict[str, Any]]:
    return {
        "StopSandbox": {"found": True, "state": "suspended", "gpus_before": 2},
        "StartSandbox": {"found": True, "state": "running", "runtime_identity": "r2"},
    }


def made_on_a(ray: Ray, store: Any, answers: dict[str, dict[str, Any]]) -> FakeFleet:
    fleet = FakeFleet(answers, Table("a", "b"), Records(store))
    fleet.records.add(Record("gw", "x", "box", "a", model.PLACED))
    ray.made["claim:gw:x"] = ("a", dict(TWO))
    return fleet


def run(fleet: FakeFleet, rpc: str) -> str:
    return power.Power(fleet, "x", rpc, STOP).run()


def test_a_suspend_gives_the_claim_back_and_keeps_the_record_with_its_shape(
    ray: Ray, store
) -> None:
    fleet = made_on_a(ray, store, suspended_on_stop())
    run(fleet, power.STOP)
    assert ray.made == {}  # the GPUs are the fleet's capacity again
    record = fleet.records.get("gw", "x")
    assert record == Record("gw", "x", "box", "a", model.PLACED, suspended=TWO)
    run(fleet, power.STOP)  # stopping again keeps the shape
    assert fleet.records.get("gw", "x").suspended == TWO


def test_a_stop_that_only_powers_off_keeps_the_claim(ray: Ray, store) -> None:
    fleet = made_on_a(ray, store, {"StopSandbox": {"found": True, "state": "stopped"}})
    run(fleet, power.STOP)
    assert ray.made == {"claim:gw:x": ("a", TWO)}
    assert fleet.records.get("gw", "x").suspended is None


def test_a_stop_whose_outcome_is_unknown_keeps_the_claim(ray: Ray, store) -> None:
    silent = {"error": {"code": "UNAVAILABLE", "message": "host a: the actor died"}}
    fleet = made_on_a(ray, store, {"StopSandbox": silent})
    with pytest.raises(Unavailable):
        run(fleet, power.STOP)
    assert "claim:gw:x" in ray.made
    assert fleet.records.get("gw", "x").suspended is None


def test_a_resume_takes_the_claim_again_on_the_host_of_the_save(ray: Ray, store) -> None:
    fleet = made_on_a(ray, store, suspended_on_stop())
    run(fleet, power.STOP)
    assert run(fleet, power.START) == "r2"
    assert ray.made == {"claim:gw:x": ("a", TWO)}
    assert fleet.records.get("gw", "x").suspended is None
    assert fleet.asked == ["StopSandbox a", "StartSandbox a"]


def test_no_room_on_the_host_of_the_save_is_exhausted_and_it_stays_suspended(
    ray: Ray, store
) -> None:
    fleet = made_on_a(ray, store, suspended_on_stop())
    run(fleet, power.STOP)
    ray.made["claim:gw:other"] = ("a", dict(TWO))  # its GPUs taken meanwhile; b has room
    with pytest.raises(ResourceExhausted, match="host a, which holds the save"):
        run(fleet, power.START)
    assert fleet.asked == ["StopSandbox a"]  # never asked b
    assert "claim:gw:x" not in ray.made
    assert fleet.records.get("gw", "x").suspended == TWO
    del ray.made["claim:gw:other"]
    assert run(fleet, power.START) == "r2"


def test_the_hosts_own_refusal_of_a_resume_gives_the_claim_back(ray: Ray, store) -> None:
    answers = suspended_on_stop()
    fleet = made_on_a(ray, store, answers)
    run(fleet, power.STOP)
    answers["StartSandbox"] = {
        "error": {"code": "RESOURCE_EXHAUSTED", "message": "no free GPU", "answered": True}
    }
    with pytest.raises(ResourceExhausted, match="no free GPU"):
        run(fleet, power.START)
    assert ray.made == {}
    assert fleet.records.get("gw", "x").suspended == TWO


def test_a_resume_whose_outcome_is_unknown_keeps_the_claim_and_the_next_reuses_it(
    ray: Ray, store
) -> None:
    answers = suspended_on_stop()
    fleet = made_on_a(ray, store, answers)
    run(fleet, power.STOP)
    answers["StartSandbox"] = {"error": {"code": "UNAVAILABLE", "message": "actor died"}}
    with pytest.raises(Unavailable):
        run(fleet, power.START)
    assert ray.made == {"claim:gw:x": ("a", TWO)}  # the host may have taken the GPUs
    answers["StartSandbox"] = {"found": True, "state": "running", "runtime_identity": "r3"}
    assert run(fleet, power.START) == "r3"
    assert ray.made == {"claim:gw:x": ("a", TWO)}


def test_a_lost_host_is_unavailable_and_never_resumed_elsewhere(ray: Ray, store) -> None:
    fleet = FakeFleet(suspended_on_stop(), Table("b", lost=("a",)), Records(store))
    fleet.records.add(Record("gw", "x", "box", "a", model.PLACED, suspended=TWO))
    with pytest.raises(Unavailable, match="host a, which is lost"):
        run(fleet, power.START)
    assert fleet.asked == [] and ray.made == {}


def test_a_sandbox_without_a_record_or_host_is_not_found(ray: Ray, store) -> None:
    fleet = FakeFleet({}, Table("a"), Records(store))
    with pytest.raises(NotFound):
        run(fleet, power.START)
    fleet.records.add(Record("gw", "x", "box", "a", model.PLACED))
    fleet.answers["StartSandbox"] = {"found": False}
    with pytest.raises(NotFound, match="not on host a"):
        run(fleet, power.START)


def test_an_adopted_sandbox_without_a_claim_is_given_the_shape_of_its_gpus(ray: Ray, store) -> None:
    fleet = FakeFleet(suspended_on_stop(), Table("a"), Records(store))
    fleet.records.add(Record("gw", "x", "box", "a", model.PLACED))
    run(fleet, power.STOP)
    assert fleet.records.get("gw", "x").suspended == TWO


def test_an_old_record_without_the_field_reads_as_not_suspended() -> None:
    old = b'{"gateway": "gw", "host": "a", "job": "", "name": "", "sandbox_id": "x", '
    old += b'"state": "placed"}'
    assert Record.from_json(old).suspended is None


def test_a_claim_left_waiting_for_room_is_removed_and_the_start_exhausted(
    ray: Ray, store, monkeypatch: pytest.MonkeyPatch
) -> None:
    fleet = FakeFleet(suspended_on_stop(), Table("a"), Records(store))
    fleet.records.add(Record("gw", "x", "box", "a", model.PLACED, suspended=TWO))
    ray.made["claim:gw:x"] = ("a", dict(TWO))
    monkeypatch.setattr(claims, "find", lambda name: Claim(name, "PENDING", TWO, None))
    with pytest.raises(ResourceExhausted):
        run(fleet, power.START)
    assert ray.made == {} and fleet.asked == []
