"""Spare root ports of GPU-ready pooled guests (vmsandbox.gpu.hotplug), in the domain XML.

The reserves are sized from GPUs the allocator's fake hosts discover (umockdev); every domain
validates against libvirt's RelaxNG schema and is defined on the real libvirtd, where no
device of the domain may end up on a spare port (libvirt puts a device without an address on
the first empty root port).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import libvirt
from framework.domains import (
    Q,
    define_and_undefine,
    domain_plan,
    domain_xml,
    reserves,
    small_bar_gpu,
)
from lxml import etree

from vmsandbox.gpu import hotplug, passthrough
from vmsandbox.host.model import Inventory
from vmsandbox.vm.domain import build_domain_xml

MIB, GIB = 1 << 20, 1 << 30


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
