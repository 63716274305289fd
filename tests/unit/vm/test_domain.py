"""The domain XML builder: schema-valid, carries the spec, and injects nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
from framework.domains import CONTROL, unit_plan
from lxml import etree

from vmsandbox.guest.programs import control as guest_control
from vmsandbox.vm.domain import (
    CONTROL_PORT,
    METADATA_NS,
    build_domain_xml,
    metadata_xml,
    read_metadata,
)

SCHEMA = etree.RelaxNG(etree.parse("/usr/share/libvirt/schemas/domain.rng"))


def parse(xml: str) -> etree._Element:
    root = etree.fromstring(xml.encode())
    SCHEMA.assertValid(root)
    return root


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"virt_type": "kvm"},
        {"kernel": None, "initrd": None, "cmdline": None},
        {"network": "default", "ssh_port": None},
        {"guest_outbound": True},
        {"control_socket": Path("/var/lib/vmsandbox/sandboxes/unit/control.sock")},
        {
            "uefi": True,
            "nvram": Path("/var/lib/vmsandbox/disks/unit-vars.fd"),
            "ovmf_code": Path("/usr/share/OVMF/OVMF_CODE_4M.fd"),
            "ovmf_vars": Path("/usr/share/OVMF/OVMF_VARS_4M.fd"),
        },
    ],
)
def test_every_variant_is_schema_valid(changes: dict[str, object]):
    parse(build_domain_xml(unit_plan(**changes)))


def test_sizes_disks_and_console_come_from_the_plan():
    root = parse(build_domain_xml(unit_plan()))
    assert root.get("type") == "qemu"
    assert root.findtext("name") == "vmsbx-unit"
    assert root.find("memory").text == "2048" and root.find("memory").get("unit") == "MiB"
    assert root.findtext("vcpu") == "2"
    disks = root.findall("devices/disk")
    assert [d.find("source").get("file") for d in disks] == [
        "/var/lib/vmsandbox/disks/unit.qcow2",
        "/var/lib/vmsandbox/disks/unit-seed.iso",
    ]
    assert disks[1].find("readonly") is not None
    assert root.find("devices/memballoon").get("model") == "none"
    log = root.find("devices/serial/log").get("file")
    assert log == "/var/lib/vmsandbox/sandboxes/unit.console.log"


def test_seabios_writes_to_the_serial_console_and_ovmf_needs_nothing():
    """Firmware messages ("No bootable device.") must reach the console log."""
    assert parse(build_domain_xml(unit_plan())).find("os/bios").get("useserial") == "yes"
    uefi = unit_plan(
        uefi=True, nvram=Path("/v.fd"), ovmf_code=Path("/c.fd"), ovmf_vars=Path("/t.fd")
    )
    assert parse(build_domain_xml(uefi)).find("os/bios") is None


def test_user_network_forwards_ssh_on_loopback_only_and_restricts_the_guest():
    root = parse(build_domain_xml(unit_plan()))
    args = [a.get("value") for a in root.iter("{http://libvirt.org/schemas/domain/qemu/1.0}arg")]
    assert args[1] == "user,id=vmsbxnet0,hostfwd=tcp:127.0.0.1:40022-:22,restrict=on"
    assert args[3].startswith("virtio-net-pci,netdev=vmsbxnet0,bus=pcie.0")
    assert args[3].endswith(",romfile=")  # no iPXE: a sandbox never boots from the network


def test_a_libvirt_network_nic_has_no_option_rom_and_no_domain_has_usb():
    root = parse(build_domain_xml(unit_plan(network="default", ssh_port=None)))
    assert root.find("devices/interface/rom").get("enabled") == "no"
    assert root.find("devices/controller[@type='usb']").get("model") == "none"


def test_kvm_gets_host_cpu_and_qemu_does_not():
    assert parse(build_domain_xml(unit_plan(virt_type="kvm"))).find("cpu").get("mode") == (
        "host-passthrough"
    )
    assert parse(build_domain_xml(unit_plan())).find("cpu") is None


def test_metadata_round_trips_and_hostile_text_stays_text():
    record = {"name": "unit", "labels": {"x": "a'/><devices><disk>&amp;</disk>"}}
    xml = build_domain_xml(unit_plan(record=record))
    root = parse(xml)
    assert len(root.findall("devices/disk")) == 2
    assert read_metadata(xml) == (record, "creating")
    element = etree.fromstring(metadata_xml(record, "ready").encode())
    assert element.tag == "sandbox" and element.get("state") == "ready"


def test_foreign_domains_have_no_record():
    assert read_metadata("<domain type='kvm'><name>other</name></domain>") is None
    bad = f"<domain><metadata><s:sandbox xmlns:s='{METADATA_NS}'>{{oops</s:sandbox></metadata>"
    assert read_metadata(bad + "</domain>") is None


def test_the_control_channel_is_a_unix_socket_and_a_named_virtio_port() -> None:
    """Host end: a socket QEMU listens on at the planned path (in the sandbox's private
    folder); guest end: the virtio-serial port the guest tool looks for by name."""
    channels = parse(build_domain_xml(unit_plan(control_socket=CONTROL))).findall("devices/channel")
    assert [
        (c.get("type"), c.find("source").attrib, c.find("target").attrib) for c in channels
    ] == [
        (
            "unix",
            {"mode": "bind", "path": str(CONTROL)},
            {"type": "virtio", "name": guest_control.PORT_NAME},
        )
    ]
    assert CONTROL_PORT == guest_control.PORT_NAME
    assert parse(build_domain_xml(unit_plan())).find("devices/channel") is None
