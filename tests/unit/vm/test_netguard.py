"""Guests never reach the host's loopback (vm/netguard.py): the user QEMU runs as, the rule that
keeps its guests' new connections off this host's addresses, the refusals where no rule can,
and (e2e) a guest with outbound network that tries 10.0.2.2 and its host's 127.0.0.1 service.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vmsandbox.errors import FailedPrecondition
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
