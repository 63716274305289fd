"""Concurrent use from separate processes: parallel creates and destroys of different
sandboxes, racing destroys of one sandbox, racing creates of one name. Each ends in a
consistent state with no error but the expected NOT_FOUND / ALREADY_EXISTS.

Guests are created with ``--no-wait`` (QEMU runs, nobody waits for SSH) to keep this fast.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

import pytest
from framework.sandboxes import cli, cli_env, leftovers

from vmsandbox.config import Config
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.sandbox.spec import SandboxSpec, generate_name

SMALL = ("--memory", "256", "--no-wait")


def in_parallel(config: Config, commands: Sequence[Sequence[str]]) -> list[tuple[int, str]]:
    """Start every CLI command at once (each its own process); their exit codes and stderr."""
    env = cli_env(config)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "vmsandbox.cli", *command],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for command in commands
    ]
    results = []
    for proc in procs:
        _out, err = proc.communicate(timeout=300)
        results.append((proc.returncode, err))
    return results


def listed(config: Config) -> dict[str, dict]:
    done = cli("list", "--json", config=config, check=True)
    return {s["name"]: s for s in json.loads(done.stdout)["sandboxes"]}


def cleanup(config: Config, names: Sequence[str]) -> None:
    for name in names:
        if leftovers(config, name):
            cli("destroy", name, config=config)


def test_four_parallel_creates_then_four_parallel_destroys(config: Config) -> None:
    names = [generate_name("t") for _ in range(4)]
    try:
        created = in_parallel(config, [("create", name, *SMALL) for name in names])
        assert [code for code, _err in created] == [0, 0, 0, 0], created
        sandboxes = listed(config)
        assert all(sandboxes[name]["state"] == "started" for name in names)  # --no-wait
        ports = {sandboxes[name]["ssh"]["port"] for name in names}
        assert len(ports) == 4, "each sandbox forwards SSH on its own port"
        destroyed = in_parallel(config, [("destroy", name) for name in names])
        assert [code for code, _err in destroyed] == [0, 0, 0, 0], destroyed
        for name in names:
            assert leftovers(config, name) == []
        assert not set(names) & set(listed(config))
    finally:
        cleanup(config, names)


@pytest.mark.parametrize("round_", range(3))
def test_two_destroys_of_one_sandbox_race_cleanly(config: Config, round_: int) -> None:
    """Both succeed, or one succeeds and the other finds nothing (NOT_FOUND); never another
    error, and nothing is left."""
    name = generate_name("t")
    try:
        assert cli("create", name, *SMALL, config=config).returncode == 0
        time.sleep(0.1 * round_)  # a little more of the guest's boot going on, round by round
        results = in_parallel(config, [("destroy", name), ("destroy", name)])
        codes = sorted(code for code, _err in results)
        assert codes in ([0, 0], [0, 3]), results
        for code, err in results:
            if code == 3:
                assert err.startswith("error: NOT_FOUND: "), err
        assert leftovers(config, name) == []
    finally:
        cleanup(config, [name])


def test_two_creates_of_one_name_give_one_sandbox_and_already_exists(config: Config) -> None:
    """Exactly one create wins; the other is ALREADY_EXISTS and leaves the winner intact."""
    name = generate_name("t")
    try:
        results = in_parallel(config, [("create", name, *SMALL), ("create", name, *SMALL)])
        codes = sorted(code for code, _err in results)
        assert codes == [0, 4], results
        loser = next(err for code, err in results if code == 4)
        assert "error: ALREADY_EXISTS: " in loser
        assert listed(config)[name]["state"] == "started"  # --no-wait
        made = leftovers(config, name)
        assert f"domain vmsbx-{name}" in made and len(made) >= 4  # domain, overlay, seed, keys
        assert cli("destroy", name, config=config).returncode == 0
        assert leftovers(config, name) == []
    finally:
        cleanup(config, [name])


def test_a_forwarded_port_taken_before_qemu_starts_is_replaced(config: Config) -> None:
    """Another program binds the SSH port chosen for a sandbox between define and start: the
    real QEMU cannot forward it, and the create plans another port and starts (defect 8e)."""
    name, said = generate_name("t"), []
    squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)

    def take_the_port(stage: str) -> None:
        if stage == "define":
            xml = manager.conn.lookupByName(f"vmsbx-{name}").XMLDesc(0)
            found = re.search(r"hostfwd=tcp:127\.0\.0\.1:(\d+)-", xml)
            assert found is not None
            port = int(found.group(1))
            squatter.bind(("127.0.0.1", port))
            squatter.listen()

    try:
        with SandboxManager(
            config, progress=said.append, reconcile=False, checkpoint=take_the_port
        ) as manager:
            sandbox = manager.create(SandboxSpec(name=name, memory_mib=256), wait=False)
            assert any("was taken meanwhile" in line for line in said), said
            assert sandbox.ssh is not None
            assert sandbox.ssh.port != squatter.getsockname()[1]
            assert manager.get(name).state == "started"
    finally:
        squatter.close()
        cleanup(config, [name])
    assert leftovers(config, name) == []
