"""The host's end of the in-guest GPU hand-over (guest/quiesce.py): the program fed to
``sudo -n python3 -`` with its arguments, and its answers read as reports or errors. A fake
runner stands in for SSH."""

from __future__ import annotations

import json
from typing import Any

import pytest

from vmsandbox.errors import FailedPrecondition, Internal
from vmsandbox.guest import quiesce
from vmsandbox.guest.ssh import ExecResult


def runner(status: int, answer: Any, seen: list[tuple[str, bytes]] | None = None) -> Any:
    def run(command: str, *, stdin: bytes, timeout: float) -> ExecResult:
        if seen is not None:
            seen.append((command, stdin))
        text = answer if isinstance(answer, str) else json.dumps(answer) + "\n"
        return ExecResult(status, text, "")

    return run


def test_the_program_is_fed_with_the_ids_and_force() -> None:
    seen: list[tuple[str, bytes]] = []
    report = quiesce.quiesce(
        runner(0, {"unloaded": ["nvidia"]}, seen), ["10de:2330"], force=True, name="box"
    )
    assert report == {"unloaded": ["nvidia"]}
    command, stdin = seen[0]
    assert command == "sudo -n python3 - quiesce --force 10de:2330"
    assert stdin == quiesce.program() and b"def revive" in stdin


def test_processes_holding_a_gpu_are_named_with_the_way_out() -> None:
    run = runner(quiesce.EXIT_HELD, {"held": {"4242": "train"}})
    with pytest.raises(FailedPrecondition, match=r"4242 \(train\).*--force") as caught:
        quiesce.quiesce(run, ["10de:2330"], force=False, name="box")
    assert caught.value.details["processes"] == {"4242": "train"}


def test_a_failure_in_the_guest_says_why_and_garbage_is_internal() -> None:
    with pytest.raises(FailedPrecondition, match="no driver took"):
        quiesce.revive(runner(quiesce.EXIT_FAILED, {"error": "no driver took it"}), name="box")
    with pytest.raises(Internal):
        quiesce.revive(runner(0, "not json\n"), name="box")
