"""GPU passthrough in the domain XML (vmsandbox.gpu.passthrough).

Golden files in tests/golden/ hold the whole domain XML for GPUs chosen by the allocator on
the fake hosts; ``UPDATE_GOLDEN=1 pytest tests/unit/gpu/test_passthrough.py`` rewrites them. Every
generated document must validate against libvirt's RelaxNG schema and be accepted by
``defineXML`` on the real libvirtd (tests/libvirt/test_passthrough.py).
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import replace

import pytest
from framework.domains import (
    CASES,
    HGX_CPUS,
    full_passthrough_board,
    golden_case,
    gpu_domain_xml,
    small_bar_gpu,
)
from framework.paths import GOLDEN
from lxml import etree

from vmsandbox.gpu import passthrough
from vmsandbox.host.model import Bar, Gpu, Inventory

UPDATE = os.environ.get("UPDATE_GOLDEN") == "1"
MIB, GIB, TIB = 1 << 20, 1 << 30, 1 << 40


def cpu_of(
    root: etree._Element,
) -> tuple[dict[str, str], list[tuple[str, dict[str, str], str | None]]]:
    """The ``<cpu>`` element's attributes and its children as (tag, attributes, text)."""
    cpu = root.find("cpu")
    return dict(cpu.attrib), [(child.tag, dict(child.attrib), child.text) for child in cpu]


def check_golden(name: str, xml: str) -> None:
    path = GOLDEN / f"{name}.xml"
    if UPDATE:
        path.write_text(xml)
    assert xml == path.read_text(), f"{path} differs; UPDATE_GOLDEN=1 rewrites it"


# -- golden domains ------------------------------------------------------------------------


@pytest.mark.parametrize("name", CASES)
def test_golden_domain(name: str, hosts: dict[str, Inventory], schema: etree.RelaxNG) -> None:
    _, xml = golden_case(name, hosts)
    check_golden(name, xml)
    assert schema.validate(etree.fromstring(xml.encode())), schema.error_log


def test_golden_files_have_the_expected_shape() -> None:
    one = etree.parse(str(GOLDEN / "hgx_h100_1gpu.xml")).getroot()
    assert cpu_of(one) == (
        {"mode": "host-passthrough", "check": "none", "migratable": "off"},
        [("maxphysaddr", {"mode": "passthrough"}, None)],
    )
    assert [pin.get("cpuset") for pin in one.iterfind("cputune/vcpupin")] == ["0-55,112-167"] * 8
    assert one.find("numatune/memory").attrib == {"mode": "strict", "nodeset": "0"}
    eight = etree.parse(str(GOLDEN / "hgx_h100_8gpu.xml")).getroot()
    # TCG: QEMU's own model, with 1 GiB pages and the address width the window needs
    assert cpu_of(eight) == (
        {"mode": "custom", "match": "exact", "check": "none"},
        [
            ("model", {"fallback": "forbid"}, "qemu64"),
            ("feature", {"policy": "require", "name": "pdpe1gb"}, None),
            ("maxphysaddr", {"mode": "emulate", "bits": "42"}, None),
        ],
    )
    assert eight.find("cputune") is None and eight.find("numatune") is None
    ports = eight.findall("devices/controller[@model='pcie-root-port']")
    assert [port.get("index") for port in ports] == [str(i) for i in range(1, 9)]
    buses = [a.get("bus") for a in eight.iterfind("devices/hostdev/address")]
    assert buses == [f"0x{i:02x}" for i in range(1, 9)]


def test_golden_full_passthrough_board_passes_every_nvswitch(
    hosts: dict[str, Inventory], schema: etree.RelaxNG
) -> None:
    got, xml = full_passthrough_board(hosts)
    check_golden("hgx_h100_8gpu_nvswitch", xml)
    root = etree.fromstring(xml.encode())
    assert schema.validate(root), schema.error_log
    # the GPUs' ports first (1-8), then one port per NVSwitch (9-12)
    ports = root.findall("devices/controller[@model='pcie-root-port']")
    assert [port.get("index") for port in ports] == [str(i) for i in range(1, 13)]
    sources = [
        "0000:{}:{}.{}".format(*(a.get(k)[2:] for k in ("bus", "slot", "function")))
        for a in root.iterfind("devices/hostdev/source/address")
    ]
    assert sources[8:] == [device.bdf for device in got.switches]
    buses = [a.get("bus") for a in root.iterfind("devices/hostdev/address")]
    assert buses == [f"0x{i:02x}" for i in range(1, 13)]
    # the switches change neither the 64-bit window nor the memory limit
    eight = etree.parse(str(GOLDEN / "hgx_h100_8gpu.xml")).getroot()
    for path in ("memtune/hard_limit", "devices/controller[@model='pcie-root']/pcihole64"):
        assert root.findtext(path) == eight.findtext(path)


