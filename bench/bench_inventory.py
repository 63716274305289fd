"""Benchmark of the host GPU inventory on a fake 200-device host with 8 GPUs.

Measures, under umockdev (tests/fixtures/hosts/bench_200.umockdev):

(a) ``discover()`` in process, after a warm-up, against the 20 ms target;
(b) ``vmsandbox gpus --json`` as a whole process against 300 ms; while that command is missing
    or fails, ``python -m vmsandbox.host`` (same discovery, JSON out) stands in for it.

Prints a table and writes inventory.json (with the date, the machine and the command) into
bench/results/ or ``--out DIR``. Usage:
``.venv/bin/python bench/bench_inventory.py [--rounds N] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

import common  # noqa: E402
from framework.fake_hosts import umockdev_run  # noqa: E402

from vmsandbox.tables import render_grid  # noqa: E402

HOST = "bench_200"
DISCOVER_TARGET_MS = 20.0
PROCESS_TARGET_MS = 300.0


def _summary(name: str, samples: list[float], target_ms: float) -> dict[str, Any]:
    median = statistics.median(samples)
    return {
        "name": name,
        "median_ms": round(median, 2),
        "min_ms": round(min(samples), 2),
        "max_ms": round(max(samples), 2),
        "target_ms": target_ms,
        "ok": median <= target_ms,
        "samples_ms": [round(sample, 2) for sample in samples],
    }


def _time_discover(rounds: int, **kwargs: Any) -> list[float]:
    from vmsandbox.host import discover

    discover(**kwargs)  # warm-up: imports, pyudev context, pci.ids cache
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        discover(**kwargs)
        samples.append((time.perf_counter() - start) * 1000)
    return samples


def _cli_command() -> tuple[list[str], bool]:
    """``vmsandbox gpus --json`` when it works here, else ``python -m vmsandbox.host``."""
    cli = [str(Path(sys.executable).parent / "vmsandbox"), "gpus", "--json"]
    try:
        run = subprocess.run(cli, capture_output=True, text=True, timeout=60, check=False)
        if run.returncode == 0 and "gpus" in json.loads(run.stdout):
            return cli, True
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return [sys.executable, "-m", "vmsandbox.host"], False  # the CLI is not usable here
    return [sys.executable, "-m", "vmsandbox.host"], False


def _time_process(command: list[str], rounds: int) -> list[float]:
    subprocess.run(command, capture_output=True, check=True)  # warm-up: page cache, .pyc
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        subprocess.run(command, capture_output=True, check=True)
        samples.append((time.perf_counter() - start) * 1000)
    return samples


def inner(rounds: int) -> None:
    """Runs under umockdev-run: measure and print the results as JSON."""
    from vmsandbox.host import discover

    inventory = discover()
    command, is_cli = _cli_command()
    label = "vmsandbox gpus --json" if is_cli else "python -m vmsandbox.host (CLI stand-in)"
    results = [
        _summary("discover() in process", _time_discover(rounds), DISCOVER_TARGET_MS),
        _summary(
            "discover(use_nvml=False) in process",
            _time_discover(rounds, use_nvml=False),
            DISCOVER_TARGET_MS,
        ),
        _summary(f"{label}, whole process", _time_process(command, rounds), PROCESS_TARGET_MS),
    ]
    report = {
        "host": HOST,
        "pci_devices": inventory.pci_devices,
        "gpus": len(inventory.gpus),
        "fabric": len(inventory.fabric),
        "rounds": rounds,
        "process_command": command,
        "process_command_is_cli": is_cli,
        "python": platform.python_version(),
        "results": results,
    }
    json.dump(report, sys.stdout)


def table(report: dict[str, Any]) -> str:
    header = ("measurement", "median", "min", "max", "target", "verdict")
    rows = [
        (
            result["name"],
            f"{result['median_ms']:.2f} ms",
            f"{result['min_ms']:.2f} ms",
            f"{result['max_ms']:.2f} ms",
            f"{result['target_ms']:.0f} ms",
            "ok" if result["ok"] else "OVER TARGET",
        )
        for result in report["results"]
    ]
    lines = [
        f"{report['host']}: {report['pci_devices']} PCI devices, {report['gpus']} GPUs, "
        f"{report['fabric']} fabric devices; {report['rounds']} rounds after a warm-up",
        *render_grid(header, rows),
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20, help="timed repetitions (>= 1)")
    parser.add_argument(
        "--out", type=Path, default=common.RESULTS, help="folder for the JSON report"
    )
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.inner:
        inner(args.rounds)
        return 0
    started = time.time()
    with umockdev_run(HOST) as (argv, env):
        run = subprocess.run(
            [*argv, sys.executable, __file__, "--inner", "--rounds", str(args.rounds)],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
    if run.returncode != 0:
        print(run.stderr, file=sys.stderr)
        return run.returncode
    report = {
        "bench": "inventory",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "seconds": round(time.time() - started, 1),
        "command": common.command_line(),
        "commit": common.commit(),
        "machine": common.machine(),
        **json.loads(run.stdout),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "inventory.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))
    print(f"written to {path}")
    return 0 if all(result["ok"] for result in report["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
