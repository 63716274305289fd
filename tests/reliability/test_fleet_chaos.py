"""The fleet under chaos: two gateways whose sandbox ids collide, each with its fleet server and
clients creating and deleting at once through the server's socket, while the fleet breaks one
part after another: a host's agent stalled (SIGSTOP) and resumed, a host's driver killed while
its Ray node lives and started again, a host killed and joined again, and a gateway's fleet
server killed while creates wait for placement, then started again. The clients answer every
outcome as a gateway does: what ended UNAVAILABLE (or found no server) is asked again, the same
request, until a definite answer.

The invariants are judged from each host's own records (the domains its fake libvirt keeps),
never through the fleet: no GPU held twice; no sandbox of a gateway on two hosts; every
create answered OK and not deleted there exactly once; nothing a delete answered for still
there; each gateway listing and deleting only its own sandboxes, ids colliding; and at the
end no claim waiting for placement and no record of a create under way. Bounded to a few
minutes (the faults one after another, then at most SETTLE seconds of asking again).
"""

from __future__ import annotations

import os
import random
import secrets
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import pytest
from framework.fleet_cluster import FakeFleet, fake_fleet
from framework.openshell_client import stub

os.environ.setdefault("RAY_AUTH_MODE", "token")  # read by Ray when it is imported
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))

import ray

from vmsandbox.fleet import claims, model
from vmsandbox.fleet.agent import GATEWAY_LABEL
from vmsandbox.fleet.core import Fleet
from vmsandbox.fleet.records import Records
from vmsandbox.openshell.proto import compute_driver_pb2 as pb

HOSTS = {  # name -> (umockdev host, fabric, pooled guests)
    "wa": ("workstation_rtx2080ti", "none", 0),
    "wb": ("workstation_rtx2080ti", "none", 0),
    "l4": ("l4_server_x12", "none", 0),
}
GATEWAYS = ("gw-a", "gw-b")
CLIENTS = 2  # per gateway; client i of each gateway uses the same ids
SETTLE = 90.0  # seconds the clients get, once the faults are over, for definite answers
QUIET = 60.0
ID_LABEL = "openshell.sandbox-id"
AGAIN = ("UNAVAILABLE", "DEADLINE_EXCEEDED")  # outcome not known: asked again


@pytest.fixture(scope="module")
def fx() -> Iterator[FakeFleet]:
    with fake_fleet("vsc-", HOSTS, GATEWAYS, "--place-timeout", "4") as made:
        yield made


def until(what: str, check, timeout: float = QUIET) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"never: {what} ({under_way()})"
        time.sleep(0.2)


@dataclass
class Client:
    """One gateway's client: creates and deletes of its own ids, each outcome remembered."""

    fx: FakeFleet
    gateway: str
    index: int
    stop: threading.Event
    live: dict[str, pb.DriverSandbox] = field(default_factory=dict)  # answered OK, not deleted
    unsure: dict[str, pb.DriverSandbox] = field(default_factory=dict)  # create to ask again
    deleted: set[str] = field(default_factory=set)  # a delete answered (true or false)
    undeleted: set[str] = field(default_factory=set)  # a delete to ask again
    errors: list[str] = field(default_factory=list)  # answers no gateway should get
    made: int = 0

    def _call(self, method: str, request: object) -> str:
        try:
            channel, driver = stub(self.fx.fleet_sockets[self.gateway])
            with channel:
                getattr(driver, method)(request, timeout=60)
            return "OK"
        except grpc.RpcError as exc:
            return exc.code().name

    def create(self, sandbox: pb.DriverSandbox) -> None:
        code = self._call("CreateSandbox", pb.CreateSandboxRequest(sandbox=sandbox))
        self.unsure.pop(sandbox.id, None)
        if code == "OK":
            self.live[sandbox.id] = sandbox
        elif code in AGAIN:
            self.unsure[sandbox.id] = sandbox
        elif code != "RESOURCE_EXHAUSTED":
            self.errors.append(f"create {sandbox.id}: {code}")

    def delete(self, sandbox_id: str) -> None:
        code = self._call("DeleteSandbox", pb.DeleteSandboxRequest(sandbox_id=sandbox_id))
        if code == "OK":
            self.live.pop(sandbox_id, None)
            self.undeleted.discard(sandbox_id)
            self.deleted.add(sandbox_id)
        elif code in AGAIN:
            self.undeleted.add(sandbox_id)
        else:
            self.errors.append(f"delete {sandbox_id}: {code}")

    def run(self) -> None:
        rng = random.Random(self.index)
        while not self.stop.is_set():
            if self.unsure and rng.random() < 0.5:
                self.create(next(iter(self.unsure.values())))
            elif self.undeleted and rng.random() < 0.5:
                self.delete(next(iter(self.undeleted)))
            elif self.live and rng.random() < 0.35:
                self.delete(rng.choice(sorted(self.live)))
            else:
                self.made += 1
                self.create(request(f"c{self.index}-{self.made}", rng.choice((0, 0, 1)), "tiny"))
            time.sleep(0.05)

    def settle(self, deadline: float) -> None:
        """Ask again until every outcome is definite (or ``deadline``)."""
        while (self.unsure or self.undeleted) and time.monotonic() < deadline:
            for sandbox in list(self.unsure.values()):
                self.create(sandbox)
            for sandbox_id in list(self.undeleted):
                self.delete(sandbox_id)
            time.sleep(0.5)


