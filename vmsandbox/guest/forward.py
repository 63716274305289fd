"""TCP ports of a guest on this host: each forward listens on a local address (127.0.0.1 unless
another is named) and carries every connection to a port on the guest's own loopback through
the sandbox's SSH connection (a ``direct-tcpip`` channel, as ``ssh -L`` does), with the pinned
host key (ssh.py).

A connection the guest refuses (nothing listens on that port) is closed and reported through
``on_event``; the forwarder goes on. At most ``max_connections`` are carried at once, one
thread each; one more is closed at once and reported. The SSH connection is made again when it
has gone (a guest rebooted), on the next connection that needs it.
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
import select
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vmsandbox.errors import InvalidArgument, ResourceExhausted

if TYPE_CHECKING:
    import paramiko

LOOPBACK = "127.0.0.1"
GUEST_HOST = "localhost"  # where the guest's sshd connects each forwarded connection
MAX_CONNECTIONS = 64
OPEN_TIMEOUT_S = 15.0  # for the guest's sshd to connect to the port (or refuse)
_ACCEPT_POLL_S = 0.5  # how often a listener looks whether it is closed
_CHUNK = 65536
FORWARD_FORMAT = "[ADDRESS:][LOCAL:]REMOTE, ports 1-65535 (LOCAL 0: any free port)"
_SPEC_RE = re.compile(
    r"(?:(?P<address>\[[^\]]*\]|[^:\[\]]+):)?(?:(?P<local>[^:]*):)?(?P<remote>[^:]+)\Z"
)


@dataclass(frozen=True)
class ForwardSpec:
    """Guest port ``remote`` on ``address``:``local`` (``local`` 0: a free port)."""

    address: str
    local: int
    remote: int

    def __str__(self) -> str:
        return f"{_bracketed(self.address)}:{self.local}:{self.remote}"


@dataclass(frozen=True)
class Listening:
    """A forward as it listens: where, and to which guest port."""

    address: str
    port: int
    remote: int

    def to_dict(self) -> dict[str, Any]:
        return {"address": self.address, "port": self.port, "remote_port": self.remote}

    def __str__(self) -> str:
        return f"{_bracketed(self.address)}:{self.port} -> guest port {self.remote}"


def _bracketed(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def _port(text: str, what: str, spec: str, lowest: int) -> int:
    if not text.isascii() or not text.isdigit() or not lowest <= int(text) <= 65535:
        raise InvalidArgument(
            f"forward {spec!r}: {what} port {text!r} is not valid; use {FORWARD_FORMAT}",
            details={"field": "forward", "value": spec, "allowed": FORWARD_FORMAT},
        )
    return int(text)


def parse_forward(spec: str) -> ForwardSpec:
    """``REMOTE``, ``LOCAL:REMOTE`` or ``ADDRESS:LOCAL:REMOTE`` (an IPv6 address in brackets,
    or ``localhost``). ``REMOTE`` alone listens on the same port number. INVALID_ARGUMENT
    naming the spec and the allowed forms for anything else."""
    match = _SPEC_RE.match(spec) if isinstance(spec, str) else None
    if match is None:
        raise InvalidArgument(
            f"forward {spec!r} is not valid; use {FORWARD_FORMAT}",
            details={"field": "forward", "value": repr(spec), "allowed": FORWARD_FORMAT},
        )
    address, local, remote_text = (
        match.group("address"),
        match.group("local"),
        match.group("remote"),
    )
    if address is not None and local is None:  # "A:B" is LOCAL:REMOTE
        address, local = None, address
    remote = _port(remote_text, "guest", spec, 1)
    port = remote if local is None else _port(local, "local", spec, 0)
    host = LOOPBACK
    if address is not None:
        host = address.strip("[]")
        if host != "localhost":
            try:
                host = str(ipaddress.ip_address(host))
            except ValueError:
                raise InvalidArgument(
                    f"forward {spec!r}: {host!r} is not an IP address (or localhost)",
                    details={"field": "forward", "value": spec, "allowed": FORWARD_FORMAT},
                ) from None
    return ForwardSpec(host, port, remote)


Events = Callable[[str], None]


class Forwarder:
    """The forwards of ``specs`` through the SSH client ``connect()`` returns (and returns
    again when the connection has gone). ``start`` binds every listener before any is served
    (RESOURCE_EXHAUSTED naming an address in use); ``close`` stops them all and every
    connection. A context manager."""

    def __init__(
        self,
        connect: Callable[[], paramiko.SSHClient],
        specs: Sequence[ForwardSpec],
        *,
        on_event: Events = lambda _line: None,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self._connect = connect
        self.specs = list(specs)
        self.on_event = on_event
        self.listening: list[Listening] = []
        self._client: paramiko.SSHClient | None = None
        self._client_lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_connections)
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []

    def start(self) -> list[Listening]:
        try:
            self._transport()  # the guest must answer before anything listens
            for spec in self.specs:
                listener = self._bind(spec)
                self._sockets.append(listener)
                bound = listener.getsockname()
                self.listening.append(Listening(spec.address, bound[1], spec.remote))
        except BaseException:
            self.close()
            raise
        for listener, forward in zip(self._sockets, self.listening, strict=True):
            thread = threading.Thread(
                target=self._accept,
                args=(listener, forward),
                name=f"forward {forward}",
                daemon=True,
            )
            thread.start()
            self._threads.append(thread)
        return list(self.listening)

    def _bind(self, spec: ForwardSpec) -> socket.socket:
        family = socket.AF_INET6 if ":" in spec.address else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((spec.address, spec.local))
            listener.listen(16)
        except OSError as exc:
            listener.close()
            raise ResourceExhausted(
                f"cannot listen on {_bracketed(spec.address)}:{spec.local} for guest port "
                f"{spec.remote}: {exc.strerror or exc}",
                details={"address": spec.address, "port": spec.local},
            ) from exc
        listener.settimeout(_ACCEPT_POLL_S)
        return listener

    def _transport(self) -> paramiko.Transport:
        """The SSH transport, connected again when it has gone."""
        with self._client_lock:
            transport = self._client.get_transport() if self._client else None
            if transport is None or not transport.is_active():
                if self._client is not None:
                    self._client.close()
                self._client = self._connect()
                transport = self._client.get_transport()
                assert transport is not None  # a client connect() returns is connected
                transport.set_keepalive(30)
            return transport

    def _accept(self, listener: socket.socket, forward: Listening) -> None:
        while not self._closed.is_set():
            try:
                conn, peer = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            if not self._slots.acquire(blocking=False):
                self.on_event(f"{forward}: refused a connection from {peer[0]}: too many open")
                conn.close()
                continue
            threading.Thread(target=self._carry, args=(conn, peer, forward), daemon=True).start()

    def _carry(self, conn: socket.socket, peer: Any, forward: Listening) -> None:
        channel = None
        try:
            try:
                transport = self._transport()
                channel = transport.open_channel(
                    "direct-tcpip",
                    (GUEST_HOST, forward.remote),
                    (peer[0], peer[1]),
                    timeout=OPEN_TIMEOUT_S,
                )
            except Exception as exc:  # the guest refused, or the connection is gone
                self.on_event(
                    f"{forward}: connection from {peer[0]}:{peer[1]} not carried: "
                    f"{_why(exc, forward.remote)}"
                )
                return
            _pump(conn, channel, self._closed)
        finally:
            if channel is not None:
                channel.close()
            conn.close()
            self._slots.release()

    def close(self) -> None:
        self._closed.set()
        for listener in self._sockets:
            listener.close()
        for thread in self._threads:
            thread.join(timeout=2 * _ACCEPT_POLL_S)
        with self._client_lock:
            if self._client is not None:
                self._client.close()  # ends every channel, and so every carrying thread
                self._client = None

    def __enter__(self) -> Forwarder:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def _why(exc: Exception, remote: int) -> str:
    import paramiko

    if isinstance(exc, paramiko.ChannelException):
        return f"the guest refused it: nothing listens on guest port {remote} ({exc.text})"
    return f"{type(exc).__name__}: {exc}"


def _pump(conn: socket.socket, channel: paramiko.Channel, closed: threading.Event) -> None:
    """Copy both ways until either side ends (a half-close is passed on) or ``closed``."""
    ends: dict[Any, bool] = {conn: False, channel: False}
    while not closed.is_set() and not all(ends.values()):
        readable, _, _ = select.select([s for s, done in ends.items() if not done], [], [], 1.0)
        for source in readable:
            data = source.recv(_CHUNK)
            sink: Any = channel if source is conn else conn
            if not data:
                ends[source] = True
                with contextlib.suppress(OSError):
                    if sink is channel:
                        channel.shutdown_write()
                    else:
                        conn.shutdown(socket.SHUT_WR)
                continue
            sink.sendall(data)
        if channel.closed:
            return
