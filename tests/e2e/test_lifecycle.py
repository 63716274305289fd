"""End to end on the real libvirtd with the real minimal image under TCG: create, exec, list
from a second process, pinned host key, destroy."""

from __future__ import annotations

import json

import pytest
from framework.sandboxes import cli, leftovers

from vmsandbox.config import Config
from vmsandbox.guest.keys import SandboxKeys, generate
from vmsandbox.guest.ssh import HostKeyMismatch, run
from vmsandbox.sandbox.handle import Sandbox
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.sandbox.record import SandboxFiles
from vmsandbox.sandbox.spec import SandboxSpec, generate_name


def test_exec_reads_the_guests_kernel_and_hostname(manager: SandboxManager, booted: Sandbox):
    result = manager.exec(booted.name, ["sh", "-c", "uname -r; cat /etc/hostname"])
    kernel, hostname = result.stdout.split()
    assert result.exit_status == 0
    assert hostname == booted.name
    image = manager.images.get("minimal")
    assert kernel == image.meta["kernel_version"]


def test_exec_returns_the_commands_exit_status_and_stderr(manager: SandboxManager, booted: Sandbox):
    result = manager.exec(booted.name, "echo out; echo err >&2; exit 7")
    assert (result.exit_status, result.stdout, result.stderr) == (7, "out\n", "err\n")


def test_exec_quotes_each_word(manager: SandboxManager, booted: Sandbox):
    result = manager.exec(booted.name, ["printf", "%s|", "a b", "$(id)", "'; reboot"])
    assert result.stdout == "a b|$(id)|'; reboot|"


def test_cli_exec_streams_output_and_passes_the_exit_status(config: Config, booted: Sandbox):
    done = cli("exec", booted.name, "--", "sh", "-c", "echo hello; exit 3", config=config)
    assert done.returncode == 3
    assert done.stdout == "hello\n"


def test_a_second_process_lists_and_shows_the_sandbox(config: Config, booted: Sandbox):
    listed = json.loads(cli("list", "--json", config=config, check=True).stdout)
    names = [s["name"] for s in listed["sandboxes"]]
    assert booted.name in names
    shown = json.loads(cli("show", booted.name, "--json", config=config, check=True).stdout)
    assert shown["state"] == "ready"
    assert shown["ssh"]["host"] == "127.0.0.1"
    assert shown["ssh"]["port"] == booted.ssh.port


def test_sandbox_files_are_owner_only(config: Config, booted: Sandbox):
    keys = config.sandboxes / booted.name
    assert keys.stat().st_mode & 0o777 == 0o700
    assert (keys / "id_ed25519").stat().st_mode & 0o777 == 0o600
    assert config.sandboxes.stat().st_mode & 0o777 == 0o700
    assert (config.disks / f"{booted.name}-seed.iso").stat().st_mode & 0o077 == 0


def test_a_changed_guest_host_key_is_refused(manager: SandboxManager, booted: Sandbox, tmp_path):
    """The guest is real; the pin is swapped for another key, as if the guest had changed."""
    real = manager.keys_of(booted)
    fake = SandboxKeys(tmp_path, real.host_alias)
    (tmp_path / "id_ed25519").write_bytes(real.client_key.read_bytes())
    (tmp_path / "id_ed25519").chmod(0o600)
    other = generate("someone-else").public_openssh.split()
    fake.known_hosts.write_text(f"{real.host_alias} {other[0]} {other[1]}\n")
    with pytest.raises(HostKeyMismatch) as caught:
        run(booted.ssh, fake, "true")
    assert caught.value.code == "FAILED_PRECONDITION"
    assert "refusing" in caught.value.message


def test_ssh_command_pins_the_host_key(manager: SandboxManager, booted: Sandbox):
    argv = manager.ssh_argv(booted.name, ["true"])
    joined = " ".join(argv)
    assert "StrictHostKeyChecking=yes" in joined
    assert f"HostKeyAlias=vmsbx-{booted.name}" in joined
    assert f"UserKnownHostsFile={manager.keys_of(booted).known_hosts}" in joined
    assert "StrictHostKeyChecking=no" not in joined
    assert "UserKnownHostsFile=/dev/null" not in joined


def test_destroy_leaves_no_domain_overlay_seed_key_or_log(manager: SandboxManager, config: Config):
    """Nothing of a destroyed sandbox remains, libvirt's own QEMU log of it included (8f)."""
    name = generate_name("t")
    manager.create(SandboxSpec(name=name), wait=False)
    qemu_log = SandboxFiles.of(config, name).qemu_log
    assert qemu_log is not None and qemu_log.exists()
    assert leftovers(config, name)
    manager.destroy(name)
    assert leftovers(config, name) == []
    assert not qemu_log.exists()
