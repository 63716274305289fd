"""The ``openshell.compute.v1.ComputeDriver`` RPCs of OpenShell v0.1, each mapped onto
SandboxManager.

- GetCapabilities negotiates the extension protocol (``negotiation``) and states the
  operator's resource admission policy (``admission``).
- Every RPC knows its caller (``caller``: the peer's uid, and the gateway a trusted delegate
  names), and sees and acts on that caller's sandboxes only: the ones it created, whose
  record names it as their owner. Another gateway's sandbox is NOT_FOUND (or absent from a
  listing), whatever the request names.
- A request addresses a sandbox by the gateway's ``sandbox_id`` (kept as the label ID_LABEL),
  or by ``name`` when it carries no id; either way only a sandbox this driver made for this
  caller (this state directory's, with a gateway id) is found (``find_ours``), and the action
  then names its domain UUID, so a sandbox made since under the same name is never touched.
- CreateSandbox is idempotent per (caller, id): the same request again (a gateway retrying a
  lost answer) answers with the sandbox made the first time; a different request under an id
  the caller has is ALREADY_EXISTS; creates of one (caller, id) run one at a time.
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
- WatchSandboxes sends every current sandbox of the caller, then one snapshot per libvirt event
  of one of them and a deleted event when its domain is undefined, matched by domain UUID;
  after a libvirt reconnect, what vanished meanwhile is announced deleted (``watch``).
- With a supervisor configured, every ready sandbox gets an SSH tunnel to the gateway
  (``tunnel.GatewayTunnels``).
- Snapshots of ready sandboxes read their main process over SSH, several at once and briefly
  (``snapshots``).
- EnsureWorkspace/DeleteWorkspace succeed with nothing to do: a vmsandbox host has no
  workspace-level resources.
- AuthenticateSandbox answers the gateway id and runtime identity of the caller's sandbox whose
  token the credential is, matched against the salted digest in each record
  (``vmsandbox.sandbox.credential``).
- Every condition carries the time it last changed (``status.Transitions``).

vmsandbox errors keep their code: ``err.code`` is already a gRPC status code name; each error
the driver answers carries ANSWERED_METADATA in its trailing metadata, so a client (the fleet's
agent) tells a refusal from a call whose outcome it cannot know.
"""

from __future__ import annotations

import contextlib
import logging
import queue
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, NoReturn, TypeVar

import grpc

from vmsandbox.config import Config
from vmsandbox.errors import (
    AlreadyExists,
    InvalidArgument,
    NotFound,
    Unauthenticated,
    VmSandboxError,
)
from vmsandbox.openshell import negotiation
from vmsandbox.openshell.admission import AdmissionPolicy
from vmsandbox.openshell.caller import ANSWERED_METADATA, Caller, Callers, OneAtATime
from vmsandbox.openshell.events import EventSource
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
    same_request,
    translate,
)
from vmsandbox.openshell.snapshots import Snapshots
from vmsandbox.openshell.socket import Peers
from vmsandbox.openshell.status import Transitions
from vmsandbox.openshell.supervisor import Supervisor
from vmsandbox.openshell.tunnel import GatewayTunnels
from vmsandbox.openshell.watch import Stream
from vmsandbox.sandbox.handle import Sandbox
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.sandbox.record import STATE_READY, STATE_STARTED, STATE_STARTING, STATE_SUSPENDED
from vmsandbox.vm.domain import DOMAIN_PREFIX

log = logging.getLogger(__name__)
T = TypeVar("T")
_WATCH_TICK = 1.0  # seconds between checks that a watching gateway is still there


