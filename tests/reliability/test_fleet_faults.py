"""The fleet never duplicates or forgets a sandbox, one fault at a time: a Ray head and three
fake hosts (tests/framework/fleet_host.py: two RTX 2080 Ti workstations and a server with
twelve L4) inside a network namespace of the test's own, a fleet server, and ``Fleet`` objects
of this process. Each host is judged by its own records (the domains its fake libvirt keeps),
never through the fleet.

- A create whose outcome is unknown (the agent died while the host went on creating) keeps its
  claim, answers UNAVAILABLE and is asked of that host again: never a second sandbox.
- A lost host's sandboxes are known to a fleet started after the loss: listed as lost, their
  Delete UNAVAILABLE, never ``deleted: false``.
- Slow calls filling an agent's call slots never make its host lost, nor its creates' claims
  swept while they wait.
- A host whose driver died (its Ray node alive) is lost within seconds: its sandboxes listed
  as lost, nothing placed there; one made just before is not forgotten.
- A create left waiting for placement by a killed fleet process never blocks its id.
- A host's name stays with its machine until an operator releases it.

One cluster serves the module; the tests run in order and each leaves the fleet empty.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
from framework.fleet_cluster import FakeFleet, fake_fleet

os.environ.setdefault("RAY_AUTH_MODE", "token")  # read by Ray when it is imported
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))

import ray

from vmsandbox.errors import VmSandboxError
from vmsandbox.fleet import claims, model
from vmsandbox.fleet.core import Fleet
from vmsandbox.openshell.proto import compute_driver_pb2 as pb

HOSTS = {  # name -> (umockdev host, fabric, pooled guests)
    "wa": ("workstation_rtx2080ti", "none", 0),
    "wb": ("workstation_rtx2080ti", "none", 0),
    "l4": ("l4_server_x12", "none", 0),
}
WORKSTATIONS = ("wa", "wb")
GATEWAY = "gw-f"
QUIET = 60.0  # seconds a bounded wait gets (not a timing check)
ID_LABEL = "openshell.sandbox-id"


@pytest.fixture(scope="module")
def fx() -> Iterator[FakeFleet]:
    with fake_fleet("vsr-", HOSTS, (GATEWAY,), "--place-timeout", "2") as made:
        yield made


@pytest.fixture(scope="module")
def fleet(fx: FakeFleet) -> Iterator[Fleet]:
    made = Fleet(fx.cluster.address, gateway=GATEWAY, place_timeout=2)
    yield made
    made.close()


def sandbox(sandbox_id: str, gpus: int = 0) -> pb.DriverSandbox:
    spec = pb.DriverSandboxSpec(
        template=pb.DriverSandboxTemplate(
            image="tiny", resources=pb.DriverResourceRequirements(memory_limit="256Mi")
        )
    )
    if gpus:
        spec.resource_requirements.gpu.count = gpus
    return pb.DriverSandbox(id=sandbox_id, name=sandbox_id, spec=spec)


def holders(fx: FakeFleet, sandbox_id: str) -> list[str]:
    """The hosts whose own records hold ``sandbox_id`` (of any gateway)."""
    return [
        name
        for name in fx.hosts
        for domain in fx.domains(name)
        if domain["data"].get("labels", {}).get(ID_LABEL) == sandbox_id
    ]


def until(what: str, check, timeout: float = QUIET):
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.2)
    return found


def state(fleet: Fleet, host: str) -> str:
    return {view.name: view.state for view in fleet.hosts()}[host]


def served(fleet: Fleet, sandbox_id: str) -> bool:
    """Whether the fleet lists ``sandbox_id`` Ready from its host's own answer."""
    found = {s.sandbox_id: s for s in fleet.sandboxes()}.get(sandbox_id)
    return found is not None and found.to_dict()["ready"] == "True"


def code(call) -> str:
    """The error code ``call()`` fails with ("OK" when it does not)."""
    try:
        call()
    except VmSandboxError as exc:
        return exc.code
    return "OK"


def rejoin(fx: FakeFleet, fleet: Fleet, name: str) -> None:
    """Host ``name``'s Ray side killed (if it still runs) and joined again, until ready."""
    fx.cluster.kill(name)
    until(f"{name}'s node dead", lambda: name not in claims.live_nodes())
    fx.cluster.join(name, fx.sockets[name])
    fx.cluster.wait_joined(name)
    until(f"{name} ready", lambda: state(fleet, name) == "ready")


