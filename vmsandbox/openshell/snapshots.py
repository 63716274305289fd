"""Reading sandboxes' DriverSandbox snapshots (status.py makes them): each ready guest's state,
read over SSH briefly and several at once, the launch failure kept for it (``launch``), and
its conditions stamped with when they last changed (``status.Transitions``).

A guest that does not answer, or drops the session, leaves its guest-state conditions out,
never the snapshot.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

from vmsandbox.errors import VmSandboxError
from vmsandbox.guest.ssh import run as ssh_run
from vmsandbox.openshell.launch import Launches
from vmsandbox.openshell.proto import compute_driver_pb2 as pb
from vmsandbox.openshell.status import GUEST_QUERY, GuestState, Transitions, guest_state, snapshot
from vmsandbox.sandbox.handle import Sandbox
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.sandbox.record import STATE_READY

log = logging.getLogger(__name__)
_GUEST_QUERY_TIMEOUT = 5.0  # seconds for reading a guest's state over SSH
_GUEST_QUERIES = 8  # guest-state queries of one snapshot listing at once


class Snapshots:
    """The snapshots of one driver: ``launches`` says why a launch failed, ``transitions``
    when each condition changed; ``network`` is the host's network mode."""

    def __init__(self, launches: Launches, transitions: Transitions, network: str) -> None:
        self.launches = launches
        self.transitions = transitions
        self.network = network

    def one(self, manager: SandboxManager, sandbox: Sandbox) -> pb.DriverSandbox:
        return self._stamped(sandbox, self._guest_state(manager, sandbox))

    def many(self, manager: SandboxManager, sandboxes: list[Sandbox]) -> list[pb.DriverSandbox]:
        """Snapshots of ``sandboxes``, their guests' states read in parallel."""
        with ThreadPoolExecutor(max_workers=_GUEST_QUERIES) as pool:
            states = list(pool.map(lambda s: self._guest_state(manager, s), sandboxes))
        return [self._stamped(s, state) for s, state in zip(sandboxes, states, strict=True)]

    def _stamped(self, sandbox: Sandbox, guest: GuestState | None) -> pb.DriverSandbox:
        failure = self.launches.failure(sandbox.uuid)
        made = snapshot(sandbox, guest, launch_failure=failure, network=self.network)
        return self.transitions.stamp(made)

    def _guest_state(self, manager: SandboxManager, sandbox: Sandbox) -> GuestState | None:
        """The main process and launched identity of a ready sandbox, read over SSH; None when
        the guest does not answer right now (the conditions then leave them out)."""
        if sandbox.state != STATE_READY or sandbox.ssh is None:
            return None
        try:
            keys = manager.keys_of(sandbox)
            shown = ssh_run(sandbox.ssh, keys, GUEST_QUERY, timeout=_GUEST_QUERY_TIMEOUT)
        except VmSandboxError as exc:
            log.info("guest state of %s: %s: %s", sandbox.name, exc.code, exc.message)
            return None
        if shown.exit_status != 0:  # the query ends in `true`: its session was cut short
            log.info("guest state of %s: the query ended %d", sandbox.name, shown.exit_status)
            return None
        return guest_state(shown.stdout)
