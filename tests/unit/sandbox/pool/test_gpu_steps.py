"""Claiming a GPU-ready pooled guest (sandbox/pool/keeper.py, gpu_steps.py) against the in-memory
hypervisor (tests/framework/fake_hypervisor.py), a fake guest that answers the claim's commands, and
the GPUs of the HGX fake host as umockdev discovery sees them (made AMD cards, so that the in-guest
verification is the PCI check: the NVIDIA checks have tests of their own in test_verify.py).

Every failure path must leave no domain, no file and no GPU held; a killed claim is taken
apart by reconcile. test_e2e_nested.py attaches real cards to a real guest.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
from framework.fake_hypervisor import IMAGE_ID, FakeHypervisor, refuse, unit_config
from framework.gpu_guests import BoardManager, amd_board
from framework.inventories import discover_hosts
from framework.paths import FIXTURES
from lxml import etree

from vmsandbox.config import Config
from vmsandbox.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    GuestVerificationFailed,
    InvalidArgument,
)
from vmsandbox.gpu import hotplug
from vmsandbox.gpu.request import GpuRequest
from vmsandbox.guest.ssh import Endpoint, ExecResult
from vmsandbox.host.bdf import libvirt_address
from vmsandbox.host.model import Inventory
from vmsandbox.sandbox import runner
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.sandbox.pool import gpu_steps, park
from vmsandbox.sandbox.pool.shapes import shape_spec
from vmsandbox.sandbox.pool.steps import FILL_STEPS, GPU_CLAIM_STEPS
from vmsandbox.sandbox.spec import SandboxSpec

SHAPE = {"image": "tiny", "memory_mib": 256, "disk_gib": 1, "count": 1, "gpus": 2}
DEAD = {"pid": 1, "start": "0", "boot": "another boot"}


@pytest.fixture(scope="module")
def board(tmp_path_factory: pytest.TempPathFactory) -> Inventory:
    """The HGX fake host's eight GPUs as AMD cards, without its NVSwitches."""
    case = {"use_nvml": False, "proc_root": str(tmp_path_factory.mktemp("proc"))}
    return amd_board(discover_hosts({"hgx": ("hgx_h100", case)})["hgx"])


@dataclass
class FakeGuest:
    """Answers a claim's commands as the guest of the domain holding the SSH port would:
    it sees (in sysfs below its spare ports, and in lspci) what was attached to it, unless
    ``blind``; ``lspci_lists`` False makes lspci list no GPU (verification fails)."""

    hv: FakeHypervisor
    board: Inventory
    blind: bool = False
    lspci_lists: bool = True
    commands: list[str] = field(default_factory=list)

    def __call__(
        self, endpoint: Endpoint, _keys: object, command: str, **_kwargs: Any
    ) -> ExecResult:
        self.commands.append(command)
        if command.startswith("for port in"):
            lines = [] if self.blind else self._seen(endpoint)
            return ExecResult(0, "".join(f"{line}\n" for line in lines), "")
        if command == "lspci -Dnn":
            lines = [
                f"0000:{port + 1:02x}:00.{fn} Display controller [0380]: AMD [{v[2:]}:{d[2:]}]"
                for port, fn, v, d in self._functions(endpoint)
                if self.lspci_lists
            ]
            return ExecResult(0, "\n".join(lines) + "\n", "")
        return ExecResult(0, "", "")  # hostname, boot settling

    def _functions(self, endpoint: Endpoint) -> Iterator[tuple[int, int, str, str]]:
        """(port, function, vendor id, device id) of each function attached to the guest."""
        dom = next(
            d for d in self.hv.domains.values() if d.data and d.data["ssh"]["port"] == endpoint.port
        )
        assert dom.data is not None
        buses = dom.data["hotplug"]["buses"]
        ids = {gpu.bdf: (gpu.vendor_id, gpu.device_id) for gpu in self.board.gpus}
        for gpu in self.board.gpus:
            ids.update(zip(gpu.companions, gpu.companion_ids, strict=True))
        for xml in dom.attached:
            hostdev = etree.fromstring(xml.encode())
            source = hostdev.find("source/address").attrib
            domain, bus, slot = (source[key][2:] for key in ("domain", "bus", "slot"))
            bdf = f"{domain}:{bus}:{slot}.{source['function'][2:]}"
            port = buses.index(int(hostdev.find("address").get("bus"), 16))
            yield port, int(source["function"], 16), *ids[bdf]

    def _seen(self, endpoint: Endpoint) -> list[str]:
        return [
            f"{hotplug.guest_port(port)} {vendor} {device}"
            for port, fn, vendor, device in self._functions(endpoint)
            if fn == 0
        ]


