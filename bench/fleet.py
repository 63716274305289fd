"""The fleet under load and faults: four hosts, 36 GPUs, 300 creates from 8 clients, while a
host's driver is killed, a whole host is killed and the fleet server is restarted.

The fleet is the one of tests/e2e/test_fleet_fake_hosts.py, inside a network namespace of this run's
own: a Ray head, four hosts each a vmsandbox driver on the fake hypervisor under its own umockdev
host (two HGX H100 boards in shared NVSwitch mode with the fake fmpm, one HGX H100 board in full
passthrough, one PCIe server with twelve L4: 8 + 8 + 8 + 12 GPUs), and the fleet server, whose
socket 8 client threads drive as a gateway does. Each client creates sandboxes of 1, 2, 4 or 8 GPUs
(more than the fleet holds: some are refused) and deletes one of its own now and then; a create
or delete whose outcome is not known (UNAVAILABLE, DEADLINE_EXCEEDED, or no server on the socket)
is asked again later with the same request, as a gateway retries, until its answer is definite.
The faults, by the share of creates asked: at 1/4, one HGX board's driver (``vmsandbox serve``) is
killed while its Ray node lives, and started again 8 s later; at 1/2, the other HGX board is killed
whole (its Ray side and its driver), and started and joined again 15 s later; at 3/4, the fleet
server is killed and started again. The domains of the fake hosts outlive their drivers, as
libvirt's do.

What it reports (``--json FILE`` writes the same keys; ``--out DIR`` writes DIR/fleet.json for
docs/performance.md), each host judged by its own records (its domains), never by the fleet:

- ``placement_p50_ms``, ``placement_p99_ms``: CreateSandbox latency of the creates that
  succeeded at the first ask (claim placed by Ray, sandbox defined and started by its host);
- ``creates_per_s``: successful creates per second of the create phase;
- ``creates_asked_again``: creates whose first answer was UNAVAILABLE (their outcome not known,
  or a server not there), asked again until definite;
- ``lost``: creates answered OK and never deleted that no host holds;
- ``duplicated``: sandboxes held twice (by two hosts, or by two domains of one);
- ``pending``: at the end, claims still waiting for placement, placement records of a create
  still under way, and creates or deletes whose answer never became definite;
- ``double_allocations``: GPUs that two sandboxes of one host hold;
- ``constraint_violations``: sandboxes whose GPUs are not what was asked (count, whole
  partition in shared NVSwitch mode, 1 or all in full passthrough);
- ``unaccounted``: answers a gateway should never get (neither OK nor a clear refusal:
  RESOURCE_EXHAUSTED, or UNAVAILABLE asked again);
- ``drift_gpus``: once quiet, the sum over the hosts of |Ray's free GPUs - the host's own|;
- ``driver_lost_marked_s``: from the driver's kill until the fleet marks its host lost;
- ``host_lost_marked_s``: from the whole host's kill until the fleet marks it lost;
- ``stranded_claims``: at the end, placed claims of sandboxes no host holds;
- ``wall_s``: the run's time;
- ``peak_rss_mib``, ``peak_pss_mib``: the most memory its processes (the fleet's included) held
  at once, as their RSS summed (a page that Ray's processes share counts once per process) and
  as their PSS summed (each shared page split among them: what the run holds).

Usage (as root, with the fleet extra): .venv/bin/python bench/fleet.py [--creates 300]
       [--clients 8] [--json FILE] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import secrets
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
os.environ.setdefault("RAY_AUTH_MODE", "token")  # read by Ray when it is imported
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))

import common  # noqa: E402
import grpc  # noqa: E402
from framework.fleet_cluster import FakeFleet, fake_fleet  # noqa: E402
from framework.openshell_client import stub  # noqa: E402

from vmsandbox.fleet import claims, model  # noqa: E402
from vmsandbox.fleet.core import Fleet  # noqa: E402
from vmsandbox.fleet.records import Records  # noqa: E402
from vmsandbox.openshell.proto import compute_driver_pb2 as pb  # noqa: E402

HOSTS = {  # name -> (umockdev host, fabric, pooled guests)
    "hgx-a": ("hgx_h100", "shared", 0),
    "hgx-b": ("hgx_h100", "shared", 0),
    "hgx-full": ("hgx_h100", "full", 0),
    "l4": ("l4_server_x12", "none", 0),
}
GATEWAY = "bench"
DRIVER_KILLED = "hgx-a"  # its driver killed at 1/4 of the creates, its Ray node alive
HOST_KILLED = "hgx-b"  # killed whole at 1/2: its Ray side and its driver
DRIVER_BACK_S = 8.0  # seconds until the killed driver is started again
HOST_BACK_S = 15.0  # seconds until the killed host is started and joined again
SIZES = (1, 1, 1, 2, 2, 4, 8)  # GPUs per create, drawn at random
DELETE_CHANCE = 0.3  # after each create, the chance a client deletes one of its sandboxes
AGAIN = ("UNAVAILABLE", "DEADLINE_EXCEEDED")  # the outcome is not known: asked again
SETTLE_S = 180.0  # seconds the clients get, once the creates are done, for definite answers
QUIET_S = 60.0
ID_LABEL = "openshell.sandbox-id"


class Memory:
    """The peaks of the memory of this process and all its descendants, sampled: their RSS
    summed (shared pages counted once per process that maps them) and their PSS summed (each
    shared page split among its sharers: what the tree holds)."""

    def __init__(self) -> None:
        self.peak_rss_kib = 0
        self.peak_pss_kib = 0
        self._stop = threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while not self._stop.wait(0.5):
            pids = _tree(os.getpid())
            self.peak_rss_kib = max(
                self.peak_rss_kib, sum(_kib(pid, "status", "VmRSS") for pid in pids)
            )
            self.peak_pss_kib = max(
                self.peak_pss_kib, sum(_kib(pid, "smaps_rollup", "Pss") for pid in pids)
            )

    def stop(self) -> tuple[float, float]:
        """The peaks in MiB: summed RSS, summed PSS."""
        self._stop.set()
        return self.peak_rss_kib / 1024, self.peak_pss_kib / 1024


def _tree(root: int) -> list[int]:
    """``root`` and every process descended from it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def _kib(pid: int, table: str, key: str) -> int:
    """The ``key`` line of /proc/PID/``table`` in KiB (0 when the process is gone)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path(f"/proc/{pid}/{table}").read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1])
    return 0


class Load:
    """The clients' creates and deletes, and what came of each; ``phase`` fires at each
    quarter of the creates asked."""

    def __init__(self, socket_path: Path, creates: int, clients: int, seed: int) -> None:
        self.socket_path = socket_path
        self.left = creates
        self.total = creates
        self.clients = clients
        self.random = random.Random(seed)
        self.lock = threading.Lock()
        self.latencies: list[float] = []
        self.wanted: dict[str, int] = {}  # sandbox id -> GPUs asked, for those created
        self.deleted: set[str] = set()  # a delete answered (deleted or not there)
        self.unsure: dict[str, pb.DriverSandbox] = {}  # creates to ask again
        self.undeleted: set[str] = set()  # deletes to ask again
        self.outcomes: dict[str, int] = {}
        self.asked_again: set[str] = set()  # creates whose outcome was not known at first
        self.unaccounted: list[str] = []
        self.quarters = [threading.Event() for _ in range(3)]

    def _next(self) -> int | None:
        with self.lock:
            if self.left == 0:
                return None
            self.left -= 1
            for index, quarter in enumerate(self.quarters):
                if self.total - self.left >= self.total * (index + 1) // 4:
                    quarter.set()
            return self.random.choice(SIZES)

    def _call(self, method: str, request: Any) -> str:
        try:
            channel, driver = stub(self.socket_path)
            with channel:
                getattr(driver, method)(request, timeout=300)
            return "OK"
        except grpc.RpcError as exc:
            return exc.code().name

    def create(self, sandbox: pb.DriverSandbox, first: bool) -> str:
        started = time.monotonic()
        code = self._call("CreateSandbox", pb.CreateSandboxRequest(sandbox=sandbox))
        with self.lock:
            self.outcomes[code] = self.outcomes.get(code, 0) + 1
            self.unsure.pop(sandbox.id, None)
            if code == "OK":
                if first:
                    self.latencies.append(time.monotonic() - started)
                self.wanted[sandbox.id] = sandbox.spec.resource_requirements.gpu.count
            elif code in AGAIN:
                self.unsure[sandbox.id] = sandbox
                self.asked_again.add(sandbox.id)
            elif code != "RESOURCE_EXHAUSTED":
                self.unaccounted.append(f"create {sandbox.id}: {code}")
        return code

    def delete(self, sandbox_id: str) -> None:
        request = pb.DeleteSandboxRequest(sandbox_id=sandbox_id)
        code = self._call("DeleteSandbox", request)
        with self.lock:
            if code == "OK":
                self.deleted.add(sandbox_id)
                self.undeleted.discard(sandbox_id)
            elif code in AGAIN:
                self.undeleted.add(sandbox_id)
            else:
                self.unaccounted.append(f"delete {sandbox_id}: {code}")

    def again(self) -> None:
        """Ask once more for every create and delete whose outcome is not known yet."""
        with self.lock:
            creates, deletes = list(self.unsure.values()), sorted(self.undeleted)
        for sandbox in creates:
            self.create(sandbox, first=False)
        for sandbox_id in deletes:
            self.delete(sandbox_id)

    def client(self, index: int) -> None:
        mine: list[str] = []
        rng = random.Random(index)
        while (size := self._next()) is not None:
            sandbox = pb.DriverSandbox(
                id=f"bench-{index}-{secrets.token_hex(4)}",
                spec=pb.DriverSandboxSpec(
                    template=pb.DriverSandboxTemplate(
                        image="tiny",
                        resources=pb.DriverResourceRequirements(memory_limit="256Mi"),
                    ),
                    command=["true"],
                ),
            )
            sandbox.spec.resource_requirements.gpu.count = size
            if self.create(sandbox, first=True) == "OK":
                mine.append(sandbox.id)
            if mine and rng.random() < DELETE_CHANCE:
                self.delete(mine.pop(rng.randrange(len(mine))))
            if rng.random() < 0.2:
                self.again()

    def settle(self) -> None:
        """Ask again, as a gateway retries, until every outcome is definite (or SETTLE_S)."""
        deadline = time.monotonic() + SETTLE_S
        while (self.unsure or self.undeleted) and time.monotonic() < deadline:
            self.again()
            time.sleep(1.0)


def audit(fx: FakeFleet, load: Load) -> dict[str, Any]:
    """What each host's own records (its domains) say of the run."""
    doubles = violations = 0
    holders: dict[str, list[str]] = {}
    for name in HOSTS:
        info = fx.domains(name)
        fabric = HOSTS[name][1]
        seen: set[str] = set()
        partitions = _partition_sizes(fx, name) if fabric == "shared" else set()
        for domain in info:
            labels = domain["data"].get("labels", {})
            sandbox_id = labels.get(ID_LABEL)
            if not sandbox_id:
                continue
            holders.setdefault(sandbox_id, []).append(name)
            for bdf in domain["gpus"]:
                doubles += bdf in seen
                seen.add(bdf)
            count, asked = len(domain["gpus"]), load.wanted.get(sandbox_id)
            if (
                asked is None
                or count != asked
                or (fabric == "shared" and count not in partitions)
                or (fabric == "full" and count not in (1, 8))
            ):
                violations += 1
    live = set(load.wanted) - load.deleted
    return {
        "lost": sorted(live - set(holders)),
        "duplicated": sorted(sid for sid, hosts in holders.items() if len(hosts) > 1),
        "still_there": sorted(load.deleted & set(holders)),
        "double_allocations": doubles,
        "constraint_violations": violations,
        "holders": holders,
    }


