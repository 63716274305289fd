"""GPU hand-offs on the nested GPU host: what one tenant leaves in a card, whether the next one
finds it, and what the sanitize between them costs.

A hand-off is one tenant's sandbox holding both emulated cards (``create --gpu 2``) destroyed and
the next one's created on them. Each tenant's guest first searches the whole video memory of
its cards for the previous tenant's marker (tests/framework/canary.py), then fills it with a
marker of its own; its destroy sanitizes both cards (a secondary bus reset of each card's root
port and L1's scrub hook, which zeroes the VRAM the emulated card keeps through the reset). A
chain of tenants runs in one L1 (the cards' memory lives in L1's QEMU), ``--per-l1`` boots
long, then a pristine L1 starts the next chain (its first tenant follows no one). The host is
watched as the nested test module watches it (tests/framework/nested_host.py): a lost L1 ends
its chain and the next L1 goes on.

Figures:

- ``gpus_lost``: cards that did not come back after a destroy (custody not free, held, or not
  on the driver they had);
- ``canary_bytes_found``: marker bytes any tenant found of its predecessor's, over every
  hand-off (0 with custody);
- ``canary_bytes_found_unsanitized``: the same probe after one hand-off with ``gpu_sanitize =
  false`` in L1 (the probe can fail: the reset alone leaves the memory as it was);
- ``sanitize_p50_s``, ``sanitize_p99_s``: a card's whole sanitize, and per step, from L1's
  sanitize log;
- ``fault_quarantined_s``: an uncorrectable AER error injected at a free card's root port from
  the outer QEMU's monitor, until the health monitor (``vmsandbox gpus watch`` in L1) wrote the
  card's new custody record (L1's clock is set from the host's at each restore).

Needs root, libvirtd and the images (``make setup``); about a minute per hand-off here. Uses its
own L1 folder (``VMSANDBOX_NESTED_DIR``, default /var/tmp/vmsandbox-handoff).

Usage: .venv/bin/python bench/gpu_handoff.py [--handoffs 100] [--per-l1 10] [--json FILE]
       [--out DIR]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import common

os.environ.setdefault("VMSANDBOX_NESTED_DIR", "/var/tmp/vmsandbox-handoff")
os.environ.setdefault("VMSANDBOX_NESTED_BUDGET", str(24 * 3600))  # this bench's, not the tests'
sys.path.insert(0, str(common.REPO / "tests"))

from framework import canary
from framework.nested_host import BudgetExhausted, L1Lost, NestedHost, nested_env

NESTED = common.REPO / "setup" / "nested.sh"
QMP = common.REPO / "setup" / "qmp.py"
CREATE = ("--gpu", "2", "--memory", "512", "--timeout", "420")
CREATE_LIMIT = 600.0
CONFIG = "/etc/vmsandbox/config.toml"
SANITIZE_LOG = "/var/lib/vmsandbox/custody/sanitize.jsonl"
WATCH_LOG = "/root/gpu-watch.log"
FAULT_PORT = "gpu1"  # setup/nested.sh's root port of the Rage 128 Pro (0000:02:00.0 in L1)
FAULT_CARD = "0000:02:00.0"
FAULT_WAIT_S = 15.0


@dataclass
class Tally:
    handoffs: int = 0
    gpus_lost: int = 0
    canary_bytes_found: int = 0
    tenants: int = 0
    l1s: int = 0
    lost_l1s: list[str] = field(default_factory=list)
    sanitizes: list[dict[str, Any]] = field(default_factory=list)
    per_handoff_s: list[float] = field(default_factory=list)


def ok(done: subprocess.CompletedProcess[str], what: str) -> subprocess.CompletedProcess[str]:
    if done.returncode != 0:
        raise common.BenchError(f"{what} failed in L1: {(done.stderr or done.stdout)[-2000:]}")
    return done


def cards_back(host: NestedHost, before: dict[str, str | None]) -> int:
    """How many cards did not come back: custody free, nothing holding it, its driver again."""
    gpus = json.loads(ok(host.run("vmsandbox", "--json", "gpus"), "gpus").stdout)["gpus"]
    back = {
        gpu["bdf"]
        for gpu in gpus
        if gpu["custody"] == "free"
        and gpu["in_use_by"] is None
        and gpu["driver"] == before[gpu["bdf"]]
    }
    return len(set(before) - back)


def drivers(host: NestedHost) -> dict[str, str | None]:
    gpus = json.loads(ok(host.run("vmsandbox", "--json", "gpus"), "gpus").stdout)["gpus"]
    return {gpu["bdf"]: gpu["driver"] for gpu in gpus}


def sanitize_log(host: NestedHost) -> list[dict[str, Any]]:
    done = host.run("sh", "-c", f"cat {SANITIZE_LOG} 2>/dev/null || true")
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def tenant(host: NestedHost, name: str) -> None:
    ok(host.run("vmsandbox", "--json", "create", name, *CREATE, limit=CREATE_LIMIT), "create")


def chain(host: NestedHost, tally: Tally, wanted: int, per_l1: int) -> None:
    """One L1's chain of tenants (see the module docstring)."""
    host.boot("restart" if host.lives else "start")
    tally.l1s += 1
    before = drivers(host)
    previous: str | None = None
    logged = 0  # the sanitize log's entries of this L1 already counted
    for boot in range(per_l1):
        if tally.handoffs >= wanted:
            return
        began = time.monotonic()
        name = f"bench-h{tally.l1s}-{boot}"
        tenant(host, name)
        tally.tenants += 1
        if previous is not None:
            tally.canary_bytes_found += canary.probe(host.run, name, "count", previous)
        previous = canary.marker()
        canary.probe(host.run, name, "write", previous)
        ok(host.run("vmsandbox", "destroy", name), "destroy")
        entries = sanitize_log(host)
        tally.sanitizes += entries[logged:]
        logged = len(entries)
        lost = cards_back(host, before)
        tally.gpus_lost += lost
        if boot:
            tally.handoffs += 1
            tally.per_handoff_s.append(time.monotonic() - began)
        print(
            f"L1 {tally.l1s} tenant {boot}: {tally.handoffs}/{wanted} hand-offs, "
            f"{tally.canary_bytes_found} canary bytes found, {tally.gpus_lost} GPUs lost",
            flush=True,
        )
        if lost:
            return  # the next chain starts in a pristine L1


