"""GPU passthrough in the domain XML (vmsandbox.gpu.passthrough) and host CPU topology (numa).

Golden files in tests/golden/ hold the whole domain XML for GPUs chosen by the allocator on
the fake hosts; ``UPDATE_GOLDEN=1 pytest tests/test_passthrough.py`` rewrites them. Every
generated document must validate against libvirt's RelaxNG schema and be accepted by
``defineXML`` on the real libvirtd (defined under a test name, then undefined).
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path

import libvirt
import pytest
from hypothesis import given
from hypothesis import strategies as st
from lxml import etree
from test_allocator import discover_hosts

from vmsandbox.gpu import passthrough
from vmsandbox.gpu.allocator import Allocation, select
from vmsandbox.gpu.fabric.mode import FULL_PASSTHROUGH, FabricMode
from vmsandbox.gpu.fabric.policy import allocate
from vmsandbox.gpu.fabric.state import Fabric
from vmsandbox.gpu.request import GpuRequest
from vmsandbox.host.model import Bar, Gpu, Inventory
from vmsandbox.host.numa import format_cpuset, host_cpus_by_node, parse_cpulist
from vmsandbox.vm.domain import QEMU_NS, DomainPlan, build_domain_xml

GOLDEN = Path(__file__).resolve().parent / "golden"
SCHEMA = Path("/usr/share/libvirt/schemas/domain.rng")
UPDATE = os.environ.get("UPDATE_GOLDEN") == "1"
MIB, GIB, TIB = 1 << 20, 1 << 30, 1 << 40
STATE = Path("/var/lib/vmsandbox/sandboxes/golden")
# Two Sapphire Rapids sockets, 56 cores each with hyper-threads, as sysfs lists them.
HGX_CPUS = {0: parse_cpulist("0-55,112-167"), 1: parse_cpulist("56-111,168-223")}
# name: fake host, request, virt type, vCPUs, memory in MiB
CASES = {
    "hgx_h100_1gpu": ("hgx_h100", GpuRequest(count=1), "kvm", 8, 32768),
    "hgx_h100_2gpu": ("hgx_h100", GpuRequest(count=2), "kvm", 16, 65536),
    "hgx_h100_8gpu": ("hgx_h100", GpuRequest(count=8), "qemu", 32, 262144),
    "workstation_rtx2080ti": ("workstation_rtx2080ti", GpuRequest(), "kvm", 4, 8192),
}


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Inventory]:
    case = {"use_nvml": False, "proc_root": str(tmp_path_factory.mktemp("proc"))}
    names = ["hgx_h100", "workstation_rtx2080ti", "mi300x"]
    return discover_hosts({name: (name, case) for name in names})


@pytest.fixture(scope="module")
def schema() -> etree.RelaxNG:
    return etree.RelaxNG(etree.parse(str(SCHEMA)))


@pytest.fixture(scope="module")
def conn() -> Iterator[libvirt.virConnect]:
    connection = libvirt.open("qemu:///system")
    yield connection
    connection.close()


def domain_plan(
    name: str, virt_type: str, cpus: int, memory_mib: int, **extra: object
) -> DomainPlan:
    """A DomainPlan with fixed names, paths and UUID, as the manager builds one for GPUs."""
    return DomainPlan(
        domain_name=f"vmsbx-{name.replace('_', '-')}",
        uuid="5f0c2a9e-41d3-4b7e-9c1a-0123456789ab",
        virt_type=virt_type,
        cpus=cpus,
        memory_mib=memory_mib,
        overlay=STATE / "disk.qcow2",
        seed=STATE / "seed.img",
        console_log=STATE / "console.log",
        record={"name": name, "image": "minimal", "state": "creating"},
        ssh_port=2222,
        uefi=True,
        nvram=STATE / "OVMF_VARS.fd",
        ovmf_code=Path("/usr/share/OVMF/OVMF_CODE_4M.fd"),
        ovmf_vars=Path("/usr/share/OVMF/OVMF_VARS_4M.fd"),
        **extra,
    )


def gpu_domain_xml(
    gpus: list[Gpu],
    name: str,
    virt_type: str,
    cpus: int,
    memory_mib: int,
    *,
    host_cpus: dict[int, list[int]] | None = HGX_CPUS,
    switches: tuple[str, ...] = (),
    **extra: object,
) -> str:
    plan = passthrough.plan(
        gpus,
        vcpus=cpus,
        memory_mib=memory_mib,
        virt_type=virt_type,
        host_cpus=host_cpus,
        switches=switches,
    )
    domain = domain_plan(name, virt_type, cpus, memory_mib, **extra)
    domain.extra.append(partial(passthrough.apply, plan=plan))
    return build_domain_xml(domain)


def define_and_undefine(conn: libvirt.virConnect, xml: str) -> etree._Element:
    """Define ``xml`` under a fresh test name and UUID; libvirt's own XML of it, undefined."""
    root = etree.fromstring(xml.encode())
    root.find("name").text = f"vmsbx-test-{uuid.uuid4().hex[:8]}"
    root.find("uuid").text = str(uuid.uuid4())
    domain = conn.defineXML(etree.tostring(root, encoding="unicode"))
    try:
        return etree.fromstring(domain.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE).encode())
    finally:
        domain.undefineFlags(libvirt.VIR_DOMAIN_UNDEFINE_NVRAM)


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


