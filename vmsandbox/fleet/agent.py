"""The agent: one Ray actor per host (``agent:<host>``), placed on the host's own node, the only
part of the fleet that talks to the host. It speaks to the host's driver socket (``vmsandbox
serve``): the OpenShell compute driver for sandboxes, HostInfo for what the host has. It opens
no listener; the fleet reaches it through Ray.

Every RECONCILE_PERIOD seconds it reads HostInfo and keeps the host's *pinned claim*
(model.py): what the host has taken or blocked outside the fleet's own claims. A fleet claim
on this node whose sandbox never appeared here, and that no create of this agent is working
on, is removed after STRANDED_GRACE seconds (its fleet server died mid-create). The agent is
*ready* once its first pinned claim is placed: a host that rejoins has its survivors covered
before the fleet routes a create to it.

Sandboxes the fleet made carry two labels: GATEWAY_LABEL (the gateway that asked) and
HOST_LABEL (this host). A call names its gateway, and the agent acts only on that gateway's
sandboxes, so one gateway's request never reaches another's sandbox. The host enforces it too:
the agent speaks for the gateway in each driver call (``vmsandbox-gateway`` metadata,
openshell/caller.py), which the host accepts from the agent's uid only when its config trusts
that uid (``openshell_delegate_uids``); each gateway is then an owner of its own there, and
sees nothing of another. HostInfo is read without naming one: the agent sees the sandboxes of
every gateway it speaks for. Errors come back as ``{"error": {"code", "message"}}``, with the
host's own code.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

import grpc
import ray

from vmsandbox.fleet import claims, model
from vmsandbox.openshell.caller import FLEET_GATEWAY_LABEL, GATEWAY_METADATA
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
        self._dialled = Checked(socket_path)  # only to a driver of a trusted uid (dial.py)
        self._driver = pb_grpc.ComputeDriverStub(self._dialled.channel)
        self._info_stub = info_grpc.HostInfoStub(self._dialled.channel)
        self._lock = threading.Lock()
        self._in_flight: set[str] = set()
        self._unmatched: dict[str, float] = {}
        self._info: dict[str, Any] | None = None
        self._ready = False
        self._error: str | None = None
        self._pinned: dict[str, float] | None = None
        claims.remove(model.pin_name(host))  # left by an earlier incarnation of this host
        self._stop = threading.Event()
        threading.Thread(target=self._loop, name="reconcile", daemon=True).start()

    # -- what the fleet asks ----------------------------------------------------------------

    def ping(self) -> dict[str, Any]:
        """The agent's state and the host document it last read."""
        with self._lock:
            return {
                "host": self.host,
                "node_id": self.node_id,
                "ready": self._ready,
                "error": self._error,
                "info": self._info,
                "totals": self.totals,
            }

    def create(self, request: bytes, gateway: str, claim: str) -> dict[str, Any]:
        """Create the sandbox of ``request`` (a serialized DriverSandbox) for ``gateway`` under
        claim ``claim``; on success, the GPUs the host gave it."""
        sandbox = pb.DriverSandbox.FromString(request)
        labels = sandbox.spec.template.labels
        labels[GATEWAY_LABEL] = gateway
        labels[HOST_LABEL] = self.host
        with self._lock:
            self._in_flight.add(claim)
        try:
            created = self._driver.CreateSandbox(
                pb.CreateSandboxRequest(sandbox=sandbox),
                timeout=CALL_TIMEOUT,
                metadata=_for(gateway),
            )
            info = self._read_info()
        except grpc.RpcError as exc:
            return self._failed(exc)
        finally:
            with self._lock:
                self._in_flight.discard(claim)
        found = _find(info, gateway, sandbox.id)
        by_bdf = {gpu["bdf"]: gpu for gpu in info["gpus"]}
        gpus = [by_bdf[bdf] for bdf in (found or {}).get("gpus", []) if bdf in by_bdf]
        return {"host": self.host, "gpus": gpus, "runtime_identity": created.runtime_identity}

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
        the gateway's sandbox ``sandbox_id``; ``found`` False when it is not here."""
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
        return {
            "found": True,
            "deleted": bool(getattr(answer, "deleted", False)),
            "runtime_identity": getattr(answer, "runtime_identity", ""),
        }

    def _failed(self, exc: grpc.RpcError) -> dict[str, Any]:
        """The error of a failed driver call; FAILED_PRECONDITION when the socket's server
        was refused (not of a trusted uid: nothing was sent to it)."""
        if self._dialled.refused is not None:
            return {"error": {"code": "FAILED_PRECONDITION", "message": self._dialled.refused}}
        return {"error": {"code": exc.code().name, "message": exc.details() or str(exc)}}

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
                log.warning("host %s: %s", self.host, error)
            self._stop.wait(RECONCILE_PERIOD)

    def reconcile(self) -> None:
        """Read the host; remove stranded fleet claims; replace the pinned claim when what it
        must hold changed (model.pinned); ready once it is placed."""
        info = self._read_info()
        here = {
            model.claim_name(s["labels"][GATEWAY_LABEL], s["labels"].get(ID_LABEL, ""))
            for s in info["sandboxes"]
            if s["labels"].get(GATEWAY_LABEL) and s["labels"].get(HOST_LABEL) == self.host
        }
        with self._lock:
            in_flight = set(self._in_flight)
        now = time.monotonic()
        mine = [c for c in claims.claims() if c.node_id == self.node_id]
        held = []
        for claim in mine:
            if not claim.name.startswith(model.CLAIM_PREFIX):
                continue
            if claim.name in here or claim.name in in_flight:
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
            self._ready = True


def _owned(info: dict[str, Any], gateway: str) -> list[dict[str, Any]]:
    """The host's sandboxes that ``gateway`` made through the fleet."""
    return [s for s in info["sandboxes"] if s["labels"].get(GATEWAY_LABEL) == gateway]


def _find(info: dict[str, Any], gateway: str, sandbox_id: str) -> dict[str, Any] | None:
    return next((s for s in _owned(info, gateway) if s["labels"].get(ID_LABEL) == sandbox_id), None)