@pytest.fixture
def config(tmp_path: Path) -> Config:
    return unit_config(tmp_path, pool={"gpu": SHAPE})


@pytest.fixture
def guest(hv: FakeHypervisor, board: Inventory) -> FakeGuest:
    return FakeGuest(hv, board)


@pytest.fixture
def manager(
    config: Config, hv: FakeHypervisor, board: Inventory, guest: FakeGuest
) -> Iterator[SandboxManager]:
    BoardManager.board = board
    with BoardManager(config, hypervisor=hv, reconcile=False) as mgr:
        mgr.pool.guest_run = guest
        yield mgr


def pooled_guest(manager: SandboxManager) -> str:
    """A GPU-ready pooled guest made by the fill steps (not waited for: no sshd here)."""
    shape = manager.config.pool[0]
    spec = shape_spec(shape)
    assert spec.name is not None
    creation = manager.pool.creation(spec, spec.name, manager.images.get("tiny"), print)
    creation.wait = False
    creation.pool_key = shape.key
    creation.hotplug = manager.pool.spare_ports(shape, creation.virt_type)
    runner.run(FILL_STEPS, creation, manager.locked, manager.checkpoint)
    return spec.name


def gpu_spec(count: int, name: str = "hit") -> SandboxSpec:
    return SandboxSpec(
        name=name, image="tiny", memory_mib=256, disk_gib=1, gpu=GpuRequest(count=count)
    )


def everything(config: Config, hv: FakeHypervisor) -> list[str]:
    """Every domain, every file of the state directory, and every GPU held."""
    files = [str(path) for folder in (config.disks, config.sandboxes) for path in folder.iterdir()]
    return sorted(hv.domains) + files + sorted(hv.hostdev_holders())


def test_a_gpu_ready_guest_boots_with_its_spare_ports(
    manager: SandboxManager, hv: FakeHypervisor
) -> None:
    guest = pooled_guest(manager)
    dom = hv.domains[f"vmsbx-{guest}"]
    assert dom.data is not None and dom.data["hotplug"] == {"buses": [1, 2], "firmware": "uefi"}
    root = etree.fromstring(dom.xml.encode())
    ports = root.findall("devices/controller[@model='pcie-root-port']")
    assert [port.find("alias").get("name") for port in ports] == ["ua-hp1", "ua-hp2"]
    assert root.find("devices/hostdev") is None and root.find("os/loader") is not None


def test_a_claim_attaches_the_gpus_and_verifies_them(
    manager: SandboxManager, config: Config, hv: FakeHypervisor, guest: FakeGuest
) -> None:
    pooled = pooled_guest(manager)
    domain = f"vmsbx-{pooled}"
    stages: list[str] = []
    manager.checkpoint = stages.append
    filled = len(hv.calls)
    sandbox = manager.create(gpu_spec(2), refill=False)
    assert stages == [
        *("look", "locked", "claim", "fabric", "taken", "restore", "attach"),
        *("hostname", "seen", "verify", "locked", "ready"),
    ]
    assert (sandbox.name, sandbox.domain, sandbox.state) == ("hit", domain, "ready")
    record = hv.domains[domain].data
    assert record is not None and record["guest"] == pooled
    assert [gpu["bdf"] for gpu in record["gpus"]] == sorted(hv.hostdev_holders())
    assert record["verification"]["ok"]
    assert set(hv.hostdev_holders().values()) == {domain}
    # the record named the GPUs before the first attach
    calls = [op for op, _name in hv.calls[filled:] if op in ("set_metadata", "attach")]
    assert calls[:2] == ["set_metadata", "attach"]
    buses = [
        etree.fromstring(xml.encode()).find("address").get("bus")
        for xml in hv.domains[domain].attached
    ]
    assert buses == ["0x01", "0x02"]
    manager.destroy("hit")
    assert everything(config, hv) == []


