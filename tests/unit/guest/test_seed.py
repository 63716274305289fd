"""The NoCloud seed: label cidata, the sandbox's keys, no injection through values."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from framework.seeds import read_iso

from vmsandbox.guest.keys import SandboxKeys, generate
from vmsandbox.guest.seed import network_config, write_seed


def test_seed_carries_label_keys_and_static_network(tmp_path: Path):
    client, host = generate("c"), generate("h")
    iso = tmp_path / "seed.iso"
    net = network_config("52:54:00:ab:cd:ef", user_net=True)
    write_seed(
        iso,
        instance_id="iid-1",
        hostname="box",
        user="sandbox",
        client=client,
        host=host,
        network=net,
    )
    assert iso.stat().st_mode & 0o777 == 0o600
    label = subprocess.run(
        ["isoinfo", "-d", "-i", str(iso)], capture_output=True, text=True, check=True
    ).stdout
    assert "Volume id: cidata" in label
    user_data = read_iso(iso, "user-data")
    assert user_data.startswith("#cloud-config\n")
    config = json.loads(user_data.split("\n", 1)[1])
    assert config["users"][0]["name"] == "sandbox"
    assert config["users"][0]["ssh_authorized_keys"] == [client.public_openssh]
    assert config["ssh_keys"]["ed25519_private"] == host.private_openssh
    assert config["ssh_genkeytypes"] == [] and config["ssh_deletekeys"] is True
    assert json.loads(read_iso(iso, "meta-data")) == {
        "instance-id": "iid-1",
        "local-hostname": "box",
    }
    network = json.loads(read_iso(iso, "network-config"))
    assert network["ethernets"]["eth0"]["match"] == {"macaddress": "52:54:00:ab:cd:ef"}
    assert network["ethernets"]["eth0"]["addresses"] == ["10.0.2.15/24"]
    assert "dhcp4" in network_config("52:54:00:ab:cd:ef", user_net=False)["ethernets"]["eth0"]


def test_hostile_values_stay_quoted_strings(tmp_path: Path):
    iso = tmp_path / "seed.iso"
    evil = "x\nruncmd: [reboot]\n#"
    write_seed(
        iso,
        instance_id="i",
        hostname=evil,
        user="sandbox",
        client=generate("c"),
        host=generate("h"),
        network=network_config("52:54:00:00:00:01", user_net=True),
    )
    config = json.loads(read_iso(iso, "user-data").split("\n", 1)[1])
    assert config["hostname"] == evil
    assert "runcmd" not in config


def test_keys_are_owner_only_and_pinned_under_the_alias(tmp_path: Path):
    keys, client, host = SandboxKeys.create(tmp_path / "k", "vmsbx-box")
    assert (tmp_path / "k").stat().st_mode & 0o777 == 0o700
    for path in (keys.client_key, keys.known_hosts):
        assert path.stat().st_mode & 0o777 == 0o600
    assert keys.host_public_key() == " ".join(host.public_openssh.split()[:2])
    assert keys.known_hosts.read_text().startswith("vmsbx-box ssh-ed25519 ")
    assert "PRIVATE KEY" in keys.client_key.read_text()
    assert client.public_openssh.startswith("ssh-ed25519 ")
