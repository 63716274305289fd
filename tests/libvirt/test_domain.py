"""The domain XML builder's documents as the real libvirtd takes them (the control channel)."""

from __future__ import annotations

import libvirt
from framework.domains import CONTROL, define_and_undefine, unit_plan

from vmsandbox.vm.domain import (
    CONTROL_PORT,
    build_domain_xml,
)


def test_the_control_channel_defines_on_libvirtd() -> None:
    """libvirtd takes the channel and adds the virtio-serial controller it needs."""
    conn = libvirt.open("qemu:///system")
    try:
        defined = define_and_undefine(conn, build_domain_xml(unit_plan(control_socket=CONTROL)))
    finally:
        conn.close()
    channel = defined.find("devices/channel")
    assert channel.find("target").get("name") == CONTROL_PORT
    assert channel.find("address").get("type") == "virtio-serial"
    assert defined.find("devices/controller[@type='virtio-serial']") is not None
