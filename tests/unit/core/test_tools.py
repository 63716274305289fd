"""Running host tools and having them write files atomically (vmsandbox.tools)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vmsandbox.errors import FailedPrecondition, VmSandboxError
from vmsandbox.tools import run_streaming, run_tool, write_with_tool


def test_run_tool_returns_stdout_and_names_a_failure() -> None:
    assert run_tool(["sh", "-c", "echo out; echo err >&2"]) == "out\n"
    with pytest.raises(VmSandboxError, match=r"^sh failed \(exit 3\): bad thing$"):
        run_tool(["sh", "-c", "echo bad thing >&2; exit 3"])
    with pytest.raises(FailedPrecondition, match=r"^cannot mount x \(exit 1\): "):
        run_tool(["false"], error=FailedPrecondition, what="cannot mount x")


def test_run_tool_that_is_not_installed_is_a_failed_precondition() -> None:
    with pytest.raises(FailedPrecondition, match="cannot run vmsbx-no-such-tool"):
        run_tool(["vmsbx-no-such-tool"])


def test_write_with_tool_goes_through_partial_and_keeps_the_mode(tmp_path: Path) -> None:
    target = tmp_path / "seed.iso"
    seen: list[Path] = []

    def command(partial: Path) -> list[str]:
        seen.append(partial)
        return ["sh", "-c", f"test ! -s '{partial}' && echo data > '{partial}'"]

    write_with_tool(target, command)
    assert seen == [tmp_path / "seed.iso.partial"]
    assert target.read_text() == "data\n"
    assert target.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["seed.iso"]


def test_write_with_tool_failure_leaves_neither_file(tmp_path: Path) -> None:
    target = tmp_path / "overlay.qcow2"
    with pytest.raises(FailedPrecondition, match=r"^cannot create overlay \(exit 1\): no room$"):
        write_with_tool(
            target,
            lambda partial: ["sh", "-c", f"echo half > '{partial}'; echo no room >&2; exit 1"],
            what="cannot create overlay",
        )
    assert list(tmp_path.iterdir()) == []


def test_run_streaming_passes_selected_lines_and_keeps_the_tail_on_failure() -> None:
    messages: list[str] = []
    script = "echo 'I: one'; echo noise; echo 'E: two'; exit 2"
    with pytest.raises(VmSandboxError, match=r"sh failed \(exit 2\):\nI: one\nnoise\nE: two$"):
        run_streaming(
            ["sh", "-c", script],
            messages.append,
            message=lambda line: line[3:] if line[1:3] == ": " else None,
        )
    assert messages == ["one", "two"]