def test_one_gpu_takes_the_first_spare_port(manager: SandboxManager, hv: FakeHypervisor) -> None:
    pooled = pooled_guest(manager)
    manager.create(gpu_spec(1), refill=False)
    (xml,) = hv.domains[f"vmsbx-{pooled}"].attached
    assert etree.fromstring(xml.encode()).find("address").get("bus") == "0x01"


def test_more_gpus_than_spare_ports_boot_cold(manager: SandboxManager, hv: FakeHypervisor) -> None:
    pooled = pooled_guest(manager)
    sandbox = manager.create(gpu_spec(3, "big"), wait=False)
    assert sandbox.domain == "vmsbx-big"
    assert hv.domains[f"vmsbx-{pooled}"].state == "pooled"  # left for a request it fits
    assert len(hostdevs(hv, "vmsbx-big")) == 3


def test_a_host_without_gpu_ready_guests_boots_cold(
    manager: SandboxManager, hv: FakeHypervisor
) -> None:
    """A pooled guest without spare ports (filled where there was no bindable GPU) serves
    GPU-less creates only."""
    shape = manager.config.pool[0]
    spec = shape_spec(shape)
    assert spec.name is not None
    creation = manager.pool.creation(spec, spec.name, manager.images.get("tiny"), print)
    creation.wait, creation.pool_key = False, shape.key
    runner.run(FILL_STEPS, creation, manager.locked, manager.checkpoint)
    sandbox = manager.create(gpu_spec(1, "cold"), wait=False)
    assert sandbox.domain == "vmsbx-cold"
    assert hv.domains[f"vmsbx-{spec.name}"].state == "pooled"


def hostdevs(hv: FakeHypervisor, domain: str) -> list[etree._Element]:
    return etree.fromstring(hv.domains[domain].xml.encode()).findall("devices/hostdev")


@pytest.mark.parametrize(
    ("failure", "error", "message"),
    [
        ("attach refused", FailedPrecondition, "no room on the bus"),
        ("guest never sees it", DeadlineExceeded, "did not see GPU"),
        ("verification fails", GuestVerificationFailed, "GPU verification in the guest failed"),
    ],
)
def test_a_failed_claim_gives_everything_back(
    manager: SandboxManager,
    config: Config,
    hv: FakeHypervisor,
    guest: FakeGuest,
    monkeypatch: pytest.MonkeyPatch,
    failure: str,
    error: type[Exception],
    message: str,
) -> None:
    """The original error comes out; the guest is stopped, which gives what was attached back
    (nothing is detached one function at a time: libvirt 9.0 cannot unplug one function of a
    multifunction card), and removed (never back to the pool); its GPUs are free and no file
    is left."""
    pooled_guest(manager)
    if failure == "attach refused":
        attached = []
        hv.before["attach"] = lambda domain: (
            refuse("no room on the bus")(domain) if attached else attached.append(domain)
        )
    elif failure == "guest never sees it":
        guest.blind = True
        monkeypatch.setattr(gpu_steps, "SEEN_TIMEOUT", 0.2)
    else:
        guest.lspci_lists = False
    with pytest.raises(error, match=message):
        manager.create(gpu_spec(2), refill=False)
    assert sum(op == "detach" for op, _name in hv.calls) == 0
    assert everything(config, hv) == []


