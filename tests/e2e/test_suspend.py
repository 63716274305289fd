"""Suspend and resume on the real libvirtd. With the run's one booted guest (left running for the
tests after): a process started before keeps its PID and its in-memory counter, a file written
before keeps its checksum, the guest's clock is set right after the resume, through the
guest's control channel, and a login the suspend cut ends in the guest too. With a sandbox of
its own, suspended while it boots: the save waits for that channel, and destroy removes the
save file."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

from framework.sandboxes import cli, leftovers

from vmsandbox.config import Config
from vmsandbox.sandbox.handle import Sandbox
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.sandbox.spec import generate_name
from vmsandbox.vm.domain import CONTROL_PORT

SAVE_DIR = Path("/var/lib/libvirt/qemu/save")
COUNTER = (
    "setsid sh -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/counter; sleep 0.2; done' "
    "</dev/null >/dev/null 2>&1 & echo $!"
)


def _out(manager: SandboxManager, name: str, command: str) -> str:
    result = manager.exec(name, command, timeout=60)
    assert result.exit_status == 0, result.stderr
    return result.stdout.strip()


def test_a_suspended_sandbox_comes_back_as_it_was(
    manager: SandboxManager, config: Config, booted: Sandbox
) -> None:
    name = booted.name
    pid = _out(manager, name, COUNTER)
    _out(manager, name, "head -c 1048576 /dev/urandom > ~/data && sync")
    checksum = _out(manager, name, "sha256sum ~/data")
    time.sleep(1)
    counted = int(_out(manager, name, "cat /tmp/counter"))

    done = cli("suspend", name, "--json", config=config)
    assert done.returncode == 0, done.stderr
    suspended = json.loads(done.stdout)["sandboxes"][0]
    assert suspended["state"] == "suspended" and suspended["saved_bytes"] > 0
    save = SAVE_DIR / f"{booted.domain}.save"
    assert save.exists() and save.stat().st_size == suspended["saved_bytes"]
    assert not manager.hypervisor.running(booted.domain)
    listed = json.loads(cli("list", "--json", config=config).stdout)
    assert [s["state"] for s in listed["sandboxes"] if s["name"] == name] == ["suspended"]
    assert listed["saved_bytes"] >= suspended["saved_bytes"]
    with manager.locked():  # a record change while saved: the restored domain answers with it
        found = manager.store.require(name)
        labels = {**found.record.labels, "while-saved": "1"}
        manager.store.commit(found, lambda now: replace(now, labels=labels))
    time.sleep(5)  # the guest's clock stands still meanwhile; the resume sets it

    said: list[str] = []
    manager.progress, before = said.append, manager.progress
    try:
        resumed = manager.resume(name)
    finally:
        manager.progress = before
    assert resumed.state == "ready" and resumed.saved_bytes == 0
    assert resumed.labels.get("while-saved") == "1"
    assert f"{name} woken through its control channel" in said  # no SSH login, no wait
    assert manager.hypervisor.channel_state(booted.domain, CONTROL_PORT) == "connected"
    assert not save.exists()
    guest_clock = float(_out(manager, name, "date +%s.%N"))
    assert abs(guest_clock - time.time()) < 3
    assert _out(manager, name, f"kill -0 {pid} && echo alive") == "alive"
    time.sleep(1)
    assert int(_out(manager, name, "cat /tmp/counter")) > counted
    assert _out(manager, name, "sha256sum ~/data") == checksum

    _out(manager, name, f"kill {pid}; rm -f ~/data /tmp/counter")
    with manager.locked():
        found = manager.store.require(name)
        manager.store.commit(found, lambda now: replace(now, labels=booted.labels))


def test_a_login_cut_by_a_suspend_ends_in_the_guest(
    manager: SandboxManager, booted: Sandbox
) -> None:
    """A login open across a suspend loses its host side with the old QEMU's network forward,
    and the guest is never told: its sshd must end that login after the resume
    (ClientAliveInterval) rather than keep it until TCP's keepalive, hours later."""
    name = booted.name
    logins = "pgrep -f '^sshd: [a-z_]+(@notty)?$' | grep -vx $PPID || true"  # not this one
    before = set(_out(manager, name, logins).split())
    client = manager.connect(name)  # logged in, then left idle
    try:
        (login,) = set(_out(manager, name, logins).split()) - before
        manager.suspend(name)
        manager.resume(name)
        deadline = time.monotonic() + 90
        while _out(manager, name, f"kill -0 {login} 2>/dev/null && echo alive || true"):
            assert time.monotonic() < deadline, f"sshd {login} of the cut login still runs"
            time.sleep(3)
    finally:
        client.close()


def test_destroy_removes_a_suspended_sandboxs_save(config: Config) -> None:
    """Suspended while it still boots: the save waits for its control channel first."""
    name = generate_name("sx")
    done = cli("create", name, "--memory", "256", "--no-wait", config=config)
    try:
        assert done.returncode == 0, done.stderr
        done = cli("suspend", name, config=config)  # its progress on stderr
        assert done.returncode == 0, done.stderr
        assert f"waiting for {name}'s guest to serve its control channel" in done.stderr
        save = SAVE_DIR / f"vmsbx-{name}.save"
        assert save.exists()
        done = cli("destroy", name, config=config)
        assert done.returncode == 0, done.stderr
        assert not save.exists() and leftovers(config, name) == []
    finally:
        cli("destroy", name, config=config)
