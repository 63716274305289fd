"""Test helpers for the OpenShell driver: a served ``vmsandbox serve`` process, the driver served
in this process over a fake hypervisor, a client built from the project's proto and one built
from the upstream v0.1.2 descriptors (tests/fixtures/openshell), the metadata a v0.1 gateway
sends and the checks it makes of the capabilities, a watch-stream reader, and a port of the
gateway's phase derivation (NVIDIA/OpenShell crates/openshell-server/src/compute/mod.rs,
``derive_phase``)."""

from __future__ import annotations

import contextlib
import os
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
from typing import Any

import grpc
from framework.fake_hypervisor import FakeHypervisor
from framework.paths import FIXTURES
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

import vmsandbox
from vmsandbox.config import Config
from vmsandbox.openshell.events import DomainEvent
from vmsandbox.openshell.hostinfo import HostInfo
from vmsandbox.openshell.proto import compute_driver_pb2 as pb
from vmsandbox.openshell.proto import compute_driver_pb2_grpc as pb_grpc
from vmsandbox.openshell.proto import extension_pb2 as ext
from vmsandbox.openshell.proto import host_info_pb2_grpc as info_grpc
from vmsandbox.openshell.service import ComputeDriver
from vmsandbox.openshell.socket import PeerGate, Peers, allowed_uids
from vmsandbox.sandbox.manager import SandboxManager

UPSTREAM_SET = FIXTURES / "openshell" / "upstream-v0.1.2.binpb"
CONTRACT = "openshell.compute.contract"
# What a v0.1 gateway sends in GetCapabilitiesRequest.gateway (its gateway_metadata()).
GATEWAY = ext.PeerMetadata(
    protocol_version=ext.ProtocolVersion(major=1, minor=0),
    implementation_name="openshell/gateway",
    implementation_version="0.1.2",
    supported_capabilities=[CONTRACT],
    required_capabilities=[CONTRACT],
)
# The policy a gateway configured with no [openshell.drivers.vmsandbox] settings expects.
DEFAULT_ADMISSION = (
    'v1:{"allow_driver_config":false,"resource_admission":{"enabled":true,'
    '"required_labels":{"openshell.ai/sandbox-attachable":"true",'
    '"openshell.ai/sandbox-attachable-workspace":"${workspace}"}}}'
)


def capabilities_request() -> pb.GetCapabilitiesRequest:
    return pb.GetCapabilitiesRequest(gateway=GATEWAY)


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


def check_capabilities(
    caps: pb.GetCapabilitiesResponse, *, supervised: bool, admission: str = DEFAULT_ADMISSION
) -> None:
    """What a v0.1 gateway reads from GetCapabilities, as vmsandbox must answer it."""
    assert (caps.driver_name, caps.default_image, caps.gateway_manages_lifecycle) == (
        "vmsandbox",
        "minimal",
        False,
    )
    extension = caps.extension
    assert (extension.protocol_version.major, extension.protocol_version.minor) == (1, 0)
    assert (extension.implementation_name, extension.implementation_version) == (
        "vmsandbox",
        vmsandbox.__version__,
    )
    assert list(extension.supported_capabilities) == [CONTRACT]
    assert list(extension.required_capabilities) == [CONTRACT]
    assert caps.resource_admission_policy == admission
    assert (caps.rootfs_tar_staging_dir, caps.rootfs_tar_max_bytes) == ("", 0)
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
                client.GetCapabilities(capabilities_request(), timeout=10)
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

    def changed(self, name: str, uuid: str) -> None:
        """Nobody to tell."""


class Published:
    """An event source whose events the test publishes (as ``DomainEvents`` would from
    libvirt's): every watch stream gets each one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: list[queue.Queue[DomainEvent]] = []

    def subscribe(self) -> queue.Queue[DomainEvent]:
        events: queue.Queue[DomainEvent] = queue.Queue()
        with self._lock:
            self._queues.append(events)
        return events

    def unsubscribe(self, events: queue.Queue[DomainEvent]) -> None:
        with self._lock:
            self._queues.remove(events)

    def changed(self, name: str, uuid: str) -> None:
        self.publish(DomainEvent(name, uuid=uuid))

    def publish(self, event: DomainEvent) -> None:
        with self._lock:
            for events in self._queues:
                events.put(event)

    def watchers(self) -> int:
        with self._lock:
            return len(self._queues)


@contextlib.contextmanager
def in_process(config: Config, hypervisor: FakeHypervisor, events: Any = None) -> Iterator[Path]:
    """The driver and HostInfo served in this process as ``vmsandbox serve`` serves them: gRPC
    on a private socket behind the peer gate on a public one (its path is yielded, in a folder
    other uids can reach when the config lets them in), the managers over ``hypervisor``; no
    libvirt events unless ``events`` is given."""
    folder = Path(tempfile.mkdtemp(prefix="vmsbx-os-"))  # short: a socket path has 108 bytes
    os.chmod(folder, 0o711)
    private = Path(tempfile.mkdtemp(prefix="vmsbx-grpc-"))
    socket_path, backend = folder / "driver.sock", private / "grpc.sock"
    peers = Peers()

    def manager() -> SandboxManager:
        return SandboxManager(config, hypervisor=hypervisor, reconcile=False)

    driver = ComputeDriver(config, events or Unwatched(), manager=manager, peers=peers)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_ComputeDriverServicer_to_server(driver, server)
    info_grpc.add_HostInfoServicer_to_server(HostInfo(config, manager, peers=peers), server)
    server.add_insecure_port(f"unix:{backend}")
    server.start()
    gate = PeerGate(socket_path, backend, allowed_uids(config), peers)
    gate.start()
    try:
        yield socket_path
    finally:
        gate.close()
        server.stop(None).wait()
        driver.close()
        shutil.rmtree(folder)
        shutil.rmtree(private)


def upstream_pool() -> descriptor_pool.DescriptorPool:
    """A descriptor pool holding the upstream v0.1.2 files (UPSTREAM_SET) and nothing else."""
    files = descriptor_pb2.FileDescriptorSet.FromString(UPSTREAM_SET.read_bytes())
    pool = descriptor_pool.DescriptorPool()
    for file in files.file:
        pool.Add(file)
    return pool


class UpstreamClient:
    """A ComputeDriver client whose messages are classes built from the upstream v0.1.2
    descriptors, not from vmsandbox's protos: what a v0.1 gateway's own stubs send and read."""

    SERVICE = "openshell.compute.v1.ComputeDriver"

    def __init__(self, channel: grpc.Channel) -> None:
        self.pool = upstream_pool()
        self.channel = channel
        self._service = self.pool.FindServiceByName(self.SERVICE)

    def message(self, kind: str, /, **fields: Any) -> Any:
        """A new upstream message ``openshell.compute.v1.NAME`` (or a full name)."""
        full = kind if "." in kind else f"openshell.compute.v1.{kind}"
        return message_factory.GetMessageClass(self.pool.FindMessageTypeByName(full))(**fields)

    def call(self, method: str, request: Any, timeout: float = 60) -> Any:
        """One unary RPC with upstream request and response classes."""
        descriptor = self._service.FindMethodByName(method)
        response = message_factory.GetMessageClass(descriptor.output_type)
        stub = self.channel.unary_unary(
            f"/{self.SERVICE}/{method}",
            request_serializer=lambda message: message.SerializeToString(),
            response_deserializer=response.FromString,
        )
        return stub(request, timeout=timeout)


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
