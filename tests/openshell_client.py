"""Test helpers for the OpenShell driver: a served ``vmsandbox serve`` process, the driver served
in this process over a fake hypervisor, a client built from the project's proto, the checks a
gateway makes of the capabilities, a watch-stream reader, and a port of the gateway's phase
derivation (NVIDIA/OpenShell crates/openshell-server/src/compute/mod.rs, ``derive_phase``, at
2f7fb65)."""

from __future__ import annotations

import contextlib
import queue
import shutil
import signal
import socketserver
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
from fake_hypervisor import FakeHypervisor

from vmsandbox.config import Config
from vmsandbox.openshell.events import DomainEvent
from vmsandbox.openshell.proto import compute_driver_pb2 as pb
from vmsandbox.openshell.proto import compute_driver_pb2_grpc as pb_grpc
from vmsandbox.openshell.service import ComputeDriver
from vmsandbox.sandbox.manager import SandboxManager

_TRANSIENT = {
    "reconcilererror",
    "dependenciesnotready",
    "supervisornotconnected",
    "starting",
    "containerstarting",
    "containercreated",
    "healthcheckstarting",
    "inspectfailed",
}


def phase(sandbox: pb.DriverSandbox) -> str:
    """The public phase the gateway derives from a driver snapshot."""
    if not sandbox.HasField("status"):
        return "Unknown"
    status = sandbox.status
    if status.deleting:
        return "Deleting"
    if any(c.type.lower() == "suspended" and c.status.lower() == "true" for c in status.conditions):
        return "Stopped"
    for condition in status.conditions:
        if condition.type == "Ready":
            if condition.status.lower() == "true":
                return "Ready"
            if condition.status.lower() == "false":
                return "Provisioning" if condition.reason.lower() in _TRANSIENT else "Error"
            return "Provisioning"
    return "Provisioning"


def check_capabilities(caps: pb.GetCapabilitiesResponse, *, supervised: bool) -> None:
    """What a gateway reads from GetCapabilities, as vmsandbox must answer it."""
    assert (caps.driver_name, caps.default_image, caps.gateway_manages_lifecycle) == (
        "vmsandbox",
        "minimal",
        False,
    )
    assert caps.supports_sandbox_authentication is True
    # with a supervisor the gateway also waits for its callback; without one vmsandbox decides
    assert caps.driver_reports_runtime_readiness is (not supervised)
    resources = caps.resource_capabilities
    assert resources.cpu.limit_supported and resources.memory.limit_supported
    assert resources.gpu.default_selection_supported and resources.gpu.count_selection_supported


def stub(socket_path: Path) -> tuple[grpc.Channel, pb_grpc.ComputeDriverStub]:
    channel = grpc.insecure_channel(f"unix:{socket_path}")
    return channel, pb_grpc.ComputeDriverStub(channel)


@contextlib.contextmanager
def serving(
    socket_path: Path, env: dict[str, str], prefix: list[str] | None = None
) -> Iterator[subprocess.Popen[str]]:
    """``vmsandbox serve`` until the block ends; then SIGTERM, which must end it with 0 and
    remove its socket. Its stderr goes to a file beside the socket (read on failure)."""
    log = socket_path.parent.parent / f"{socket_path.name}.log"
    with log.open("w") as err:
        process = subprocess.Popen(
            [
                *(prefix or []),
                *(sys.executable, "-m", "vmsandbox.cli", "serve"),
                *("--openshell-socket", str(socket_path)),
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
            text=True,
        )
    try:
        _wait_answering(socket_path, process, log)
        yield process
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
        assert code == 0, log.read_text()
        assert not socket_path.exists()


def _wait_answering(socket_path: Path, process: subprocess.Popen[str], log: Path) -> None:
    """Until GetCapabilities answers; the server failing to start fails the test."""
    while True:
        if process.poll() is not None:
            raise AssertionError(f"serve exited {process.returncode}: {log.read_text()}")
        if socket_path.exists():
            channel, client = stub(socket_path)
            with channel, contextlib.suppress(grpc.RpcError):
                client.GetCapabilities(pb.GetCapabilitiesRequest(), timeout=10)
                return
        time.sleep(0.2)


class Unwatched:
    """The event source of a driver no test watches: its queues never fill. (The real one,
    ``DomainEvents``, registers libvirt's event loop for the whole process, which would turn
    on keepalive for every other libvirt connection of the test run.)"""

    def subscribe(self) -> queue.Queue[DomainEvent]:
        return queue.Queue()

    def unsubscribe(self, events: queue.Queue[DomainEvent]) -> None:
        """Nothing to drop."""


@contextlib.contextmanager
def in_process(config: Config, hypervisor: FakeHypervisor) -> Iterator[Path]:
    """The driver served in this process on a Unix socket (the path is yielded), its managers
    over ``hypervisor``; no peer check, no libvirt events."""
    folder = Path(tempfile.mkdtemp(prefix="vmsbx-os-"))  # short: a socket path has 108 bytes
    socket_path = folder / "driver.sock"
    driver = ComputeDriver(
        config,
        Unwatched(),
        manager=lambda: SandboxManager(config, hypervisor=hypervisor, reconcile=False),
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_ComputeDriverServicer_to_server(driver, server)
    server.add_insecure_port(f"unix:{socket_path}")
    server.start()
    try:
        yield socket_path
    finally:
        server.stop(None).wait()
        driver.close()
        shutil.rmtree(folder)


class Watch:
    """A WatchSandboxes stream read by a thread into a queue."""

    def __init__(self, socket_path: Path) -> None:
        self.channel, client = stub(socket_path)
        self.events: queue.Queue[pb.WatchSandboxesEvent] = queue.Queue()
        self._stream = client.WatchSandboxes(pb.WatchSandboxesRequest())
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        with contextlib.suppress(grpc.RpcError):
            for event in self._stream:
                self.events.put(event)

    def until(self, wanted: str, sandbox_id: str, timeout: float = 900) -> list[str]:
        """Phases of ``sandbox_id`` seen until phase ``wanted`` (or ``"deleted"``)."""
        seen: list[str] = []
        deadline = time.monotonic() + timeout
        while True:
            event = self.events.get(timeout=max(0.1, deadline - time.monotonic()))
            kind = event.WhichOneof("payload")
            if kind == "deleted" and event.deleted.sandbox_id == sandbox_id:
                seen.append("deleted")
            elif kind == "sandbox" and event.sandbox.sandbox.id == sandbox_id:
                seen.append(phase(event.sandbox.sandbox))
            if seen and seen[-1] == wanted:
                return seen

    def close(self) -> None:
        self._stream.cancel()
        self.channel.close()


class LineGateway:
    """A stand-in for the gateway's listener on 127.0.0.1: answers each line it is sent with
    ``gateway saw: LINE`` and keeps the lines, so a test sees what reached the host."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def _handler(self) -> type[socketserver.StreamRequestHandler]:
        lines = self.lines

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                line = self.rfile.readline().decode().strip()
                lines.append(line)
                self.wfile.write(f"gateway saw: {line}\n".encode())

        return Handler

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
