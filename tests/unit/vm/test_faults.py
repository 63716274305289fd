"""Paused domains and libvirt's reason (vm/faults.py), on libvirt's test driver."""

from __future__ import annotations

import libvirt

from vmsandbox.vm import faults


def test_a_paused_domain_with_its_reason() -> None:
    conn = libvirt.open("test:///default")
    try:
        assert faults.paused(conn) == {}
        conn.lookupByName("test").suspend()
        assert faults.paused(conn) == {"test": "user"}  # an operator's pause: not a fault
    finally:
        conn.close()


def test_the_reasons_a_fault_gives_are_named() -> None:
    assert faults.PAUSED_REASONS[libvirt.VIR_DOMAIN_PAUSED_IOERROR] == "ioerror"
    assert faults.PAUSED_REASONS[libvirt.VIR_DOMAIN_PAUSED_CRASHED] == "crashed"