def test_an_unknown_create_outcome_is_never_placed_again_elsewhere(fx: FakeFleet, fleet: Fleet):
    for name in WORKSTATIONS:  # each workstation's create goes on for 6 s after it made it
        fx.fault(name, create_delay=6)
    wanted = sandbox("t-unknown", gpus=1)
    answer: dict[str, str] = {}
    creating = threading.Thread(
        target=lambda: answer.setdefault(
            "code", code(lambda: fleet.create(wanted, model_name="2080"))
        )
    )
    creating.start()
    host = until("a host made it", lambda: holders(fx, wanted.id))[0]
    ray.kill(ray.get_actor(model.agent_name(host), namespace=model.NAMESPACE))  # mid-call
    creating.join(timeout=120)
    for name in WORKSTATIONS:
        fx.fault(name)
    time.sleep(8)  # any create another workstation was asked for has made its sandbox by now
    assert holders(fx, wanted.id) == [host]  # one sandbox, never a twin
    assert answer["code"] == "UNAVAILABLE"  # the outcome was not known: not a refusal
    rejoin(fx, fleet, host)
    placed = fleet.create(wanted, model_name="2080")  # the same again: its host is asked first
    assert placed.host == host
    assert holders(fx, wanted.id) == [host]
    assert fleet.delete(wanted.id) is True
    assert holders(fx, wanted.id) == []


def test_a_fleet_started_after_a_host_was_lost_still_knows_its_sandboxes(
    fx: FakeFleet, fleet: Fleet
):
    sandbox_id, placed = fleet.create_sandbox(
        sandbox_id="t-lost", image="tiny", memory_mib=256, gpus=1, model_name="2080"
    )
    fx.cluster.kill(placed.host)
    until("the host lost", lambda: state(fleet, placed.host) == "lost")
    fresh = Fleet(fx.cluster.address, gateway=GATEWAY, place_timeout=2)  # a restarted server
    try:
        listed = {s.sandbox_id: s for s in fresh.sandboxes()}
        assert listed[sandbox_id].lost and listed[sandbox_id].host == placed.host
        assert code(lambda: fresh.delete(sandbox_id)) == "UNAVAILABLE"  # never "deleted: false"
        assert holders(fx, sandbox_id) == [placed.host]
        rejoin(fx, fresh, placed.host)
        assert fresh.delete(sandbox_id) is True
    finally:
        fresh.close()
    assert holders(fx, sandbox_id) == []


def test_a_host_busy_with_slow_calls_stays_ready_and_keeps_its_creates_claims(
    fx: FakeFleet, fleet: Fleet
) -> None:
    fx.fault("l4", info_delay=6)  # every call of l4's agent that reads the host takes 6 s
    agent = ray.get_actor(model.agent_name("l4"), namespace=model.NAMESPACE)
    stop = pb.StopSandboxRequest().SerializeToString()
    busy = [agent.act.remote(GATEWAY, f"t-none-{i}", "StopSandbox", stop) for i in range(40)]
    busy += [agent.sandboxes.remote(GATEWAY) for _ in range(20)]
    made: dict[str, str] = {}
    queued = threading.Thread(  # waits in l4's agent behind them, longer than the sweep's grace
        target=lambda: made.setdefault(
            "code",
            code(lambda: fleet.create(sandbox("t-queued", gpus=1), model_name="L4")),
        )
    )
    queued.start()
    seen: set[str] = set()
    while queued.is_alive():  # l4 answers its pings all along
        seen |= {view.name for view in fleet.hosts() if view.state != "ready"}
        time.sleep(0.5)
    fx.fault("l4")
    try:
        assert seen == set()
        assert made["code"] == "OK"
        claim = claims.find(model.claim_name(GATEWAY, "t-queued"))
        assert claim is not None and claim.state == "CREATED"  # never swept as stranded
    finally:
        ray.get(busy, timeout=120)
        fleet.delete("t-queued")


