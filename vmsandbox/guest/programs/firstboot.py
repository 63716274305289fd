#!/usr/bin/python3
"""vmsandbox's first-boot unit: applies the NoCloud seed vmsandbox writes, in place of cloud-init.

Baked into the project's own images as /usr/lib/vmsandbox/firstboot.py (compiled there to
firstboot.pyc) and run by ``vmsandbox-firstboot.service`` before systemd-networkd and sshd
start. It reads the seed (an ISO 9660 volume labelled ``cidata``: user-data, meta-data,
network-config) and gives the guest its hostname, the sandbox user with its authorized key and
sudo rule, the pinned SSH host key, the network, and the files of the sandbox's guest setup;
the seed's ``runcmd`` is kept for ``vmsandbox-runcmd.service``, which runs it (``--runcmd``)
beside sshd, as cloud-init's late stages did. Stock cloud images never run this: they keep
cloud-init and read the same seed.

vmsandbox writes user-data as JSON after the ``#cloud-config`` line (JSON is YAML), so the
standard library's json reads it: no YAML parser to start under TCG. Every key is checked
against what this program applies before anything is changed: a key it does not understand
stops the boot with a line ``vmsandbox-firstboot: error: ...`` on the console (vmsandbox's boot
watcher fails the create on it at once), never silently ignored. It applies a seed once per
instance-id. Standard library only: it runs with ``python3 -I -S``.
"""

from __future__ import annotations

import binascii
import grp
import ipaddress
import json
import os
import pwd
import sys
import time
from collections import namedtuple
from pathlib import Path

# Every import costs under TCG, on the way to sshd: typing, dataclasses (inspect) and subprocess
# (imported only to start a program, which a first boot with the image's defaults never does)
# are kept out of the way.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

PREFIX = "vmsandbox-firstboot"
LABEL = b"cidata"
STATE = Path("/var/lib/vmsandbox")
RUNCMD_FILE = "runcmd.json"
# ISO 9660: 2048-byte sectors; the primary volume descriptor at sector 16 ("CD001" at byte 1,
# the volume id at 40), the others after it; a Joliet one is a supplementary descriptor (type 2)
# with one of the UCS-2 escape sequences at byte 88.
ISO_SECTOR = 2048
PVD_OFFSET = 16 * ISO_SECTOR
JOLIET_ESCAPES = (b"%/@", b"%/C", b"%/E")
MAX_DESCRIPTORS = 16
MAX_DIRECTORY = 64 * ISO_SECTOR
SEED_WAIT_S = 60.0
POLL_S = 0.05
SSH_KEY_TYPES = ("rsa", "ecdsa", "ed25519")

# What this program applies, per seed file; anything else is refused by name.
USER_DATA_KEYS = frozenset(
    {
        "hostname",
        "manage_etc_hosts",
        "users",
        "disable_root",
        "ssh_deletekeys",
        "ssh_genkeytypes",
        "ssh_keys",
        "write_files",
        "runcmd",
    }
)
USER_KEYS = frozenset({"name", "shell", "sudo", "lock_passwd", "ssh_authorized_keys"})
FILE_KEYS = frozenset({"path", "content", "permissions", "owner", "append", "encoding"})
META_KEYS = frozenset({"instance-id", "local-hostname"})
NIC_KEYS = frozenset({"match", "set-name", "addresses", "gateway4", "nameservers", "dhcp4"})


class SeedError(Exception):
    """The seed cannot be applied: the message says which key or file, and why."""


