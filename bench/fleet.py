"""The fleet under load: four hosts, 36 GPUs, 300 creates from 8 clients, then a host killed.

The fleet is the one of tests/e2e/test_fleet_fake_hosts.py, inside a network namespace of this run's
own: a Ray head, four hosts each a vmsandbox driver on the fake hypervisor under its own umockdev
host (two HGX H100 boards in shared NVSwitch mode with the fake fmpm, one HGX H100 board in full
passthrough, one PCIe server with twelve L4: 8 + 8 + 8 + 12 GPUs), and the fleet server, whose
socket 8 client threads drive as a gateway does. Each client creates sandboxes of 1, 2, 4 or 8 GPUs
(more than the fleet holds: some are refused) and deletes one of its own now and then. Halfway
through, one HGX board's Ray side is killed; the clients go on.

What it reports (``--json FILE`` writes the same keys):

- ``placement_p50_ms``, ``placement_p99_ms``: CreateSandbox latency of the creates that
  succeeded (claim placed by Ray, sandbox defined and started by its host);
- ``creates_per_s``: successful creates per second of the create phase;
- ``double_allocations``: GPUs that two sandboxes of one host hold, from each host's own
  records (HostInfo), never Ray's;
- ``constraint_violations``: sandboxes whose GPUs are not what was asked (count, whole
  partition in shared NVSwitch mode, 1 or all in full passthrough);
- ``unaccounted``: creates that neither succeeded (and exist on their host, or were deleted)
  nor failed with a clear refusal (RESOURCE_EXHAUSTED, UNAVAILABLE, ALREADY_EXISTS); a delete
  answered UNAVAILABLE is asked again once the clients are done, as a gateway retries, and
  counts as done when the fleet then has no such sandbox (its answer was lost with its host);
- ``drift_gpus``: once quiet, the sum over live hosts of |Ray's free GPUs - the host's own|;
- ``host_lost_marked_s``: from the kill until the fleet marks the host lost;
- ``stranded_claims``: 10 s after that, claims of sandboxes on the lost host or of none;
- ``wall_s``: the run's time;
- ``peak_rss_mib``, ``peak_pss_mib``: the most memory its processes (the fleet's included) held
  at once, as their RSS summed (a page that Ray's processes share counts once per process) and
  as their PSS summed (each shared page split among them: what the run holds).

Usage (as root, with the fleet extra): .venv/bin/python bench/fleet.py [--creates 300]
       [--clients 8] [--json FILE]
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

import grpc  # noqa: E402
from framework.fleet_cluster import cluster, free_port, own_network, start_fake_host, stop  # noqa: E402
from framework.openshell_client import stub  # noqa: E402

from vmsandbox.fleet import claims, model  # noqa: E402
from vmsandbox.fleet.core import Fleet  # noqa: E402
from vmsandbox.openshell.proto import compute_driver_pb2 as pb  # noqa: E402

HOSTS = {  # name -> (umockdev host, fabric, pooled guests)
    "hgx-a": ("hgx_h100", "shared", 0),
    "hgx-b": ("hgx_h100", "shared", 0),
    "hgx-full": ("hgx_h100", "full", 0),
    "l4": ("l4_server_x12", "none", 0),
}
KILLED = "hgx-b"
SIZES = (1, 1, 1, 2, 2, 4, 8)  # GPUs per create, drawn at random
DELETE_CHANCE = 0.3  # after each create, the chance a client deletes one of its sandboxes
CLEAR = ("RESOURCE_EXHAUSTED", "UNAVAILABLE", "ALREADY_EXISTS")
STRANDED_AFTER_S = 10.0
QUIET_S = 60.0


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
    """The clients' creates and deletes, and what came of each."""

    def __init__(self, socket_path: Path, creates: int, clients: int, seed: int) -> None:
        self.socket_path = socket_path
        self.left = creates
        self.clients = clients
        self.random = random.Random(seed)
        self.lock = threading.Lock()
        self.latencies: list[float] = []
        self.wanted: dict[str, int] = {}  # sandbox id -> GPUs asked, for those created
        self.deleted: set[str] = set()
        self.history: dict[str, list[str]] = {}  # sandbox id -> the answers the client got
        self.unsure: set[str] = set()  # deletes answered UNAVAILABLE
        self.outcomes: dict[str, int] = {}
        self.unaccounted: list[str] = []  # what happened to each create not accounted for
        self.halfway = threading.Event()
        self.total = creates

    def _next(self) -> int | None:
        with self.lock:
            if self.left == 0:
                return None
            self.left -= 1
            if self.total - self.left >= self.total // 2:
                self.halfway.set()
            return self.random.choice(SIZES)

    def client(self, index: int) -> None:
        channel, driver = stub(self.socket_path)
        mine: list[str] = []
        rng = random.Random(index)
        with channel:
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
                started = time.monotonic()
                try:
                    driver.CreateSandbox(pb.CreateSandboxRequest(sandbox=sandbox), timeout=300)
                    code = "OK"
                except grpc.RpcError as exc:
                    code = exc.code().name
                with self.lock:
                    self.history.setdefault(sandbox.id, []).append(f"create {code}")
                    self.outcomes[code] = self.outcomes.get(code, 0) + 1
                    if code == "OK":
                        self.latencies.append(time.monotonic() - started)
                        self.wanted[sandbox.id] = size
                        mine.append(sandbox.id)
                    elif code not in CLEAR:
                        self.unaccounted.append(f"create {sandbox.id}: {code}")
                if mine and rng.random() < DELETE_CHANCE:
                    victim = mine.pop(rng.randrange(len(mine)))
                    try:
                        driver.DeleteSandbox(
                            pb.DeleteSandboxRequest(sandbox_id=victim), timeout=120
                        )
                        with self.lock:
                            self.deleted.add(victim)
                            self.history.setdefault(victim, []).append("delete OK")
                    except grpc.RpcError as exc:
                        with self.lock:
                            self.history.setdefault(victim, []).append(f"delete {exc.code().name}")
                            if exc.code().name == "UNAVAILABLE":  # its outcome is not known
                                self.unsure.add(victim)
                            else:
                                self.unaccounted.append(f"delete {victim}: {exc.code().name}")

    def settle(self) -> None:
        """Ask again, as a gateway retries, for each delete answered UNAVAILABLE: its host was
        lost (kept there: UNAVAILABLE again), or the delete went through and only its answer
        was lost (NOT_FOUND now: deleted)."""
        channel, driver = stub(self.socket_path)
        with channel:
            for victim in sorted(self.unsure):
                try:
                    driver.DeleteSandbox(pb.DeleteSandboxRequest(sandbox_id=victim), timeout=120)
                    code = "OK"
                except grpc.RpcError as exc:
                    code = exc.code().name
                self.history.setdefault(victim, []).append(f"delete again {code}")
                if code in ("OK", "NOT_FOUND"):
                    self.deleted.add(victim)
                elif code != "UNAVAILABLE":
                    self.unaccounted.append(f"delete {victim} again: {code}")