def test_a_dead_driver_makes_its_host_lost_and_its_sandboxes_stay(fx: FakeFleet, fleet: Fleet):
    sandbox_id, placed = fleet.create_sandbox(
        sandbox_id="t-driver", image="tiny", memory_mib=256, gpus=1, model_name="2080"
    )
    host = placed.host
    fx.kill_driver(host)
    killed = time.monotonic()
    until("the host lost", lambda: state(fleet, host) == "lost", timeout=10)
    assert time.monotonic() - killed < 10
    lost = {s.sandbox_id: s for s in fleet.sandboxes()}[sandbox_id]
    assert lost.lost and lost.to_dict()["ready"] == "False"
    assert code(lambda: fleet.delete(sandbox_id)) == "UNAVAILABLE"
    for _index in range(3):  # nothing is placed on the lost host
        other, there = fleet.create_sandbox(image="tiny", memory_mib=256)
        assert there.host != host
        fleet.delete(other)
    fx.start_driver(host)  # its sandboxes were kept by its (fake) libvirt
    until("the sandbox back", lambda: served(fleet, sandbox_id))
    assert {s.sandbox_id: s for s in fleet.sandboxes()}[sandbox_id].host == host
    assert fleet.delete(sandbox_id) is True
    assert holders(fx, sandbox_id) == []


def test_a_sandbox_made_just_before_its_driver_died_is_not_forgotten(fx: FakeFleet, fleet: Fleet):
    fleet.sandboxes()  # the listing this process last saw predates the create
    sandbox_id, placed = fleet.create_sandbox(
        sandbox_id="t-just-before", image="tiny", memory_mib=256, gpus=1, model_name="2080"
    )
    fx.kill_driver(placed.host)
    listed = {s.sandbox_id: s for s in fleet.sandboxes()}
    assert sandbox_id in listed
    assert code(lambda: fleet.delete(sandbox_id)) == "UNAVAILABLE"
    fx.start_driver(placed.host)
    until("the sandbox back", lambda: served(fleet, sandbox_id))
    assert fleet.delete(sandbox_id) is True
    assert holders(fx, sandbox_id) == []


def test_a_create_left_waiting_by_a_killed_fleet_process_never_blocks_its_id(
    fx: FakeFleet, fleet: Fleet
):
    claim = model.claim_name(GATEWAY, "t-waiting")
    waiting = subprocess.Popen(  # 16 GPUs on one host: no host has them, it waits for room
        [
            sys.executable, "-m", "vmsandbox.cli", "fleet", "create", "--id", "t-waiting",
            "--image", "tiny", "--memory-mib", "256", "--gpus", "16", "--place-timeout", "300",
            "--address", fx.cluster.address, "--gateway", GATEWAY,
        ],
        env=fx.cluster.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        until("its claim waits", lambda: any(c.name == claim for c in claims.claims()))
    finally:
        waiting.kill()
        waiting.wait()
    sandbox_id, placed = fleet.create_sandbox(
        sandbox_id="t-waiting", image="tiny", memory_mib=256, gpus=1
    )
    assert holders(fx, sandbox_id) == [placed.host]
    assert fleet.delete(sandbox_id) is True
    until("no claim left", lambda: not any(c.name == claim for c in claims.claims()))


def test_a_host_name_stays_with_its_machine_until_released(fx: FakeFleet, fleet: Fleet) -> None:
    fx.hosts["wa-other"] = fx.hosts["wa"]
    fx.start_driver("wa-other")  # another machine, with a key of its own

    def fleet_cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "vmsandbox.cli", "fleet", *args],
            env=fx.cluster.env, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip

    def impostor() -> subprocess.CompletedProcess[str]:
        """wa-other's machine joining under wa's name."""
        return fleet_cli(
            "join", fx.cluster.address, "--name", "wa",
            "--openshell-socket", str(fx.sockets["wa-other"]),
            "--temp-dir", str(fx.cluster.root / "r-impostor"),
            "--machine-key", str(fx.cluster.root / "wa-other" / "machine.key"),
        )  # fmt: skip

    refused = impostor()  # wa is live
    assert refused.returncode != 0 and "belongs to another machine" in refused.stderr
    release = ["release", "wa", "--address", fx.cluster.address]
    assert "is in the fleet now" in fleet_cli(*release).stderr  # a live host is not released
    fx.cluster.kill("wa")
    until("wa lost", lambda: state(fleet, "wa") == "lost")
    refused = impostor()  # wa was lost a moment ago: its name is still its machine's
    assert refused.returncode != 0 and "belongs to another machine" in refused.stderr
    released = fleet_cli(*release)
    assert released.returncode == 0, released.stderr
    assert "host wa released" in released.stdout
    rejoin(fx, fleet, "wa")  # the name is free: wa's own machine takes it again
