"""Guests never reach this host's own addresses (its loopback services above all), in any
network mode.

- **User networking** (the default): QEMU's ``restrict=on``: slirp drops every connection the
  guest opens; only the forwarded SSH port reaches the guest.
- **User networking with ``guest_outbound``**: QEMU 7.2's slirp has no filter by destination
  (libslirp's ``disable_host_loopback`` is not an option of ``-netdev user``). It maps every
  address of its virtual network but the DNS (10.0.2.2 above all) to the host's 127.0.0.1,
  and a guest's root can send packets to 127.0.0.1 itself. Either way the guest's connection
  becomes a socket QEMU opens on the host, as the user QEMU runs as (``libvirt-qemu`` under
  ``qemu:///system``). So before such a guest starts, ``ensure`` puts a firewall rule in
  place: a new connection from that user to any address of this host (packets routed over
  ``lo``: 127.0.0.0/8, ::1 and the host's own addresses) is rejected, for IPv4 and IPv6 (chain
  ``VMSANDBOX-GUESTS``, jumped to from ``OUTPUT``). The SSH forward is not touched: those
  connections come *to* QEMU, and its replies are not new. The rule stays (other guests need
  it); a host resolver on 127.0.0.x is unreachable too, so such guests need a DNS server
  elsewhere. ``ensure`` refuses (FAILED_PRECONDITION) where the rule cannot be made, and where
  a user cannot tell QEMU apart: QEMU running as root, or as the caller (``qemu:///session``).
- **A libvirt network**: the guest reaches the host through the bridge's address only; the
  kernel never routes 127.0.0.0/8 from another interface unless ``route_localnet`` is on,
  which ``check_network`` refuses.
"""

from __future__ import annotations

import pwd
import re
import shutil
import subprocess
from pathlib import Path

from vmsandbox.config import Config
from vmsandbox.errors import FailedPrecondition

CHAIN = "VMSANDBOX-GUESTS"
QEMU_CONF = Path("/etc/libvirt/qemu.conf")
# Who libvirt runs QEMU as when qemu.conf names no user: Debian's build, then upstream's.
DEFAULT_QEMU_USERS = ("libvirt-qemu", "qemu")
_USER_LINE = re.compile(r'^\s*user\s*=\s*"([^"]+)"', re.M)
_TOOLS = ("iptables", "ip6tables")
TOOL_TIMEOUT = 30.0


def qemu_uid(uri: str, conf: Path = QEMU_CONF) -> int:
    """The uid QEMU runs as under ``uri``; FAILED_PRECONDITION where no rule can single it
    out (a session URI, a root QEMU, a user that does not exist)."""
    system = uri.split("?", 1)[0].endswith("/system")
    if not system:
        raise FailedPrecondition(
            f"guest_outbound needs QEMU to run as a user of its own, and under {uri} it runs "
            "as the caller: use qemu:///system, or leave guest_outbound off",
            details={"field": "guest_outbound", "uri": uri},
        )
    try:
        found = _USER_LINE.search(conf.read_text())
    except OSError:
        found = None
    names = (found[1],) if found else DEFAULT_QEMU_USERS
    for name in names:
        try:
            uid = int(name[1:]) if name.startswith("+") else pwd.getpwnam(name).pw_uid
        except (KeyError, ValueError):
            continue
        if uid == 0:
            raise FailedPrecondition(
                f"guest_outbound: QEMU runs as root ({conf} user = {name!r}), so no rule can "
                "keep its guests' connections off this host's loopback; run QEMU as a user of "
                "its own (libvirt's default), or leave guest_outbound off",
                details={"field": "guest_outbound", "qemu_user": name},
            )
        return uid
    raise FailedPrecondition(
        f"guest_outbound: the user QEMU runs as ({', '.join(names)}) does not exist here",
        details={"field": "guest_outbound", "qemu_user": list(names)},
    )


def rules(uid: int) -> list[tuple[list[str], list[str]]]:
    """(check, add) argument lists, for each tool, that make the rule (module docstring)."""
    reject = [
        *("-m", "owner", "--uid-owner", str(uid)),
        *("-m", "conntrack", "--ctstate", "NEW"),
        *("-m", "comment", "--comment", "vmsandbox: guests never reach this host"),
        *("-j", "REJECT"),
    ]
    jump = ["-o", "lo", "-j", CHAIN]
    return [
        (["-C", CHAIN, *reject], ["-A", CHAIN, *reject]),
        (["-C", "OUTPUT", *jump], ["-I", "OUTPUT", "1", *jump]),
    ]


def ensure(uri: str) -> None:
    """Put the rule for QEMU's user under ``uri`` in place (idempotent); FAILED_PRECONDITION,
    with the tool's words, where it cannot be."""
    uid = qemu_uid(uri)
    for tool in _TOOLS:
        binary = shutil.which(tool)
        if binary is None:
            raise FailedPrecondition(
                f"guest_outbound needs {tool} to keep guests off this host's loopback, and it "
                "is not installed (apt-get install iptables), or leave guest_outbound off",
                details={"field": "guest_outbound", "tool": tool},
            )
        _run(binary, ["-N", CHAIN], allowed=(0, 1))  # 1: the chain exists
        for check, add in rules(uid):
            if _run(binary, check, allowed=(0, 1)) != 0:
                _run(binary, add, allowed=(0,))


def _run(binary: str, args: list[str], allowed: tuple[int, ...]) -> int:
    argv = [binary, "-w", *args]
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=TOOL_TIMEOUT, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise FailedPrecondition(
            f"guest_outbound: {' '.join(argv)} failed: {exc}", details={"argv": argv}
        ) from exc
    if done.returncode not in allowed:
        raise FailedPrecondition(
            f"guest_outbound: {' '.join(argv)} failed (exit {done.returncode}): "
            f"{done.stderr.strip()}; guests with outbound network are not started without it",
            details={"argv": argv, "exit_status": done.returncode},
        )
    return done.returncode


def check_network(bridge: str | None, proc: Path = Path("/proc/sys/net/ipv4/conf")) -> None:
    """FAILED_PRECONDITION when the kernel would route 127.0.0.0/8 from the network's bridge
    (``route_localnet`` on for all interfaces or for that one)."""
    for name in ("all", *([bridge] if bridge else [])):
        try:
            value = (proc / name / "route_localnet").read_text().strip()
        except OSError:
            continue
        if value != "0":
            raise FailedPrecondition(
                f"net.ipv4.conf.{name}.route_localnet is {value}: guests on the libvirt "
                "network could reach this host's loopback services; set it to 0",
                details={"field": "network", "route_localnet": name},
            )


def bridge_of(uri: str, network: str) -> str | None:
    """The bridge of libvirt network ``network``; None when libvirt cannot say (only the
    setting for all interfaces is checked then)."""
    import libvirt

    from vmsandbox.errors import Unavailable
    from vmsandbox.vm.hypervisor import open_connection

    try:
        conn = open_connection(uri)
    except Unavailable:
        return None
    try:
        return str(conn.networkLookupByName(network).bridgeName())
    except libvirt.libvirtError:
        return None
    finally:
        conn.close()


def before_start(config: Config) -> None:
    """What must hold before a guest of ``config``'s network mode starts (module docstring)."""
    if config.network == "user":
        if config.guest_outbound:
            ensure(config.uri)
        return
    check_network(bridge_of(config.uri, config.network))
