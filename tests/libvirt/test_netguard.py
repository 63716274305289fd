"""Guests never reach the host's loopback nor the networks kept from them (vm/netguard.py): the
rules in this host's firewall, once ensured (tests/unit/vm/test_netguard.py has the rules' pure
parts, tests/e2e/test_netguard.py a guest that tries)."""

from __future__ import annotations

import subprocess

from vmsandbox.config import BLOCKED_NETWORKS
from vmsandbox.vm import netguard


def test_the_rules_are_in_place_once_ensured() -> None:
    """The rules themselves, in this host's firewall (idempotent: ensured twice, listed once)."""
    netguard.ensure("qemu:///system", BLOCKED_NETWORKS)
    netguard.ensure("qemu:///system", BLOCKED_NETWORKS)
    uid = netguard.qemu_uid("qemu:///system")
    for version, tool in ((4, "iptables"), (6, "ip6tables")):
        for check, _add in netguard.rules(uid, version, BLOCKED_NETWORKS):
            assert subprocess.run([tool, "-w", *check], check=False).returncode == 0
        listed = subprocess.run(
            [tool, "-w", "-S", "OUTPUT"], capture_output=True, text=True, check=True
        ).stdout
        assert listed.count(f"-j {netguard.CHAIN}") == 1
        assert listed.count(f"-j {netguard.NETS_CHAIN}") == 1
