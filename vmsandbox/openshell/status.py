"""A sandbox as an OpenShell DriverSandbox snapshot: name, labels, the conditions the gateway
derives its phase from, the resolved workload identity and the fence evidence.

Conditions (the gateway reads Suspended first, then the first Ready condition):

- stopped (domain not running): Suspended=True, reason Stopped; Ready=False, reason Stopped.
- suspended (its memory saved to disk, no GPU held): the same, reason Suspended.
- creating, defined or starting: Ready=False, reason Starting (transient: Provisioning).
- failed (the guest did not come up): Ready=False, reason BootFailed, with vmsandbox's message;
  failed because the health monitor quarantined one of its GPUs: reason GpuQuarantined, the
  message naming the GPU and why (vmsandbox/sandbox/health.py).
- ready with a failed in-guest GPU verification: Ready=False, reason VerificationFailed.
- ready, but the workload launch failed (``launch``): Ready=False, reason LaunchFailed.
- ready, the guest answering and the workload not launched yet: Ready=False, reason Starting.
- ready: Ready=True, reason SandboxReady: SSH answered, the GPUs passed the check and the
  workload was launched.
- with a main command: MainProcess, True while it runs (reason Running), False once it
  exited (reason Exited, the status in the message); given when the guest state is known,
  which the service reads from the guest (``GUEST_QUERY``) while the sandbox is ready.

``resolved_identity`` is the identity the launch resolved in the guest (uid, gid, sorted
supplementary gids, the source of its selectors, the image's id); ``fence_evidence`` and the
runtime identity are ``identity``'s.

When each condition last changed (``DriverCondition.transition_time``, a
google.protobuf.Timestamp in whole seconds) is ``Transitions``'s: vmsandbox's record keeps no
time per state change, so the driver stamps a condition when it first reports it with a given
status and reason and keeps that stamp while both stay the same, as a Kubernetes controller
does. Every libvirt event of a sandbox is reported at once on the watch stream, so the stamp is
the change's time give or take the snapshot's own delay. After a restart of ``vmsandbox serve``
each condition's first report is stamped anew.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from vmsandbox.openshell.identity import RuntimeIdentity
from vmsandbox.openshell.launch import (
    IDENTITY_PATH,
    OPENSHELL_MAIN_UNIT,
    SOURCE_LABEL,
    Resolved,
    Workload,
    key_values,
    read_identity,
)
from vmsandbox.openshell.proto import compute_driver_pb2 as pb
from vmsandbox.openshell.request import ID_LABEL, IMAGE_ID_LABEL, NAMESPACE_LABEL, WORKSPACE_LABEL
from vmsandbox.sandbox.handle import Sandbox
from vmsandbox.sandbox.record import STATE_FAILED, STATE_READY, STATE_SUSPENDED

GUEST_QUERY = (
    f"systemctl show -p LoadState -p ActiveState -p ExecMainStatus {OPENSHELL_MAIN_UNIT}; "
    f"cat {IDENTITY_PATH} 2>/dev/null; true"
)


@dataclass(frozen=True)
class MainProcess:
    """What the guest's main-process unit says: running, or exited with a status."""

    running: bool
    exit_status: int | None = None


@dataclass(frozen=True)
class GuestState:
    """What GUEST_QUERY found: the main process (None: the sandbox has none) and the
    identity the launch resolved (None: not launched yet this boot)."""

    main: MainProcess | None = None
    identity: Resolved | None = None


def guest_state(shown: str) -> GuestState:
    """The guest's state as GUEST_QUERY's output tells it."""
    fields = key_values(shown)
    return GuestState(main_process(fields), read_identity(fields))


def main_process(fields: dict[str, str]) -> MainProcess | None:
    """The main process from ``systemctl show`` fields; None when the sandbox has none."""
    if fields.get("LoadState") != "loaded":
        return None
    if fields.get("ActiveState") in ("active", "activating", "reloading"):
        return MainProcess(running=True)
    status = fields.get("ExecMainStatus", "")
    return MainProcess(running=False, exit_status=int(status) if status.isdigit() else None)


