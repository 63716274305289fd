"""GPU passthrough domains (vmsandbox.gpu.passthrough) accepted by ``defineXML`` on the real
libvirtd (defined under a test name, then undefined): the golden cases, a full passthrough
board, existing controllers, SeaBIOS for small BARs. tests/unit/gpu/test_passthrough.py checks
the same documents against the golden files and libvirt's RelaxNG schema.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import libvirt
import pytest
from framework.domains import (
    CASES,
    define_and_undefine,
    domain_plan,
    full_passthrough_board,
    golden_case,
    gpu_domain_xml,
    small_bar_gpu,
)
from lxml import etree

from vmsandbox.gpu import passthrough
from vmsandbox.host.model import Inventory
from vmsandbox.vm.domain import QEMU_NS, build_domain_xml


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


def test_full_passthrough_board_defines_on_libvirtd(
    hosts: dict[str, Inventory], conn: libvirt.virConnect
) -> None:
    got, xml = full_passthrough_board(hosts)
    defined = define_and_undefine(conn, xml)
    assert len(defined.findall("devices/hostdev")) == len(got.gpus) + len(got.switches) == 12


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