def request(sandbox_id: str, gpus: int, image: str) -> pb.DriverSandbox:
    spec = pb.DriverSandboxSpec(
        template=pb.DriverSandboxTemplate(
            image=image, resources=pb.DriverResourceRequirements(memory_limit="256Mi")
        )
    )
    if gpus:
        spec.resource_requirements.gpu.count = gpus
    return pb.DriverSandbox(id=sandbox_id, name="", spec=spec)


def held(fx: FakeFleet) -> dict[tuple[str, str], list[str]]:
    """(gateway, sandbox id) -> the hosts whose own records hold it."""
    found: dict[tuple[str, str], list[str]] = {}
    for name in HOSTS:
        for domain in fx.domains(name):
            labels = domain["data"].get("labels", {})
            if labels.get(GATEWAY_LABEL):
                owner = (labels[GATEWAY_LABEL], labels.get(ID_LABEL, ""))
                found.setdefault(owner, []).append(name)
                assert domain["data"].get("owner", "").endswith("/" + owner[0]), domain["name"]
    return found


def under_way() -> list[str]:
    """Claims waiting for placement and records of a create under way."""
    left = [f"claim {c.name} {c.state}" for c in claims.claims() if c.state != "CREATED"]
    return left + [
        f"record {r.gateway}/{r.sandbox_id} {r.state} {r.job}"
        for r in Records().of()
        if r.state in (model.PLACING, model.CREATING)
    ]


def agent_pid(host: str) -> int:
    agent = ray.get_actor(model.agent_name(host), namespace=model.NAMESPACE)
    return int(ray.get(agent.ping.remote(), timeout=30)["pid"])


def test_the_fleet_never_duplicates_or_forgets_a_sandbox_under_chaos(fx: FakeFleet) -> None:
    fleet = Fleet(fx.cluster.address, gateway=GATEWAYS[0])
    stop = threading.Event()
    clients = [Client(fx, gateway, i, stop) for gateway in GATEWAYS for i in range(CLIENTS)]
    threads = [threading.Thread(target=client.run) for client in clients]
    began = time.monotonic()
    try:
        for thread in threads:
            thread.start()
        time.sleep(5)
        pid = agent_pid("wa")  # wa's agent stalled, then resumed
        os.kill(pid, signal.SIGSTOP)
        time.sleep(6)
        os.kill(pid, signal.SIGCONT)
        fx.kill_driver("wb")  # wb's driver dies; its Ray node and agent live on
        time.sleep(6)
        fx.start_driver("wb")
        fx.cluster.kill("l4")  # l4's Ray side dies, its driver lives on
        until("l4's node dead", lambda: "l4" not in claims.live_nodes())
        fx.cluster.join("l4", fx.sockets["l4"])
        fx.cluster.wait_joined("l4")
        late = Client(fx, GATEWAYS[0], 9, stop)
        clients.append(late)  # asks again in the settling below, as a gateway would
        waiting = threading.Thread(  # a create that waits for room no host has (16 GPUs)
            target=late.create, args=(request("c9-1", 16, "tiny"),)
        )
        waiting.start()
        time.sleep(2)
        fx.kill_server(GATEWAYS[0])  # while that create waits for placement
        waiting.join()
        fx.serve(GATEWAYS[0])
        time.sleep(5)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    deadline = time.monotonic() + SETTLE
    assert "c9-1" in late.unsure  # its server was killed while it waited: not known
    for client in clients:
        client.settle(deadline)
    chaos_s = time.monotonic() - began
    until("every host ready", lambda: {v.state for v in fleet.hosts()} == {"ready"})
    found = held(fx)
    try:
        assert [e for client in clients for e in client.errors] == []
        assert [c.unsure for c in clients] == [{}] * len(clients), "outcomes never definite"
        assert [c.undeleted for c in clients] == [set()] * len(clients)
        assert {k: v for k, v in found.items() if len(v) > 1} == {}  # no sandbox twice
        for name in HOSTS:  # no GPU held twice
            gpus = [bdf for domain in fx.domains(name) for bdf in domain["gpus"]]
            assert len(gpus) == len(set(gpus)), name
        for client in clients:
            mine = {sid for (gateway, sid) in found if gateway == client.gateway}
            for sandbox_id in client.live:  # every OK create present exactly once
                assert sandbox_id in mine, f"{client.gateway} {sandbox_id} lost"
            for sandbox_id in client.deleted:  # never reported deleted while it runs
                assert sandbox_id not in mine, f"{client.gateway} {sandbox_id} still there"
        for gateway in GATEWAYS:  # each gateway lists its own, never another's (ids collide)
            channel, driver = stub(fx.fleet_sockets[gateway])
            with channel:
                listed = driver.ListSandboxes(pb.ListSandboxesRequest(), timeout=60).sandboxes
            assert {s.id for s in listed} == {sid for (gw, sid) in found if gw == gateway}
        assert any(gw == GATEWAYS[1] and (GATEWAYS[0], sid) in found for gw, sid in found), (
            "no id made by both gateways: the collision was never tried"
        )
        until(
            "no claim waiting, no create under way",
            lambda: (
                not [c for c in claims.claims() if c.state != "CREATED"]
                and not [r for r in Records().of() if r.state in (model.PLACING, model.CREATING)]
            ),
        )
    finally:
        print(f"chaos: {chaos_s:.0f} s, {sum(c.made for c in clients)} creates asked")
        for client in clients:
            for sandbox_id in list(client.live):
                client.delete(sandbox_id)
        fleet.close()
