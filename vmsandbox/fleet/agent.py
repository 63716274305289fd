"""The agent: one Ray actor per host (``agent:<host>``), placed on the host's own node, the only
part of the fleet that talks to the host. It speaks to the host's driver socket (``vmsandbox
serve``): the OpenShell compute driver for sandboxes, HostInfo for what the host has. It opens
no listener; the fleet reaches it through Ray.

Every RECONCILE_PERIOD seconds it reads HostInfo and keeps the host's *pinned claim*
(model.py): what the host has taken or blocked outside the fleet's own claims. A fleet claim
on this node whose sandbox is not here, that no create of this agent is working on and that no
live fleet process waits for (its placement record, records.py) is removed after
STRANDED_GRACE seconds (its fleet process died mid-create). A fleet sandbox here without a
placement record gets one (made before records were kept, or its record dropped by a delete
that raced its create), except one this agent is deleting or deleted a moment ago. The agent
is *ready* while its last reconcile succeeded and its driver answers: a host that rejoins, or
whose driver comes back, has its survivors pinned before the fleet routes a create to it.

Liveness apart from work: ``ping`` runs in a concurrency group of its own (HEALTH), and the
listings and authentications in another (READS), so neither ever waits behind the creates and
deletes of the default group. ``ping`` does no I/O: it answers what a probe thread saw, which
every PROBE_PERIOD seconds checks that someone listens on the driver's socket and that the
driver's gRPC server takes a new connection within PROBE_TIMEOUT (its handshake, through the
uid check, answered by the server's transport, not its workers: a driver whose workers are all
busy with creates is alive, a killed or hung one is not). ``driver_down_s`` says for how long
the driver has not answered, and the fleet marks the host lost from it (hosts.py). A create
checks, before it calls the host, that the fleet still places that sandbox here (its record
names this host): a create that waited in the actor's queue while the fleet moved on makes
nothing.

Sandboxes the fleet made carry two labels: GATEWAY_LABEL (the gateway that asked) and
HOST_LABEL (this host). A call names its gateway, and the agent acts only on that gateway's
sandboxes, so one gateway's request never reaches another's sandbox. The host enforces it too:
the agent speaks for the gateway in each driver call (``vmsandbox-gateway`` metadata,
openshell/caller.py), which the host accepts from the agent's uid only when its config trusts
that uid (``openshell_delegate_uids``); each gateway is then an owner of its own there, and
sees nothing of another. HostInfo is read without naming one: the agent sees the sandboxes of
every gateway it speaks for. Errors come back as ``{"error": {"code", "message", "answered",
"sent"}}``, with the host's own code: ``answered`` when the host's driver itself answered it
(its ANSWERED_METADATA), ``sent`` false when nothing was sent to it; only then does the caller
know the call did nothing (placement.definite).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from typing import Any

import grpc
import ray

from vmsandbox.fleet import claims, model
from vmsandbox.fleet.records import Records
from vmsandbox.openshell.caller import ANSWERED_METADATA, FLEET_GATEWAY_LABEL, GATEWAY_METADATA
from vmsandbox.openshell.dial import Checked
from vmsandbox.openshell.proto import compute_driver_pb2 as pb
from vmsandbox.openshell.proto import compute_driver_pb2_grpc as pb_grpc
from vmsandbox.openshell.proto import host_info_pb2 as info_pb
from vmsandbox.openshell.proto import host_info_pb2_grpc as info_grpc
from vmsandbox.openshell.request import ID_LABEL

log = logging.getLogger(__name__)
GATEWAY_LABEL = FLEET_GATEWAY_LABEL
HOST_LABEL = "vmsandbox.fleet/host"
RECONCILE_PERIOD = 1.0  # seconds between two reads of the host (each costs the host a look)
STRANDED_GRACE = 10.0  # seconds a claim on this node may wait for its sandbox
PIN_WAIT = 2.0  # seconds to wait for the pinned claim to be placed
CALL_TIMEOUT = 120.0  # seconds for one call to the host's driver (a create defines and starts)
PROBE_PERIOD = 0.5  # seconds between two probes of the driver
PROBE_TIMEOUT = 1.5  # seconds a probe waits for the driver's answer
DELETED_GRACE = 60.0  # seconds after a delete here during which its sandbox gets no new record
HEALTH = "health"  # the concurrency group of ping
READS = "reads"  # the concurrency group of the listings and authentications
CONCURRENCY_GROUPS = {HEALTH: 2, READS: 16}
CALLS = 32  # creates and deletes at once (the default group)


def _for(gateway: str) -> tuple[tuple[str, str], ...]:
    """The metadata of a driver call made on behalf of ``gateway``."""
    return ((GATEWAY_METADATA, gateway),)


class HostAgent:
    """The agent of host ``host``, whose driver listens on ``socket_path``; ``totals``: the
    Ray resources its node joined with."""

    def __init__(self, host: str, socket_path: str, totals: dict[str, float]) -> None:
        self.host = host
        self.totals = totals
        self.node_id = ray.get_runtime_context().get_node_id()
        self.socket_path = socket_path
        self._dialled = Checked(socket_path)  # only to a driver of a trusted uid (dial.py)
        self._driver = pb_grpc.ComputeDriverStub(self._dialled.channel)
        self._info_stub = info_grpc.HostInfoStub(self._dialled.channel)
        self.records = Records()
        self._lock = threading.Lock()
        self._in_flight: set[str] = set()
        self._unmatched: dict[str, float] = {}
        self._deleting: dict[tuple[str, str], float] = {}  # -> when it ended (inf: under way)
        self._info: dict[str, Any] | None = None
        self._ready = False
        self._error: str | None = None
        self._answered_at = time.monotonic()  # the driver's last answer to a probe
        self._driver_error: str | None = None
        # Probes that found the driver gone: a reconcile begun before one makes nobody ready.
        self._outages = 0
        self._pinned: dict[str, float] | None = None
        claims.remove(model.pin_name(host))  # left by an earlier incarnation of this host
        self._stop = threading.Event()
        threading.Thread(target=self._loop, name="reconcile", daemon=True).start()
        threading.Thread(target=self._probe, name="probe", daemon=True).start()

    # -- what the fleet asks ----------------------------------------------------------------

    @ray.method(concurrency_group=HEALTH)
    def ping(self) -> dict[str, Any]:
        """The agent's state, the host document it last read, and for how long the driver has
        not answered (``driver_down_s``, None while it answers). No I/O: it never waits."""
        with self._lock:
            down = None
            if self._driver_error is not None:
                down = time.monotonic() - self._answered_at
            return {
                "host": self.host,
                "node_id": self.node_id,
                "pid": os.getpid(),
                "ready": self._ready and down is None,
                "error": self._driver_error or self._error,
                "driver_down_s": down,
                "info": self._info,
                "totals": self.totals,
            }

    def create(self, request: bytes, gateway: str, claim: str) -> dict[str, Any]:
        """Create the sandbox of ``request`` (a serialized DriverSandbox) for ``gateway`` under
        claim ``claim``; on success, the GPUs the host gave it and its name. A create the fleet
        no longer places here (its record names no longer this host) makes nothing."""
        sandbox = pb.DriverSandbox.FromString(request)
        labels = sandbox.spec.template.labels
        labels[GATEWAY_LABEL] = gateway
        labels[HOST_LABEL] = self.host
        record = self.records.get(gateway, sandbox.id)
        if record is None or record.host != self.host:
            return _error(
                "ABORTED",
                f"the fleet no longer places sandbox {sandbox.id!r} on host {self.host}",
                sent=False,
            )
        with self._lock:
            self._in_flight.add(claim)
        try:
            created = self._driver.CreateSandbox(
                pb.CreateSandboxRequest(sandbox=sandbox),
                timeout=CALL_TIMEOUT,
                metadata=_for(gateway),
            )
        except grpc.RpcError as exc:
            return self._failed(exc)
        finally:
            with self._lock:
                self._in_flight.discard(claim)
        try:
            info = self._read_info()
        except grpc.RpcError as exc:  # made, but which GPUs it got cannot be read now
            return _error(exc.code().name, f"the sandbox was made: {exc.details()}")
        found = _find(info, gateway, sandbox.id)
        by_bdf = {gpu["bdf"]: gpu for gpu in info["gpus"]}
        gpus = [by_bdf[bdf] for bdf in (found or {}).get("gpus", []) if bdf in by_bdf]
        return {
            "host": self.host,
            "gpus": gpus,
            "runtime_identity": created.runtime_identity,
            "name": (found or {}).get("name", sandbox.name),
        }

    @ray.method(concurrency_group=READS)
    def sandboxes(self, gateway: str) -> dict[str, Any]:
        """The gateway's sandboxes on this host, as serialized DriverSandbox snapshots."""
        try:
            info = self._read_info()
            listed = self._driver.ListSandboxes(
                pb.ListSandboxesRequest(), timeout=CALL_TIMEOUT, metadata=_for(gateway)
            )
        except grpc.RpcError as exc:
            return self._failed(exc)
        ours = {s["labels"].get(ID_LABEL) for s in _owned(info, gateway)}
        return {
            "sandboxes": [s.SerializeToString() for s in listed.sandboxes if s.id in ours],
        }

    @ray.method(concurrency_group=READS)
    def authenticate(self, gateway: str, credential: str) -> dict[str, Any]:
        """The id of the gateway's sandbox on this host whose token ``credential`` is (an
        empty id when none is); the credential is never logged."""
        try:
            answer = self._driver.AuthenticateSandbox(
                pb.AuthenticateSandboxRequest(credential=credential),
                timeout=CALL_TIMEOUT,
                metadata=_for(gateway),
            )
            info = self._read_info()
        except grpc.RpcError as exc:
            return self._failed(exc)
        if _find(info, gateway, answer.sandbox_id) is None:
            return {"sandbox_id": "", "runtime_identity": ""}
        return {"sandbox_id": answer.sandbox_id, "runtime_identity": answer.runtime_identity}

    def act(self, gateway: str, sandbox_id: str, rpc: str, request: bytes) -> dict[str, Any]:
        """``rpc`` (StopSandbox, StartSandbox or DeleteSandbox) with ``request`` (serialized) on
        the gateway's sandbox ``sandbox_id``; ``found`` False when it is not here. A stop or
        start answers too how many GPUs the sandbox held before (``gpus_before``) and its
        state after (``state``, empty when the host cannot be read now): a stop that the host
        maps to suspend leaves it ``suspended``, its GPUs given back (fleet/power.py)."""
        deleting = rpc == "DeleteSandbox"
        if deleting:
            with self._lock:
                self._deleting[(gateway, sandbox_id)] = float("inf")
        try:
            found = _find(self._read_info(), gateway, sandbox_id)
            if found is None:
                return {"found": False, "deleted": False}
            message = getattr(pb, f"{rpc}Request").FromString(request)
            message.sandbox_id, message.name = sandbox_id, found["name"]
            answer = getattr(self._driver, rpc)(
                message, timeout=CALL_TIMEOUT, metadata=_for(gateway)
            )
        except grpc.RpcError as exc:
            return self._failed(exc)
        finally:
            if deleting:
                with self._lock:
                    self._deleting[(gateway, sandbox_id)] = time.monotonic()
        done = {
            "found": True,
            "deleted": bool(getattr(answer, "deleted", False)),
            "runtime_identity": getattr(answer, "runtime_identity", ""),
        }
        if not deleting:
            done["gpus_before"] = len(found.get("gpus", []))
            try:
                after = _find(self._read_info(), gateway, sandbox_id)
            except grpc.RpcError:  # done, but its state cannot be read now
                after = None
            done["state"] = (after or {}).get("state", "")
        return done

    def _failed(self, exc: grpc.RpcError) -> dict[str, Any]:
        """The error of a failed driver call: answered when the driver answered it (its
        ANSWERED_METADATA); FAILED_PRECONDITION, not sent, when the socket's server was refused
        (not of a trusted uid: nothing was sent to it)."""
        if self._dialled.refused is not None:
            return _error("FAILED_PRECONDITION", self._dialled.refused, sent=False)
        return _error(exc.code().name, exc.details() or str(exc), answered=_answered(exc))

    def close(self) -> None:
        """Stop reconciling and give the host's pinned claim back (the host leaves)."""
        self._stop.set()
        claims.remove(model.pin_name(self.host))
        self._dialled.close()

    # -- reconcile --------------------------------------------------------------------------

    def _read_info(self) -> dict[str, Any]:
        answer = self._info_stub.GetHostInfo(info_pb.GetHostInfoRequest(), timeout=CALL_TIMEOUT)
        info = json.loads(answer.json)
        with self._lock:
            self._info = info
        return info

    def _probe(self) -> None:
        """Every PROBE_PERIOD, whether the driver answers (``_probe_once``)."""
        while not self._stop.wait(PROBE_PERIOD):
            error = self._probe_once()
            with self._lock:
                if error is None:
                    self._answered_at = time.monotonic()
                else:
                    self._ready = False  # until a reconcile pins what the host holds again
                    self._outages += 1
                    if self._driver_error is None:
                        log.warning("host %s: %s", self.host, error)
                self._driver_error = error

    def _probe_once(self) -> str | None:
        """None when someone listens on the driver's socket and a new connection to it (checked
        by uid, dial.py) is taken by its gRPC server within PROBE_TIMEOUT; else what failed."""
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.settimeout(PROBE_TIMEOUT)
                probe.connect(self.socket_path)
        except OSError as exc:
            return f"nobody serves the driver's socket {self.socket_path}: {exc.strerror or exc}"
        options = [("grpc.use_local_subchannel_pool", 1)]  # a connection of its own
        with grpc.insecure_channel(self._dialled.target, options=options) as channel:
            try:
                grpc.channel_ready_future(channel).result(timeout=PROBE_TIMEOUT)
            except grpc.FutureTimeoutError:
                return self._dialled.refused or (
                    f"the host's driver did not take a connection in {PROBE_TIMEOUT:g} s"
                )
        return None

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.reconcile()
                error = None
            except grpc.RpcError as exc:
                error = self._dialled.refused or (
                    f"the host's driver does not answer: {exc.code().name}: {exc.details()}"
                )
            except Exception as exc:  # Ray or the host: keep trying, say what failed
                error = f"{type(exc).__name__}: {exc}"
            with self._lock:
                self._error = error
                if error:
                    self._ready = False  # until a reconcile pins what the host holds again
            if error:
                log.warning("host %s: %s", self.host, error)
            self._stop.wait(RECONCILE_PERIOD)

    def reconcile(self) -> None:
        """Read the host; record its fleet sandboxes that lack a record; remove stranded fleet
        claims; replace the pinned claim when what it must hold changed (model.pinned); ready
        once it is placed, unless the driver went away meanwhile."""
        with self._lock:
            outages = self._outages
        info = self._read_info()
        ours = {
            (s["labels"][GATEWAY_LABEL], s["labels"].get(ID_LABEL, "")): s
            for s in info["sandboxes"]
            if s["labels"].get(GATEWAY_LABEL) and s["labels"].get(HOST_LABEL) == self.host
        }
        here = {model.claim_name(*owner) for owner in ours}
        self._record(ours)
        with self._lock:
            in_flight = set(self._in_flight)
        now = time.monotonic()
        mine = [c for c in claims.claims() if c.node_id == self.node_id]
        held = []
        for claim in mine:
            owner = model.claim_owner(claim.name)
            if owner is None:
                continue
            if claim.name in here or claim.name in in_flight or self._awaited(*owner):
                self._unmatched.pop(claim.name, None)
                held.append(claim.bundle)
            elif now - self._unmatched.setdefault(claim.name, now) > STRANDED_GRACE:
                log.info("host %s: removing stranded claim %s", self.host, claim.name)
                claims.remove(claim.name)
                self._unmatched.pop(claim.name, None)
            else:
                held.append(claim.bundle)
        want = model.pinned(self.totals, model.host_free(self.host, info), model.add(held))
        pin = model.pin_name(self.host)
        placed = any(c.name == pin and c.state == "CREATED" for c in mine)
        if want != self._pinned or (want and not placed):
            claims.remove(pin)
            claims.wait_gone(pin, PIN_WAIT)
            self._pinned = None
            if want:
                bundle = {**want, model.HOST + self.host: 1.0}
                if claims.place(pin, bundle, PIN_WAIT) is None:
                    raise RuntimeError(f"the pinned claim {bundle} could not be placed yet")
            self._pinned = want
        with self._lock:
            self._ready = self._outages == outages

    def _awaited(self, gateway: str, sandbox_id: str) -> bool:
        """Whether a live fleet process waits for this host's answer to the create of the
        sandbox (its record ``creating`` here): its call may wait in this actor's queue."""
        record = self.records.get(gateway, sandbox_id)
        return (
            record is not None
            and record.host == self.host
            and record.state == model.CREATING
            and record.job in claims.live_jobs()
        )

    def _record(self, ours: dict[tuple[str, str], dict[str, Any]]) -> None:
        """A placement record for each fleet sandbox here that has none, except one this agent
        deletes or deleted less than DELETED_GRACE seconds ago (the delete dropped its record
        on purpose). Only the records' keys are read: one look at the store per reconcile."""
        now = time.monotonic()
        with self._lock:
            self._deleting = {k: t for k, t in self._deleting.items() if now - t < DELETED_GRACE}
            deleting = set(self._deleting)
        for owner in set(ours) - self.records.recorded() - deleting:
            listed = ours[owner]
            found = model.Record(*owner, name=listed["name"], host=self.host, state=model.PLACED)
            if self.records.add(found):
                log.info("host %s: recorded sandbox %s of gateway %s", self.host, *owner[::-1])


def _owned(info: dict[str, Any], gateway: str) -> list[dict[str, Any]]:
    """The host's sandboxes that ``gateway`` made through the fleet."""
    return [s for s in info["sandboxes"] if s["labels"].get(GATEWAY_LABEL) == gateway]


def _find(info: dict[str, Any], gateway: str, sandbox_id: str) -> dict[str, Any] | None:
    return next((s for s in _owned(info, gateway) if s["labels"].get(ID_LABEL) == sandbox_id), None)


def _error(code: str, message: str, *, answered: bool = False, sent: bool = True) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "answered": answered, "sent": sent}}


def _answered(exc: grpc.RpcError) -> bool:
    """Whether the driver itself answered the failed call (rather than the way there failing:
    the connection lost, the deadline passed), so nothing was done."""
    trailing: Any = exc.trailing_metadata() or ()  # type: ignore[attr-defined]
    return any(key == ANSWERED_METADATA for key, _value in trailing)
