#!/usr/bin/python3
"""vmsandbox's first-boot unit: applies the NoCloud seed vmsandbox writes, in place of cloud-init.

Baked into the project's own images as /usr/lib/vmsandbox/firstboot.py (compiled there to
firstboot.pyc), with its modules beside it: firstboot_seed.py (the seed's grammar) and
firstboot_iso.py (finding and reading the seed). ``vmsandbox-firstboot.service`` runs it before
systemd-networkd and sshd start. It reads the seed (an ISO 9660 volume labelled ``cidata``:
user-data, meta-data, network-config) and gives the guest its hostname, the sandbox user with
its authorized key and sudo rule, the pinned SSH host key, the network, and the files of the
sandbox's guest setup; the seed's ``runcmd`` is kept for ``vmsandbox-runcmd.service``, which
runs it (``--runcmd``) beside sshd, as cloud-init's late stages did. Stock cloud images never
run this: they keep cloud-init and read the same seed.

vmsandbox writes user-data as JSON after the ``#cloud-config`` line (JSON is YAML), so the
standard library's json reads it: no YAML parser to start under TCG. Every key is checked
against what this program applies before anything is changed: a key it does not understand
stops the boot with a line ``vmsandbox-firstboot: error: ...`` on the console (vmsandbox's boot
watcher fails the create on it at once), never silently ignored. It applies a seed once per
instance-id. Standard library only: it runs with ``python3 -I -S``.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import sys
from pathlib import Path

if __package__:  # a module of vmsandbox (the tests run it on the host)
    from .firstboot_iso import find_seed, read_seed
    from .firstboot_seed import Nic, Seed, SeedError, parse
else:  # in the guest: /usr/lib/vmsandbox/firstboot.pyc, whose folder -I leaves off sys.path
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from firstboot_iso import find_seed, read_seed
    from firstboot_seed import Nic, Seed, SeedError, parse

# Every import costs under TCG, on the way to sshd: typing and subprocess (imported only to start
# a program, which a first boot with the image's defaults never does) are kept out of the way.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

PREFIX = "vmsandbox-firstboot"
STATE = Path("/var/lib/vmsandbox")
RUNCMD_FILE = "runcmd.json"


def _run(argv: list[str]) -> None:
    import subprocess

    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SeedError(f"{' '.join(argv)} failed (exit {done.returncode}): {done.stderr.strip()}")


def _write(path: Path, data: bytes, mode: int, uid: int = 0, gid: int = 0) -> None:
    """Write ``path`` whole, never readable by others before it has its own mode and owner."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchown(fd, uid, gid)
        os.fchmod(fd, mode)
        os.write(fd, data)
    finally:
        os.close(fd)


def apply_hostname(
    seed: Seed, root: Path, kernel: Path = Path("/proc/sys/kernel/hostname")
) -> None:
    """The hostname now (the kernel's) and at later boots (/etc/hostname, /etc/hosts)."""
    kernel.write_text(seed.hostname)
    _write(root / "etc/hostname", f"{seed.hostname}\n".encode(), 0o644)
    if seed.manage_etc_hosts:
        hosts = (
            f"127.0.0.1 localhost\n127.0.1.1 {seed.hostname}\n"
            "::1 localhost ip6-localhost ip6-loopback\nff02::1 ip6-allnodes\n"
            "ff02::2 ip6-allrouters\n"
        )
        _write(root / "etc/hosts", hosts.encode(), 0o644)


def apply_host_keys(seed: Seed, root: Path) -> None:
    ssh = root / "etc/ssh"
    if seed.delete_host_keys:
        for old in ssh.glob("ssh_host_*"):
            old.unlink()
    for name, text in seed.host_keys.items():
        _write(ssh / name, text.encode(), 0o644 if name.endswith(".pub") else 0o600)


