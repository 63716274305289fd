"""One host of the fleet tests: a vmsandbox driver (the OpenShell compute driver and HostInfo)
on a Unix socket, over the fake hypervisor (tests/framework/fake_hypervisor.py), run under
umockdev-run with a fake host's devices, so its GPUs, NUMA nodes and IOMMU groups are a real host's
shape.

Run as ``fleet_host.py --socket PATH --root DIR --fabric shared|full|none [--pool N]``:

- ``shared``: fabricmanager.cfg says FABRIC_MODE=1 and the fake fmpm (tests/fixtures/fmpm)
  keeps this host's partition state in ROOT/fm; ``full``: FABRIC_MODE=0 (full passthrough);
  ``none``: no NVSwitch fabric.
- There are no guests: a started sandbox is marked ready at once (``_become_ready``); pooled
  guests (``--pool N``: a shape of the image ``tiny`` with 256 MiB, N guests, no GPUs) are
  made by the fill steps without waiting for SSH, and a claim skips the hostname step, which
  needs a guest. The pool is filled at start and refilled in this process after each claim.
- The domains outlive the process, as libvirt's outlive ``vmsandbox serve``: every change is
  written to ROOT/domains.json (``STATE``), which a driver started again on ROOT reads back
  (and reconciles, as ``vmsandbox serve`` does at start: a killed driver's half-made creates
  are taken apart), and which the tests read to judge a host by its own records
  (``domains``).
- Faults for the tests, read from ROOT/faults.json (``FAULTS``) at each call:
  ``{"create_delay": S}`` answers a CreateSandbox S seconds after the sandbox was made (a host
  whose create goes on past its caller's deadline); ``{"create_refused": MESSAGE}`` refuses
  every CreateSandbox with UNAVAILABLE and MESSAGE, as the driver refuses what its host cannot
  make now (a host that stays ready); ``{"info_delay": S}`` answers HostInfo S seconds late (a
  busy host: every agent call that reads it is slow).

Everything else is vmsandbox's own code: the allocator, Fabric Manager partitions through
fmpm, the host lock, the records in the fake domains, the socket's peer gate; the fleet's
agents run as this uid, which the host trusts to speak for gateways
(``openshell_delegate_uids``), as a host's config names its fleet agent's. SIGTERM ends it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for framework.*

from framework import paths
from framework.fake_hypervisor import FakeDomain, FakeHypervisor, unit_config
from framework.openshell_client import Unwatched

from vmsandbox.errors import Unavailable
from vmsandbox.openshell.hostinfo import HostInfo
from vmsandbox.openshell.metrics import HostMetrics
from vmsandbox.openshell.proto import compute_driver_pb2_grpc as pb_grpc
from vmsandbox.openshell.proto import host_info_pb2_grpc as info_grpc
from vmsandbox.openshell.readiness import Readiness
from vmsandbox.openshell.service import ComputeDriver
from vmsandbox.openshell.socket import PeerGate, Peers, allowed_uids
from vmsandbox.sandbox import runner
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.sandbox.pool import keeper, shapes, steps
from vmsandbox.sandbox.record import STATE_READY

FIXTURES = paths.FIXTURES / "fmpm"
DRIVER = "535.216.01"  # the NVIDIA driver the image records and the fake FM reports
STATE = "domains.json"  # in the host's root: its domains, as libvirt keeps them
FAULTS = "faults.json"  # in the host's root: the faults the tests inject
# The methods that change the domains: each is followed by a write of STATE.
CHANGES = ("define", "start", "stop", "shutdown", "undefine", "set_metadata", "attach", "detach")


class SharedHypervisor(FakeHypervisor):
    """The fake hypervisor shared by the driver's threads: one call at a time, as libvirtd
    serializes what it changes, its domains kept in ``state`` (read back when it exists).
    Every public method is wrapped when the instance is made (a dataclass's ``__init__``
    calls no ``__post_init__`` that its own class lacks)."""

    def __init__(self, state: Path) -> None:
        super().__init__()
        self._state = state
        self._lock = threading.RLock()
        if state.exists():
            self.domains = {
                entry["name"]: FakeDomain(**entry["domain"])
                for entry in json.loads(state.read_text())
            }
        for name, method in vars(FakeHypervisor).items():
            if callable(method) and not name.startswith("_"):
                setattr(self, name, self._locked(getattr(self, name), name in CHANGES))

    def _locked(self, method: Callable[..., Any], changes: bool) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                try:
                    return method(*args, **kwargs)
                finally:
                    if changes:
                        self._save()

        return call

    def _save(self) -> None:
        kept = [
            {"name": name, "domain": dataclasses.asdict(domain)}
            for name, domain in self.domains.items()
        ]
        temporary = self._state.with_suffix(".tmp")
        temporary.write_text(json.dumps(kept))
        temporary.replace(self._state)


def domains(root: Path) -> list[dict[str, Any]]:
    """Host ``root``'s domains as its fake libvirt keeps them: name, uuid, running, the
    sandbox record (``data``: labels, owner) and the PCI addresses its definitions hold."""
    from vmsandbox.host.holders import hostdev_addresses

    state = root / STATE
    if not state.exists():
        return []
    found = []
    for entry in json.loads(state.read_text()):
        domain = entry["domain"]
        held: dict[str, None] = {}
        for xml in (domain["next_xml"], domain["xml"]):
            if xml is not None:
                held.update(dict.fromkeys(hostdev_addresses(xml)))
        found.append(
            {
                "name": entry["name"],
                "uuid": domain["uuid"],
                "running": domain["running"],
                "data": domain["data"] or {},
                "gpus": list(held),
            }
        )
    return found


def faults(root: Path) -> dict[str, Any]:
    """The faults injected into host ``root`` now (FAULTS; none when it is absent)."""
    with contextlib.suppress(FileNotFoundError, ValueError):
        return dict(json.loads((root / FAULTS).read_text()))
    return {}


class InstantReadiness(Readiness):
    """Guests that are ready as soon as they start."""

    def become_ready(self, name: str, uuid: str, *, wait: bool = True) -> None:
        with self._manager() as manager, manager.locked("ready"):
            found = manager.store.require(name, uuid)
            manager.store.commit(found, lambda record: record, STATE_READY)


class SlowInfo(HostInfo):
    """HostInfo, as late as the faults of ``root`` say."""

    def __init__(self, root: Path, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.root = root

    def GetHostInfo(self, request: Any, context: grpc.ServicerContext) -> Any:
        time.sleep(float(faults(self.root).get("info_delay", 0)))
        return super().GetHostInfo(request, context)


class FakeGuests(ComputeDriver):
    """The driver, with guests that are ready as soon as they start, and the faults of
    ``root`` (``faults``)."""

    def __init__(self, root: Path, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.root = root
        self.readiness = InstantReadiness(self._manager, self.launches, self.tunnels)

    def CreateSandbox(self, request: Any, context: grpc.ServicerContext) -> Any:
        refused = faults(self.root).get("create_refused")
        if refused:
            return self._call(context, "CreateSandbox", lambda: _refuse(str(refused)))
        answer = super().CreateSandbox(request, context)
        time.sleep(float(faults(self.root).get("create_delay", 0)))
        return answer


def _refuse(message: str) -> None:
    raise Unavailable(message)


def fill(manager: SandboxManager) -> None:
    """Make pooled guests until every shape is full (no SSH: the fill does not wait)."""
    image = manager.images.get("tiny")
    for shape in manager.config.pool:
        while len([r for r, *_ in manager.pool.guests() if shapes.holds(shape, r)]) < shape.count:
            spec = shapes.shape_spec(shape)
            assert spec.name is not None
            creation = manager.pool.creation(spec, spec.name, image, lambda _line: None)
            creation.wait = False
            creation.pool_key, creation.doing = shape.key, "fill"
            runner.run(steps.FILL_STEPS, creation, manager.locked, manager.checkpoint)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--fabric", choices=("shared", "full", "none"), default="none")
    parser.add_argument("--pool", type=int, default=0)
    parser.add_argument("--metrics-address", help="HOST:PORT for the host's Prometheus metrics")
    args = parser.parse_args()
    # gRPC logs an RPC's unhandled exception with its traceback (the caller sees only UNKNOWN):
    # into this host's log, as ``vmsandbox serve`` does.
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    overrides: dict[str, object] = {
        "boot_timeout": 30.0,
        "openshell_delegate_uids": [os.geteuid()],  # the fleet agent's uid speaks for gateways
    }
    if args.fabric != "none":
        cfg = root / "fabricmanager.cfg"
        cfg.write_text(f"FABRIC_MODE={1 if args.fabric == 'shared' else 0}\n")
        overrides["fabric_manager_config"] = cfg
    if args.fabric == "shared":
        fm = root / "fm"
        fm.mkdir(exist_ok=True)
        (fm / "version").write_text(DRIVER)
        os.environ["FAKE_FMPM_STATE"] = str(fm)
        overrides.update(
            fmpm=str(FIXTURES / "fmpm"), fabric_manager=str(FIXTURES / "nv-fabricmanager")
        )
    if args.pool:
        overrides["pool"] = {"small": {"image": "tiny", "memory_mib": 256, "count": args.pool}}
    shutil.rmtree(root / "images", ignore_errors=True)  # made again: a restart finds it
    config = unit_config(root, **overrides)
    meta = next(config.images.glob("tiny/*/meta.json"))
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "nvidia_driver_version": DRIVER}))
    hypervisor = SharedHypervisor(root / STATE)

    def manager() -> SandboxManager:
        return SandboxManager(config, hypervisor=hypervisor, reconcile=False)

    keeper.CLAIM_STEPS = tuple(s for s in steps.CLAIM_STEPS if s.name != "hostname")
    refill = threading.Lock()

    def refill_here(_pool: keeper.WarmPool) -> None:
        def run() -> None:
            with refill, manager() as m:
                fill(m)

        threading.Thread(target=run, daemon=True).start()

    keeper.WarmPool.refill_in_background = refill_here  # type: ignore[method-assign]
    with manager() as m:
        fill(m)
    metrics = HostMetrics(manager) if args.metrics_address else None
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=16),
        interceptors=[metrics.interceptor()] if metrics else [],
    )
    if metrics is not None:
        metrics.serve(args.metrics_address)
    peers = Peers()
    driver = FakeGuests(root, config, Unwatched(), manager=manager, peers=peers)
    driver.resume()  # as `vmsandbox serve` starts: a killed driver's half-made creates go
    pb_grpc.add_ComputeDriverServicer_to_server(driver, server)
    info_grpc.add_HostInfoServicer_to_server(SlowInfo(root, config, manager, peers=peers), server)
    backend = Path(tempfile.mkdtemp(prefix="vmsbx-grpc-")) / "grpc.sock"
    server.add_insecure_port(f"unix:{backend}")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    server.start()
    gate = PeerGate(Path(args.socket), backend, allowed_uids(config), peers)
    gate.start()
    print("serving", flush=True)
    stop.wait()
    gate.close()
    server.stop(2).wait()
    shutil.rmtree(backend.parent)


if __name__ == "__main__":
    main()
