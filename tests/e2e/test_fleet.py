"""The fleet with real guests: two hosts on the real libvirtd under TCG, each a ``vmsandbox
serve`` with a state directory of its own (host-a with a warm pool of one minimal guest), joined
to a Ray head inside a network namespace of the test's own; the OpenShell test client drives the
fleet server. A pooled and a cold create through the fleet both reach SSH.

The host drivers start before the test enters its network namespace: their guests forward SSH
to the machine's own loopback, which the drivers (and the check here, run in a thread that goes
back to the machine's network) reach.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from framework.fleet_cluster import cluster, own_network
from framework.openshell_client import Watch, phase, serving, stub
from framework.sandboxes import cli_env, make_config

os.environ.setdefault("RAY_AUTH_MODE", "token")  # read by Ray when it is imported
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))

from vmsandbox.config import Config
from vmsandbox.fleet.core import Fleet
from vmsandbox.fleet.join import read_host
from vmsandbox.openshell.proto import compute_driver_pb2 as pb
from vmsandbox.sandbox.manager import SandboxManager

BOOT = 900.0  # seconds a guest may take to answer SSH under TCG on a busy machine


def host_config(root: Path, name: str, pool: int) -> tuple[Config, dict[str, str]]:
    """Host ``name``'s config (its own state directory, the shared image store) and the
    environment of its processes; ``pool`` minimal guests kept ready. The fleet's agent runs
    as this uid, which the host trusts to speak for the gateways (openshell/caller.py)."""
    folder = root / name
    folder.mkdir()
    os.chmod(folder, 0o711)
    config_file = folder / "config.toml"
    delegate = f"openshell_delegate_uids = [{os.geteuid()}]\n"
    config_file.write_text(delegate + (f"[pool]\nminimal = {pool}\n" if pool else ""))
    config = make_config(folder / "state", **({"pool": {"minimal": pool}} if pool else {}))
    return config, cli_env(config, VMSANDBOX_CONFIG=str(config_file))


def vmsandbox(env: dict[str, str], *args: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "vmsandbox.cli", *args, "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=BOOT,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def in_machine_network(machine: int, body: object) -> object:
    """``body()`` run in a thread that has gone back to the machine's network namespace (the
    descriptor ``machine``)."""
    import ctypes

    found: list[object] = []

    def run() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.setns(machine, 0x40000000) == 0, ctypes.get_errno()
        found.append(body())  # type: ignore[operator]

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return found[0]


@pytest.fixture(scope="module")
def hosts() -> Iterator[dict[str, tuple[Config, Path]]]:
    root = Path(tempfile.mkdtemp(prefix="vmsbx-fleet-e2e-", dir="/var/tmp"))  # libvirt-qemu
    os.chmod(root, 0o711)  # reaches the disks under it
    stack = contextlib.ExitStack()
    stack.callback(shutil.rmtree, root, ignore_errors=True)
    made: dict[str, tuple[Config, Path]] = {}
    with stack:
        for name, pool in (("host-a", 1), ("host-b", 0)):
            config, env = host_config(root, name, pool)
            if pool:
                vmsandbox(env, "pool", "fill")
            socket_path = root / name / "socket" / "driver.sock"  # its folder is made 0700
            stack.enter_context(serving(socket_path, env))
            made[name] = (config, socket_path)
        try:
            yield made
        finally:
            for config, _socket in made.values():
                with SandboxManager(config, reconcile=False) as manager:
                    deadline = time.monotonic() + BOOT  # a refill started by the pooled create
                    while any(
                        g["state"] != "pooled" for s in manager.pool.show() for g in s["guests"]
                    ):
                        assert time.monotonic() < deadline
                        time.sleep(2)
                    manager.pool.drain()
                    for sandbox in manager.list():
                        with contextlib.suppress(Exception):
                            manager.destroy(sandbox.name)


def test_a_pooled_and_a_cold_create_through_the_fleet_reach_ssh(hosts) -> None:
    with own_network() as machine, cluster("vsfe-") as made:
        for name, (_config, socket_path) in hosts.items():
            made.join(name, socket_path)
        made.wait_joined(*hosts)
        fleet_socket = made.root / "fleet" / "driver.sock"
        made.serve(fleet_socket, "e2e")
        fleet = Fleet(made.address, gateway="e2e")
        watch = Watch(fleet_socket)
        channel, client = stub(fleet_socket)
        try:
            pooled_id, placed = fleet.create_sandbox(image="minimal", memory_mib=1024)
            assert (placed.host, placed.pooled) == ("host-a", True)
            cold = pb.DriverSandbox(
                id=f"cold-{secrets.token_hex(4)}",
                name="t-fleet-cold",
                spec=pb.DriverSandboxSpec(
                    template=pb.DriverSandboxTemplate(image="minimal"),
                    command=["sleep", "infinity"],
                ),
            )
            client.CreateSandbox(pb.CreateSandboxRequest(sandbox=cold), timeout=BOOT)
            for sandbox_id in (pooled_id, cold.id):
                assert watch.until("Ready", sandbox_id, timeout=BOOT)[-1] == "Ready"
            listed = {s.id: s for s in client.ListSandboxes(pb.ListSandboxesRequest()).sandboxes}
            assert {phase(listed[pooled_id]), phase(listed[cold.id])} == {"Ready"}
            for sandbox in fleet.sandboxes():
                config, socket_path = hosts[sandbox.host]
                name = next(
                    s["name"]
                    for s in read_host(str(socket_path), wait=False)["sandboxes"]
                    if s["labels"].get("openshell.sandbox-id") == sandbox.sandbox_id
                )

                def hostname(config: Config = config, name: str = name) -> object:
                    with SandboxManager(config, reconcile=False) as manager:
                        done = manager.exec(name, ["hostname"], timeout=120)
                    return done.exit_status, done.stdout.strip()

                assert in_machine_network(machine, hostname) == (0, name)
            for sandbox_id in (pooled_id, cold.id):
                client.DeleteSandbox(pb.DeleteSandboxRequest(sandbox_id=sandbox_id), timeout=300)
            assert fleet.sandboxes() == []
        finally:
            watch.close()
            channel.close()
            fleet.close()
