"""A GPU host and its guests for suspend and resume tests on the in-memory hypervisor: the HGX fake
host's GPUs as AMD cards (so the in-guest verification is the PCI check), with or without its
NVSwitches (``amd_board``); a manager whose host GPUs are the board's (``BoardManager``, made by
``board_manager``; ``gpu_box`` creates a GPU sandbox on it); a fake guest that answers the GPU
hand-over program, the wait for the GPUs below their ports and lspci (``FakeGuest``); and what a
test reads of a sandbox (``record``, ``buses``, ``held_by``)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from framework.fake_hypervisor import FakeHypervisor
from lxml import etree

from vmsandbox.config import Config
from vmsandbox.gpu import hotplug
from vmsandbox.gpu.request import GpuRequest
from vmsandbox.guest.ssh import Endpoint, ExecResult
from vmsandbox.host.model import Inventory
from vmsandbox.sandbox import boot
from vmsandbox.sandbox.holds import Holds
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.sandbox.record import SandboxRecord
from vmsandbox.sandbox.spec import SandboxSpec


def amd_board(hgx: Inventory, *, switches: bool = False) -> Inventory:
    """The HGX fake host's eight GPUs as AMD cards, with its NVSwitches or without them."""
    amd = tuple(
        replace(gpu, vendor="amd", vendor_id="0x1002", device_id="0x74a1", name="MI300X")
        for gpu in hgx.gpus
    )
    return replace(hgx, gpus=amd, fabric=hgx.fabric if switches else ())


class BoardManager(SandboxManager):
    """A manager whose host GPUs are ``board``'s, held as the fake hypervisor's domains say."""

    board: Inventory

    def gpus(self, in_use: Mapping[str, str] | None = None) -> Inventory:
        holders = self.hypervisor.hostdev_holders() if in_use is None else in_use
        gpus = tuple(replace(gpu, in_use_by=holders.get(gpu.bdf)) for gpu in self.board.gpus)
        return replace(self.board, gpus=gpus)


@contextlib.contextmanager
def board_manager(
    config: Config, hv: FakeHypervisor, board: Inventory, guest: Any = None
) -> Iterator[SandboxManager]:
    """A ``BoardManager`` on ``board`` whose boot waits return at once and whose guest
    commands ``guest`` answers (when given)."""
    BoardManager.board = board
    real = boot.wait_ready
    boot.wait_ready = lambda *_a, **_k: 0.25  # type: ignore[assignment]
    try:
        with BoardManager(config, hypervisor=hv, reconcile=False) as manager:
            if guest is not None:
                manager.guest_run = guest  # type: ignore[method-assign]
            yield manager
    finally:
        boot.wait_ready = real  # type: ignore[assignment]


def gpu_box(manager: SandboxManager, name: str = "box", count: int = 1) -> SandboxRecord:
    """A sandbox of ``count`` GPUs created (not waited for); its record."""
    spec = SandboxSpec(
        name=name, image="tiny", memory_mib=256, disk_gib=1, gpu=GpuRequest(count=count)
    )
    manager.create(spec, wait=False)
    return record(manager.hypervisor, name)  # type: ignore[arg-type]


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
