"""Guests never reach the host's loopback (vm/netguard.py): the user QEMU runs as, the rule that
keeps its guests' new connections off this host's addresses, the refusals where no rule can,
and (e2e) a guest with outbound network that tries 10.0.2.2 and its host's 127.0.0.1 service.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from vmsandbox.config import Config
from vmsandbox.errors import FailedPrecondition
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.sandbox.spec import SandboxSpec, generate_name
from vmsandbox.vm import netguard


def test_qemus_user_comes_from_qemu_conf_or_libvirts_default(tmp_path: Path) -> None:
    conf = tmp_path / "qemu.conf"
    conf.write_text('#user = "root"\n')
    assert netguard.qemu_uid("qemu:///system", conf) == netguard.qemu_uid("qemu:///system")
    conf.write_text('user = "+65534"\n')
    assert netguard.qemu_uid("qemu+unix:///system?socket=/x", conf) == 65534


@pytest.mark.parametrize(
    ("uri", "conf", "why"),
    [
        ("qemu:///session", "", "runs as the caller"),
        ("qemu:///system", 'user = "root"\n', "QEMU runs as root"),
        ("qemu:///system", 'user = "no-such-user-here"\n', "does not exist here"),
    ],
)
def test_where_no_rule_can_single_qemu_out_outbound_is_refused(
    tmp_path: Path, uri: str, conf: str, why: str
) -> None:
    path = tmp_path / "qemu.conf"
    path.write_text(conf)
    with pytest.raises(FailedPrecondition, match=why) as caught:
        netguard.qemu_uid(uri, path)
    assert caught.value.details["field"] == "guest_outbound"


def test_a_libvirt_network_with_route_localnet_on_is_refused(tmp_path: Path) -> None:
    for name, value in (("all", "0"), ("virbr9", "1")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "route_localnet").write_text(value + "\n")
    netguard.check_network(None, tmp_path)
    with pytest.raises(FailedPrecondition, match="route_localnet is 1"):
        netguard.check_network("virbr9", tmp_path)


@pytest.mark.libvirt
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


@contextlib.contextmanager
def listener() -> Iterator[tuple[int, list[bytes]]]:
    """A TCP service on the host's 127.0.0.1 that records what reaches it."""
    server = socket.create_server(("127.0.0.1", 0))
    received: list[bytes] = []

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = server.accept()
                with conn:
                    received.append(conn.recv(100) or b"(connected)")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1], received
    finally:
        with contextlib.suppress(OSError):
            server.shutdown(socket.SHUT_RDWR)
        server.close()
        thread.join(5)


@pytest.mark.e2e
def test_a_guest_with_outbound_network_cannot_reach_the_hosts_loopback(config: Config) -> None:
    """slirp maps 10.0.2.2 to the host's 127.0.0.1; the rule rejects the guest's connection
    there (it used to reach Fabric Manager's command port, the gateway, other sandboxes' SSH
    forwards). The guest's own SSH forward still works (this test runs over it)."""
    outbound = replace(config, guest_outbound=True)
    name = generate_name("t")
    with listener() as (port, received), SandboxManager(outbound, reconcile=False) as manager:
        try:
            manager.create(SandboxSpec(name=name, memory_mib=512), verify=False)
            probe = f"echo from-the-guest > /dev/tcp/10.0.2.2/{port}"
            done = manager.exec(name, ["timeout", "20", "bash", "-c", probe], timeout=120)
            assert done.exit_status != 0, done.stdout + done.stderr
            assert received == []
        finally:
            with contextlib.suppress(Exception):
                manager.destroy(name)
