"""GPU sandboxes on the nested GPU host: a cold ``create --gpu 1`` against a pooled claim.

Cold: ``vmsandbox create NAME --gpu 1 --memory 512`` inside L1, a whole process, to ready
(L2 boots under KVM in L1 with the card passed at boot, SSH, in-guest verification).

Pooled claim: the same command with ``--no-refill`` once L1's ``[pool]`` holds one GPU-ready
guest of that shape (two spare root ports), filled beforehand and not timed: the card is
attached to the running guest, seen in its sysfs and verified.

Both are timed inside L1 (the SSH hop into L1 is not counted), in the same run, each followed
by a destroy that must give the card back to its host driver. Target (issue 18): the claim at
most a quarter of the cold create.

Needs a running nested host (``setup/nested.sh start``; VMSANDBOX_NESTED_DIR as for it).
L1's config file gets the pool's shape for the run and is put back after.

Usage: .venv/bin/python bench/gpu_claim.py [--rounds 1] [--warmup 0] [--out DIR]
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import common

NESTED = common.REPO / "setup" / "nested.sh"
TARGET = 0.25
CONFIG = "/etc/vmsandbox/config.toml"
SHAPE = '\n[pool.gpu]\nimage = "minimal"\nmemory_mib = 512\ncount = 1\ngpus = 2\n'
# The boot wait of the nested host's tests: an L2 takes 1-2 minutes here, more under load.
CREATE = ("--gpu", "1", "--memory", "512", "--timeout", "900")
TIMEOUT_S = 1200.0  # per command in L1
# Inside L1: the command's wall time in ms on the last line of stdout, after its own output.
TIMED = (
    's=$(date +%s%N); "$@"; rc=$?; e=$(date +%s%N); echo "ms $(( (e - s) / 1000000 ))"; exit $rc'
)


def inside(*argv: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` in L1 (setup/nested.sh exec); BenchError when it fails."""
    done = subprocess.run(
        ["bash", str(NESTED), "exec", "--", *argv],
        input=stdin,
        stdin=None if stdin is not None else subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        raise common.BenchError(f"{' '.join(argv)} failed in L1: {done.stderr[-2000:]}")
    return done


def timed_create(name: str, *extra: str) -> tuple[float, dict[str, Any]]:
    """Seconds a ``vmsandbox --json create`` took in L1, and the sandbox it made."""
    argv = ("vmsandbox", "--json", "create", name, *CREATE, *extra)
    done = inside("sh", "-c", TIMED, "sh", *argv)
    *output, last = done.stdout.strip().splitlines()
    return int(last.removeprefix("ms ")) / 1000, json.loads("\n".join(output))


def drivers() -> dict[str, str | None]:
    """BDF -> host driver of each GPU in L1."""
    gpus = json.loads(inside("vmsandbox", "--json", "gpus").stdout)["gpus"]
    return {gpu["bdf"]: gpu["driver"] for gpu in gpus}


def destroy(name: str, before: dict[str, str | None]) -> None:
    """Destroy the sandbox; BenchError unless every card is back on its driver of ``before``."""
    inside("vmsandbox", "destroy", name)
    after = drivers()
    if after != before:
        raise common.BenchError(f"GPU drivers after destroying {name}: {after}, before: {before}")


def main(argv: Sequence[str] | None = None) -> int:
    args = common.parse_args(common.arguments(__doc__, rounds=1, warmup=0), argv)
    report = common.Report("gpu_claim", args.rounds, args.warmup)
    original = inside("cat", CONFIG).stdout
    cold_s, claim_s = [], []
    before = drivers()
    try:
        inside("sh", "-c", f"cat > {CONFIG}", stdin=original + SHAPE)
        for round_no in range(args.warmup + args.rounds):
            tag = f"r{round_no}-{common.RUN}"
            cold, sandbox = timed_create(f"bench-cold-{tag}")
            destroy(sandbox["name"], before)
            inside("vmsandbox", "pool", "fill")
            claim, claimed = timed_create(f"bench-claim-{tag}", "--no-refill")
            if not claimed["domain"].startswith("vmsbx-pool-"):
                raise common.BenchError(f"the create did not claim a pooled guest: {claimed}")
            destroy(claimed["name"], before)
            print(f"round {round_no}: cold {cold:.2f} s, pooled claim {claim:.2f} s")
            if round_no >= args.warmup:
                cold_s.append(cold)
                claim_s.append(claim)
    finally:
        subprocess.run(
            ["bash", str(NESTED), "exec", "--", "vmsandbox", "pool", "drain"],
            capture_output=True,
            timeout=TIMEOUT_S,
            check=False,
        )
        inside("sh", "-c", f"cat > {CONFIG}", stdin=original)
    series = [
        common.Series("cold create --gpu 1 -> ready (verified)", cold_s),
        common.Series("pooled claim --gpu 1 -> ready (attached, seen, verified)", claim_s),
    ]
    ratio = series[1].median / series[0].median
    report.checks.append(common.at_most("claim / cold", ratio, TARGET, "x"))
    report.extra.update(series=[s.to_dict() for s in series])
    rows = [(s.label, common.fmt(s.median, "s")) for s in series]
    print(common.render(("measurement (median)", "seconds"), rows))
    report.write(args.out)
    return 0 if all(check.met for check in report.checks) else 1


if __name__ == "__main__":
    sys.exit(common.entry(main))
