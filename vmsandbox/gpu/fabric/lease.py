"""A sandbox's Fabric Manager partition: activated before its domain starts, deactivated once
the domain is gone, and never left active by a crash or a timeout.

The ledger is one file per partition vmsandbox activated, ``<state_dir>/fabric/<id>.json``,
naming the sandbox by its immutable identity, the UUID of its domain (and, for people, its
name): a claimed pooled guest keeps its domain's name but is another sandbox, and a name can
be used again. The entry is written *before* fmpm activates the partition, so a create killed
at any point leaves either nothing or an entry. It is removed only when the partition is known
inactive: after a deactivation, or when FM refused the activation; an fmpm that timed out or
could not be reached may have activated it, so the entry stays and the release (or reconcile)
deactivates it. Reconcile deactivates every entry whose UUID belongs to no domain and to no
reservation in flight (``vmsandbox.sandbox.holds``), and every entry of a sandbox whose
settled reservation names another partition or none (a suspended sandbox gave its partition
back: the entry is one its suspend could not deactivate), deciding which from the ledger and
the reservations read in one hold of the host lock (``orphans``): a create or a resume writes
its reservation before its lease, and a suspend forgets the partition in its reservation only
after its lease, so a lease that the reservations do not explain is never one in use.
A partition FM has active that nothing of vmsandbox explains (no lease, no reservation or
domain naming it, none of its GPUs held by a domain) is a stray: an fmpm activation whose
create was killed can land after reconcile released its lease (FM was still activating it).
Reconcile leases each stray under the lock (``claim_strays``, UUID ``STRAY``) and deactivates
it like an orphan; a reconcile killed halfway leaves that lease, an orphan for the next one.
An entry counts as taken for the allocation until it is removed (``vmsandbox.sandbox.reserve``),
so the partition of an orphan is not handed to a new sandbox while reconcile deactivates it.
The domain's record carries the partition id too (``fabric_partition``), for the user to see.

The version rule is checked before anything is activated: in shared NVSwitch mode the image's
NVIDIA driver must be Fabric Manager's release (``vmsandbox.gpu.fabric.version``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from vmsandbox.config import Config
from vmsandbox.errors import FailedPrecondition, Unavailable, VmSandboxError
from vmsandbox.gpu.fabric.version import check_driver_matches, fm_version

if TYPE_CHECKING:
    from vmsandbox.gpu.fabric.fmpm import Fmpm
    from vmsandbox.gpu.fabric.partitions import Partition

STRAY = "stray"  # the UUID of a stray's lease (claim_strays): never a domain's


@dataclass(frozen=True)
class Lease:
    """One ledger entry: the partition, the sandbox's domain UUID and its name. ``uuid`` is
    empty in entries written before leases named UUIDs (they are matched by name)."""

    partition: int
    uuid: str
    sandbox: str


@dataclass(frozen=True)
class FabricLease:
    """Activation and release of partitions through fmpm, remembered in the ledger of
    ``config``'s state directory. Reading the ledger loads nothing else: the manager asks it
    on every destroy and reconcile, and only hosts with leases pay for fmpm and discovery."""

    config: Config

    @property
    def ledger(self) -> Path:
        return self.config.state_dir / "fabric"

    def fmpm(self) -> Fmpm:
        from vmsandbox.gpu.fabric.state import client

        return client(self.config)

    def activate(
        self,
        partition_id: int,
        uuid: str,
        sandbox: str,
        *,
        image: str,
        image_driver: str | None,
    ) -> None:
        """Check the version rule, record the lease, activate. A refusal by FM (the partition
        was not activated) removes the entry again; any other failure keeps it for the
        release, since FM may have activated the partition all the same."""
        fm = self.config.fm_version or fm_version(self.config.fabric_manager)
        check_driver_matches(image, image_driver, fm)
        entry = self._write(partition_id, uuid, sandbox)
        try:
            self.fmpm().activate(partition_id)
        except FailedPrecondition:
            entry.unlink(missing_ok=True)  # FM refused: nothing was activated
            raise
        except Unavailable as exc:
            exc.add_note(
                f"the lease of partition {partition_id} is kept: FM may have activated it; "
                "the create's cleanup or reconcile deactivates it"
            )
            raise

    def release(self, uuid: str, sandbox: str = "") -> None:
        """Deactivate the partitions leased to the sandbox with domain UUID ``uuid`` (entries
        from before UUIDs: to ``sandbox`` by name) and forget them; asks FM nothing when it
        has none. UNAVAILABLE when FM cannot be reached: the entries stay, for reconcile."""
        self._release(lease.partition for lease in self.leases() if _names(lease, uuid, sandbox))

    def orphans(
        self,
        live: Iterable[str],
        live_names: Iterable[str] = (),
        settled: Mapping[str, int | None] | None = None,
    ) -> list[int]:
        """The partitions of leases whose UUID is not in ``live`` (the UUIDs of every domain
        and every reservation; entries from before UUIDs: whose name is not in
        ``live_names``), and of leases whose UUID has a settled reservation that names another
        partition or none (``settled``: UUID -> its partition; a suspended sandbox, or one
        whose guest holds none of the partition's GPUs any more). ``live`` and ``settled``
        must be read in the same hold of the host lock as this (see the module docstring)."""
        alive, named, kept = set(live), set(live_names), dict(settled or {})
        return [
            lease.partition
            for lease in self.leases()
            if (lease.uuid not in alive if lease.uuid else lease.sandbox not in named)
            or (lease.uuid in kept and kept[lease.uuid] != lease.partition)
        ]

    def claim_strays(
        self,
        active: Iterable[Partition],
        taken: Container[int],
        holders: Container[str],
    ) -> list[int]:
        """Under the host lock: the partitions of ``active`` (FM's, read before the lock)
        that no lease and nothing ``taken`` names (reservations, domain records) and none of
        whose GPUs a domain holds (``holders``: BDFs), each given a lease of UUID STRAY so
        that no create takes it while ``release_orphans`` deactivates it."""
        leased = {lease.partition for lease in self.leases()}
        strays = [
            partition.id
            for partition in active
            if partition.id not in leased
            and partition.id not in taken
            and not any(bdf in holders for bdf in partition.bdfs)
        ]
        for partition_id in strays:
            self._write(partition_id, STRAY, "(active with no lease)")
        return strays

    def release_orphans(self, orphans: Iterable[int]) -> list[str]:
        """Deactivate and forget the partitions ``orphans`` decided (outside the host lock:
        fmpm is slow); the problems (FM unreachable is one, not an error: the leases stay
        for next time)."""
        wanted = sorted(set(orphans))
        try:
            self._release(wanted)
        except VmSandboxError as exc:
            return [f"fabric partitions {wanted}: {exc.message}"]
        return []

    def leases(self) -> list[Lease]:
        """The ledger's entries."""
        found: list[Lease] = []
        if self.ledger.is_dir():
            for path in self.ledger.glob("*.json"):
                try:
                    data = json.loads(path.read_text())
                    found.append(
                        Lease(int(path.stem), str(data.get("uuid", "")), str(data["sandbox"]))
                    )
                except (ValueError, KeyError, TypeError, AttributeError, OSError):
                    continue  # not a ledger entry
        return sorted(found, key=lambda lease: lease.partition)

    def _release(self, partition_ids: Iterable[int]) -> None:
        wanted = sorted(set(partition_ids))
        if not wanted:
            return
        fmpm = self.fmpm()
        active = {partition.id for partition in fmpm.list().active()}
        for partition_id in wanted:
            if partition_id in active:
                try:
                    fmpm.deactivate(partition_id)
                except FailedPrecondition:
                    # FM refused: fine when another release deactivated it meanwhile
                    if partition_id in {p.id for p in fmpm.list().active()}:
                        raise
            self._entry(partition_id).unlink(missing_ok=True)

    def _write(self, partition_id: int, uuid: str, sandbox: str) -> Path:
        """The ledger entry of ``partition_id``, written whole (a reader never sees half)."""
        self.ledger.mkdir(mode=0o700, parents=True, exist_ok=True)
        entry = self._entry(partition_id)
        partial = entry.with_suffix(".partial")
        data = {"partition": partition_id, "uuid": uuid, "sandbox": sandbox}
        partial.write_text(json.dumps(data) + "\n")
        os.replace(partial, entry)
        return entry

    def _entry(self, partition_id: int) -> Path:
        return self.ledger / f"{partition_id}.json"


def _names(lease: Lease, uuid: str, sandbox: str) -> bool:
    return lease.uuid == uuid if lease.uuid else bool(sandbox) and lease.sandbox == sandbox
