"""A sandbox's shown state stays true after the call that set it (issue 42, point 5): a
``start --no-wait`` whose process is gone shows ``started``, not ``starting`` for good; a
reader (show, list) that finds SSH answering stores a ``started`` or ``failed`` sandbox ready;
a ``start`` of one that runs but never showed ready waits for it; the commands that need a
running guest say so for a stopped one, never "retry once libvirtd is back"."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from framework.fake_hypervisor import FakeHypervisor

from vmsandbox.errors import FailedPrecondition, Unavailable
from vmsandbox.sandbox import power, settle
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.sandbox.record import SandboxRecord
from vmsandbox.sandbox.spec import SandboxSpec
from vmsandbox.sandbox.store import Found
from vmsandbox.vm import process


class Answering:
    """ssh.connect of a guest whose sshd takes the sandbox's key (or not: ``down``)."""

    def __init__(self, *, down: bool = False) -> None:
        self.down = down
        self.calls = 0

    def __call__(self, *_args: Any, **_kwargs: Any) -> Any:
        self.calls += 1
        if self.down:
            raise Unavailable("cannot reach the guest over SSH")
        return self

    def close(self) -> None:
        pass


@pytest.fixture
def guest(monkeypatch: pytest.MonkeyPatch) -> Answering:
    answering = Answering()
    monkeypatch.setattr(settle.ssh, "connect", answering)
    return answering


def spec(name: str = "unit") -> SandboxSpec:
    return SandboxSpec(name=name, image="tiny", memory_mib=256, disk_gib=1)


def stored(hv: FakeHypervisor, name: str = "unit") -> tuple[str, SandboxRecord]:
    domain = hv.domains[f"vmsbx-{name}"]
    return domain.state, SandboxRecord.from_dict(domain.data or {})


def test_a_start_without_wait_shows_started_once_its_process_is_gone(
    manager: SandboxManager, hv: FakeHypervisor, guest: Answering
) -> None:
    guest.down = True
    manager.create(spec(), start=False)
    manager.start("unit", wait=False)
    assert manager.get("unit").state == "starting"  # this process started it and still lives
    for owner in process._PROCESS_OWNERS.values():
        owner.end()  # what the CLI process does when it exits
    assert [s.state for s in manager.list()] == ["started"]
    assert manager.get("unit").state == "started"


def test_show_and_list_settle_a_started_sandbox_whose_guest_answers(
    manager: SandboxManager, hv: FakeHypervisor, guest: Answering
) -> None:
    manager.create(spec(), wait=False)
    guest.down = True
    assert manager.get("unit").state == "started"  # not answering yet: nothing changes
    assert stored(hv)[0] == "started"
    guest.down = False
    assert [s.state for s in manager.list()] == ["ready"]
    assert stored(hv)[0] == "ready"
    assert manager.get("unit").state == "ready"
    assert guest.calls == 2  # a ready sandbox is not probed again


def test_a_failed_sandbox_whose_guest_came_up_since_is_ready_and_forgets_why(
    manager: SandboxManager, hv: FakeHypervisor, guest: Answering
) -> None:
    manager.create(spec(), wait=False)
    _state, record = stored(hv)
    failure = {"code": "DEADLINE_EXCEEDED", "message": "guest did not accept SSH within 300s"}
    hv.set_metadata("vmsbx-unit", replace(record, failure=failure).to_dict(), "failed")
    guest.down = True
    shown = manager.get("unit")
    assert (shown.state, shown.failure) == ("failed", failure)
    guest.down = False
    shown = manager.get("unit")
    assert (shown.state, shown.failure) == ("ready", None)


def test_a_start_of_a_running_sandbox_that_never_showed_ready_waits_for_it(
    manager: SandboxManager, hv: FakeHypervisor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A start of a running sandbox shown failed waits for it, and then shows it ready."""
    waited: list[str] = []

    def wait(_hv: Any, _config: Any, found: Found, *_a: Any, **_k: Any) -> Any:
        record = found.record
        waited.append(record.name)
        ready = replace(record, boot_seconds=1.5)
        hv.set_metadata(record.domain, ready.to_dict(), "ready")
        return ready, 1.5

    monkeypatch.setattr(power, "wait", wait)
    monkeypatch.setattr(settle.ssh, "connect", Answering(down=True))
    manager.create(spec(), wait=False)
    _state, record = stored(hv)
    failure = {"code": "DEADLINE_EXCEEDED", "message": "no SSH"}
    hv.set_metadata("vmsbx-unit", replace(record, failure=failure).to_dict(), "failed")
    hv.calls.clear()
    assert manager.start("unit").state == "ready"
    assert waited == ["unit"] and ("start", "vmsbx-unit") not in hv.calls
    assert manager.get("unit").boot_seconds == 1.5
    assert manager.start("unit").state == "ready" and waited == ["unit"]  # ready: as it is


def test_a_gpu_sandbox_is_left_to_start_which_checks_its_gpus(
    manager: SandboxManager, hv: FakeHypervisor, guest: Answering
) -> None:
    manager.create(spec(), wait=False)
    _state, record = stored(hv)
    gpus = ({"bdf": "0000:41:00.0", "vendor_id": "0x10de", "device_id": "0x2330"},)
    data = {**record.to_dict(), "gpus": list(gpus)}
    hv.set_metadata("vmsbx-unit", data, "started")
    assert manager.get("unit").state == "started" and guest.calls == 0


@pytest.mark.parametrize(
    ("how", "says"),
    [("stopped", "it is stopped; start it with 'vmsandbox start unit'"), ("defined", "never")],
)
def test_exec_verify_and_ssh_of_a_guest_that_does_not_run_say_how_to_start_it(
    manager: SandboxManager, hv: FakeHypervisor, how: str, says: str
) -> None:
    """exec of a stopped sandbox used to exit 7 (UNAVAILABLE, "[Errno None] Unable to
    connect"), and verify answered "verification: ok"."""
    manager.create(spec(), start=how == "stopped", wait=False)
    if how == "stopped":
        manager.stop("unit", grace=1)
    for call in (
        lambda: manager.exec("unit", ["true"]),
        lambda: manager.verify("unit"),
        lambda: manager.ssh_argv("unit"),
    ):
        with pytest.raises(FailedPrecondition, match=says) as caught:
            call()
        assert caught.value.details["state"] == how


def test_verify_of_a_running_sandbox_without_gpus_reaches_the_guest_first(
    manager: SandboxManager, monkeypatch: pytest.MonkeyPatch, guest: Answering
) -> None:
    manager.create(spec(), wait=False)

    def silent(*_args: Any, **_kwargs: Any) -> None:
        raise Unavailable("cannot reach the guest's sshd at 127.0.0.1:1: Connection refused")

    monkeypatch.setattr("vmsandbox.sandbox.manager.ssh.prove_host_key", silent)
    with pytest.raises(Unavailable, match="cannot reach the guest's sshd"):
        manager.verify("unit")
