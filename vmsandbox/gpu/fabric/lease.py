"""A sandbox's Fabric Manager partition: activated before its domain starts, deactivated once
the domain is gone, and never left active by a crash.

The ledger is one file per partition vmsandbox activated, ``<state_dir>/fabric/<id>.json``
naming the sandbox. It is written under the host lock *before* fmpm activates the partition,
so a create killed at any point leaves either nothing or a ledger entry; reconcile (under the
same lock) deactivates every entry whose sandbox has no domain any more, which covers both a
partition recorded by a sandbox whose domain is gone and one left by a killed create. The
domain's record carries the partition id too (``fabric_partition``), for the user to see.

The version rule is checked before anything is activated: in shared NVSwitch mode the image's
NVIDIA driver must be Fabric Manager's release (``vmsandbox.gpu.fabric.version``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from vmsandbox.config import Config
from vmsandbox.errors import VmSandboxError
from vmsandbox.gpu.fabric.version import check_driver_matches, fm_version

if TYPE_CHECKING:
    from vmsandbox.gpu.fabric.fmpm import Fmpm


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
        self, partition_id: int, sandbox: str, *, image: str, image_driver: str | None
    ) -> None:
        """Under the host lock: check the version rule, record the lease, activate. A failed
        activation removes the record again, so nothing is left."""
        fm = self.config.fm_version or fm_version(self.config.fabric_manager)
        check_driver_matches(image, image_driver, fm)
        self.ledger.mkdir(mode=0o700, parents=True, exist_ok=True)
        entry = self._entry(partition_id)
        partial = entry.with_suffix(".partial")
        partial.write_text(json.dumps({"sandbox": sandbox, "partition": partition_id}) + "\n")
        os.replace(partial, entry)
        try:
            self.fmpm().activate(partition_id)
        except BaseException:
            entry.unlink(missing_ok=True)
            raise

    def release(self, sandbox: str) -> None:
        """Deactivate the partitions leased to ``sandbox`` (its domain is gone) and forget
        them; asks FM nothing when it has none. UNAVAILABLE when FM cannot be reached: the
        entries stay, for reconcile to finish."""
        self._release(pid for pid, name in self.leases().items() if name == sandbox)

    def reconcile(self, live: Iterable[str]) -> list[str]:
        """Release every lease whose sandbox is not in ``live`` (names with a domain); return
        the problems (FM unreachable is one, not an error: the leases stay for next time)."""
        alive = set(live)
        orphans = [pid for pid, name in self.leases().items() if name not in alive]
        try:
            self._release(orphans)
        except VmSandboxError as exc:
            return [f"fabric partitions {orphans}: {exc.message}"]
        return []

    def leases(self) -> dict[int, str]:
        """Partition id -> sandbox, from the ledger."""
        found: dict[int, str] = {}
        if self.ledger.is_dir():
            for path in self.ledger.glob("*.json"):
                try:
                    found[int(path.stem)] = str(json.loads(path.read_text())["sandbox"])
                except (ValueError, KeyError, TypeError, OSError):
                    continue  # not a ledger entry
        return found

    def _release(self, partition_ids: Iterable[int]) -> None:
        wanted = sorted(partition_ids)
        if not wanted:
            return
        fmpm = self.fmpm()
        active = {partition.id for partition in fmpm.list().active()}
        for partition_id in wanted:
            if partition_id in active:
                fmpm.deactivate(partition_id)
            self._entry(partition_id).unlink(missing_ok=True)

    def _entry(self, partition_id: int) -> Path:
        return self.ledger / f"{partition_id}.json"
