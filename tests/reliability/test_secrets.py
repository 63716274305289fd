"""Secrets and access: keys, seeds and the state directory are the owner's alone (even when
the CLI runs under ``umask 000``), and neither ``vmsandbox ssh`` nor ``exec`` ever talks to a
guest whose host key is not the pinned one, or turns host key checking off.

Extends tests/e2e/test_lifecycle.py (which checks the booted guest's key folder and the
paramiko refusal of a changed key) to the whole state tree, the OpenSSH path and an empty pin.
"""

from __future__ import annotations

import ast
import contextlib
import itertools
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from framework.paths import REPO
from framework.sandboxes import cli, leftovers

from vmsandbox.config import Config
from vmsandbox.guest.keys import generate
from vmsandbox.sandbox.handle import Sandbox
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.sandbox.spec import SandboxSpec, generate_name

PACKAGE = REPO / "vmsandbox"


def modes(root: Path) -> dict[str, int]:
    """Permission bits of ``root`` and everything under it, by path relative to ``root``."""
    found = {".": stat.S_IMODE(root.lstat().st_mode)}
    for path in root.rglob("*"):
        found[str(path.relative_to(root))] = stat.S_IMODE(path.lstat().st_mode)
    return found


@pytest.fixture
def fresh_state(config: Config) -> Iterator[Config]:
    """A state directory that does not exist yet: the CLI makes it."""
    parent = Path(tempfile.mkdtemp(prefix="vmsbx-secrets-", dir="/var/tmp"))
    os.chmod(parent, 0o711)
    yield replace(config, state_dir=parent / "state")
    shutil.rmtree(parent, ignore_errors=True)


def test_the_state_tree_is_the_owners_alone_after_a_cli_create_under_umask_000(
    fresh_state: Config,
) -> None:
    """Keys folder 0700 and every file in it 0600; overlay, seed and lock 0600; the state and
    disks folders 0711 (QEMU, running as another user, must traverse to the disks, never list
    or read them); nothing anywhere writable or readable by group or others."""
    cfg = fresh_state
    name = generate_name("t")
    env = {
        **os.environ,
        "VMSANDBOX_CONFIG": "/nonexistent",
        "VMSANDBOX_URI": cfg.uri,
        "VMSANDBOX_STATE_DIR": str(cfg.state_dir),
        "VMSANDBOX_IMAGE_DIR": str(cfg.images),
        "VMSANDBOX_VIRT_TYPE": cfg.virt_type,
    }
    done = subprocess.run(
        [sys.executable, "-m", "vmsandbox.cli", "create", name, "--memory", "256", "--no-wait"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
        preexec_fn=lambda: os.umask(0),
    )
    try:
        assert done.returncode == 0, done.stderr
        tree = modes(cfg.state_dir)
        assert f"sandboxes/{name}/id_ed25519" in tree and f"disks/{name}-seed.iso" in tree
        for path, mode in tree.items():
            assert mode & 0o066 == 0, f"{path} is {mode:04o}"  # no read or write but ours
        for folder in (".", "disks"):
            assert tree[folder] == 0o711, f"{folder} is {tree[folder]:04o}"
        for path, mode in modes(cfg.sandboxes).items():
            is_dir = (cfg.sandboxes / path).is_dir()
            assert mode == (0o700 if is_dir else 0o600), f"sandboxes/{path} is {mode:04o}"
        for path, mode in modes(cfg.disks).items():
            if path != ".":
                assert mode & 0o077 == 0, f"disks/{path} is {mode:04o}"
        assert tree["host.lock"] & 0o077 == 0
    finally:
        cli("destroy", name, config=cfg)
    assert leftovers(cfg, name) == []


def test_no_code_path_turns_host_key_checking_off() -> None:
    """No trust-on-first-use anywhere in the package: no paramiko policy that accepts unknown
    keys (only RejectPolicy), no system known_hosts, no OpenSSH option that relaxes the check."""
    relaxed = re.compile(
        r"(StrictHostKeyChecking\s*=?\s*(no|off|accept-new)|UserKnownHostsFile\s*=?\s*/dev/null"
        r"|CheckHostIP\s*=?\s*no)",
        re.IGNORECASE,
    )
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(PACKAGE.parent)}:{getattr(node, 'lineno', '?')}"
            name = getattr(node, "attr", None) or getattr(node, "id", None)
            if name in ("AutoAddPolicy", "WarningPolicy", "load_system_host_keys"):
                offenders.append(f"{where}: {name}")
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                offenders += [f"{where}: {m.group(0)}" for m in relaxed.finditer(node.value)]
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", None) == "set_missing_host_key_policy"
                and "RejectPolicy" not in ast.unparse(node.args[0])
            ):
                offenders.append(f"{where}: {ast.unparse(node)}")
    assert offenders == []


