"""Waiting for, stopping and starting a sandbox act on the sandbox that was looked up, by its
domain UUID, and commit only while it is still there (compare-and-set under the host lock): a
sandbox deleted while it boots, whose name a later sandbox (another tenant's) took, is never
waited for, written to, powered off or read in its place. On the fake hypervisor."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from framework.fake_hypervisor import FakeHypervisor

from vmsandbox.config import Config
from vmsandbox.errors import NotFound
from vmsandbox.sandbox import boot, power
from vmsandbox.sandbox.holds import Holds
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.sandbox.record import SandboxRecord
from vmsandbox.sandbox.spec import SandboxSpec

DOMAIN = "vmsbx-web"


def spec(tenant: str) -> SandboxSpec:
    return SandboxSpec(
        name="web", image="tiny", memory_mib=256, disk_gib=1, labels={"tenant": tenant}
    )


def replaced(manager: SandboxManager) -> str:
    """Sandbox A "web" deleted, and B "web" (another tenant's) made: B's domain UUID."""
    manager.destroy("web")
    return manager.create(spec("b"), wait=False).uuid


def b_untouched(hv: FakeHypervisor, uuid_b: str) -> None:
    dom = hv.domains[DOMAIN]
    assert dom.uuid == uuid_b and dom.running
    record = SandboxRecord.from_dict(dom.data or {})
    assert record.labels == {"tenant": "b"} and dom.state == "started"


def _ssh_up(during: Callable[[Any], None]) -> Callable[..., float]:
    """``wait_ready`` for a guest whose sshd answers, running ``during(still_running)`` first."""

    def wait_ready(*_args: Any, still_running: Callable[[], bool], **_kwargs: Any) -> float:
        during(still_running)
        return 1.0

    return wait_ready


def test_a_stale_wait_never_writes_its_record_onto_a_later_namesake(
    manager: SandboxManager, hv: FakeHypervisor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A's wait outlives A: B took the name meanwhile. Its commit (the record it read at the
    start: id, credential, labels, port) must not land on B's domain."""
    manager.create(spec("a"), wait=False)
    taken: list[str] = []
    monkeypatch.setattr(boot, "wait_ready", _ssh_up(lambda _check: taken.append(replaced(manager))))
    with pytest.raises(NotFound):
        manager.wait("web", verify=False)
    b_untouched(hv, taken[0])


def test_a_stale_wait_never_takes_a_namesakes_running_guest_for_its_own(
    manager: SandboxManager, hv: FakeHypervisor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The boot watch asks whether *A's* domain runs, not whatever domain has the name, and
    the failure it stores lands nowhere (A is gone)."""
    manager.create(spec("a"), wait=False)
    taken: list[str] = []

    def during(still_running: Callable[[], bool]) -> None:
        taken.append(replaced(manager))
        still_running()  # raises: A's domain is gone

    monkeypatch.setattr(boot, "wait_ready", _ssh_up(during))
    with pytest.raises(NotFound, match="removed while"):
        manager.wait("web", verify=False)
    b_untouched(hv, taken[0])


def test_a_wait_whose_sandbox_is_being_torn_down_does_not_commit(
    manager: SandboxManager, hv: FakeHypervisor, config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its domain is still there, but a destroy has taken its hold over: no "ready" then."""
    uuid_a = manager.create(spec("a"), wait=False).uuid

    def during(_check: Callable[[], bool]) -> None:
        from dataclasses import replace

        from vmsandbox.vm.process import ProcessIdentity

        with manager.locked():
            holds = Holds(config)
            hold = holds.get(uuid_a)
            assert hold is not None
            holds.put(replace(hold, owner=ProcessIdentity.current(), doing="destroy"))

    monkeypatch.setattr(boot, "wait_ready", _ssh_up(during))
    with pytest.raises(NotFound):
        manager.wait("web", verify=False)
    assert hv.domains[DOMAIN].state == "started"


def test_a_wait_commits_onto_the_current_record(
    manager: SandboxManager, hv: FakeHypervisor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What changed in the record while the guest booted (a generation recorded by another
    call) survives the wait's commit: it writes only what it learned."""
    uuid_a = manager.create(spec("a"), wait=False).uuid
    monkeypatch.setattr(
        boot,
        "wait_ready",
        _ssh_up(lambda _check: manager.set_generation("web", "gen-2", uuid=uuid_a)),
    )
    ready = manager.wait("web", verify=False)
    assert (ready.state, ready.generation, ready.uuid) == ("ready", "gen-2", uuid_a)
    assert hv.domains[DOMAIN].state == "ready"


def test_a_stale_stop_never_presses_a_namesakes_power_button(
    manager: SandboxManager, hv: FakeHypervisor
) -> None:
    uuid_a = manager.create(spec("a"), wait=False).uuid
    uuid_b = replaced(manager)
    power.stop(hv, DOMAIN, grace=1.0, uuid=uuid_a)
    b_untouched(hv, uuid_b)
    assert ("shutdown", DOMAIN) not in hv.calls


def test_a_stale_start_never_starts_a_namesake(manager: SandboxManager, hv: FakeHypervisor) -> None:
    """A start looked A up (stopped); B took the name before it pressed start."""
    a = manager.create(spec("a"), wait=False)
    manager.stop("web", grace=1.0)
    found = manager.store.require("web", a.uuid)
    manager.destroy("web")
    uuid_b = manager.create(spec("b"), start=False).uuid
    with pytest.raises(NotFound):
        power.start(hv, manager.config, found, manager.locked)
    dom = hv.domains[DOMAIN]
    assert (dom.uuid, dom.running, dom.state) == (uuid_b, False, "defined")
    assert SandboxRecord.from_dict(dom.data or {}).labels == {"tenant": "b"}


def test_a_view_of_a_stale_sandbox_reads_its_own_domain(
    manager: SandboxManager, hv: FakeHypervisor
) -> None:
    """``store.view`` of A (a record read earlier) does not show B's running guest as A's."""
    a = manager.create(spec("a"), wait=False)
    found = manager.store.require("web", a.uuid)
    replaced(manager)
    assert manager.store.view(found.record, found.state, found.uuid).state == "stopped"
