"""The manager's logic against an in-memory hypervisor (tests/framework/fake_hypervisor.py): create
steps and their undos, states, races with a concurrent create or destroy, the DHCP endpoint of a
libvirt-network sandbox, reconcile. Files are real (qemu-img overlays, genisoimage seeds) in a state
directory of the test's own; no libvirtd, no guest.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from framework.fake_hypervisor import FakeHypervisor, refuse
from framework.paths import FIXTURES
from framework.seeds import read_iso

from vmsandbox.config import Config
from vmsandbox.errors import (
    AlreadyExists,
    FailedPrecondition,
    GuestVerificationFailed,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from vmsandbox.guest.setup import GuestFile, GuestSetup
from vmsandbox.guest.ssh import Endpoint
from vmsandbox.guest.verify import VerificationReport
from vmsandbox.sandbox import create, power
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.sandbox.record import SCHEMA_VERSION, SandboxFiles, SandboxRecord
from vmsandbox.sandbox.spec import SandboxSpec
from vmsandbox.vm.process import ProcessIdentity


def spec(name: str = "unit") -> SandboxSpec:
    return SandboxSpec(name=name, image="tiny", memory_mib=256, disk_gib=1)


def left(config: Config, hv: FakeHypervisor, name: str = "unit") -> list[str]:
    found = [str(path) for path in SandboxFiles.of(config, name).existing()]
    return found + [domain for domain in hv.domains if domain == f"vmsbx-{name}"]


def test_create_runs_every_step_and_checkpoints_each(config: Config, hv: FakeHypervisor) -> None:
    stages: list[str] = []
    with SandboxManager(config, hypervisor=hv, reconcile=False, checkpoint=stages.append) as mgr:
        sandbox = mgr.create(spec(), wait=False)
    assert stages == [
        "look",
        "locked",
        "reserve",
        "fabric",
        "keys",
        "overlay",
        "seed",
        "locked",
        "define",
        "start",
        "wait",
        "verify",
        "locked",
        "ready",
    ]
    assert sandbox.state == "started"
    assert hv.domains["vmsbx-unit"].running


def test_create_without_wait_is_started_never_ready(
    manager: SandboxManager, hv: FakeHypervisor
) -> None:
    """8e: a sandbox nobody waited for has not shown that SSH works: it is not "ready"."""
    manager.create(spec(), wait=False)
    assert hv.domains["vmsbx-unit"].state == "started"
    assert manager.get("unit").state == "started"


def test_create_without_start_is_defined(manager: SandboxManager, hv: FakeHypervisor) -> None:
    assert manager.create(spec(), start=False).state == "defined"
    assert ("start", "vmsbx-unit") not in hv.calls
    assert not hv.domains["vmsbx-unit"].running


def test_the_seed_step_carries_the_specs_guest_setup_and_the_domain_does_not(
    manager: SandboxManager, config: Config, hv: FakeHypervisor
) -> None:
    secret = "eyJhbGciOi.unit-secret"
    setup = GuestSetup(
        environment={"TEAM": "ml"},
        files=(GuestFile("/etc/openshell/token", secret, mode="0600"),),
    )
    manager.create(replace(spec(), guest=setup), start=False)
    seed = SandboxFiles.of(config, "unit").seed
    user_data = json.loads(read_iso(seed, "user-data").split("\n", 1)[1])
    written = {item["path"]: item for item in user_data["write_files"]}
    assert written["/etc/openshell/token"]["content"] == secret
    assert any("TEAM=ml" in item["content"] for item in written.values())
    assert secret not in hv.domains["vmsbx-unit"].xml


def test_the_record_is_typed_and_versioned(manager: SandboxManager, hv: FakeHypervisor) -> None:
    manager.create(spec(), wait=False)
    data = hv.domains["vmsbx-unit"].data
    assert data is not None and data["version"] == SCHEMA_VERSION
    record = SandboxRecord.from_dict(data)
    assert record.creator is not None and record.creator.pid == os.getpid()
    assert record.creator.owner is not None  # the create's owner file...
    assert not record.creator.alive()  # ...given up when the create ended
    assert record.to_dict() == data


def test_a_failed_step_undoes_what_the_create_made(
    manager: SandboxManager, config: Config, hv: FakeHypervisor
) -> None:
    hv.before["start"] = refuse("libvirt refused: QEMU exited")
    with pytest.raises(FailedPrecondition, match="QEMU exited"):
        manager.create(spec(), wait=False)
    assert left(config, hv) == []


def test_a_failing_cleanup_never_replaces_the_original_error(
    manager: SandboxManager, config: Config, hv: FakeHypervisor
) -> None:
    """8e: the create's own error propagates; the failed undo is a note on it."""
    hv.before["start"] = refuse("the original error")
    hv.before["undefine"] = refuse("undefine refused too")
    with pytest.raises(FailedPrecondition, match="the original error") as caught:
        manager.create(spec(), wait=False)
    assert any("undefine refused too" in note for note in caught.value.__notes__)
    assert SandboxFiles.of(config, "unit").existing() == []  # the other undos still ran


