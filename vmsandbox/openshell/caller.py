"""Who calls the driver: a gateway is an identity, not a label.

Every connection to the driver's socket comes through ``socket.PeerGate``, which knows the
peer's uid (SO_PEERCRED) and tells the service (``socket.Peers``). That uid is the caller:
each uid the operator lets in (``openshell_allowed_uids``, and the server's own) is one
gateway. A uid of ``openshell_delegate_uids`` is trusted to speak for gateways it names in each
call's metadata (GATEWAY_METADATA: a fleet agent calls for every gateway of its fleet over one
socket), and each gateway it names is an owner of its own; so is the server's own uid, which
holds every sandbox anyway (the state directory, libvirt). Any other uid that names a gateway
is PERMISSION_DENIED. A connection the gate did not relay has no caller: UNAUTHENTICATED.

The caller's identity, ``Caller.owner`` (``uid:1000``, or ``uid:1001/gw-a`` for a gateway a
delegate named), goes into the record of every sandbox it creates (``SandboxRecord.owner``),
and every RPC sees and acts on its own sandboxes only (``owns``). Records from before owners
were kept have an owner read from their labels (``owner_of``): one the fleet made belongs to
any delegate speaking for the gateway its fleet label names, any other to the server's own
uid (the gateway of a host with one gateway, as before).
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from vmsandbox.errors import InvalidArgument, PermissionDenied, Unauthenticated
from vmsandbox.sandbox.handle import Sandbox

# The call metadata in which a delegate names the gateway it speaks for (gRPC keys are
# lowercase ASCII).
GATEWAY_METADATA = "vmsandbox-gateway"
# The trailing metadata of an error the driver itself answered (its code as the value): a
# client tells it from a failure of the way there (a connection lost, a deadline passed), which
# says nothing of what the driver did.
ANSWERED_METADATA = "vmsandbox-answered"
# The label the fleet's agent puts on the sandboxes it makes (vmsandbox/fleet/agent.py): the
# owner of those made before owners were recorded.
FLEET_GATEWAY_LABEL = "vmsandbox.fleet/gateway"
_GATEWAY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}\Z")
_ANY_DELEGATE = "*"  # the uid part of a legacy fleet sandbox's owner: any delegate


@dataclass(frozen=True)
class Caller:
    """One caller: the peer's ``uid``, and the ``gateway`` it speaks for when it is a trusted
    ``delegate`` that named one."""

    uid: int
    gateway: str = ""
    delegate: bool = False

    @property
    def owner(self) -> str:
        """The identity recorded in the sandboxes this caller creates."""
        return f"uid:{self.uid}" + (f"/{self.gateway}" if self.gateway else "")

    def owns(self, sandbox: Sandbox) -> bool:
        """Whether ``sandbox`` is this caller's (its owner, ``owner_of``)."""
        owner = owner_of(sandbox)
        if owner == self.owner:
            return True
        return bool(self.gateway) and owner == f"{_ANY_DELEGATE}/{self.gateway}"

    def sees(self, sandbox: Sandbox) -> bool:
        """Whether HostInfo shows ``sandbox`` by name to this caller: its own, and for a
        delegate that names no gateway, those of every gateway it speaks for (a fleet agent
        reconciling its host)."""
        if self.owns(sandbox):
            return True
        if not (self.delegate and not self.gateway):
            return False
        owner = owner_of(sandbox)
        return owner.startswith((f"uid:{self.uid}/", f"{_ANY_DELEGATE}/"))


def owner_of(sandbox: Sandbox) -> str:
    """The owner of ``sandbox``: its record's, else (made before owners were recorded) the
    gateway of its fleet label for any delegate, else the server's own uid."""
    if sandbox.owner:
        return sandbox.owner
    gateway = sandbox.labels.get(FLEET_GATEWAY_LABEL)
    return f"{_ANY_DELEGATE}/{gateway}" if gateway else f"uid:{os.geteuid()}"


def check_gateway(name: str) -> str:
    """A gateway name a delegate gives: 1-63 letters, digits, '.', '_' and '-', starting with a
    letter or digit."""
    if not _GATEWAY.match(name):
        raise InvalidArgument(
            f"{GATEWAY_METADATA} {name!r} is not a gateway name: use 1-63 letters, digits, "
            "'.', '_' and '-', starting with a letter or digit",
            details={"field": GATEWAY_METADATA, "value": name},
        )
    return name


class Callers:
    """Who each RPC's peer is: ``peer_uid`` maps gRPC's peer address to the uid the gate saw
    (``socket.Peers.uid_of``); ``delegates`` are the uids trusted to name gateways, the
    server's own besides."""

    def __init__(self, peer_uid: Callable[[str], int | None], delegates: Iterable[int]) -> None:
        self._peer_uid = peer_uid
        self.delegates = frozenset(delegates) | {os.geteuid()}

    def identify(self, context: Any) -> Caller:
        """The caller of the RPC of ``context`` (a grpc.ServicerContext); UNAUTHENTICATED for
        a connection the gate did not relay, PERMISSION_DENIED for a gateway named by a uid
        that may not speak for one."""
        uid = self._peer_uid(context.peer())
        if uid is None:
            raise Unauthenticated(
                "the driver cannot tell who calls: connect through its socket, whose gate "
                "checks each peer"
            )
        named = [v for k, v in context.invocation_metadata() or () if k == GATEWAY_METADATA]
        if not named:
            return Caller(uid, delegate=uid in self.delegates)
        if uid not in self.delegates:
            raise PermissionDenied(
                f"uid {uid} named a gateway ({GATEWAY_METADATA}) but may not speak for one: "
                "the operator lists the uids that may in openshell_delegate_uids",
                details={"uid": uid},
            )
        if len(named) > 1:
            raise InvalidArgument(
                f"{GATEWAY_METADATA} given {len(named)} times: name one gateway",
                details={"field": GATEWAY_METADATA},
            )
        return Caller(uid, check_gateway(str(named[0])), delegate=True)


class OneAtATime:
    """One call at a time per key (a caller's sandbox id): a create sent again while the first
    is still at work waits for it, then finds what it made."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[object, tuple[threading.Lock, int]] = {}

    @contextlib.contextmanager
    def __call__(self, key: object) -> Iterator[None]:
        with self._lock:
            lock, users = self._held.get(key, (threading.Lock(), 0))
            self._held[key] = (lock, users + 1)
        try:
            with lock:
                yield
        finally:
            with self._lock:
                lock, users = self._held[key]
                if users == 1:
                    del self._held[key]
                else:
                    self._held[key] = (lock, users - 1)
