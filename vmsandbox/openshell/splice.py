"""Two-way byte copy between two open connections, for the socket's peer gate and the tunnel.

Either end may be a socket or a paramiko SSH channel: both have ``recv``, ``sendall`` and
``close``; they differ only in how the sending side is ended.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Any, Protocol

_CHUNK = 65536


class Stream(Protocol):
    """What splice needs of a connection (``socket.socket`` and ``paramiko.Channel`` have it)."""

    def recv(self, size: int, /) -> bytes: ...

    def sendall(self, data: bytes, /) -> Any: ...

    def close(self) -> None: ...


def splice(one: Stream, other: Stream) -> None:
    """Copy both ways until each side has ended its sending, then close both."""
    back = threading.Thread(target=_pump, args=(other, one), daemon=True)
    back.start()
    _pump(one, other)
    back.join()
    one.close()
    other.close()


def _pump(source: Stream, sink: Stream) -> None:
    """Copy until ``source`` ends, then end ``sink``'s sending side."""
    with contextlib.suppress(OSError):  # a reset ends the copy like an orderly close
        while data := source.recv(_CHUNK):
            sink.sendall(data)
    with contextlib.suppress(OSError, EOFError):
        if isinstance(sink, socket.socket):
            sink.shutdown(socket.SHUT_WR)
        else:
            sink.shutdown_write()  # type: ignore[attr-defined]  # paramiko.Channel