def test_ssh_command_words_cannot_become_ssh_options(
    manager: SandboxManager, config: Config
) -> None:
    """``vmsandbox ssh NAME -- -o StrictHostKeyChecking=no`` runs that as the remote command:
    the pinning options come first (OpenSSH keeps the first value of an option) and the
    user's words only after ``--``."""
    name = generate_name("t")
    try:
        manager.create(SandboxSpec(name=name, memory_mib=256), wait=False)
        hostile = ["-o", "StrictHostKeyChecking=no", "-oUserKnownHostsFile=/dev/null"]
        argv = manager.ssh_argv(name, hostile)
        cut = argv.index("--")
        assert argv[cut + 1 :] == hostile
        options = {}
        for flag, value in itertools.pairwise(argv[: cut + 1]):
            if flag == "-o":
                key, _, setting = value.partition("=")
                options.setdefault(key.lower(), setting)
        assert options["stricthostkeychecking"] == "yes"
        keys = manager.keys_of(manager.get(name))
        assert options["userknownhostsfile"] == str(keys.known_hosts)
        assert options["hostkeyalias"] == keys.host_alias
        assert options["globalknownhostsfile"] == "/dev/null"
    finally:
        manager.destroy(name)
    assert leftovers(config, name) == []


@contextlib.contextmanager
def pinned(known_hosts: Path, text: str) -> Iterator[None]:
    """Replace a sandbox's pinned host key for the duration of the block."""
    saved = known_hosts.read_bytes()
    try:
        known_hosts.write_text(text)
        yield
    finally:
        known_hosts.write_bytes(saved)
        known_hosts.chmod(0o600)


def test_ssh_and_exec_refuse_a_guest_whose_host_key_is_not_the_pinned_one(
    manager: SandboxManager, config: Config, booted: Sandbox
) -> None:
    """The booted guest is real; its pin is swapped for another key (as if the guest, or a man
    in the middle on its port, had changed), then emptied. ``vmsandbox ssh`` (OpenSSH with
    the argv of ``ssh_argv``) exits 255 with OpenSSH's verification error; ``vmsandbox exec``
    (paramiko) exits 5, FAILED_PRECONDITION; neither learns the guest's key."""
    keys = manager.keys_of(booted)
    assert cli("ssh", booted.name, "--", "true", config=config).returncode == 0  # the control
    other = generate("someone-else").public_openssh.split()
    for text in (f"{keys.host_alias} {other[0]} {other[1]}\n", ""):
        with pinned(keys.known_hosts, text):
            ssh = cli("ssh", booted.name, "--", "true", config=config)
            assert ssh.returncode == 255, ssh.stderr
            assert "Host key verification failed" in ssh.stderr
            done = cli("exec", booted.name, "--", "true", config=config)
            assert done.returncode == 5, done.stderr
            assert done.stderr.startswith("error: FAILED_PRECONDITION: "), done.stderr
            assert keys.known_hosts.read_text() == text  # nothing learned, nothing added
    assert manager.exec(booted.name, ["true"]).exit_status == 0  # the real pin works again
