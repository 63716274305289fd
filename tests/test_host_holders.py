"""Which libvirt domain holds which PCI device (vmsandbox.host.holders)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import libvirt
import pytest
from conftest_host import probe

from vmsandbox.host import libvirt_hostdev_holders
from vmsandbox.host.holders import hostdev_addresses

DOMAIN_XML = """\
<domain type='qemu'>
  <name>{name}</name>
  <memory unit='MiB'>64</memory>
  <vcpu>1</vcpu>
  <os><type arch='x86_64' machine='q35'>hvm</type></os>
  <devices>
    <hostdev mode='subsystem' type='pci' managed='yes'>
      <source><address domain='0x0000' bus='0x41' slot='0x00' function='0x0'/></source>
    </hostdev>
    <hostdev mode='subsystem' type='pci' managed='yes'>
      <source><address domain='0x0000' bus='0x41' slot='0x00' function='0x1'/></source>
    </hostdev>
  </devices>
</domain>
"""


def test_hostdev_addresses_reads_pci_hostdevs_only() -> None:
    xml = """\
<domain type='qemu'>
  <name>mixed</name>
  <devices>
    <hostdev mode='subsystem' type='pci' managed='yes'>
      <source><address domain='0x0000' bus='0xC2' slot='0x00' function='0x0'/></source>
      <address type='pci' domain='0x0000' bus='0x05' slot='0x00' function='0x0'/>
    </hostdev>
    <hostdev mode='subsystem' type='pci' managed='no'>
      <driver name='vfio'/>
      <source><address domain='0x0001' bus='0x3' slot='0x1f' function='0x7'/></source>
    </hostdev>
    <hostdev mode='subsystem' type='usb'>
      <source><vendor id='0x1234'/><product id='0xbeef'/></source>
    </hostdev>
    <interface type='user'><address type='pci' bus='0x01' slot='0x00' function='0x0'/></interface>
  </devices>
</domain>"""
    assert hostdev_addresses(xml) == ["0000:c2:00.0", "0001:03:1f.7"]
    assert hostdev_addresses(xml.encode()) == ["0000:c2:00.0", "0001:03:1f.7"]


TEST_DRIVER_DOMAIN = """\
<domain type='test'>
  <name>{name}</name>
  <uuid>{uuid}</uuid>
  <memory unit='MiB'>64</memory>
  <os><type>hvm</type></os>
  <devices>
    <hostdev mode='subsystem' type='pci' managed='yes'>
      <source><address domain='0x0000' bus='{bus}' slot='0x00' function='0x0'/></source>
    </hostdev>
  </devices>
</domain>
"""


def test_running_domains_hold_their_live_and_next_config() -> None:
    """libvirt's test driver: a running domain whose persistent config was changed since it
    started holds both devices; a transient domain (no persistent config) holds its own."""
    conn = libvirt.open("test:///default")
    try:
        live = str(uuid.uuid4())
        domain = conn.defineXML(
            TEST_DRIVER_DOMAIN.format(name="vmsbx-test-a", uuid=live, bus="0x42")
        )
        domain.create()
        conn.defineXML(TEST_DRIVER_DOMAIN.format(name="vmsbx-test-a", uuid=live, bus="0x43"))
        conn.createXML(
            TEST_DRIVER_DOMAIN.format(name="vmsbx-test-b", uuid=uuid.uuid4(), bus="0x44"), 0
        )
        assert libvirt_hostdev_holders(conn) == {
            "0000:42:00.0": "vmsbx-test-a",
            "0000:43:00.0": "vmsbx-test-a",
            "0000:44:00.0": "vmsbx-test-b",
        }
    finally:
        conn.close()  # the test driver forgets everything with its last connection


@pytest.fixture
def holder_domain() -> Iterator[tuple[libvirt.virConnect, str]]:
    """A defined (never started) domain holding 0000:41:00.0 and .1, undefined afterwards."""
    conn = libvirt.open("qemu:///system")
    name = f"vmsbx-test-holder-{uuid.uuid4().hex[:8]}"
    domain = conn.defineXML(DOMAIN_XML.format(name=name))
    try:
        yield conn, name
    finally:
        domain.undefine()
        conn.close()


@pytest.mark.libvirt
def test_holders_on_the_real_libvirtd_reach_the_inventory(
    holder_domain: tuple[libvirt.virConnect, str],
) -> None:
    conn, name = holder_domain
    holders = libvirt_hostdev_holders(conn)
    assert holders["0000:41:00.0"] == name
    assert holders["0000:41:00.1"] == name
    [result] = probe("hgx_h100", [{"in_use": holders, "use_nvml": False}])
    inventory = result["inventory"]
    for gpu in inventory["gpus"]:
        # other domains on this libvirtd may hold other addresses; they are reported too
        assert gpu["in_use_by"] == holders.get(gpu["bdf"])
    in_use = {gpu["bdf"]: gpu["in_use_by"] for gpu in inventory["gpus"]}
    assert in_use["0000:41:00.0"] == name
    assert inventory["host"]["free"] == sum(1 for by in in_use.values() if by is None)
    assert name in result["table"]
