"""Copying a large file into and out of a sandbox: ``vmsandbox cp`` against plain ``scp`` with the
same key and known hosts (the ssh_config that ``vmsandbox ssh-config`` prints), on one sandbox.

A: ``vmsandbox cp FILE NAME:PATH`` (in) and ``vmsandbox cp NAME:PATH FILE`` (out), each a whole
process (start-up, libvirt lookup and SSH handshake included). B: ``scp -F CONFIG`` the same way.
Rounds alternate A and B; each copy's file is removed (untimed) before the next. The target:
vmsandbox moves at least 0.9x scp's bytes per second, in each direction (its time at most
1/0.9 of scp's). The copies out are compared with the file, byte for byte.

    .venv/bin/python bench/transfer.py [--size-mib 1024] [--rounds 1] [--json FILE]
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import common

TARGET_THROUGHPUT = 0.9  # vmsandbox's bytes per second over scp's, at least
GUEST_FILE = "bench-source.bin"  # in the sandbox user's home: what the copies out read


def make_file(path: Path, size: int) -> str:
    """``size`` random bytes (nothing compresses them) at ``path``; their SHA-256."""
    digest = hashlib.sha256()
    with path.open("wb") as handle:
        left = size
        while left:
            block = os.urandom(min(left, 2**24))
            digest.update(block)
            handle.write(block)
            left -= len(block)
    return digest.hexdigest()


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(2**24):
            digest.update(block)
    return digest.hexdigest()


def main(argv: Sequence[str] | None = None) -> int:
    parser = common.arguments(__doc__, rounds=1, warmup=0)
    parser.add_argument("--size-mib", type=int, default=1024, help="file size (1024 MiB)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the report here")
    args = common.parse_args(parser, argv)
    common.require("scp", "ssh")
    size = args.size_mib * 2**20
    report = common.Report("transfer", args.rounds, args.warmup)
    with common.state_dir("tr") as state, common.Cleanup() as cleanup:
        env = {**common.vmsandbox_env(state), "PYTHONPATH": str(common.REPO)}  # this checkout's
        name = common.name("tr", "box")
        cleanup.add("box", lambda: common.destroy_sandbox(name, env))
        disk_gib = max(8, 4 + 3 * size // 2**30)
        print(f"creating sandbox {name} ({disk_gib} GiB disk)", flush=True)
        common.run(
            [
                common.VMSANDBOX,
                "create",
                name,
                *("--cpus", "2", "--memory", "2G"),
                "--disk",
                f"{disk_gib}G",
            ],
            env=env,
            timeout=900,
        )
        config = state / "ssh_config"
        config.write_text(common.run([common.VMSANDBOX, "ssh-config", name], env=env).stdout)
        source = state / "source.bin"
        print(f"writing {args.size_mib} MiB of random bytes", flush=True)
        expected = make_file(source, size)
        scp = ["scp", "-q", "-F", str(config)]
        common.run([*scp, str(source), f"{name}:{GUEST_FILE}"], timeout=3600)

        def guest_rm(tag: str) -> None:
            common.run([common.VMSANDBOX, "exec", name, "--", "rm", "-f", f"in-{tag}"], env=env)

        def local_rm(tag: str) -> None:
            (state / f"out-{tag}").unlink(missing_ok=True)

        def cp_in(tag: str) -> float:
            argv = [common.VMSANDBOX, "cp", str(source), f"{name}:in-{tag}"]
            return common.timed(argv, env=env, timeout=3600)

        def scp_in(tag: str) -> float:
            return common.timed([*scp, str(source), f"{name}:in-{tag}"], timeout=3600)

        def cp_out(tag: str) -> float:
            target = state / f"out-{tag}"
            argv = [common.VMSANDBOX, "cp", f"{name}:{GUEST_FILE}", str(target)]
            seconds = common.timed(argv, env=env, timeout=3600)
            if sha256(target) != expected:
                raise common.BenchError(f"vmsandbox cp out ({tag}) did not copy the file whole")
            return seconds

        def scp_out(tag: str) -> float:
            target = state / f"out-{tag}"
            seconds = common.timed([*scp, f"{name}:{GUEST_FILE}", str(target)], timeout=3600)
            if sha256(target) != expected:
                raise common.BenchError(f"scp out ({tag}) did not copy the file whole")
            return seconds

        print(f"into the sandbox, {args.size_mib} MiB", flush=True)
        into = common.alternate(
            f"copy {args.size_mib} MiB into a sandbox",
            ("vmsandbox cp", cp_in),
            ("scp", scp_in),
            rounds=args.rounds,
            warmup=args.warmup,
            after=guest_rm,
        )
        print(f"out of the sandbox, {args.size_mib} MiB", flush=True)
        out_of = common.alternate(
            f"copy {args.size_mib} MiB out of a sandbox",
            ("vmsandbox cp", cp_out),
            ("scp", scp_out),
            rounds=args.rounds,
            warmup=args.warmup,
            after=local_rm,
        )
    for comparison, way in ((into, "in"), (out_of, "out")):
        report.comparisons.append(comparison)
        mib_s = {
            side: args.size_mib / series.median
            for side, series in (("a", comparison.a), ("b", comparison.b))
        }
        report.extra[f"mib_per_second_{way}"] = {"vmsandbox": mib_s["a"], "scp": mib_s["b"]}
        ratio = mib_s["a"] / mib_s["b"]
        report.checks.append(
            common.Check(
                f"copy {way}: vmsandbox cp / scp throughput ({mib_s['a']:.1f} / "
                f"{mib_s['b']:.1f} MiB/s)",
                ratio,
                "x",
                f">= {TARGET_THROUGHPUT:.2f}x",
                ratio >= TARGET_THROUGHPUT,
            )
        )
    report.extra["size_mib"] = args.size_mib
    report.write(args.out)
    if args.json:
        args.json.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
        print(f"written to {args.json}")
    return 0 if all(check.met for check in report.checks) else 1


if __name__ == "__main__":
    sys.exit(common.entry(main))
