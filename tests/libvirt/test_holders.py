"""Which libvirt domain holds which PCI device (vmsandbox.host.holders), on the real libvirtd."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import libvirt
import pytest
from framework.fake_hosts import probe

from vmsandbox.host import libvirt_hostdev_holders


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
