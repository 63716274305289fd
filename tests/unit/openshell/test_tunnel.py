"""The gateway tunnels: one SSH remote forward per sandbox, kept by the sandbox's domain UUID,
so a tunnel asked for a sandbox that is gone never reaches a later sandbox of its name. On the
fake hypervisor; the SSH connection is a stand-in."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from framework.fake_hypervisor import FakeHypervisor

from vmsandbox.config import Config
from vmsandbox.openshell import tunnel
from vmsandbox.openshell.tunnel import GatewayTunnels
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.sandbox.spec import SandboxSpec


@pytest.fixture
def manager(config: Config) -> Iterator[SandboxManager]:
    hv = FakeHypervisor()
    with SandboxManager(config, hypervisor=hv, reconcile=False) as mgr:
        yield mgr


def spec(tenant: str) -> SandboxSpec:
    return SandboxSpec(
        name="web", image="tiny", memory_mib=256, disk_gib=1, labels={"tenant": tenant}
    )


def test_a_tunnel_for_a_sandbox_that_is_gone_never_reaches_its_namesake(
    manager: SandboxManager, config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    uuid_a = manager.create(spec("a"), wait=False).uuid
    manager.destroy("web")
    manager.create(spec("b"), wait=False)
    dialled: list[Any] = []

    def connect(endpoint: Any, keys: Any) -> None:
        dialled.append(endpoint)
        raise AssertionError("the tunnel dialled a sandbox")

    monkeypatch.setattr(tunnel, "connect", connect)
    tunnels = GatewayTunnels(lambda: SandboxManager(config, hypervisor=manager.hypervisor), 9)
    before = set(threading.enumerate())
    tunnels.ensure("web", uuid_a)
    for thread in set(threading.enumerate()) - before:
        thread.join(timeout=30)
    assert dialled == []
    tunnels.close()


class Channel:
    """A guest connection that came back over SSH (what paramiko hands the forward)."""

    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_guest_connections_are_bounded_per_sandbox_and_in_all(
    config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each connection a guest opens through its tunnel costs the driver two threads: past
    the limit for its sandbox, or for all sandboxes, a connection is refused (closed at once)
    until others end."""
    monkeypatch.setattr(tunnel, "PER_SANDBOX", 3)
    monkeypatch.setattr(tunnel, "IN_ALL", 5)
    release = threading.Event()
    tunnels = GatewayTunnels(lambda: SandboxManager(config, hypervisor=FakeHypervisor()), 9)
    monkeypatch.setattr(tunnels, "_join", lambda channel: release.wait(30))
    a = [Channel() for _ in range(4)]
    b = [Channel() for _ in range(3)]
    for channel in a:
        tunnels.accept("uuid-a", channel)
    for channel in b:
        tunnels.accept("uuid-b", channel)
    assert [c.closed for c in a] == [False, False, False, True]  # 3 per sandbox
    assert [c.closed for c in b] == [False, False, True]  # 5 in all
    release.set()
    deadline = time.monotonic() + 30
    while tunnels.open_connections() and time.monotonic() < deadline:
        time.sleep(0.05)
    later = Channel()
    tunnels.accept("uuid-a", later)
    assert not later.closed
