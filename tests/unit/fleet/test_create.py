"""One fleet create under its placement record, without a cluster: Ray's claims replaced by a
dictionary, the agents by answers per host, the records by a dictionary store. A host the
record names is asked first; only its own refusal moves the create elsewhere; an unknown
outcome keeps the record; a create that fails for good leaves no record."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from vmsandbox.errors import Unavailable
from vmsandbox.fleet import claims, create, model
from vmsandbox.fleet.model import HostView, Record, Wish
from vmsandbox.fleet.records import Records
from vmsandbox.openshell.proto import compute_driver_pb2 as pb

ME, OTHER = "01000000", "02000000"


class Table:
    def __init__(self, *ready: str, lost: tuple[str, ...] = ()) -> None:
        self.views = {name: HostView(name, "ready", info={}) for name in ready}
        self.views.update({name: HostView(name, "lost") for name in lost})

    def ready(self) -> list[HostView]:
        return [view for view in self.views.values() if view.state == "ready"]


@dataclass
class FakeFleet:
    answers: dict[str, dict[str, Any]]
    table: Table
    records: Records
    gateway: str = "gw"
    job: str = ME
    place_timeout: float = 1.0
    asked: list[str] = field(default_factory=list)

    def call(self, host: str, method: str, *args: Any) -> dict[str, Any]:
        self.asked.append(f"{method} {host}")
        return self.answers.get(host, {"gpus": []}) if method == "create" else {"deleted": True}

    def legacy_host(self, sandbox_id: str) -> str | None:
        return None


@pytest.fixture
def ray_claims(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Claims as name -> host, placed on the first host allowed; live jobs: ME and OTHER."""
    made: dict[str, str] = {}

    def place(name: str, bundle: dict, wait: float, selector: dict) -> str:
        made[name] = selector[model.LABEL_HOST][3:-1].split(",")[0]
        return made[name]

    monkeypatch.setattr(claims, "place", place)
    monkeypatch.setattr(claims, "remove", lambda name: made.pop(name, None) is not None)
    monkeypatch.setattr(claims, "wait_gone", lambda *_a: True)
    monkeypatch.setattr(claims, "live_jobs", lambda: {ME, OTHER})
    monkeypatch.setattr(claims, "nodes", lambda: [])
    monkeypatch.setattr(create.Create, "_place", lambda self, *a: place(*a))
    return made


def run(fleet: FakeFleet, sandbox_id: str = "x") -> Any:
    sandbox = pb.DriverSandbox(id=sandbox_id, name="box")
    return create.Create(fleet, sandbox, Wish()).run()


def silent() -> dict[str, Any]:
    return {"error": {"code": "UNAVAILABLE", "message": "host a: the actor died"}}


def refused() -> dict[str, Any]:
    return {"error": {"code": "RESOURCE_EXHAUSTED", "message": "full", "answered": True}}


def test_an_unknown_outcome_keeps_the_record_and_the_next_create_asks_that_host_first(
    ray_claims: dict[str, str], store
) -> None:
    fleet = FakeFleet({"a": silent()}, Table("a", "b"), Records(store))
    with pytest.raises(Unavailable, match="host a did not answer"):
        run(fleet)
    assert fleet.records.get("gw", "x") == Record("gw", "x", "box", "a", model.UNKNOWN, ME)
    assert ray_claims == {"claim:gw:x": "a"}  # kept
    fleet.answers["a"] = {"gpus": [], "runtime_identity": "r"}
    assert run(fleet).host == "a"
    assert fleet.asked == ["create a", "create a"]  # never placed anywhere else
    assert fleet.records.get("gw", "x") == Record("gw", "x", "box", "a", model.PLACED, ME)


def test_a_lost_host_the_record_names_is_unavailable_not_placed_around(
    ray_claims: dict[str, str], store
) -> None:
    fleet = FakeFleet({}, Table("b", lost=("a",)), Records(store))
    fleet.records.add(Record("gw", "x", "box", "a", model.UNKNOWN, OTHER))
    with pytest.raises(Unavailable, match="may be on host a, which is lost"):
        run(fleet)
    assert fleet.asked == []
    assert fleet.records.get("gw", "x").host == "a"


def test_the_named_hosts_own_refusal_moves_the_create_on(ray_claims: dict[str, str], store) -> None:
    fleet = FakeFleet({"a": refused()}, Table("a", "b"), Records(store))
    fleet.records.add(Record("gw", "x", "box", "a", model.UNKNOWN, ""))
    ray_claims["claim:gw:x"] = "a"
    assert run(fleet).host == "b"
    assert fleet.asked == ["create a", "create b"]
    assert ray_claims == {"claim:gw:x": "b"}


def test_another_live_process_placing_the_id_is_unavailable(
    ray_claims: dict[str, str], store
) -> None:
    fleet = FakeFleet({}, Table("a"), Records(store))
    fleet.records.add(Record("gw", "x", "box", job=OTHER))
    with pytest.raises(Unavailable, match="under way in another fleet process"):
        run(fleet)
    fleet.records.write(Record("gw", "x", "box", job="03000000"))  # its process died waiting
    ray_claims["claim:gw:x"] = "pending"
    assert run(fleet).host == "a"  # taken over, the dead process's claim removed first


def test_a_create_refused_everywhere_leaves_no_record(ray_claims: dict[str, str], store) -> None:
    fleet = FakeFleet({"a": refused(), "b": refused()}, Table("a", "b"), Records(store))
    with pytest.raises(Exception, match="after 2 tries"):
        run(fleet)
    assert fleet.records.get("gw", "x") is None
    assert ray_claims == {}
