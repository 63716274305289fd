"""``Fleet``: many vmsandbox hosts as one, for one gateway, through Ray.

A fleet process keeps nothing that matters in its memory. What a sandbox is like is read from
its host (each agent lists the gateway's sandboxes from its host's driver); where each sandbox
is, or may be, is its placement record, kept in Ray's control store (records.py), as are the
claims. A fresh ``Fleet`` (a restarted fleet server) knows everything its predecessor knew; it
only lacks the last snapshots of sandboxes on hosts lost before it started, which it lists from
their records until their host is back.

Every sandbox is addressed by the gateway's sandbox id. A create (create.py) works under the
id's record: the same request again is answered by the host that has it (a host's create is
idempotent per gateway and id), a different one is ALREADY_EXISTS there, and a create whose
outcome is unknown answers UNAVAILABLE and is asked of the same host again, never placed
elsewhere. The gateway's identity (``gateway``) is the operator's name for it, written into
each sandbox's labels on its host: a fleet acts only on its own gateway's sandboxes.

"Does not exist" is said only from a complete view: a sandbox is listed from every host that
answers and, for the records whose host is lost or does not answer, from its record (its last
snapshot when this process saw one), Ready false with reason ``HostLost``. A delete asks the
record's host and is UNAVAILABLE while that host is lost or does not answer; ``deleted: false``
means no record names a host, or that host said it has no such sandbox. A lost host's
sandboxes are not deleted and not placed again; their claims are released (the host's agent
pins the capacity again when the host rejoins, before it takes new work).

Stop and start go to the host the record names (power.py): a sandbox suspended there gives its
claim back and keeps its record, and is resumed only there, its claim taken again first.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import ray

from vmsandbox.errors import InvalidArgument, NotFound, Unauthenticated, Unavailable
from vmsandbox.fleet import claims, model, placement
from vmsandbox.fleet.agent import GATEWAY_LABEL
from vmsandbox.fleet.auth import check_token_auth
from vmsandbox.fleet.create import Create
from vmsandbox.fleet.hosts import HostTable
from vmsandbox.fleet.model import HostView, Record
from vmsandbox.fleet.power import Power
from vmsandbox.fleet.records import Records
from vmsandbox.openshell.caller import OneAtATime
from vmsandbox.openshell.proto import compute_driver_pb2 as pb
from vmsandbox.openshell.request import ID_LABEL

log = logging.getLogger("vmsandbox.fleet")
ADDRESS_ENV = "VMSANDBOX_FLEET_ADDRESS"
CALL_TIMEOUT = 150.0  # seconds for one agent call (a host's create defines and starts)
_GATEWAY_RE = re.compile(r"[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?")
LOST_REASON = "HostLost"
UNANSWERED_REASON = "HostNotAnswering"
# A create or a listing uses the hosts as seen at most this many seconds ago (the fleet
# server's monitor looks every 0.5 s); a refusal or a lost host is found out at the host.
FRESH = 1.0


def check_gateway(name: str) -> str:
    if not isinstance(name, str) or not _GATEWAY_RE.fullmatch(name):
        raise InvalidArgument(
            f"gateway {name!r} is not valid: use 1-63 lowercase letters, digits, '.' and '-', "
            "starting and ending with a letter or digit",
            details={"field": "gateway", "value": repr(name)},
        )
    return name


@dataclass(frozen=True)
class FleetSandbox:
    """One of the gateway's sandboxes: its host, its driver snapshot, and whether the host is
    lost (the snapshot is then the last one seen, marked HostLost)."""

    sandbox_id: str
    host: str
    snapshot: pb.DriverSandbox
    lost: bool = False

    def to_dict(self) -> dict[str, Any]:
        ready = next((c for c in self.snapshot.status.conditions if c.type == "Ready"), None)
        return {
            "id": self.sandbox_id,
            "name": self.snapshot.name,
            "host": self.host,
            "lost": self.lost,
            "ready": ready.status if ready else "Unknown",
            "reason": ready.reason if ready else "",
        }


class Fleet:
    """The gateway ``gateway``'s view of the fleet whose Ray head is at ``address`` (default:
    $VMSANDBOX_FLEET_ADDRESS). ``place_timeout``: seconds a create waits for Ray to find
    room before RESOURCE_EXHAUSTED. ``metrics``: a FleetMetrics to record into (or None)."""

    def __init__(
        self,
        address: str | None = None,
        *,
        gateway: str = "default",
        place_timeout: float = 5.0,
        metrics: Any = None,
    ) -> None:
        check_token_auth()
        self.gateway = check_gateway(gateway)
        self.place_timeout = place_timeout
        self.metrics = metrics
        self._own_ray = not ray.is_initialized()
        if self._own_ray:
            ray.init(
                address=address or os.environ.get(ADDRESS_ENV) or "auto",
                namespace=model.NAMESPACE,
                logging_level=logging.WARNING,
                log_to_driver=False,
            )
        self.records = Records()
        self.job = claims.this_job()
        self.table = HostTable()
        self.table.on_lost.append(self._host_lost)
        self._last: dict[str, FleetSandbox] = {}  # sandbox id -> its host's last snapshot
        self._lock = threading.Lock()
        self._one = OneAtATime()  # one create or delete per sandbox id at a time here
        self.table.refresh()

    def close(self) -> None:
        if self._own_ray:
            ray.shutdown()

    # -- hosts ------------------------------------------------------------------------------

    def hosts(self) -> list[HostView]:
        """Every host with its state, its own capacity and Ray's view of it."""
        views = self.table.refresh()
        if self.metrics is not None:
            self.metrics.hosts_seen(list(views.values()))
        return sorted(views.values(), key=lambda view: view.name)

    def _agent(self, host: str) -> Any:
        try:
            return ray.get_actor(model.agent_name(host), namespace=model.NAMESPACE)
        except ValueError as exc:
            raise Unavailable(f"host {host} has no agent: it left or is lost") from exc

    def call(self, host: str, method: str, *args: Any) -> dict[str, Any]:
        """The agent's answer, or an UNAVAILABLE error answer when the host has no agent right
        now (lost, or joining again and its agent not yet up: nothing was sent) or the call
        failed on the way (its outcome is not known)."""
        try:
            agent = self._agent(host)
        except Unavailable as exc:
            return {"error": {"code": "UNAVAILABLE", "message": exc.message, "sent": False}}
        try:
            return ray.get(getattr(agent, method).remote(*args), timeout=CALL_TIMEOUT)
        except ray.exceptions.RayError as exc:
            return {"error": {"code": "UNAVAILABLE", "message": f"host {host}: {exc}"}}

    def _host_lost(self, view: HostView) -> None:
        """A host was lost: the claims of the sandboxes recorded there (of every gateway) and
        its pinned claim are released; the sandboxes stay recorded, listed as lost."""
        log.warning("host %s is lost: %s", view.name, view.error)
        for record in self.records.of():
            if record.host == view.name:
                claims.remove(model.claim_name(record.gateway, record.sandbox_id))
        claims.remove(model.pin_name(view.name))

    def legacy_host(self, sandbox_id: str) -> str | None:
        """The host of one of the gateway's sandboxes that has no placement record (made
        before records were kept; its host's agent records it soon): where its claim is placed,
        or a host whose last document lists it."""
        claim = claims.find(model.claim_name(self.gateway, sandbox_id))
        if claim is not None and claim.node_id is not None:
            host = {node.node_id: node.host for node in claims.nodes()}.get(claim.node_id)
            if host is not None:
                return host
        for view in self.table.snapshot():
            if any(_owner(s) == (self.gateway, sandbox_id) for s in _listed(view)):
                return view.name
        return None

    def sweep(self) -> None:
        """Forget the gateway's creates that wait for placement on behalf of nobody: claims
        waiting with no record, or with a record whose create's fleet process is dead (killed
        while it waited), and those records (no host was asked: nothing was made)."""
        live = claims.live_jobs()

        def orphan(record: Record | None) -> bool:
            return record is None or (record.state == model.PLACING and record.job not in live)

        for claim in claims.claims():
            owner = model.claim_owner(claim.name)
            if owner is None or owner[0] != self.gateway or claim.state == "CREATED":
                continue
            if orphan(self.records.get(*owner)):  # read now: a create may have taken it over
                log.info("removing claim %s: its create's fleet process is gone", claim.name)
                claims.remove(claim.name)
        for record in self.records.of(self.gateway):
            if orphan(record) and orphan(self.records.get(self.gateway, record.sandbox_id)):
                log.info("forgetting sandbox %s: its create's fleet process died placing it",
                         record.sandbox_id)  # fmt: skip
                self.records.drop(self.gateway, record.sandbox_id)

    # -- sandboxes --------------------------------------------------------------------------

    def create(
        self, sandbox: pb.DriverSandbox, *, model_name: str | None = None, numa: str = "any"
    ) -> placement.Placed:
        """Create ``sandbox`` (the gateway's DriverSandbox) on the host Ray chooses, or on the
        host its record names (create.py)."""
        if not sandbox.id:
            raise InvalidArgument(
                "sandbox.id is empty: the gateway always sets it", details={"field": "id"}
            )
        started = time.monotonic()
        try:
            wish = placement.wish_of(sandbox, model_name, numa)
            with self._one(sandbox.id):
                self.table.refresh(max_age=FRESH)
                placed = Create(self, sandbox, wish).run()
        except Exception as exc:
            if self.metrics is not None:
                self.metrics.failed("create", getattr(exc, "code", "INTERNAL"))
            raise
        if self.metrics is not None:
            self.metrics.created(time.monotonic() - started, placed.claim_seconds)
        return placed

    def sandboxes(self) -> list[FleetSandbox]:
        """The gateway's sandboxes: those of every host that answers as it reports them, and
        those recorded on a host that is lost or does not answer as last seen (module
        docstring)."""
        views = self.table.refresh(max_age=FRESH)
        records = self.records.of(self.gateway)
        found: dict[str, FleetSandbox] = {}
        answered: set[str] = set()
        for view in views.values():
            if view.state == "lost":
                continue
            answer = self.call(view.name, "sandboxes", self.gateway)
            if "error" in answer:
                continue
            answered.add(view.name)
            for data in answer["sandboxes"]:
                snapshot = pb.DriverSandbox.FromString(data)
                found[snapshot.id] = FleetSandbox(snapshot.id, view.name, snapshot)
        with self._lock:
            last = self._last
            self._last = dict(found)
            for record in records:
                if record.sandbox_id in found or record.host in (None, *answered):
                    continue  # listed; or its host answered without it (not there now)
                seen = last.get(record.sandbox_id)
                if seen is not None:
                    self._last[record.sandbox_id] = seen
                host = views.get(record.host) if record.host else None
                found[record.sandbox_id] = _unreached(record, seen, host)
        return sorted(found.values(), key=lambda sandbox: sandbox.sandbox_id)

    def get(self, sandbox_id: str) -> FleetSandbox:
        for sandbox in self.sandboxes():
            if sandbox.sandbox_id == sandbox_id:
                return sandbox
        raise NotFound(
            f"sandbox {sandbox_id!r} does not exist in this gateway's fleet",
            details={"sandbox_id": sandbox_id},
        )

    def delete(self, sandbox_id: str) -> bool:
        """Delete the gateway's sandbox ``sandbox_id``; False when it does not exist (no record
        names a host, or that host has no such sandbox); UNAVAILABLE while a create of it is
        under way elsewhere or its host is lost or does not answer."""
        started = time.monotonic()
        claim = model.claim_name(self.gateway, sandbox_id)
        with self._one(sandbox_id):
            record = self.records.get(self.gateway, sandbox_id)
            if record is None:
                host = self.legacy_host(sandbox_id)
                if host is None:
                    claims.remove(claim)  # a create's that failed
                    return False
                record = Record(self.gateway, sandbox_id, host=host, state=model.PLACED)
            if record.busy(claims.live_jobs(), self.job):
                raise Unavailable(
                    f"a create of sandbox {sandbox_id!r} is under way in another fleet "
                    "process: delete it once that create answered",
                    details={"sandbox_id": sandbox_id},
                )
            if record.host is None:  # its create died waiting for placement
                claims.remove(claim)
                self.records.drop(self.gateway, sandbox_id)
                return False
            view = self.table.refresh(max_age=FRESH).get(record.host)
            if view is None or view.state == "lost":
                raise Unavailable(
                    f"sandbox {sandbox_id!r} is on host {record.host}, which is lost: delete "
                    "it again once the host is back",
                    details={"sandbox_id": sandbox_id, "host": record.host},
                )
            request = pb.DeleteSandboxRequest().SerializeToString()
            answer = self.call(
                record.host, "act", self.gateway, sandbox_id, "DeleteSandbox", request
            )
            if "error" in answer:
                if self.metrics is not None:
                    self.metrics.failed("delete", answer["error"]["code"])
                raise placement.error(answer["error"]["code"], answer["error"]["message"])
            claims.remove(claim)
            self.records.drop(self.gateway, sandbox_id)
        with self._lock:
            self._last.pop(sandbox_id, None)
        if self.metrics is not None:
            self.metrics.deleted(time.monotonic() - started)
        return bool(answer.get("deleted"))

    def power(
        self, sandbox_id: str, request: pb.StopSandboxRequest | pb.StartSandboxRequest
    ) -> str:
        """Stop or start (as ``request`` says) the gateway's sandbox ``sandbox_id`` on the host
        its record names (power.py: a suspend gives the sandbox's claim back, a resume takes it
        again on that host); the runtime identity a start answers."""
        rpc = type(request).__name__.removesuffix("Request")
        with self._one(sandbox_id):
            self.table.refresh(max_age=FRESH)
            return Power(self, sandbox_id, rpc, request.SerializeToString()).run()

    def authenticate(self, credential: str) -> dict[str, Any]:
        """The id and runtime identity of the gateway's sandbox whose token ``credential``
        is; UNAUTHENTICATED only when every host that may hold one of the gateway's sandboxes
        answered no, UNAVAILABLE when one of them is lost or does not answer."""
        views = self.table.refresh(max_age=FRESH)
        unasked = {record.host for record in self.records.of(self.gateway) if record.host}
        for view in views.values():
            if view.state == "lost":
                continue
            answer = self.call(view.name, "authenticate", self.gateway, credential)
            if answer.get("sandbox_id"):
                return answer
            if "error" not in answer:
                unasked.discard(view.name)
        if unasked:
            raise Unavailable(
                f"host(s) {', '.join(sorted(unasked))} do not answer now, and may hold the "
                "sandbox of this token: ask again",
                details={"hosts": sorted(unasked)},
            )
        raise Unauthenticated("the credential is not the token of any sandbox here")

    def create_sandbox(
        self,
        *,
        sandbox_id: str | None = None,
        name: str = "",
        image: str = "",
        cpus: int = 1,
        memory_mib: int = 1024,
        gpus: int = 0,
        model_name: str | None = None,
        numa: str = "any",
    ) -> tuple[str, placement.Placed]:
        """The Python API's create: a sandbox of this size; returns its id and placement."""
        sandbox_id = sandbox_id or str(uuid.uuid4())
        spec = pb.DriverSandboxSpec(
            template=pb.DriverSandboxTemplate(
                image=image,
                resources=pb.DriverResourceRequirements(
                    cpu_limit=str(cpus), memory_limit=f"{memory_mib}Mi"
                ),
            )
        )
        if gpus:
            spec.resource_requirements.gpu.count = gpus
        sandbox = pb.DriverSandbox(id=sandbox_id, name=name, spec=spec)
        return sandbox_id, self.create(sandbox, model_name=model_name, numa=numa)


