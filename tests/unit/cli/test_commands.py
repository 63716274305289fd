"""The ``vmsandbox`` command in this process, on the in-memory hypervisor: what a new user
typed in their first hour (issue 42) gets the answer the docs promise, in one error line with
the right exit status, and ``--json`` gives one documented shape per command or is refused."""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from framework.fake_hypervisor import FakeHypervisor, unit_config
from framework.fake_pool import pooled_guest

from vmsandbox import __version__
from vmsandbox.cli import commands, common
from vmsandbox.config import Config
from vmsandbox.guest.ssh import ExecResult
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.sandbox.spec import SandboxSpec

SHAPE = {"image": "tiny", "memory_mib": 256, "disk_gib": 1, "count": 1}


@pytest.fixture
def manager(
    config: Config, hv: FakeHypervisor, monkeypatch: pytest.MonkeyPatch
) -> Iterator[SandboxManager]:
    """The manager every command of the CLI gets (in place of one on libvirt)."""
    with SandboxManager(config, hypervisor=hv, reconcile=False) as mgr:
        monkeypatch.setattr(common, "manager", lambda **_kw: _Borrowed(mgr))
        monkeypatch.setenv("VMSANDBOX_CONFIG", "/nonexistent")
        monkeypatch.setenv("VMSANDBOX_STATE_DIR", str(config.state_dir))
        monkeypatch.setenv("VMSANDBOX_IMAGE_DIR", str(config.images))
        yield mgr


class _Borrowed:
    """``with`` that hands the test's manager over and leaves it open."""

    def __init__(self, manager: SandboxManager) -> None:
        self.manager = manager

    def __enter__(self) -> SandboxManager:
        return self.manager

    def __exit__(self, *_exc: object) -> None:
        pass


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = commands.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def error_line(err: str) -> str:
    (line,) = [line for line in err.splitlines() if not line.startswith("[")]
    return line


# -- usage, version, the guest's options ---------------------------------------------------------


def test_vmsandbox_alone_prints_its_usage(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys)
    assert code == 2
    assert out.startswith("usage: vmsandbox") and "create" in out and "destroy" in out
    assert error_line(err).startswith("error: INVALID_ARGUMENT: vmsandbox: give a command")


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        commands.main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"vmsandbox {__version__}\n"


def test_a_guest_option_before_dashdash_says_where_the_command_goes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _out, err = run(capsys, "exec", "box", "uname", "-r")
    assert code == 2
    line = error_line(err)
    assert "unrecognized arguments: -r" in line
    assert "put the guest's command after '--': vmsandbox exec NAME -- CMD" in line


def test_stop_grace_names_grace(capsys: pytest.CaptureFixture[str]) -> None:
    code, _out, err = run(capsys, "stop", "box", "--grace", "0")
    assert code == 2
    assert error_line(err) == (
        "error: INVALID_ARGUMENT: --grace '0' is not a number of seconds above 0"
    )


# -- sizes: one rule -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "memory_mib", "disk_gib"),
    [
        (("--memory", "4G"), 4096, 4),
        (("--memory", "4Gi"), 4096, 4),
        (("--memory", "4GiB"), 4096, 4),
        (("--memory", "4gb"), 3815, 4),  # decimal, rounded up to a whole MiB
        (("--memory", "2048"), 2048, 4),
        (("--disk", "20GB"), 1024, 19),  # decimal, rounded up to a whole GiB
        (("--disk", "1.5G"), 1024, 2),  # rounded up to a whole GiB
        (("--disk", "20"), 1024, 20),
    ],
)
def test_sizes_follow_one_rule(
    manager: SandboxManager,
    capsys: pytest.CaptureFixture[str],
    flags: tuple[str, str],
    memory_mib: int,
    disk_gib: int,
) -> None:
    argv = ("create", "box", "--image", "tiny", "--memory", "1024", *flags, "--dry-run", "--json")
    code, out, _err = run(capsys, *argv)
    assert code == 0, out
    plan = json.loads(out)["plan"]
    assert (plan["memory_mib"], plan["disk_gib"]) == (memory_mib, disk_gib)


def test_gpu_memory_follows_the_same_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    from vmsandbox.cli.args import build_parser

    for text, mib in (("80GB", 76294), ("80G", 81920), ("80Gi", 81920), ("81920", 81920)):
        assert build_parser().parse_args(["create", "--gpu-memory", text]).gpu_memory == mib