# -- the numbers ---------------------------------------------------------------------------


def test_mmio64_window(hosts: dict[str, Inventory]) -> None:
    h100s = list(hosts["hgx_h100"].gpus)
    assert passthrough.mmio64_window(h100s[:1]) == 256 * GIB
    assert passthrough.mmio64_window(h100s[:2]) == 512 * GIB
    assert passthrough.mmio64_window(h100s[:3]) == 1 * TIB
    assert passthrough.mmio64_window(h100s) == 2 * TIB
    # 288 MiB of BARs: OVMF's default 32 GiB is never shrunk
    assert passthrough.mmio64_window(hosts["workstation_rtx2080ti"].gpus[:1]) == 32 * GIB
    # 256 GiB + 2 MiB
    assert passthrough.mmio64_window(hosts["mi300x"].gpus) == 512 * GIB


def test_mmio64_window_leaves_room_for_padded_root_ports(hosts: dict[str, Inventory]) -> None:
    h100 = hosts["hgx_h100"].gpus[0]
    bars = tuple(Bar(i, size * GIB, True, True) for i, size in ((0, 128), (2, 64), (4, 32)))
    big = [
        replace(h100, bdf=f"0000:{bus:02x}:00.0", bars=bars, bar_64bit_prefetchable_total=224 * GIB)
        for bus in range(8)
    ]
    # their windows end at 7 x 256 + 224 = 2016 GiB: 1 GiB and eight root ports padded to
    # 8 GiB each no longer fit in 2 TiB
    assert passthrough.mmio64_window(big) == 4 * TIB


def test_phys_bits() -> None:
    assert passthrough.phys_bits(16384, 256 * GIB) == 40  # never below QEMU's default
    # RAM and hole reach the HyperTransport range, RAM moves to 1 TiB: the 2 TiB window at
    # 2 TiB ends at 4 TiB, 42 bits
    assert passthrough.phys_bits(128 * 1024, 2 * TIB) == 42
    # with 2 TiB of RAM the window sits at 4 TiB: 6 TiB needs 43 bits
    assert passthrough.phys_bits(2 * 1024 * 1024, 2 * TIB) == 43
    # 1 GiB of RAM above 4 GiB moves to 1 TiB: the hole ends past 2 TiB
    assert passthrough.phys_bits(3072, 1 * TIB) == 42


def start_qemu(memory_mib: int, window: int, bits: int) -> subprocess.CompletedProcess[str]:
    """Start (stopped) and quit a TCG q35 guest with this memory, 64-bit hole and width."""
    return subprocess.run(
        [
            "qemu-system-x86_64",
            *("-machine", "q35,accel=tcg", "-cpu", f"qemu64,phys-bits={bits}"),
            *("-m", str(memory_mib), "-global", f"q35-pcihost.pci-hole64-size={window}"),
            *("-nodefaults", "-display", "none", "-S", "-monitor", "stdio"),
        ],
        input="quit\n",
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    ("memory_mib", "window"), [(3072, 1 * TIB), (1024, 2 * TIB), (4096, 256 * GIB)]
)
def test_qemu_accepts_the_address_width(memory_mib: int, window: int) -> None:
    result = start_qemu(memory_mib, window, passthrough.phys_bits(memory_mib, window))
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(("memory_mib", "window"), [(3072, 1 * TIB), (1024, 2 * TIB)])
def test_qemu_refuses_one_bit_less(memory_mib: int, window: int) -> None:
    result = start_qemu(memory_mib, window, passthrough.phys_bits(memory_mib, window) - 1)
    assert "phys-bits too low" in result.stderr


def test_hard_limit_is_guest_memory_and_qemu_not_the_bars(hosts: dict[str, Inventory]) -> None:
    [h100] = hosts["hgx_h100"].gpus[:1]
    kvm = passthrough.plan([h100], vcpus=2, memory_mib=16384, virt_type="kvm", host_cpus=None)
    assert kvm.hard_limit_kib * 1024 == 16 * GIB + 1 * GIB
    tcg = passthrough.plan([h100], vcpus=2, memory_mib=16384, virt_type="qemu", host_cpus=None)
    assert tcg.hard_limit_kib == kvm.hard_limit_kib + 1024 * 1024