class ComputeDriver(pb_grpc.ComputeDriverServicer):
    """The compute-driver service of one vmsandbox host."""

    def __init__(
        self,
        config: Config,
        events: EventSource,
        manager: Callable[[], SandboxManager] | None = None,
        *,
        peers: Peers,
    ) -> None:
        """``manager`` makes the SandboxManager each RPC uses (default: libvirt at
        ``config.uri``; the unit tests hand in one over a fake hypervisor); ``peers`` says
        which uid each connection relayed by the socket's gate is (``caller``)."""
        self.config = config
        self.events = events
        self.callers = Callers(peers.uid_of, config.openshell_delegate_uids)
        self._new_manager = manager or (lambda: SandboxManager(self.config, reconcile=False))
        self.transitions = Transitions()
        self.admission = AdmissionPolicy.from_config(config)  # one the gateway refuses stops us
        self.supervisor = Supervisor.from_config(config)
        self.tunnels = (
            GatewayTunnels(self._manager, self.supervisor.port) if self.supervisor else None
        )
        self.launches = Launches(self._manager, self.events.changed)
        self.readiness = Readiness(self._manager, self.launches, self.tunnels)
        self.snapshots = Snapshots(self.launches, self.transitions, config.network)
        self._creating = OneAtATime()

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

    def _images(self, manager: SandboxManager) -> dict[str, str]:
        return {image.name: image.id for image in manager.images.list()}

    def _translate(
        self, manager: SandboxManager, sandbox: pb.DriverSandbox, caller: Caller
    ) -> Translated:
        return translate(
            sandbox,
            self._images(manager),
            self.supervisor,
            admission=self.admission,
            default_user=self.config.ssh_user,
            owner=caller.owner,
        )

    def _made(self, manager: SandboxManager) -> list[Sandbox]:
        """The sandboxes this driver made: this state directory's, carrying a gateway id."""
        return [s for s in manager.list() if s.labels.get(ID_LABEL) and s.local]

    def _ours(self, manager: SandboxManager, caller: Caller) -> list[Sandbox]:
        """The sandboxes this driver made for ``caller`` (``caller.Caller.owns``)."""
        return [s for s in self._made(manager) if caller.owns(s)]

    def _find(self, manager: SandboxManager, caller: Caller, sandbox_id: str, name: str) -> Sandbox:
        """The sandbox a request addresses, among the caller's own only (``find_ours``)."""
        return find_ours(self._ours(manager, caller), sandbox_id, name)

    def resume(self) -> None:
        """At start: reconcile (a killed server's half-made sandboxes), then wait again for
        sandboxes of ours left started or starting by a server that is gone, and launch every
        ready one and open a tunnel into it (a supervisor in each dials the gateway)."""
        with self._manager() as manager:
            try:
                manager.reconcile()
            except VmSandboxError as exc:  # serving goes on; the next reconcile repairs
                log.warning("reconcile at start: %s: %s", exc.code, exc.message)
            for sandbox in self._made(manager):
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

        def check() -> None:
            self.callers.identify(context)
            negotiation.check_gateway(request.HasField("gateway"), request.gateway)

        self._call(context, "GetCapabilities", check)
        return negotiation.capabilities(self.admission, reports_readiness=self.supervisor is None)

    def AuthenticateSandbox(self, request: Any, context: grpc.ServicerContext) -> Any:
        """The gateway id and runtime identity of the caller's sandbox whose token
        ``credential`` is. The credential is a secret: no message, log line or error detail
        repeats it."""

        def authenticate() -> tuple[str, str]:
            caller = self.callers.identify(context)
            if not request.credential:
                raise InvalidArgument(
                    "credential is empty: give the sandbox token the sandbox holds",
                    details={"field": "credential"},
                )
            with self._manager() as manager:
                found = manager.store.holder(
                    request.credential, among=lambda s: bool(s.local and caller.owns(s))
                )
            sandbox_id = found.labels.get(ID_LABEL) if found is not None else None
            if found is None or not sandbox_id:
                raise Unauthenticated("the credential is not the token of any sandbox here")
            return sandbox_id, str(RuntimeIdentity.of(found))

        sandbox_id, identity = self._call(context, "AuthenticateSandbox", authenticate)
        return pb.AuthenticateSandboxResponse(sandbox_id=sandbox_id, runtime_identity=identity)

    def ValidateSandboxCreate(self, request: Any, context: grpc.ServicerContext) -> Any:
        def validate() -> None:
            caller = self.callers.identify(context)
            with self._manager() as manager:
                manager.dry_run(self._translate(manager, request.sandbox, caller).spec)

        self._call(context, "ValidateSandboxCreate", validate)
        return pb.ValidateSandboxCreateResponse()

    def CreateSandbox(self, request: Any, context: grpc.ServicerContext) -> Any:
        def create() -> str:
            caller = self.callers.identify(context)
            with self._creating((caller.owner, request.sandbox.id)):
                with self._manager() as manager:
                    again = self._created(manager, caller, request.sandbox)
                if again is not None:
                    return again
                return self._create(caller, request.sandbox)

        identity = self._call(context, "CreateSandbox", create)
        return pb.CreateSandboxResponse(runtime_identity=identity)

    def _created(
        self, manager: SandboxManager, caller: Caller, sandbox: pb.DriverSandbox
    ) -> str | None:
        """The runtime identity of the caller's sandbox with ``sandbox``'s id when this is the
        request that made it; None when the caller has no sandbox of that id. ALREADY_EXISTS
        for another request under that id."""
        if not sandbox.id:
            return None  # translate says what is wrong
        found = next(
            (s for s in self._ours(manager, caller) if s.labels[ID_LABEL] == sandbox.id), None
        )
        if found is None:
            return None
        record = manager.store.require(found.name, found.uuid).record
        if not same_request(record, sandbox):
            raise AlreadyExists(
                f"sandbox {sandbox.id!r} exists, made by a different request: delete it first",
                details={"sandbox_id": sandbox.id},
            )
        log.info("sandbox %s (%s) asked for again: the same", found.name, sandbox.id)
        return str(RuntimeIdentity.of(found))

    def _create(self, caller: Caller, request: pb.DriverSandbox) -> str:
        with self._manager() as manager:
            wanted = self._translate(manager, request, caller)
            pooled = pooled_spec(request, wanted.spec, manager.config.pool)
            try:
                # a pooled guest of the shape is claimed when one is ready, else it boots
                sandbox = manager.create(pooled or wanted.spec, wait=False)
            except VmSandboxError:
                self.readiness.reconcile_behind()
                raise
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
        log.info("sandbox %s (%s) started for %s", wanted.name, request.id, caller.owner)
        self.readiness.become_ready(sandbox.name, sandbox.uuid)
        return str(RuntimeIdentity.of(sandbox))

    def GetSandbox(self, request: Any, context: grpc.ServicerContext) -> Any:
        def get() -> pb.DriverSandbox:
            caller = self.callers.identify(context)
            with self._manager() as manager:
                found = self._find(manager, caller, request.sandbox_id, request.name)
                return self.snapshots.one(manager, found)

        return pb.GetSandboxResponse(sandbox=self._call(context, "GetSandbox", get))

    def ListSandboxes(self, request: Any, context: grpc.ServicerContext) -> Any:
        def listing() -> list[pb.DriverSandbox]:
            caller = self.callers.identify(context)
            with self._manager() as manager:
                return self.snapshots.many(manager, self._ours(manager, caller))

        return pb.ListSandboxesResponse(sandboxes=self._call(context, "ListSandboxes", listing))

    def StopSandbox(self, request: Any, context: grpc.ServicerContext) -> Any:
        def stop() -> None:
            caller = self.callers.identify(context)
            with self._manager() as manager:
                found = self._find(manager, caller, request.sandbox_id, request.name)
                if self.config.openshell_stop_suspends:  # memory and GPUs given back
                    manager.suspend(found.name, uuid=found.uuid)
                else:
                    manager.stop(found.name, uuid=found.uuid)

        self._call(context, "StopSandbox", stop)
        return pb.StopSandboxResponse()

    def StartSandbox(self, request: Any, context: grpc.ServicerContext) -> Any:
        """Checks ``expected_runtime_identity`` and the launch credentials before starting
        anything; records ``generation_id``; answers the runtime identity after the start."""

        def start() -> str:
            caller = self.callers.identify(context)
            with self._manager() as manager:
                found = self._find(manager, caller, request.sandbox_id, request.name)
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
                if found.state == STATE_SUSPENDED:  # only a resume brings it back
                    started = manager.resume(found.name, uuid=found.uuid)
                else:
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
            caller = self.callers.identify(context)
            with self._manager() as manager:
                try:
                    found = self._find(manager, caller, request.sandbox_id, request.name)
                    manager.destroy(found.name, uuid=found.uuid)
                except NotFound:
                    return False
            self.transitions.forget(found.domain)
            self.launches.forget(found.uuid)
            log.info("sandbox %s deleted", found.name)
            return True

        return pb.DeleteSandboxResponse(deleted=self._call(context, "DeleteSandbox", delete))

    def WatchSandboxes(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        """The caller's sandboxes, then their changes (watch.py)."""
        caller = self._call(context, "WatchSandboxes", lambda: self.callers.identify(context))
        events = self.events.subscribe()
        stream = Stream(lambda: self._listing(caller), lambda u, n: self._one(caller, u, n))
        try:
            yield from self._call(context, "WatchSandboxes", lambda: list(stream.start()))
            while context.is_active():
                try:
                    event = events.get(timeout=_WATCH_TICK)
                except queue.Empty:
                    continue
                if event.gone and event.name is not None:
                    self.transitions.forget(DOMAIN_PREFIX + event.name)
                changes = partial(lambda e: list(stream.events(e)), event)  # errors: inside _call
                yield from self._call(context, "WatchSandboxes", changes)
        finally:
            self.events.unsubscribe(events)

    def EnsureWorkspace(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._call(context, "EnsureWorkspace", lambda: self.callers.identify(context))
        return pb.EnsureWorkspaceResponse()

    def DeleteWorkspace(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._call(context, "DeleteWorkspace", lambda: self.callers.identify(context))
        return pb.DeleteWorkspaceResponse()

    # -- watch --------------------------------------------------------------------------------

    def _listing(self, caller: Caller) -> list[tuple[str, pb.DriverSandbox]]:
        """(domain UUID, snapshot) of each of the caller's sandboxes: all of them, or an
        error (a libvirt error propagates)."""
        with self._manager() as manager:
            ours = self._ours(manager, caller)
            snaps = self.snapshots.many(manager, ours)
        return [(s.uuid, snap) for s, snap in zip(ours, snaps, strict=True)]

    def _one(self, caller: Caller, uuid: str, name: str) -> pb.DriverSandbox | None:
        """The snapshot of the caller's sandbox of domain ``uuid``; None when that domain is
        not one (gone since: its own event follows)."""
        try:
            with self._manager() as manager:
                found = manager.store.by_domain(DOMAIN_PREFIX + name, uuid=uuid or None)
                if found is None:
                    return None
                sandbox = manager.store.view(found.record, found.state, found.uuid)
                if not (sandbox.labels.get(ID_LABEL) and sandbox.local and caller.owns(sandbox)):
                    return None
                return self.snapshots.one(manager, sandbox)
        except (NotFound, InvalidArgument):
            return None  # undefined since: its own event follows
        except VmSandboxError as exc:
            log.warning("watch: reading sandbox %s failed: %s", name, exc.message)
            return None


def _abort(context: grpc.ServicerContext, exc: VmSandboxError) -> NoReturn:
    """End the RPC with ``exc``'s code and message, marked as the driver's own answer
    (ANSWERED_METADATA)."""
    code = getattr(grpc.StatusCode, exc.code, grpc.StatusCode.INTERNAL)
    context.set_trailing_metadata(((ANSWERED_METADATA, code.name),))
    context.abort(code, exc.message)
    raise AssertionError("context.abort returned")  # pragma: no cover - abort always raises
