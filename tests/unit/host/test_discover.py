"""discover() on fake hosts (umockdev device files in tests/fixtures/hosts) and on this host."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
from framework.fake_hosts import probe

from vmsandbox.host import discover, pci_ids
from vmsandbox.host.discover import IOMMU_OFF

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
H100_BARS = [
    {"index": 0, "size": 16 * MIB, "is_64bit": False, "prefetchable": False},
    {"index": 1, "size": 128 * GIB, "is_64bit": True, "prefetchable": True},
    {"index": 3, "size": 32 * MIB, "is_64bit": True, "prefetchable": True},
]
# bdf, driver, numa node, IOMMU group, upstream port of the PCIe switch above it
HGX_GPUS = [
    ("0000:18:00.0", "vfio-pci", 0, 31, "0000:16:00.0"),
    ("0000:19:00.0", "vfio-pci", 0, 32, "0000:16:00.0"),
    ("0000:41:00.0", "nvidia", 0, 42, "0000:3f:00.0"),
    ("0000:42:00.0", "nvidia", 0, 43, "0000:3f:00.0"),
    ("0000:9a:00.0", "vfio-pci", 1, 53, "0000:98:00.0"),
    ("0000:9b:00.0", "nvidia", 1, 54, "0000:98:00.0"),
    ("0000:c1:00.0", "vfio-pci", 1, 64, "0000:bf:00.0"),
    ("0000:c2:00.0", "nvidia", 1, 65, "0000:bf:00.0"),
]
NVML_GPUS = {
    "0000:41:00.0": {
        "bus_id": "00000000:41:00.0",
        "name": "NVIDIA H100 80GB HBM3",
        "memory_mib": 81559,
        "uuid": "GPU-41",
        "pids": [],
    },
    "0000:42:00.0": {
        "bus_id": "00000000:42:00.0",
        "name": "NVIDIA H100 80GB HBM3",
        "memory_mib": 81559,
        "uuid": "GPU-42",
        "pids": [777, 777],
    },
    "0000:c2:00.0": {
        "bus_id": "00000000:C2:00.0",
        "name": "NVIDIA H100 80GB HBM3",
        "memory_mib": 81000,
        "uuid": "GPU-c2",
        "pids": [],
    },
}
BOOT_VGA = "it is the boot VGA device (boot_vga=1): the host console runs on it"


def gpu_by_bdf(inventory: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {gpu["bdf"]: gpu for gpu in inventory["gpus"]}


def fake_proc(root: Path) -> Path:
    """A /proc where pid 4242 holds /dev/nvidia2 (GPU 0000:41:00.0) open."""
    for bdf, minor in [("0000:41:00.0", 2), ("0000:c2:00.0", 7), ("0000:18:00.0", 0)]:
        info = root / "driver" / "nvidia" / "gpus" / bdf
        info.mkdir(parents=True)
        (info / "information").write_text(
            f"Model: \t\t NVIDIA H100 80GB HBM3\nIRQ:   \t\t 42\nDevice Minor: \t {minor}\n"
        )
    for pid, comm, targets in [
        (4242, "python3", ["/dev/null", "/dev/nvidiactl", "/dev/nvidia2"]),
        (4243, "bash", ["/dev/pts/0", "/dev/nvidia-uvm"]),
    ]:
        fd_dir = root / str(pid) / "fd"
        fd_dir.mkdir(parents=True)
        (root / str(pid) / "comm").write_text(f"{comm}\n")
        for fd, target in enumerate(targets):
            os.symlink(target, fd_dir / str(fd))
    (root / "5000").mkdir()  # a process that exited mid-scan: no fd directory
    (root / "self").mkdir()
    return root


@pytest.fixture(scope="module")
def hgx(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    proc = fake_proc(tmp_path_factory.mktemp("proc"))
    empty_proc = tmp_path_factory.mktemp("empty_proc")
    return probe(
        "hgx_h100",
        [
            {
                "in_use": {"0000:9B:00.0": "other-team-vm"},
                "nvml": {"init_error": "Driver Not Loaded"},
                "proc_root": str(empty_proc),
            },
            {"use_nvml": False, "proc_root": str(empty_proc)},
            {
                "nvml": {
                    "devices": [
                        NVML_GPUS["0000:41:00.0"],
                        NVML_GPUS["0000:42:00.0"],
                        {"error": "GPU is lost"},
                        NVML_GPUS["0000:c2:00.0"],
                    ]
                },
                "proc_root": str(empty_proc),
            },
            {"use_nvml": False, "proc_root": str(proc)},
            {"proc_root": str(empty_proc)},
        ],
    )


def test_hgx_lists_eight_h100_with_every_field(hgx: list[dict[str, Any]]) -> None:
    inventory = hgx[0]["inventory"]
    assert [gpu["bdf"] for gpu in inventory["gpus"]] == [row[0] for row in HGX_GPUS]
    for index, (bdf, driver, numa, group, switch) in enumerate(HGX_GPUS):
        assert inventory["gpus"][index] == {
            "bdf": bdf,
            "vendor": "nvidia",
            "vendor_id": "0x10de",
            "device_id": "0x2330",
            "class_id": "0x030200",
            "name": "GH100 [H100 SXM5 80GB]",
            "driver": driver,
            "numa_node": numa,
            "iommu_group": group,
            "group_members": [],
            "companions": [],
            "companion_ids": [],
            "bars": H100_BARS,
            "bar_64bit_prefetchable_total": 128 * GIB + 32 * MIB,
            "memory_mib": 81559,
            "memory_source": "pci-id",
            "uuid": None,
            "bindable": True,
            "reasons": [],
            "in_use_by": "other-team-vm" if bdf == "0000:9b:00.0" else None,
            "index": index,
            "pcie_switch": switch,
            "boot_vga": False,
            "drm_cards": [],
            "custody": "free",
            "custody_reason": "",
            "custody_since": "",
        }


def test_hgx_lists_nvswitches_as_fabric_only(hgx: list[dict[str, Any]]) -> None:
    inventory = hgx[0]["inventory"]
    assert inventory["fabric"] == [
        {
            "bdf": f"0000:{bus:02x}:00.0",
            "vendor": "nvidia",
            "vendor_id": "0x10de",
            "device_id": "0x22a3",
            "class_id": "0x068000",
            "name": "GH100 [H100 NVSwitch]",
            "driver": "nvidia",
            "numa_node": 0,
            "iommu_group": group,
            "in_use_by": None,
        }
        for bus, group in [(0x08, 20), (0x09, 21), (0x0A, 22), (0x0B, 23)]
    ]
    assert inventory["host"] == {
        "iommu": True,
        "pci_devices": 72,
        "gpus": 8,
        "bindable": 8,
        "free": 7,
        "fabric": 4,
        "nvml": False,
        "notes": ["NVML unavailable: Driver Not Loaded"],
        "unified_memory_mib": None,  # no GPU here uses the host's memory
    }


def test_hgx_without_nvml_has_no_note(hgx: list[dict[str, Any]]) -> None:
    host = hgx[1]["inventory"]["host"]
    assert (host["nvml"], host["notes"], host["free"]) == (False, [], 8)


def test_nvml_enrichment_through_the_seam(hgx: list[dict[str, Any]]) -> None:
    inventory = hgx[2]["inventory"]
    gpus = gpu_by_bdf(inventory)
    assert inventory["host"]["nvml"] is True
    assert inventory["host"]["notes"] == ["NVML could not read device 2: GPU is lost"]
    assert (gpus["0000:41:00.0"]["memory_mib"], gpus["0000:41:00.0"]["uuid"]) == (81559, "GPU-41")
    assert gpus["0000:41:00.0"]["memory_source"] == "nvml"
    assert (gpus["0000:c2:00.0"]["memory_mib"], gpus["0000:c2:00.0"]["uuid"]) == (81000, "GPU-c2")
    # hwdb names win over NVML's
    assert gpus["0000:41:00.0"]["name"] == "GH100 [H100 SXM5 80GB]"
    # NVML could not read 9b; vfio-pci GPUs are never NVML's: both fall back to the table
    for bdf in ["0000:9b:00.0", "0000:18:00.0"]:
        assert (gpus[bdf]["memory_source"], gpus[bdf]["uuid"]) == ("pci-id", None)
    # a process NVML reports on the GPU blocks it (no /proc entry: name unknown)
    assert gpus["0000:42:00.0"]["bindable"] is False
    assert gpus["0000:42:00.0"]["reasons"] == ["host processes hold it open: pid 777 (?)"]
    assert inventory["host"]["bindable"] == 7


def test_host_process_holding_dev_nvidia_blocks_the_gpu(hgx: list[dict[str, Any]]) -> None:
    gpus = gpu_by_bdf(hgx[3]["inventory"])
    assert gpus["0000:41:00.0"]["reasons"] == ["host processes hold it open: pid 4242 (python3)"]
    assert gpus["0000:41:00.0"]["bindable"] is False
    # minor 7 is open nowhere; GPU 18 is on vfio-pci, so its stale nvidia entry is not read
    assert gpus["0000:c2:00.0"]["bindable"] is True
    assert gpus["0000:18:00.0"]["bindable"] is True


def test_real_pynvml_answers_or_leaves_a_note(hgx: list[dict[str, Any]]) -> None:
    host = hgx[4]["inventory"]["host"]
    assert host["nvml"] is True or host["notes"][0].startswith("NVML unavailable: ")


def test_hgx_table(hgx: list[dict[str, Any]]) -> None:
    table = hgx[0]["table"]
    lines = table.splitlines()
    assert lines[0].split() == [
        "#",
        "BDF",
        "VENDOR",
        "NAME",
        "MEMORY",
        "NUMA",
        "GROUP",
        "DRIVER",
        "BINDABLE",
        "IN",
        "USE",
        "BY",
        "STATE",
    ]
    assert lines[6].split() == [
        "5",
        "0000:9b:00.0",
        "nvidia",
        "GH100",
        "[H100",
        "SXM5",
        "80GB]",
        "81559",
        "MiB",
        "1",
        "54",
        "nvidia",
        "yes",
        "other-team-vm",
        "free",
    ]
    assert "fabric (not passed to guests):" in lines
    assert sum("GH100 [H100 NVSwitch]" in line for line in lines) == 4
    assert "8 GPUs (8 bindable, 7 free), 4 fabric devices, 72 PCI devices scanned" in table
    assert "note: NVML unavailable: Driver Not Loaded" in lines


def test_workstation_card_takes_its_four_functions() -> None:
    [result] = probe("workstation_rtx2080ti", [{"use_nvml": False}])
    inventory = result["inventory"]
    card, igpu = inventory["gpus"]
    functions = ["0000:0a:00.1", "0000:0a:00.2", "0000:0a:00.3"]
    assert card == {
        "bdf": "0000:0a:00.0",
        "vendor": "nvidia",
        "vendor_id": "0x10de",
        "device_id": "0x1e07",
        "class_id": "0x030000",
        "name": "TU102 [GeForce RTX 2080 Ti Rev. A]",
        "driver": "nvidia",
        "numa_node": None,
        "iommu_group": 4,
        "group_members": functions,
        "companions": functions,
        "companion_ids": [["0x10de", "0x10f7"], ["0x10de", "0x1ad6"], ["0x10de", "0x1ad7"]],
        "bars": [
            {"index": 0, "size": 16 * MIB, "is_64bit": False, "prefetchable": False},
            {"index": 1, "size": 256 * MIB, "is_64bit": True, "prefetchable": True},
            {"index": 3, "size": 32 * MIB, "is_64bit": True, "prefetchable": True},
        ],
        "bar_64bit_prefetchable_total": 288 * MIB,
        "memory_mib": None,
        "memory_source": "unknown",
        "uuid": None,
        "bindable": True,
        "reasons": [],
        "in_use_by": None,
        "index": 0,
        "pcie_switch": None,
        "boot_vga": False,
        "drm_cards": [],
        "custody": "free",
        "custody_reason": "",
        "custody_since": "",
    }
    # The Cezanne iGPU counts as an AMD GPU, and is the boot VGA device.
    assert (igpu["bdf"], igpu["vendor"], igpu["boot_vga"]) == ("0000:30:00.0", "amd", True)
    assert igpu["group_members"] == ["0000:00:08.1", "0000:30:00.1"]
    assert igpu["companions"] == ["0000:30:00.1"]
    assert igpu["bars"][0] == {
        "index": 0,
        "size": 256 * MIB,
        "is_64bit": True,
        "prefetchable": True,
    }
    assert (igpu["bindable"], igpu["reasons"]) == (False, [BOOT_VGA])
    assert inventory["host"]["pci_devices"] == 13


def test_iommu_off() -> None:
    [result] = probe("iommu_off", [{"nvml": {"init_error": "Driver Not Loaded"}}])
    inventory = result["inventory"]
    [gpu] = inventory["gpus"]
    assert gpu["bdf"] == "0000:17:00.0"
    assert (gpu["iommu_group"], gpu["group_members"], gpu["companions"]) == (None, [], [])
    assert (gpu["bindable"], gpu["reasons"]) == (False, [IOMMU_OFF])
    assert gpu["reasons"] == [
        "IOMMU is off on this host (no PCI device has an iommu_group); "
        "enable intel_iommu=on or amd_iommu=on"
    ]
    # no hwdb on this host: the name comes from pci.ids, or the built-in table without one
    assert gpu["name"] == (pci_ids.device_name("0x10de", "0x27b8") or "NVIDIA L4")
    assert (gpu["memory_mib"], gpu["memory_source"]) == (23034, "pci-id")
    assert (gpu["numa_node"], gpu["pcie_switch"], gpu["bar_64bit_prefetchable_total"]) == (
        0,
        None,
        32 * GIB + 32 * MIB,
    )
    assert inventory["host"]["iommu"] is False
    assert "IOMMU off" in result["table"]


def test_group_shared_with_a_nic_blocks_the_gpu() -> None:
    [result] = probe("shared_group_nic", [{}])
    [gpu] = result["inventory"]["gpus"]
    nvme_class = pci_ids.class_name("0x010802") or "PCI class 0x010802"
    assert gpu["bdf"] == "0000:04:00.0"
    assert gpu["group_members"] == [
        "0000:00:1c.0",
        "0000:00:1c.4",
        "0000:00:1c.6",
        "0000:03:00.0",
        "0000:05:00.0",
    ]
    assert gpu["bindable"] is False
    assert gpu["reasons"] == [
        "IOMMU group 7 also holds 0000:03:00.0 (Ethernet controller, driver ixgbe), "
        "which is not a companion, a bridge or on vfio-pci",
        f"IOMMU group 7 also holds 0000:05:00.0 ({nvme_class}, no driver), "
        "which is not a companion, a bridge or on vfio-pci",
    ]
    assert (gpu["memory_mib"], gpu["memory_source"]) == (15360, "pci-id")
    assert "0 0000:04:00.0: IOMMU group 7 also holds 0000:03:00.0" in result["table"]


def test_gpu_and_audio_on_vfio_are_bindable() -> None:
    [result] = probe("vfio_bound", [{}])
    inventory = result["inventory"]
    [gpu] = inventory["gpus"]
    assert (gpu["bdf"], gpu["driver"], gpu["name"]) == (
        "0000:01:00.0",
        "vfio-pci",
        "GA102 [GeForce RTX 3090]",
    )
    assert gpu["group_members"] == ["0000:00:01.0", "0000:01:00.1"]
    assert (gpu["companions"], gpu["companion_ids"]) == (["0000:01:00.1"], [["0x10de", "0x1aef"]])
    assert (gpu["bindable"], gpu["reasons"]) == (True, [])
    assert (gpu["memory_mib"], gpu["memory_source"], gpu["numa_node"]) == (None, "unknown", None)
    # no GPU on the nvidia driver: NVML is not asked at all
    assert (inventory["host"]["nvml"], inventory["host"]["notes"]) == (False, [])


def test_mi300x() -> None:
    [result] = probe("mi300x", [{}])
    inventory = result["inventory"]
    [gpu] = inventory["gpus"]
    assert gpu == {
        "bdf": "0000:03:00.0",
        "vendor": "amd",
        "vendor_id": "0x1002",
        "device_id": "0x74a1",
        "class_id": "0x120000",
        "name": pci_ids.device_name("0x1002", "0x74a1") or "AMD Instinct MI300X",
        "driver": "amdgpu",
        "numa_node": 0,
        "iommu_group": 5,
        "group_members": [],
        "companions": [],
        "companion_ids": [],
        "bars": [
            {"index": 0, "size": 256 * GIB, "is_64bit": True, "prefetchable": True},
            {"index": 2, "size": 2 * MIB, "is_64bit": True, "prefetchable": True},
            {"index": 5, "size": 512 * KIB, "is_64bit": False, "prefetchable": False},
        ],
        "bar_64bit_prefetchable_total": 256 * GIB + 2 * MIB,
        "memory_mib": 196608,
        "memory_source": "pci-id",
        "uuid": "GPU-3f5a9c0e71b2d486",  # ROCm's: "GPU-" and amdgpu's sysfs unique_id
        "bindable": True,
        "reasons": [],
        "in_use_by": None,
        "index": 0,
        "pcie_switch": "0000:01:00.0",
        "boot_vga": False,
        "drm_cards": ["card1"],  # from the drm/ children of the function
        "custody": "free",
        "custody_reason": "",
        "custody_since": "",
    }
    # the BMC's ASPEED VGA is the boot device, and no GPU
    assert (inventory["fabric"], inventory["host"]["notes"]) == ([], [])


def test_host_process_holding_a_dri_node_blocks_an_amd_gpu(tmp_path: Path) -> None:
    """A GPU on a DRM driver (amdgpu, radeon) is held through /dev/dri/cardN or renderDN, not
    /dev/nvidiaN, which was all the inventory looked at."""
    fd_dir = tmp_path / "4321" / "fd"
    fd_dir.mkdir(parents=True)
    (tmp_path / "4321" / "comm").write_text("sleep\n")
    os.symlink("/dev/dri/renderD128", fd_dir / "0")
    held, free = probe("mi300x", [{"proc_root": str(tmp_path)}, {}])
    [gpu] = held["inventory"]["gpus"]
    assert gpu["reasons"] == ["host processes hold it open: pid 4321 (sleep)"]
    assert gpu["bindable"] is False
    assert free["inventory"]["gpus"][0]["bindable"] is True


def test_boot_vga_card_is_not_bindable() -> None:
    [result] = probe("boot_vga", [{"use_nvml": False}])
    [gpu] = result["inventory"]["gpus"]
    assert (gpu["bdf"], gpu["boot_vga"], gpu["companions"]) == (
        "0000:01:00.0",
        True,
        ["0000:01:00.1"],
    )
    assert (gpu["bindable"], gpu["reasons"]) == (False, [BOOT_VGA])
    assert (gpu["memory_mib"], gpu["memory_source"]) == (None, "unknown")


def test_bench_host_has_200_devices_and_8_gpus() -> None:
    [result] = probe("bench_200", [{"use_nvml": False}])
    host = result["inventory"]["host"]
    assert (host["pci_devices"], host["gpus"], host["fabric"], host["bindable"]) == (200, 8, 4, 8)


def _sysfs_text(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def test_this_host_real_sysfs() -> None:
    """On the development machine: no GPU, no IOMMU. Checked against sysfs on any machine."""
    inventory = discover(use_nvml=False)
    devices = sorted(Path("/sys/bus/pci/devices").iterdir())
    gpu_classes = {"0x10de": ("0x0300", "0x0302"), "0x1002": ("0x0300", "0x0380", "0x1200")}
    expected_gpus = [
        device.name
        for device in devices
        if _sysfs_text(device / "class")[:6] in gpu_classes.get(_sysfs_text(device / "vendor"), ())
    ]
    iommu = any((device / "iommu_group").exists() for device in devices)
    assert [gpu.bdf for gpu in inventory.gpus] == expected_gpus
    assert inventory.iommu is iommu
    assert inventory.pci_devices == len(devices)
    if not iommu:
        assert all(gpu.reasons[0] == IOMMU_OFF for gpu in inventory.gpus)


def test_each_thread_looks_at_the_host_through_a_udev_context_of_its_own() -> None:
    """libudev(3): an object belongs to the one thread that made it, for its whole life, and
    ``vmsandbox serve`` looks at the host from several RPC threads at once."""
    from vmsandbox.host import sysfs

    together = threading.Barrier(4)
    seen: list[tuple[object, object]] = []

    def look() -> None:
        first = sysfs.udev_context()
        together.wait(timeout=30)  # all four threads alive at once
        seen.append((first, sysfs.udev_context()))

    threads = [threading.Thread(target=look) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(seen) == 4
    assert all(first is again for first, again in seen)  # one per thread, kept
    assert len({id(first) for first, _ in seen}) == 4