def test_keep_on_failure_boots_cold(manager: SandboxManager, hv: FakeHypervisor) -> None:
    """A claim takes a failed guest apart: a caller who wants it kept gets a cold create."""
    pooled = pooled_guest(manager)
    sandbox = manager.create(gpu_spec(1, "kept"), wait=False, keep_on_failure=True)
    assert sandbox.domain == "vmsbx-kept"
    assert hv.domains[f"vmsbx-{pooled}"].state == "pooled"


STAGES = [step.name for step in GPU_CLAIM_STEPS]


@pytest.mark.parametrize("stage", STAGES[:-1])  # after "ready" it is a sandbox
def test_a_claim_killed_after_any_step_is_taken_apart_by_reconcile(
    manager: SandboxManager, config: Config, hv: FakeHypervisor, stage: str
) -> None:
    """The steps up to ``stage`` ran and their process died: reconcile removes a guest whose
    claim had begun (libvirt gives its GPUs back when its QEMU goes); before that, the pooled
    guest stays in the pool."""
    pooled = pooled_guest(manager)
    shape = manager.config.pool[0]
    creation = manager.pool.claiming(shape, gpu_spec(2), "hit", manager.images.get("tiny"), print)
    steps = GPU_CLAIM_STEPS[: STAGES.index(stage) + 1]
    runner.run(steps, creation, manager.locked, manager.checkpoint)
    dom = hv.domains[f"vmsbx-{pooled}"]
    assert dom.data is not None
    dom.data["creator"] = DEAD
    removed = manager.reconcile()["removed"]
    if STAGES.index(stage) < STAGES.index("claim"):
        assert removed == [] and dom.state == "pooled"
        return
    assert removed == ["hit"]
    assert everything(config, hv) == []


def test_a_bad_gpus_count_of_a_shape_names_its_field(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="over this host's cap") as caught:
        unit_config(tmp_path, max_gpus=4, pool={"gpu": {**SHAPE, "gpus": 8}})
    assert caught.value.details == {"field": "pool.gpu.gpus", "value": 8, "max": 4}


def test_hostdevs_attach_companions_before_function_0(board: Inventory) -> None:
    from vmsandbox.gpu.record import GpuRecord
    from vmsandbox.sandbox.record import HotplugRecord, SandboxRecord

    gpu = replace(
        board.gpus[0], companions=("0000:18:00.1",), companion_ids=(("0x10de", "0x22a3"),)
    )
    record = SandboxRecord.from_dict(
        {"name": "x", "gpus": [GpuRecord.of(gpu).to_dict()], "ssh": {"port": 1}}
    )
    xmls = [xml for _gpu, _bus, xml in gpu_steps._hostdevs(record, HotplugRecord((1,), "uefi"))]
    functions = [
        libvirt_address(
            "0000:18:00." + etree.fromstring(x.encode()).find("source/address").get("function")[2:]
        )["function"]
        for x in xmls
    ]
    assert functions == ["0x1", "0x0"]
    assert etree.fromstring(xmls[1].encode()).find("address").get("multifunction") == "on"


# -- identity of a claimed sandbox's partition; cards with companions ---------------------------

FMPM = FIXTURES / "fmpm" / "fmpm"
DRIVER = "535.216.01"


@pytest.fixture
def fabric_manager(
    tmp_path: Path, hv: FakeHypervisor, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[SandboxManager, Path]]:
    """A manager on the HGX board with its NVSwitches, in shared NVSwitch mode with the fake
    fmpm (its state folder is returned too), an image whose driver is FM's, and a guest that
    answers as the claimed guest would."""
    hgx = discover_hosts(
        {"hgx": ("hgx_h100", {"use_nvml": False, "proc_root": str(tmp_path / "proc")})}
    )["hgx"]
    fm = tmp_path / "fm"
    fm.mkdir()
    monkeypatch.setenv("FAKE_FMPM_STATE", str(fm))
    cfg = tmp_path / "fabricmanager.cfg"
    cfg.write_text("FABRIC_MODE=1\n")
    config = unit_config(
        tmp_path,
        pool={"gpu": SHAPE},
        fmpm=str(FMPM),
        fm_version=DRIVER,
        fabric_manager_config=cfg,
    )
    meta = config.images / "tiny" / IMAGE_ID / "meta.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "nvidia_driver_version": DRIVER}))
    BoardManager.board = hgx
    with BoardManager(config, hypervisor=hv, reconcile=False) as mgr:
        mgr.pool.guest_run = FakeGuest(hv, hgx)
        yield mgr, fm


