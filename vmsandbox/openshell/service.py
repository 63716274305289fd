"""The ``openshell.compute.v1.ComputeDriver`` RPCs of OpenShell v0.1, each mapped onto
SandboxManager.

- GetCapabilities negotiates the extension protocol (``negotiation``) and states the
  operator's resource admission policy (``admission``).
- A request addresses a sandbox by the gateway's ``sandbox_id`` (kept as the label ID_LABEL),
  or by ``name`` when it carries no id; either way only a sandbox this driver made (this state
  directory's, with a gateway id) is found (``find_ours``), and the action then names its
  domain UUID, so a sandbox made since under the same name is never touched.
- CreateSandbox makes and starts the sandbox in one create (GPUs reserved under the host lock,
  the record ``creating`` until QEMU runs, so a server killed meanwhile leaves it to
  reconcile), records the gateway's generation and returns the runtime identity
  (``identity``); a background thread then waits for SSH and the in-guest GPU check
  (``SandboxManager.wait``) and launches the workload (``launch``, ``readiness``), whose
  outcome reaches the gateway as a snapshot on the watch stream. A failed create has taken
  itself apart; a reconcile runs behind it for whatever its cleanup could not remove. At start
  the server reconciles, waits again for the sandboxes a killed server left started or
  starting, and launches the ready ones (a no-op in a guest launched this boot). A request
  that gives the guest nothing, of a ``[pool]`` shape, claims a ready pooled guest instead
  when there is one (it has no workload to launch).
- Stop/Start map to ``SandboxManager.stop/start`` (disk and GPUs kept). Start first checks
  ``expected_runtime_identity``, records ``generation_id`` and returns the new runtime
  identity; its launch credentials go to the guest at the launch that follows the boot.
  Delete is idempotent (``deleted`` false when nothing was there).
- Launch credentials wait in this process's memory until the guest is ready, never on disk
  (``launch.Launches``); a ``vmsandbox serve`` restarted meanwhile has lost them and the
  gateway's next start brings fresh ones. A launch that fails is reported as the sandbox's
  Ready condition (LaunchFailed).
- WatchSandboxes sends every current sandbox, then one snapshot per libvirt event of a sandbox
  (``events.DomainEvents``) and a deleted event when its domain is undefined.
- With a supervisor configured, every ready sandbox gets an SSH tunnel to the gateway
  (``tunnel.GatewayTunnels``).
- Snapshots of ready sandboxes read their main process over SSH, several at once and briefly
  (``_MAIN_QUERY_TIMEOUT``); a guest that does not answer, or drops the session, leaves that
  condition out, never the snapshot.
- EnsureWorkspace/DeleteWorkspace succeed with nothing to do: a vmsandbox host has no
  workspace-level resources.
- AuthenticateSandbox answers the gateway id and runtime identity of the sandbox whose token
  the credential is, matched against the salted digest in each record
  (``vmsandbox.sandbox.credential``).
- Every condition carries the time it last changed (``status.Transitions``).

vmsandbox errors keep their code: ``err.code`` is already a gRPC status code name.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NoReturn, TypeVar

import grpc

from vmsandbox.config import Config
from vmsandbox.errors import InvalidArgument, NotFound, Unauthenticated, VmSandboxError
from vmsandbox.guest.ssh import run as ssh_run
from vmsandbox.openshell import negotiation
from vmsandbox.openshell.admission import AdmissionPolicy
from vmsandbox.openshell.events import DomainEvent, EventSource
from vmsandbox.openshell.identity import RuntimeIdentity, check_generation_id
from vmsandbox.openshell.launch import LaunchCredentials, Launches
from vmsandbox.openshell.proto import compute_driver_pb2 as pb
from vmsandbox.openshell.proto import compute_driver_pb2_grpc as pb_grpc
from vmsandbox.openshell.readiness import Readiness
from vmsandbox.openshell.request import (
    ID_LABEL,
    Translated,
    find_ours,
    pooled_spec,
    translate,
)
from vmsandbox.openshell.status import GUEST_QUERY, GuestState, Transitions, guest_state, snapshot
from vmsandbox.openshell.supervisor import Supervisor
from vmsandbox.openshell.tunnel import GatewayTunnels
from vmsandbox.sandbox.handle import Sandbox
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.sandbox.record import STATE_READY, STATE_STARTED, STATE_STARTING
from vmsandbox.vm.domain import DOMAIN_PREFIX

log = logging.getLogger(__name__)
T = TypeVar("T")
_WATCH_TICK = 1.0  # seconds between checks that a watching gateway is still there
_GUEST_QUERY_TIMEOUT = 5.0  # seconds for reading a guest's state over SSH
_GUEST_QUERIES = 8  # guest-state queries of one snapshot listing at once


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
        self.admission = AdmissionPolicy.from_config(config)  # one the gateway refuses stops us
        self.supervisor = Supervisor.from_config(config)
        self.tunnels = (
            GatewayTunnels(self._manager, self.supervisor.port) if self.supervisor else None
        )
        # domain name -> gateway id, for deleted events (a claimed pooled guest's domain is not
        # named after its sandbox, and an undefined domain's record cannot be read any more)
        self._ids: dict[str, str] = {}
        self._ids_lock = threading.Lock()
        self.launches = Launches(self._manager, self.events.changed)
        self.readiness = Readiness(self._manager, self.launches, self.tunnels)

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
        return self._stamped(sandbox, self._guest_state(manager, sandbox))

    def _stamped(self, sandbox: Sandbox, guest: GuestState | None) -> pb.DriverSandbox:
        self._remember(sandbox)
        snap = snapshot(
            sandbox,
            guest,
            launch_failure=self.launches.failure(sandbox.uuid),
            network=self.config.network,
        )
        return self.transitions.stamp(snap)

    def _snapshots(self, manager: SandboxManager, sandboxes: list[Sandbox]) -> list[Any]:
        """Snapshots of ``sandboxes``, their guests' states read in parallel."""
        with ThreadPoolExecutor(max_workers=_GUEST_QUERIES) as pool:
            states = list(pool.map(lambda s: self._guest_state(manager, s), sandboxes))
        return [self._stamped(s, state) for s, state in zip(sandboxes, states, strict=True)]

    def _guest_state(self, manager: SandboxManager, sandbox: Sandbox) -> GuestState | None:
        """The main process and launched identity of a ready sandbox, read over SSH; None when
        the guest does not answer right now (the conditions then leave them out)."""
        if sandbox.state != STATE_READY or sandbox.ssh is None:
            return None
        try:
            keys = manager.keys_of(sandbox)
            shown = ssh_run(sandbox.ssh, keys, GUEST_QUERY, timeout=_GUEST_QUERY_TIMEOUT)
        except VmSandboxError as exc:
            log.info("guest state of %s: %s: %s", sandbox.name, exc.code, exc.message)
            return None
        if shown.exit_status != 0:  # the query ends in `true`: its session was cut short
            log.info("guest state of %s: the query ended %d", sandbox.name, shown.exit_status)
            return None
        return guest_state(shown.stdout)

    def _images(self, manager: SandboxManager) -> dict[str, str]:
        return {image.name: image.id for image in manager.images.list()}

    def _translate(self, manager: SandboxManager, sandbox: pb.DriverSandbox) -> Translated:
        return translate(
            sandbox,
            self._images(manager),
            self.supervisor,
            admission=self.admission,
            default_user=self.config.ssh_user,
        )

    def _ours(self, manager: SandboxManager) -> list[Sandbox]:
        """The sandboxes this driver made: this state directory's, carrying a gateway id."""
        return [s for s in manager.list() if s.labels.get(ID_LABEL) and s.local]

    def _find(self, manager: SandboxManager, sandbox_id: str, name: str) -> Sandbox:
        """The sandbox a request addresses, among this driver's own only (``find_ours``)."""
        return find_ours(self._ours(manager), sandbox_id, name)

    def resume(self) -> None:
        """At start: reconcile (a killed server's half-made sandboxes), then wait again for
        sandboxes of ours left started or starting by a server that is gone, and launch every
        ready one and open a tunnel into it (a supervisor in each dials the gateway)."""
        with self._manager() as manager:
            try:
                manager.reconcile()
            except VmSandboxError as exc:  # serving goes on; the next reconcile repairs
                log.warning("reconcile at start: %s: %s", exc.code, exc.message)
            for sandbox in self._ours(manager):
                if sandbox.state in (STATE_STARTED, STATE_STARTING):
                    self.readiness.become_ready(sandbox.name, sandbox.uuid)
                elif sandbox.state == STATE_READY:
                    self.readiness.become_ready(sandbox.name, sandbox.uuid, wait=False)

    def close(self) -> None:
        if self.tunnels is not None:
            self.tunnels.close()

    # -- RPCs ---------------------------------------------------------------------------------

    def GetCapabilities(self, request: Any, context: grpc.ServicerContext) -> Any:
        """The gateway is checked first (``negotiation``). Readiness is vmsandbox's own (SSH
        answered, GPUs verified, workload launched) unless a supervisor is configured: the
        gateway then also waits for the supervisor to call back. CPU and memory limits, a GPU
        count and a GPU request without one (vmsandbox picks) are all honoured; rootfs tar
        sources are not (no staging directory, size 0). Authentication: a sandbox's token
        identifies it (AuthenticateSandbox), bound to its runtime identity."""
        self._call(
            context,
            "GetCapabilities",
            lambda: negotiation.check_gateway(request.HasField("gateway"), request.gateway),
        )
        return negotiation.capabilities(self.admission, reports_readiness=self.supervisor is None)

    def AuthenticateSandbox(self, request: Any, context: grpc.ServicerContext) -> Any:
        """The gateway id and runtime identity of the sandbox whose token ``credential`` is.
        The credential is a secret: no message, log line or error detail repeats it."""

        def authenticate() -> tuple[str, str]:
            if not request.credential:
                raise InvalidArgument(
                    "credential is empty: give the sandbox token the sandbox holds",
                    details={"field": "credential"},
                )
            with self._manager() as manager:
                found = manager.store.holder(request.credential)
            sandbox_id = found.labels.get(ID_LABEL) if found is not None else None
            if found is None or not sandbox_id:
                raise Unauthenticated("the credential is not the token of any sandbox here")
            return sandbox_id, str(RuntimeIdentity.of(found))

        sandbox_id, identity = self._call(context, "AuthenticateSandbox", authenticate)
        return pb.AuthenticateSandboxResponse(sandbox_id=sandbox_id, runtime_identity=identity)

    def ValidateSandboxCreate(self, request: Any, context: grpc.ServicerContext) -> Any:
        def validate() -> None:
            with self._manager() as manager:
                manager.dry_run(self._translate(manager, request.sandbox).spec)

        self._call(context, "ValidateSandboxCreate", validate)
        return pb.ValidateSandboxCreateResponse()

    def CreateSandbox(self, request: Any, context: grpc.ServicerContext) -> Any:
        def create() -> str:
            with self._manager() as manager:
                wanted = self._translate(manager, request.sandbox)
                pooled = pooled_spec(request.sandbox, wanted.spec, manager.config.pool)
                try:
                    # a pooled guest of the shape is claimed when one is ready, else it boots
                    sandbox = manager.create(pooled or wanted.spec, wait=False)
                except VmSandboxError:
                    self.readiness.reconcile_behind()
                    raise
                self._remember(sandbox)
                credentials = wanted.credentials
                if credentials is not None and credentials.runtime_generation:
                    try:
                        sandbox = manager.set_generation(
                            sandbox.name, credentials.runtime_generation, uuid=sandbox.uuid
                        )
                    except VmSandboxError:
                        with contextlib.suppress(VmSandboxError):
                            manager.destroy(sandbox.name, uuid=sandbox.uuid)
                        raise
                self.launches.hold(sandbox.uuid, credentials)
            log.info("sandbox %s (%s) started", wanted.name, request.sandbox.id)
            self.readiness.become_ready(sandbox.name, sandbox.uuid)
            return str(RuntimeIdentity.of(sandbox))

        identity = self._call(context, "CreateSandbox", create)
        return pb.CreateSandboxResponse(runtime_identity=identity)

    def GetSandbox(self, request: Any, context: grpc.ServicerContext) -> Any:
        def get() -> pb.DriverSandbox:
            with self._manager() as manager:
                found = self._find(manager, request.sandbox_id, request.name)
                return self._snapshot(manager, found)

        return pb.GetSandboxResponse(sandbox=self._call(context, "GetSandbox", get))

    def ListSandboxes(self, request: Any, context: grpc.ServicerContext) -> Any:
        def listing() -> list[pb.DriverSandbox]:
            with self._manager() as manager:
                return self._snapshots(manager, self._ours(manager))

        return pb.ListSandboxesResponse(sandboxes=self._call(context, "ListSandboxes", listing))

    def StopSandbox(self, request: Any, context: grpc.ServicerContext) -> Any:
        def stop() -> None:
            with self._manager() as manager:
                found = self._find(manager, request.sandbox_id, request.name)
                manager.stop(found.name, uuid=found.uuid)

        self._call(context, "StopSandbox", stop)
        return pb.StopSandboxResponse()

    def StartSandbox(self, request: Any, context: grpc.ServicerContext) -> Any:
        """Checks ``expected_runtime_identity`` and the launch credentials before starting
        anything; records ``generation_id``; answers the runtime identity after the start."""

        def start() -> str:
            with self._manager() as manager:
                found = self._find(manager, request.sandbox_id, request.name)
                RuntimeIdentity.of(found).check_start(
                    request.expected_runtime_identity, request.generation_id
                )
                generation = request.generation_id and check_generation_id(request.generation_id)
                credentials = (
                    LaunchCredentials.parse(request.launch_authentication, "launch_authentication")
                    if request.launch_authentication
                    else None
                )
                self.launches.restart(found.uuid, credentials)
                started = manager.start(found.name, wait=False, uuid=found.uuid)
                if generation and generation != started.generation:
                    started = manager.set_generation(found.name, generation, uuid=found.uuid)
            if started.state != STATE_READY:
                self.readiness.become_ready(found.name, found.uuid)
            elif credentials is not None:
                self.readiness.become_ready(found.name, found.uuid, wait=False)
            return str(RuntimeIdentity.of(started))

        identity = self._call(context, "StartSandbox", start)
        return pb.StartSandboxResponse(runtime_identity=identity)

    def DeleteSandbox(self, request: Any, context: grpc.ServicerContext) -> Any:
        def delete() -> bool:
            with self._manager() as manager:
                try:
                    found = self._find(manager, request.sandbox_id, request.name)
                    self._remember(found)
                    manager.destroy(found.name, uuid=found.uuid)
                except NotFound:
                    return False
            self.transitions.forget(found.domain)
            self.launches.forget(found.uuid)
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
                return self._snapshots(manager, self._ours(manager))

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
                found = manager.store.by_domain(DOMAIN_PREFIX + event.name)
                if found is None:
                    return  # undefined since: its own event follows
                sandbox = manager.store.view(found.record, found.state, found.uuid)
                ours = sandbox.labels.get(ID_LABEL) and sandbox.local
                snap = self._snapshot(manager, sandbox) if ours else None
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
