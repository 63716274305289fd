"""Time to remove a running sandbox: ``vmsandbox destroy`` against virsh and rm.

Before each side (untimed) a sandbox is made with ``vmsandbox create NAME --no-wait``, so both
sides remove the same kind of guest at the same stage of its boot.

A: ``vmsandbox destroy NAME`` as a whole process (stops the domain, undefines it with its NVRAM
and removes overlay, seed, keys and console log).

B: what a user runs by hand, as one shell process: ``virsh destroy``, ``virsh undefine --nvram``
and ``rm`` of the overlay and seed. What it leaves (keys, console log) is removed afterwards,
untimed.

Targets: A under 1 s (median) and A/B at most 1.5 (median ratio). For scale, each round also
times ``virsh destroy`` alone (libvirt stopping QEMU), the floor under both sides.

Usage: .venv/bin/python bench/destroy.py [--rounds 5] [--warmup 1] [--out DIR]
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence

import common

TARGET_S = 1.0
TARGET_RATIO = 1.5


def main(argv: Sequence[str] | None = None) -> int:
    args = common.parse_args(common.arguments(__doc__), argv)
    common.require("virsh")
    report = common.Report("destroy", args.rounds, args.warmup)
    with common.state_dir("de") as state, common.Cleanup() as cleanup:
        env = common.vmsandbox_env(state)

        def create(tag: str) -> str:
            name = common.name("de", tag)
            cleanup.add(tag, lambda: common.destroy_sandbox(name, env))
            common.run([common.VMSANDBOX, "create", name, "--no-wait"], env=env)
            return name

        def vmsandbox(tag: str) -> float:
            return common.timed([common.VMSANDBOX, "destroy", create(tag)], env=env)

        def by_hand(tag: str) -> float:
            name = create(tag)
            virsh = "virsh -q -c qemu:///system"
            domain = shlex.quote(f"vmsbx-{name}")
            disks = [state / "disks" / f"{name}{end}" for end in (".qcow2", "-seed.iso")]
            script = (
                f"{virsh} destroy {domain} && {virsh} undefine {domain} --nvram && "
                f"rm -f {shlex.join(map(str, disks))}"
            )
            return common.timed(["bash", "-c", script])

        def floor(tag: str) -> float:
            domain = f"vmsbx-{create(tag)}"
            return common.timed(["virsh", "-q", "-c", "qemu:///system", "destroy", domain])

        print("vmsandbox destroy against virsh destroy + undefine --nvram + rm", flush=True)
        comparison = common.alternate(
            "destroy a running sandbox",
            ("vmsandbox destroy", vmsandbox),
            ("virsh destroy + virsh undefine --nvram + rm", by_hand),
            ("floor: virsh destroy alone", floor),
            rounds=args.rounds,
            warmup=args.warmup,
            after=cleanup.now,
        )
    report.comparisons.append(comparison)
    report.checks += [
        common.at_most("vmsandbox destroy, median", comparison.a.median, TARGET_S, "s"),
        common.at_most(
            "vmsandbox destroy / by hand, median ratio", comparison.median_ratio, TARGET_RATIO, "x"
        ),
    ]
    report.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(common.entry(main))
