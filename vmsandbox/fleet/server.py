"""``vmsandbox fleet serve --openshell-socket PATH``: the fleet's compute driver for one gateway,
in the foreground until SIGTERM or SIGINT, logging to stderr.

The socket is served as ``vmsandbox serve`` serves its own (a peer check of each connection's
uid, then a relay to gRPC's socket in a private folder). A monitor thread refreshes the hosts
every MONITOR_PERIOD seconds, which is what marks a lost host (hosts.py) and feeds the metrics,
exported over HTTP when ``metrics_address`` is given, and every SWEEP_PERIOD seconds removes
the gateway's claims that wait for placement on behalf of a dead fleet process
(``Fleet.sweep``).
"""

from __future__ import annotations

import logging
import signal
import sys
import tempfile
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc

from vmsandbox.config import Config
from vmsandbox.fleet.core import Fleet
from vmsandbox.fleet.metrics import FleetMetrics
from vmsandbox.fleet.service import FleetDriver
from vmsandbox.openshell.admission import AdmissionPolicy
from vmsandbox.openshell.proto import compute_driver_pb2_grpc as pb_grpc
from vmsandbox.openshell.socket import PeerGate

log = logging.getLogger("vmsandbox.fleet")
MONITOR_PERIOD = 0.5  # seconds between two looks at the hosts
SWEEP_PERIOD = 5.0  # seconds between two sweeps of claims left waiting by dead processes
_WORKERS = 32
_STOP_GRACE = 5.0


def serve(
    socket_path: str,
    *,
    address: str | None,
    gateway: str,
    metrics_address: str | None = None,
    place_timeout: float = 5.0,
    stop: threading.Event | None = None,
) -> int:
    """Serve until ``stop`` is set (SIGTERM/SIGINT when not given); returns the exit status."""
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s"
    )
    config = Config.load()
    metrics = FleetMetrics()
    fleet = Fleet(address, gateway=gateway, place_timeout=place_timeout, metrics=metrics)
    if stop is None:  # after Ray's start, which sets handlers of its own
        stop = threading.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: stop.set())
    driver = FleetDriver(fleet, AdmissionPolicy.from_config(config))
    private = Path(tempfile.mkdtemp(prefix="vmsandbox-fleet-"))
    backend = private / "grpc.sock"
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=_WORKERS))
    pb_grpc.add_ComputeDriverServicer_to_server(driver, server)
    server.add_insecure_port(f"unix:{backend}")
    gate: PeerGate | None = None
    monitor = threading.Thread(target=_monitor, args=(fleet, stop), name="monitor", daemon=True)
    try:
        if metrics_address:
            metrics.serve(metrics_address)
        server.start()
        gate = PeerGate(Path(socket_path), backend, frozenset(config.openshell_allowed_uids))
        gate.start()
        monitor.start()
        log.info("serving the fleet's compute driver for gateway %s on %s", gateway, socket_path)
        stop.wait()
        log.info("stopping")
    finally:
        stop.set()
        if gate is not None:
            gate.close()
        server.stop(_STOP_GRACE).wait()
        driver.close()
        fleet.close()
        backend.unlink(missing_ok=True)
        private.rmdir()
    return 0


def _monitor(fleet: Fleet, stop: threading.Event) -> None:
    swept = 0.0
    while not stop.wait(MONITOR_PERIOD):
        try:
            fleet.hosts()
            if time.monotonic() - swept >= SWEEP_PERIOD:
                swept = time.monotonic()
                fleet.sweep()
        except Exception as exc:  # Ray unreachable for a moment: look again next time
            log.warning("monitor: %s: %s", type(exc).__name__, exc)
