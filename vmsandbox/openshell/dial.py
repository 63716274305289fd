"""Dialling a driver's socket as its client, only to a server we trust.

A client that connects by path trusts whoever listens there: during a driver's restart, any
local user who can write to the socket's folder (a /tmp socket) may bind it and receive every
call, sandbox tokens and launch credentials among them. gRPC connects (and reconnects) by
itself and tells nothing of its peer, so ``checked_channel`` puts a relay of our own between
them: gRPC dials a socket in a private 0700 folder, and for each connection the relay dials the
driver's socket, reads the server's uid from the kernel (SO_PEERCRED: the uid of the process
that listens) and relays only when it is trusted, root or our own uid by default. Nothing is
sent to a server before its uid is checked, on every connection gRPC makes. A refused server
is named in ``Checked.refused`` (until a trusted one answers again); a call through it fails
as UNAVAILABLE.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import tempfile
import threading
from collections.abc import Iterable
from pathlib import Path

import grpc

from vmsandbox.errors import FailedPrecondition
from vmsandbox.openshell.socket import peer_uid
from vmsandbox.openshell.splice import splice

log = logging.getLogger(__name__)
# The channel tries again soon after the driver went away (a restart): gRPC's own backoff
# grows to two minutes, during which every call fails at once.
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
)


class Checked:
    """A gRPC channel to the driver at ``path`` whose server must run as one of ``trusted``
    (default: root and our own uid); ``close`` ends the channel and the relay."""

    def __init__(self, path: str | os.PathLike[str], trusted: Iterable[int] = ()) -> None:
        self.path = str(path)
        self.trusted = frozenset(trusted) or frozenset({0, os.geteuid()})
        self.refused: str | None = None
        self._folder = Path(tempfile.mkdtemp(prefix="vmsandbox-dial-"))  # 0700, ours alone
        relay = self._folder / "relay.sock"
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(relay))
        self._listener.listen(16)
        threading.Thread(target=self._accept, name="dial-relay", daemon=True).start()
        self.target = f"unix:{relay}"  # what a channel of one's own dials (every one is checked)
        self.channel = grpc.insecure_channel(self.target, options=CHANNEL_OPTIONS)

    def check(self) -> None:
        """FAILED_PRECONDITION when a server was refused (call it on a failed call)."""
        if self.refused is not None:
            raise FailedPrecondition(self.refused, details={"socket": self.path})

    def close(self) -> None:
        self.channel.close()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        shutil.rmtree(self._folder, ignore_errors=True)

    def __enter__(self) -> Checked:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _addr = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            server.connect(self.path)
            uid = peer_uid(server)
        except OSError:
            client.close()  # nobody listens: gRPC sees UNAVAILABLE, as without the relay
            server.close()
            return
        if uid not in self.trusted:
            self.refused = (
                f"the server on {self.path} runs as uid {uid}, not as one trusted to be the "
                f"vmsandbox driver ({', '.join(map(str, sorted(self.trusted)))}): nothing was "
                "sent to it; another user may have bound the socket while the driver was down"
            )
            log.error("%s", self.refused)
            client.close()
            server.close()
            return
        self.refused = None  # the driver is back
        splice(client, server)
