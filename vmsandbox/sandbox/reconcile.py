"""Reconcile: finish taking apart what killed or failed calls left half-made, on a complete
view only.

It reads every domain first, outside the host lock (``Hypervisor.every_domain``: the whole
list or an error; a libvirt error, such as libvirtd restarting mid-scan, aborts reconcile before it
decides anything, so nothing is ever removed on a partial view). Under the lock it reads the
reservations (holds.py) and decides; the view is older than the lock, so every domain it acts
on is looked up again there by its UUID (one that is gone since is left alone: a later create
may have its name by now), and so is every decision that rests on a domain being gone. Only
sandboxes of
this state directory are touched (their record names the keys folder kept here); a domain
without a vmsandbox record naming it is never ours.

Left over, and taken apart (teardown.finish, slow parts outside the lock):

- a reservation whose owner is gone (a create, claim, fill or destroy that was killed or
  whose cleanup could not finish), with whatever domain and files it has;
- a domain still marked creating whose creator is gone, made before reservations existed;
- a stopped domain whose overlay, seed or keys are gone (a running one is reported, not
  stopped);
- files with no domain and no reservation (removed at once, under the lock);
- owner files (``owners/``) that nobody keeps locked: their processes were killed.

A suspend or resume whose process was killed (its hold's ``doing``) is not taken apart but
settled (suspend.py's ``settle``): a guest whose memory is saved is ``suspended`` with no GPU
held, one that runs is ``ready`` with the GPUs it holds; a suspended sandbox's save file is
never removed here (only destroy removes it).

Also under the lock: a settled reservation whose domain is gone (removed by something else
than vmsandbox) is dropped; a sandbox made before reservations existed gets one; tombstones of
domains no longer listed are forgotten. Last, the fabric ledger: a Fabric Manager partition
leased to a UUID that is neither a domain nor a reservation, or to a sandbox whose settled
reservation does not name it (a suspended sandbox, or one settled with none of its GPUs in
the guest), is deactivated, decided from the ledger and the reservations read in one hold of
the lock (a create or resume reserves before it leases, a suspend forgets the partition only
after its lease), and deactivated after it (gpu/fabric/lease.py); so is a stray, a partition
FM has active that no lease, reservation or domain explains (a killed create's activation that
landed late), leased first under the lock. Fabric Manager unreachable is a problem reported,
not an error: the leases stay for the next reconcile. Then the GPUs'
custody (sandbox/custody.py): GPUs released above or left sanitizing are sanitized, and GPUs
of sandboxes gone another way are released and sanitized.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from vmsandbox.config import Config
from vmsandbox.errors import InvalidArgument, VmSandboxError
from vmsandbox.gpu.fabric.lease import FabricLease
from vmsandbox.sandbox import custody
from vmsandbox.sandbox.create import Remains
from vmsandbox.sandbox.holds import SAVES, Hold, Holds, own, owners_folder
from vmsandbox.sandbox.pool.shapes import holds as of_shape
from vmsandbox.sandbox.record import (
    STATE_CREATING,
    STATE_POOLED,
    SandboxFiles,
    SandboxRecord,
)
from vmsandbox.sandbox.reserve import HostView, taken
from vmsandbox.sandbox.suspend import settle as settle_save
from vmsandbox.sandbox.teardown import finish
from vmsandbox.validate import validate_name
from vmsandbox.vm.domain import DOMAIN_PREFIX
from vmsandbox.vm.hypervisor import Hypervisor, Stored
from vmsandbox.vm.process import Ownership, sweep_owner_files

Lock = Callable[[], contextlib.AbstractContextManager[None]]


@dataclass
class Report:
    removed: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    fabric_partitions: list[int] = field(default_factory=list)  # deactivated and forgotten
    settled: list[str] = field(default_factory=list)  # "name: state" of interrupted saves

    def to_dict(self) -> dict[str, list[str]]:
        return {
            "removed": sorted(set(self.removed)),
            "problems": self.problems,
            "fabric_partitions": [str(partition) for partition in sorted(self.fabric_partitions)],
            **({"settled": self.settled} if self.settled else {}),
        }


def reconcile(hypervisor: Hypervisor, config: Config, lock: Lock) -> Report:
    """Repair this state directory (see the module docstring); the view is read first, and
    any libvirt error while reading it propagates before anything is decided."""
    view = HostView(tuple(hypervisor.every_domain()))
    report = Report()
    fabric = FabricLease(config)
    leased = {lease.partition for lease in fabric.leases()}
    owner = own(config)
    try:
        with lock():
            targets = _decide(hypervisor, config, view, owner, report)
        for remains in targets:
            try:
                finish(remains, lock, fabric_too=False)  # the fabric pass below
                report.removed.append(remains.name)
            except VmSandboxError as exc:
                report.problems.append(f"{remains.name}: {exc.message}")
        if fabric.ledger.is_dir():  # most hosts never leased: no more work for them
            strays = _fabric(fabric, view, lock, report)
            left = {lease.partition for lease in fabric.leases()}
            report.fabric_partitions = sorted((leased | set(strays)) - left)
        report.problems += custody.reconcile(config, lock, view.domains)
    finally:
        owner.end()
    sweep_owner_files(owners_folder(config))
    return report


def _decide(
    hypervisor: Hypervisor, config: Config, view: HostView, owner: Ownership, report: Report
) -> list[Remains]:
    """Under the lock: what to take apart (its holds taken over by ``owner``), and the quick
    repairs done on the spot."""
    holds = Holds(config)
    current = holds.all()
    gone = holds.gone()
    listed = {stored.uuid: stored for stored in view.domains}
    targets: list[Remains] = []

    def take(hold: Hold, record: SandboxRecord | None) -> None:
        holds.put(replace(hold, owner=owner.identity, doing="reconcile"))
        files = SandboxFiles.of(config, hold.stem)
        name = record.name if record else hold.name
        targets.append(Remains(hypervisor, config, name, files, record, hold.uuid, owner))

    for hold in current.values():
        if hold.left_over and hold.doing in SAVES and hold.uuid in listed:
            # a suspend or resume killed halfway: finished or returned, never taken apart
            settled = settle_save(hypervisor, config, hold.uuid)
            report.settled.append(f"{hold.name}: {settled}")
        elif hold.left_over:
            stored = listed.get(hold.uuid)
            take(hold, _record(stored))
        elif (
            hold.owner is None
            and hold.uuid not in listed
            and _gone(hypervisor, hold.uuid, hold.domain)
        ):
            holds.drop(hold.uuid)  # removed by something other than vmsandbox
            report.removed.append(hold.name)
    for record, stored in view.ours(config):
        found = current.get(stored.uuid)
        if found is not None and found.owner:
            continue  # being worked on, or taken above
        if found is None and stored.uuid in gone and _gone(hypervisor, stored.uuid, stored.domain):
            continue  # undefined since the view was read
        legacy = found is None
        # A settled hold says its transition committed, whatever the (older) view's state;
        # only a sandbox made before reservations is judged by its record, read again now by
        # its UUID: one gone since the view gets nothing (its name may be a new create's).
        fresh = hypervisor.metadata(stored.domain, uuid=stored.uuid) if legacy else None
        if legacy and fresh is None:
            continue
        # made before reservations existed: it gets one now
        hold = holds.put(_backfill(config, record, stored)) if found is None else found
        creating = fresh is not None and fresh.state == STATE_CREATING
        if creating and record.creator is not None and record.creator.alive():
            continue  # a create from before reservations, still at work
        files = SandboxFiles.of(config, record.stem)
        missing = [str(p) for p in (files.overlay, files.seed, files.keys_dir) if not p.exists()]
        if not creating and not missing:
            continue
        if not creating and hypervisor.running(stored.domain, uuid=stored.uuid):
            report.problems.append(
                f"{record.name}: running, but its files are gone ({', '.join(missing)}); "
                f"remove it with 'vmsandbox destroy {record.name}'"
            )
            continue
        take(hold, record)
    stems = {hold.stem for hold in holds.all().values()}
    stems |= {record.stem for record, _stored in view.ours(config)}
    for name in sorted(names_on_disk(config) - stems):
        if hypervisor.metadata(DOMAIN_PREFIX + name) is not None:
            continue  # another state directory's domain of that name: its files are not these
        try:
            SandboxFiles.of(config, name).remove()
            report.removed.append(name)
        except VmSandboxError as exc:
            report.problems.append(f"{name}: {exc.message}")
    holds.forget_gone(gone - set(listed))
    return targets


def _record(stored: Stored | None) -> SandboxRecord | None:
    if stored is None or stored.data is None:
        return None
    try:
        return SandboxRecord.from_dict(stored.data)
    except VmSandboxError:
        return None


def _gone(hypervisor: Hypervisor, uuid: str, domain: str) -> bool:
    """Whether the domain ``uuid`` is gone now (a fresh lookup: the view may be older)."""
    stored = hypervisor.metadata(domain)
    return stored is None or stored.uuid != uuid


def _backfill(config: Config, record: SandboxRecord, stored: Stored) -> Hold:
    """The hold of a sandbox made before reservations existed, read from its domain."""
    pooled = stored.state == STATE_POOLED and record.guest is None
    shape = next((s for s in config.pool if pooled and of_shape(s, record)), None)
    return Hold(
        uuid=stored.uuid,
        name=record.name,
        stem=record.stem,
        gpus=stored.hostdevs,
        port=record.ssh.port,
        partition=record.fabric_partition,
        pool=shape.key if shape else None,
        image_id=record.image_id if shape else None,
    )


def _fabric(fabric: FabricLease, view: HostView, lock: Lock, report: Report) -> list[int]:
    """Deactivate partitions leased to a UUID that is neither a domain nor a reservation, or
    to a sandbox whose settled reservation names another partition or none (suspended, or
    settled with none of the partition's GPUs in its guest), and the strays (FM's active
    partitions nothing here explains, lease.py); the strays' ids."""
    config = fabric.config
    unchecked = ""
    try:  # read before the lock (fmpm is slow); a stray must still be one under it
        active = fabric.fmpm().list().active()
    except VmSandboxError as exc:
        active, unchecked = (), f"fabric partitions not checked for strays: {exc.message}"
    # Reservations and ledger read in one hold (fresh: the view still lists the domains taken
    # apart above, tombstones say which): a lease the reservations do not explain is not one
    # a create wrote since, since a create reserves before it leases.
    with lock():
        holds = Holds(config)
        reserved, gone = holds.all(), holds.gone()
        live = ({stored.uuid for stored in view.domains} - gone) | set(reserved)
        names = {s.domain.removeprefix(DOMAIN_PREFIX) for s in view.domains}
        names |= {hold.stem for hold in reserved.values()}
        settled = {uuid: hold.partition for uuid, hold in reserved.items() if hold.owner is None}
        orphans = fabric.orphans(live, names, settled)
        strays: list[int] = []
        if active:
            now = taken(view, holds)
            strays = fabric.claim_strays(active, now.partitions, now.holders)
    problems = fabric.release_orphans([*orphans, *strays])
    report.problems += problems or ([unchecked] if unchecked else [])  # FM down: said once
    return strays


def names_on_disk(config: Config) -> set[str]:
    """Sandbox names that have files in this state directory."""
    names: set[str] = set()
    if config.disks.is_dir():
        for path in config.disks.iterdir():
            stem = path.name.split(".", 1)[0]
            names.add(stem.removesuffix("-seed").removesuffix("-vars"))
    if config.sandboxes.is_dir():
        for path in config.sandboxes.iterdir():
            names.add(path.name.split(".", 1)[0])
    valid = set()
    for name in names:
        with contextlib.suppress(InvalidArgument):
            valid.add(validate_name(name))
    return valid
