"""``vmsandbox gpus check`` and ``gpus release --force`` (cli/gpus.py) as a user runs them, on
libvirt's test driver and a fake sysfs: a quarantined GPU reset and freed, a failed one
released by force and logged, and the refusals in words."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from framework import fake_sysfs

from vmsandbox.cli.commands import main
from vmsandbox.config import Config
from vmsandbox.gpu.custody import state
from vmsandbox.gpu.custody.state import Custody
from vmsandbox.gpu.custody.store import CustodyStore
from vmsandbox.lock import host_lock

BDF = "0000:01:00.0"


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Config:
    tree = tmp_path / "sys" / "devices"
    fake_sysfs.gpu(tree, BDF)
    file = tmp_path / "config.toml"
    file.write_text(f'state_dir = "{tmp_path / "state"}"\npci_sysfs = "{tree}"\n')
    monkeypatch.setenv("VMSANDBOX_CONFIG", str(file))
    monkeypatch.setenv("VMSANDBOX_URI", "test:///default")
    (tmp_path / "state").mkdir()
    return Config.load()


def put(config: Config, record: Custody) -> None:
    with host_lock(config.lock_path):
        CustodyStore(config).put(record, "test")


def test_check_resets_a_quarantined_gpu_and_frees_it(
    config: Config, capsys: pytest.CaptureFixture[str]
) -> None:
    put(config, Custody(BDF, state=state.QUARANTINED, reason="AER: fatal"))
    assert main(["--json", "gpus", "check", BDF]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["state"] == "free" and "reset" in shown["steps"]


def test_a_failed_gpu_is_released_only_by_force_and_the_release_is_logged(
    config: Config, capsys: pytest.CaptureFixture[str]
) -> None:
    put(config, Custody(BDF, state=state.FAILED, reason="alive: reads all ones"))
    assert main(["gpus", "release", BDF]) == 2
    assert "say --force" in capsys.readouterr().err
    assert main(["gpus", "release", BDF, "--force"]) == 0
    assert "released by force" in capsys.readouterr().out
    assert CustodyStore(config).get(BDF).state == state.FREE
    last = CustodyStore(config).read_log()[-1]
    assert last["action"] == "release --force" and last["operator"].startswith("uid ")


def test_check_needs_a_gpu(config: Config, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gpus", "check"]) == 2
    assert "needs a GPU's PCI address" in capsys.readouterr().err
