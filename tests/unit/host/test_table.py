"""The text table of `vmsandbox gpus` (vmsandbox.host.table)."""

from __future__ import annotations

from dataclasses import replace

from vmsandbox.host import FabricDevice, Gpu, Inventory, render_table
from vmsandbox.host.model import Bar

GPU = Gpu(
    bdf="0000:41:00.0",
    vendor="nvidia",
    vendor_id="0x10de",
    device_id="0x2330",
    class_id="0x030200",
    name="GH100 [H100 SXM5 80GB]",
    driver="vfio-pci",
    numa_node=0,
    iommu_group=42,
    group_members=(),
    companions=(),
    companion_ids=(),
    bars=(Bar(index=1, size=128 << 30, is_64bit=True, prefetchable=True),),
    bar_64bit_prefetchable_total=128 << 30,
    memory_mib=81559,
    memory_source="pci-id",
    uuid=None,
    bindable=True,
    reasons=(),
    in_use_by=None,
    index=0,
)
NVSWITCH = FabricDevice(
    bdf="0000:08:00.0",
    vendor="nvidia",
    vendor_id="0x10de",
    device_id="0x22a3",
    class_id="0x068000",
    name=None,
    driver="nvidia",
    numa_node=0,
    iommu_group=20,
)


def test_no_gpus_is_one_line() -> None:
    inventory = Inventory(gpus=(), fabric=(), iommu=False, pci_devices=6, nvml=False)
    assert (
        render_table(inventory) == "no GPUs found on this host (6 PCI devices scanned; IOMMU off)\n"
    )


def test_gpus_reasons_fabric_and_summary() -> None:
    blocked = replace(
        GPU,
        bdf="0000:42:00.0",
        index=1,
        name="A name much longer than the forty characters of the column",
        memory_mib=None,
        numa_node=None,
        driver="nvidia",
        bindable=False,
        reasons=("it is the boot VGA device (boot_vga=1): the host console runs on it",),
        in_use_by="sandbox-7",
        custody="assigned",
    )
    quarantined = replace(
        GPU,
        bdf="0000:43:00.0",
        index=2,
        custody="quarantined",
        custody_reason="AER: fatal error at its port 0000:40:01.0",
        custody_since="2026-01-02T03:04:05Z",
    )
    inventory = Inventory(
        gpus=(GPU, blocked, quarantined),
        fabric=(NVSWITCH,),
        iommu=True,
        pci_devices=72,
        nvml=False,
        notes=("NVML unavailable: Driver Not Loaded",),
    )
    assert render_table(inventory).splitlines() == [
        "#  BDF           VENDOR  NAME                                      MEMORY     NUMA  GROUP"
        "  DRIVER    BINDABLE  IN USE BY  STATE",
        "0  0000:41:00.0  nvidia  GH100 [H100 SXM5 80GB]                    81559 MiB  0     42"
        "     vfio-pci  yes       -          free",
        "1  0000:42:00.0  nvidia  A name much longer than the forty cha...  -          -     42"
        "     nvidia    no        sandbox-7  assigned",
        "2  0000:43:00.0  nvidia  GH100 [H100 SXM5 80GB]                    81559 MiB  0     42"
        "     vfio-pci  yes       -          quarantined",
        "",
        "not bindable:",
        "  1 0000:42:00.0: it is the boot VGA device (boot_vga=1): the host console runs on it",
        "",
        "not free (custody):",
        "  2 0000:43:00.0: quarantined since 2026-01-02T03:04:05Z: AER: fatal error at its port "
        "0000:40:01.0",
        "",
        "fabric (not passed to guests):",
        "BDF           VENDOR  NAME  NUMA  GROUP  DRIVER",
        "0000:08:00.0  nvidia  -     0     20     nvidia",
        "",
        "3 GPUs (2 bindable, 1 free), 1 fabric device, 72 PCI devices scanned; IOMMU on; "
        "NVML not used",
        "note: NVML unavailable: Driver Not Loaded",
    ]
