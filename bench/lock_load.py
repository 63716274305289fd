"""The host lock under load: create, destroy and claim latency, and how long calls wait for and
hold the lock, with 100 defined domains on a fake 64-GPU host and 8 concurrent clients.

Setup: a state directory of this run's own on the real libvirtd, a small imported image, and
``--domains`` sandboxes defined there (never started) that stay for the whole run: every
listing, reconcile and view reads them. Then ``--clients`` processes, each under
``umockdev-run`` with tests/fixtures/hosts/gpu64.umockdev (64 H100 PCIe on 16 switches), run
for ``--seconds``:

- **create**: a GPU sandbox of 1, 2 or 4 GPUs, defined and not started (the definition holds
  the GPUs; a start would fail without VFIO), or one without GPUs;
- **destroy**: one of the client's own sandboxes;
- **claim**: a warm-pool claim of a pooled guest. The pooled guests are defined, not booted
  (client 0 keeps the pool filled), and the claim's one question to the guest (its hostname)
  is answered by the client: what is measured is the claim's work on the host;
- **reconcile**: now and then, as every ``create`` and ``pool fill`` of the CLI does.

Each client times each call and records every hold of the host lock (``vmsandbox.lock.STATS``:
the wait for it and the time it was held). The report gives count, median, 95th percentile and
maximum of each, and the errors by code. ``--ops create,destroy`` runs only those two (what
code without warm-pool claims of defined guests can run, for a comparison).

Usage: .venv/bin/python bench/lock_load.py [--clients 8] [--seconds 60] [--domains 100]
       [--out DIR | --json FILE] [--ops create,destroy,claim,reconcile]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import common

HOST = "gpu64"
IMAGE = "lockload"
OPS = ("create", "destroy", "claim", "reconcile")
WEIGHTS = {"create": 5, "destroy": 4, "claim": 3, "reconcile": 1}


# -- a client --------------------------------------------------------------------------------------


class Client:
    """One client process: a manager on the shared state directory, its calls timed."""

    def __init__(self, number: int, ops: Sequence[str], seed: int, run: str) -> None:
        from vmsandbox import lock
        from vmsandbox.config import Config
        from vmsandbox.guest.ssh import ExecResult
        from vmsandbox.sandbox.manager import SandboxManager

        if hasattr(lock, "STATS"):
            lock.STATS = []
        self.lock = lock
        self.number = number
        self.run_id = run
        self.ops = [op for op in ops for _ in range(WEIGHTS[op])]
        self.rng = random.Random(seed)
        self.manager = SandboxManager(Config.load(), reconcile=False)
        if hasattr(self.manager.pool, "guest_run"):
            self.manager.pool.guest_run = lambda *_a, **_k: ExecResult(0, "", "")
        self.mine: list[tuple[str, str]] = []  # (name, uuid) of this client's sandboxes
        self.made = 0
        self.calls: list[dict[str, Any]] = []

    def name(self, kind: str) -> str:
        self.made += 1
        return f"{common.PREFIX}lock-{self.run_id}-{kind}{self.number}-{self.made}"

    def timed(self, op: str, body: Callable[[], object]) -> None:
        from vmsandbox.errors import VmSandboxError

        started = time.monotonic()
        try:
            body()
            code = "OK"
        except VmSandboxError as exc:
            code = exc.code
        self.calls.append({"op": op, "code": code, "seconds": time.monotonic() - started})

    def create(self) -> None:
        from vmsandbox.gpu.request import GpuRequest
        from vmsandbox.sandbox.spec import SandboxSpec

        count = self.rng.choice([0, 1, 1, 2, 4])
        spec = SandboxSpec(
            name=self.name("c"),
            image=IMAGE,
            memory_mib=256,
            disk_gib=1,
            gpu=GpuRequest(count=count) if count else None,
        )
        made = self.manager.create(spec, start=False)
        self.mine.append((made.name, made.uuid))

    def destroy(self) -> None:
        if not self.mine:
            return
        name, uuid = self.mine.pop(self.rng.randrange(len(self.mine)))
        if uuid:
            self.manager.destroy(name, uuid=uuid)
        else:
            self.manager.destroy(name)

    def claim(self) -> None:
        from vmsandbox.sandbox.spec import SandboxSpec

        name = self.name("k")
        spec = SandboxSpec(name=name, image=IMAGE, memory_mib=256, disk_gib=1)
        image = self.manager.images.get(IMAGE)
        made = self.manager.pool.claim(spec, name, image, lambda _line: None, False)
        if made is not None:
            self.mine.append((made.name, made.uuid))

    def reconcile(self) -> None:
        self.manager.reconcile()

    def fill(self) -> None:
        """Keep the pool full of defined (not booted) guests."""
        from vmsandbox.sandbox import runner
        from vmsandbox.sandbox.pool.shapes import PoolFull, shape_spec
        from vmsandbox.sandbox.pool.steps import FILL_STEPS

        m = self.manager
        shape = m.config.pool[0]
        steps = tuple(s for s in FILL_STEPS if s.name not in ("start", "wait", "settle"))
        spec = shape_spec(shape)
        creation = m.pool.creation(spec, spec.name or "", m.images.get(IMAGE), lambda _l: None)
        creation.pool_key, creation.doing = shape.key, "fill"
        creation.room = lambda now: (
            sum(1 for h in now.holds.values() if h.pool == shape.key) < shape.count
        )
        try:
            runner.run(steps, creation, m.locked, m.checkpoint)
        except PoolFull:
            time.sleep(0.05)

    def run(self, seconds: float, filler: bool) -> dict[str, Any]:
        bodies = {op: getattr(self, op) for op in OPS}
        end = time.monotonic() + seconds
        first = sorted(set(self.ops))  # every kind of call once, then at random by weight
        self.rng.shuffle(first)
        while time.monotonic() < end:
            if filler:
                self.timed("fill", self.fill)
                continue
            op = first.pop() if first else self.rng.choice(self.ops)
            self.timed(op, bodies[op])
        holds = getattr(self.lock, "STATS", None) or []
        return {
            "calls": self.calls,
            "holds": [{"waited": h.waited, "held": h.held} for h in holds],
        }


def client_main(args: argparse.Namespace) -> int:
    client = Client(args.client, args.ops.split(","), args.seed, args.run)
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 1
    result = client.run(args.seconds, filler=args.filler)
    args.result.write_text(json.dumps(result))
    for _ in list(client.mine):  # the coordinator removes the rest
        client.timed("cleanup", client.destroy)
    return 0


# -- the coordinator -------------------------------------------------------------------------------


def setup(root: Path, domains: int, clients: int) -> tuple[Path, dict[str, str]]:
    """The image, the config file, and ``domains`` defined sandboxes."""
    from vmsandbox.config import Config
    from vmsandbox.image.store import ImageStore
    from vmsandbox.sandbox.manager import SandboxManager
    from vmsandbox.sandbox.spec import SandboxSpec

    disk = root / "disk.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(disk), "64M"], check=True)
    # an MBR signature: images import refuses a blank qcow2
    signature = ["-c", "write -P 0x55 510 1", "-c", "write -P 0xaa 511 1"]
    subprocess.run(["qemu-io", *signature, str(disk)], check=True, capture_output=True)
    ImageStore(root / "images").import_image(disk, IMAGE)
    file = root / "config.toml"
    # a long wait: the figures measure the waits, a timeout would hide them (older versions
    # have no such key and wait 60 s)
    patient = "lock_timeout = 300\n" if "lock_timeout" in Config.__dataclass_fields__ else ""
    file.write_text(
        f'uri = "qemu:///system"\nstate_dir = "{root / "state"}"\n'
        f'image_dir = "{root / "images"}"\nvirt_type = "qemu"\n{patient}'
        f'[pool.{IMAGE}]\nimage = "{IMAGE}"\nmemory_mib = 256\ndisk_gib = 1\ncount = {clients}\n'
    )
    env = {**os.environ, "VMSANDBOX_CONFIG": str(file)}
    for key in ("VMSANDBOX_URI", "VMSANDBOX_STATE_DIR", "VMSANDBOX_IMAGE_DIR"):
        env.pop(key, None)
    with SandboxManager(Config.load(file), reconcile=False) as manager:
        for n in range(domains):
            spec = SandboxSpec(name=common.name("lock", f"idle{n}"), image=IMAGE, memory_mib=256)
            manager.create(spec, start=False)
    return file, env


def teardown(file: Path) -> None:
    from vmsandbox.config import Config
    from vmsandbox.errors import VmSandboxError
    from vmsandbox.sandbox.manager import SandboxManager

    config = Config.load(file)
    with SandboxManager(config, reconcile=False) as manager:
        ours = [s for s in manager.list() if Path(s.key_file).is_relative_to(config.sandboxes)]
        for sandbox in ours:
            try:
                manager.destroy(sandbox.name)
            except VmSandboxError as exc:
                print(f"warning: {exc.code}: {exc.message}", file=sys.stderr)
        manager.pool.drain()


def summary(values: Sequence[float]) -> dict[str, float]:
    ordered = sorted(values)
    if not ordered:
        return {"count": 0}
    p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
    return {
        "count": len(ordered),
        "median_s": statistics.median(ordered),
        "p95_s": p95,
        "max_s": ordered[-1],
    }


def coordinate(args: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, str(common.REPO / "tests"))
    from framework.fake_hosts import umockdev_run

    with common.state_dir("lockload") as root:
        print(f"defining {args.domains} sandboxes ...", file=sys.stderr)
        file, env = setup(root, args.domains, args.clients)
        procs: list[subprocess.Popen[str]] = []
        results = [root / f"client-{n}.json" for n in range(args.clients)]
        try:
            with umockdev_run(HOST) as (prefix, umockdev_env):
                testbed = {k: v for k, v in umockdev_env.items() if k == "TMPDIR"}
                for n in range(args.clients):
                    argv = [
                        *prefix,
                        sys.executable,
                        __file__,
                        *("--client", str(n), "--result", str(results[n])),
                        *("--seconds", str(args.seconds), "--ops", args.ops),
                        *("--seed", str(random.randrange(1 << 30)), "--run", common.RUN),
                        *(["--filler"] if n == 0 and "claim" in args.ops else []),
                    ]
                    procs.append(
                        subprocess.Popen(
                            argv,
                            env={**env, **testbed},
                            stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE,
                            text=True,
                        )
                    )
                for proc in procs:
                    assert proc.stdout is not None
                    if proc.stdout.readline().strip() != "ready":
                        raise common.BenchError("a client did not start")
                for proc in procs:
                    assert proc.stdin is not None
                    proc.stdin.write("go\n")
                    proc.stdin.close()
                failed = [proc.wait(timeout=args.seconds + 900) for proc in procs]
            if any(failed):
                raise common.BenchError(f"clients exited {failed}")
            found = [json.loads(path.read_text()) for path in results]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            teardown(file)
    calls = [call for result in found for call in result["calls"]]
    holds = [hold for result in found for hold in result["holds"]]
    report: dict[str, Any] = {
        "bench": "lock_load",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": common.command_line(),
        "commit": common.commit(),
        "run": common.RUN,
        "clients": args.clients,
        "seconds": args.seconds,
        "domains": args.domains,
        "host": HOST,
        "ops": args.ops.split(","),
        "machine": common.machine(),
        "calls": {},
        "errors": {},
        "lock": {
            "wait": summary([h["waited"] for h in holds]),
            "hold": summary([h["held"] for h in holds]),
        },
    }
    for op in sorted({call["op"] for call in calls}):
        done = [c for c in calls if c["op"] == op]
        report["calls"][op] = summary([c["seconds"] for c in done if c["code"] == "OK"])
        errors: dict[str, int] = {}
        for call in done:
            if call["code"] != "OK":
                errors[call["code"]] = errors.get(call["code"], 0) + 1
        report["errors"][op] = errors
    return report


def text(report: dict[str, Any]) -> str:
    rows = []
    for what, figures in [
        *((f"{op} (ok)", s) for op, s in report["calls"].items()),
        ("lock wait", report["lock"]["wait"]),
        ("lock hold", report["lock"]["hold"]),
    ]:
        if figures.get("count"):
            rows.append(
                (
                    what,
                    str(figures["count"]),
                    f"{figures['median_s'] * 1000:.0f} ms",
                    f"{figures['p95_s'] * 1000:.0f} ms",
                    f"{figures['max_s'] * 1000:.0f} ms",
                )
            )
        else:
            rows.append((what, "0", "-", "-", "-"))
    errors = "; ".join(
        f"{op}: " + ", ".join(f"{code} x{n}" for code, n in codes.items())
        for op, codes in report["errors"].items()
        if codes
    )
    head = (
        f"lock_load: {report['clients']} clients, {report['seconds']:.0f} s, "
        f"{report['domains']} defined domains, host {report['host']}"
    )
    table = common.render(("figure", "count", "median", "p95", "max"), rows)
    return "\n".join([head, "", table, "", f"errors: {errors or 'none'}"])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--domains", type=int, default=100)
    parser.add_argument("--ops", default=",".join(OPS), help="among " + ", ".join(OPS))
    parser.add_argument(
        "--out", type=Path, default=common.RESULTS, help="folder for the JSON report"
    )
    parser.add_argument(
        "--json", type=Path, help="write the figures to this file (default OUT/lock_load.json)"
    )
    parser.add_argument("--client", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--run", default=common.RUN, help=argparse.SUPPRESS)
    parser.add_argument("--filler", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = set(args.ops.split(",")) - set(OPS)
    if unknown:
        parser.error(f"--ops: unknown {', '.join(sorted(unknown))}; known: {', '.join(OPS)}")
    if args.client is not None:
        return client_main(args)
    common.require("umockdev-run", "qemu-img")
    report = coordinate(args)
    report["checks"] = [check.to_dict() for check in checks(report)]
    print(text(report))
    path = args.json or args.out / "lock_load.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"written to {path}")
    return 0


# A hold of the lock is a short transition (a reservation, a define, a commit): its 95th
# percentile stays under this even on a loaded 2-core machine; and no call gives up waiting.
HOLD_P95_MS = 250.0


def checks(report: dict[str, Any]) -> list[common.Check]:
    timeouts = sum(codes.get("DEADLINE_EXCEEDED", 0) for codes in report["errors"].values())
    found = [common.at_most("calls that timed out waiting (DEADLINE_EXCEEDED)", timeouts, 0, "")]
    hold = report["lock"]["hold"]
    if hold.get("count"):
        found.append(common.at_most("lock hold, p95", hold["p95_s"] * 1000, HOLD_P95_MS, "ms"))
    wait = report["lock"]["wait"]
    if wait.get("count"):
        found.append(common.Check("lock wait, p95", wait["p95_s"] * 1000, "ms", "-", None))
    for op, figures in report["calls"].items():
        if figures.get("count"):
            found.append(common.Check(f"{op}, median", figures["median_s"] * 1000, "ms", "-", None))
    return found


if __name__ == "__main__":
    sys.exit(common.entry(main))
