"""Taking a sandbox apart (sandbox/teardown.py): what it holds stays held until its domain is
gone. On the fake hypervisor."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from framework.fake_hypervisor import FakeHypervisor, unit_config
from lxml import etree

from vmsandbox.gpu.record import GpuRecord
from vmsandbox.sandbox.holds import Holds
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.sandbox.record import SandboxRecord
from vmsandbox.sandbox.reserve import HostView, taken
from vmsandbox.sandbox.spec import SandboxSpec

GPU = GpuRecord("0000:41:00.0", "nvidia", "10de", "2330", companions=("0000:41:00.1",))
HOSTDEVS = "".join(
    "<hostdev mode='subsystem' type='pci' managed='yes'><source><address domain='0x0000' "
    f"bus='0x41' slot='0x00' function='0x{function}'/></source></hostdev>"
    for function in (0, 1)
)


def test_a_legacy_sandbox_keeps_its_gpus_and_partition_until_its_domain_is_gone(
    tmp_path: Path,
) -> None:
    """A sandbox made before reservations gets one when destroy takes it over; the view of a
    concurrent create then counts its GPUs from that hold, not from its domain. The hold must
    name them: with none, the GPUs looked free while QEMU still held them."""
    config = unit_config(tmp_path)
    hv = FakeHypervisor()
    manager = SandboxManager(config, hypervisor=hv, reconcile=False)
    made = manager.create(
        SandboxSpec(name="old", image="tiny", memory_mib=256, disk_gib=1), wait=False
    )
    dom = hv.domains["vmsbx-old"]
    record = replace(SandboxRecord.from_dict(dom.data or {}), gpus=(GPU,), fabric_partition=3)
    hv.set_metadata("vmsbx-old", record.to_dict(), "ready")
    dom.change(lambda root: root.find("devices").extend(etree.fromstring(f"<d>{HOSTDEVS}</d>")))
    with manager.locked():
        Holds(config).drop(made.uuid, tombstone=False)  # as before reservations existed
    seen: list[tuple[set[str], set[int]]] = []

    def look(_domain: str) -> None:  # a create's look and reservation, before the undefine
        now = taken(HostView(tuple(hv.every_domain())), Holds(config))
        seen.append((set(now.holders), set(now.partitions)))

    hv.before["undefine"] = look
    manager.destroy("old")
    assert seen == [({"0000:41:00.0", "0000:41:00.1"}, {3})]