def test_already_exists_touches_nothing_of_the_existing_sandbox(
    manager: SandboxManager, config: Config, hv: FakeHypervisor
) -> None:
    manager.create(spec(), wait=False)
    before = left(config, hv)
    with pytest.raises(AlreadyExists):
        manager.create(spec(), wait=False)
    assert left(config, hv) == before
    assert hv.domains["vmsbx-unit"].running


def test_destroy_removes_everything(
    manager: SandboxManager, config: Config, hv: FakeHypervisor
) -> None:
    manager.create(spec(), wait=False)
    manager.destroy("unit")
    assert left(config, hv) == []
    with pytest.raises(NotFound):
        manager.destroy("unit")


def test_destroy_never_reports_success_while_files_remain(
    manager: SandboxManager, config: Config, hv: FakeHypervisor
) -> None:
    """8e: a file that cannot be deleted is FAILED_PRECONDITION naming it, not success."""
    manager.create(spec(), wait=False)
    stuck = SandboxFiles.of(config, "unit").overlay
    subprocess.run(["chattr", "+i", str(stuck)], check=True)
    try:
        with pytest.raises(FailedPrecondition, match="not removed completely") as caught:
            manager.destroy("unit")
        assert str(stuck) in caught.value.message
        assert caught.value.details["remaining"] == [str(stuck)]
    finally:
        subprocess.run(["chattr", "-i", str(stuck)], check=True)
    manager.destroy("unit")  # what was left goes once it can
    assert left(config, hv) == []


def test_destroy_racing_a_create_that_just_defined_removes_it(
    config: Config, hv: FakeHypervisor
) -> None:
    """8e: the sandbox shows up between destroy's first look and the lock: removed, not
    NOT_FOUND."""
    with SandboxManager(config, hypervisor=hv, reconcile=False) as mgr:

        def create_meanwhile(_domain: str) -> None:
            del hv.before["metadata"]
            mgr.create(spec(), wait=False)

        hv.before["metadata"] = create_meanwhile
        mgr.destroy("unit")
    assert left(config, hv) == []


def test_verify_racing_a_destroy_is_not_found(manager: SandboxManager, hv: FakeHypervisor) -> None:
    """8e: the sandbox vanishes while verify looks it up: NOT_FOUND, not an assertion."""
    manager.create(spec(), wait=False)
    hv.before["metadata"] = lambda domain: hv.domains.pop(domain)
    with pytest.raises(NotFound):
        manager.verify("unit")


def test_a_port_taken_before_qemu_starts_is_replaced(
    manager: SandboxManager, hv: FakeHypervisor
) -> None:
    """8e: QEMU cannot bind the forwarded port another process took meanwhile: the create plans
    another port, redefines and starts."""
    tries: list[str] = []

    def taken(_domain: str) -> None:
        tries.append(hv.domains["vmsbx-unit"].xml)
        if len(tries) == 1:
            raise FailedPrecondition(
                "libvirt refused: Could not set up host forwarding rule 'tcp:127.0.0.1:1-:22'"
            )

    hv.before["start"] = taken
    sandbox = manager.create(spec(), wait=False)
    assert len(tries) == 2 and tries[0] != tries[1]
    assert sandbox.ssh is not None
    assert f"hostfwd=tcp:127.0.0.1:{sandbox.ssh.port}-:22" in hv.domains["vmsbx-unit"].xml


