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


def test_why_a_holder_was_not_checkpointed_is_in_the_refusal() -> None:
    why = "not checkpointed: its 7168 MiB of GPU memory needs about 7680 MiB of the guest's memory"
    run = runner(quiesce.EXIT_HELD, {"held": {"8": "big", "9": "viewer"}, "why": {"8": why}})
    with pytest.raises(FailedPrecondition) as caught:
        quiesce.quiesce(run, ["10de:2330"], force=False, name="box")
    assert f"8 (big: {why}), 9 (viewer); end them" in caught.value.message
    assert caught.value.details["why"] == {"8": why}


def test_the_time_limit_grows_with_the_gpu_memory_to_copy() -> None:
    limits: list[float] = []

    def run(command: str, *, stdin: bytes, timeout: float) -> ExecResult:
        limits.append(timeout)
        return ExecResult(0, "{}\n", "")

    quiesce.quiesce(run, ["10de:2330"], force=False, name="box", gpu_memory_mib=80 * 1024)
    quiesce.revive(run, name="box", gpu_memory_mib=80 * 1024)
    assert limits == [
        quiesce.TIMEOUT_S + 80 * quiesce.CHECKPOINT_S_PER_GIB,
        quiesce.TIMEOUT_S + 80 * quiesce.RESTORE_S_PER_GIB,
    ]
