"""The driver's background work: a sandbox becoming ready (SSH, the GPU check, the workload's
launch, the supervisor's tunnel) and the reconcile behind a failed create.

Each runs in a thread of its own that never dies on an error: the outcome reaches the gateway
through the sandbox's record (failed, with the reason) or its snapshots, and the thread logs it.
A sandbox is named by its domain UUID as well as its name, so a later sandbox that took the
name is never waited for or launched in its place.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from vmsandbox.errors import VmSandboxError
from vmsandbox.openshell.launch import Launches
from vmsandbox.openshell.tunnel import GatewayTunnels
from vmsandbox.sandbox.manager import SandboxManager

log = logging.getLogger(__name__)


class Readiness:
    """Starts the background threads; ``manager`` makes the SandboxManager each one uses."""

    def __init__(
        self,
        manager: Callable[[], SandboxManager],
        launches: Launches,
        tunnels: GatewayTunnels | None,
    ) -> None:
        self._manager = manager
        self.launches = launches
        self.tunnels = tunnels

    def become_ready(self, name: str, uuid: str, *, wait: bool = True) -> None:
        """For the sandbox of domain UUID ``uuid`` only: wait for SSH and the GPU check
        (``wait``), then launch the workload and open the tunnel. The outcome lands in the
        domain's record, which libvirt announces to the watchers, or, for the launch, in the
        snapshots (``Launches`` tells the watchers)."""

        def run() -> None:
            try:
                if wait:
                    with self._manager() as manager:
                        manager.wait(name, uuid=uuid)  # that sandbox, by its UUID, throughout
                    log.info("sandbox %s is ready", name)
                self.launches.launch(name, uuid)
                if self.tunnels is not None:
                    self.tunnels.ensure(name, uuid)
            except VmSandboxError as exc:
                log.warning("sandbox %s did not become ready: %s: %s", name, exc.code, exc.message)
            except Exception:  # a thread that dies silently would leave it "starting"
                log.exception("sandbox %s: waiting for it failed", name)

        threading.Thread(target=run, name=f"ready-{name}", daemon=True).start()

    def reconcile_behind(self) -> None:
        """Reconcile, for what a failed call's cleanup could not remove."""

        def run() -> None:
            try:
                with self._manager() as manager:
                    report = manager.reconcile()
                if report["removed"] or report["problems"]:
                    log.info("reconcile: %s", report)
            except VmSandboxError as exc:
                log.warning("reconcile: %s: %s", exc.code, exc.message)

        threading.Thread(target=run, name="reconcile", daemon=True).start()
