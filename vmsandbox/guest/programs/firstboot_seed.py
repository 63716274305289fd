"""The NoCloud seed as vmsandbox's first-boot unit reads it (firstboot.py): the three files
checked whole, every key refused by name unless the unit applies it, into a ``Seed``.

A module of the first-boot unit, installed beside it as /usr/lib/vmsandbox/firstboot_seed.py.
Standard library only: it runs with ``python3 -I -S``.
"""

from __future__ import annotations

import binascii
import ipaddress
import json
from collections import namedtuple

# Every import costs under TCG, on the way to sshd: typing (and dataclasses, which imports inspect)
# is kept out of the way.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

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