def _partition_sizes(fx: FakeFleet, name: str) -> set[int]:
    """The sizes of the Fabric Manager partitions active on shared board ``name`` (its fake
    fmpm's own state)."""
    from vmsandbox.fleet.join import read_host

    with contextlib.suppress(Exception):
        info = read_host(str(fx.sockets[name]), wait=False)
        return {p["size"] for p in info["fabric"]["partitions"] if p["active"]}
    return set()


def pending(load: Load) -> list[str]:
    """What is left under way at the end: claims waiting for placement, records of a create
    under way, and outcomes never made definite."""
    left = [f"claim {c.name} {c.state}" for c in claims.claims() if c.state != "CREATED"]
    left += [
        f"record {r.sandbox_id} {r.state}"
        for r in Records().of(GATEWAY)
        if r.state in (model.PLACING, model.CREATING)
    ]
    left += [f"create {sandbox_id} never answered" for sandbox_id in load.unsure]
    left += [f"delete {sandbox_id} never answered" for sandbox_id in load.undeleted]
    return left


def marked_lost(fleet: Fleet, host: str, since: float) -> float:
    """Seconds from ``since`` until the fleet marks ``host`` lost."""
    while fleet.table.refresh()[host].state != "lost":
        time.sleep(0.1)
    return time.monotonic() - since


