"""Sandboxes as OpenShell snapshots: each state's conditions, read through the gateway's phase
derivation (ported in openshell_client), and the main process read from ``systemctl show``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from framework.openshell_client import phase

from vmsandbox.openshell.launch import key_values
from vmsandbox.openshell.status import GuestState, MainProcess, main_process, snapshot
from vmsandbox.sandbox.handle import Sandbox


def _sandbox(state: str, **extra: Any) -> Sandbox:
    return Sandbox(
        name="job-1",
        domain="vmsbx-job-1",
        state=state,
        image="minimal",
        cpus=1,
        memory_mib=1024,
        disk_gib=4,
        virt_type="qemu",
        ssh=None,
        key_file=Path("/k"),
        known_hosts=Path("/h"),
        host_key_alias="vmsbx-job-1",
        created_at="",
        labels={"openshell.sandbox-id": "gw-1", "openshell.namespace": "ns"},
        **extra,
    )


@pytest.mark.parametrize(
    ("state", "extra", "expected"),
    [
        ("creating", {}, "Provisioning"),
        ("defined", {}, "Provisioning"),
        ("starting", {}, "Provisioning"),
        ("ready", {}, "Ready"),
        ("ready", {"verification": {"ok": True, "problems": []}}, "Ready"),
        ("ready", {"verification": {"ok": False, "problems": ["GPU 0 missing"]}}, "Error"),
        ("failed", {"failure": {"code": "DEADLINE_EXCEEDED", "message": "no SSH"}}, "Error"),
        ("stopped", {}, "Stopped"),
    ],
)
def test_each_state_derives_the_phase_the_gateway_expects(
    state: str, extra: dict[str, Any], expected: str
):
    snap = snapshot(_sandbox(state, **extra))
    assert (snap.id, snap.name, snap.status.name, snap.namespace, snap.status.instance_id) == (
        "gw-1",
        "job-1",
        "job-1",
        "ns",
        "vmsbx-job-1",
    )
    assert phase(snap) == expected


def test_failure_and_verification_messages_reach_the_condition():
    failed = snapshot(_sandbox("failed", failure={"code": "DEADLINE_EXCEEDED", "message": "x"}))
    (ready,) = failed.status.conditions
    assert (ready.reason, ready.message) == ("BootFailed", "DEADLINE_EXCEEDED: x")
    bad = snapshot(_sandbox("ready", verification={"ok": False, "problems": ["GPU 0 missing"]}))
    assert (bad.status.conditions[0].reason, bad.status.conditions[0].message) == (
        "VerificationFailed",
        "GPU 0 missing",
    )


def _shown(text: str) -> MainProcess | None:
    return main_process(key_values(text))


def test_main_process_from_systemctl_show():
    assert _shown("LoadState=not-found\nActiveState=inactive\nExecMainStatus=0\n") is None
    assert _shown("LoadState=loaded\nActiveState=active\nExecMainStatus=0\n") == MainProcess(
        running=True
    )
    assert _shown("LoadState=loaded\nActiveState=failed\nExecMainStatus=3\n") == MainProcess(
        running=False, exit_status=3
    )
    exited = snapshot(_sandbox("ready"), GuestState(MainProcess(running=False, exit_status=3)))
    main = exited.status.conditions[1]
    assert (main.type, main.status, main.reason, main.message) == (
        "MainProcess",
        "False",
        "Exited",
        "the main process exited (3)",
    )
    assert phase(exited) == "Ready"


def test_a_sandbox_failed_by_a_quarantined_gpu_says_so():
    failure = {
        "code": "UNAVAILABLE",
        "message": "GPU 0000:02:00.0 is suspect: AER: fatal error at its port 0000:00:06.0",
        "reason": "GpuQuarantined",
    }
    snap = snapshot(_sandbox("failed", failure=failure))
    (ready,) = snap.status.conditions
    assert (ready.reason, ready.status) == ("GpuQuarantined", "False")
    assert "AER: fatal error" in ready.message
    assert phase(snap) == "Error"
