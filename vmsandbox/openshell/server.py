"""``vmsandbox serve --openshell-socket PATH``: the compute driver in the foreground until
SIGTERM or SIGINT, logging to stderr; it also reaps the sandboxes whose lifetime has ended
(``create --ttl``), every minute. The socket also serves ``vmsandbox.host.v1.HostInfo``
(hostinfo.py), which a fleet agent on this host reads. The GPU health monitor
(vmsandbox/sandbox/health.py) runs beside it, in a thread.

gRPC listens on a socket in a private 0700 folder; the gateway's socket at PATH is served by a
``PeerGate`` that checks each peer's uid and relays to it, telling the services which uid each
connection is (``socket.Peers``: every RPC is its caller's, openshell/caller.py). A gateway that
disconnects and reconnects needs nothing: every connection is accepted anew and the service
keeps no per-connection state.
"""

from __future__ import annotations

import logging
import signal
import sys
import tempfile
import threading
from concurrent import futures
from pathlib import Path

import grpc

from vmsandbox.config import Config
from vmsandbox.errors import VmSandboxError
from vmsandbox.openshell.events import DomainEvents
from vmsandbox.openshell.hostinfo import HostInfo
from vmsandbox.openshell.proto import compute_driver_pb2_grpc as pb_grpc
from vmsandbox.openshell.proto import host_info_pb2_grpc as info_grpc
from vmsandbox.openshell.service import ComputeDriver
from vmsandbox.openshell.socket import PeerGate, Peers, allowed_uids
from vmsandbox.sandbox.lifetime import Reaped, Reaper
from vmsandbox.sandbox.manager import SandboxManager

log = logging.getLogger("vmsandbox.openshell")
_WORKERS = 32  # each open watch stream holds one
_STOP_GRACE = 5.0  # seconds in-flight RPCs get to finish at shutdown
# Seconds between the main thread's looks at the stop flag. A SIGTERM that the kernel hands to
# another thread (gRPC's, a readiness wait) does not interrupt a wait without a timeout, and
# Python runs its handler only once the main thread runs again.
_SIGNAL_POLL = 1.0


def _health_monitor(config: Config, stop: threading.Event) -> threading.Thread:
    """The GPU health monitor (sandbox/health.py) in a thread of its own, until ``stop``."""
    from vmsandbox.sandbox.health import Monitor

    manager = SandboxManager(config, reconcile=False)

    def watch() -> None:
        try:
            Monitor(manager).run(stop)
        finally:
            manager.close()

    thread = threading.Thread(target=watch, name="gpu-health", daemon=True)
    thread.start()
    return thread


def serve(
    socket_path: str, config: Config | None = None, *, metrics_address: str | None = None
) -> int:
    """Serve until SIGTERM/SIGINT; returns the exit status (0). A socket that cannot be
    served raises its vmsandbox error, after everything made so far is removed. With
    ``metrics_address`` (HOST:PORT), Prometheus metrics are exported there (metrics.py)."""
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s"
    )
    config = config or Config.load()
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    events = DomainEvents(config.uri)
    peers = Peers()
    try:
        driver = ComputeDriver(config, events, peers=peers)  # a bad supervisor stops us here
    except VmSandboxError:
        events.close()
        raise
    private = Path(tempfile.mkdtemp(prefix="vmsandbox-grpc-"))  # mkdtemp: 0700, ours alone
    backend = private / "grpc.sock"
    metrics = None
    if metrics_address:
        from vmsandbox.openshell.metrics import HostMetrics

        metrics = HostMetrics(lambda: SandboxManager(config, reconcile=False))
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=_WORKERS),
        interceptors=[metrics.interceptor()] if metrics else [],
    )
    pb_grpc.add_ComputeDriverServicer_to_server(driver, server)
    info_grpc.add_HostInfoServicer_to_server(HostInfo(config, peers=peers), server)
    server.add_insecure_port(f"unix:{backend}")
    gate: PeerGate | None = None
    health: threading.Thread | None = None
    reaper = Reaper(lambda: _reap(config))  # sandboxes whose lifetime ended (create --ttl)
    try:
        if metrics is not None and metrics_address:
            metrics.serve(metrics_address)
        server.start()
        gate = PeerGate(Path(socket_path), backend, allowed_uids(config), peers)
        gate.start()
        driver.resume()
        health = _health_monitor(config, stop)
        reaper.start()
        log.info("serving the OpenShell compute driver on %s", socket_path)
        while not stop.wait(_SIGNAL_POLL):
            pass
        log.info("stopping")
    finally:  # a failure to start propagates: the CLI prints its code and message
        reaper.close()
        if gate is not None:
            gate.close()
        server.stop(_STOP_GRACE).wait()
        if health is not None:
            stop.set()
            health.join(_STOP_GRACE)
        driver.close()
        events.close()
        backend.unlink(missing_ok=True)
        private.rmdir()
    return 0


def _reap(config: Config) -> Reaped:
    with SandboxManager(config, reconcile=False) as manager:
        return manager.reap()
