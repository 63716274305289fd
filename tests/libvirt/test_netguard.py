"""Guests never reach the host's loopback (vm/netguard.py): the rule in this host's firewall,
once ensured (tests/unit/vm/test_netguard.py has the rule's pure parts, tests/e2e/test_netguard.py
a guest that tries)."""

from __future__ import annotations

import subprocess

from vmsandbox.vm import netguard


def test_the_rule_is_in_place_once_ensured() -> None:
    """The rule itself, in this host's firewall (idempotent: ensured twice, listed once)."""
    netguard.ensure("qemu:///system")
    netguard.ensure("qemu:///system")
    uid = netguard.qemu_uid("qemu:///system")
    for tool in ("iptables", "ip6tables"):
        for check, _add in netguard.rules(uid):
            assert subprocess.run([tool, "-w", *check], check=False).returncode == 0
        listed = subprocess.run(
            [tool, "-w", "-S", "OUTPUT"], capture_output=True, text=True, check=True
        ).stdout
        assert listed.count(f"-j {netguard.CHAIN}") == 1