def _listed(view: HostView) -> list[dict[str, Any]]:
    """The sandboxes in the host document a host last answered."""
    return list((view.info or {}).get("sandboxes", []))


def _owner(listed: dict[str, Any]) -> tuple[str, str] | None:
    """(gateway, sandbox id) of a listed sandbox the fleet made; None for others."""
    labels = listed.get("labels", {})
    gateway = labels.get(GATEWAY_LABEL)
    return (gateway, labels.get(ID_LABEL, "")) if gateway else None


def _unreached(record: Record, seen: FleetSandbox | None, host: HostView | None) -> FleetSandbox:
    """The sandbox of ``record``, whose host did not answer now: as this process last ``seen``
    it, else by its id and name, with Ready false (HostLost) when the host is lost, or Ready
    unknown (HostNotAnswering) while it is not lost yet: never Ready on an old answer."""
    assert record.host is not None
    snapshot = pb.DriverSandbox(id=record.sandbox_id, name=record.name)
    if seen is not None:
        snapshot.CopyFrom(seen.snapshot)
    lost = host is None or host.state == "lost"
    if lost:
        at = host.lost_at if host is not None and host.lost_at else time.time()
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))
        status, reason = "False", LOST_REASON
        message = f"host {record.host} stopped answering at {when}; the sandbox is kept there"
    else:
        status, reason = "Unknown", UNANSWERED_REASON
        message = f"host {record.host} does not answer now; the sandbox is recorded there"
    del snapshot.status.conditions[:]
    snapshot.status.conditions.add(type="Ready", status=status, reason=reason, message=message)
    return FleetSandbox(record.sandbox_id, record.host, snapshot, lost=lost)
