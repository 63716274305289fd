"""Reconcile decides on a consistent view: what it reads outside the host lock is checked again
under it before it acts, and calls that run between its lock holds (a create reserving and
leasing a partition, a create writing the files of a name that a vanished domain had) keep
what they made. On the fake hypervisor and the fake fmpm (tests/fixtures/fmpm)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from framework.fake_hypervisor import FakeHypervisor, unit_config
from framework.paths import FIXTURES

from vmsandbox.config import Config
from vmsandbox.lock import host_lock
from vmsandbox.sandbox.holds import Hold, Holds, owners_folder
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.sandbox.reconcile import reconcile
from vmsandbox.sandbox.record import SandboxFiles
from vmsandbox.sandbox.spec import SandboxSpec
from vmsandbox.vm.process import Ownership

FMPM = FIXTURES / "fmpm" / "fmpm"
NEW_UUID = "0d7b1a5e-5d2c-4b8e-9a51-6f1f3c1e2b77"


@pytest.fixture
def fm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The fake FM's state folder; partitions 1 and 4 active."""
    state = tmp_path / "fm"
    state.mkdir()
    (state / "active.json").write_text("[1, 4]")
    monkeypatch.setenv("FAKE_FMPM_STATE", str(state))
    return state


@pytest.fixture
def config(tmp_path: Path) -> Config:
    return replace(unit_config(tmp_path), fmpm=str(FMPM))


def spec(name: str) -> SandboxSpec:
    return SandboxSpec(name=name, image="tiny", memory_mib=256, disk_gib=1)


def write_lease(config: Config, partition: int, uuid: str, sandbox: str) -> None:
    """A ledger entry, as FabricLease.activate writes it."""
    ledger = config.state_dir / "fabric"
    ledger.mkdir(exist_ok=True)
    entry = {"partition": partition, "uuid": uuid, "sandbox": sandbox}
    (ledger / f"{partition}.json").write_text(json.dumps(entry))


def between(config: Config, after: int, act: Callable[[], None]) -> Callable[[], object]:
    """The host lock, with ``act`` run once right after reconcile lets go of its ``after``-th
    hold of it: another call that got the lock next."""
    count = 0

    @contextlib.contextmanager
    def lock() -> Iterator[None]:
        nonlocal count
        with host_lock(config.lock_path, config.lock_timeout, "reconcile"):
            yield
        count += 1
        if count == after:
            act()

    return lock


def before(config: Config, act: Callable[[], None]) -> Callable[[], object]:
    """The host lock, with ``act`` run once right before reconcile's first hold of it: what
    changed between its reading of the view and its turn at the lock."""
    acted = False

    @contextlib.contextmanager
    def lock() -> Iterator[None]:
        nonlocal acted
        if not acted:
            acted = True
            act()
        with host_lock(config.lock_path, config.lock_timeout, "reconcile"):
            yield

    return lock


def test_a_legacy_domain_gone_before_reconciles_turn_is_not_taken_apart(
    manager: SandboxManager, config: Config, hv: FakeHypervisor
) -> None:
    """Legacy sandbox A "web" (made before reservations) is in reconcile's view; before its
    turn at the lock, A's domain is removed outside vmsandbox and a create of B "web" has
    reserved the name and written its keys. Reconcile must not give A a reservation nor take
    "A" apart: that removed the files of the name, B's keys."""
    a = manager.create(spec("web"), start=False)
    with manager.locked():
        Holds(config).drop(a.uuid, tombstone=False)  # as before reservations existed
    files = SandboxFiles.of(config, "web")
    creator = Ownership(owners_folder(config))

    def a_gone_and_b_reserved() -> None:
        hv.undefine("vmsbx-web", uuid=a.uuid)
        files.remove()
        with manager.locked():
            hold = Hold(NEW_UUID, "web", "web", owner=creator.identity, doing="create")
            Holds(config).put(hold)
        files.keys_dir.mkdir(mode=0o700)
        (files.keys_dir / "id_ed25519").write_text("B's key")

    try:
        report = reconcile(hv, config, before(config, a_gone_and_b_reserved))
        holds = Holds(config).all()
    finally:
        creator.end()
    assert (files.keys_dir / "id_ed25519").read_text() == "B's key"
    assert report.removed == [] and set(holds) == {NEW_UUID}