def unsanitized(host: NestedHost) -> int:
    """One hand-off with sanitizing off in L1: the bytes tenant B finds of tenant A's marker."""
    host.boot("restart")
    config = ok(host.run("cat", CONFIG), "cat").stdout
    ok(host.run("sh", "-c", f"cat > {CONFIG}", stdin=config + "gpu_sanitize = false\n"), "config")
    mark = canary.marker()
    tenant(host, "bench-plain-a")
    canary.probe(host.run, "bench-plain-a", "write", mark)
    ok(host.run("vmsandbox", "destroy", "bench-plain-a"), "destroy")
    tenant(host, "bench-plain-b")
    found = canary.probe(host.run, "bench-plain-b", "count", mark)
    ok(host.run("vmsandbox", "destroy", "bench-plain-b"), "destroy")
    host.kill()  # this L1 frees without sanitizing: nothing more runs in it
    return found


def fault(host: NestedHost) -> float:
    """Seconds from an AER error injected at a free card's port to its custody record."""
    host.boot("restart")
    watch = f"setsid nohup vmsandbox --json gpus watch > {WATCH_LOG} 2>&1 < /dev/null & echo $!"
    watcher = ok(host.run("sh", "-c", watch), "watch").stdout.strip()
    try:
        time.sleep(3)  # its first pass sets its cursor in the kernel log
        began = time.time()
        sock = Path(os.environ["VMSANDBOX_NESTED_DIR"]) / "qmp.sock"
        subprocess.run(
            [sys.executable, str(QMP), str(sock), "hmp", f"pcie_aer_inject_error {FAULT_PORT} DLP"],
            check=True,
            capture_output=True,
            timeout=30,
        )
        while time.time() < began + FAULT_WAIT_S:
            for line in host.run("cat", WATCH_LOG).stdout.splitlines():
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue
                if entry.get("bdf") == FAULT_CARD and entry.get("state"):
                    return float(entry["applied_at"]) - began
            time.sleep(0.5)
        raise common.BenchError(f"no quarantine of {FAULT_CARD} within {FAULT_WAIT_S:.0f} s")
    finally:
        host.run("kill", watcher)