def server_errors(name: str, text: list[str], lines: int = 60) -> str:
    """A server's tracebacks and error lines from its log ``name`` (``text``: its lines), the
    last ``lines`` of them."""
    kept, inside = [], False
    for line in text:
        inside = inside or line.startswith("Traceback")
        if inside or " ERROR " in line or "Exception" in line:
            kept.append(line)
        if inside and line and not line[0].isspace() and not line.startswith("Traceback"):
            inside = False  # the exception's own line ends a traceback
    return "\n".join([f"errors in {name}:", *kept[-lines:]])


def percentile(values: list[float], share: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--creates", type=int, default=300)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seed", type=int, default=30)
    parser.add_argument("--json", type=Path, help="write the figures there as JSON")
    parser.add_argument("--out", type=Path, help="write fleet.json there (docs/results)")
    args = parser.parse_args(argv)
    report = common.Report("fleet", rounds=1, warmup=0)
    began = time.monotonic()
    memory = Memory()
    with fake_fleet("vsfb-", HOSTS, (GATEWAY,), "--place-timeout", "1") as fx:
        fleet = Fleet(fx.cluster.address, gateway=GATEWAY)
        load = Load(fx.fleet_sockets[GATEWAY], args.creates, args.clients, args.seed)
        threads = [threading.Thread(target=load.client, args=(i,)) for i in range(args.clients)]
        load_began = time.monotonic()
        for thread in threads:
            thread.start()
        load.quarters[0].wait()
        fx.kill_driver(DRIVER_KILLED)
        driver_marked = marked_lost(fleet, DRIVER_KILLED, time.monotonic())
        time.sleep(max(0.0, DRIVER_BACK_S - driver_marked))
        fx.start_driver(DRIVER_KILLED)
        load.quarters[1].wait()
        fx.cluster.kill(HOST_KILLED)
        fx.kill_driver(HOST_KILLED)
        host_marked = marked_lost(fleet, HOST_KILLED, time.monotonic())
        back = threading.Thread(target=_back, args=(fx, HOST_KILLED, HOST_BACK_S - host_marked))
        back.start()
        load.quarters[2].wait()
        fx.kill_server(GATEWAY)
        fx.serve(GATEWAY)
        for thread in threads:
            thread.join()
        load_s = time.monotonic() - load_began
        back.join()
        load.settle()
        drift = _quiet_drift(fleet)
        found = audit(fx, load)
        left = pending(load)
        stranded = [
            c.name
            for c in claims.claims()
            if c.state == "CREATED"
            and (owner := model.claim_owner(c.name)) is not None
            and owner[1] not in found["holders"]
        ]
        fleet.close()
        problems = load.unaccounted + found["lost"] + found["duplicated"] + found["still_there"]
        if problems or left:  # the servers' own account of what went wrong
            logs = [fx.cluster.root / f"serve-{GATEWAY}.log"]
            logs += sorted(fx.cluster.root.glob("driver-*.log"))
            texts = {log.name: log.read_text(errors="replace").splitlines() for log in logs}
            for name, lines in texts.items():
                print(server_errors(name, lines))
    peak_rss, peak_pss = memory.stop()
    figures = {
        "placement_p50_ms": round(percentile(load.latencies, 0.5) * 1000, 1),
        "placement_p99_ms": round(percentile(load.latencies, 0.99) * 1000, 1),
        "creates_per_s": round(len(load.wanted) / load_s, 2),
        "creates_asked_again": len(load.asked_again),
        "lost": len(found["lost"]),
        "duplicated": len(found["duplicated"]),
        "pending": len(left),
        "deleted_but_there": len(found["still_there"]),
        "double_allocations": found["double_allocations"],
        "constraint_violations": found["constraint_violations"],
        "unaccounted": len(load.unaccounted),
        "drift_gpus": drift,
        "driver_lost_marked_s": round(driver_marked, 2),
        "host_lost_marked_s": round(host_marked, 2),
        "stranded_claims": len(stranded),
        "wall_s": round(time.monotonic() - began, 1),
        "peak_rss_mib": round(peak_rss, 1),
        "peak_pss_mib": round(peak_pss, 1),
    }
    print(f"outcomes: {json.dumps(load.outcomes, sort_keys=True)}")
    for why in [
        *load.unaccounted,
        *(f"lost: {sid}" for sid in found["lost"]),
        *(f"duplicated: {sid} on {found['holders'][sid]}" for sid in found["duplicated"]),
        *(f"deleted but there: {sid}" for sid in found["still_there"]),
        *(f"pending: {what}" for what in left),
        *(f"stranded: {name}" for name in stranded),
    ]:
        print(f"problem: {why}")
    for key, value in figures.items():
        print(f"{key}: {value}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    if args.out:
        report.extra.update(
            {"creates": args.creates, "fleet_clients": args.clients, "figures": figures}
        )
        report.extra["series"] = [_series("CreateSandbox, succeeded at the first ask", load)]
        for figure in ("lost", "duplicated", "pending", "double_allocations", "unaccounted"):
            report.checks.append(common.at_most(figure, figures[figure], 0, ""))
        for figure in ("driver_lost_marked_s", "host_lost_marked_s"):
            report.checks.append(common.at_most(figure, figures[figure], 5.0, "s"))
        report.write(args.out)
    return 0


def _back(fx: FakeFleet, name: str, after: float) -> None:
    """Host ``name``, killed whole, started and joined again ``after`` seconds on."""
    time.sleep(max(0.0, after))
    fx.start_driver(name)
    while name in claims.live_nodes():
        time.sleep(0.2)
    fx.cluster.join(name, fx.sockets[name])
    fx.cluster.wait_joined(name)


def _series(label: str, load: Load) -> dict[str, Any]:
    values = sorted(load.latencies) or [0.0]
    return {
        "label": label,
        "median": percentile(values, 0.5),
        "min": values[0],
        "max": values[-1],
        "samples": len(load.latencies),
    }


def _quiet_drift(fleet: Fleet) -> float:
    """Ray's free GPUs less each host's own, summed as magnitudes, once every host is ready and
    they agree (or after QUIET_S seconds, what is left)."""
    deadline = time.monotonic() + QUIET_S
    clean = 0
    while True:
        views = fleet.hosts()
        drift = sum(abs(v.drift().get(model.GPU, 0.0)) for v in views)
        total = sum(abs(d) for v in views for d in v.drift().values())
        clean = clean + 1 if total == 0 and all(v.state == "ready" for v in views) else 0
        if clean >= 4 or time.monotonic() > deadline:
            return drift
        time.sleep(0.5)


if __name__ == "__main__":
    raise SystemExit(main())