def apply_users(seed: Seed, root: Path, account: Callable[[str], tuple[int, int, str]]) -> None:
    """Each user (made when missing, its password locked as useradd leaves it), its sudo rule
    and its authorized keys. ``account`` gives a user's uid, gid and home (KeyError: none)."""
    rules = []
    for user in seed.users:
        try:
            account(user.name)
        except KeyError:
            _run(["useradd", "--create-home", "--user-group", "--shell", user.shell, user.name])
        uid, gid, home = account(user.name)
        ssh = root / home.lstrip("/") / ".ssh"
        ssh.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chown(ssh, uid, gid)
        keys = "".join(f"{key}\n" for key in user.keys)
        _write(ssh / "authorized_keys", keys.encode(), 0o600, uid, gid)
        if user.sudo is not None:
            rules.append(f"{user.name} {user.sudo}\n")
    if rules:
        _write(root / "etc/sudoers.d/90-vmsandbox-users", "".join(rules).encode(), 0o440)


def apply_network(
    seed: Seed,
    root: Path,
    sys_net: Path = Path("/sys/class/net"),
    *,
    run: Callable[[list[str]], None],
) -> None:
    """systemd-networkd configuration for each NIC, matched by MAC (networkd, ordered after
    this unit, applies it; no shell scripts per interface as with ifupdown), and its name: a
    .link file names it when udev adds it, and one the kernel has already named otherwise is
    renamed now. Nothing waits for a NIC whose driver is still loading.

    Name servers: the seed's static ones go to resolv.conf itself. A DHCP lease's can reach
    resolv.conf only through systemd-resolved, which the image has but leaves off (it would be
    one more daemon before network.target at every boot); it is enabled and started here."""
    resolvers = []
    network = root / "etc/systemd/network"
    for nic in seed.nics:
        match = f"[Match]\nMACAddress={nic.mac}\n"
        link = f"{match}\n[Link]\nName={nic.name}\n"
        _write(network / f"50-vmsandbox-{nic.name}.link", link.encode(), 0o644)
        current = _nic_named(nic.mac, sys_net)
        if current not in (None, nic.name):
            run(["ip", "link", "set", "dev", current, "name", nic.name])
        if nic.dhcp:
            lines = ["[Network]", "DHCP=ipv4"]
        else:  # user-mode networking: its SSH forward and DNS are IPv4, no IPv6 to wait for
            # (and the addresses this unit gives the NIC now are networkd's own, kept)
            lines = ["[Network]", "LinkLocalAddressing=no", "IPv6AcceptRA=no"]
            lines += ["KeepConfiguration=static"]
        lines += [f"Address={address}" for address in nic.addresses]
        lines += [f"Gateway={nic.gateway}"] if nic.gateway else []
        lines += [f"DNS={server}" for server in nic.nameservers]
        text = f"{match}\n" + "\n".join(lines) + "\n"
        _write(network / f"50-vmsandbox-{nic.name}.network", text.encode(), 0o644)
        resolvers += nic.nameservers
    resolv = root / "etc/resolv.conf"
    if any(nic.dhcp for nic in seed.nics):
        resolv.unlink(missing_ok=True)
        resolv.symlink_to("../run/systemd/resolve/stub-resolv.conf")
        run(["systemctl", "enable", "--now", "--no-block", "systemd-resolved.service"])
    elif resolvers:
        resolv.unlink(missing_ok=True)  # may be a link into a resolver's runtime folder
        _write(resolv, "".join(f"nameserver {r}\n" for r in resolvers).encode(), 0o644)


def bring_up(
    seed: Seed,
    root: Path,
    sys_net: Path = Path("/sys/class/net"),
    *,
    run: Callable[[list[str]], None],
) -> None:
    """Each static NIC that is there (named as the seed says), up with its addresses and
    gateway now, at every boot: sshd (which starts before networkd in the project's lean
    images) answers as soon as it listens, and networkd keeps them (KeepConfiguration=static).
    A NIC whose driver is still loading is left to networkd, like one that fails here."""
    for nic in seed.nics:
        if not nic.dhcp and _nic_named(nic.mac, sys_net) == nic.name:
            _bring_up(nic, root, run)


