"""Reconcile: finish taking apart sandboxes that a killed or failed process left half-made.

Only sandboxes of this state directory are touched (their record names the keys folder kept
here); a domain without a vmsandbox record naming it is never ours.

Half-made: a domain still marked creating whose creator process is gone (a create, a pool
fill or a claim of a pooled guest) (``ProcessIdentity``:
a reused pid or a reboot is not its creator); files with no domain; a stopped domain whose
overlay, seed or keys are gone. A running domain whose files are gone is reported, not stopped.

Then the fabric ledger (``vmsandbox.gpu.fabric.lease``): a Fabric Manager partition leased to a
sandbox that has no domain any more (its domain was removed without the release, or a create
was killed between activation and ``define``) is deactivated. Fabric Manager unreachable is a
problem reported, not an error: the leases stay for the next reconcile.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from vmsandbox.config import Config
from vmsandbox.errors import InvalidArgument, VmSandboxError
from vmsandbox.gpu.fabric.lease import FabricLease
from vmsandbox.sandbox import lifecycle
from vmsandbox.sandbox.record import DOMAIN_PREFIX, STATE_CREATING, SandboxFiles, SandboxRecord
from vmsandbox.validate import validate_name
from vmsandbox.vm.hypervisor import Hypervisor


@dataclass
class Report:
    removed: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    fabric_partitions: list[int] = field(default_factory=list)  # deactivated and forgotten

    def to_dict(self) -> dict[str, list[str]]:
        return {
            "removed": sorted(set(self.removed)),
            "problems": self.problems,
            "fabric_partitions": [str(partition) for partition in sorted(self.fabric_partitions)],
        }


def reconcile(
    hypervisor: Hypervisor, config: Config, sandboxes: list[tuple[SandboxRecord, str]]
) -> Report:
    """Repair ``sandboxes`` (this state directory's records and states, read under the host
    lock, which the caller holds throughout) and remove files that belong to no domain."""
    report = Report()
    fabric = FabricLease(config)
    leased = set(fabric.leases())  # before the removals: theirs are released as they go
    known = set()
    for record, state in sandboxes:
        name = record.name
        known.add(record.stem)  # a claimed pooled guest's files keep the guest's name
        files = SandboxFiles.of(config, record.stem)
        creating = state == STATE_CREATING
        if creating and record.creator is not None and record.creator.alive():
            continue  # its creator is still at work
        missing = [str(p) for p in (files.overlay, files.seed, files.keys_dir) if not p.exists()]
        if not creating and not missing:
            continue
        remains = lifecycle.Remains(hypervisor, config, name, files, record)
        if not creating and hypervisor.running(remains.domain):
            report.problems.append(
                f"{name}: running, but its files are gone ({', '.join(missing)}); "
                f"remove it with 'vmsandbox destroy {name}'"
            )
            continue
        try:
            lifecycle.teardown(remains, contextlib.nullcontext)
            report.removed.append(name)
        except VmSandboxError as exc:
            report.problems.append(f"{name}: {exc.message}")
    for name in names_on_disk(config) - known:
        try:  # files only: a domain of that name, if any, is another state directory's
            SandboxFiles.of(config, name).remove()
            report.removed.append(name)
        except VmSandboxError as exc:
            report.problems.append(f"{name}: {exc.message}")
    if leased:  # most hosts have no fabric: no more libvirt calls for them
        domains = hypervisor.list(DOMAIN_PREFIX)
        report.problems += fabric.reconcile(d.domain.removeprefix(DOMAIN_PREFIX) for d in domains)
        report.fabric_partitions = sorted(leased - set(fabric.leases()))
    return report


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
