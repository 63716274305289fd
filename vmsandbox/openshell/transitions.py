"""When each condition of a sandbox last changed: ``DriverCondition.transition_time`` (a
google.protobuf.Timestamp, in whole seconds).

vmsandbox's record keeps no time per state change, so the driver stamps a condition when it
first reports it with a given status and reason and keeps that stamp while both stay the same,
as a Kubernetes controller does. Every libvirt event of a sandbox is reported at once on the
watch stream, so the stamp is the change's time give or take the snapshot's own delay. After a
restart of ``vmsandbox serve`` each condition's first report is stamped anew.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from vmsandbox.openshell.proto import compute_driver_pb2 as pb


class Transitions:
    """Condition stamps of every sandbox this driver reported, by libvirt domain."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        # (domain, condition type) -> ((status, reason), seconds since the epoch)
        self._seen: dict[tuple[str, str], tuple[tuple[str, str], int]] = {}

    def stamp(self, sandbox: pb.DriverSandbox) -> pb.DriverSandbox:
        """``sandbox`` with the transition time set on each of its conditions."""
        domain = sandbox.status.instance_id
        now = int(self._clock())
        with self._lock:
            for condition in sandbox.status.conditions:
                key = (domain, condition.type)
                now_is = (condition.status, condition.reason)
                seen = self._seen.get(key)
                if seen is None or seen[0] != now_is:
                    seen = (now_is, now)
                    self._seen[key] = seen
                condition.transition_time.seconds = seen[1]
                condition.transition_time.nanos = 0
        return sandbox

    def forget(self, domain: str) -> None:
        """Drop the stamps of a domain that is gone."""
        with self._lock:
            for key in [key for key in self._seen if key[0] == domain]:
                del self._seen[key]