def _bring_up(nic: Nic, root: Path, run: Callable[[list[str]], None]) -> None:
    commands = [f"link set dev {nic.name} up"]
    commands += [f"address replace {address} dev {nic.name}" for address in nic.addresses]
    if nic.gateway:
        commands.append(f"route replace default via {nic.gateway} dev {nic.name}")
    batch = root / "run/vmsandbox-firstboot.ip"
    _write(batch, "".join(f"{command}\n" for command in commands).encode(), 0o600)
    try:
        run(["ip", "-batch", str(batch)])
    except SeedError as exc:
        print(f"{PREFIX}: note: {nic.name} is left to systemd-networkd ({exc})", flush=True)
        return
    finally:
        batch.unlink(missing_ok=True)
    print(f"{PREFIX}: {nic.name} is up at {' '.join(nic.addresses)}", flush=True)


def _nic_named(mac: str, sys_net: Path) -> str | None:
    """The name of the NIC with MAC address ``mac``, or None while there is none."""
    for link in sorted(sys_net.iterdir()) if sys_net.is_dir() else []:
        with open(link / "address") as handle:
            if handle.read().strip().lower() == mac:
                return link.name
    return None


def apply_files(seed: Seed, root: Path, ids: Callable[[str, str], tuple[int, int]]) -> None:
    """write_files, after the users so that a file may belong to the sandbox user."""
    for item in seed.files:
        try:
            uid, gid = ids(item.owner, item.group)
        except KeyError as exc:
            raise SeedError(f"write_files {item.path}: no user or group {exc}") from exc
        path = root / item.path.lstrip("/")
        if item.append and path.exists():
            with open(path, "ab") as handle:
                handle.write(item.data)
            os.chown(path, uid, gid)
            os.chmod(path, item.mode)
        else:
            _write(path, item.data, item.mode, uid, gid)


def system_ids(user: str, group: str) -> tuple[int, int]:
    """uid and gid by name (KeyError when either is missing)."""
    return pwd.getpwnam(user).pw_uid, grp.getgrnam(group).gr_gid


def system_account(user: str) -> tuple[int, int, str]:
    """A user's uid, primary gid and home (KeyError when it is missing)."""
    entry = pwd.getpwnam(user)
    return entry.pw_uid, entry.pw_gid, entry.pw_dir


def apply(seed: Seed, root: Path = Path("/"), state: Path = STATE) -> None:
    """Everything the seed asks for, in the order a sandbox needs it; then the instance-id, so
    a later boot of the same instance does nothing."""
    apply_hostname(seed, root)
    apply_host_keys(seed, root)
    apply_users(seed, root, system_account)
    apply_files(seed, root, system_ids)
    apply_network(seed, root, run=_run)
    bring_up(seed, root, run=_run)
    state.mkdir(mode=0o700, parents=True, exist_ok=True)
    if seed.runcmd:
        _write(state / RUNCMD_FILE, json.dumps(seed.runcmd).encode(), 0o600)
    _write(state / "instance-id", f"{seed.instance_id}\n".encode(), 0o644)


def run_commands(state: Path = STATE) -> int:
    """``--runcmd``: the seed's commands, in order, once; every failure is reported."""
    import subprocess

    path = state / RUNCMD_FILE
    commands = json.loads(path.read_text())
    path.unlink()
    failed = 0
    for argv in commands:
        done = subprocess.run(argv, check=False)
        if done.returncode != 0:
            failed += 1
            print(f"{PREFIX}: error: runcmd {argv!r} exited {done.returncode}", file=sys.stderr)
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    try:
        if argv == ["--runcmd"]:
            return run_commands()
        if argv:
            raise SeedError(f"usage: firstboot.py [--runcmd], got {argv!r}")
        device = find_seed()
        print(f"{PREFIX}: reading the NoCloud seed on {device}", flush=True)
        seed = parse(*read_seed(device))
        done = STATE / "instance-id"
        if done.exists() and done.read_text().strip() == seed.instance_id:
            print(f"{PREFIX}: instance {seed.instance_id} is set up already", flush=True)
            bring_up(seed, Path("/"), run=_run)
            return 0
        apply(seed)
    except (SeedError, OSError, ValueError) as exc:
        print(f"{PREFIX}: error: {exc}", file=sys.stderr, flush=True)
        return 1
    print(f"{PREFIX}: {seed.hostname} is set up (instance {seed.instance_id})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