def audit(infos: dict[str, dict[str, Any]], load: Load) -> tuple[int, int, list[str]]:
    """Double allocations, constraint violations and the ids of created sandboxes no host
    has (nor were they deleted), from the hosts' own records."""
    doubles = violations = 0
    found: set[str] = set()
    for info in infos.values():
        seen: dict[str, str] = {}
        active = {p["size"] for p in info["fabric"]["partitions"] if p["active"]}
        for sandbox in info["sandboxes"]:
            for bdf in sandbox["gpus"]:
                if bdf in seen:
                    doubles += 1
                seen[bdf] = sandbox["name"]
            sandbox_id = sandbox["labels"].get("openshell.sandbox-id", "")
            found.add(sandbox_id)
            asked = load.wanted.get(sandbox_id)
            count = len(sandbox["gpus"])
            mode = info["fabric"]["mode"]
            if (
                asked is None
                or count != asked
                or (mode == "shared-nvswitch" and count not in active)
                or (mode == "full-passthrough" and count not in (1, len(info["gpus"])))
            ):
                violations += 1
    missing = set(load.wanted) - load.deleted - found
    return doubles, violations, sorted(missing)


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
    args = parser.parse_args(argv)
    from vmsandbox.fleet.join import read_host

    began = time.monotonic()
    memory = Memory()
    with own_network(), cluster("vsfb-") as made:
        sockets, drivers = {}, []
        try:
            for name, (host, fabric, pooled) in HOSTS.items():
                process, socket_path = start_fake_host(
                    made.root, name, host, fabric, pooled, free_port()
                )
                drivers.append(process)
                sockets[name] = socket_path
                made.join(name, socket_path)
            made.wait_joined(*HOSTS)
            fleet_socket = made.root / "fleet" / "driver.sock"
            made.serve(fleet_socket, "bench", "--place-timeout", "1")
            fleet = Fleet(made.address, gateway="bench")
            load = Load(fleet_socket, args.creates, args.clients, args.seed)
            threads = [threading.Thread(target=load.client, args=(i,)) for i in range(args.clients)]
            load_began = time.monotonic()
            for thread in threads:
                thread.start()
            load.halfway.wait()
            made.kill(KILLED)
            killed = time.monotonic()
            while fleet.table.refresh()[KILLED].state != "lost":
                time.sleep(0.1)
            marked = time.monotonic() - killed
            for thread in threads:
                thread.join()
            load.settle()
            load_s = time.monotonic() - load_began
            time.sleep(max(0.0, STRANDED_AFTER_S - (time.monotonic() - killed - marked)))
            live = {n: read_host(str(s), wait=False) for n, s in sockets.items() if n != KILLED}
            on_live = {
                model.claim_name("bench", s["labels"].get("openshell.sandbox-id", ""))
                for info in live.values()
                for s in info["sandboxes"]
            }
            stranded = sum(
                1
                for claim in claims.claims()
                if (claim.name.startswith(model.CLAIM_PREFIX) and claim.name not in on_live)
                or claim.name == model.pin_name(KILLED)
            )
            drift = _quiet_drift(fleet)
            infos = {n: read_host(str(s), wait=False) for n, s in sockets.items()}
            doubles, violations, missing = audit(infos, load)
            fleet.close()
            if load.unaccounted or missing:  # the servers' own account of what went wrong
                logs = [made.root / "serve-bench.log", *sorted(made.root.glob("driver-*.log"))]
                texts = {log.name: log.read_text(errors="replace").splitlines() for log in logs}
                for name, lines in texts.items():
                    print(server_errors(name, lines))
                for sandbox_id in missing:
                    print(f"{sandbox_id}: {load.history.get(sandbox_id, [])}")
                    for name, lines in texts.items():
                        print(
                            "".join(f"  {name}: {ln}\n" for ln in lines if sandbox_id in ln), end=""
                        )
        finally:
            for process in drivers:
                stop(process)  # SIGTERM; its whole session killed if it does not end
    peak_rss, peak_pss = memory.stop()
    figures = {
        "placement_p50_ms": round(percentile(load.latencies, 0.5) * 1000, 1),
        "placement_p99_ms": round(percentile(load.latencies, 0.99) * 1000, 1),
        "creates_per_s": round(len(load.latencies) / load_s, 2),
        "double_allocations": doubles,
        "constraint_violations": violations,
        "unaccounted": len(load.unaccounted) + len(missing),
        "drift_gpus": drift,
        "host_lost_marked_s": round(marked, 2),
        "stranded_claims": stranded,
        "wall_s": round(time.monotonic() - began, 1),
        "peak_rss_mib": round(peak_rss, 1),
        "peak_pss_mib": round(peak_pss, 1),
    }
    print(f"outcomes: {json.dumps(load.outcomes, sort_keys=True)}")
    for why in [*load.unaccounted, *(f"missing on every host: {sid}" for sid in missing)]:
        print(f"unaccounted: {why}")
    for key, value in figures.items():
        print(f"{key}: {value}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


def _quiet_drift(fleet: Fleet) -> float:
    """Ray's free GPUs less each live host's own, summed as magnitudes, once they agree (or
    after QUIET_S seconds, what is left)."""
    deadline = time.monotonic() + QUIET_S
    clean = 0
    while True:
        views = [v for v in fleet.hosts() if v.state != "lost"]
        drift = sum(abs(v.drift().get(model.GPU, 0.0)) for v in views)
        total = sum(abs(d) for v in views for d in v.drift().values())
        clean = clean + 1 if total == 0 and all(v.state == "ready" for v in views) else 0
        if clean >= 4 or time.monotonic() > deadline:
            return drift
        time.sleep(0.5)


if __name__ == "__main__":
    raise SystemExit(main())
