"""Relay one guest connection to a TCP port on the host's loopback: QEMU's user-mode network
runs this (``guestfwd=tcp:ADDR:PORT-cmd:python3 relay.py HOST PORT``) once per connection the
guest opens to ADDR:PORT, with that connection as stdin and stdout.

It is how a guest under ``restrict=on`` (no other traffic leaves it) reaches one service on the
host, such as an OpenShell gateway on 127.0.0.1: explicit forwards are exempt from ``restrict``.
Standard library only: the hypervisor's user runs it with the system Python.
"""

from __future__ import annotations

import os
import socket
import sys
import threading

_CHUNK = 65536


def _pump_in(sock: socket.socket) -> None:
    """Guest to host: stdin into the socket, then end the socket's sending side."""
    while data := os.read(0, _CHUNK):
        sock.sendall(data)
    sock.shutdown(socket.SHUT_WR)


def main(argv: list[str]) -> int:
    host, port = argv[1], int(argv[2])
    try:
        sock = socket.create_connection((host, port))
    except OSError as exc:
        print(f"relay: cannot reach {host}:{port}: {exc}", file=sys.stderr)
        return 1
    threading.Thread(target=_pump_in, args=(sock,), daemon=True).start()
    while data := sock.recv(_CHUNK):
        os.write(1, data)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
