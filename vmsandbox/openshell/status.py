"""A vmsandbox sandbox as an OpenShell DriverSandbox snapshot: name, labels and the conditions
the gateway derives its phase from.

Conditions (the gateway reads Suspended first, then the first Ready condition):

- stopped (domain not running): Suspended=True, reason Stopped; Ready=False, reason Stopped.
- creating, defined or starting: Ready=False, reason Starting (transient: Provisioning).
- failed (the guest did not come up): Ready=False, reason BootFailed, with vmsandbox's message.
- ready with a failed in-guest GPU verification: Ready=False, reason VerificationFailed.
- ready: Ready=True, reason SandboxReady: SSH answered and the GPUs passed the check.
- with a main command: MainProcess, True while it runs (reason Running), False once it
  exited (reason Exited, the status in the message); given when ``main`` is known, which the
  service reads from the guest (``MAIN_QUERY``) while the sandbox is ready.
"""

from __future__ import annotations

from dataclasses import dataclass

from vmsandbox.guest.setup import MAIN_UNIT
from vmsandbox.openshell.proto import compute_driver_pb2 as pb
from vmsandbox.openshell.request import ID_LABEL, NAMESPACE_LABEL, WORKSPACE_LABEL
from vmsandbox.sandbox.handle import Sandbox
from vmsandbox.sandbox.record import STATE_FAILED, STATE_READY

MAIN_QUERY = f"systemctl show -p LoadState -p ActiveState -p ExecMainStatus {MAIN_UNIT}"


@dataclass(frozen=True)
class MainProcess:
    """What the guest's main-process unit says: running, or exited with a status."""

    running: bool
    exit_status: int | None = None


def main_process(show: str) -> MainProcess | None:
    """The main process as ``MAIN_QUERY``'s output tells it; None when the sandbox has none."""
    fields = dict(line.split("=", 1) for line in show.splitlines() if "=" in line)
    if fields.get("LoadState") != "loaded":
        return None
    if fields.get("ActiveState") in ("active", "activating", "reloading"):
        return MainProcess(running=True)
    status = fields.get("ExecMainStatus", "")
    return MainProcess(running=False, exit_status=int(status) if status.isdigit() else None)


def snapshot(sandbox: Sandbox, main: MainProcess | None = None) -> pb.DriverSandbox:
    """The DriverSandbox the gateway sees for ``sandbox``."""
    labels = sandbox.labels
    return pb.DriverSandbox(
        id=labels.get(ID_LABEL, ""),
        name=sandbox.name,
        namespace=labels.get(NAMESPACE_LABEL, ""),
        workspace=labels.get(WORKSPACE_LABEL, ""),
        status=pb.DriverSandboxStatus(
            sandbox_name=sandbox.name,
            instance_id=sandbox.domain,
            conditions=conditions(sandbox, main),
        ),
    )


def conditions(sandbox: Sandbox, main: MainProcess | None = None) -> list[pb.DriverCondition]:
    """The conditions of ``sandbox`` (see the module docstring)."""
    if sandbox.state == "stopped":
        return [
            _condition("Suspended", True, "Stopped", "the sandbox's VM is shut off; disk kept"),
            _condition("Ready", False, "Stopped", "the sandbox's VM is shut off"),
        ]
    found: list[pb.DriverCondition] = []
    if sandbox.state == STATE_FAILED:
        failure = sandbox.failure or {}
        found.append(
            _condition(
                "Ready",
                False,
                "BootFailed",
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
    else:
        found.append(_condition("Ready", True, "SandboxReady", "SSH answers; GPUs verified"))
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