def test_a_claimed_gpu_sandbox_keeps_its_fabric_partition(
    fabric_manager: tuple[SandboxManager, Path], hv: FakeHypervisor
) -> None:
    """The partition of a sandbox claimed from the pool is leased to its identity (the
    domain's UUID), not to a name: reconcile leaves it active. (The lease named the sandbox
    while reconcile looked for domain names, and a claimed sandbox keeps its guest's domain
    name: every refill's reconcile deactivated the partition under a running guest.)"""
    manager, fm = fabric_manager
    pooled = pooled_guest(manager)
    sandbox = manager.create(gpu_spec(2), verify=False, refill=False)
    assert sandbox.domain == f"vmsbx-{pooled}"
    active = json.loads((fm / "active.json").read_text())
    assert len(active) == 1
    assert manager.reconcile() == {"removed": [], "problems": [], "fabric_partitions": []}
    assert json.loads((fm / "active.json").read_text()) == active
    manager.destroy("hit")
    assert json.loads((fm / "active.json").read_text()) == []


@pytest.fixture
def card_with_companions(board: Inventory) -> Inventory:
    """The board with its first GPU given three companion functions (audio, USB, UCSI)."""
    first = replace(
        board.gpus[0],
        companions=("0000:18:00.1", "0000:18:00.2", "0000:18:00.3"),
        companion_ids=(("0x10de", "0x10f7"), ("0x10de", "0x1ad6"), ("0x10de", "0x1ad7")),
    )
    return replace(board, gpus=(first, *board.gpus[1:]))


def test_a_failed_claim_of_a_card_with_companions_cleans_up_without_a_note(
    config: Config,
    hv: FakeHypervisor,
    card_with_companions: Inventory,
    guest: FakeGuest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """libvirt 9.0 refuses to hot-unplug one function of a multifunction slot: the claim's
    cleanup stops the guest instead (libvirt gives the card back), and nothing is left.
    (Detaching function by function always failed, and the failure was noted.)"""
    BoardManager.board = card_with_companions
    guest.board = card_with_companions
    guest.blind = True
    with BoardManager(config, hypervisor=hv, reconcile=False) as manager:
        manager.pool.guest_run = guest
        pooled_guest(manager)
        spec = replace(gpu_spec(1), gpu=GpuRequest(devices=("0000:18:00.0",)))
        monkeypatch.setattr(gpu_steps, "SEEN_TIMEOUT", 0.2)
        with pytest.raises(DeadlineExceeded, match="did not see GPU") as caught:
            manager.create(spec, refill=False)
    assert getattr(caught.value, "__notes__", []) == []
    assert everything(config, hv) == []


def test_a_parked_gpu_ready_guest_is_restored_then_given_its_gpus(
    manager: SandboxManager, config: Config, hv: FakeHypervisor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GPU-ready guest holds no GPU while pooled, so it can be parked; a claim restores it
    (the wake stubbed: pool/test_park.py) and attaches the GPUs to the running guest."""
    manager.config = manager.pool.config = replace(
        config, pool=tuple(replace(shape, park=True) for shape in config.pool)
    )
    monkeypatch.setattr(park.resume, "reach", lambda *_args: park.resume.Reached(0.1))
    domain = f"vmsbx-{pooled_guest(manager)}"
    assert (hv.domains[domain].state, hv.domains[domain].running) == ("parked", False)
    sandbox = manager.create(gpu_spec(1), refill=False)
    assert (sandbox.domain, sandbox.state) == (domain, "ready")
    assert hv.domains[domain].running and hv.domains[domain].saved is None
    assert set(hv.hostdev_holders().values()) == {domain}
