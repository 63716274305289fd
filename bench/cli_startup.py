"""How long the vmsandbox CLI takes to answer: ``vmsandbox --help`` and ``vmsandbox list``.

A: ``vmsandbox --help`` and ``vmsandbox list`` (no sandboxes: an empty state directory of this
run's own; libvirt domains are global, but ``list`` shows only vmsandbox's), each a whole
process. B, for scale: ``virsh --help`` and ``virsh list --all``. Targets: ``--help`` under
150 ms and ``list`` under 250 ms (medians). When one is missed, the five packages whose imports
cost the most (``python -X importtime``) are printed with the chain that pulled each in.

Usage: .venv/bin/python bench/cli_startup.py [--rounds 20] [--warmup 1] [--out DIR]
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import common

TARGETS_MS = {"--help": 150.0, "list": 250.0}
BASELINES = {
    "--help": ["virsh", "--help"],
    "list": ["virsh", "-c", "qemu:///system", "list", "--all"],
}
SLOWEST = 5


def slowest_imports(argv: Sequence[str], env: dict[str, str]) -> list[dict[str, Any]]:
    """The ``SLOWEST`` top-level packages a Python command imports, by the self time of all
    their modules (``python -X importtime``), each with the chain that first pulled it in."""
    done = common.run([sys.executable, "-X", "importtime", *argv], env=env)
    entries = []
    for line in done.stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        own, _total, name = line.removeprefix("import time:").split("|")
        name = name[1:]  # the space after the bar; then two spaces per level of nesting
        depth = (len(name) - len(name.lstrip())) // 2
        entries.append((name.strip(), int(own) / 1000, depth))
    # importtime prints a module after the modules it imported: read backwards, an entry's
    # importer is the latest one seen a level up, and a package's first import comes last.
    packages: dict[str, dict[str, Any]] = {}
    chain: list[str] = []
    for module, self_ms, depth in reversed(entries):
        del chain[depth:]
        package = packages.setdefault(
            module.split(".")[0], {"self_ms": 0.0, "modules": 0, "imported_via": "", "depth": 99}
        )
        package["self_ms"] += self_ms
        package["modules"] += 1
        if depth < package["depth"]:
            package["imported_via"], package["depth"] = " > ".join(chain), depth
        chain.append(module)
    ranked = sorted(packages.items(), key=lambda item: -item[1]["self_ms"])[:SLOWEST]
    return [
        {
            "package": name,
            "self_ms": round(p["self_ms"], 1),
            "modules": p["modules"],
            "imported_via": p["imported_via"],
        }
        for name, p in ranked
    ]


def main(argv: Sequence[str] | None = None) -> int:
    args = common.parse_args(common.arguments(__doc__, rounds=20), argv)
    report = common.Report("cli_startup", args.rounds, args.warmup)
    with common.state_dir("cli", parent="/tmp") as state:
        env = common.vmsandbox_env(state)
        for command, target in TARGETS_MS.items():
            mine = [common.VMSANDBOX, command]
            print(f"vmsandbox {command} against {' '.join(BASELINES[command])}", flush=True)
            comparison = common.alternate(
                f"vmsandbox {command}",
                (f"vmsandbox {command}", lambda _tag, argv=mine: common.timed(argv, env=env)),
                (
                    " ".join(BASELINES[command]),
                    lambda _tag, argv=BASELINES[command]: common.timed(argv, env=env),
                ),
                rounds=args.rounds,
                warmup=args.warmup,
                unit="ms",
            )
            report.comparisons.append(comparison)
            check = common.at_most(
                f"vmsandbox {command} (median)", comparison.a.median * 1000, target, "ms"
            )
            report.checks.append(check)
            if not check.met:
                offenders = slowest_imports(mine, env)
                report.extra.setdefault("slowest_imports", {})[command] = offenders
                print(f"slowest imports of vmsandbox {command}, by package:")
                for entry in offenders:
                    via = f", via {entry['imported_via']}" if entry["imported_via"] else ""
                    print(
                        f"  {entry['self_ms']:6.1f} ms  {entry['package']}"
                        f" ({entry['modules']} module{'s' * (entry['modules'] > 1)}{via})"
                    )
    report.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(common.entry(main))