def test_no_gpus_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="at least one GPU"):
        passthrough.plan([], vcpus=1, memory_mib=1024, virt_type="kvm", host_cpus=None)


# -- pinning -------------------------------------------------------------------------------


def test_pinning_follows_the_gpus_node(hosts: dict[str, Inventory]) -> None:
    hgx = hosts["hgx_h100"].gpus

    def pinned(gpus: list[Gpu], **kwargs: object) -> tuple[int | None, str | None, str | None]:
        args = {"vcpus": 2, "memory_mib": 1024, "virt_type": "kvm", "host_cpus": HGX_CPUS}
        plan = passthrough.plan(gpus, **(args | kwargs))
        return plan.numa_node, plan.cpuset, plan.unpinned_reason

    assert pinned(list(hgx[4:6])) == (1, "56-111,168-223", None)
    assert pinned(list(hgx[3:5])) == (
        None,
        None,
        "the GPUs sit on different NUMA nodes (0, 1)",
    )
    assert pinned(list(hgx[:1]), pin=False) == (None, None, "pinning was not asked for")
    assert pinned(list(hgx[:1]), host_cpus=None) == (
        None,
        None,
        "no host CPUs are known for NUMA node 0",
    )
    assert pinned(list(hgx[:1]), host_cpus={0: [], 1: [1]})[2] == (
        "no host CPUs are known for NUMA node 0"
    )
    workstation = list(hosts["workstation_rtx2080ti"].gpus[:1])
    assert pinned(workstation)[2] == "the GPUs' NUMA node is unknown"
    assert pinned([*workstation, hgx[0]])[2] == (
        "the GPUs sit on different NUMA nodes (0, unknown)"
    )


# -- apply on other domain shapes ----------------------------------------------------------


def test_companions_share_one_guest_slot(hosts: dict[str, Inventory]) -> None:
    card = hosts["workstation_rtx2080ti"].gpus[0]
    root = etree.fromstring(
        gpu_domain_xml([card], "companions", "qemu", 2, 2048, host_cpus=None).encode()
    )
    hostdevs = root.findall("devices/hostdev")
    assert [h.find("source/address").get("function") for h in hostdevs] == [
        "0x0",
        "0x1",
        "0x2",
        "0x3",
    ]
    guest = [h.find("address").attrib for h in hostdevs]
    assert {(a["bus"], a["slot"]) for a in guest} == {("0x01", "0x00")}
    assert [a["function"] for a in guest] == ["0x0", "0x1", "0x2", "0x3"]
    assert [a.get("multifunction") for a in guest] == ["on", None, None, None]
    assert cpu_of(root)[1][-1] == ("maxphysaddr", {"mode": "emulate", "bits": "40"}, None)


def test_balloon_is_added_when_missing(hosts: dict[str, Inventory]) -> None:
    def drop_balloon(root: etree._Element) -> None:
        root.find("devices").remove(root.find("devices/memballoon"))

    xml = gpu_domain_xml(
        list(hosts["mi300x"].gpus), "balloon", "kvm", 2, 2048, extra=[drop_balloon]
    )
    devices = etree.fromstring(xml.encode()).find("devices")
    assert [child.tag for child in devices][-2:] == ["hostdev", "memballoon"]
    assert devices.find("memballoon").get("model") == "none"


def test_apply_needs_a_pcie_root(hosts: dict[str, Inventory]) -> None:
    plan = passthrough.plan(
        hosts["mi300x"].gpus, vcpus=1, memory_mib=1024, virt_type="kvm", host_cpus=None
    )
    root = etree.fromstring(
        b"<domain><devices><controller type='pci' model='pci-root'/></devices></domain>"
    )
    with pytest.raises(ValueError, match="needs a q35 domain with a pcie-root"):
        passthrough.apply(root, plan)


# -- host CPU topology ---------------------------------------------------------------------


# -- firmware ------------------------------------------------------------------------------


def test_auto_firmware_is_seabios_only_for_small_bars(hosts: dict[str, Inventory]) -> None:
    h100, other = hosts["hgx_h100"].gpus[:2]
    assert passthrough.choose_firmware([h100]) == "uefi"
    small = [small_bar_gpu(h100), small_bar_gpu(other)]
    assert passthrough.choose_firmware(small) == "bios"
    assert passthrough.choose_firmware(small, "uefi") == "uefi"
    assert passthrough.choose_firmware([h100], "bios") == "bios"
    # the budget counts every BAR of every GPU: sixteen such cards are past it
    assert passthrough.choose_firmware([small_bar_gpu(h100)] * 16) == "uefi"