def test_a_start_whose_port_was_taken_moves_the_forward(
    manager: SandboxManager, hv: FakeHypervisor
) -> None:
    """Another program took a stopped sandbox's SSH port: start moves the forward to a free
    port (record and domain both) and starts; it used to fail every time."""
    created = manager.create(spec(), start=False)
    assert created.ssh is not None
    old = created.ssh.port
    tries: list[str] = []

    def taken(_domain: str) -> None:
        tries.append(hv.domains["vmsbx-unit"].xml)
        if len(tries) == 1:
            raise FailedPrecondition(
                f"libvirt refused: Could not set up host forwarding rule 'tcp:127.0.0.1:{old}-:22'"
            )

    hv.before["start"] = taken
    started = manager.start("unit", wait=False)
    assert started.ssh is not None and started.ssh.port != old
    assert f"hostfwd=tcp:127.0.0.1:{started.ssh.port}-:22" in hv.domains["vmsbx-unit"].xml
    assert f"127.0.0.1:{old}-" not in hv.domains["vmsbx-unit"].xml
    assert started.state == "starting" and hv.domains["vmsbx-unit"].running


def test_libvirt_network_address_is_kept_in_the_record(config: Config, hv: FakeHypervisor) -> None:
    """8a: the DHCP address, once known, is written to the record, so get/exec/ssh/verify in
    another process find it."""
    network = replace(config, network="vmsbx-unit-net")
    with SandboxManager(network, hypervisor=hv, reconcile=False) as mgr:
        assert mgr.create(spec(), wait=False).ssh is None  # no lease yet
        hv.leases["vmsbx-unit"] = "192.0.2.7"  # TEST-NET-1: never contacted
        assert mgr.get("unit").ssh == Endpoint("192.0.2.7", 22, "sandbox")
    hv.leases.clear()  # a later process does not need the lease any more
    with SandboxManager(network, hypervisor=hv, reconcile=False) as mgr:
        assert mgr.get("unit").ssh == Endpoint("192.0.2.7", 22, "sandbox")
        assert "192.0.2.7" in mgr.ssh_argv("unit")


@pytest.mark.parametrize("made", ["before reservations", "with a reservation"])
def test_reconcile_removes_a_create_whose_process_died(
    manager: SandboxManager, config: Config, hv: FakeHypervisor, made: str
) -> None:
    """A create killed mid-way: its record says creating by a creator that is gone, and (when
    it was made with reservations) its reservation's owner is gone too."""
    manager.create(spec(), wait=False)
    dom = hv.domains["vmsbx-unit"]
    assert dom.data is not None
    dead = {"pid": 1, "start": "0", "boot": "another boot"}
    dom.data["creator"] = dead
    dom.state = "creating"
    hold = config.state_dir / "holds" / f"{dom.uuid}.json"
    if made == "before reservations":
        hold.unlink()
    else:
        hold.write_text(json.dumps({**json.loads(hold.read_text()), "owner": dead}))
    assert manager.reconcile() == {"removed": ["unit"], "problems": [], "fabric_partitions": []}
    assert left(config, hv) == []


def test_reconcile_reports_a_running_sandbox_without_files(
    manager: SandboxManager, config: Config, hv: FakeHypervisor
) -> None:
    manager.create(spec(), wait=False)
    SandboxFiles.of(config, "unit").overlay.unlink()
    report = manager.reconcile()
    assert report["removed"] == [] and "running, but its files are gone" in report["problems"][0]
    assert hv.domains["vmsbx-unit"].running


def test_a_step_that_fails_halfway_is_undone_too(
    manager: SandboxManager, config: Config, hv: FakeHypervisor
) -> None:
    """define fails after the domain exists (as libvirt can when it saves its config): the
    define step's own undo removes it."""

    def define_then_fail(xml: str) -> None:
        FakeHypervisor.define(hv, xml)
        raise FailedPrecondition("libvirt refused: cannot write the config")

    hv.define = define_then_fail  # type: ignore[method-assign]
    with pytest.raises(FailedPrecondition, match="cannot write the config"):
        manager.create(spec(), wait=False)
    assert left(config, hv) == []


