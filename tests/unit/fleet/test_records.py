"""The fleet's durable records over a dictionary in place of Ray's control store: placement
records written only where none is, per gateway, and host names bound to one machine until
released."""

from __future__ import annotations

import pytest

from vmsandbox.errors import FailedPrecondition
from vmsandbox.fleet import model
from vmsandbox.fleet.model import Record
from vmsandbox.fleet.records import Records


def test_a_record_is_made_once_per_gateway_and_id_and_says_where_it_may_be(store) -> None:
    records = Records(store)
    first = Record("gw-a", "x", "box", job="01000000")
    assert records.add(first) is True
    assert records.add(Record("gw-a", "x", "other")) is False  # one create of an id wins
    assert records.add(Record("gw-b", "x", "theirs")) is True  # ids belong to their gateway
    records.write(first.on("h1", model.UNKNOWN))
    assert records.get("gw-a", "x") == Record("gw-a", "x", "box", "h1", model.UNKNOWN, "01000000")
    assert [r.gateway for r in records.of("gw-b")] == ["gw-b"]
    assert {r.gateway for r in records.of()} == {"gw-a", "gw-b"}
    assert records.recorded() == {("gw-a", "x"), ("gw-b", "x")}
    records.drop("gw-a", "x")
    assert records.get("gw-a", "x") is None


def test_a_record_names_a_host_exactly_when_one_may_hold_the_sandbox() -> None:
    with pytest.raises(ValueError):
        Record("gw", "x", host="h1", state=model.PLACING)
    with pytest.raises(ValueError):
        Record("gw", "x", host=None, state=model.UNKNOWN)
    assert Record.from_json(Record("gw", "x", "n", "h", model.PLACED).to_json()).host == "h"


def test_only_another_live_process_placing_or_creating_makes_a_record_busy() -> None:
    placing = Record("gw", "x", job="02000000")
    assert placing.busy({"02000000"}, me="01000000")
    assert not placing.busy(set(), me="01000000")  # its process is dead: anyone takes it over
    assert not placing.busy({"02000000"}, me="02000000")
    assert not placing.on("h", model.UNKNOWN).busy({"02000000"}, me="01000000")


def test_a_host_name_stays_with_its_machine_until_released(store) -> None:
    records = Records(store)
    records.bind("wa", "sha256:one", "node-1")
    records.bind("wa", "sha256:one", "node-2")  # the same machine joins again
    assert records.binding("wa") == model.Binding("wa", "sha256:one", "node-2")
    with pytest.raises(FailedPrecondition, match="vmsandbox fleet release wa"):
        records.bind("wa", "sha256:two")
    records.add(Record("gw", "x", "n", "wa", model.PLACED))
    records.add(Record("gw", "y", "n", "wb", model.PLACED))
    forgotten = records.release("wa")
    assert [r.sandbox_id for r in forgotten] == ["x"]
    assert [r.sandbox_id for r in records.of()] == ["y"]
    assert records.bind("wa", "sha256:two").key == "sha256:two"
