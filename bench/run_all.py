"""Run every benchmark and print one summary: each figure against its target, met or missed.

Each benchmark runs as its own process (its table and progress are shown as it goes) and writes
<name>.json into bench/results/ (or ``--out DIR``); this script reads them back and writes
summary.json beside them. ``--out docs/results``, then docs/gen_performance.py, puts a run's
figures on the documentation's performance page.
``--quick`` runs one round of each without warm-up: it proves they all work, its figures are
not worth quoting. Exit status: 0 when every benchmark ran and met its targets, 1 otherwise.

The boot-heavy ones take long under TCG: destroy and create_overhead a minute or two,
ssh_ready 1-2 minutes a round, fast_start 2-4 minutes a round (a cold boot and a pool fill),
parallel_creates 10-15 minutes for its one round.

Usage: .venv/bin/python bench/run_all.py [--quick] [--only NAME ...] [--skip NAME ...] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import common

BENCH = common.REPO / "bench"


@dataclass(frozen=True)
class Bench:
    name: str
    script: str
    result: str  # file name under bench/results
    quick: tuple[str, ...] = ("--rounds", "1", "--warmup", "0")


BENCHES = (
    Bench("cli_startup", "cli_startup.py", "cli_startup.json"),
    Bench("inventory", "bench_inventory.py", "inventory.json", quick=("--rounds", "1")),
    Bench("allocation", "allocation.py", "allocation.json"),
    Bench(
        "lock_load", "lock_load.py", "lock_load.json", quick=("--seconds", "10", "--domains", "5")
    ),
    Bench("destroy", "destroy.py", "destroy.json"),
    Bench("create_overhead", "create_overhead.py", "create_overhead.json"),
    Bench("ssh_ready", "ssh_ready.py", "ssh_ready.json"),
    Bench("fast_start", "fast_start.py", "fast_start.json"),
    Bench("parallel_creates", "parallel_creates.py", "parallel_creates.json"),
    Bench("suspend", "suspend.py", "suspend.json", quick=("--cycles", "2")),
)
NAMES = [bench.name for bench in BENCHES]


@dataclass
class Outcome:
    bench: str
    exit: int | None
    seconds: float
    checks: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "bench": self.bench,
            "exit": self.exit,
            "seconds": round(self.seconds, 1),
            "checks": self.checks,
            "error": self.error,
        }


def run_one(bench: Bench, quick: bool, out: Path) -> Outcome:
    """Run one benchmark to its end (on Ctrl-C: let it clean up first) and read its checks."""
    argv = [sys.executable, str(BENCH / bench.script), *(bench.quick if quick else ())]
    argv += ["--out", str(out)]
    print(f"\n=== {bench.name}: {' '.join(argv[1:])}", flush=True)
    start = time.time()
    with subprocess.Popen(argv) as proc:
        try:
            code = proc.wait()
        except KeyboardInterrupt:
            common.reap(proc)
            raise
    outcome = Outcome(bench.name, code, time.time() - start)
    result = out / bench.result
    if not result.exists() or result.stat().st_mtime < start:
        outcome.error = f"no fresh {result.name} (exit {code})"
        return outcome
    outcome.checks = checks_of(json.loads(result.read_text()))
    return outcome


def checks_of(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The figures of a report, in the form of ``common.Check`` (bench_inventory has its own)."""
    if "checks" in report:
        return report["checks"]
    return [
        common.Check(
            result["name"],
            result["median_ms"],
            "ms",
            f"<= {result['target_ms']:.0f} ms",
            result["ok"],
        ).to_dict()
        for result in report["results"]
    ]


def summary(outcomes: Sequence[Outcome], quick: bool) -> str:
    verdicts = {True: "met", False: "MISSED", None: "-"}
    rows = []
    for outcome in outcomes:
        if outcome.error:
            rows.append((outcome.bench, "did not run to its end", "", "", outcome.error))
        for check in outcome.checks:
            value = common.fmt(check["value"], check["unit"])
            rows.append(
                (outcome.bench, check["figure"], value, check["target"], verdicts[check["met"]])
            )
    info = common.machine()
    head = (
        f"summary{' (--quick: one round each, not figures to quote)' if quick else ''}: "
        f"{info['cpus']} CPUs ({info['cpu_model']}), {info['memory_gib']} GiB, "
        f"load {info['load_average'][0]}, {info['qemu']}, {info['libvirt']}"
    )
    return head + "\n" + common.render(("bench", "figure", "value", "target", "verdict"), rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="one round each, no warm-up")
    parser.add_argument("--only", nargs="+", choices=NAMES, metavar="NAME", help=", ".join(NAMES))
    parser.add_argument("--skip", nargs="+", choices=NAMES, default=[], metavar="NAME")
    parser.add_argument(
        "--out", type=Path, default=common.RESULTS, help="folder for the JSON reports"
    )
    args = parser.parse_args(argv)
    chosen = [
        b for b in BENCHES if (not args.only or b.name in args.only) and b.name not in args.skip
    ]
    started = time.time()
    outcomes: list[Outcome] = []
    try:
        for bench in chosen:
            outcomes.append(run_one(bench, args.quick, args.out))
    except KeyboardInterrupt:
        print("\ninterrupted: summary of the benchmarks that finished", file=sys.stderr)
    text = summary(outcomes, args.quick)
    path: Path = args.out / "summary.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "quick": args.quick,
        "command": common.command_line(),
        "commit": common.commit(),
        "machine": common.machine(),
        "benches": [outcome.to_dict() for outcome in outcomes],
    }
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n{text}\nwritten to {path}")
    ok = len(outcomes) == len(chosen) and all(
        not outcome.error and all(check["met"] is not False for check in outcome.checks)
        for outcome in outcomes
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(common.entry(main))
