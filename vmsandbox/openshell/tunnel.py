"""How a guest's supervisor reaches the gateway on this host's loopback: an SSH remote forward.

libvirt runs QEMU with ``-sandbox ...,spawn=deny`` and the guest's user network with
``restrict=on``, so neither a ``guestfwd=...-cmd:`` relay (QEMU is killed when it spawns it)
nor the 10.0.2.2 host alias (blocked by restrict) can carry the guest's connections. The
driver instead holds one SSH session per running sandbox (the sandbox's own key, pinned host
key) with a remote forward: the guest's sshd listens on its 127.0.0.1:PORT, and each connection
there comes back over SSH to the driver, which opens 127.0.0.1:PORT on the host. Traffic stays
on the loopback of both machines; the forward lives as long as the driver serves.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable

import paramiko

from vmsandbox.errors import NotFound, VmSandboxError
from vmsandbox.guest.ssh import connect
from vmsandbox.openshell.splice import splice
from vmsandbox.sandbox.manager import SandboxManager

log = logging.getLogger(__name__)
_RETRY_SECONDS = 2.0


class GatewayTunnels:
    """One remote-forward SSH session per sandbox, kept up while the sandbox runs."""

    def __init__(self, managers: Callable[[], SandboxManager], port: int) -> None:
        self._managers = managers
        self.port = port
        self._running: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

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
                    self._forward(name, client, stop)
                except (OSError, EOFError, paramiko.SSHException) as exc:
                    log.info("tunnel into %s broke: %s; retrying", name, exc)
                    stop.wait(_RETRY_SECONDS)
        finally:
            with self._lock:
                self._running.pop(uuid, None)

    def _forward(self, name: str, client: paramiko.SSHClient, stop: threading.Event) -> None:
        """Hold the remote forward on ``client`` until its session ends or we stop."""
        with client:
            transport = client.get_transport()
            assert transport is not None
            transport.request_port_forward("127.0.0.1", self.port, handler=self._accept)
            log.info("tunnel into %s: guest 127.0.0.1:%d -> gateway", name, self.port)
            while transport.is_active() and not stop.wait(_RETRY_SECONDS):
                pass

    def _accept(self, channel: paramiko.Channel, _origin: object, _server: object) -> None:
        """A guest connection arrived: join it to the gateway (in a thread: paramiko calls this
        from its transport thread, which must not block)."""
        threading.Thread(target=self._join, args=(channel,), daemon=True).start()

    def _join(self, channel: paramiko.Channel) -> None:
        try:
            gateway = socket.create_connection(("127.0.0.1", self.port))
        except OSError as exc:
            log.warning("the gateway at 127.0.0.1:%d cannot be reached: %s", self.port, exc)
            channel.close()
            return
        splice(channel, gateway)
