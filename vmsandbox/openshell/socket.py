"""The driver's Unix socket: its folder and mode, and the peer check gRPC cannot do.

The extension socket has no TLS and no authentication; the socket is the protection. grpcio
tells a servicer nothing about a Unix peer (``context.peer()`` is ``"unix:"``, the auth context
has no uid), so the check happens where the kernel knows: ``PeerGate`` accepts on the public
socket, reads the peer's credentials (SO_PEERCRED), closes connections from uids that are not
allowed, and relays the others byte for byte to gRPC's own socket, which sits in a 0700 folder
of its own that only this user can reach.

The service must also know *which* allowed uid calls (openshell/caller.py: each is a gateway
of its own). The gate's end of each relay is bound, before it connects to gRPC's socket, to a
fresh name in the abstract namespace, which gRPC reports as that connection's peer
(``context.peer()``, ``unix-abstract:NAME``); ``Peers`` maps each such name to the uid the
gate saw, for as long as the relay lasts. Only the gate's own connections are in it: any other
peer of gRPC's socket (which only this uid can reach) is no caller.

Allowed: the server's own uid, and those listed in the config (``openshell_allowed_uids``, and
the delegates of ``openshell_delegate_uids``).
Modes: socket 0600 when only the own uid is allowed, 0666 with other uids allowed (so they can
reach it at all, and the peer check decides); a folder the server makes for it is 0700, or
0711 with other uids allowed. A folder that exists already (/run, /tmp) keeps its mode.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import stat
import struct
import threading
from pathlib import Path

from vmsandbox.config import Config
from vmsandbox.errors import FailedPrecondition, InvalidArgument
from vmsandbox.openshell.splice import splice

log = logging.getLogger(__name__)
_UNIX_PATH_MAX = 107  # sun_path holds 108 bytes, one for the NUL


def allowed_uids(config: Config) -> frozenset[int]:
    """Who may use the driver's socket besides the server's own uid: the gateways and the
    delegates of the config."""
    return frozenset(config.openshell_allowed_uids) | frozenset(config.openshell_delegate_uids)


def peer_uid(conn: socket.socket) -> int:
    """The uid of the process at the other end of a connected Unix socket (SO_PEERCRED)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid


def prepare_socket_path(path: Path, *, shared: bool) -> None:
    """Make the socket's folder when it is missing (0700, or 0711 when ``shared``) and remove
    a stale socket. A folder that exists is left as it is: it may be /run or /tmp, which
    others use too; the socket's own mode and the peer check protect it."""
    if len(os.fsencode(path)) > _UNIX_PATH_MAX:
        raise InvalidArgument(
            f"socket path {path} is longer than {_UNIX_PATH_MAX} bytes, the most a Unix "
            "socket address holds",
            details={"field": "openshell_socket", "value": str(path)},
        )
    try:
        if not path.parent.exists():
            path.parent.mkdir(parents=True)
            os.chmod(path.parent, 0o711 if shared else 0o700)  # the umask may have taken bits
        if path.is_symlink() or path.exists():
            if not stat.S_ISSOCK(path.lstat().st_mode):
                raise FailedPrecondition(f"{path} exists and is not a socket; not replacing it")
            if _listening(path):
                raise FailedPrecondition(f"another server already listens on {path}")
            path.unlink()
    except OSError as exc:
        raise FailedPrecondition(f"cannot prepare socket {path}: {exc.strerror}") from exc


def _listening(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


class Peers:
    """The uid behind each relayed connection, by the peer address gRPC reports for it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._uids: dict[str, int] = {}

    def uid_of(self, peer: str) -> int | None:
        """The uid of the relayed connection whose gRPC peer address is ``peer``; None for a
        connection the gate did not make."""
        with self._lock:
            return self._uids.get(peer)

    def add(self, peer: str, uid: int) -> None:
        with self._lock:
            self._uids[peer] = uid

    def remove(self, peer: str) -> None:
        with self._lock:
            self._uids.pop(peer, None)


class PeerGate:
    """Accept on ``public``, check each peer's uid, relay allowed ones to ``backend``; with
    ``peers``, tell the service which uid each relayed connection is (module docstring)."""

    def __init__(
        self,
        public: Path,
        backend: Path,
        allowed_uids: frozenset[int],
        peers: Peers | None = None,
    ) -> None:
        self.public = public
        self.backend = backend
        self.peers = peers
        self.allowed = allowed_uids | {os.geteuid()}
        shared = self.allowed != {os.geteuid()}
        prepare_socket_path(public, shared=shared)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o111 if shared else 0o177)  # the socket is born with its final mode
        try:
            self._listener.bind(str(public))
        finally:
            os.umask(old)
        self._listener.listen(64)
        self._thread = threading.Thread(target=self._accept, name="peer-gate", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop accepting and remove the socket (relays already open end with their peer)."""
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with contextlib.suppress(OSError):
            self.public.unlink()

    def _accept(self) -> None:
        while True:
            try:
                conn, _addr = self._listener.accept()
            except OSError:
                return  # closed
            uid = peer_uid(conn)
            if uid not in self.allowed:
                log.warning(
                    "refused a connection from uid %d (allowed: %s)", uid, sorted(self.allowed)
                )
                conn.close()
                continue
            threading.Thread(target=self._relay, args=(conn, uid), daemon=True).start()

    def _relay(self, client: socket.socket, uid: int) -> None:
        backend = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        name = f"vmsandbox-peer-{os.getpid()}-{secrets.token_hex(8)}"
        peer = f"unix-abstract:{name}"
        try:
            if self.peers is not None:
                backend.bind("\0" + name)
                self.peers.add(peer, uid)
            backend.connect(str(self.backend))
        except OSError as exc:
            log.error("cannot reach the gRPC server at %s: %s", self.backend, exc)
            client.close()
            backend.close()
            if self.peers is not None:
                self.peers.remove(peer)
            return
        try:
            splice(client, backend)
        finally:
            if self.peers is not None:
                self.peers.remove(peer)
