"""Suspend and resume of a sandbox without GPUs (sandbox/suspend.py, resume.py) against the
in-memory hypervisor (tests/framework/fake_hypervisor.py), which keeps libvirt's rules of managed
save: the states shown, the save file's accounting against ``max_saved_gib``, destroy removing
the save, and a suspend or resume killed halfway settled by reconcile, never taken apart.
A guest whose sshd answers at once and that runs every command (the clock set over SSH)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from framework.fake_hypervisor import FakeHypervisor, refuse

from vmsandbox.config import Config
from vmsandbox.errors import FailedPrecondition, NotFound, ResourceExhausted
from vmsandbox.guest.ssh import ExecResult
from vmsandbox.sandbox import boot, resume, suspend
from vmsandbox.sandbox.holds import Holds
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.sandbox.record import SandboxFiles, SandboxRecord
from vmsandbox.sandbox.spec import SandboxSpec
from vmsandbox.vm.domain import CONTROL_PORT
from vmsandbox.vm.process import ProcessIdentity

DOMAIN = "vmsbx-box"
DEAD = ProcessIdentity(pid=1, start="0", boot="another boot")


@pytest.fixture
def commands() -> list[str]:
    return []


@pytest.fixture
def manager(
    config: Config, hv: FakeHypervisor, commands: list[str], monkeypatch: pytest.MonkeyPatch
) -> Iterator[SandboxManager]:
    monkeypatch.setattr(boot, "wait_ready", lambda *_a, **_k: 0.25)

    def guest_run(_endpoint: Any, _keys: Any, command: str, **_kwargs: Any) -> ExecResult:
        commands.append(command)
        return ExecResult(0, "", "")

    with SandboxManager(config, hypervisor=hv, reconcile=False) as mgr:
        mgr.guest_run = guest_run  # type: ignore[method-assign]
        yield mgr


def made(manager: SandboxManager, name: str = "box", memory_mib: int = 256) -> str:
    spec = SandboxSpec(name=name, image="tiny", memory_mib=memory_mib, disk_gib=1)
    return manager.create(spec, wait=False).uuid


def record(hv: FakeHypervisor, domain: str = DOMAIN) -> SandboxRecord:
    return SandboxRecord.from_dict(hv.domains[domain].data or {})


def test_a_suspended_sandbox_is_saved_not_running_and_shown_suspended(
    manager: SandboxManager, hv: FakeHypervisor, config: Config
) -> None:
    uuid = made(manager)
    sandbox = manager.suspend("box")
    dom = hv.domains[DOMAIN]
    assert sandbox.state == "suspended" and not dom.running
    assert dom.saved == 256 * 2**20 // FakeHypervisor.SAVE_FRACTION
    assert sandbox.saved_bytes == dom.saved and sandbox.to_dict()["saved_bytes"] == dom.saved
    assert [s.state for s in manager.list()] == ["suspended"]
    hold = Holds(config).all()[uuid]
    assert hold.owner is None and hold.saved_bytes == dom.saved
    assert record(hv).suspended is not None


def test_using_a_suspended_sandbox_says_how_to_resume_it(manager: SandboxManager) -> None:
    """exec, cp, forward and ssh of a suspended sandbox used to try its closed SSH port:
    UNAVAILABLE ("Unable to connect"), and cp an internal error."""
    made(manager)
    manager.suspend("box")
    for call in (
        lambda: manager.exec("box", ["true"]),
        lambda: manager.upload("box", b"data", "/tmp/data"),
        lambda: manager.ssh_argv("box"),
        lambda: manager.verify("box"),
    ):
        with pytest.raises(FailedPrecondition, match="resume it with 'vmsandbox resume box'") as e:
            call()
        assert e.value.details == {"name": "box", "state": "suspended"}


def test_suspend_is_idempotent(manager: SandboxManager, hv: FakeHypervisor) -> None:
    made(manager)
    manager.suspend("box")
    assert manager.suspend("box").state == "suspended"
    assert hv.calls.count(("save", DOMAIN)) == 1


def test_resume_restores_sets_the_clock_and_is_ready(
    manager: SandboxManager, hv: FakeHypervisor, config: Config, commands: list[str]
) -> None:
    uuid = made(manager)
    manager.suspend("box")
    sandbox = manager.resume("box")
    assert sandbox.state == "ready" and hv.domains[DOMAIN].running
    assert hv.domains[DOMAIN].saved is None
    assert sandbox.suspended is None and sandbox.saved_bytes == 0
    assert any("date -u -s @" in command and "/dev/urandom" in command for command in commands)
    hold = Holds(config).all()[uuid]
    assert hold.owner is None and hold.saved_bytes == 0
    assert manager.resume("box").state == "ready"  # idempotent


def test_a_sandbox_that_does_not_run_cannot_be_suspended(
    manager: SandboxManager, hv: FakeHypervisor
) -> None:
    made(manager)
    manager.stop("box", grace=1)
    with pytest.raises(FailedPrecondition, match="does not run"):
        manager.suspend("box")
    with pytest.raises(NotFound):
        manager.suspend("nobody")


def test_a_sandbox_that_is_not_suspended_cannot_be_resumed(manager: SandboxManager) -> None:
    made(manager)
    manager.stop("box", grace=1)
    with pytest.raises(FailedPrecondition, match="not suspended"):
        manager.resume("box")


def test_a_suspend_past_max_saved_gib_is_refused_and_leaves_it_running(
    config: Config, hv: FakeHypervisor, manager: SandboxManager
) -> None:
    manager.config = replace(config, max_saved_gib=1)
    manager.store.config = manager.config
    made(manager, "one", memory_mib=768)
    made(manager, "two", memory_mib=1024)
    manager.suspend("one")
    with pytest.raises(ResourceExhausted, match="max_saved_gib = 1"):
        manager.suspend("two")
    assert hv.domains["vmsbx-two"].running and manager.get("two").state == "started"
    assert Holds(manager.config).get(manager.get("two").uuid).saved_bytes == 0  # type: ignore[union-attr]


def test_a_failed_save_leaves_the_sandbox_running_as_it_was(
    manager: SandboxManager, hv: FakeHypervisor, config: Config
) -> None:
    uuid = made(manager)
    hv.before["save"] = refuse("disk full")
    with pytest.raises(FailedPrecondition, match="disk full"):
        manager.suspend("box")
    assert hv.domains[DOMAIN].running and manager.get("box").state == "ready"
    hold = Holds(config).all()[uuid]
    assert hold.owner is None and hold.saved_bytes == 0 and record(hv).suspended is None


def test_a_failed_restore_leaves_the_sandbox_suspended(
    manager: SandboxManager, hv: FakeHypervisor
) -> None:
    made(manager)
    manager.suspend("box")
    hv.before["start"] = refuse("cannot restore")
    with pytest.raises(FailedPrecondition, match="cannot restore"):
        manager.resume("box")
    assert manager.get("box").state == "suspended" and hv.domains[DOMAIN].saved


def test_destroy_removes_the_save(manager: SandboxManager, hv: FakeHypervisor) -> None:
    made(manager)
    manager.suspend("box")
    manager.destroy("box")
    assert DOMAIN not in hv.domains and manager.list() == []


def test_reconcile_never_removes_a_suspended_sandbox(
    manager: SandboxManager, hv: FakeHypervisor
) -> None:
    made(manager)
    manager.suspend("box")
    assert manager.reconcile()["removed"] == []
    assert manager.get("box").state == "suspended" and hv.domains[DOMAIN].saved


def _killed(config: Config, uuid: str, doing: str) -> None:
    """The hold as a suspend or resume killed halfway leaves it: owned by a dead process."""
    from vmsandbox.lock import host_lock

    with host_lock(config.lock_path, 5):
        holds = Holds(config)
        hold = holds.get(uuid)
        assert hold is not None
        holds.put(replace(hold, owner=DEAD, doing=doing))


def test_a_suspend_killed_after_the_save_is_finished_by_reconcile(
    manager: SandboxManager, hv: FakeHypervisor, config: Config
) -> None:
    uuid = made(manager)
    manager.suspend("box")
    # killed before its last commit: the record still says suspending
    manager.store.put(record(hv), "suspending", uuid)
    _killed(config, uuid, "suspend")
    report = manager.reconcile()
    assert report["removed"] == [] and report["settled"] == ["box: suspended"]
    assert manager.get("box").state == "suspended"
    hold = Holds(config).all()[uuid]
    assert hold.owner is None and hold.saved_bytes == hv.domains[DOMAIN].saved


def test_a_suspend_killed_before_the_save_returns_to_ready(
    manager: SandboxManager, hv: FakeHypervisor, config: Config
) -> None:
    uuid = made(manager)
    manager.store.put(record(hv), "suspending", uuid)
    _killed(config, uuid, "suspend")
    assert manager.reconcile()["settled"] == ["box: ready"]
    assert manager.get("box").state == "ready" and record(hv).suspended is None
    assert Holds(config).all()[uuid].owner is None


def test_a_resume_killed_after_the_restore_is_ready(
    manager: SandboxManager, hv: FakeHypervisor, config: Config
) -> None:
    uuid = made(manager)
    manager.suspend("box")
    hv.start(DOMAIN)  # the restore happened, the resume died before it committed
    manager.store.put(record(hv), "resuming", uuid)
    _killed(config, uuid, "resume")
    assert manager.reconcile()["settled"] == ["box: ready"]
    assert manager.get("box").state == "ready"
    assert Holds(config).all()[uuid].saved_bytes == 0


def test_a_resume_killed_before_the_restore_stays_suspended(
    manager: SandboxManager, hv: FakeHypervisor, config: Config
) -> None:
    uuid = made(manager)
    manager.suspend("box")
    manager.store.put(record(hv), "resuming", uuid)
    _killed(config, uuid, "resume")
    assert manager.reconcile()["settled"] == ["box: suspended"]
    assert manager.get("box").state == "suspended" and hv.domains[DOMAIN].saved
    assert manager.resume("box").state == "ready"


def test_start_of_a_suspended_sandbox_points_to_resume_and_restores_nothing(
    manager: SandboxManager, hv: FakeHypervisor
) -> None:
    made(manager)
    manager.suspend("box")
    with pytest.raises(FailedPrecondition, match="'vmsandbox resume box' restores it"):
        manager.start("box")
    assert not hv.domains[DOMAIN].running and hv.domains[DOMAIN].saved
    assert manager.stop("box", grace=1).state == "suspended"  # nothing runs: nothing to stop


# -- the control channel: served before the save, used by the resume ---------------------------


def test_a_save_waits_until_the_guest_serves_its_control_channel(
    manager: SandboxManager, hv: FakeHypervisor
) -> None:
    """A sandbox suspended right after its create: its guest is still starting the program
    that serves the channel; the save waits for it, so that the restore is woken at once."""
    made(manager)
    hv.channels[DOMAIN] = {CONTROL_PORT: "disconnected"}
    said: list[str] = []

    def progress(line: str) -> None:
        said.append(line)
        if "waiting for box's guest to serve its control channel" in line:
            hv.channels[DOMAIN] = {CONTROL_PORT: "connected"}  # the guest's program starts

    manager.progress = progress
    assert manager.suspend("box").state == "suspended"
    waited = next(n for n, line in enumerate(said) if "control channel" in line)
    saving = next(n for n, line in enumerate(said) if line.startswith("saving the memory"))
    assert waited < saving


def test_a_guest_that_never_serves_its_channel_is_saved_all_the_same(
    manager: SandboxManager, hv: FakeHypervisor, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(suspend, "CONTROL_WAIT_S", 0.2)
    made(manager)
    hv.channels[DOMAIN] = {CONTROL_PORT: "disconnected"}
    said: list[str] = []
    manager.progress = said.append
    assert manager.suspend("box").state == "suspended"
    assert "box's guest did not open its control channel; saving it as it is" in said


@pytest.mark.parametrize("state", ["connected", None])
def test_a_resume_wakes_the_guest_through_its_channel_and_reads_sshd_banner(
    manager: SandboxManager,
    hv: FakeHypervisor,
    config: Config,
    commands: list[str],
    monkeypatch: pytest.MonkeyPatch,
    state: str | None,
) -> None:
    """No SSH login: the clock and seed go through the channel, sshd's banner shows it
    answers (a state libvirt does not know is tried too)."""
    woken, banners = _wake_and_banner(manager, hv, config, monkeypatch)
    hv.channels[DOMAIN] = {CONTROL_PORT: state} if state else {}
    assert manager.resume("box").state == "ready"
    assert (len(woken), len(banners)) == (1, 1)
    assert not any("date -u -s @" in command for command in commands)


def test_a_parked_claim_woken_through_the_channel_reads_no_banner(
    manager: SandboxManager, hv: FakeHypervisor, config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The claim went with the wake, after the guest checked its sshd, as a running pooled
    guest's claim does: no sshd banner read on top."""
    woken, banners = _wake_and_banner(manager, hv, config, monkeypatch)
    hv.start(DOMAIN)
    record = manager.store.require("box").record
    reached = resume.reach(hv, config, record, "", lambda *_a, **_k: None, print, 0.0, "hit")
    assert reached.claimed and (len(woken), banners) == (1, [])