def golden_case(name: str, hosts: dict[str, Inventory]) -> tuple[list[Gpu], str]:
    """The GPUs the allocator picks for case ``name``, and the domain XML for them."""
    host, request, virt_type, cpus, memory_mib = CASES[name]
    gpus = select(request, hosts[host])
    return gpus, gpu_domain_xml(gpus, name, virt_type, cpus, memory_mib)


@pytest.mark.parametrize("name", CASES)
def test_golden_domain(name: str, hosts: dict[str, Inventory], schema: etree.RelaxNG) -> None:
    _, xml = golden_case(name, hosts)
    check_golden(name, xml)
    assert schema.validate(etree.fromstring(xml.encode())), schema.error_log


@pytest.mark.libvirt
@pytest.mark.parametrize("name", CASES)
def test_golden_domain_defines_on_libvirtd(
    name: str, hosts: dict[str, Inventory], conn: libvirt.virConnect
) -> None:
    gpus, xml = golden_case(name, hosts)
    defined = define_and_undefine(conn, xml)
    # libvirt kept every passthrough setting
    sources = defined.findall("devices/hostdev/source/address")
    assert len(sources) == sum(1 + len(gpu.companions) for gpu in gpus)
    want = etree.fromstring(xml.encode())
    for path in ("memtune/hard_limit", "devices/controller[@model='pcie-root']/pcihole64"):
        assert int(defined.findtext(path)) == int(want.findtext(path))
    assert defined.find("memoryBacking/locked") is None  # VFIO pins guest RAM; no mlockall
    assert defined.find("cpu/maxphysaddr").attrib == want.find("cpu/maxphysaddr").attrib
    assert defined.find("devices/memballoon").get("model") == "none"
    args = [arg.get("value") for arg in defined.iterfind(f"{{{QEMU_NS}}}commandline/*")]
    assert args[-2:] == [a.get("value") for a in want.iterfind(f"{{{QEMU_NS}}}commandline/*")][-2:]


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


def full_passthrough_board(hosts: dict[str, Inventory]) -> tuple[Allocation, str]:
    """All 8 GPUs and the 4 NVSwitches of the HGX host, as full passthrough allocates them."""
    fabric = Fabric(FabricMode(FULL_PASSTHROUGH, ("nvswitch",)))
    got = allocate(GpuRequest(count=8), hosts["hgx_h100"], fabric=fabric)
    switches = tuple(device.bdf for device in got.switches)
    return got, gpu_domain_xml(
        list(got.gpus), "hgx_h100_8gpu_nvswitch", "qemu", 32, 262144, switches=switches
    )


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


@pytest.mark.libvirt
def test_full_passthrough_board_defines_on_libvirtd(
    hosts: dict[str, Inventory], conn: libvirt.virConnect
) -> None:
    got, xml = full_passthrough_board(hosts)
    defined = define_and_undefine(conn, xml)
    assert len(defined.findall("devices/hostdev")) == len(got.gpus) + len(got.switches) == 12


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


@pytest.mark.libvirt
def test_ports_follow_existing_controllers_and_balloon_is_forced_off(
    hosts: dict[str, Inventory], schema: etree.RelaxNG, conn: libvirt.virConnect
) -> None:
    gpus = list(hosts["hgx_h100"].gpus[:2])

    def add_controller_and_balloon(root: etree._Element) -> None:
        devices = root.find("devices")
        root_port = etree.Element("controller", type="pci", index="3", model="pcie-root-port")
        devices.find("controller").addnext(root_port)
        devices.remove(devices.find("memballoon"))
        etree.SubElement(devices, "memballoon", model="virtio")

    xml = gpu_domain_xml(
        gpus,
        "shapes",
        "kvm",
        2,
        2048,
        extra=[add_controller_and_balloon],
        network="default",
    )
    root = etree.fromstring(xml.encode())
    ports = root.findall("devices/controller[@model='pcie-root-port']")
    assert [port.get("index") for port in ports] == ["3", "4", "5"]
    assert [a.get("bus") for a in root.iterfind("devices/hostdev/address")] == ["0x04", "0x05"]
    assert [b.get("model") for b in root.iterfind("devices/memballoon")] == ["none"]
    # no user networking: the fw_cfg entry gets a qemu:commandline of its own
    args = [arg.get("value") for arg in root.iterfind(f"{{{QEMU_NS}}}commandline/*")]
    assert args == ["-fw_cfg", "name=opt/ovmf/X-PciMmio64Mb,string=524288"]
    assert schema.validate(root), schema.error_log
    define_and_undefine(conn, xml)


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


