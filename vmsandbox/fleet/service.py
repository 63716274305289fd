"""The fleet as one OpenShell compute driver: the ``openshell.compute.v1.ComputeDriver`` RPCs of
``vmsandbox serve``, each answered by ``Fleet`` across every host.

- CreateSandbox places the sandbox (placement.py) and returns once its host started it; its
  readiness reaches the gateway on the watch stream, from the host's own snapshots.
- Get, List and Watch show the gateway's sandboxes on every host; those recorded on a lost
  host as last seen (or by id and name), Ready false with reason HostLost.
- Stop, Start and Delete go to the host the sandbox's placement record names (core.py,
  power.py): UNAVAILABLE while that host is lost, never ``deleted: false`` for a sandbox that
  may live; Delete is idempotent. A stop the host maps to suspend gives the sandbox's Ray claim
  back; its start resumes it on that host only, RESOURCE_EXHAUSTED while that host has no room.
- AuthenticateSandbox asks each host in turn; only the gateway's own sandboxes answer, and a
  token no answering host knows is UNAVAILABLE while a host that may hold it does not answer.
- ValidateSandboxCreate checks the request and that some ready host could ever take it.

Errors keep their code: a host's refusal crosses the fleet unchanged.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, TypeVar

import grpc

from vmsandbox.errors import InvalidArgument, NotFound, VmSandboxError
from vmsandbox.fleet import placement
from vmsandbox.fleet.core import Fleet, FleetSandbox
from vmsandbox.openshell import negotiation
from vmsandbox.openshell.admission import AdmissionPolicy
from vmsandbox.openshell.proto import compute_driver_pb2 as pb
from vmsandbox.openshell.proto import compute_driver_pb2_grpc as pb_grpc

log = logging.getLogger("vmsandbox.fleet")
T = TypeVar("T")
WATCH_TICK = 1.0  # seconds between two listings of the fleet for the watch streams


class FleetDriver(pb_grpc.ComputeDriverServicer):
    """The compute-driver service of a whole fleet, for one gateway."""

    def __init__(self, fleet: Fleet, admission: AdmissionPolicy) -> None:
        self.fleet = fleet
        self.admission = admission
        self._watchers: list[queue.Queue[Any]] = []
        self._known: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll, name="fleet-watch", daemon=True)
        self._poller.start()

    def close(self) -> None:
        self._stop.set()
        self._poller.join(timeout=10)

    def _call(self, context: grpc.ServicerContext, what: str, body: Callable[[], T]) -> T:
        try:
            return body()
        except VmSandboxError as exc:
            log.info("%s: %s: %s", what, exc.code, exc.message)
            _abort(context, exc)

    def _find(self, sandbox_id: str, name: str) -> FleetSandbox:
        """The gateway's sandbox a request addresses: by ``sandbox_id`` when it has one, else
        by ``name``, among this gateway's sandboxes only, as every host's driver does."""
        if not sandbox_id and not name:
            raise InvalidArgument(
                "sandbox_id and name are both empty: a request names its sandbox by one of them",
                details={"field": "sandbox_id"},
            )
        for sandbox in self.fleet.sandboxes():
            if sandbox.sandbox_id == sandbox_id if sandbox_id else sandbox.snapshot.name == name:
                return sandbox
        raise NotFound(
            f"no sandbox {'with id ' + repr(sandbox_id) if sandbox_id else repr(name)} is in "
            "the fleet",
            details={"sandbox_id": sandbox_id, "name": name},
        )

    # -- RPCs -------------------------------------------------------------------------------

    def GetCapabilities(self, request: Any, context: grpc.ServicerContext) -> Any:
        """As a host's driver answers (the gateway's metadata checked first), readiness being
        the hosts' own; the admission policy is this server's config's, which must be the
        hosts' too (docs/fleet.md)."""
        self._call(
            context,
            "GetCapabilities",
            lambda: negotiation.check_gateway(request.HasField("gateway"), request.gateway),
        )
        return negotiation.capabilities(self.admission, reports_readiness=True)

    def AuthenticateSandbox(self, request: Any, context: grpc.ServicerContext) -> Any:
        def authenticate() -> dict[str, Any]:
            if not request.credential:
                raise InvalidArgument(
                    "credential is empty: give the sandbox token the sandbox holds",
                    details={"field": "credential"},
                )
            return self.fleet.authenticate(request.credential)

        found = self._call(context, "AuthenticateSandbox", authenticate)
        return pb.AuthenticateSandboxResponse(
            sandbox_id=found["sandbox_id"], runtime_identity=found["runtime_identity"]
        )

    def ValidateSandboxCreate(self, request: Any, context: grpc.ServicerContext) -> Any:
        def validate() -> None:
            if not request.sandbox.id:
                raise InvalidArgument("sandbox.id is empty", details={"field": "id"})
            wish = placement.wish_of(request.sandbox)
            self.fleet.table.refresh()
            placement.plan(wish, self.fleet.table.ready(), self.fleet.place_timeout)

        self._call(context, "ValidateSandboxCreate", validate)
        return pb.ValidateSandboxCreateResponse()

    def CreateSandbox(self, request: Any, context: grpc.ServicerContext) -> Any:
        def create() -> str:
            placed = self.fleet.create(request.sandbox)
            log.info("sandbox %s created on host %s", request.sandbox.id, placed.host)
            return placed.runtime_identity

        identity = self._call(context, "CreateSandbox", create)
        return pb.CreateSandboxResponse(runtime_identity=identity)

    def GetSandbox(self, request: Any, context: grpc.ServicerContext) -> Any:
        found = self._call(
            context, "GetSandbox", lambda: self._find(request.sandbox_id, request.name)
        )
        return pb.GetSandboxResponse(sandbox=found.snapshot)

    def ListSandboxes(self, request: Any, context: grpc.ServicerContext) -> Any:
        listed = self._call(context, "ListSandboxes", self.fleet.sandboxes)
        return pb.ListSandboxesResponse(sandboxes=[sandbox.snapshot for sandbox in listed])

    def StopSandbox(self, request: Any, context: grpc.ServicerContext) -> Any:
        def stop() -> None:
            found = self._find(request.sandbox_id, request.name)
            self.fleet.power(found.sandbox_id, request)

        self._call(context, "StopSandbox", stop)
        return pb.StopSandboxResponse()

    def StartSandbox(self, request: Any, context: grpc.ServicerContext) -> Any:
        def start() -> str:
            found = self._find(request.sandbox_id, request.name)
            return self.fleet.power(found.sandbox_id, request)

        identity = self._call(context, "StartSandbox", start)
        return pb.StartSandboxResponse(runtime_identity=identity)

    def DeleteSandbox(self, request: Any, context: grpc.ServicerContext) -> Any:
        def delete() -> bool:
            if request.sandbox_id:  # its record says where it is, lost hosts included
                return self.fleet.delete(request.sandbox_id)
            try:
                found = self._find(request.sandbox_id, request.name)
            except NotFound:
                return False
            return self.fleet.delete(found.sandbox_id)

        return pb.DeleteSandboxResponse(deleted=self._call(context, "DeleteSandbox", delete))

    def WatchSandboxes(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        events: queue.Queue[Any] = queue.Queue()
        with self._lock:
            current = [pb.DriverSandbox.FromString(data) for data in self._known.values()]
            self._watchers.append(events)
        try:
            for snapshot in current:
                yield _sandbox_event(snapshot)
            while context.is_active():
                try:
                    yield events.get(timeout=WATCH_TICK)
                except queue.Empty:
                    continue
        finally:
            with self._lock:
                self._watchers.remove(events)

    def EnsureWorkspace(self, request: Any, context: grpc.ServicerContext) -> Any:
        return pb.EnsureWorkspaceResponse()

    def DeleteWorkspace(self, request: Any, context: grpc.ServicerContext) -> Any:
        return pb.DeleteWorkspaceResponse()

    # -- watch ------------------------------------------------------------------------------

    def _poll(self) -> None:
        """List the fleet every WATCH_TICK; send each changed snapshot and each sandbox gone
        (not lost: a lost host's sandboxes stay, marked) to every watcher."""
        while not self._stop.wait(WATCH_TICK):
            try:
                listed = self.fleet.sandboxes()
            except VmSandboxError as exc:
                log.warning("watch: listing the fleet failed: %s", exc.message)
                continue
            now = {sandbox.sandbox_id: sandbox.snapshot.SerializeToString() for sandbox in listed}
            with self._lock:
                events = [
                    _sandbox_event(pb.DriverSandbox.FromString(data))
                    for sandbox_id, data in now.items()
                    if self._known.get(sandbox_id) != data
                ]
                events += [
                    pb.WatchSandboxesEvent(
                        deleted=pb.WatchSandboxesDeletedEvent(sandbox_id=sandbox_id)
                    )
                    for sandbox_id in self._known
                    if sandbox_id not in now
                ]
                self._known = now
                for watcher in self._watchers:
                    for event in events:
                        watcher.put(event)


def _sandbox_event(sandbox: pb.DriverSandbox) -> Any:
    return pb.WatchSandboxesEvent(sandbox=pb.WatchSandboxesSandboxEvent(sandbox=sandbox))


def _abort(context: grpc.ServicerContext, exc: VmSandboxError) -> NoReturn:
    code = getattr(grpc.StatusCode, exc.code, grpc.StatusCode.INTERNAL)
    context.abort(code, exc.message)
    raise AssertionError("context.abort returned")  # pragma: no cover - abort always raises