def test_a_resume_of_a_guest_whose_channel_was_closed_sets_the_clock_over_ssh(
    manager: SandboxManager,
    hv: FakeHypervisor,
    config: Config,
    commands: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """libvirt says the guest's end is closed: no wake to wait out, the clock over SSH."""
    woken, banners = _wake_and_banner(manager, hv, config, monkeypatch)
    hv.channels[DOMAIN] = {CONTROL_PORT: "disconnected"}
    assert manager.resume("box").state == "ready"
    assert (woken, banners) == ([], [])
    assert any("date -u -s @" in command for command in commands)


def test_a_channel_that_libvirt_learns_open_just_after_the_restore_is_used(
    manager: SandboxManager,
    hv: FakeHypervisor,
    config: Config,
    commands: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """libvirt reads the port closed until QEMU's event after the restore is handled: a
    "disconnected" read right after the restore is read again, not taken for a closed channel."""
    woken, banners = _wake_and_banner(manager, hv, config, monkeypatch)
    reads: list[str] = []

    def channel_state(domain: str, name: str, uuid: str | None = None) -> str:
        reads.append(name)
        return "disconnected" if len(reads) < 3 else "connected"

    monkeypatch.setattr(hv, "channel_state", channel_state)
    assert manager.resume("box").state == "ready"
    assert (len(woken), len(banners), len(reads)) == (1, 1, 3)
    assert not any("date -u -s @" in command for command in commands)


def _wake_and_banner(
    manager: SandboxManager, hv: FakeHypervisor, config: Config, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[object], list[object]]:
    """A suspended sandbox whose host end of the channel is there; the wake and the banner
    read recorded (each succeeds)."""
    made(manager)
    manager.suspend("box")
    SandboxFiles.of(config, "box").control.touch()
    woken: list[object] = []
    banners: list[object] = []
    monkeypatch.setattr(resume, "_woken", lambda files, _claim="": woken.append(files) or True)
    monkeypatch.setattr(
        resume.ssh, "banner", lambda endpoint: banners.append(endpoint) or "SSH-2.0-x"
    )
    return woken, banners