def test_a_sandbox_kept_although_its_guest_verification_failed_is_reported(
    manager: SandboxManager, config: Config, hv: FakeHypervisor
) -> None:
    """A create asked to keep a sandbox whose in-guest check failed keeps it and still
    raises the verification error (the create's verify step raises without ``keep``, and the
    create's undos take the sandbox apart: the GPU claim's tests in
    tests/unit/sandbox/pool/test_gpu_steps.py show it)."""
    made = manager.create(spec(), wait=False)
    failed = VerificationReport(gpus=[], checks=[], problems=["0000:41:00.0 missing"]).to_dict()
    stored = hv.domains["vmsbx-unit"].data
    assert stored is not None
    creation = manager._creation(spec(), made.name, manager.images.get("tiny"), lambda _l: None)
    creation.record = replace(SandboxRecord.from_dict(stored), verification=failed)
    with pytest.raises(GuestVerificationFailed, match=r"0000:41:00\.0 missing") as caught:
        create.check_verification(creation)
    assert caught.value.details["kept"] is True
    assert left(config, hv)


def test_a_newer_record_is_refused_here_and_skipped_from_another_state_dir(
    manager: SandboxManager, config: Config, hv: FakeHypervisor
) -> None:
    manager.create(spec("theirs"), wait=False)
    theirs = hv.domains["vmsbx-theirs"].data
    assert theirs is not None
    theirs.update(version=99, keys="/var/lib/another-state-dir/sandboxes/theirs")
    assert [sandbox.name for sandbox in manager.list()] == []
    manager.create(spec(), wait=False)
    ours = hv.domains["vmsbx-unit"].data
    assert ours is not None
    ours["version"] = 99
    with pytest.raises(FailedPrecondition, match="newer vmsandbox"):
        manager.list()
    with pytest.raises(FailedPrecondition, match="newer vmsandbox"):
        manager.get("unit")


# -- Fabric Manager partitions (the fake fmpm of tests/fixtures/fmpm) -----------------------------

FMPM = FIXTURES / "fmpm" / "fmpm"


@pytest.fixture
def fm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The fake FM's state folder; partitions 1 and 4 active."""
    state = tmp_path / "fm"
    state.mkdir()
    (state / "active.json").write_text("[1, 4]")
    monkeypatch.setenv("FAKE_FMPM_STATE", str(state))
    return state


def lease(config: Config, partition: int, sandbox: str) -> None:
    """A ledger entry, as FabricLease.activate writes it."""
    ledger = config.state_dir / "fabric"
    ledger.mkdir(exist_ok=True)
    (ledger / f"{partition}.json").write_text(json.dumps({"sandbox": sandbox}))


def ledger(config: Config) -> list[str]:
    return sorted(path.name for path in (config.state_dir / "fabric").glob("*.json"))


@pytest.fixture
def fm_manager(config: Config, hv: FakeHypervisor, fm: Path) -> Iterator[SandboxManager]:
    """A manager whose fmpm is the fake one, holding sandbox 'unit' (created, not waited for)."""
    with SandboxManager(replace(config, fmpm=str(FMPM)), hypervisor=hv, reconcile=False) as mgr:
        mgr.create(spec(), wait=False)
        yield mgr


def test_destroy_deactivates_the_partition_once_the_domain_is_gone(
    fm_manager: SandboxManager, config: Config, hv: FakeHypervisor, fm: Path
) -> None:
    lease(config, 4, "unit")
    fm_manager.destroy("unit")
    assert json.loads((fm / "active.json").read_text()) == [1]
    assert (fm / "calls.log").read_text().splitlines() == ["-l", "-d 4"]
    assert ledger(config) == [] and left(config, hv) == []