def test_a_bad_disk_size_suggests_a_disk_size(capsys: pytest.CaptureFixture[str]) -> None:
    code, _out, err = run(capsys, "create", "--disk", "4X")
    assert code == 2
    line = error_line(err)
    assert "e.g. 20 or 20G" in line and "2048" not in line
    assert "KB, MB, GB, TB decimal" in line and "i/iB are binary" in line


def test_more_gpus_than_the_cap_is_a_bad_request_like_more_cpus(
    manager: SandboxManager, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--gpu 17`` exited 5 (FAILED_PRECONDITION) where ``--cpus 9`` exits 2."""
    for flags in (("--gpu", "17"), ("--cpus", "9")):
        code, _out, err = run(capsys, "create", "box", *flags)
        assert code == 2, err
        assert "over this host's cap" in error_line(err)


# -- the dry run ---------------------------------------------------------------------------------


def test_a_dry_run_refuses_what_create_refuses(
    manager: SandboxManager, capsys: pytest.CaptureFixture[str]
) -> None:
    manager.create(SandboxSpec(name="taken", image="tiny", memory_mib=256, disk_gib=1), wait=False)
    for argv, code, says in (
        (("create", "taken", "--image", "tiny", "--dry-run"), 4, "ALREADY_EXISTS"),
        (("create", "pool-x", "--image", "tiny", "--dry-run"), 2, "kept for the warm pool"),
        (("create", "new", "--image", "nope", "--dry-run"), 3, "NOT_FOUND: image 'nope'"),
        (("create", "new", "--image", "tiny", "--gpu", "2", "--dry-run"), 5, "without the --gpu"),
    ):
        got, out, err = run(capsys, *argv)
        assert (got, out) == (code, ""), err
        assert says in error_line(err)


def test_a_dry_run_in_json_gives_the_plan_and_the_xml(
    manager: SandboxManager, hv: FakeHypervisor, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "create", "box", "--image", "tiny", "--dry-run", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert set(data) == {"plan", "gpus", "xml"}
    assert data["plan"]["name"] == "box" and data["gpus"] == []
    assert data["xml"].startswith("<domain") and "<name>vmsbx-box</name>" in data["xml"]
    assert hv.domains == {}


# -- --json everywhere ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv", [("ssh", "box", "--json"), ("serve", "--openshell-socket", "/x", "--json")]
)
def test_a_command_that_cannot_give_json_refuses_the_flag(
    capsys: pytest.CaptureFixture[str], argv: tuple[str, ...]
) -> None:
    code, out, _err = run(capsys, *argv)
    assert code == 2
    error = json.loads(out)["error"]
    assert error["code"] == "INVALID_ARGUMENT" and "takes no --json" in error["message"]


def test_exec_json_gives_stdout_stderr_and_the_exit_status(
    manager: SandboxManager, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def exec_(_name: str, _argv: list[str], **streams: Any) -> ExecResult:
        assert streams.get("stdout") is None  # collected, not streamed
        return ExecResult(3, "out\n", "err\n")

    monkeypatch.setattr(manager, "exec", exec_)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"")))  # a script's empty input
    code, out, _err = run(capsys, "exec", "box", "--json", "--", "false")
    assert code == 3
    assert json.loads(out) == {
        "exit_status": 3,
        "signal": None,
        "stdout": "out\n",
        "stderr": "err\n",
    }


def test_exec_says_when_the_guest_command_was_killed_by_a_signal(
    manager: SandboxManager, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    class Killed:
        """An ExecStream whose command was killed by SIGKILL, having said nothing."""

        exit_status, signal = 137, "KILL"

        def __enter__(self) -> Killed:
            return self

        def __exit__(self, *_exc: object) -> None:
            pass

        def __iter__(self) -> Any:
            return iter(())

    monkeypatch.setattr(manager, "stream", lambda *_a, **_k: Killed())
    code, _out, err = run(capsys, "exec", "box", "-n", "--", "sleep", "100")
    assert code == 137
    assert err == "vmsandbox: the guest command was killed by signal KILL (exit status 137)\n"


# -- what the commands say -----------------------------------------------------------------------


def test_text_destroy_names_what_it_destroyed_and_never_tried(
    manager: SandboxManager, capsys: pytest.CaptureFixture[str]
) -> None:
    manager.create(SandboxSpec(name="a", image="tiny", memory_mib=256, disk_gib=1), wait=False)
    code, out, err = run(capsys, "destroy", "a", "b", "c")
    assert code == 3
    assert out == "destroyed a\n"
    line = error_line(err)
    assert line.startswith("error: NOT_FOUND: sandbox 'b' does not exist")
    assert line.endswith("(destroyed: a; failed: b; not tried: c)")


def test_show_says_what_the_state_means_and_why_it_failed(
    manager: SandboxManager,
    hv: FakeHypervisor,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from vmsandbox.sandbox import settle
    from vmsandbox.sandbox.record import SandboxRecord

    monkeypatch.setattr(settle.ssh, "connect", _refused)
    manager.create(SandboxSpec(name="box", image="tiny", memory_mib=256, disk_gib=1), wait=False)
    record = SandboxRecord.from_dict(hv.domains["vmsbx-box"].data or {})
    failure = {"code": "DEADLINE_EXCEEDED", "message": "guest did not accept SSH within 5s"}
    hv.set_metadata("vmsbx-box", replace(record, failure=failure).to_dict(), "failed")
    code, out, _err = run(capsys, "show", "box")
    assert code == 0
    assert "state:     failed (its guest runs, but the last wait for it failed" in out
    assert "failure:   DEADLINE_EXCEEDED: guest did not accept SSH within 5s" in out
    assert "console:   " in out and "box.console.log" in out


def _refused(*_args: Any, **_kwargs: Any) -> Any:
    from vmsandbox.errors import Unavailable

    raise Unavailable("no answer")


def test_create_output_says_verification_once_and_a_claim_is_no_boot() -> None:
    from vmsandbox.cli.output import describe

    base = {
        "name": "box",
        "state": "ready",
        "image": "minimal",
        "cpus": 1,
        "memory_mib": 1024,
        "disk_gib": 4,
        "virt_type": "qemu",
        "ssh": {"user": "sandbox", "host": "127.0.0.1", "port": 2222},
        "domain": "vmsbx-pool-1234abcd",
        "verification": {"ok": True, "gpus": [], "checks": [], "problems": []},
    }
    cold = describe({**base, "boot_seconds": 9.5})
    assert cold.count("verification") == 1 and "verification: ok (no GPUs to check)" in cold
    assert "boot:      SSH answered 9.5s after the guest started" in cold
    claim = describe({**base, "boot_seconds": 0.02, "stage_seconds": {"claim": 0.01, "ssh": 0.01}})
    assert "boot:" not in claim and "claimed:   a pooled guest, in 0.02s" in claim


def test_show_of_a_created_sandbox_has_its_boot_seconds(
    manager: SandboxManager, hv: FakeHypervisor
) -> None:
    """``boot_seconds`` was null in ``show`` after create printed it: it is in the record."""
    from vmsandbox.sandbox.record import SandboxRecord

    manager.create(SandboxSpec(name="box", image="tiny", memory_mib=256, disk_gib=1), wait=False)
    record = SandboxRecord.from_dict(hv.domains["vmsbx-box"].data or {})
    hv.set_metadata("vmsbx-box", replace(record, boot_seconds=9.5).to_dict(), "ready")
    assert manager.get("box").to_dict()["boot_seconds"] == 9.5


def test_pool_shows_guests_of_no_configured_shape(
    tmp_path: Path,
    hv: FakeHypervisor,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A pooled guest still running after its shape left the configuration: ``pool`` said
    "no [pool] shapes configured" while it held its memory."""
    with SandboxManager(
        unit_config(tmp_path, pool={"small": SHAPE}), hypervisor=hv, reconcile=False
    ) as filler:
        guest = pooled_guest(filler)
        unpooled = replace(filler.config, pool=())
    with SandboxManager(unpooled, hypervisor=hv, reconcile=False) as mgr:
        monkeypatch.setattr(common, "manager", lambda **_kw: _Borrowed(mgr))
        code, out, _err = run(capsys, "pool")
        assert code == 0
        assert "no [pool] shapes configured" in out
        assert f"pooled guests of no configured shape, still running: {guest}" in out
        assert "'vmsandbox pool drain' removes them" in out
        code, out, _err = run(capsys, "pool", "--json")
        assert [g["name"] for g in json.loads(out)["unshaped"]] == [guest]
