"""Guests never reach the host's loopback (vm/netguard.py): a guest with outbound network tries
10.0.2.2, its host's 127.0.0.1 service, and is refused."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from dataclasses import replace

from vmsandbox.config import Config
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.sandbox.spec import SandboxSpec, generate_name


@contextlib.contextmanager
def listener() -> Iterator[tuple[int, list[bytes]]]:
    """A TCP service on the host's 127.0.0.1 that records what reaches it."""
    server = socket.create_server(("127.0.0.1", 0))
    received: list[bytes] = []

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = server.accept()
                with conn:
                    received.append(conn.recv(100) or b"(connected)")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1], received
    finally:
        with contextlib.suppress(OSError):
            server.shutdown(socket.SHUT_RDWR)
        server.close()
        thread.join(5)


def test_a_guest_with_outbound_network_cannot_reach_the_hosts_loopback(config: Config) -> None:
    """slirp maps 10.0.2.2 to the host's 127.0.0.1; the rule rejects the guest's connection
    there (it used to reach Fabric Manager's command port, the gateway, other sandboxes' SSH
    forwards). The guest's own SSH forward still works (this test runs over it)."""
    outbound = replace(config, guest_outbound=True)
    name = generate_name("t")
    with listener() as (port, received), SandboxManager(outbound, reconcile=False) as manager:
        try:
            manager.create(SandboxSpec(name=name, memory_mib=512), verify=False)
            probe = f"echo from-the-guest > /dev/tcp/10.0.2.2/{port}"
            done = manager.exec(name, ["timeout", "20", "bash", "-c", probe], timeout=120)
            assert done.exit_status != 0, done.stdout + done.stderr
            assert received == []
        finally:
            with contextlib.suppress(Exception):
                manager.destroy(name)
