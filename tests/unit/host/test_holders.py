"""Which libvirt domain holds which PCI device (vmsandbox.host.holders)."""

from __future__ import annotations

import uuid

import libvirt

from vmsandbox.host import libvirt_hostdev_holders
from vmsandbox.host.holders import hostdev_addresses


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