def test_parse_and_format_cpulists() -> None:
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpulist("\n") == []
    assert parse_cpulist("5") == [5]
    assert format_cpuset([11, 0, 1, 2, 3, 8, 10, 3]) == "0-3,8,10-11"
    assert format_cpuset([]) == ""
    for bad in ("3-1", "a", "1-2-3", "-1"):
        with pytest.raises(ValueError):
            parse_cpulist(bad)


@given(st.sets(st.integers(0, 300)))
def test_cpuset_round_trip(cpus: set[int]) -> None:
    assert parse_cpulist(format_cpuset(cpus)) == sorted(cpus)


def test_host_cpus_by_node_from_sysfs(tmp_path: Path) -> None:
    nodes = tmp_path / "devices" / "system" / "node"
    for name, cpulist in [("node0", "0-3,8-11\n"), ("node1", "4-7,12-15\n"), ("node10", "\n")]:
        (nodes / name).mkdir(parents=True)
        (nodes / name / "cpulist").write_text(cpulist)
    (nodes / "possible").write_text("0-1,10\n")
    (nodes / "power").mkdir()
    assert host_cpus_by_node(tmp_path) == {
        0: [0, 1, 2, 3, 8, 9, 10, 11],
        1: [4, 5, 6, 7, 12, 13, 14, 15],
        10: [],
    }
    assert host_cpus_by_node(tmp_path / "nowhere") == {}


def test_host_cpus_by_node_on_this_host() -> None:
    found = passthrough.host_cpus_by_node()  # the name the manager uses
    online = parse_cpulist(Path("/sys/devices/system/cpu/online").read_text())
    assert sorted(cpu for cpus in found.values() for cpu in cpus) == online


# -- firmware ------------------------------------------------------------------------------


def small_bar_gpu(gpu: Gpu) -> Gpu:
    """``gpu`` with the BARs of QEMU's ati-vga (16 MiB framebuffer, 16 KiB registers)."""
    bars = (Bar(0, 16 * MIB, False, True), Bar(2, 16 << 10, False, False))
    return replace(gpu, bars=bars, bar_64bit_prefetchable_total=0)


def test_auto_firmware_is_seabios_only_for_small_bars(hosts: dict[str, Inventory]) -> None:
    h100, other = hosts["hgx_h100"].gpus[:2]
    assert passthrough.choose_firmware([h100]) == "uefi"
    small = [small_bar_gpu(h100), small_bar_gpu(other)]
    assert passthrough.choose_firmware(small) == "bios"
    assert passthrough.choose_firmware(small, "uefi") == "uefi"
    assert passthrough.choose_firmware([h100], "bios") == "bios"
    # the budget counts every BAR of every GPU: sixteen such cards are past it
    assert passthrough.choose_firmware([small_bar_gpu(h100)] * 16) == "uefi"


def test_seabios_domain_has_no_ovmf_settings_and_no_option_roms(
    hosts: dict[str, Inventory], schema: etree.RelaxNG, conn: libvirt.virConnect
) -> None:
    gpus = [small_bar_gpu(gpu) for gpu in hosts["hgx_h100"].gpus[:2]]
    plan = passthrough.plan(gpus, vcpus=2, memory_mib=2048, virt_type="kvm", host_cpus=None)
    assert plan.firmware == "bios"
    domain = replace(domain_plan("seabios", "kvm", 2, 2048), uefi=False, nvram=None, ovmf_code=None)
    domain.extra.append(partial(passthrough.apply, plan=plan))
    root = etree.fromstring(build_domain_xml(domain).encode())
    assert schema.validate(root), schema.error_log
    assert root.find("os/loader") is None
    assert passthrough.FW_CFG_MMIO64 not in etree.tostring(root, encoding="unicode")
    hostdevs = root.findall("devices/hostdev")
    assert [h.find("rom").get("bar") for h in hostdevs] == ["off"] * len(hostdevs)
    defined = define_and_undefine(conn, etree.tostring(root, encoding="unicode"))
    assert [h.find("rom").get("bar") for h in defined.findall("devices/hostdev")] == ["off"] * 2
