"""The cloud-init NoCloud seed (an ISO 9660 volume labelled ``cidata``) of one sandbox.

user-data is written as JSON after the ``#cloud-config`` line: JSON is YAML, and ``json.dumps``
quotes every value, so no name or key can inject configuration.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from vmsandbox.errors import FailedPrecondition
from vmsandbox.guest.keys import KeyPair, write_private
from vmsandbox.guest.setup import GuestSetup
from vmsandbox.tools import write_with_tool


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
                "sudo": "ALL=(ALL) NOPASSWD:ALL",
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
