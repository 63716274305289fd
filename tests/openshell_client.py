"""Test helpers for the OpenShell driver: a served ``vmsandbox serve`` process, a client built
from the project's proto, a watch-stream reader, and a port of the gateway's phase derivation
(NVIDIA/OpenShell crates/openshell-server/src/compute/mod.rs, ``derive_phase``, at 2f7fb65)."""

from __future__ import annotations

import contextlib
import queue
import signal
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc

from vmsandbox.openshell.proto import compute_driver_pb2 as pb
from vmsandbox.openshell.proto import compute_driver_pb2_grpc as pb_grpc

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
