"""How often the nested GPU host loses an L1, for one L1 configuration.

Each round starts a pristine L1 (restored from the snapshot of the first boot) and boots one L2
in it under KVM inside the TCG L1, watched as the test module watches it
(tests/framework/nested_host.py: console, heartbeat, crawl). The workload ``create`` (the default)
creates a sandbox holding both emulated cards, runs a command in it and destroys it; ``pool`` fills
a GPU-ready pool of one guest (the module's shape), claims it with one GPU attached live, runs a
command and destroys it. It prints one line per round and a summary, and writes JSON with ``--json
FILE``.

The configuration is setup/nested.sh's environment, for example::

    VMSANDBOX_NESTED_TCG_THREAD=single bench/nested_soak.py --rounds 20 --json single.json
    bench/nested_soak.py --workload pool --rounds 10

Needs root, libvirtd and the images (``make setup``); runs for several minutes per round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from framework.nested_host import (  # noqa: E402
    POOL_CONFIG,
    POOL_TOML,
    BudgetExhausted,
    L1Lost,
    NestedHost,
    nested_env,
)

CONFIG_KEYS = (
    "VMSANDBOX_NESTED_CPU",
    "VMSANDBOX_NESTED_TCG_THREAD",
    "VMSANDBOX_NESTED_CPUS",
    "VMSANDBOX_NESTED_MEMORY_MIB",
)


SMALL = ("--memory", "512", "--timeout", "420")


def create(host: NestedHost, name: str) -> subprocess.CompletedProcess[str]:
    """A cold create holding both cards."""
    return host.run("vmsandbox", "create", name, "--gpu", "2", *SMALL, limit=600)


def pool_claim(host: NestedHost, name: str) -> subprocess.CompletedProcess[str]:
    """A GPU-ready pooled guest booted, then claimed with one GPU attached live."""
    config = host.run("cat", POOL_CONFIG).stdout
    host.run("sh", "-c", f"cat > {POOL_CONFIG}", stdin=f"{config}\n{POOL_TOML}")
    filled = host.run("vmsandbox", "pool", "fill", limit=600)
    if filled.returncode != 0:
        return filled
    return host.run("vmsandbox", "create", name, "--gpu", "1", *SMALL, "--no-refill", limit=600)


WORKLOADS: dict[str, Callable[[NestedHost, str], subprocess.CompletedProcess[str]]] = {
    "create": create,
    "pool": pool_claim,
}


def one_round(host: NestedHost, number: int, workload: str) -> dict[str, object]:
    """Restore L1, run the workload's create, a command in the sandbox and its destroy: what
    happened and how long it took."""
    began = time.monotonic()
    name = f"soak{number}"
    try:
        host.boot("restart" if host.lives else "start")
        booted = time.monotonic()
        made = WORKLOADS[workload](host, name)
        created = time.monotonic()
        if made.returncode != 0:
            return {"round": number, "outcome": "create failed", "detail": made.stderr[-600:]}
        inside = host.run("vmsandbox", "exec", name, "--", "true")
        host.run("vmsandbox", "destroy", name)
        return {
            "round": number,
            "outcome": "ok" if inside.returncode == 0 else "exec failed",
            "l1_start_s": round(booted - began, 1),
            "create_s": round(created - booted, 1),
        }
    except L1Lost as lost:
        return {"round": number, "outcome": "L1 lost", "detail": str(lost)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="create")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    env = nested_env()
    state = Path(env.get("VMSANDBOX_NESTED_DIR", "/var/tmp/vmsandbox-nested"))
    logs = Path(env.get("VMSANDBOX_NESTED_LOG_DIR", "/var/tmp/vmsandbox-nested-logs"))
    host = NestedHost(REPO / "setup" / "nested.sh", env, state, logs)
    host.deadline = float("inf")  # a soak has no module budget
    config = {key: os.environ.get(key, "default") for key in CONFIG_KEYS}
    print(f"configuration: {config}, workload: {args.workload}", flush=True)
    rounds = []
    began = time.monotonic()
    try:
        for number in range(1, args.rounds + 1):
            rounds.append(one_round(host, number, args.workload))
            print(json.dumps(rounds[-1]), flush=True)
    except BudgetExhausted:
        pass
    finally:
        host.stop()
    creates = [r["create_s"] for r in rounds if "create_s" in r]
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(sys.argv),
        "configuration": config,
        "workload": args.workload,
        "l1s_started": len(host.lives),
        "l1s_lost": sum(1 for life in host.lives if life.lost),
        "lost_why": [life.lost for life in host.lives if life.lost],
        "rounds_ok": sum(1 for r in rounds if r["outcome"] == "ok"),
        "rounds": len(rounds),
        "create_s_median": statistics.median(creates) if creates else None,
        "wall_s": round(time.monotonic() - began),
    }
    print(host.summary())
    print(json.dumps({k: v for k, v in result.items() if k != "command"}, indent=2))
    if args.json:
        args.json.write_text(json.dumps({**result, "rounds_detail": rounds}, indent=2) + "\n")


if __name__ == "__main__":
    main()
