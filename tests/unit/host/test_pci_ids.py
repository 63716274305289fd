"""Built-in table of known GPUs and lookups in pci.ids (vmsandbox.host.pci_ids)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vmsandbox.host import pci_ids

# The layout of pci.ids: vendors, their devices (one tab), subsystems (two tabs), comments,
# and the class section at the end.
PCI_IDS = """\
#	List of PCI ID's
10de  NVIDIA Corporation
	1eb8  TU104GL [Tesla T4]
		10de 12a2  T4 16GB
# a comment inside a vendor block
	2330  GH100[H100 SXM5 80GB]
10df  Emulex Corporation
	2330  Not an NVIDIA part
1002  Advanced Micro Devices, Inc. [AMD/ATI]
	1638  Cezanne [Radeon Vega Series / Radeon Vega Mobile Series]
C 01  Mass storage controller
	08  Non-Volatile memory controller
		02  NVM Express
C 02  Network controller
	00  Ethernet controller
"""


@pytest.fixture
def ids_file(tmp_path: Path) -> str:
    path = tmp_path / "pci.ids"
    path.write_text(PCI_IDS)
    return str(path)


def test_device_names(ids_file: str) -> None:
    # Debian 12's pci.ids lacks the space before "[" in this one entry (defect 8h).
    assert pci_ids.device_name("0x10de", "0x2330", ids_file) == "GH100 [H100 SXM5 80GB]"
    assert pci_ids.device_name("0x10DE", "0x1EB8", ids_file) == "TU104GL [Tesla T4]"
    assert pci_ids.device_name("0x10df", "0x2330", ids_file) == "Not an NVIDIA part"
    # device ids are looked up in their vendor's block only
    assert pci_ids.device_name("0x1002", "0x2330", ids_file) is None
    assert pci_ids.device_name("0x1002", "0x74a1", ids_file) is None
    assert pci_ids.device_name("0x8086", "0x1533", ids_file) is None


def test_class_names(ids_file: str) -> None:
    assert pci_ids.class_name("0x020000", ids_file) == "Ethernet controller"
    assert pci_ids.class_name("0x010802", ids_file) == "Non-Volatile memory controller"
    assert pci_ids.class_name("0x030200", ids_file) is None


def test_missing_file(tmp_path: Path) -> None:
    missing = str(tmp_path / "absent.ids")
    assert pci_ids.device_name("0x10de", "0x2330", missing) is None
    assert pci_ids.class_name("0x020000", missing) is None


@pytest.mark.parametrize(
    ("device_id", "name", "memory_mib"),
    [
        ("0x2330", "NVIDIA H100 80GB HBM3", 81559),
        ("0x2331", "NVIDIA H100 PCIe", 81559),
        ("0x2335", "NVIDIA H200", 143771),
        ("0x20b0", "NVIDIA A100-SXM4-40GB", 40960),
        ("0x20f1", "NVIDIA A100-PCIE-40GB", 40960),
        ("0x20b2", "NVIDIA A100-SXM4-80GB", 81920),
        ("0x20b5", "NVIDIA A100 80GB PCIe", 81920),
        ("0x27b8", "NVIDIA L4", 23034),
        ("0x26b9", "NVIDIA L40S", 46068),
        ("0x2236", "NVIDIA A10", 23028),
        ("0x1eb8", "Tesla T4", 15360),
    ],
)
def test_known_nvidia_parts(device_id: str, name: str, memory_mib: int) -> None:
    assert pci_ids.known_part("0x10de", device_id) == (name, memory_mib)


def test_known_amd_part_and_unknown_ids() -> None:
    assert pci_ids.known_part("0x1002", "0x74a1") == ("AMD Instinct MI300X", 196608)
    assert pci_ids.known_part("0x10de", "0x1e07") is None
    assert pci_ids.known_part("0x1002", "0x2330") is None


@pytest.mark.parametrize(
    ("raw", "tidy"),
    [
        ("GH100[H100 SXM5 80GB]", "GH100 [H100 SXM5 80GB]"),
        ("GH100 [H100 NVSwitch]", "GH100 [H100 NVSwitch]"),
        ("Advanced Micro Devices, Inc. [AMD/ATI]", "Advanced Micro Devices, Inc. [AMD/ATI]"),
        ("[Radeon]", "[Radeon]"),
        ("T4 16GB", "T4 16GB"),
    ],
)
def test_tidy_name_puts_a_space_before_the_bracket(raw: str, tidy: str) -> None:
    assert pci_ids.tidy_name(raw) == tidy
