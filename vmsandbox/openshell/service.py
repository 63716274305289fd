"""The ``openshell.compute.v1.ComputeDriver`` RPCs, each mapped onto SandboxManager.

- CreateSandbox defines the sandbox (GPUs chosen under the host lock), starts it and returns
  (a request that gives the guest nothing, of a ``[pool]`` shape, claims a ready pooled guest
  instead, when there is one);
  a background thread then waits for SSH and the in-guest GPU check (``SandboxManager.wait``),
  whose outcome reaches the gateway as a snapshot on the watch stream. A start that libvirt
  refuses (a GPU that cannot be passed through) removes the sandbox before the error returns.
- Stop/Start map to ``SandboxManager.stop/start`` (disk and GPUs kept); Delete is idempotent
  (``deleted`` false when nothing was there).
- WatchSandboxes sends every current sandbox, then one snapshot per libvirt event of a sandbox
  (``events.DomainEvents``) and a deleted event when its domain is undefined.
- With a supervisor configured, every ready sandbox gets an SSH tunnel to the gateway
  (``tunnel.GatewayTunnels``).
- EnsureWorkspace/DeleteWorkspace succeed with nothing to do: a vmsandbox host has no
  workspace-level resources.
- AuthenticateSandbox answers the gateway id of the sandbox whose token the credential is,
  matched against the salted digest in each record (``vmsandbox.sandbox.credential``).
- Every condition carries the time it last changed (``transitions.Transitions``).

vmsandbox errors keep their code: ``err.code`` is already a gRPC status code name.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any, NoReturn, TypeVar

import grpc

import vmsandbox
from vmsandbox.config import Config
from vmsandbox.errors import InvalidArgument, NotFound, Unauthenticated, VmSandboxError
from vmsandbox.openshell.events import DomainEvent, EventSource
from vmsandbox.openshell.proto import compute_driver_pb2 as pb
from vmsandbox.openshell.proto import compute_driver_pb2_grpc as pb_grpc
from vmsandbox.openshell.request import (
    DEFAULT_IMAGE,
    ID_LABEL,
    gives_guest_nothing,
    sandbox_name,
    translate,
)
from vmsandbox.openshell.status import MAIN_QUERY, MainProcess, main_process, snapshot
from vmsandbox.openshell.supervisor import Supervisor
from vmsandbox.openshell.transitions import Transitions
from vmsandbox.openshell.tunnel import GatewayTunnels
from vmsandbox.sandbox.handle import Sandbox
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.sandbox.pool import fits
from vmsandbox.sandbox.record import DOMAIN_PREFIX, STATE_READY

log = logging.getLogger(__name__)
T = TypeVar("T")
_WATCH_TICK = 1.0  # seconds between checks that a watching gateway is still there
_MAIN_QUERY_TIMEOUT = 20.0  # seconds for reading the main process's state over SSH


class ComputeDriver(pb_grpc.ComputeDriverServicer):
    """The compute-driver service of one vmsandbox host."""

    def __init__(
        self,
        config: Config,
        events: EventSource,
        manager: Callable[[], SandboxManager] | None = None,
    ) -> None:
        """``manager`` makes the SandboxManager each RPC uses (default: libvirt at
        ``config.uri``; the unit tests hand in one over a fake hypervisor)."""
        self.config = config
        self.events = events
        self._new_manager = manager or (lambda: SandboxManager(self.config, reconcile=False))
        self.transitions = Transitions()
        self.supervisor = Supervisor.from_config(config)
        self.tunnels = (
            GatewayTunnels(self._manager, self.supervisor.port) if self.supervisor else None
        )
        # domain name -> gateway id, for deleted events (a claimed pooled guest's domain is not
        # named after its sandbox, and an undefined domain's record cannot be read any more)
        self._ids: dict[str, str] = {}
        self._ids_lock = threading.Lock()

    # -- helpers ------------------------------------------------------------------------------

    def _call(self, context: grpc.ServicerContext, what: str, body: Callable[[], T]) -> T:
        """Run ``body``; a vmsandbox error aborts the RPC with its own code and message."""
        try:
            return body()
        except VmSandboxError as exc:
            log.info("%s: %s: %s", what, exc.code, exc.message)
            _abort(context, exc)

    def _manager(self) -> SandboxManager:
        return self._new_manager()

    def _remember(self, sandbox: Sandbox) -> None:
        if sandbox.labels.get(ID_LABEL):
            with self._ids_lock:
                self._ids[sandbox.domain] = sandbox.labels[ID_LABEL]

    def _snapshot(self, manager: SandboxManager, sandbox: Sandbox) -> pb.DriverSandbox:
        self._remember(sandbox)
        return self.transitions.stamp(snapshot(sandbox, self._main_process(manager, sandbox)))

    def _main_process(self, manager: SandboxManager, sandbox: Sandbox) -> MainProcess | None:
        """The state of a ready sandbox's main process, read over SSH; None when it has none
        or the guest does not answer right now (the condition is then left out)."""
        if sandbox.state != STATE_READY or sandbox.ssh is None:
            return None
        try:
            shown = manager.exec(sandbox.name, MAIN_QUERY, timeout=_MAIN_QUERY_TIMEOUT)
        except VmSandboxError:
            return None
        return main_process(shown.stdout)

    def _ours(self, manager: SandboxManager) -> list[Sandbox]:
        """The sandboxes this driver made (those carrying a gateway id)."""
        return [sandbox for sandbox in manager.list() if sandbox.labels.get(ID_LABEL)]

    def _find(self, manager: SandboxManager, sandbox_id: str, name: str) -> Sandbox:
        """The sandbox a request names (by name, else by the gateway id); NOT_FOUND if none."""
        wanted = sandbox_name(name, sandbox_id)
        with contextlib.suppress(NotFound):
            return manager.get(wanted)
        for sandbox in self._ours(manager):
            if sandbox_id and sandbox.labels.get(ID_LABEL) == sandbox_id:
                return sandbox
        raise NotFound(
            f"sandbox {name or sandbox_id!r} does not exist",
            details={"sandbox_id": sandbox_id, "sandbox_name": name},
        )

    def _become_ready(self, name: str) -> None:
        """In the background: wait for SSH and the GPU check; the outcome lands in the
        domain's record, which libvirt announces to the watchers."""

        def run() -> None:
            try:
                with self._manager() as manager:
                    manager.wait(name)
                log.info("sandbox %s is ready", name)
                if self.tunnels is not None:
                    self.tunnels.ensure(name)
            except VmSandboxError as exc:
                log.warning("sandbox %s did not become ready: %s: %s", name, exc.code, exc.message)

        threading.Thread(target=run, name=f"ready-{name}", daemon=True).start()

    def resume_tunnels(self) -> None:
        """At start: a tunnel into every running sandbox of ours (a supervisor in each dials
        the gateway through it)."""
        if self.tunnels is None:
            return
        with self._manager() as manager:
            for sandbox in self._ours(manager):
                if sandbox.state == STATE_READY:
                    self.tunnels.ensure(sandbox.name)

    def close(self) -> None:
        if self.tunnels is not None:
            self.tunnels.close()

    # -- RPCs ---------------------------------------------------------------------------------

    def GetCapabilities(self, request: Any, context: grpc.ServicerContext) -> Any:
        """Readiness is vmsandbox's own (SSH answered, GPUs verified) unless a supervisor is
        configured: the gateway then also waits for the supervisor to call back. CPU and
        memory limits, a GPU count and a GPU request without one (vmsandbox picks) are all
        honoured. Authentication: a sandbox's token identifies it (AuthenticateSandbox)."""
        return pb.GetCapabilitiesResponse(
            driver_name="vmsandbox",
            driver_version=vmsandbox.__version__,
            default_image=DEFAULT_IMAGE,
            gateway_manages_lifecycle=False,
            supports_sandbox_authentication=True,
            driver_reports_runtime_readiness=self.supervisor is None,
            resource_capabilities=pb.ResourceCapabilities(
                cpu=pb.CpuResourceCapabilities(limit_supported=True),
                memory=pb.MemoryResourceCapabilities(limit_supported=True),
                gpu=pb.GpuResourceCapabilities(
                    default_selection_supported=True, count_selection_supported=True
                ),
            ),
        )

    def AuthenticateSandbox(self, request: Any, context: grpc.ServicerContext) -> Any:
        """The gateway id of the sandbox whose token ``credential`` is. The credential is a
        secret: no message, log line or error detail repeats it."""

        def authenticate() -> str:
            if not request.credential:
                raise InvalidArgument(
                    "credential is empty: give the sandbox token the sandbox holds",
                    details={"field": "credential"},
                )
            with self._manager() as manager:
                found = manager.holder(request.credential)
            sandbox_id = found.labels.get(ID_LABEL) if found is not None else None
            if not sandbox_id:
                raise Unauthenticated("the credential is not the token of any sandbox here")
            return sandbox_id

        sandbox_id = self._call(context, "AuthenticateSandbox", authenticate)
        return pb.AuthenticateSandboxResponse(sandbox_id=sandbox_id)

    def GetGatewayListenerRequirements(self, request: Any, context: grpc.ServicerContext) -> Any:
        """With a supervisor, its guests dial the gateway through this driver's SSH tunnels,
        which open the host's loopback: ask for a loopback listener. Without one, nothing
        dials the gateway."""
        if self.supervisor is None:
            return pb.GetGatewayListenerRequirementsResponse()
        reason = (
            "vmsandbox guests reach the gateway through SSH tunnels that end at "
            f"127.0.0.1:{self.supervisor.port}"
        )
        return pb.GetGatewayListenerRequirementsResponse(
            requirements=[
                pb.GatewayListenerRequirement(
                    reason=reason, loopback_interface=pb.GatewayLoopbackInterfaceRequirement()
                )
            ]
        )

    def ValidateSandboxCreate(self, request: Any, context: grpc.ServicerContext) -> Any:
        def validate() -> None:
            with self._manager() as manager:
                images = [image.name for image in manager.images.list()]
                manager.dry_run(translate(request.sandbox, images, self.supervisor).spec)

        self._call(context, "ValidateSandboxCreate", validate)
        return pb.ValidateSandboxCreateResponse()

    def CreateSandbox(self, request: Any, context: grpc.ServicerContext) -> Any:
        def create() -> None:
            with self._manager() as manager:
                images = [image.name for image in manager.images.list()]
                wanted = translate(request.sandbox, images, self.supervisor)
                bare = replace(wanted.spec, guest=None)
                if gives_guest_nothing(request.sandbox) and any(
                    fits(shape, bare) for shape in manager.config.pool
                ):
                    # a ready pooled guest of the shape is claimed, else it boots cold; a
                    # failure undoes everything either way
                    self._remember(manager.create(bare, wait=False))
                else:
                    sandbox = manager.create(wanted.spec, start=False)
                    self._remember(sandbox)
                    try:
                        manager.start(wanted.name, wait=False)
                    except VmSandboxError:
                        with contextlib.suppress(VmSandboxError):
                            manager.destroy(wanted.name)
                        raise
            log.info("sandbox %s (%s) started", wanted.name, request.sandbox.id)
            self._become_ready(wanted.name)

        self._call(context, "CreateSandbox", create)
        return pb.CreateSandboxResponse()

    def GetSandbox(self, request: Any, context: grpc.ServicerContext) -> Any:
        def get() -> pb.DriverSandbox:
            with self._manager() as manager:
                found = self._find(manager, request.sandbox_id, request.sandbox_name)
                return self._snapshot(manager, found)

        return pb.GetSandboxResponse(sandbox=self._call(context, "GetSandbox", get))

    def ListSandboxes(self, request: Any, context: grpc.ServicerContext) -> Any:
        def listing() -> list[pb.DriverSandbox]:
            with self._manager() as manager:
                return [self._snapshot(manager, sandbox) for sandbox in self._ours(manager)]

        return pb.ListSandboxesResponse(sandboxes=self._call(context, "ListSandboxes", listing))

    def StopSandbox(self, request: Any, context: grpc.ServicerContext) -> Any:
        def stop() -> None:
            with self._manager() as manager:
                found = self._find(manager, request.sandbox_id, request.sandbox_name)
                manager.stop(found.name)

        self._call(context, "StopSandbox", stop)
        return pb.StopSandboxResponse()

    def StartSandbox(self, request: Any, context: grpc.ServicerContext) -> Any:
        def start() -> None:
            with self._manager() as manager:
                found = self._find(manager, request.sandbox_id, request.sandbox_name)
                started = manager.start(found.name, wait=False)
            if started.state != "ready":
                self._become_ready(found.name)

        self._call(context, "StartSandbox", start)
        return pb.StartSandboxResponse()

    def DeleteSandbox(self, request: Any, context: grpc.ServicerContext) -> Any:
        def delete() -> bool:
            with self._manager() as manager:
                try:
                    found = self._find(manager, request.sandbox_id, request.sandbox_name)
                except NotFound:
                    return False
                self._remember(found)
                manager.destroy(found.name)
            self.transitions.forget(found.domain)
            log.info("sandbox %s deleted", found.name)
            return True

        return pb.DeleteSandboxResponse(deleted=self._call(context, "DeleteSandbox", delete))

    def WatchSandboxes(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        events = self.events.subscribe()
        try:
            yield from self._everything(context)
            while context.is_active():
                try:
                    event = events.get(timeout=_WATCH_TICK)
                except queue.Empty:
                    continue
                yield from self._watch_event(event, context)
        finally:
            self.events.unsubscribe(events)

    def EnsureWorkspace(self, request: Any, context: grpc.ServicerContext) -> Any:
        return pb.EnsureWorkspaceResponse()

    def DeleteWorkspace(self, request: Any, context: grpc.ServicerContext) -> Any:
        return pb.DeleteWorkspaceResponse()

    # -- watch --------------------------------------------------------------------------------

    def _everything(self, context: grpc.ServicerContext) -> Iterator[Any]:
        def listing() -> list[pb.DriverSandbox]:
            with self._manager() as manager:
                return [self._snapshot(manager, sandbox) for sandbox in self._ours(manager)]

        for snap in self._call(context, "WatchSandboxes", listing):
            yield _sandbox_event(snap)

    def _watch_event(self, event: DomainEvent, context: grpc.ServicerContext) -> Iterator[Any]:
        if event.name is None:
            yield from self._everything(context)
            return
        if event.gone:
            self.transitions.forget(DOMAIN_PREFIX + event.name)
            with self._ids_lock:
                sandbox_id = self._ids.get(DOMAIN_PREFIX + event.name)
            if sandbox_id:
                yield pb.WatchSandboxesEvent(
                    deleted=pb.WatchSandboxesDeletedEvent(sandbox_id=sandbox_id)
                )
            return
        try:
            with self._manager() as manager:
                sandbox = manager.get(event.name)
                snap = self._snapshot(manager, sandbox) if sandbox.labels.get(ID_LABEL) else None
        except (NotFound, InvalidArgument):
            return  # undefined since: its own event follows
        except VmSandboxError as exc:
            log.warning("watch: reading sandbox %s failed: %s", event.name, exc.message)
            return
        if snap is not None:
            yield _sandbox_event(snap)


def _sandbox_event(sandbox: pb.DriverSandbox) -> Any:
    return pb.WatchSandboxesEvent(sandbox=pb.WatchSandboxesSandboxEvent(sandbox=sandbox))


def _abort(context: grpc.ServicerContext, exc: VmSandboxError) -> NoReturn:
    code = getattr(grpc.StatusCode, exc.code, grpc.StatusCode.INTERNAL)
    context.abort(code, exc.message)
    raise AssertionError("context.abort returned")  # pragma: no cover - abort always raises
