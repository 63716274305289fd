"""Suspend and resume of GPU sandboxes (sandbox/suspend.py, resume.py, handover.py) against the
in-memory hypervisor, whose managed save refuses a guest holding a host device as libvirt does,
the HGX fake host's GPUs as umockdev discovery sees them (made AMD cards, so the verification
is the PCI check), and a fake guest that answers the GPU hand-over program, the wait for the
GPUs below their ports and lspci. A GPU is never held by two sandboxes; a resume without free
GPUs of the model leaves the sandbox suspended."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
from framework.fake_hypervisor import FakeHypervisor
from framework.inventories import discover_hosts
from lxml import etree

from vmsandbox.config import Config
from vmsandbox.errors import FailedPrecondition, ResourceExhausted
from vmsandbox.gpu import hotplug
from vmsandbox.gpu.custody.store import CustodyStore
from vmsandbox.gpu.request import GpuRequest
from vmsandbox.guest.ssh import Endpoint, ExecResult
from vmsandbox.host.model import Inventory
from vmsandbox.sandbox import boot
from vmsandbox.sandbox.holds import Holds
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.sandbox.record import SandboxRecord
from vmsandbox.sandbox.spec import SandboxSpec


@pytest.fixture(scope="module")
def board(tmp_path_factory: pytest.TempPathFactory) -> Inventory:
    """The HGX fake host's eight GPUs as AMD cards, without its NVSwitches."""
    case = {"use_nvml": False, "proc_root": str(tmp_path_factory.mktemp("proc"))}
    hgx = discover_hosts({"hgx": ("hgx_h100", case)})["hgx"]
    amd = tuple(
        replace(gpu, vendor="amd", vendor_id="0x1002", device_id="0x74a1", name="MI300X")
        for gpu in hgx.gpus
    )
    return replace(hgx, gpus=amd, fabric=())


class BoardManager(SandboxManager):
    """A manager whose host GPUs are ``board``'s, held as the fake hypervisor's domains say."""

    board: Inventory

    def gpus(self, in_use: Mapping[str, str] | None = None) -> Inventory:
        holders = self.hypervisor.hostdev_holders() if in_use is None else in_use
        gpus = tuple(replace(gpu, in_use_by=holders.get(gpu.bdf)) for gpu in self.board.gpus)
        return replace(self.board, gpus=gpus)


@dataclass
class FakeGuest:
    """Answers as the guest of the domain holding the SSH port: the hand-over program (with
    ``holders``, processes that hold a GPU: exit 3 unless forced), the GPUs it sees below its
    root ports, lspci."""

    hv: FakeHypervisor
    board: Inventory
    holders: dict[str, str] = field(default_factory=dict)
    commands: list[str] = field(default_factory=list)

    def __call__(
        self, endpoint: Endpoint, _keys: object, command: str, **_kwargs: Any
    ) -> ExecResult:
        self.commands.append(command)
        if "python3 - quiesce" in command:
            if self.holders and "--force" not in command:
                return ExecResult(3, json.dumps({"held": self.holders}) + "\n", "")
            ended = list(self.holders) if "--force" in command else []
            return ExecResult(0, json.dumps({"ended": ended, "unloaded": ["amdgpu"]}) + "\n", "")
        if "python3 - revive" in command:
            return ExecResult(0, json.dumps({"loaded": ["amdgpu"], "restored": []}) + "\n", "")
        seen = list(self._seen(endpoint))
        if command.startswith("for port in"):
            return ExecResult(0, "".join(f"{port} {v} {d}\n" for port, v, d in seen), "")
        if command == "lspci -Dnn":
            lines = [
                f"0000:{n + 1:02x}:00.0 Display controller [0380]: AMD [{v[2:]}:{d[2:]}]"
                for n, (_port, v, d) in enumerate(seen)
            ]
            return ExecResult(0, "\n".join(lines) + "\n", "")
        return ExecResult(0, "", "")

    def _seen(self, endpoint: Endpoint) -> Iterator[tuple[str, str, str]]:
        """(root port's guest address, vendor id, device id) of each GPU the guest holds."""
        dom = next(
            d for d in self.hv.domains.values() if d.data and d.data["ssh"]["port"] == endpoint.port
        )
        if not dom.running:
            return
        ids = {gpu.bdf: (gpu.vendor_id, gpu.device_id) for gpu in self.board.gpus}
        for hostdev in etree.fromstring(dom.xml.encode()).iterfind("devices/hostdev"):
            source = hostdev.find("source/address").attrib
            domain, bus, slot = (source[key][2:] for key in ("domain", "bus", "slot"))
            bdf = f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(slot, 16):02x}.0"
            bus = int(hostdev.find("address").get("bus"), 16)
            port = hotplug.port_of(dom.xml, bus) or f"bus {bus}"  # libvirt places the port
            if bdf in ids:
                yield port, *ids[bdf]


