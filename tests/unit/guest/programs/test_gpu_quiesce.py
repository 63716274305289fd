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
    """Answers commands as the guest's tools would; records them. modprobe loads and unloads
    the fake modules (and binds the GPU at ``address`` to nvidia again)."""

    def __init__(
        self, root: Path, *, checkpointable: set[int] | None = None, address: str = ADDRESS
    ) -> None:
        self.root, self.address = root, address
        self.checkpointable = checkpointable or set()
        self.commands: list[list[str]] = []
        self.timeouts: dict[str, float] = {}  # cuda-checkpoint action -> its time limit
        self.uuid = "GPU-old"
        self.gpu_memory: dict[int, int] = {}  # pid -> MiB, as nvidia-smi reports it

    def __call__(
        self, argv: Sequence[str], timeout: float = gpu_quiesce.COMMAND_TIMEOUT_S
    ) -> subprocess.CompletedProcess[str]:
        argv = list(argv)
        self.commands.append(argv)
        if argv[0] == "cuda-checkpoint" and "--action" in argv:
            self.timeouts[argv[argv.index("--action") + 1]] = timeout
        if argv[0] == "modprobe":
            self.modprobe(argv[1:])
            return subprocess.CompletedProcess(argv, 0, "", "")
        return subprocess.CompletedProcess(argv, 0, self.answer(argv), "")

    def answer(self, argv: list[str]) -> str:
        if argv[0] == "nvidia-smi" and argv[1].startswith("--query-compute-apps"):
            return "".join(f"{pid}, {mib}\n" for pid, mib in self.gpu_memory.items())
        if argv[0] == "nvidia-smi":
            return f"00000000:01:00.0, {self.uuid}\n"
        if argv[0] == "cuda-checkpoint" and "--get-state" in argv:
            return "running\n" if int(argv[-1]) in self.checkpointable else "unknown\n"
        if argv[0] == "cuda-checkpoint" and "--help" in argv:
            return "--action lock|checkpoint|restore|unlock --device-map\n"
        if argv[0] == "cuda-checkpoint" and "checkpoint" in argv:
            (self.root / "proc" / argv[-1] / "fd" / "3").unlink()  # the GPU let go
        return ""

    def modprobe(self, args: list[str]) -> None:
        if args[0] == "-r":
            for module in args[1:]:
                (self.root / "sys/module" / module).rmdir()
            return
        (self.root / "sys/module" / args[0]).mkdir()
        driver = self.root / "sys/bus/pci/devices" / self.address / "driver"
        if not driver.is_symlink():
            driver.symlink_to("../../../bus/pci/drivers/nvidia")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return guest_root(tmp_path, ADDRESS, "0x2330")


def guest_root(path: Path, address: str, device_id: str) -> Path:
    """A guest root with one NVIDIA GPU on the nvidia driver at ``address``."""
    device = path / "sys/bus/pci/devices" / address
    device.mkdir(parents=True)
    (device / "vendor").write_text("0x10de\n")
    (device / "device").write_text(f"{device_id}\n")
    (device / "driver").symlink_to("../../../bus/pci/drivers/nvidia")
    (path / "sys/module/nvidia").mkdir(parents=True)
    (path / "sys/module/nvidia_uvm").mkdir(parents=True)
    (path / "proc").mkdir()
    (path / "proc/meminfo").write_text("MemTotal: 16777216 kB\nMemAvailable: 8388608 kB\n")
    return path


def process(root: Path, pid: int, command: str, nodes: Sequence[str] = ("/dev/nvidia0",)) -> None:
    """A process with ``nodes`` open (fds 3, 4...)."""
    fd = root / "proc" / str(pid) / "fd"
    fd.mkdir(parents=True)
    (root / "proc" / str(pid) / "comm").write_text(command + "\n")
    for number, node in enumerate(nodes, start=3):
        (fd / str(number)).symlink_to(node)


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
    assert json.loads(capsys.readouterr().out) == {"held": {"4242": "train"}, "why": {}}
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


def test_the_checkpoint_and_restore_get_time_for_the_gpu_memory_they_copy(
    root: Path, with_checkpoint: None
) -> None:
    process(root, 7, "cuda-job")
    run = Runner(root, checkpointable={7})
    run.gpu_memory = {7: 4096}
    guest = Guest(root, run)
    report = gpu_quiesce.quiesce(guest, [ID], force=False)
    assert report["checkpointed"] == [7] and report["memory"] == {"7": 4096}
    gpu_quiesce.revive(guest, wait=1)
    base = gpu_quiesce.COMMAND_TIMEOUT_S
    assert run.timeouts["checkpoint"] == base + 4 * gpu_quiesce.CHECKPOINT_S_PER_GIB
    assert run.timeouts["restore"] == base + 4 * gpu_quiesce.RESTORE_S_PER_GIB


