"""The workload launches of the driver's sandboxes: the launch credentials each one waits for,
why its last launch failed, and the launch itself (``launch``, run over SSH).

Launch credentials wait in this process's memory until the guest is ready, never on disk; a
``vmsandbox serve`` restarted meanwhile has lost them and the gateway's next start brings fresh
ones. A failed launch is kept, for the sandbox's snapshots (its Ready condition), until the
next start or a launch that succeeds.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from vmsandbox.errors import VmSandboxError
from vmsandbox.guest import ssh
from vmsandbox.openshell.launch import LaunchCredentials, Workload, launch
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.sandbox.record import DOMAIN_PREFIX

log = logging.getLogger(__name__)
_LAUNCH_TIMEOUT = 120.0  # seconds for the launch script in the guest


class Launches:
    """Per domain: the credentials not yet in the guest and the last launch failure.

    ``manager`` makes a SandboxManager; ``changed(name)`` tells the watchers that a sandbox's
    snapshot changed (``events.EventSource.changed``).
    """

    def __init__(
        self, manager: Callable[[], SandboxManager], changed: Callable[[str], None]
    ) -> None:
        self._manager = manager
        self._changed = changed
        self._lock = threading.Lock()
        self._pending: dict[str, LaunchCredentials] = {}
        self._failures: dict[str, str] = {}

    def hold(self, domain: str, credentials: LaunchCredentials | None) -> None:
        """Keep ``credentials`` (when given) for the next launch of ``domain``."""
        with self._lock:
            if credentials is not None:
                self._pending[domain] = credentials

    def restart(self, domain: str, credentials: LaunchCredentials | None) -> None:
        """A new start of ``domain``: its credentials held (when given), its last failure gone."""
        with self._lock:
            if credentials is not None:
                self._pending[domain] = credentials
            self._failures.pop(domain, None)

    def drop(self, domain: str) -> None:
        """Forget the credentials held for ``domain`` (its start failed)."""
        with self._lock:
            self._pending.pop(domain, None)

    def forget(self, domain: str) -> None:
        """Forget everything about ``domain`` (it was deleted)."""
        with self._lock:
            self._pending.pop(domain, None)
            self._failures.pop(domain, None)

    def failure(self, domain: str) -> str | None:
        """Why the last launch of ``domain`` failed ("CODE: message"); None when it did not."""
        with self._lock:
            return self._failures.get(domain)

    def launch(self, name: str) -> None:
        """Launch the workload of a ready sandbox of ours (``launch``) with the credentials
        waiting for it; a failure is kept for its snapshots, and raised."""
        with self._manager() as manager:
            sandbox = manager.get(name)
            workload = Workload.of(sandbox.labels)
            if workload is None or sandbox.ssh is None:
                return
            endpoint, keys = sandbox.ssh, manager.keys_of(sandbox)
        with self._lock:
            credentials = self._pending.pop(sandbox.domain, None)

        def run(command: str, stdin: bytes | None) -> ssh.ExecResult:
            return ssh.run(endpoint, keys, command, stdin=stdin, timeout=_LAUNCH_TIMEOUT)

        try:
            resolved = launch(run, workload, credentials)
        except VmSandboxError as exc:
            with self._lock:
                self._failures[sandbox.domain] = f"{exc.code}: {exc.message}"
            self._changed(sandbox.domain.removeprefix(DOMAIN_PREFIX))
            raise
        with self._lock:
            self._failures.pop(sandbox.domain, None)
        log.info("sandbox %s launched as uid %d gid %d", name, resolved.uid, resolved.gid)
        self._changed(sandbox.domain.removeprefix(DOMAIN_PREFIX))
