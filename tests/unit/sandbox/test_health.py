"""The GPU health monitor (sandbox/health.py) on the in-memory hypervisor, the HGX fake host's
GPUs, a fake sysfs and a kernel log in a plain file: each signal quarantines (or only reports)
within the pass that saw it, the sandbox on a quarantined GPU is stored failed with the reason,
and a suspect GPU nothing holds gets its one automatic reset."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path

import pytest
from framework import fake_sysfs
from framework.fake_hypervisor import FakeHypervisor, unit_config
from framework.inventories import discover_hosts

from vmsandbox.config import Config
from vmsandbox.gpu.custody import state
from vmsandbox.gpu.custody.store import CustodyStore
from vmsandbox.gpu.request import GpuRequest
from vmsandbox.host.kernlog import KernelLog
from vmsandbox.host.model import Inventory
from vmsandbox.sandbox import health
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.sandbox.spec import SandboxSpec

XID_79 = "[ 99.1] NVRM: Xid (PCI:0000:01:00): 79, pid=0, GPU has fallen off the bus."
XID_13 = "[ 98.0] NVRM: Xid (PCI:0000:01:00): 13, pid=42, Graphics Exception: ESR 0x5"


@pytest.fixture(scope="module")
def board(tmp_path_factory: pytest.TempPathFactory) -> Inventory:
    case = {"use_nvml": False, "proc_root": str(tmp_path_factory.mktemp("proc"))}
    return replace(discover_hosts({"hgx": ("hgx_h100", case)})["hgx"], fabric=())


class BoardManager(SandboxManager):
    board: Inventory

    def gpus(self, in_use: Mapping[str, str] | None = None) -> Inventory:
        holders = self.hypervisor.hostdev_holders() if in_use is None else in_use
        gpus = tuple(replace(gpu, in_use_by=holders.get(gpu.bdf)) for gpu in self.board.gpus)
        return health.custody.shown(self.config, replace(self.board, gpus=gpus))


@pytest.fixture
def tree(tmp_path: Path, board: Inventory) -> Path:
    tree = tmp_path / "sys" / "devices"
    for gpu in board.gpus:
        fake_sysfs.gpu(tree, gpu.bdf)
    return tree


@pytest.fixture
def config(tmp_path: Path, tree: Path) -> Config:
    return unit_config(tmp_path, pci_sysfs=tree)


@pytest.fixture
def manager(config: Config, board: Inventory) -> Iterator[SandboxManager]:
    BoardManager.board = board
    with BoardManager(config, hypervisor=FakeHypervisor(), reconcile=False) as mgr:
        yield mgr


@pytest.fixture
def kmsg(tmp_path: Path) -> Path:
    path = tmp_path / "kmsg"
    path.write_text("6,1,1000,-;booted\n")
    return path


def monitor(
    manager: SandboxManager, kmsg: Path, paused: dict[str, str] | None = None
) -> health.Monitor:
    log = KernelLog(manager.config.state_dir / "cursor", str(kmsg))
    found = health.Monitor(
        manager,
        paused=lambda: paused or {},
        inventory=manager.gpus,
        kernel_log=log,
        xid_interval=3600,
    )
    assert found.look() == []  # the first pass sets the log's cursor
    return found


def log_line(kmsg: Path, sequence: int, text: str) -> None:
    with kmsg.open("a") as out:
        out.write(f"3,{sequence},{sequence * 1000},-;{text}\n")


def gpu_sandbox(manager: SandboxManager, name: str = "box") -> str:
    spec = SandboxSpec(name=name, image="tiny", memory_mib=256, disk_gib=1, gpu=GpuRequest(count=1))
    sandbox = manager.create(spec, wait=False)
    return str(sandbox.to_dict()["gpus"][0]["bdf"])


def test_an_aer_error_of_a_held_gpu_quarantines_it_and_fails_its_sandbox(
    manager: SandboxManager, kmsg: Path
) -> None:
    bdf = gpu_sandbox(manager)
    watch = monitor(manager, kmsg)
    log_line(kmsg, 2, f"vfio-pci {bdf}: PCIe Bus Error: severity=Uncorrected (Fatal), type=DLL")
    (seen,) = watch.look()
    assert seen.record is not None and seen.record.state == state.SUSPECT
    assert seen.sandbox == "box" and seen.applied - seen.at < 5
    shown = manager.get("box")
    assert shown.state == "failed"
    assert shown.failure is not None and shown.failure["reason"] == "GpuQuarantined"
    assert f"GPU {bdf} is suspect: AER: fatal error at the GPU" in shown.failure["message"]
    manager.destroy("box")  # the release is its automatic reset
    record = CustodyStore(manager.config).get(bdf)
    assert record.state == state.FREE and record.auto_reset_at


def test_a_corrected_error_is_only_reported(manager: SandboxManager, kmsg: Path) -> None:
    bdf = manager.gpus().gpus[0].bdf
    watch = monitor(manager, kmsg)
    log_line(kmsg, 2, f"pcieport 0000:00:01.0: AER: Corrected error received: {bdf}")
    (seen,) = watch.look()
    assert seen.record is None and not seen.signal.quarantines
    assert CustodyStore(manager.config).read_log()[-1]["kind"] == "aer"


def test_all_ones_on_a_free_gpu_gets_one_automatic_reset(
    manager: SandboxManager, kmsg: Path, tree: Path
) -> None:
    bdf = manager.gpus().gpus[1].bdf
    watch = monitor(manager, kmsg)
    folder = fake_sysfs.gpu(tree, bdf, all_ones=True)
    signals_seen = watch.look()
    assert [s.record.state for s in signals_seen if s.record] == [state.SUSPECT]
    # it did not come back: the automatic reset failed, and it stays out
    assert CustodyStore(manager.config).get(bdf).state == state.FAILED
    (folder / "config").write_bytes(fake_sysfs.config_space(0x10DE, 0x20B0))
    assert watch.look() == []
    assert CustodyStore(manager.config).get(bdf).state == state.FAILED  # until an operator acts


def test_a_domain_paused_on_an_error_two_passes_in_a_row(
    manager: SandboxManager, kmsg: Path
) -> None:
    bdf = gpu_sandbox(manager)
    paused = {"vmsbx-box": "ioerror"}
    watch = monitor(manager, kmsg, paused)
    (seen,) = watch.look()
    assert seen.signal.kind == "vfio" and seen.signal.bdf == bdf and seen.sandbox == "box"


def test_xids_by_the_catalogue(manager: SandboxManager) -> None:
    sandbox = {"gpus": [{"bdf": "0000:18:00.0"}], "verification": None}
    events = health.xid_events(sandbox, f"{XID_13}\n{XID_79}\n")
    assert [(bdf, xid) for bdf, xid, _line in events] == [
        ("0000:18:00.0", 13),
        ("0000:18:00.0", 79),
    ]


def test_a_verify_that_reads_an_xid_79_quarantines_the_gpu(manager: SandboxManager) -> None:
    bdf = gpu_sandbox(manager)
    found = manager.store.require("box")
    report = {"kernel_events": [XID_13, XID_79], "gpus": []}
    health.from_verification(manager, found.record, report)
    record = CustodyStore(manager.config).get(bdf)
    assert record.state == state.QUARANTINED and "Xid 79" in record.reason
    assert manager.get("box").state == "failed"
