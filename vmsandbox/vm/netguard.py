"""Guests never reach this host's own addresses (its loopback services above all), in any
network mode, nor, with outbound network, the networks the operator keeps from them.

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
  The same user's new connections to the networks of ``guest_blocked_networks`` (by default
  the private, shared, link-local and unique-local ranges: a fleet's Ray head and nodes, other
  hosts' metrics endpoints, a remote Fabric Manager, a cloud's metadata service) are rejected
  too (chain ``VMSANDBOX-GUEST-NETS``, jumped to from ``OUTPUT`` for that user's new
  connections), except port 53 of the host's own resolvers (``/etc/resolv.conf``), to which
  QEMU forwards the guest's DNS. Rules are only ever added: a network taken off the list stays
  blocked until the chain is flushed (``iptables -F VMSANDBOX-GUEST-NETS``), so a change
  never opens a gap while guests run.
- **A libvirt network**: the guest reaches the host through the bridge's address only; the
  kernel never routes 127.0.0.0/8 from another interface unless ``route_localnet`` is on,
  which ``check_network`` refuses.
"""

from __future__ import annotations

import ipaddress
import pwd
import re
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path

from vmsandbox.config import Config
from vmsandbox.errors import FailedPrecondition

CHAIN = "VMSANDBOX-GUESTS"
NETS_CHAIN = "VMSANDBOX-GUEST-NETS"
QEMU_CONF = Path("/etc/libvirt/qemu.conf")
RESOLV_CONF = Path("/etc/resolv.conf")
# Who libvirt runs QEMU as when qemu.conf names no user: Debian's build, then upstream's.
DEFAULT_QEMU_USERS = ("libvirt-qemu", "qemu")
_USER_LINE = re.compile(r'^\s*user\s*=\s*"([^"]+)"', re.M)
_TOOLS = {4: "iptables", 6: "ip6tables"}
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


def rules(
    uid: int, version: int, blocked: Iterable[str] = (), resolv: Path = RESOLV_CONF
) -> list[tuple[list[str], list[str]]]:
    """(check, add) argument lists of the tool of IP ``version`` (4: iptables, 6: ip6tables)
    that make the rules for QEMU's user ``uid`` (module docstring), in the order they are
    made: the host's own addresses, then the ``blocked`` networks of that version with the
    resolvers' port 53 let through ahead of them."""
    guests = [*("-m", "owner", "--uid-owner", str(uid)), *("-m", "conntrack", "--ctstate", "NEW")]
    reject = [*guests, *("-m", "comment", "--comment", "vmsandbox: guests never reach this host")]
    reject += ["-j", "REJECT"]
    jump = ["-o", "lo", "-j", CHAIN]
    made = [
        (["-C", CHAIN, *reject], ["-A", CHAIN, *reject]),
        (["-C", "OUTPUT", *jump], ["-I", "OUTPUT", "1", *jump]),
    ]
    networks = [net for net in blocked if ipaddress.ip_network(net).version == version]
    if not networks:
        return made
    comment = ["-m", "comment", "--comment", "vmsandbox: guests never reach these networks"]
    for address in resolvers(resolv, version):
        for protocol in ("udp", "tcp"):
            dns = ["-d", address, "-p", protocol, "--dport", "53", *comment, "-j", "RETURN"]
            made.append((["-C", NETS_CHAIN, *dns], ["-I", NETS_CHAIN, "1", *dns]))
    for net in networks:
        rule = ["-d", net, *comment, "-j", "REJECT"]
        made.append((["-C", NETS_CHAIN, *rule], ["-A", NETS_CHAIN, *rule]))
    into = [*guests, "-j", NETS_CHAIN]
    made.append((["-C", "OUTPUT", *into], ["-I", "OUTPUT", "1", *into]))
    return made


def resolvers(path: Path = RESOLV_CONF, version: int = 4) -> list[str]:
    """The host's name servers of IP ``version`` (``nameserver`` lines), as /32 or /128."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    found: list[str] = []
    for line in lines:
        words = line.split()
        if len(words) < 2 or words[0] != "nameserver":
            continue
        try:
            address = ipaddress.ip_address(words[1].split("%", 1)[0])
        except ValueError:
            continue
        if address.version == version and not address.is_loopback:
            found.append(f"{address}/{address.max_prefixlen}")
    return sorted(set(found))


def ensure(uri: str, blocked: Iterable[str] = ()) -> None:
    """Put the rules for QEMU's user under ``uri`` in place (idempotent), the ``blocked``
    networks among them; FAILED_PRECONDITION, with the tool's words, where they cannot be."""
    uid = qemu_uid(uri)
    blocked = tuple(blocked)
    for version, tool in _TOOLS.items():
        binary = shutil.which(tool)
        if binary is None:
            raise FailedPrecondition(
                f"guest_outbound needs {tool} to keep guests off this host's loopback, and it "
                "is not installed (apt-get install iptables), or leave guest_outbound off",
                details={"field": "guest_outbound", "tool": tool},
            )
        for chain in (CHAIN, NETS_CHAIN):
            _run(binary, ["-N", chain], allowed=(0, 1))  # 1: the chain exists
        for check, add in rules(uid, version, blocked):
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
    from vmsandbox.vm.connection import open_connection

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
            ensure(config.uri, config.guest_blocked_networks)
        return
    check_network(bridge_of(config.uri, config.network))
