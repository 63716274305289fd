"""How a guest's supervisor reaches the gateway on this host's loopback: an SSH remote forward.

libvirt runs QEMU with ``-sandbox ...,spawn=deny`` and the guest's user network with
``restrict=on``, so neither a ``guestfwd=...-cmd:`` relay (QEMU is killed when it spawns it)
nor the 10.0.2.2 host alias (blocked by restrict) can carry the guest's connections. The
driver instead holds one SSH session per running sandbox (the sandbox's own key, pinned host
key) with a remote forward: the guest's sshd listens on its 127.0.0.1:PORT, and each connection
there comes back over SSH to the driver, which opens 127.0.0.1:PORT on the host. Traffic stays
on the loopback of both machines; the forward lives as long as the driver serves.

Each guest connection costs the driver two threads while it lasts, so a guest may hold at
most PER_SANDBOX of them at once and all guests together IN_ALL: past either, a new
connection is refused (closed at once, and logged with the counts) until others end.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from typing import Any, Protocol

import paramiko

from vmsandbox.errors import NotFound, VmSandboxError
from vmsandbox.guest.ssh import connect
from vmsandbox.openshell.splice import splice
from vmsandbox.sandbox.manager import SandboxManager

log = logging.getLogger(__name__)
_RETRY_SECONDS = 2.0
PER_SANDBOX = 64  # guest connections to the gateway one sandbox may hold open at once
IN_ALL = 1024  # and all sandboxes together


class Closable(Protocol):
    def close(self) -> None: ...


class GatewayTunnels:
    """One remote-forward SSH session per sandbox, kept up while the sandbox runs."""

    def __init__(self, managers: Callable[[], SandboxManager], port: int) -> None:
        self._managers = managers
        self.port = port
        self._running: dict[str, threading.Event] = {}
        self._lock = threading.Lock()
        self._open: dict[str, int] = {}  # guest connections open, by sandbox UUID

    def ensure(self, name: str, uuid: str) -> None:
        """Keep a tunnel into sandbox ``name`` of domain UUID ``uuid`` (it ends when that
        sandbox stops or is gone: a later sandbox of the name is never tunnelled into)."""
        with self._lock:
            if uuid in self._running:
                return
            stop = threading.Event()
            self._running[uuid] = stop
        threading.Thread(target=self._hold, args=(name, uuid, stop), daemon=True).start()

    def close(self) -> None:
        with self._lock:
            for stop in self._running.values():
                stop.set()

    def _hold(self, name: str, uuid: str, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                try:
                    with self._managers() as manager:
                        sandbox = manager.get(name, uuid=uuid)
                        if sandbox.state == "stopped" or sandbox.ssh is None:
                            return
                        client = connect(sandbox.ssh, manager.keys_of(sandbox))
                except NotFound:
                    return
                except VmSandboxError as exc:
                    log.info("tunnel into %s: %s; retrying", name, exc.message)
                    stop.wait(_RETRY_SECONDS)
                    continue
                try:
                    self._forward(name, uuid, client, stop)
                except (OSError, EOFError, paramiko.SSHException) as exc:
                    log.info("tunnel into %s broke: %s; retrying", name, exc)
                    stop.wait(_RETRY_SECONDS)
        finally:
            with self._lock:
                self._running.pop(uuid, None)

    def _forward(
        self, name: str, uuid: str, client: paramiko.SSHClient, stop: threading.Event
    ) -> None:
        """Hold the remote forward on ``client`` until its session ends or we stop."""

        def arrived(channel: paramiko.Channel, _origin: object, _server: object) -> None:
            self.accept(uuid, channel)

        with client:
            transport = client.get_transport()
            assert transport is not None
            transport.request_port_forward("127.0.0.1", self.port, handler=arrived)
            log.info("tunnel into %s: guest 127.0.0.1:%d -> gateway", name, self.port)
            while transport.is_active() and not stop.wait(_RETRY_SECONDS):
                pass

    def accept(self, uuid: str, channel: Closable) -> None:
        """A connection from the guest of sandbox ``uuid`` arrived: join it to the gateway (in
        a thread: paramiko calls this from its transport thread, which must not block), or
        refuse it past the limits (module docstring)."""
        with self._lock:
            mine, total = self._open.get(uuid, 0), sum(self._open.values())
            if mine >= PER_SANDBOX or total >= IN_ALL:
                refused = True
            else:
                refused = False
                self._open[uuid] = mine + 1
        if refused:
            log.warning(
                "tunnel of sandbox %s: refused a guest connection to the gateway: %d open for "
                "it (at most %d), %d in all (at most %d)",
                uuid,
                mine,
                PER_SANDBOX,
                total,
                IN_ALL,
            )
            channel.close()
            return
        threading.Thread(target=self._counted, args=(uuid, channel), daemon=True).start()

    def open_connections(self) -> int:
        """Guest connections joined to the gateway now, all sandboxes together."""
        with self._lock:
            return sum(self._open.values())

    def _counted(self, uuid: str, channel: Any) -> None:
        try:
            self._join(channel)
        finally:
            with self._lock:
                left = self._open.get(uuid, 1) - 1
                if left:
                    self._open[uuid] = left
                else:
                    self._open.pop(uuid, None)

    def _join(self, channel: paramiko.Channel) -> None:
        try:
            gateway = socket.create_connection(("127.0.0.1", self.port))
        except OSError as exc:
            log.warning("the gateway at 127.0.0.1:%d cannot be reached: %s", self.port, exc)
            channel.close()
            return
        splice(channel, gateway)
