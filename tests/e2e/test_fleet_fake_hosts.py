"""The fleet end to end on one machine: a Ray head and four hosts inside a network namespace of
the test's own, each host a vmsandbox driver on the fake hypervisor under its own umockdev host
(tests/framework/fleet_host.py): two HGX H100 boards in shared NVSwitch mode with the fake fmpm, one
HGX H100 board in full passthrough, one RTX 2080 Ti workstation. The OpenShell test client drives
the fleet server's socket; Ray itself is read for claims and free amounts.

One cluster serves the module; the tests run in order and each leaves the fleet empty.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from framework.fleet_cluster import Cluster, cluster, free_port, own_network, start_fake_host
from framework.openshell_client import Watch, phase, stub

# Ray reads its authentication settings when it is imported: this process joins the test's
# cluster as a client, so they are set before vmsandbox.fleet imports Ray.
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))

from vmsandbox.errors import Unavailable
from vmsandbox.fleet import claims, model
from vmsandbox.fleet.core import Fleet
from vmsandbox.openshell.proto import compute_driver_pb2 as pb
from vmsandbox.openshell.proto import compute_driver_pb2_grpc as pb_grpc

HOSTS = {  # name -> (umockdev host, fabric, pooled guests)
    "hgx-a": ("hgx_h100", "shared", 1),
    "hgx-b": ("hgx_h100", "shared", 0),
    "hgx-full": ("hgx_h100", "full", 0),
    "ws": ("workstation_rtx2080ti", "none", 1),
}
GATEWAY = "gw-a"
QUIET = 60.0  # seconds the fleet gets to settle (bounded waits, not timing checks)


@dataclass
class Fixture:
    """The module's fleet: the cluster, each host's driver process and socket, the server's
    socket and metrics ports, and a Fleet of this process for Ray-level checks."""

    cluster: Cluster
    sockets: dict[str, Path]
    drivers: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    host_metrics: dict[str, int] = field(default_factory=dict)
    fleet_socket: Path = Path()
    server_metrics: int = 0
    fleet: Fleet | None = None

    def host_info(self, name: str) -> dict:
        from vmsandbox.fleet.join import read_host

        return read_host(str(self.sockets[name]), wait=False)


@pytest.fixture(scope="module")
def fx() -> Iterator[Fixture]:
    with own_network(), cluster("vsf-") as made:
        fixture = Fixture(made, {})
        try:
            for name in HOSTS:
                port = free_port()
                process, socket_path = start_fake_host(made.root, name, *HOSTS[name], port)
                fixture.drivers[name], fixture.sockets[name] = process, socket_path
                fixture.host_metrics[name] = port
                made.join(name, socket_path)
            made.wait_joined(*HOSTS)
            fixture.fleet_socket = made.root / "fleet" / "driver.sock"
            fixture.server_metrics = free_port()
            made.serve(
                fixture.fleet_socket, GATEWAY,
                "--metrics-address", f"127.0.0.1:{fixture.server_metrics}",
                "--place-timeout", "2",
            )  # fmt: skip
            fixture.fleet = Fleet(made.address, gateway=GATEWAY, place_timeout=2)
            yield fixture
        finally:
            if fixture.fleet is not None:
                fixture.fleet.close()
            made.close()
            for process in fixture.drivers.values():
                process.terminate()
                process.wait(timeout=30)


@pytest.fixture
def client(fx: Fixture) -> Iterator[pb_grpc.ComputeDriverStub]:
    channel, driver = stub(fx.fleet_socket)
    with channel:
        yield driver


def quiet(fx: Fixture) -> dict[str, dict[str, float]]:
    """Until every host is ready and Ray's free amounts equal the hosts' own; the last drift."""
    assert fx.fleet is not None
    deadline = time.monotonic() + QUIET
    clean = 0  # looks in a row without drift: an agent's answer may predate the last change
    while True:
        views = fx.fleet.hosts()
        drift = {view.name: view.drift() for view in views if view.state != "lost"}
        settled = all(view.state in ("ready", "lost") for view in views)
        clean = clean + 1 if settled and not any(drift.values()) else 0
        if clean >= 4 or time.monotonic() > deadline:
            return drift
        time.sleep(0.5)


def request(name: str, gpus: int = 0, **template: object) -> pb.DriverSandbox:
    spec = pb.DriverSandboxSpec(
        template=pb.DriverSandboxTemplate(
            image="tiny",
            resources=pb.DriverResourceRequirements(memory_limit="256Mi"),
            **template,
        ),
        command=["sleep", "infinity"],
    )
    if gpus:
        spec.resource_requirements.gpu.count = gpus
    return pb.DriverSandbox(id=f"{name}-{uuid.uuid4().hex[:8]}", name=name, spec=spec)


def listed(client: pb_grpc.ComputeDriverStub) -> dict[str, pb.DriverSandbox]:
    answer = client.ListSandboxes(pb.ListSandboxesRequest(), timeout=60)
    return {sandbox.id: sandbox for sandbox in answer.sandboxes}


def where(fx: Fixture, sandbox_id: str) -> str:
    """The host whose own records hold the sandbox."""
    for name in HOSTS:
        try:
            info = fx.host_info(name)
        except Unavailable:  # a host made to fail by the test
            continue
        for sandbox in info["sandboxes"]:
            if sandbox["labels"].get("openshell.sandbox-id") == sandbox_id:
                return name
    raise AssertionError(f"no host holds {sandbox_id}")


def test_hosts_join_with_their_capacity_as_ray_resources_and_labels(fx: Fixture) -> None:
    nodes = {node.host: node for node in claims.nodes() if node.alive}
    assert set(nodes) == set(HOSTS)
    shared = nodes["hgx-a"]
    assert shared.labels[model.LABEL_FABRIC] == "shared-nvswitch"
    assert shared.labels[model.LABEL_MODEL] == "gh100-h100-sxm5-80gb"
    wanted = {"gpu": 8, "gpus/1": 8, "gpus/2": 4, "gpus/4": 2, "gpus/8": 1, "numa-gpus/4": 2}
    for key, count in wanted.items():
        assert shared.totals[model.PREFIX + key] == count, key
    assert model.PREFIX + "gpus/3" not in shared.totals  # no partition of three
    full = nodes["hgx-full"]
    assert full.labels[model.LABEL_FABRIC] == "full-passthrough"
    assert {k: v for k, v in full.totals.items() if k.startswith(model.GPUS)} == {
        model.GPUS + "1": 8.0,
        model.GPUS + "8": 1.0,
    }
    workstation = nodes["ws"]
    assert workstation.labels[model.LABEL_FABRIC] == "none"
    assert workstation.totals[model.GPU] == 1.0
    assert model.POOL + "tiny-1c-256m-4g-0gpu" in workstation.totals
    assert quiet(fx) == {name: {} for name in HOSTS}


def test_the_cli_shows_every_host(fx: Fixture) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "vmsandbox.cli", "fleet", "hosts", "--json",
         "--address", fx.cluster.address, "--gateway", GATEWAY],
        capture_output=True, text=True, env=fx.cluster.env, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    hosts = {host["name"]: host for host in json.loads(done.stdout)}
    assert {name: host["state"] for name, host in hosts.items()} == dict.fromkeys(HOSTS, "ready")
    assert (hosts["hgx-b"]["gpus"], hosts["ws"]["gpus"]) == (8, 1)
    assert hosts["ws"]["pool"] == [{"key": "small", "ready": 1, "count": 1}]


def test_a_gpu_sandbox_through_the_fleet_socket(fx: Fixture, client) -> None:
    watch = Watch(fx.fleet_socket)
    try:
        wanted = request("t-fl-pair", gpus=2)
        client.CreateSandbox(pb.CreateSandboxRequest(sandbox=wanted), timeout=120)
        assert watch.until("Ready", wanted.id, timeout=60)[-1] == "Ready"
        host = where(fx, wanted.id)
        assert host in ("hgx-a", "hgx-b")  # only shared boards have partitions of two
        info = fx.host_info(host)
        mine = next(s for s in info["sandboxes"] if s["name"] == "t-fl-pair")
        assert len(mine["gpus"]) == 2
        assert mine["labels"]["vmsandbox.fleet/gateway"] == GATEWAY
        assert [p["size"] for p in info["fabric"]["partitions"] if p["active"]] == [2]
        assert phase(listed(client)[wanted.id]) == "Ready"
        assert quiet(fx)[host] == {}  # the partitions the pair blocks are pinned
        claim = model.claim_name(GATEWAY, wanted.id)
        assert any(c.name == claim and c.state == "CREATED" for c in claims.claims())
        deleted = client.DeleteSandbox(pb.DeleteSandboxRequest(sandbox_id=wanted.id), timeout=60)
        assert deleted.deleted is True
        assert watch.until("deleted", wanted.id, timeout=60)[-1] == "deleted"
    finally:
        watch.close()
    assert not any(c.name == claim for c in claims.claims())
    assert not [p for p in fx.host_info(host)["fabric"]["partitions"] if p["active"]]
    assert quiet(fx)[host] == {}


def test_a_burst_of_creates_never_double_allocates(fx: Fixture, client) -> None:
    sizes = [1, 2, 4, 8, 1, 2, 1, 4, 2, 1, 8, 1]
    made: list[str] = []
    refused: list[str] = []
    lock = threading.Lock()

    def one(size: int, index: int) -> None:
        wanted = request(f"t-fl-burst-{index}", gpus=size)
        try:
            client.CreateSandbox(pb.CreateSandboxRequest(sandbox=wanted), timeout=180)
        except grpc.RpcError as exc:
            with lock:
                refused.append(f"{exc.code().name}: {exc.details()}")
            return
        with lock:
            made.append(wanted.id)

    threads = [threading.Thread(target=one, args=(size, i)) for i, size in enumerate(sizes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        assert len(made) + len(refused) == len(sizes)
        assert all(why.startswith("RESOURCE_EXHAUSTED: ") for why in refused), refused
        holders: dict[str, set[str]] = {}
        for name in HOSTS:
            for gpu in fx.host_info(name)["gpus"]:
                if gpu["holder"]:
                    holders.setdefault(f"{name}/{gpu['bdf']}", set()).add(gpu["holder"])
        assert all(len(held) == 1 for held in holders.values())
        assert set(listed(client)) == set(made)
        assert quiet(fx) == {name: {} for name in HOSTS}
    finally:
        for sandbox_id in listed(client):
            client.DeleteSandbox(pb.DeleteSandboxRequest(sandbox_id=sandbox_id), timeout=60)
    assert listed(client) == {}
    assert quiet(fx) == {name: {} for name in HOSTS}


def test_a_refusing_host_is_tried_no_more_and_the_error_names_it(fx: Fixture, client) -> None:
    faults = fx.cluster.root / "hgx-a" / "faults.json"  # hgx-a's driver refuses every create
    faults.write_text(json.dumps({"create_refused": "Fabric Manager does not answer"}))
    made = []
    try:
        for index in range(4):  # hgx-b has four pairs
            wanted = request(f"t-fl-refuse-{index}", gpus=2)
            client.CreateSandbox(pb.CreateSandboxRequest(sandbox=wanted), timeout=120)
            made.append(wanted.id)
            assert where(fx, wanted.id) == "hgx-b"
        fifth = request("t-fl-refuse-5", gpus=2)
        with pytest.raises(grpc.RpcError) as caught:
            client.CreateSandbox(pb.CreateSandboxRequest(sandbox=fifth), timeout=120)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "host hgx-a: UNAVAILABLE: Fabric Manager does not answer" in caught.value.details()
        assert not any(c.name == model.claim_name(GATEWAY, fifth.id) for c in claims.claims())
    finally:
        faults.unlink()
        for sandbox_id in made:
            client.DeleteSandbox(pb.DeleteSandboxRequest(sandbox_id=sandbox_id), timeout=60)
    assert quiet(fx) == {name: {} for name in HOSTS}


def test_a_host_that_cannot_read_itself_is_not_ready_and_says_why(fx: Fixture) -> None:
    assert fx.fleet is not None
    unreachable = fx.cluster.root / "hgx-a" / "fm" / "unreachable"
    unreachable.touch()  # hgx-a's Fabric Manager stops answering: HostInfo fails there
    try:
        deadline = time.monotonic() + QUIET
        while (view := next(v for v in fx.fleet.hosts() if v.name == "hgx-a")).state == "ready":
            assert time.monotonic() < deadline, "hgx-a stayed ready"
            time.sleep(0.5)
        assert view.state == "joining" and view.error  # no claim lands there, and why
        whole, placed = fx.fleet.create_sandbox(image="tiny", memory_mib=256, gpus=8)
        assert placed.host != "hgx-a"
        fx.fleet.delete(whole)
    finally:
        unreachable.unlink()
    assert quiet(fx) == {name: {} for name in HOSTS}


def test_capacity_taken_outside_the_fleet_is_pinned(fx: Fixture) -> None:
    channel, host = stub(fx.sockets["hgx-full"])  # a local client of the host's own driver
    with channel:
        local = request("t-fl-local", gpus=1)
        host.CreateSandbox(pb.CreateSandboxRequest(sandbox=local), timeout=60)
        try:
            assert quiet(fx)["hgx-full"] == {}
            view = next(v for v in fx.fleet.hosts() if v.name == "hgx-full")
            # one GPU taken: 7 single GPUs left and no room for all eight
            assert view.ray_free[model.GPU] == 7.0
            assert view.ray_free[model.GPUS + "8"] == 0.0
            whole, placed = fx.fleet.create_sandbox(image="tiny", memory_mib=256, gpus=8)
            assert placed.host in ("hgx-a", "hgx-b")  # a shared board's partition of eight
            fx.fleet.delete(whole)
        finally:
            host.DeleteSandbox(pb.DeleteSandboxRequest(sandbox_id=local.id), timeout=60)
    assert quiet(fx)["hgx-full"] == {}


def test_one_gateway_never_acts_on_anothers_sandbox(fx: Fixture, client) -> None:
    other = Fleet(fx.cluster.address, gateway="gw-b", place_timeout=2)
    wanted = request("t-fl-mine", gpus=1)
    client.CreateSandbox(pb.CreateSandboxRequest(sandbox=wanted), timeout=120)
    try:
        assert [s.sandbox_id for s in other.sandboxes()] == []
        assert other.delete(wanted.id) is False
        assert wanted.id in listed(client)
        sandbox_id, placed = other.create_sandbox(image="tiny", memory_mib=256, gpus=1)
        assert sandbox_id not in listed(client)
        assert other.delete(sandbox_id) is True
        assert placed.host in HOSTS
    finally:
        client.DeleteSandbox(pb.DeleteSandboxRequest(sandbox_id=wanted.id), timeout=60)


def test_a_plain_create_prefers_a_host_with_a_ready_pooled_guest(fx: Fixture) -> None:
    sandbox_id, placed = fx.fleet.create_sandbox(image="tiny", memory_mib=256)
    try:
        assert placed.pooled is True
        assert placed.host in ("hgx-a", "ws")  # the hosts with a pool
        domain = next(
            s["domain"] for s in fx.host_info(placed.host)["sandboxes"]
            if s["labels"].get("openshell.sandbox-id") == sandbox_id
        )  # fmt: skip
        assert domain.startswith("vmsbx-pool-")
        assert quiet(fx)[placed.host] == {}  # refilled, the pool unit stays with the sandbox
    finally:
        fx.fleet.delete(sandbox_id)
    assert quiet(fx) == {name: {} for name in HOSTS}


def test_a_lost_host_keeps_its_sandboxes_and_they_are_adopted_on_rejoin(fx: Fixture, client):
    sandbox_id, placed = fx.fleet.create_sandbox(
        image="tiny", memory_mib=256, gpus=1, model_name="2080"
    )
    assert placed.host == "ws"
    fx.cluster.kill("ws")
    deadline = time.monotonic() + QUIET
    while phase(listed(client)[sandbox_id]) != "Error":
        assert time.monotonic() < deadline, "the lost host was never reported"
        time.sleep(0.5)
    lost = listed(client)[sandbox_id].status.conditions[0]
    assert (lost.reason, lost.status) == ("HostLost", "False")
    assert where(fx, sandbox_id) == "ws"  # not deleted
    with pytest.raises(Exception) as caught:  # not placed again: no other host has that model
        fx.fleet.create_sandbox(image="tiny", memory_mib=256, gpus=1, model_name="2080")
    assert getattr(caught.value, "code", "") == "FAILED_PRECONDITION"
    code = None
    try:
        client.DeleteSandbox(pb.DeleteSandboxRequest(sandbox_id=sandbox_id), timeout=60)
    except grpc.RpcError as exc:
        code = exc.code()
    assert code == grpc.StatusCode.UNAVAILABLE
    assert not any(c.name.endswith(sandbox_id) for c in claims.claims())  # nothing stranded
    fx.cluster.join("ws", fx.sockets["ws"])
    fx.cluster.wait_joined("ws")
    deadline = time.monotonic() + QUIET
    while phase(listed(client)[sandbox_id]) != "Ready":
        assert time.monotonic() < deadline, "the survivor was not adopted"
        time.sleep(0.5)
    assert quiet(fx)["ws"] == {}  # the survivor's GPU is pinned
    view = next(v for v in fx.fleet.hosts() if v.name == "ws")
    assert view.ray_free[model.GPU] == 0.0
    client.DeleteSandbox(pb.DeleteSandboxRequest(sandbox_id=sandbox_id), timeout=60)
    assert quiet(fx)["ws"] == {}


def test_every_host_and_the_server_export_metrics(fx: Fixture) -> None:
    def scrape(port: int) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as answer:
            return answer.read().decode()

    host = scrape(fx.host_metrics["hgx-b"])
    assert 'vmsandbox_gpus{model="GH100 [H100 SXM5 80GB]",state="free"} 8.0' in host
    assert 'vmsandbox_slots_free{gpus="2"} 4.0' in host
    assert 'vmsandbox_rpc_seconds_count{method="CreateSandbox"}' in host
    assert 'vmsandbox_partitions{size="8",state="inactive"} 1.0' in host
    with contextlib.suppress(Exception):
        fx.fleet.hosts()
    server = scrape(fx.server_metrics)
    assert 'vmsandbox_fleet_hosts{state="ready"} 4.0' in server
    assert "vmsandbox_fleet_create_seconds_bucket" in server
    assert 'vmsandbox_fleet_drift{host="hgx-a"} 0.0' in server


def test_a_restarted_server_loses_and_duplicates_nothing(fx: Fixture, client) -> None:
    wanted = request("t-fl-restart", gpus=1)
    client.CreateSandbox(pb.CreateSandboxRequest(sandbox=wanted), timeout=120)
    before = {sid: phase(s) for sid, s in listed(client).items()}
    server = fx.cluster.servers.pop()
    server.terminate()
    assert server.wait(timeout=60) == 0
    fx.cluster.serve(fx.fleet_socket, GATEWAY, "--place-timeout", "2")
    channel, again = stub(fx.fleet_socket)
    with channel:
        assert {sid: phase(s) for sid, s in listed(again).items()} == before
        # the same request again (a gateway retrying): the same sandbox, from its host
        again.CreateSandbox(pb.CreateSandboxRequest(sandbox=wanted), timeout=120)
        other = pb.DriverSandbox()
        other.CopyFrom(wanted)
        other.spec.resource_requirements.gpu.count = 2
        with pytest.raises(grpc.RpcError) as caught:  # another request under that id
            again.CreateSandbox(pb.CreateSandboxRequest(sandbox=other), timeout=120)
        assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert [where(fx, wanted.id)] == [
            name for name in HOSTS for s in fx.host_info(name)["sandboxes"]
            if s["labels"].get("openshell.sandbox-id") == wanted.id
        ]  # fmt: skip
        again.DeleteSandbox(pb.DeleteSandboxRequest(sandbox_id=wanted.id), timeout=60)