def _check_keys(what: str, value: object, known: frozenset[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise SeedError(f"{what} must be a mapping, got {type(value).__name__}")
    unknown = sorted(set(value) - known)
    if unknown:
        raise SeedError(
            f"{what} key {unknown[0]!r} is not understood by this image's first-boot unit "
            f"(it applies: {', '.join(sorted(known))})"
        )
    return value


def _string(what: str, value: object) -> str:
    if not isinstance(value, str) or not value or "\0" in value or "\n" in value:
        raise SeedError(f"{what} must be one line of text, got {value!r}")
    return value


def _ip(what: str, value: object, *, network: bool = False) -> str:
    """An IP address (``network``: with its prefix length, as 10.0.2.15/24), as given."""
    text = _string(what, value)
    try:
        if network and "/" in text:
            ipaddress.ip_interface(text)
        else:
            ipaddress.ip_address(text)
    except ValueError:
        shape = "an address with its prefix length such as 10.0.2.15/24" if network else "an IP"
        raise SeedError(f"{what} must be {shape}, got {text!r}") from None
    return text


def _flag(what: str, value: object, allowed: tuple[bool, ...] = (True, False)) -> bool:
    if value not in allowed or not isinstance(value, bool):
        raise SeedError(f"{what} must be {' or '.join(map(str, allowed)).lower()}, got {value!r}")
    return value


class User(namedtuple("User", "name shell sudo keys")):
    """A user: name, shell, sudo rule (None: none), authorized keys."""

    __slots__ = ()


class File(namedtuple("File", "path data mode owner group append")):
    """One of write_files: its data is bytes and may be a secret, never shown."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"File(path={self.path!r}, mode={self.mode:#o}, owner={self.owner!r}, ...)"


class Nic(namedtuple("Nic", "mac name addresses gateway nameservers dhcp")):
    """A NIC by MAC: its name, static addresses (CIDR), gateway, name servers, or DHCP."""

    __slots__ = ()


class Seed(
    namedtuple(
        "Seed",
        "instance_id hostname manage_etc_hosts users delete_host_keys host_keys files runcmd nics",
    )
):
    """A seed, checked whole: what the guest gets (host_keys: file name under /etc/ssh -> its
    text; never shown, like the files)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"Seed(instance_id={self.instance_id!r}, hostname={self.hostname!r}, ...)"


def parse(user_data: str, meta_data: str, network_config: str) -> Seed:
    """The seed's three files, checked; SeedError names the first key or value it refuses."""
    header, _, body = user_data.partition("\n")
    if header.strip() != "#cloud-config":
        raise SeedError(f"user-data must start with '#cloud-config', got {header[:40]!r}")
    try:
        config = json.loads(body) if body.strip() else {}
        meta = json.loads(meta_data)
        network = json.loads(network_config) if network_config.strip() else None
    except json.JSONDecodeError as exc:
        raise SeedError(
            f"the seed is not the JSON that vmsandbox writes ({exc}); an image with this unit "
            "reads only vmsandbox's seeds (stock cloud images use cloud-init)"
        ) from exc
    config = _check_keys("user-data", config, USER_DATA_KEYS)
    meta = _check_keys("meta-data", meta, META_KEYS)
    hostname = _string("user-data hostname", config.get("hostname", meta.get("local-hostname")))
    _flag("user-data disable_root", config.get("disable_root", True), (True,))
    genkeys = config.get("ssh_genkeytypes", [])
    if genkeys != []:
        raise SeedError(
            f"user-data ssh_genkeytypes must be [] (host keys come from ssh_keys), got {genkeys!r}"
        )
    return Seed(
        instance_id=_string("meta-data instance-id", meta.get("instance-id")),
        hostname=hostname,
        manage_etc_hosts=_flag("user-data manage_etc_hosts", config.get("manage_etc_hosts", False)),
        users=tuple(_user(i, u) for i, u in enumerate(_list("user-data users", config, "users"))),
        delete_host_keys=_flag("user-data ssh_deletekeys", config.get("ssh_deletekeys", True)),
        host_keys=_host_keys(config.get("ssh_keys", {})),
        files=tuple(
            _file(i, f) for i, f in enumerate(_list("user-data write_files", config, "write_files"))
        ),
        runcmd=tuple(_command(i, c) for i, c in enumerate(_list("runcmd", config, "runcmd"))),
        nics=_network(network),
    )


def _list(what: str, config: dict[str, Any], key: str) -> list[Any]:
    value = config.get(key, [])
    if not isinstance(value, list):
        raise SeedError(f"{what} must be a list, got {type(value).__name__}")
    return value


def _user(index: int, value: object) -> User:
    what = f"user-data users[{index}]"
    entry = _check_keys(what, value, USER_KEYS)
    _flag(f"{what} lock_passwd", entry.get("lock_passwd", True), (True,))
    keys = entry.get("ssh_authorized_keys", [])
    if not isinstance(keys, list):
        raise SeedError(f"{what} ssh_authorized_keys must be a list")
    sudo = entry.get("sudo")
    return User(
        name=_string(f"{what} name", entry.get("name")),
        shell=_string(f"{what} shell", entry.get("shell", "/bin/bash")),
        sudo=None if sudo is None else _string(f"{what} sudo", sudo),
        keys=tuple(_string(f"{what} ssh_authorized_keys[{i}]", k) for i, k in enumerate(keys)),
    )


def _host_keys(value: object) -> dict[str, str]:
    known = frozenset(f"{t}_{part}" for t in SSH_KEY_TYPES for part in ("private", "public"))
    entry = _check_keys("user-data ssh_keys", value, known)
    keys = {}
    for key, text in entry.items():
        if not isinstance(text, str) or not text.strip():
            raise SeedError(f"user-data ssh_keys {key} must be the key's text")
        kind, part = key.rsplit("_", 1)
        name = f"ssh_host_{kind}_key" + (".pub" if part == "public" else "")
        keys[name] = text if text.endswith("\n") else text + "\n"
    return keys


def _file(index: int, value: object) -> File:
    what = f"user-data write_files[{index}]"
    entry = _check_keys(what, value, FILE_KEYS)
    path = _string(f"{what} path", entry.get("path"))
    if not path.startswith("/") or "/../" in path + "/":
        raise SeedError(f"{what} path must be absolute, without '..', got {path!r}")
    content = entry.get("content", "")
    if not isinstance(content, str):
        raise SeedError(f"{what} content must be text")
    encoding = entry.get("encoding", "text/plain")
    if encoding in ("b64", "base64"):
        data = binascii.a2b_base64(content, strict_mode=True)
    elif encoding == "text/plain":
        data = content.encode()
    else:
        raise SeedError(f"{what} encoding {encoding!r} is not understood (b64 or none)")
    permissions = entry.get("permissions", "0644")
    try:
        mode = int(permissions, 8) if isinstance(permissions, str) else -1
    except ValueError:
        mode = -1
    if not 0 <= mode <= 0o7777:
        raise SeedError(f"{what} permissions must be octal such as '0600', got {permissions!r}")
    owner, _, group = _string(f"{what} owner", entry.get("owner", "root:root")).partition(":")
    return File(
        path=path,
        data=data,
        mode=mode,
        owner=owner,
        group=group or owner,
        append=_flag(f"{what} append", entry.get("append", False)),
    )


def _command(index: int, value: object) -> list[str]:
    if isinstance(value, str):
        return ["sh", "-c", value]
    if isinstance(value, list) and value and all(isinstance(word, str) for word in value):
        return list(value)
    raise SeedError(f"runcmd[{index}] must be a shell line or a list of words, got {value!r}")


def _network(value: object) -> tuple[Nic, ...]:
    if value is None:
        return ()
    config = _check_keys("network-config", value, frozenset({"version", "ethernets"}))
    if config.get("version") != 2:
        raise SeedError(f"network-config version must be 2, got {config.get('version')!r}")
    ethernets = config.get("ethernets", {})
    if not isinstance(ethernets, dict):
        raise SeedError("network-config ethernets must be a mapping")
    return tuple(_nic(key, nic) for key, nic in ethernets.items())


def _nic(key: str, value: object) -> Nic:
    what = f"network-config ethernets.{key}"
    entry = _check_keys(what, value, NIC_KEYS)
    match = _check_keys(f"{what} match", entry.get("match"), frozenset({"macaddress"}))
    dns = _check_keys(f"{what} nameservers", entry.get("nameservers", {}), frozenset({"addresses"}))
    addresses = entry.get("addresses", [])
    servers = dns.get("addresses", [])
    if not isinstance(addresses, list) or not isinstance(servers, list):
        raise SeedError(f"{what} addresses and nameservers.addresses must be lists")
    dhcp = _flag(f"{what} dhcp4", entry.get("dhcp4", False))
    if dhcp == bool(addresses):
        raise SeedError(f"{what} needs either dhcp4: true or static addresses, not both")
    gateway = entry.get("gateway4")
    return Nic(
        mac=_string(f"{what} match.macaddress", match.get("macaddress")).lower(),
        name=_string(f"{what} set-name", entry.get("set-name", key)),
        addresses=tuple(_ip(f"{what} addresses", a, network=True) for a in addresses),
        gateway=None if gateway is None else _ip(f"{what} gateway4", gateway),
        nameservers=tuple(_ip(f"{what} nameservers", a) for a in servers),
        dhcp=dhcp,
    )


# -- reading the seed -----------------------------------------------------------------------------


def _volume_label(device: Path) -> bytes | None:
    """The ISO 9660 volume id of a block device, or None when it holds no ISO 9660 volume."""
    try:
        with device.open("rb") as handle:
            handle.seek(PVD_OFFSET)
            pvd = handle.read(72)
    except OSError:
        return None
    if len(pvd) < 72 or pvd[:6] != b"\x01CD001":
        return None
    return pvd[40:72].rstrip(b" \0")


def find_seed(dev: Path = Path("/dev"), timeout: float = SEED_WAIT_S) -> Path:
    """The block device of the volume labelled cidata (whole disks and CD-ROMs, waited for:
    their drivers may still be loading)."""
    deadline = time.monotonic() + timeout
    while True:
        for name in sorted(os.listdir("/sys/class/block")):
            partition = os.path.exists(f"/sys/class/block/{name}/partition")
            if not partition and _volume_label(dev / name) == LABEL:
                return dev / name
        if time.monotonic() > deadline:
            raise SeedError(
                f"no NoCloud seed (an ISO 9660 volume labelled cidata) appeared within "
                f"{timeout:.0f}s"
            )
        time.sleep(POLL_S)


def read_seed(device: Path) -> tuple[str, ...]:
    """user-data, meta-data and network-config ("" when absent) of the seed on ``device``,
    read from its Joliet directory (vmsandbox writes the seed with genisoimage -joliet): no
    mount, so no mount and umount programs and no iso9660 driver to load on the way to sshd."""
    try:
        with device.open("rb") as volume:
            files = _joliet_root(volume, device)
            texts = []
            for name in ("user-data", "meta-data", "network-config"):
                if name not in files:
                    if name == "network-config":
                        texts.append("")
                        continue
                    raise SeedError(f"the seed on {device} has no {name}")
                extent, size = files[name]
                volume.seek(extent * ISO_SECTOR)
                data = volume.read(size)
                if len(data) != size:
                    raise SeedError(f"the seed on {device} ends inside {name}")
                texts.append(data.decode())
            return tuple(texts)
    except UnicodeDecodeError as exc:
        raise SeedError(f"the seed on {device} holds a file that is not UTF-8 ({exc})") from exc


def _joliet_root(volume: Any, device: Path) -> dict[str, tuple[int, int]]:
    """The files in the root directory of the volume's Joliet tree: name -> (extent, size)."""
    for sector in range(16, 16 + MAX_DESCRIPTORS):
        volume.seek(sector * ISO_SECTOR)
        descriptor = volume.read(ISO_SECTOR)
        if len(descriptor) < ISO_SECTOR or descriptor[1:6] != b"CD001" or descriptor[0] == 255:
            break
        if descriptor[0] == 2 and descriptor[88:91] in JOLIET_ESCAPES:
            root = descriptor[156:190]
            extent, size = _u32(root, 2), _u32(root, 10)
            if size > MAX_DIRECTORY:
                raise SeedError(f"the seed on {device} has a root directory of {size} bytes")
            volume.seek(extent * ISO_SECTOR)
            return _directory(volume.read(size))
    raise SeedError(f"the seed on {device} has no Joliet directory (vmsandbox writes one)")


def _directory(data: bytes) -> dict[str, tuple[int, int]]:
    """The plain files of one ISO 9660 directory with Joliet (UCS-2) names, version cut."""
    files = {}
    at = 0
    while at < len(data):
        length = data[at]
        if length == 0:  # records do not cross sectors: the rest of this one is padding
            at = (at // ISO_SECTOR + 1) * ISO_SECTOR
            continue
        record = data[at : at + length]
        at += length
        name_length = record[32]
        if length < 33 + name_length or record[25] & 0x02:  # short, or a directory
            continue
        name = record[33 : 33 + name_length].decode("utf-16-be", errors="replace")
        files[name.split(";", 1)[0]] = (_u32(record, 2), _u32(record, 10))
    return files


def _u32(data: bytes, at: int) -> int:
    """The little-endian half of an ISO 9660 both-endian 32-bit number."""
    return int.from_bytes(data[at : at + 4], "little")


# -- applying it ----------------------------------------------------------------------------------


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
