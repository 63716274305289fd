"""The placement loop without a cluster: unknown is not no. Only a host's own refusal (its
driver answered, or nothing was sent) moves a create on; a call that ended without the host's
word stops the create with UNAVAILABLE, its claim kept."""

from __future__ import annotations

from typing import Any

import pytest

from vmsandbox.errors import AlreadyExists, ResourceExhausted, Unavailable
from vmsandbox.fleet import model, placement
from vmsandbox.fleet.model import Wish

STEPS = [placement.Step({model.GPU: 1.0}, ("a", "b", "c"), 1.0)]


def first_allowed(_claim: str, _bundle: dict, _wait: float, selector: dict) -> str:
    return selector[model.LABEL_HOST][3:-1].split(",")[0]


def run(answers: dict[str, dict[str, Any]], released: list[tuple[str, bool]]) -> Any:
    def release(host: str, _why: str, made: bool) -> bool:
        released.append((host, made))
        return True

    return placement.run(
        STEPS, Wish(gpus=1), "claim:gw:x", first_allowed, lambda h: answers[h], release
    )


def failed(code: str, **seen: bool) -> dict[str, Any]:
    return {"error": {"code": code, "message": f"{code} here", **seen}}


def test_a_call_without_the_hosts_word_stops_the_create_and_keeps_its_claim() -> None:
    released: list[tuple[str, bool]] = []
    for silent in (failed("UNAVAILABLE"), failed("DEADLINE_EXCEEDED", answered=False)):
        with pytest.raises(Unavailable) as caught:
            run({"a": silent, "b": {"gpus": []}}, released)
        assert "host a did not answer" in caught.value.message
        assert caught.value.details["host"] == "a"
    assert released == []  # nothing given back, nothing tried elsewhere


def test_only_a_definite_refusal_moves_the_create_to_the_next_host() -> None:
    released: list[tuple[str, bool]] = []
    placed = run(
        {
            "a": failed("UNAVAILABLE", answered=True),  # its Fabric Manager is down: it said so
            "b": failed("UNAVAILABLE", sent=False),  # no agent: nothing was sent
            "c": {"gpus": [], "runtime_identity": "r"},
        },
        released,
    )
    assert placed.host == "c"
    assert released == [("a", False), ("b", False)]


def test_a_host_holding_another_sandbox_of_the_id_keeps_it() -> None:
    released: list[tuple[str, bool]] = []
    with pytest.raises(AlreadyExists):
        run({"a": failed("ALREADY_EXISTS", answered=True)}, released)
    assert released == []


def test_gpus_outside_the_wish_whose_delete_is_not_known_stop_the_create() -> None:
    answers = {"a": {"gpus": [{"model": "NVIDIA A10", "numa_node": 0}]}}
    with pytest.raises(Unavailable, match="host a did not answer"):
        placement.run(
            STEPS,
            Wish(gpus=1, model="A100"),
            "claim:gw:x",
            first_allowed,
            lambda h: answers[h],
            lambda *_a: False,
        )


def test_hosts_refused_before_are_left_out() -> None:
    tried: list[str] = []

    def place(claim: str, bundle: dict, wait: float, selector: dict) -> str | None:
        tried.append(selector[model.LABEL_HOST])
        return None

    with pytest.raises(ResourceExhausted, match="host a: it refused"):
        placement.run(
            STEPS, Wish(gpus=1), "c", place, lambda _h: {}, lambda *_a: True, {"a": "it refused"}
        )
    assert tried == ["in(b,c)"]
