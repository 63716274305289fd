"""The in-guest GPU hand-over (guest/programs/gpu_quiesce.py), on the host: a fake guest root
(sysfs PCI functions with their drivers, loaded modules, /proc with processes holding device
nodes) and a fake command runner standing in for modprobe, systemctl, nvidia-smi and
cuda-checkpoint. Processes holding a GPU are named (exit 3) unless forced; cuda-checkpoint
lets CUDA processes keep their PID; revive loads what quiesce unloaded and restores the
checkpointed processes with the map of old GPU UUIDs to new ones."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from vmsandbox.guest.programs import gpu_quiesce
from vmsandbox.guest.programs.gpu_quiesce import Guest

ADDRESS = "0000:01:00.0"
ID = "10de:2330"


class Runner:
    """Answers commands as the guest's tools would; records them."""

    def __init__(self, root: Path, *, checkpointable: set[int] | None = None) -> None:
        self.root = root
        self.checkpointable = checkpointable or set()
        self.commands: list[list[str]] = []
        self.uuid = "GPU-old"

    def __call__(self, argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        argv = list(argv)
        self.commands.append(argv)
        out = ""
        if argv[0] == "nvidia-smi":
            out = f"00000000:01:00.0, {self.uuid}\n"
        elif argv[0] == "cuda-checkpoint" and "--get-state" in argv:
            out = "running\n" if int(argv[-1]) in self.checkpointable else "unknown\n"
        elif argv[0] == "cuda-checkpoint" and "--help" in argv:
            out = "--action lock|checkpoint|restore|unlock --device-map\n"
        elif argv[0] == "cuda-checkpoint" and "checkpoint" in argv:
            (self.root / "proc" / argv[-1] / "fd" / "3").unlink()  # the GPU let go
        elif argv[0] == "modprobe" and argv[1] == "-r":
            for module in argv[2:]:
                (self.root / "sys/module" / module).rmdir()
        elif argv[0] == "modprobe":
            (self.root / "sys/module" / argv[1]).mkdir()
            driver = self.root / "sys/bus/pci/devices" / ADDRESS / "driver"
            if not driver.is_symlink():
                driver.symlink_to("../../../bus/pci/drivers/nvidia")
        return subprocess.CompletedProcess(argv, 0, out, "")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    device = tmp_path / "sys/bus/pci/devices" / ADDRESS
    device.mkdir(parents=True)
    (device / "vendor").write_text("0x10de\n")
    (device / "device").write_text("0x2330\n")
    (device / "driver").symlink_to("../../../bus/pci/drivers/nvidia")
    (tmp_path / "sys/module/nvidia").mkdir(parents=True)
    (tmp_path / "sys/module/nvidia_uvm").mkdir(parents=True)
    (tmp_path / "proc").mkdir()
    return tmp_path


def process(root: Path, pid: int, command: str) -> None:
    """A process with /dev/nvidia0 open."""
    fd = root / "proc" / str(pid) / "fd"
    fd.mkdir(parents=True)
    (root / "proc" / str(pid) / "comm").write_text(command + "\n")
    (fd / "3").symlink_to("/dev/nvidia0")


@pytest.fixture
def no_checkpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_quiesce.shutil, "which", lambda name: name == "nvidia-smi" or None)


@pytest.fixture
def with_checkpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_quiesce.shutil, "which", lambda _name: "/usr/bin/tool")


def test_processes_holding_a_gpu_are_named_and_nothing_is_unloaded(
    root: Path, no_checkpoint: None, capsys: pytest.CaptureFixture[str]
) -> None:
    process(root, 4242, "train")
    run = Runner(root)
    assert gpu_quiesce.main(["quiesce", ID], Guest(root, run)) == gpu_quiesce.EXIT_HELD
    assert json.loads(capsys.readouterr().out) == {"held": {"4242": "train"}}
    assert not any(command[0] == "modprobe" for command in run.commands)
    assert (root / "sys/module/nvidia").is_dir()


def test_an_idle_gpu_is_let_go_and_taken_up_again(root: Path, no_checkpoint: None) -> None:
    run = Runner(root)
    guest = Guest(root, run)
    report = gpu_quiesce.quiesce(guest, [ID], force=False)
    assert report["unloaded"] == ["nvidia_uvm", "nvidia"]
    assert ["modprobe", "-r", "nvidia_uvm", "nvidia"] in run.commands
    assert guest.state.exists()
    revived = gpu_quiesce.revive(guest, wait=1)
    assert revived["loaded"] == ["nvidia", "nvidia_uvm"] and not guest.state.exists()


def test_cuda_processes_are_checkpointed_and_restored_onto_the_new_gpu(
    root: Path, with_checkpoint: None
) -> None:
    process(root, 7, "cuda-job")
    run = Runner(root, checkpointable={7})
    guest = Guest(root, run)
    report = gpu_quiesce.quiesce(guest, [ID], force=False)
    assert report["checkpointed"] == [7] and report["ended"] == []
    run.uuid = "GPU-new"  # resumed onto another card at the same guest address
    revived = gpu_quiesce.revive(guest, wait=1)
    assert revived["restored"] == [7] and revived["device_map"] == {"GPU-old": "GPU-new"}
    restore = next(c for c in run.commands if "restore" in c)
    assert restore[restore.index("--device-map") + 1] == "GPU-old=GPU-new"


def test_a_bad_request_is_an_error_answer(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_quiesce.main(["explode"], Guest(root, Runner(root))) == gpu_quiesce.EXIT_FAILED
    assert "usage" in json.loads(capsys.readouterr().out)["error"]