def percentile(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(fraction * (len(ordered) - 1))))
    return ordered[index]


def main(argv: Sequence[str] | None = None) -> int:
    parser = common.arguments(__doc__, rounds=1, warmup=0)
    parser.add_argument("--handoffs", type=int, default=100, help="hand-offs to make (100)")
    parser.add_argument("--per-l1", type=int, default=10, help="tenants per L1 (10)")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = common.parse_args(parser, argv)
    env = nested_env()
    state = Path(env["VMSANDBOX_NESTED_DIR"])
    logs = state.parent / f"{state.name}-logs"
    host = NestedHost(NESTED, env, state, logs)
    subprocess.run(["bash", str(NESTED), "prepare"], env=env, check=True, timeout=3600)
    tally = Tally()
    report = common.Report("gpu_handoff", args.handoffs, 0)
    try:
        while tally.handoffs < args.handoffs:
            try:
                chain(host, tally, args.handoffs, args.per_l1)
            except L1Lost as lost:
                tally.lost_l1s.append(str(lost))
        plain = unsanitized(host)
        quarantined_s = fault(host)
    except BudgetExhausted as out:
        raise common.BenchError(str(out)) from None
    finally:
        host.kill()
    ok_runs = [entry for entry in tally.sanitizes if entry.get("ok")]
    totals = [float(entry["seconds"]) for entry in ok_runs]
    steps = sorted({step for entry in ok_runs for step in entry["steps"]})
    per_step = {
        step: [float(e["steps"][step]) for e in ok_runs if step in e["steps"]] for step in steps
    }
    figures = {
        "handoffs": tally.handoffs,
        "gpus_lost": tally.gpus_lost,
        "canary_bytes_found": tally.canary_bytes_found,
        "canary_bytes_found_unsanitized": plain,
        "sanitize_p50_s": percentile(totals, 0.5),
        "sanitize_p99_s": percentile(totals, 0.99),
        "sanitize_steps": {
            step: {"p50_s": percentile(v, 0.5), "p99_s": percentile(v, 0.99)}
            for step, v in per_step.items()
        },
        "sanitizes": len(totals),
        "sanitizes_failed": len(tally.sanitizes) - len(ok_runs),
        "fault_quarantined_s": quarantined_s,
        "tenants": tally.tenants,
        "l1s": tally.l1s,
        "l1s_lost": tally.lost_l1s,
        "handoff_s_median": statistics.median(tally.per_handoff_s) if tally.per_handoff_s else None,
    }
    report.checks += [
        common.Check("GPUs lost", tally.gpus_lost, "", "0", tally.gpus_lost == 0),
        common.Check(
            "canary bytes found (custody on)",
            tally.canary_bytes_found,
            "bytes",
            "0",
            tally.canary_bytes_found == 0,
        ),
        common.Check(
            "canary bytes found, sanitizing off (the probe can fail)",
            plain,
            "bytes",
            "> 0",
            plain > 0,
        ),
        common.Check("sanitize of a card, p50", figures["sanitize_p50_s"], "s", "-", None),
        common.Check("sanitize of a card, p99", figures["sanitize_p99_s"], "s", "-", None),
        common.at_most("fault to quarantine", quarantined_s, 5.0, "s"),
    ]
    report.extra.update(
        series=[
            common.Series(f"sanitize step: {step}", v).to_dict() for step, v in per_step.items()
        ]
        + [common.Series("sanitize of a card (all steps)", totals).to_dict()],
        figures=figures,
    )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    report.write(args.out)
    return 0 if all(check.met is not False for check in report.checks) else 1


if __name__ == "__main__":
    sys.exit(common.entry(main))