@pytest.fixture
def guest(hv: FakeHypervisor, board: Inventory) -> FakeGuest:
    return FakeGuest(hv, board)


@pytest.fixture
def manager(
    config: Config,
    hv: FakeHypervisor,
    board: Inventory,
    guest: FakeGuest,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[SandboxManager]:
    monkeypatch.setattr(boot, "wait_ready", lambda *_a, **_k: 0.25)
    BoardManager.board = board
    with BoardManager(config, hypervisor=hv, reconcile=False) as mgr:
        mgr.guest_run = guest  # type: ignore[method-assign]
        yield mgr


def gpu_box(manager: SandboxManager, name: str = "box", count: int = 1) -> SandboxRecord:
    spec = SandboxSpec(
        name=name, image="tiny", memory_mib=256, disk_gib=1, gpu=GpuRequest(count=count)
    )
    manager.create(spec, wait=False)
    return record(manager.hypervisor, name)  # type: ignore[arg-type]


def record(hv: FakeHypervisor, name: str = "box") -> SandboxRecord:
    return SandboxRecord.from_dict(hv.domains[f"vmsbx-{name}"].data or {})


def buses(hv: FakeHypervisor, name: str = "box") -> list[int]:
    root = etree.fromstring(hv.domains[f"vmsbx-{name}"].xml.encode())
    return [int(h.find("address").get("bus"), 16) for h in root.iterfind("devices/hostdev")]


def held_by(config: Config, hv: FakeHypervisor, name: str = "box") -> set[str]:
    """Every GPU function the sandbox holds: in its hold and in its domain."""
    uuid = hv.domains[f"vmsbx-{name}"].uuid
    hold = Holds(config).all()[uuid]
    return set(hold.gpus) | {b for b, d in hv.hostdev_holders().items() if d == f"vmsbx-{name}"}


def test_a_suspend_lets_the_gpus_go_in_the_guest_detaches_and_releases_them(
    manager: SandboxManager, hv: FakeHypervisor, config: Config, guest: FakeGuest
) -> None:
    made = gpu_box(manager, count=2)
    slots = buses(hv)
    sandbox = manager.suspend("box")
    assert sandbox.state == "suspended" and hv.domains["vmsbx-box"].saved
    assert any("python3 - quiesce 1002:74a1" in c for c in guest.commands)
    assert held_by(config, hv) == set() and record(hv).gpus == ()
    for gpu in made.gpus:  # released through custody, sanitized, free for the next tenant
        assert CustodyStore(config).get(gpu.bdf).state == "free"
        assert (CustodyStore(config).gpus / f"{gpu.bdf}.json").exists()
    kept = record(hv).suspended
    assert kept is not None and kept.gpus == made.gpus and list(kept.buses) == slots
    assert sandbox.suspended is not None and len(sandbox.suspended["gpus"]) == 2


def test_processes_that_hold_a_gpu_refuse_the_suspend_unless_forced(
    manager: SandboxManager, hv: FakeHypervisor, config: Config, guest: FakeGuest
) -> None:
    made = gpu_box(manager)
    guest.holders = {"4242": "python3 train.py"}
    with pytest.raises(FailedPrecondition, match=r"4242 \(python3 train.py\).*--force"):
        manager.suspend("box")
    assert hv.domains["vmsbx-box"].running and record(hv).gpus == made.gpus
    assert record(hv).suspended is None and held_by(config, hv) == {made.gpus[0].bdf}
    assert manager.get("box").state == "ready"
    assert manager.suspend("box", force=True).state == "suspended"


@pytest.mark.parametrize(
    ("fabric", "words"),
    [
        ({"fabric_partition": 4}, "its GPUs are joined by Fabric Manager partition 4"),
        ({"switches": ["0000:05:00.0"]}, "NVSwitches 0000:05:00.0 are passed to it"),
    ],
)
def test_a_sandbox_on_an_nvswitch_board_is_refused_before_anything_is_touched(
    manager: SandboxManager,
    hv: FakeHypervisor,
    config: Config,
    guest: FakeGuest,
    fabric: dict[str, object],
    words: str,
) -> None:
    """Its GPUs could not be reset while the partition stays active (or its switches not
    detached): the suspend says so, and the guest, its GPUs and its hold stay as they were."""
    made = gpu_box(manager)
    dom = hv.domains["vmsbx-box"]
    dom.data = {**(dom.data or {}), **fabric}
    before = manager.get("box").state
    with pytest.raises(FailedPrecondition, match=f"cannot be suspended: {words}") as caught:
        manager.suspend("box")
    assert caught.value.details["name"] == "box"
    assert dom.running and dom.saved is None and record(hv).suspended is None
    assert held_by(config, hv) == {made.gpus[0].bdf}
    assert not any("quiesce" in c for c in guest.commands)
    assert manager.get("box").state == before


def test_a_resume_takes_a_free_gpu_of_the_model_at_the_old_slot_and_verifies(
    manager: SandboxManager, hv: FakeHypervisor, config: Config, guest: FakeGuest
) -> None:
    made = gpu_box(manager)
    slots = buses(hv)
    manager.suspend("box")
    other = gpu_box(manager, "other")  # takes the card the suspended sandbox let go
    assert other.gpus[0].bdf == made.gpus[0].bdf
    sandbox = manager.resume("box")
    assert sandbox.state == "ready" and sandbox.verification and sandbox.verification["ok"]
    now = record(hv)
    assert now.gpus[0].bdf != made.gpus[0].bdf and now.suspended is None
    assert buses(hv) == slots
    assert held_by(config, hv) == {now.gpus[0].bdf}
    assert held_by(config, hv, "other") == {made.gpus[0].bdf}
    assert any("python3 - revive" in c for c in guest.commands)


def test_a_resume_without_free_gpus_of_the_model_stays_suspended(
    manager: SandboxManager, hv: FakeHypervisor, config: Config
) -> None:
    gpu_box(manager)
    manager.suspend("box")
    gpu_box(manager, "all", count=8)
    with pytest.raises(ResourceExhausted, match="stays suspended"):
        manager.resume("box")
    assert manager.get("box").state == "suspended" and hv.domains["vmsbx-box"].saved
    assert held_by(config, hv) == set()
    manager.destroy("all")
    assert manager.resume("box").state == "ready"


def test_a_failed_attach_leaves_it_suspended_with_no_gpu_held(
    manager: SandboxManager, hv: FakeHypervisor, config: Config
) -> None:
    gpu_box(manager)
    manager.suspend("box")

    def fail(_domain: str) -> None:
        raise FailedPrecondition("attach refused")

    hv.before["attach"] = fail
    with pytest.raises(FailedPrecondition, match="attach refused"):
        manager.resume("box")
    # restored, but its GPU never came: saved again, suspended, no GPU held (never two holders)
    assert manager.get("box").state == "suspended" and held_by(config, hv) == set()
    assert record(hv).suspended is not None and hv.domains["vmsbx-box"].saved
    del hv.before["attach"]
    assert manager.resume("box").state == "ready"


def test_a_resume_whose_gpu_is_never_seen_detaches_it_and_stays_suspended(
    manager: SandboxManager, hv: FakeHypervisor, config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vmsandbox.errors import DeadlineExceeded
    from vmsandbox.sandbox import handover

    gpu_box(manager)
    manager.suspend("box")

    def unseen(*_args: Any) -> None:
        raise DeadlineExceeded("the guest did not see GPU")

    monkeypatch.setattr(handover, "wait_until_seen", unseen)
    with pytest.raises(DeadlineExceeded):
        manager.resume("box")
    assert manager.get("box").state == "suspended" and held_by(config, hv) == set()


def test_a_resume_killed_with_gpus_reserved_gives_them_back_at_reconcile(
    manager: SandboxManager, hv: FakeHypervisor, config: Config
) -> None:
    """Killed after it reserved a GPU, before it restored the guest: the sandbox stays
    suspended and the GPU it reserved is let go."""
    from vmsandbox.lock import host_lock
    from vmsandbox.vm.process import ProcessIdentity

    made = gpu_box(manager)
    manager.suspend("box")
    uuid = hv.domains["vmsbx-box"].uuid
    with host_lock(config.lock_path, 5):
        holds = Holds(config)
        hold = holds.get(uuid)
        assert hold is not None
        dead = ProcessIdentity(pid=1, start="0", boot="another boot")
        holds.put(replace(hold, gpus=(made.gpus[0].bdf,), owner=dead, doing="resume"))
    manager.store.put(replace(record(hv), gpus=made.gpus), "resuming", uuid)
    assert held_by(config, hv) == {made.gpus[0].bdf}
    assert manager.reconcile()["settled"] == ["box: suspended"]
    assert held_by(config, hv) == set() and manager.get("box").state == "suspended"
    assert manager.resume("box").state == "ready"
