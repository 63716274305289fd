"""How often the nested GPU host loses an L1, for one L1 configuration.

Each round starts a pristine L1 (restored from the snapshot of the first boot), creates a sandbox
holding both emulated cards (its L2 runs under KVM inside the TCG L1), runs a command in it and
destroys it, watched as the test module watches it (tests/nested_host.py: console, heartbeat,
crawl). It prints one line per round and a summary, and writes JSON with ``--json FILE``.

The configuration is setup/nested.sh's environment, for example::

    VMSANDBOX_NESTED_TCG_THREAD=single bench/nested_soak.py --rounds 20 --json single.json

Needs root, libvirtd and the images (``make setup``); runs for several minutes per round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from nested_host import BudgetExhausted, L1Lost, NestedHost  # noqa: E402

CONFIG_KEYS = (
    "VMSANDBOX_NESTED_CPU",
    "VMSANDBOX_NESTED_TCG_THREAD",
    "VMSANDBOX_NESTED_CPUS",
    "VMSANDBOX_NESTED_MEMORY_MIB",
)


def one_round(host: NestedHost, number: int) -> dict[str, object]:
    """Restore L1, create and destroy a two-GPU sandbox: what happened and how long it took."""
    began = time.monotonic()
    name = f"soak{number}"
    try:
        host.boot("restart" if host.lives else "start")
        booted = time.monotonic()
        create = host.run(
            "vmsandbox", "create", name, "--gpu", "2", "--memory", "512", "--timeout", "420",
            limit=600,
        )  # fmt: skip
        created = time.monotonic()
        if create.returncode != 0:
            return {"round": number, "outcome": "create failed", "detail": create.stderr[-600:]}
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
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(REPO)}
    state = Path(env.get("VMSANDBOX_NESTED_DIR", "/var/tmp/vmsandbox-nested"))
    logs = Path(env.get("VMSANDBOX_NESTED_LOG_DIR", "/var/tmp/vmsandbox-nested-logs"))
    host = NestedHost(REPO / "setup" / "nested.sh", env, state, logs)
    host.deadline = float("inf")  # a soak has no module budget
    config = {key: os.environ.get(key, "default") for key in CONFIG_KEYS}
    print(f"configuration: {config}", flush=True)
    rounds = []
    began = time.monotonic()
    try:
        for number in range(1, args.rounds + 1):
            rounds.append(one_round(host, number))
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