def test_fm_down_at_destroy_keeps_the_lease_for_reconcile(
    fm_manager: SandboxManager, config: Config, hv: FakeHypervisor, fm: Path
) -> None:
    lease(config, 4, "unit")
    (fm / "unreachable").touch()
    with pytest.raises(FailedPrecondition, match="was not removed completely") as caught:
        fm_manager.destroy("unit")
    assert "Fabric Manager" in caught.value.message
    assert left(config, hv) == [] and ledger(config) == ["4.json"]
    report = fm_manager.reconcile()
    assert report["fabric_partitions"] == [] and "cannot be reached" in report["problems"][0]
    (fm / "unreachable").unlink()
    # 4 is the lease kept; 1, active with no lease and none of its GPUs held, is a stray
    assert fm_manager.reconcile() == {
        "removed": [],
        "problems": [],
        "fabric_partitions": ["1", "4"],
    }
    assert json.loads((fm / "active.json").read_text()) == [] and ledger(config) == []


def test_reconcile_releases_only_leases_whose_domain_is_gone(
    fm_manager: SandboxManager, config: Config, fm: Path
) -> None:
    lease(config, 1, "unit")  # its domain is there: kept
    lease(config, 4, "killed-after-activation")
    assert fm_manager.reconcile() == {"removed": [], "problems": [], "fabric_partitions": ["4"]}
    assert json.loads((fm / "active.json").read_text()) == [1]
    assert ledger(config) == ["1.json"]


# -- stop, start, wait (sandbox/power.py) --------------------------------------------------------


def test_stop_presses_the_power_button_and_keeps_the_domain(
    manager: SandboxManager, hv: FakeHypervisor
) -> None:
    manager.create(spec(), wait=False)
    assert manager.stop("unit", grace=5).state == "stopped"
    assert ("shutdown", "vmsbx-unit") in hv.calls and ("stop", "vmsbx-unit") not in hv.calls
    assert "vmsbx-unit" in hv.domains  # disk and GPUs (its hostdevs) are kept


def test_stop_powers_off_a_guest_that_ignores_the_button(
    manager: SandboxManager, hv: FakeHypervisor
) -> None:
    manager.create(spec(), wait=False)
    hv.domains["vmsbx-unit"].ignores_acpi = True
    assert manager.stop("unit", grace=0.1).state == "stopped"
    assert ("stop", "vmsbx-unit") in hv.calls


