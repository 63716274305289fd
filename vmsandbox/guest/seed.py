"""The cloud-init NoCloud seed (an ISO 9660 volume labelled ``cidata``) of one sandbox.

user-data is written as JSON after the ``#cloud-config`` line: JSON is YAML, and ``json.dumps``
quotes every value, so no name or key can inject configuration.

A seed that asks for no guest setup and a static NIC also carries ``vmsandbox-firstboot``: the
same values as plain "key value" lines, which the project's minimal image applies in its
initramfs without starting an interpreter (guest/programs/firstboot_lean.sh). cloud-init and the
Python first-boot unit never read it.
"""

from __future__ import annotations

import base64
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from vmsandbox.errors import FailedPrecondition
from vmsandbox.guest.keys import KeyPair, write_private
from vmsandbox.guest.setup import GuestSetup
from vmsandbox.tools import write_with_tool

# The sandbox user's sudo rule.
SUDO_RULE = "ALL=(ALL) NOPASSWD:ALL"


def user_data(
    hostname: str, user: str, client: KeyPair, host: KeyPair, guest: GuestSetup | None = None
) -> dict[str, Any]:
    """The cloud-config: the sandbox user, its key, the pinned host key and ``guest``'s setup."""
    extra = guest.cloud_config(user) if guest is not None else {}
    return {
        **extra,
        "hostname": hostname,
        "manage_etc_hosts": True,
        "users": [
            {
                "name": user,
                "shell": "/bin/bash",
                "sudo": SUDO_RULE,
                "lock_passwd": True,
                "ssh_authorized_keys": [client.public_openssh],
            }
        ],
        "disable_root": True,
        "ssh_deletekeys": True,
        "ssh_genkeytypes": [],
        "ssh_keys": {
            "ed25519_private": host.private_openssh,
            "ed25519_public": host.public_openssh,
        },
    }


def meta_data(instance_id: str, hostname: str) -> dict[str, Any]:
    return {"instance-id": instance_id, "local-hostname": hostname}


def network_config(mac: str, *, user_net: bool) -> dict[str, Any]:
    """The guest's network: its NIC found by MAC (so images with any interface naming work)
    and named eth0. QEMU user-mode networking always hands out the same addresses, so they are
    set statically, sparing the guest a DHCP round (seconds under TCG); a libvirt network uses
    DHCP."""
    nic: dict[str, Any] = {"match": {"macaddress": mac}, "set-name": "eth0"}
    if user_net:
        nic.update(
            addresses=["10.0.2.15/24"],
            gateway4="10.0.2.2",
            nameservers={"addresses": ["10.0.2.3"]},
        )
    else:
        nic["dhcp4"] = True
    return {"version": 2, "ethernets": {"eth0": nic}}


LEAN_FILE = "vmsandbox-firstboot"
LEAN_FORMAT = 1


def lean_lines(
    instance_id: str, hostname: str, user: str, client: KeyPair, host: KeyPair, network: dict
) -> str | None:
    """The ``vmsandbox-firstboot`` file of a seed without guest setup: None when the network is
    not one static NIC (DHCP is the Python unit's: it turns on a resolver) or a value would
    not fit on its line (the Python unit then refuses the seed by name)."""
    nics = list(network.get("ethernets", {}).values())
    if len(nics) != 1 or nics[0].get("dhcp4") or len(nics[0].get("addresses", ())) != 1:
        return None
    nic = nics[0]
    public = (
        host.public_openssh if host.public_openssh.endswith("\n") else host.public_openssh + "\n"
    )
    fields = [
        ("format", str(LEAN_FORMAT)),
        ("instance-id", instance_id),
        ("hostname", hostname),
        ("user", f"{user} /bin/bash"),
        ("sudo", SUDO_RULE),
        ("authorized-key", client.public_openssh),
        ("host-key", f"ssh_host_ed25519_key {_b64(host.private_openssh)}"),
        ("host-key", f"ssh_host_ed25519_key.pub {_b64(public)}"),
        (
            "nic",
            " ".join(
                [
                    nic["match"]["macaddress"].lower(),
                    nic.get("set-name", "eth0"),
                    nic["addresses"][0],
                    nic.get("gateway4", ""),
                    *nic.get("nameservers", {}).get("addresses", []),
                ]
            ),
        ),
    ]
    if any(not value or any(c in value for c in "\n\r\0") for _key, value in fields):
        return None
    return "".join(f"{key} {value}\n" for key, value in fields)


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def write_seed(
    path: Path,
    *,
    instance_id: str,
    hostname: str,
    user: str,
    client: KeyPair,
    host: KeyPair,
    network: dict[str, Any],
    workdir: Path | None = None,
    guest: GuestSetup | None = None,
) -> None:
    """Write the seed ISO to ``path`` (0600: it carries the guest's private host key and any
    secret file of ``guest``).

    Its files are staged in a temporary folder under ``workdir`` (default: TMPDIR); a process
    killed while writing leaves them there, so give a folder that cleanup removes.
    """
    if shutil.which("genisoimage") is None:
        raise FailedPrecondition("genisoimage is missing; run the setup (make setup)")
    with tempfile.TemporaryDirectory(prefix="vmsbx-seed-", dir=workdir) as tmp:
        files = {
            "user-data": "#cloud-config\n"
            + json.dumps(user_data(hostname, user, client, host, guest), indent=1)
            + "\n",
            "meta-data": json.dumps(meta_data(instance_id, hostname)) + "\n",
            "network-config": json.dumps(network) + "\n",
        }
        if guest is None:
            lean = lean_lines(instance_id, hostname, user, client, host, network)
            if lean is not None:
                files[LEAN_FILE] = lean
        for name, text in files.items():
            write_private(Path(tmp) / name, text)
        write_with_tool(
            path,
            lambda partial: [
                *("genisoimage", "-quiet", "-output", str(partial), "-volid", "cidata"),
                *("-joliet", "-rock", *(str(Path(tmp) / name) for name in files)),
            ],
            what=f"genisoimage failed writing {path}",
        )
