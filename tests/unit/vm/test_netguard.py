"""Guests never reach the host's loopback (vm/netguard.py): the user QEMU runs as, the rule that
keeps its guests' new connections off this host's addresses, the refusals where no rule can,
and (e2e) a guest with outbound network that tries 10.0.2.2 and its host's 127.0.0.1 service.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vmsandbox.config import Config
from vmsandbox.errors import FailedPrecondition, InvalidArgument
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


# -- networks guests must not reach (guest_blocked_networks) ----------------------------------


def _rejected(uid: int, version: int, networks: tuple[str, ...], resolv: Path) -> set[str]:
    """The destinations the rules of IP ``version`` reject for QEMU's user ``uid``."""
    found = set()
    for _check, add in netguard.rules(uid, version, networks, resolv):
        if add[:2] == ["-A", netguard.NETS_CHAIN] and add[-1] == "REJECT":
            found.add(add[add.index("-d") + 1])
    return found


def test_outbound_guests_are_kept_off_private_networks_by_default(tmp_path: Path) -> None:
    """With guest_outbound, a guest reached the fleet's private network (the Ray head and
    nodes, other hosts' metrics endpoints, a remote Fabric Manager): only this host's own
    addresses were blocked. By default the private, shared, link-local (cloud metadata) and
    unique-local ranges are rejected too, for QEMU's user only and for new connections."""
    resolv = tmp_path / "resolv.conf"
    resolv.write_text("")
    networks = Config.load("/nonexistent").guest_blocked_networks
    assert _rejected(64055, 4, networks, resolv) == {
        "10.0.0.0/8",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "100.64.0.0/10",
        "169.254.0.0/16",
    }
    assert _rejected(64055, 6, networks, resolv) == {"fc00::/7", "fe80::/10"}
    jumps = [
        add for _check, add in netguard.rules(64055, 4, networks, resolv) if add[1] == "OUTPUT"
    ]
    guests = ["-m", "owner", "--uid-owner", "64055", "-m", "conntrack", "--ctstate", "NEW"]
    assert ["-I", "OUTPUT", "1", *guests, "-j", netguard.NETS_CHAIN] in jumps
    assert ["-I", "OUTPUT", "1", "-o", "lo", "-j", netguard.CHAIN] in jumps  # the host itself


def test_the_hosts_resolvers_stay_reachable_for_dns_only(tmp_path: Path) -> None:
    """QEMU's user network forwards the guest's DNS to the host's resolvers, which are often
    in a private range: their port 53 is let through, ahead of the rejections."""
    resolv = tmp_path / "resolv.conf"
    resolv.write_text("search example\nnameserver 10.255.255.53\nnameserver fd00::53\n")
    v4 = netguard.rules(64055, 4, ("10.0.0.0/8",), resolv)
    allowed = [add for _check, add in v4 if add[-1] == "RETURN"]
    assert {(add[add.index("-d") + 1], add[add.index("-p") + 1]) for add in allowed} == {
        ("10.255.255.53/32", "udp"),
        ("10.255.255.53/32", "tcp"),
    }
    assert all(add[:3] == ["-I", netguard.NETS_CHAIN, "1"] for add in allowed)
    assert all("--dport" in add and add[add.index("--dport") + 1] == "53" for add in allowed)
    v6 = netguard.rules(64055, 6, ("fc00::/7",), resolv)
    assert [add[add.index("-d") + 1] for _c, add in v6 if add[-1] == "RETURN"] == [
        "fd00::53/128",
        "fd00::53/128",
    ]


def test_blocked_networks_come_from_the_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    file = tmp_path / "config.toml"
    file.write_text('guest_blocked_networks = ["10.20.0.0/16", "2001:db8::/32"]\n')
    assert Config.load(file).guest_blocked_networks == ("10.20.0.0/16", "2001:db8::/32")
    monkeypatch.setenv("VMSANDBOX_GUEST_BLOCKED_NETWORKS", "192.0.2.0/24,")
    assert Config.load(file).guest_blocked_networks == ("192.0.2.0/24",)
    assert Config.load("/nonexistent", guest_blocked_networks=[]).guest_blocked_networks == ()
    with pytest.raises(InvalidArgument, match="guest_blocked_networks"):
        Config.load("/nonexistent", guest_blocked_networks=["10.0.0.0/33"])
