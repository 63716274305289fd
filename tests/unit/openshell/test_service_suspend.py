"""The OpenShell driver with ``openshell_stop_suspends``: StopSandbox suspends the sandbox (its
memory saved, shown Suspended), StartSandbox resumes it; without the setting StopSandbox powers
off as before. Served in this process on the fake hypervisor, driven by a client built from the
upstream descriptors; a guest whose sshd answers at once and that runs every command."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import grpc
import pytest
from framework.fake_hypervisor import FakeHypervisor
from framework.openshell_client import UpstreamClient, in_process

from vmsandbox.config import Config
from vmsandbox.guest.ssh import ExecResult
from vmsandbox.sandbox import boot
from vmsandbox.sandbox.manager import SandboxManager


@pytest.fixture
def guest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(boot, "wait_ready", lambda *_a, **_k: 0.25)
    run = staticmethod(lambda *_a, **_k: ExecResult(0, "", ""))
    monkeypatch.setattr(SandboxManager, "guest_run", run)


def client(config: Config, hv: FakeHypervisor) -> Iterator[UpstreamClient]:
    with in_process(config, hv) as path, grpc.insecure_channel(f"unix:{path}") as channel:
        yield UpstreamClient(channel)


def created(upstream: UpstreamClient, name: str) -> None:
    sandbox = upstream.message(
        "DriverSandbox",
        id=f"gw-{name}",
        name=name,
        spec=upstream.message(
            "DriverSandboxSpec", template=upstream.message("DriverSandboxTemplate", image="tiny")
        ),
    )
    upstream.call("CreateSandbox", upstream.message("CreateSandboxRequest", sandbox=sandbox))


def conditions(upstream: UpstreamClient, name: str) -> dict[str, str]:
    got = upstream.call("GetSandbox", upstream.message("GetSandboxRequest", name=name))
    return {c.type: c.reason for c in got.sandbox.status.conditions}


def test_stop_suspends_and_start_resumes_with_the_setting(
    config: Config, hv: FakeHypervisor, guest: None
) -> None:
    for upstream in client(replace(config, openshell_stop_suspends=True), hv):
        created(upstream, "s-1")
        upstream.call("StopSandbox", upstream.message("StopSandboxRequest", name="s-1"))
        dom = hv.domains["vmsbx-s-1"]
        assert not dom.running and dom.saved and dom.state == "suspended"
        assert conditions(upstream, "s-1") == {"Suspended": "Suspended", "Ready": "Suspended"}
        upstream.call("StartSandbox", upstream.message("StartSandboxRequest", name="s-1"))
        assert dom.running and dom.saved is None and dom.state == "ready"


def test_stop_powers_off_without_the_setting(
    config: Config, hv: FakeHypervisor, guest: None
) -> None:
    for upstream in client(config, hv):
        created(upstream, "s-2")
        upstream.call("StopSandbox", upstream.message("StopSandboxRequest", name="s-2"))
        dom = hv.domains["vmsbx-s-2"]
        assert not dom.running and dom.saved is None
        assert conditions(upstream, "s-2")["Suspended"] == "Stopped"
