"""Spare root ports of GPU-ready pooled guests (vmsandbox.gpu.hotplug), in the domain XML.

The reserves are sized from GPUs the allocator's fake hosts discover (umockdev); every domain
validates against libvirt's RelaxNG schema and is defined on the real libvirtd, where no
device of the domain may end up on a spare port (libvirt puts a device without an address on
the first empty root port).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import libvirt
import pytest
from lxml import etree
from test_allocator import discover_hosts
from test_passthrough import SCHEMA, define_and_undefine, domain_plan, small_bar_gpu

from vmsandbox.gpu import hotplug, passthrough
from vmsandbox.host.model import Inventory
from vmsandbox.vm.domain import QEMU_NS, build_domain_xml

MIB, GIB = 1 << 20, 1 << 30
Q = f"{{{QEMU_NS}}}"


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


def domain_xml(plan: hotplug.HotplugPlan, name: str, **extra: object) -> str:
    domain = domain_plan(name, "qemu", 1, 512, **extra)
    if plan.firmware != "uefi":
        domain = replace(domain, uefi=False, nvram=None, ovmf_code=None, ovmf_vars=None)
    domain.extra.append(lambda root: hotplug.apply(root, plan))
    return build_domain_xml(domain)


def reserves(root: etree._Element) -> dict[str, dict[str, str]]:
    """Per aliased port: its qemu:override properties."""
    return {
        device.get("alias"): {
            prop.get("name"): prop.get("value") for prop in device.iterfind(f"{Q}frontend/*")
        }
        for device in root.iterfind(f"{Q}override/{Q}device")
    }


def test_h100_ports_reserve_a_whole_bar1_and_boot_with_the_window_of_two(
    hosts: dict[str, Inventory],
) -> None:
    h100s = [gpu for gpu in hosts["hgx_h100"].gpus if gpu.bindable]
    plan = hotplug.plan(h100s, 2, vcpus=4, memory_mib=8192, virt_type="kvm")
    assert plan is not None
    # BAR1 128 GiB + BAR3 32 MiB, aligned largest first: the next power of two is 256 GiB
    assert plan.pref64_reserve == 256 * GIB
    assert plan.mem_reserve == 16 * MIB  # BAR0, 16 MiB, 32-bit
    two = passthrough.plan(
        [h100s[0]] * 2, vcpus=4, memory_mib=8192, host_cpus=None, virt_type="kvm", pin=False
    )
    # the aperture holds two 256 GiB reserves, not two cards' 128 GiB + 32 MiB: 1 TiB
    window = 1024 * GIB
    assert plan.devices == replace(
        two, slots=(), mmio64_bytes=window, phys_bits=passthrough.phys_bits(8192, window)
    )
    assert plan.firmware == "uefi"


@pytest.mark.parametrize("ports", [1, 2, 4, 8])
def test_the_aperture_holds_every_spare_ports_reserve_and_room_beside_them(
    hosts: dict[str, Inventory], ports: int
) -> None:
    """Each spare port's 64-bit reserve is a power of two (128 GiB + 32 MiB of BARs take
    256 GiB); the aperture must hold all of them, and still leave the headroom and the padded
    windows of the other root ports (virtio disks, NIC, rng, USB) beside them."""
    h100s = [gpu for gpu in hosts["hgx_h100"].gpus if gpu.bindable]
    plan = hotplug.plan(h100s, ports, vcpus=2, memory_mib=4096, virt_type="kvm")
    assert plan is not None
    window = plan.devices.mmio64_bytes
    others = passthrough.OTHER_ROOT_PORTS * (window >> passthrough.OVMF_PORT_PADDING_SHIFT)
    assert ports * plan.pref64_reserve + passthrough.MMIO64_HEADROOM + others <= window
    assert window & (window - 1) == 0  # a power of two
    assert plan.devices.phys_bits >= passthrough.phys_bits(4096, window)


def test_no_bindable_gpu_or_no_port_plans_nothing(hosts: dict[str, Inventory]) -> None:
    gpus = list(hosts["hgx_h100"].gpus)
    assert hotplug.plan([], 2, vcpus=1, memory_mib=512, virt_type="qemu") is None
    assert hotplug.plan(gpus, 0, vcpus=1, memory_mib=512, virt_type="qemu") is None


def test_companions_and_32_bit_bars_go_to_mem_reserve(hosts: dict[str, Inventory]) -> None:
    card = hosts["workstation_rtx2080ti"].gpus[0]
    assert len(card.companions) == 3  # HDMI audio, USB, UCSI
    plan = hotplug.plan([card], 1, vcpus=1, memory_mib=512, virt_type="kvm")
    assert plan is not None
    # BAR0 16 MiB (32-bit) + 1 MiB per companion = 19 MiB: 32 MiB
    assert plan.mem_reserve == 32 * MIB
    assert plan.pref64_reserve == 512 * MIB  # BAR1 256 MiB + BAR3 32 MiB


@pytest.mark.libvirt
def test_small_bar_ports_define_empty_with_their_reserves(
    hosts: dict[str, Inventory], schema: etree.RelaxNG, conn: libvirt.virConnect
) -> None:
    cards = [small_bar_gpu(gpu) for gpu in hosts["hgx_h100"].gpus[:2]]
    plan = hotplug.plan(cards, 2, vcpus=1, memory_mib=512, virt_type="qemu")
    assert plan is not None and plan.firmware == "bios"
    assert (plan.pref64_reserve, plan.mem_reserve) == (0, 32 * MIB)  # 16 MiB + 16 KiB
    # with the control channel (the project's images): its virtio-serial controller is a PCI
    # device too, and must not take a spare port
    control = Path("/var/lib/vmsandbox/sandboxes/hotplug-small/control.sock")
    root = etree.fromstring(domain_xml(plan, "hotplug-small", control_socket=control).encode())
    assert schema.validate(root), schema.error_log
    assert reserves(root) == {
        "ua-hp1": {"mem-reserve": str(32 * MIB)},
        "ua-hp2": {"mem-reserve": str(32 * MIB)},
    }
    defined = define_and_undefine(conn, etree.tostring(root, encoding="unicode"))
    ports = {
        c.get("index"): c for c in defined.iterfind("devices/controller[@model='pcie-root-port']")
    }
    assert [ports[str(i)].find("alias").get("name") for i in (1, 2)] == ["ua-hp1", "ua-hp2"]
    assert [ports[str(i)].find("address").get("function") for i in (1, 2)] == ["0x0", "0x1"]
    buses = {int(a.get("bus"), 16) for a in defined.iterfind("devices/*/address[@type='pci']")}
    assert buses == {0}  # every device on pcie.0: the spare ports stay empty
    assert defined.find("devices/memballoon").get("model") == "none"
    assert defined.find("memtune/hard_limit") is not None
    assert reserves(defined) == reserves(root)


@pytest.mark.libvirt
def test_large_bar_ports_boot_ovmf_sized_for_them(
    hosts: dict[str, Inventory], schema: etree.RelaxNG, conn: libvirt.virConnect
) -> None:
    plan = hotplug.plan(list(hosts["hgx_h100"].gpus), 1, vcpus=2, memory_mib=4096, virt_type="kvm")
    assert plan is not None
    root = etree.fromstring(domain_xml(plan, "hotplug-large", network="default").encode())
    assert schema.validate(root), schema.error_log
    assert reserves(root) == {
        "ua-hp1": {"pref64-reserve": str(256 * GIB), "mem-reserve": str(16 * MIB)}
    }
    args = [arg.get("value") for arg in root.iterfind(f"{Q}commandline/*")]
    # one 256 GiB reserve and the other ports' padding: a 512 GiB aperture
    assert args == ["-fw_cfg", f"name={passthrough.FW_CFG_MMIO64},string={512 * 1024}"]
    defined = define_and_undefine(conn, etree.tostring(root, encoding="unicode"))
    assert defined.find("os/loader") is not None
    # the NIC of a libvirt network got an address on pcie.0 too
    assert defined.find("devices/interface/address").get("bus") == "0x00"
    buses = {int(a.get("bus"), 16) for a in defined.iterfind("devices/*/address[@type='pci']")}
    assert buses == {0}


@pytest.mark.libvirt
def test_an_attached_hostdev_is_one_libvirt_takes_on_the_spare_port(
    hosts: dict[str, Inventory], conn: libvirt.virConnect
) -> None:
    card = hosts["workstation_rtx2080ti"].gpus[0]
    plan = hotplug.plan([card], 1, vcpus=1, memory_mib=512, virt_type="kvm", firmware="bios")
    assert plan is not None
    (bus,) = hotplug.port_indexes(1)
    functions = sorted((card.bdf, *card.companions))
    xmls = [hotplug.hostdev_xml(bdf, bus, multifunction=True, firmware="bios") for bdf in functions]
    gpu = etree.fromstring(xmls[0].encode())
    assert gpu.find("address").attrib == {
        "type": "pci",
        "domain": "0x0000",
        "bus": "0x01",
        "slot": "0x00",
        "function": "0x0",
        "multifunction": "on",
    }
    assert gpu.find("rom").get("bar") == "off"
    assert etree.fromstring(xmls[1].encode()).find("address").get("multifunction") is None

    def with_hostdevs(root: etree._Element) -> None:
        hotplug.apply(root, plan)
        for xml in xmls:
            root.find("devices/memballoon").addprevious(etree.fromstring(xml.encode()))

    domain = replace(
        domain_plan("hotplug-attach", "kvm", 1, 512),
        uefi=False,
        nvram=None,
        ovmf_code=None,
        ovmf_vars=None,
    )
    domain.extra.append(with_hostdevs)
    defined = define_and_undefine(conn, build_domain_xml(domain))
    placed = [h.find("address").get("bus") for h in defined.iterfind("devices/hostdev")]
    assert placed == ["0x01"] * 4


def test_apply_refuses_a_domain_whose_controllers_take_the_port_indexes(
    hosts: dict[str, Inventory],
) -> None:
    plan = hotplug.plan(list(hosts["mi300x"].gpus), 1, vcpus=1, memory_mib=512, virt_type="kvm")
    assert plan is not None
    root = etree.fromstring(
        b"<domain><devices><controller type='pci' index='0' model='pcie-root'/>"
        b"<controller type='pci' index='1' model='pcie-root-port'/></devices></domain>"
    )
    with pytest.raises(ValueError, match="overlap the spare ports"):
        hotplug.apply(root, plan)


def test_guest_port_addresses() -> None:
    assert [hotplug.guest_port(i) for i in (0, 1, 7, 8)] == [
        "0000:00:01.0",
        "0000:00:01.1",
        "0000:00:01.7",
        "0000:00:02.0",
    ]