def test_a_teardown_removes_files_only_while_no_other_reservation_has_their_name(
    manager: SandboxManager, config: Config, hv: FakeHypervisor
) -> None:
    """The last guard of teardown.finish: the files of a name are removed under the hold that
    reserves it, never while another reservation (a new create's) claims that name."""
    from vmsandbox.sandbox.create import Remains
    from vmsandbox.sandbox.teardown import finish

    files = SandboxFiles.of(config, "web")
    teardown, creator = Ownership(owners_folder(config)), Ownership(owners_folder(config))
    stale = "6c1c7d7e-1111-4a4a-8b8b-000000000001"
    try:
        with manager.locked():
            holds = Holds(config)
            holds.put(Hold(stale, "web", "web", owner=teardown.identity, doing="reconcile"))
            holds.put(Hold(NEW_UUID, "web", "web", owner=creator.identity, doing="create"))
        files.keys_dir.mkdir(mode=0o700, parents=True)
        (files.keys_dir / "id_ed25519").write_text("B's key")
        finish(Remains(hv, config, "web", files, None, stale, teardown), manager.locked)
    finally:
        teardown.end()
        creator.end()
    assert (files.keys_dir / "id_ed25519").read_text() == "B's key"


def test_a_lease_written_while_reconcile_looks_is_never_taken_for_an_orphan(
    manager: SandboxManager, config: Config, fm: Path
) -> None:
    """A create reserves partition 4 (its hold) and leases it (activating it) between
    reconcile's read of the reservations and its read of the ledger: the partition stays
    active and leased, under the guest about to start on it."""
    unit = manager.create(spec("unit"), wait=False)
    with manager.locked():  # a fabric on this host (the fabric pass runs): unit on partition 1
        hold = Holds(config).get(unit.uuid)
        assert hold is not None
        Holds(config).put(replace(hold, partition=1))
    write_lease(config, 1, unit.uuid, "unit")
    creator = Ownership(owners_folder(config))

    def create_leases_partition_4() -> None:
        with manager.locked():
            hold = Hold(NEW_UUID, "new", "new", partition=4, owner=creator.identity)
            Holds(config).put(replace(hold, doing="create"))
        write_lease(config, 4, NEW_UUID, "new")  # FabricLease.activate: lease, then fmpm -a
        (fm / "active.json").write_text("[1, 4]")

    (fm / "active.json").write_text("[1]")  # 4 is not active before the create activates it
    lock = between(config, 2, create_leases_partition_4)
    try:
        report = reconcile(manager.hypervisor, config, lock)
    finally:
        creator.end()
    assert report.fabric_partitions == [] and report.problems == []
    assert json.loads((fm / "active.json").read_text()) == [1, 4]
    assert (config.state_dir / "fabric" / "4.json").exists()


def _unit_on_partition_1(manager: SandboxManager, config: Config) -> str:
    """A sandbox holding partition 1, leased (the host has a fabric ledger)."""
    unit = manager.create(spec("unit"), wait=False)
    with manager.locked():
        hold = Holds(config).get(unit.uuid)
        assert hold is not None
        Holds(config).put(replace(hold, partition=1))
    write_lease(config, 1, unit.uuid, "unit")
    return unit.uuid


def test_a_partition_active_with_no_lease_is_deactivated(
    manager: SandboxManager, config: Config, fm: Path
) -> None:
    """Partition 4 is active and nothing here explains it: a create killed while fmpm
    activated it, whose lease reconcile released while FM still worked (the partition not
    active yet), then the activation landed. It used to stay active, taken from allocation,
    for good."""
    _unit_on_partition_1(manager, config)
    report = reconcile(manager.hypervisor, config, manager.locked)
    assert report.fabric_partitions == [4] and report.problems == []
    assert json.loads((fm / "active.json").read_text()) == [1]
    assert sorted(p.name for p in (config.state_dir / "fabric").iterdir()) == ["1.json"]


def test_an_active_partition_a_create_has_reserved_is_no_stray(
    manager: SandboxManager, config: Config, fm: Path
) -> None:
    """A create reserved partition 4 (its hold) and FM shows it active before the create's
    lease is read: the create's partition, left active and unleased by reconcile."""
    _unit_on_partition_1(manager, config)
    creator = Ownership(owners_folder(config))
    try:
        with manager.locked():
            hold = Hold(NEW_UUID, "new", "new", partition=4, owner=creator.identity)
            Holds(config).put(replace(hold, doing="create"))
        report = reconcile(manager.hypervisor, config, manager.locked)
    finally:
        creator.end()
    assert report.fabric_partitions == [] and report.problems == []
    assert json.loads((fm / "active.json").read_text()) == [1, 4]
    assert not (config.state_dir / "fabric" / "4.json").exists()


def test_strays_are_not_looked_for_while_fabric_manager_cannot_be_reached(
    manager: SandboxManager, config: Config, fm: Path
) -> None:
    _unit_on_partition_1(manager, config)
    (fm / "unreachable").touch()
    report = reconcile(manager.hypervisor, config, manager.locked)
    assert report.fabric_partitions == []
    assert any("not checked for strays" in problem for problem in report.problems)
    (fm / "unreachable").unlink()
    assert json.loads((fm / "active.json").read_text()) == [1, 4]
    assert sorted(p.name for p in (config.state_dir / "fabric").iterdir()) == ["1.json"]
