"""A host's state from what was seen of it (``hosts.state_of``): a busy host whose agent
answers is ready, a host whose driver has not answered for DRIVER_LOST seconds is lost."""

from __future__ import annotations

from vmsandbox.fleet.hosts import DRIVER_LOST, MISSES, state_of


def answer(ready: bool = True, down: float | None = None) -> dict:
    return {"ready": ready, "driver_down_s": down}


def state(previous: str, **seen: object) -> str:
    return state_of(previous, **seen)[0]  # type: ignore[arg-type]


def test_a_host_whose_driver_stopped_answering_is_lost_after_driver_lost_seconds() -> None:
    seen = {"alive": True, "agent": True, "died": False, "misses": 0}
    assert state_of("joining", answer=answer(False, DRIVER_LOST), **seen)[1].startswith(  # type: ignore[arg-type]
        "its driver has not answered"
    )
    assert state("ready", answer=answer(), **seen) == "ready"
    assert state("ready", answer=answer(False, 0.5), **seen) == "joining"  # not ready: no work
    assert state("joining", answer=answer(False, DRIVER_LOST), **seen) == "lost"
    assert state("lost", answer=answer(False, None), **seen) == "joining"  # back: pins first
    assert state("joining", answer=answer(True, None), **seen) == "ready"


def test_a_host_is_lost_when_its_node_or_agent_died_or_it_missed_pings() -> None:
    assert state("ready", alive=False, agent=True, answer=answer(), died=False, misses=0) == (
        "lost"
    )
    assert state("ready", alive=True, agent=True, answer=None, died=True, misses=0) == "lost"
    assert state("ready", alive=True, agent=False, answer=None, died=False, misses=0) == "lost"
    assert state("joining", alive=True, agent=False, answer=None, died=False, misses=0) == (
        "joining"
    )
    late = {"alive": True, "agent": True, "answer": None, "died": False}
    assert state("ready", misses=MISSES - 1, **late) == "ready"
    assert state("ready", misses=MISSES, **late) == "lost"
