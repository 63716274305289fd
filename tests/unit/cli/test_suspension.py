"""``vmsandbox suspend`` and ``resume`` (cli/suspension.py) and what ``list`` shows of saves, run
in the test's process against the fake hypervisor, with a guest that answers every command."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from framework.fake_hypervisor import FakeHypervisor

from vmsandbox.cli import commands, common
from vmsandbox.config import Config
from vmsandbox.guest.ssh import ExecResult
from vmsandbox.sandbox import boot
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.sandbox.spec import SandboxSpec


class _Borrowed:
    def __init__(self, manager: SandboxManager) -> None:
        self.manager = manager

    def __enter__(self) -> SandboxManager:
        return self.manager

    def __exit__(self, *_exc: object) -> None:
        pass


@pytest.fixture
def manager(
    config: Config, hv: FakeHypervisor, monkeypatch: pytest.MonkeyPatch
) -> Iterator[SandboxManager]:
    monkeypatch.setattr(boot, "wait_ready", lambda *_a, **_k: 0.25)
    with SandboxManager(config, hypervisor=hv, reconcile=False) as mgr:
        mgr.guest_run = lambda *_a, **_k: ExecResult(0, "", "")  # type: ignore[method-assign]
        monkeypatch.setattr(common, "manager", lambda **_kw: _Borrowed(mgr))
        yield mgr


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = commands.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def made(manager: SandboxManager, name: str) -> None:
    manager.create(SandboxSpec(name=name, image="tiny", memory_mib=256, disk_gib=1), wait=False)


def test_suspend_and_resume_in_json_and_list_shows_the_save(
    manager: SandboxManager, capsys: pytest.CaptureFixture[str]
) -> None:
    made(manager, "a")
    made(manager, "b")
    code, out, _err = run(capsys, "suspend", "a", "b", "--json")
    assert code == 0
    done = json.loads(out)
    assert done["suspended"] == ["a", "b"]
    assert [s["state"] for s in done["sandboxes"]] == ["suspended", "suspended"]
    code, out, _err = run(capsys, "list")
    assert "SAVED" in out.splitlines()[0] and "suspended" in out
    assert "saved memory: " in out and "of max_saved_gib 64 GiB" in out
    listed = json.loads(run(capsys, "list", "--json")[1])
    assert listed["saved_bytes"] == sum(s["saved_bytes"] for s in done["sandboxes"]) > 0
    code, out, _err = run(capsys, "resume", "a")
    assert code == 0 and out.startswith("resumed a (ready")


def test_a_failed_suspend_names_what_was_done_and_not_tried(
    manager: SandboxManager, capsys: pytest.CaptureFixture[str]
) -> None:
    made(manager, "a")
    code, out, err = run(capsys, "suspend", "a", "nobody", "c")
    assert code == 3 and out.startswith("suspended a (")
    assert "(suspended: a; failed: nobody; not tried: c)" in err
    code, out, _err = run(capsys, "resume", "nobody", "--json")
    error: dict[str, Any] = json.loads(out)
    assert error["error"]["code"] == "NOT_FOUND" and error["failed"] == "nobody"


def test_show_says_since_when_it_is_suspended_and_what_its_save_takes(
    manager: SandboxManager, capsys: pytest.CaptureFixture[str]
) -> None:
    made(manager, "a")
    run(capsys, "suspend", "a")
    code, out, _err = run(capsys, "show", "a")
    assert code == 0 and "state:     suspended (its memory is saved to disk" in out
    (line,) = [line for line in out.splitlines() if line.startswith("suspended: since ")]
    assert line.endswith("M saved")