def snapshot(
    sandbox: Sandbox,
    guest: GuestState | None = None,
    *,
    launch_failure: str | None = None,
    network: str = "user",
) -> pb.DriverSandbox:
    """The DriverSandbox the gateway sees for ``sandbox``; ``guest`` is None when the guest was
    not asked (or did not answer), ``launch_failure`` the reason its launch failed."""
    labels = sandbox.labels
    identity = RuntimeIdentity.of(sandbox)
    status = pb.DriverSandboxStatus(
        name=sandbox.name,
        instance_id=sandbox.domain,
        conditions=conditions(sandbox, guest, launch_failure),
        fence_evidence=identity.fence_evidence(sandbox, network),
    )
    if guest is not None and guest.identity is not None:
        status.resolved_identity.CopyFrom(
            pb.ResolvedWorkloadIdentity(
                uid=guest.identity.uid,
                gid=guest.identity.gid,
                supplementary_gids=list(guest.identity.supplementary),
                source=labels.get(SOURCE_LABEL, "image"),
                resource_digest=labels.get(IMAGE_ID_LABEL, sandbox.image),
            )
        )
    return pb.DriverSandbox(
        id=labels.get(ID_LABEL, ""),
        name=sandbox.name,
        namespace=labels.get(NAMESPACE_LABEL, ""),
        workspace=labels.get(WORKSPACE_LABEL, ""),
        status=status,
    )


def conditions(
    sandbox: Sandbox, guest: GuestState | None = None, launch_failure: str | None = None
) -> list[pb.DriverCondition]:
    """The conditions of ``sandbox`` (see the module docstring)."""
    if sandbox.state == STATE_SUSPENDED:
        return [
            _condition("Suspended", True, "Suspended", "the VM's memory is saved; GPUs given back"),
            _condition("Ready", False, "Suspended", "the sandbox is suspended"),
        ]
    if sandbox.state == "stopped":
        return [
            _condition("Suspended", True, "Stopped", "the sandbox's VM is shut off; disk kept"),
            _condition("Ready", False, "Stopped", "the sandbox's VM is shut off"),
        ]
    found: list[pb.DriverCondition] = []
    launched = Workload.of(sandbox.labels) is None or guest is None or guest.identity is not None
    if sandbox.state == STATE_FAILED:
        failure = sandbox.failure or {}
        found.append(
            _condition(
                "Ready",
                False,
                str(failure.get("reason", "BootFailed")),
                f"{failure.get('code', 'INTERNAL')}: {failure.get('message', 'the guest failed')}",
            )
        )
    elif sandbox.state != STATE_READY:
        found.append(_condition("Ready", False, "Starting", "the VM is booting"))
    elif sandbox.verification is not None and not sandbox.verification.get("ok"):
        problems = "; ".join(str(p) for p in sandbox.verification.get("problems", [])[:3])
        found.append(
            _condition("Ready", False, "VerificationFailed", problems or "GPU check failed")
        )
    elif launch_failure is not None:
        found.append(_condition("Ready", False, "LaunchFailed", launch_failure))
    elif not launched:
        found.append(_condition("Ready", False, "Starting", "launching the workload"))
    else:
        found.append(_condition("Ready", True, "SandboxReady", "SSH answers; GPUs verified"))
    main = guest.main if guest is not None else None
    if main is not None:
        if main.running:
            found.append(_condition("MainProcess", True, "Running", "the main process runs"))
        else:
            found.append(
                _condition(
                    "MainProcess", False, "Exited", f"the main process exited ({main.exit_status})"
                )
            )
    return found


def _condition(kind: str, status: bool, reason: str, message: str) -> pb.DriverCondition:
    return pb.DriverCondition(
        type=kind, status="True" if status else "False", reason=reason, message=message
    )


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
