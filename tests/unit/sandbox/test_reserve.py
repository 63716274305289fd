"""What a reservation counts as taken, under the host lock (sandbox/reserve.py)."""

from __future__ import annotations

import json
from pathlib import Path

from framework.fake_hypervisor import unit_config

from vmsandbox.lock import host_lock
from vmsandbox.sandbox.holds import Hold, Holds
from vmsandbox.sandbox.reserve import HostView, taken


def test_a_partition_in_the_lease_ledger_stays_taken_until_its_lease_is_gone(
    tmp_path: Path,
) -> None:
    """An orphan's lease (its sandbox gone, reconcile about to deactivate it outside the lock)
    keeps its partition from the next allocation: that one would otherwise be activated and
    then deactivated under its new guest."""
    config = unit_config(tmp_path)
    ledger = config.state_dir / "fabric"
    ledger.mkdir(parents=True)
    orphan = {"partition": 4, "uuid": "5b0f6a1c-0000-4000-8000-000000000004", "sandbox": "gone"}
    (ledger / "4.json").write_text(json.dumps(orphan))
    with host_lock(config.lock_path, config.lock_timeout, "test"):
        holds = Holds(config)
        holds.put(Hold("5b0f6a1c-0000-4000-8000-000000000003", "live", "live", partition=3))
        now = taken(HostView(()), holds)
    assert now.partitions == {3: "vmsbx-live", 4: "vmsbx-gone"}
