"""``Fleet``: many vmsandbox hosts as one, for one gateway, through Ray.

The fleet keeps no records of its own. Which sandbox lives where is read from the hosts
(each agent lists the gateway's sandboxes from its host's driver); claims live in Ray. A fresh
``Fleet`` (a restarted fleet server) therefore knows everything its predecessor knew, except
the last snapshots of sandboxes on hosts lost before it started, which come back with their
host.

Every sandbox is addressed by the gateway's sandbox id; its claim is named after the gateway
and that id, so a second create of the same id is ALREADY_EXISTS, never a second sandbox. The
gateway's identity (``gateway``) is the operator's name for it, written into each sandbox's
labels on its host: a fleet acts only on its own gateway's sandboxes.

A sandbox on a lost host is reported with Ready false, reason ``HostLost``; it is not deleted
and not placed again, and its claim is released (the host's agent pins the capacity again when
the host rejoins, before it takes new work). Deleting it while its host is lost is UNAVAILABLE.
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

from vmsandbox.errors import InvalidArgument, NotFound, Unavailable
from vmsandbox.fleet import claims, model, placement
from vmsandbox.fleet.agent import GATEWAY_LABEL
from vmsandbox.fleet.auth import check_token_auth
from vmsandbox.fleet.hosts import HostTable
from vmsandbox.fleet.model import HostView, Wish
from vmsandbox.openshell.proto import compute_driver_pb2 as pb
from vmsandbox.openshell.request import ID_LABEL

log = logging.getLogger("vmsandbox.fleet")
ADDRESS_ENV = "VMSANDBOX_FLEET_ADDRESS"
CALL_TIMEOUT = 150.0  # seconds for one agent call (a host's create defines and starts)
_GATEWAY_RE = re.compile(r"[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?")
LOST_REASON = "HostLost"
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
        self.table = HostTable()
        self.table.on_lost.append(self._host_lost)
        self._where: dict[str, str] = {}  # sandbox id -> host
        self._last: dict[str, FleetSandbox] = {}  # sandbox id -> last listing
        self._lock = threading.Lock()
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

    def _call(self, host: str, method: str, *args: Any) -> dict[str, Any]:
        """The agent's answer, or an UNAVAILABLE error answer when the host has no agent right
        now (lost, or joining again and its agent not yet up) or it does not answer."""
        try:
            agent = self._agent(host)
            return ray.get(getattr(agent, method).remote(*args), timeout=CALL_TIMEOUT)
        except Unavailable as exc:
            return {"error": {"code": "UNAVAILABLE", "message": exc.message}}
        except ray.exceptions.RayError as exc:
            return {"error": {"code": "UNAVAILABLE", "message": f"host {host}: {exc}"}}

    def _host_lost(self, view: HostView) -> None:
        """A host was lost: its sandboxes' claims and its pinned claim are released; its
        sandboxes stay reported, as lost."""
        log.warning("host %s is lost", view.name)
        with self._lock:
            gone = {sid for sid, host in self._where.items() if host == view.name}
        gone |= {
            owner[1] for s in _listed(view) if (owner := _owner(s)) and owner[0] == self.gateway
        }
        for sandbox_id in gone:
            claims.remove(model.claim_name(self.gateway, sandbox_id))
        claims.remove(model.pin_name(view.name))

    # -- sandboxes --------------------------------------------------------------------------

    def create(
        self, sandbox: pb.DriverSandbox, *, model_name: str | None = None, numa: str = "any"
    ) -> placement.Placed:
        """Create ``sandbox`` (the gateway's DriverSandbox) on the host Ray chooses."""
        if not sandbox.id:
            raise InvalidArgument(
                "sandbox.id is empty: the gateway always sets it", details={"field": "id"}
            )
        started = time.monotonic()
        try:
            placed = self._create(sandbox, placement.wish_of(sandbox, model_name, numa))
        except Exception as exc:
            if self.metrics is not None:
                self.metrics.failed("create", getattr(exc, "code", "INTERNAL"))
            raise
        if self.metrics is not None:
            self.metrics.created(time.monotonic() - started, placed.claim_seconds)
        return placed

    def _create(self, sandbox: pb.DriverSandbox, wish: Wish) -> placement.Placed:
        self.table.refresh(max_age=FRESH)
        name = model.claim_name(self.gateway, sandbox.id)
        with self._lock:
            known = self._where.get(sandbox.id)
        for view in self.table.snapshot():
            if any(_owner(s) == (self.gateway, sandbox.id) for s in _listed(view)):
                known = view.name
        if known is not None:
            raise _exists(sandbox.id, known)
        request = sandbox.SerializeToString()
        nodes: dict[str, str] = {}

        def place(claim: str, bundle: dict[str, float], wait: float, selector: dict) -> str | None:
            node = claims.place(claim, bundle, wait, selector)
            if node is None:
                return None
            nodes.update({n.node_id: n.host for n in claims.nodes()})
            return nodes.get(node)

        def create(host: str) -> dict[str, Any]:
            answer = self._call(host, "create", request, self.gateway, name)
            if "error" not in answer:
                with self._lock:
                    self._where[sandbox.id] = host
            return answer

        def release(host: str, reason: str) -> None:
            log.info("create %s: host %s: %s", sandbox.id, host, reason)
            with self._lock:
                self._where.pop(sandbox.id, None)
            # made but not as wished, or made before the host failed: taken back (a host
            # without it says so, and nothing happens)
            request = pb.DeleteSandboxRequest().SerializeToString()
            self._call(host, "act", self.gateway, sandbox.id, "DeleteSandbox", request)
            claims.remove(name)
            claims.wait_gone(name, 5.0)

        steps = placement.plan(wish, self.table.ready(), self.place_timeout)
        return placement.run(steps, wish, name, place, create, release)

    def sandboxes(self) -> list[FleetSandbox]:
        """The gateway's sandboxes on every host: live ones as their host reports them, those
        of lost hosts as last seen, marked lost."""
        views = self.table.refresh(max_age=FRESH)
        found: dict[str, FleetSandbox] = {}
        for view in views.values():
            if view.state == "lost":
                continue
            answer = self._call(view.name, "sandboxes", self.gateway)
            if "error" in answer:  # no answer this time: what it last said stands
                with self._lock:
                    found.update({sid: s for sid, s in self._last.items() if s.host == view.name})
                continue
            for data in answer["sandboxes"]:
                snapshot = pb.DriverSandbox.FromString(data)
                found[snapshot.id] = FleetSandbox(snapshot.id, view.name, snapshot)
        with self._lock:
            for sandbox_id, last in self._last.items():
                host = views.get(last.host)
                if sandbox_id not in found and host is not None and host.state == "lost":
                    found[sandbox_id] = _lost(last, host)
            self._last = found
            self._where = {sid: sandbox.host for sid, sandbox in found.items()}
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
        """Delete the gateway's sandbox ``sandbox_id``; False when it does not exist."""
        started = time.monotonic()
        try:
            found = self.get(sandbox_id)
        except NotFound:
            claims.remove(model.claim_name(self.gateway, sandbox_id))  # a create that failed
            return False
        if found.lost:
            raise Unavailable(
                f"sandbox {sandbox_id!r} is on host {found.host}, which is lost: delete it "
                "again once the host is back",
                details={"sandbox_id": sandbox_id, "host": found.host},
            )
        request = pb.DeleteSandboxRequest().SerializeToString()
        answer = self._call(found.host, "act", self.gateway, sandbox_id, "DeleteSandbox", request)
        if "error" in answer:
            if self.metrics is not None:
                self.metrics.failed("delete", answer["error"]["code"])
            raise placement.error(answer["error"]["code"], answer["error"]["message"])
        claims.remove(model.claim_name(self.gateway, sandbox_id))
        with self._lock:
            self._where.pop(sandbox_id, None)
            self._last.pop(sandbox_id, None)
        if self.metrics is not None:
            self.metrics.deleted(time.monotonic() - started)
        return bool(answer.get("deleted"))

    def power(
        self, sandbox_id: str, request: pb.StopSandboxRequest | pb.StartSandboxRequest
    ) -> str:
        """Stop or start (as ``request`` says) the gateway's sandbox ``sandbox_id``; the
        runtime identity a start answers."""
        found = self.get(sandbox_id)
        if found.lost:
            raise Unavailable(f"sandbox {sandbox_id!r} is on host {found.host}, which is lost")
        rpc = type(request).__name__.removesuffix("Request")
        answer = self._call(
            found.host, "act", self.gateway, sandbox_id, rpc, request.SerializeToString()
        )
        if "error" in answer:
            raise placement.error(answer["error"]["code"], answer["error"]["message"])
        return str(answer.get("runtime_identity", ""))

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


def _exists(sandbox_id: str, host: str) -> Exception:
    from vmsandbox.errors import AlreadyExists

    return AlreadyExists(
        f"sandbox {sandbox_id!r} exists on host {host}",
        details={"sandbox_id": sandbox_id, "host": host},
    )


def _lost(last: FleetSandbox, host: HostView) -> FleetSandbox:
    """``last``'s snapshot with Ready false, reason HostLost."""
    snapshot = pb.DriverSandbox()
    snapshot.CopyFrom(last.snapshot)
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(host.lost_at or time.time()))
    message = f"host {host.name} stopped answering at {when}; the sandbox is kept there"
    del snapshot.status.conditions[:]
    snapshot.status.conditions.add(
        type="Ready", status="False", reason=LOST_REASON, message=message
    )
    return FleetSandbox(last.sandbox_id, host.name, snapshot, lost=True)