def test_a_process_whose_gpu_memory_would_not_fit_in_the_guest_is_named_not_checkpointed(
    root: Path, with_checkpoint: None, capsys: pytest.CaptureFixture[str]
) -> None:
    process(root, 7, "small")
    process(root, 8, "big")
    run = Runner(root, checkpointable={7, 8})
    run.gpu_memory = {7: 1024, 8: 7 * 1024}  # 8 GiB available: 7 fits, then 8 does not
    guest = Guest(root, run)
    assert gpu_quiesce.main(["quiesce", ID], guest) == gpu_quiesce.EXIT_HELD
    answer = json.loads(capsys.readouterr().out)
    assert answer["held"] == {"8": "big"}
    assert answer["why"]["8"] == (
        "not checkpointed: its 7168 MiB of GPU memory needs about 7680 MiB of the guest's "
        "memory, 6656 MiB is available"
    )
    checkpointed = [c[-1] for c in run.commands if c[:3] == ["cuda-checkpoint", "--action", "lock"]]
    assert checkpointed == ["7"]
    restored = [c[-1] for c in run.commands if "restore" in c]
    assert restored == ["7"]  # the suspend failed: the checkpointed one runs on as before


def test_a_bad_request_is_an_error_answer(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_quiesce.main(["explode"], Guest(root, Runner(root))) == gpu_quiesce.EXIT_FAILED
    assert "usage" in json.loads(capsys.readouterr().out)["error"]


# -- on what cuda-checkpoint and nvidia-smi said on a real GPU (tests/fixtures/real) -----------

RECORDINGS = Path(__file__).parents[3] / "fixtures" / "real"


class RecordedRunner(Runner):
    """Answers with the outputs the probe recorded: cuda-checkpoint's help and states, the
    UUID and GPU memory queries; a checkpoint leaves the process the file descriptors it had
    then."""

    def __init__(self, recording: Path, root: Path, pid: int, address: str) -> None:
        super().__init__(root, address=address)
        self.recording, self.pid = recording, pid
        self.state = "running"
        self.uuids = (recording / "smi" / "uuids.out").read_text()

    def answer(self, argv: list[str]) -> str:
        if argv[0] == "nvidia-smi" and argv[1].startswith("--query-compute-apps"):
            recorded = self.recording / "checkpoint" / "hand-00-gpu-memory.out"
            return recorded.read_text() if recorded.exists() else ""  # the H200's has none
        if argv[0] == "nvidia-smi":
            return self.uuids
        if argv[:2] == ["cuda-checkpoint", "--help"]:
            return (self.recording / "checkpoint" / "help.out").read_text()
        if argv[:2] == ["cuda-checkpoint", "--get-state"]:
            return self.state + "\n"
        if argv[:2] == ["cuda-checkpoint", "--action"]:
            after = {"lock": "locked", "checkpoint": "checkpointed", "restore": "locked"}
            self.state = after.get(argv[2], "running")
            if argv[2] == "checkpoint":
                kept = set(recorded_fds(self.recording, "hand-06-checkpointed"))
                for fd in (self.root / "proc" / str(self.pid) / "fd").iterdir():
                    if str(fd.readlink()) not in kept:
                        fd.unlink()
        return ""


def recorded_fds(recording: Path, step: str) -> list[str]:
    return json.loads((recording / "checkpoint" / f"{step}.json").read_text())["fds"]


@pytest.mark.parametrize(
    ("recording", "ids"), [("h100-580.159.04", "10de:2330"), ("h200-580.159.04", "10de:2335")]
)
def test_the_recorded_tools_take_a_cuda_process_through_quiesce_and_revive(
    tmp_path: Path, with_checkpoint: None, recording: str, ids: str
) -> None:
    folder = RECORDINGS / recording
    bus, old_uuid = (folder / "smi" / "uuids.out").read_text().strip().split(", ")
    address = bus.lower()[-12:]
    root = guest_root(tmp_path, address, "0x" + ids.split(":")[1])
    seen = json.loads((folder / "checkpoint" / "quiesce.json").read_text())
    (pid,) = (int(pid) for pid in seen["holders_before"])  # the counter's, as recorded
    process(root, pid, "counter", recorded_fds(folder, "hand-00-started"))
    run = RecordedRunner(folder, root, pid, address)
    guest = Guest(root, run)

    assert guest.checkpointer() == "action"
    assert guest.holders([address]) == {pid: "counter"}
    assert guest.gpu_memory() == {int(p): mib for p, mib in seen.get("gpu_memory", {}).items()}
    report = gpu_quiesce.quiesce(guest, [ids], force=False)
    assert report["checkpointed"] == [pid] and report["ended"] == []
    assert report["memory"] == seen.get("gpu_memory", {})

    run.uuids = run.uuids.replace(old_uuid, "GPU-new")  # resumed onto another card
    revived = gpu_quiesce.revive(guest, wait=1)
    assert revived["restored"] == [pid] and revived["device_map"] == {old_uuid: "GPU-new"}
    steps = [c[1:3] for c in run.commands if c[0] == "cuda-checkpoint" and c[1] == "--action"]
    assert steps == [["--action", a] for a in ("lock", "checkpoint", "restore", "unlock")]
    restore = next(c for c in run.commands if "restore" in c)
    assert restore[restore.index("--device-map") + 1] == f"{old_uuid}=GPU-new"