def test_stop_presses_again_when_the_first_press_was_lost(
    manager: SandboxManager, hv: FakeHypervisor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A guest that has just answered SSH may not listen to its power button yet."""
    monkeypatch.setattr(power, "PRESS_AGAIN_S", 0.05)
    monkeypatch.setattr(power, "POLL_S", 0.01)
    manager.create(spec(), wait=False)
    guest = hv.domains["vmsbx-unit"]
    presses: list[str] = []

    def press(domain: str) -> None:
        presses.append(domain)
        guest.ignores_acpi = len(presses) == 1  # the first press comes too early

    hv.before["shutdown"] = press
    assert manager.stop("unit", grace=5).state == "stopped"
    assert hv.calls.count(("shutdown", "vmsbx-unit")) == 2
    assert ("stop", "vmsbx-unit") not in hv.calls


def test_stop_grace_must_be_seconds_above_zero(manager: SandboxManager) -> None:
    with pytest.raises(InvalidArgument, match="grace must be a finite number") as caught:
        manager.stop("unit", grace=0)
    assert caught.value.details == {"field": "grace", "value": "0"}


def test_a_refused_start_leaves_the_sandbox_as_it_was(
    manager: SandboxManager, hv: FakeHypervisor
) -> None:
    manager.create(spec(), start=False)
    before = dict(hv.domains["vmsbx-unit"].data or {})
    hv.before["start"] = refuse("starting sandbox 'unit': libvirt refused: no PCI device")
    with pytest.raises(FailedPrecondition, match="no PCI device"):
        manager.start("unit")
    assert hv.domains["vmsbx-unit"].state == "defined"
    assert hv.domains["vmsbx-unit"].data == before


def test_a_refused_start_whose_restore_fails_keeps_the_starts_error(
    manager: SandboxManager, hv: FakeHypervisor
) -> None:
    manager.create(spec(), start=False)
    hv.before["start"] = refuse("starting sandbox 'unit': libvirt refused: no PCI device")

    def restore_fails(_domain: str) -> None:
        if ("start", "vmsbx-unit") in hv.calls:
            raise Unavailable("updating the metadata: libvirt is unavailable")

    hv.before["set_metadata"] = restore_fails
    with pytest.raises(FailedPrecondition, match="no PCI device") as caught:
        manager.start("unit")
    assert caught.value.__notes__ == [
        "restoring the state of sandbox 'unit' failed: "
        "updating the metadata: libvirt is unavailable"
    ]


def test_a_start_in_flight_shows_starting_while_its_starter_lives(
    manager: SandboxManager, hv: FakeHypervisor
) -> None:
    manager.create(spec(), start=False)
    assert manager.start("unit", wait=False).state == "starting"
    record = SandboxRecord.from_dict(hv.domains["vmsbx-unit"].data or {})
    assert record.starter is not None and record.starter.pid == os.getpid()
    assert record.starter.alive()  # an owner file this process keeps while it lives
    hv.domains["vmsbx-unit"].running = False
    assert manager.get("unit").state == "starting"  # its starter (this process) lives
    gone = replace(record, starter=ProcessIdentity(pid=1, start=None, boot="another boot"))
    hv.domains["vmsbx-unit"].data = gone.to_dict()
    assert manager.get("unit").state == "stopped"


def test_start_of_a_running_or_creating_sandbox(
    manager: SandboxManager, hv: FakeHypervisor
) -> None:
    manager.create(spec(), wait=False)
    hv.calls.clear()
    assert manager.start("unit", wait=False).state == "started"  # running: returned as it is
    assert ("start", "vmsbx-unit") not in hv.calls
    hv.domains["vmsbx-unit"].state = "creating"
    hv.domains["vmsbx-unit"].running = False
    with pytest.raises(FailedPrecondition, match="still being created"):
        manager.start("unit")


def test_a_guest_that_does_not_come_up_is_stored_failed_with_why(
    manager: SandboxManager, hv: FakeHypervisor
) -> None:
    manager.create(spec(), start=False)
    manager.start("unit", wait=False)
    hv.domains["vmsbx-unit"].running = False
    hv.domains["vmsbx-unit"].reason = "the guest powered itself off"
    with pytest.raises(FailedPrecondition, match="stopped before SSH came up"):
        manager.wait("unit", timeout=30)
    assert hv.domains["vmsbx-unit"].state == "failed"
    failure = SandboxRecord.from_dict(hv.domains["vmsbx-unit"].data or {}).failure
    assert failure is not None and failure["code"] == "FAILED_PRECONDITION"
    assert "the guest powered itself off" in failure["message"]
    assert manager.get("unit").failure == failure


def test_stop_and_start_name_a_missing_sandbox(manager: SandboxManager) -> None:
    for call in (manager.stop, manager.start):
        with pytest.raises(NotFound, match="sandbox 'ghost' does not exist"):
            call("ghost")


def test_a_version_2_record_reads_without_failure_or_starter(
    manager: SandboxManager, hv: FakeHypervisor
) -> None:
    manager.create(spec(), wait=False)
    old = {
        k: v
        for k, v in (hv.domains["vmsbx-unit"].data or {}).items()
        if k not in ("failure", "starter")
    }
    record = SandboxRecord.from_dict({**old, "version": 2})
    assert (record.failure, record.starter, record.version) == (None, None, SCHEMA_VERSION)


def test_a_failed_cold_create_keeps_its_console_log_and_says_where(
    manager: SandboxManager, config: Config, hv: FakeHypervisor
) -> None:
    """The undos remove the sandbox's files; its console log, what the user needs to see why
    it failed, is kept in <state_dir>/failed/ and the error names it (issue 42, point 9)."""
    log = SandboxFiles.of(config, "unit").console_log

    def panics(_domain: str) -> None:
        log.write_text("Kernel panic - not syncing: VFS: Unable to mount root fs\r\n")

    hv.before["start"] = panics
    with pytest.raises(FailedPrecondition, match="cannot boot") as caught:
        manager.create(spec(), timeout=30)
    kept = Path(caught.value.details["console_log"])
    assert f"(the guest's console log is kept at {kept})" in caught.value.message
    assert kept.parent == config.state_dir / "failed" and kept.name.startswith("unit-")
    assert "Kernel panic" in kept.read_text() and kept.stat().st_mode & 0o777 == 0o600
    assert left(config, hv) == []
