"""The GPU health monitor: it looks at the host's GPUs every ``gpu_health_interval`` seconds
(``vmsandbox serve`` runs it in a thread, ``vmsandbox gpus watch`` in the foreground), turns
what it sees into health signals (``vmsandbox.gpu.custody.signals``) and applies them to the
GPUs' custody under the host lock, within the pass that saw them.

Each pass (``Monitor.look``):

1. reads the inventory (sysfs only: NVML is not started every second) with the domains
   holding each GPU and each GPU's custody;
2. gathers signals: each GPU's config space and power state (not of a GPU being sanitized or
   reset: its own steps judge it), the AER lines the host kernel logged since the last pass
   (a cursor in ``<state>/custody/kmsg.cursor``), domains libvirt reports paused on a fault
   two passes in a row, and every ``xid_interval`` seconds (30) the Xid lines in the kernel
   log of each running sandbox with NVIDIA GPUs (over SSH, as verify reads them);
3. under the lock, applies them: a signal that quarantines makes the GPU suspect or
   quarantined (state.py says which) and the sandbox holding it ``failed``, with the reason, in
   its record (the CLI, the Python API and the OpenShell driver's watch read it from there);
   a signal that does not (a corrected AER error, an application's Xid) is logged only;
4. outside the lock, gives each suspect GPU that nothing holds its one automatic reset, and
   sanitizes the GPUs a dead process left sanitizing.

``from_verification``: the Xid lines an in-guest verification found (``vmsandbox verify``) go
the same way.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from vmsandbox.errors import VmSandboxError
from vmsandbox.gpu.custody import signals, state, work
from vmsandbox.gpu.custody.signals import Signal
from vmsandbox.gpu.custody.store import CustodyStore
from vmsandbox.host import aer, pcistate
from vmsandbox.host.kernlog import KernelLog
from vmsandbox.sandbox import custody
from vmsandbox.sandbox.record import STATE_FAILED, SandboxRecord, names_domain

if TYPE_CHECKING:
    import builtins
    import contextlib as _contextlib

    from vmsandbox.config import Config
    from vmsandbox.guest.ssh import ExecResult
    from vmsandbox.host.model import Gpu, Inventory
    from vmsandbox.sandbox.handle import Sandbox
    from vmsandbox.sandbox.store import SandboxStore
    from vmsandbox.vm.hypervisor import Hypervisor

log = logging.getLogger(__name__)


class SandboxManager(Protocol):
    """What the monitor uses of ``vmsandbox.sandbox.manager.SandboxManager`` (which imports
    this module, so it is named by what it does)."""

    config: Config
    hypervisor: Hypervisor
    store: SandboxStore

    def gpus(self, in_use: Mapping[str, str] | None = None) -> Inventory: ...
    def list(self) -> builtins.list[Sandbox]: ...
    def exec(self, name: str, command: str, *, timeout: float | None = None) -> ExecResult: ...
    def locked(self, purpose: str = "") -> _contextlib.AbstractContextManager[None]: ...


QUARANTINED_REASON = "GpuQuarantined"  # the failure's reason in a sandbox's record
XID_INTERVAL_S = 30.0  # between looks into running GPU guests' kernel logs (over SSH)


@dataclass(frozen=True)
class Seen:
    """One signal the monitor applied: the GPU's record after it (None: it changed nothing,
    or only reports) and the sandbox it marked failed. ``at`` is when the pass read it and
    ``applied`` when the record was written (``time.time()``)."""

    signal: Signal
    record: state.Custody | None = None
    sandbox: str | None = None
    at: float = 0.0
    applied: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "bdf": self.signal.bdf,
            "kind": self.signal.kind,
            "words": self.signal.words,
            "quarantines": self.signal.quarantines,
            "state": self.record.state if self.record else None,
            "sandbox": self.sandbox,
            "seen_at": self.at,
            "applied_at": self.applied,
        }


@dataclass
class Monitor:
    """The monitor of one manager's host (see the module docstring). ``paused`` lists the
    paused domains with libvirt's reason (vm/faults.py on libvirt; tests hand in their own)."""

    manager: SandboxManager
    paused: Callable[[], Mapping[str, str]] | None = None
    inventory: Callable[[], Inventory] | None = None
    kernel_log: KernelLog | None = None
    clock: Callable[[], float] = time.time
    xid_interval: float = XID_INTERVAL_S
    _paused_before: dict[str, str] = field(default_factory=dict)
    _last_xids: float = 0.0
    _xid_lines: dict[str, set[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        config = self.manager.config
        if self.inventory is None:
            self.inventory = lambda: _sysfs_inventory(self.manager)
        if self.kernel_log is None:
            self.kernel_log = KernelLog(config.state_dir / "custody" / "kmsg.cursor")
        if self.paused is None:
            from vmsandbox.vm.hypervisor import LibvirtHypervisor

            hypervisor = self.manager.hypervisor
            if isinstance(hypervisor, LibvirtHypervisor):
                from vmsandbox.vm import faults

                self.paused = lambda: faults.paused(hypervisor.conn)

    def look(self) -> list[Seen]:
        """One pass (see the module docstring): what it applied."""
        at = self.clock()
        assert self.inventory is not None
        inventory = self.inventory()
        found = self._signals(inventory)
        seen = self._apply(found, inventory, at)
        self._recover()
        return seen

    def _signals(self, inventory: Inventory) -> list[Signal]:
        config = self.manager.config
        sysfs = str(config.pci_sysfs)
        records = CustodyStore(config).all()
        watched = [
            gpu
            for gpu in inventory.gpus
            if records.get(gpu.bdf, state.Custody(gpu.bdf)).state not in state.AT_WORK
        ]
        found = [s for gpu in watched if (s := signals.from_config_space(gpu, sysfs))]
        assert self.kernel_log is not None
        lines = [record.text for record in self.kernel_log.new()]
        if lines:
            ports = {gpu.bdf: pcistate.parent_bridge(gpu.bdf, sysfs) for gpu in watched}
            found += signals.from_aer(aer.parse(lines), watched, ports)
        found += self._pauses(inventory)
        if self.clock() - self._last_xids >= self.xid_interval:
            self._last_xids = self.clock()
            found += self._xids()
        return found

    def _pauses(self, inventory: Inventory) -> list[Signal]:
        now = dict(self.paused()) if self.paused is not None else {}
        stuck = {d: r for d, r in now.items() if self._paused_before.get(d) == r}
        self._paused_before = now
        found = []
        for domain, reason in stuck.items():
            held = [gpu.bdf for gpu in inventory.gpus if gpu.in_use_by == domain]
            found += signals.from_pause(held, domain, reason)
        return found

    def _xids(self) -> list[Signal]:
        """New Xid lines in the kernel log of each running sandbox with NVIDIA GPUs."""
        from vmsandbox.guest.verify import KERNEL_LOG

        found = []
        for sandbox in self.manager.list():
            nvidia = [g for g in sandbox.gpus if g.get("vendor_id") == "0x10de"]
            if sandbox.state != "ready" or not nvidia or sandbox.ssh is None:
                continue
            try:
                done = self.manager.exec(sandbox.name, KERNEL_LOG, timeout=30)
            except VmSandboxError as exc:
                log.info("health: reading %s's kernel log: %s", sandbox.name, exc.message)
                continue
            seen = self._xid_lines.setdefault(sandbox.domain, set())
            for bdf, xid, line in xid_events(sandbox.to_dict(), done.stdout):
                if line not in seen:
                    seen.add(line)
                    found.append(signals.from_xid(bdf, xid, line))
        return found

    def _apply(self, found: list[Signal], inventory: Inventory, at: float) -> list[Seen]:
        if not found:
            return []
        manager, seen = self.manager, []
        holders = {gpu.bdf: gpu.in_use_by for gpu in inventory.gpus}
        store = CustodyStore(manager.config)
        with manager.locked("apply GPU health signals"):
            for signal in found:
                if not signal.quarantines:
                    store.log({"bdf": signal.bdf, "reported": signal.words, "kind": signal.kind})
                    seen.append(Seen(signal, at=at, applied=self.clock()))
                    continue
                record = store.change(signal.bdf, _signalled(signal), f"{signal.kind} signal")
                failed = None
                if record is not None and holders.get(signal.bdf):
                    failed = _fail_sandbox(manager, holders[signal.bdf] or "", record)
                seen.append(Seen(signal, record, failed, at, self.clock()))
        for item in seen:
            if item.record is not None:
                log.warning(
                    "GPU %s is %s: %s", item.signal.bdf, item.record.state, item.signal.words
                )
        return seen

    def _recover(self) -> None:
        """Suspect GPUs that nothing holds get their automatic reset; sanitizes a dead
        process left are done again."""
        config, manager = self.manager.config, self.manager
        for bdf, record in CustodyStore(config).all().items():
            if record.state != state.SUSPECT:
                continue
            try:
                work.check(config, manager.locked, bdf, _holder(manager, bdf), automatic=True)
            except VmSandboxError:
                continue  # still held: its release resets it
        custody.sanitize(config, manager.locked, work.waiting(config))

    def run(self, stop: threading.Event, report: Callable[[Seen], None] | None = None) -> None:
        """Look every ``gpu_health_interval`` seconds until ``stop`` is set; a pass that fails
        is logged and the next one runs."""
        interval = self.manager.config.gpu_health_interval
        try:
            while not stop.is_set():
                began = time.monotonic()
                try:
                    for item in self.look():
                        if report is not None:
                            report(item)
                except VmSandboxError as exc:
                    log.warning("GPU health pass failed: %s", exc.message)
                except Exception:  # a monitor that dies watches nothing: log it, look again
                    log.exception("GPU health pass failed")
                stop.wait(max(0.0, interval - (time.monotonic() - began)))
        finally:
            assert self.kernel_log is not None
            self.kernel_log.close()


def _sysfs_inventory(manager: SandboxManager) -> Inventory:
    """The inventory from sysfs alone (no NVML), with holders and custody."""
    from vmsandbox.host import discover

    config = manager.config
    holders = manager.hypervisor.hostdev_holders()
    found = discover(in_use=holders, use_nvml=False, require_reset=config.require_gpu_reset)
    return custody.shown(config, found)


def _holder(manager: SandboxManager, bdf: str) -> Callable[[], str | None]:
    return lambda: custody.held_by(manager.config, manager.hypervisor, bdf)


def _signalled(signal: Signal) -> Callable[[state.Custody], state.Custody | None]:
    def apply(record: state.Custody) -> state.Custody | None:
        return state.signalled(record, signal.kind, signal.words, signal.reset_cures)

    return apply


def _fail_sandbox(manager: SandboxManager, domain: str, record: state.Custody) -> str | None:
    """Under the lock: the sandbox of ``domain`` stored failed because its GPU is out."""
    stored = manager.hypervisor.metadata(domain)
    if stored is None or stored.data is None or not names_domain(stored.data, stored.domain):
        return None
    try:
        sandbox = SandboxRecord.from_dict(stored.data)
    except VmSandboxError:
        return None
    if not manager.store.local(sandbox):
        return None
    failure = {
        "code": "UNAVAILABLE",
        "message": f"GPU {record.bdf} is {record.state}: {record.reason}",
        "reason": QUARANTINED_REASON,
    }
    manager.hypervisor.set_metadata(
        domain, replace(sandbox, failure=failure).to_dict(), STATE_FAILED
    )
    return sandbox.name


def xid_events(sandbox: Mapping[str, Any], kernel_log: str) -> list[tuple[str, int, str]]:
    """(host BDF, Xid, line) of each Xid in a guest's kernel log, the guest's address mapped
    to the host's by the sandbox's last verification (a sandbox of one GPU needs none)."""
    from vmsandbox.guest.verify import parse_kernel_log
    from vmsandbox.host.bdf import slot_of

    events, _lines = parse_kernel_log(kernel_log)
    verification = sandbox.get("verification") or {}
    by_guest = {
        slot_of(gpu["guest_address"]): gpu["host_bdf"]
        for gpu in verification.get("gpus", [])
        if gpu.get("guest_address")
    }
    only = [gpu["bdf"] for gpu in sandbox.get("gpus", [])]
    found = []
    for event in events:
        if event.xid is None:
            continue
        bdf = by_guest.get(event.address or "") or (only[0] if len(only) == 1 else None)
        if bdf is not None:
            found.append((bdf, event.xid, event.line))
    return found


def from_verification(
    manager: SandboxManager, record: SandboxRecord, report: Mapping[str, Any]
) -> None:
    """The Xids an in-guest verification read, applied as the monitor applies them."""
    text = "\n".join(report.get("kernel_events", []))
    sandbox = {"gpus": [{"bdf": gpu.bdf} for gpu in record.gpus], "verification": report}
    found = [signals.from_xid(bdf, xid, line) for bdf, xid, line in xid_events(sandbox, text)]
    if not found:
        return
    holders = {bdf: record.domain for bdf in (gpu.bdf for gpu in record.gpus)}
    inventory = _held(manager.gpus(), holders)
    with contextlib.suppress(VmSandboxError):
        Monitor(manager, paused=lambda: {})._apply(found, inventory, time.time())


def _held(inventory: Inventory, holders: Mapping[str, str]) -> Inventory:
    gpus: tuple[Gpu, ...] = tuple(
        replace(gpu, in_use_by=holders.get(gpu.bdf, gpu.in_use_by)) for gpu in inventory.gpus
    )
    return replace(inventory, gpus=gpus)
