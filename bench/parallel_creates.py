"""Four sandboxes at once: four ``vmsandbox create`` processes started together, against the same
four created one after another.

A: four ``vmsandbox create NAME`` processes started at the same moment; timed until the last
returns (each returns once its guest answers SSH). B: four ``vmsandbox create`` in sequence,
timed in total; each sandbox stays up while the next boots, as they would in use. The ratio A/B
says what running creates side by side gains (or loses) on this machine; there is no target.
The time of each parallel create is kept in the report too.

Under TCG on 2 cores one side takes about 4 to 8 minutes, so this benchmark defaults to one
round and no warm-up (``--rounds N --warmup M`` for more).

Usage: .venv/bin/python bench/parallel_creates.py [--rounds 1] [--warmup 0] [--count 4]
       [--out DIR]
"""

from __future__ import annotations

import contextlib
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

import common

BOOT_TIMEOUT_S = 1800.0
POLL_S = 0.05


def create_all(argvs: Sequence[Sequence[str]], env: dict[str, str]) -> list[float]:
    """Start every command at once, wait for all; the seconds each took. Raise if any failed."""
    with contextlib.ExitStack() as stack:
        logs = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in argvs]
        start = time.perf_counter()
        procs = [
            subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=log,
                env=env,
            )
            for argv, log in zip(argvs, logs, strict=True)
        ]
        took = [0.0] * len(procs)
        pending = set(range(len(procs)))
        try:
            while pending:
                elapsed = time.perf_counter() - start
                if elapsed > BOOT_TIMEOUT_S:
                    raise common.BenchError(f"creates still running after {elapsed:.0f}s")
                for index in [index for index in pending if procs[index].poll() is not None]:
                    took[index] = elapsed
                    pending.discard(index)
                time.sleep(POLL_S)
        except BaseException:
            for proc in procs:
                common.reap(proc)
            raise
        errors = []
        for proc, log in zip(procs, logs, strict=True):
            if proc.returncode:
                log.seek(0)
                errors.append(f"{shlex.join(proc.args)} exited {proc.returncode}: {log.read()}")
    if errors:
        raise common.BenchError("\n".join(errors))
    return took


def main(argv: Sequence[str] | None = None) -> int:
    parser = common.arguments(__doc__, rounds=1, warmup=0)
    parser.add_argument("--count", type=int, default=4, help="sandboxes per side (4)")
    args = common.parse_args(parser, argv)
    report = common.Report("parallel_creates", args.rounds, args.warmup)
    each: list[list[float]] = []
    with common.state_dir("pc") as state, common.Cleanup() as cleanup:
        env = common.vmsandbox_env(state)

        def commands(tag: str) -> list[list[str]]:
            names = [common.name("pc", f"{tag}-{index}") for index in range(args.count)]

            def remove() -> None:
                for name in names:
                    common.destroy_sandbox(name, env)

            cleanup.add(tag, remove)
            timeout = ["--timeout", str(BOOT_TIMEOUT_S)]
            return [[common.VMSANDBOX, "create", name, *timeout] for name in names]

        def parallel(tag: str) -> float:
            took = create_all(commands(tag), env)
            each.append(took)
            return max(took)

        def sequential(tag: str) -> float:
            return sum(
                common.timed(argv, env=env, timeout=BOOT_TIMEOUT_S) for argv in commands(tag)
            )

        print(f"{args.count} creates at once against {args.count} in sequence", flush=True)
        comparison = common.alternate(
            f"{args.count} sandboxes until all answer SSH",
            (f"{args.count} x vmsandbox create at once", parallel),
            (f"{args.count} x vmsandbox create in sequence", sequential),
            rounds=args.rounds,
            warmup=args.warmup,
            after=cleanup.now,
        )
    report.comparisons.append(comparison)
    report.extra["parallel_each_s"] = each[args.warmup :]
    report.checks.append(
        common.Check("at once / in sequence, median ratio", comparison.median_ratio, "x", "-", None)
    )
    report.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(common.entry(main))
