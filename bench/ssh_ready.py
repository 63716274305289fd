"""Time until an agent can log in: ``vmsandbox create`` against ``virsh create`` and an ssh loop.

A: ``vmsandbox create NAME`` as a whole process; it returns once SSH accepts the sandbox's key
with the pinned host key.

B: the same guest started by hand. Untimed first: an overlay, keys and NoCloud seed made with
vmsandbox's own pieces (qemu-img, ``vmsandbox.guest.keys``, ``vmsandbox.guest.seed``) and the
domain XML ``vmsandbox.vm.domain.build_domain_xml`` writes for them, under a new name, UUID and
SSH port.
Timed, as one shell process: ``virsh create FILE``, then ``ssh true`` (BatchMode, the pinned
host key) every 0.1 s until it succeeds. Each try waits up to 5 s for the connection and banner
(ConnectTimeout=5), as vmsandbox's own wait does: with 1 s, ssh gives up on a guest sshd that
TCG makes slow to answer, and the loop can go on for minutes (see ``common.SSH_TRY_S``).

Each side's console log is watched for the line saying sshd has started, which splits its time
into the guest's boot and the client's wait after it (rows "A: ..." and "B: ..." in the table).

Target: A/B at most 1.05 (median ratio): vmsandbox's wait costs next to nothing over a tight
loop. Under TCG a round takes one to two minutes; ``--rounds 1 --warmup 0`` proves it runs.

Usage: .venv/bin/python bench/ssh_ready.py [--rounds 5] [--warmup 1] [--out DIR]
"""

from __future__ import annotations

import contextlib
import re
import shlex
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import common

TARGET_RATIO = 1.05
BOOT_TIMEOUT_S = 900.0
# systemd's line, with the colour codes it writes on a serial console; the project's images boot
# with "quiet" and say it in a line of their own
SSHD_STARTED = re.compile(
    rb"Started (?:\x1b\[[0-9;]*m)?ssh\.service|vmsandbox-boot: sshd is up at "
)
POLL_S = 0.05


class ConsoleWatch:
    """While a side runs: when the guest's console log first says sshd has started."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seen: float | None = None  # seconds from the start of the side
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._start = 0.0

    def __enter__(self) -> ConsoleWatch:
        self._start = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        while not self._stop.wait(POLL_S):
            with contextlib.suppress(OSError):
                if SSHD_STARTED.search(self.path.read_bytes()):
                    self.seen = time.perf_counter() - self._start
                    return


def split_at_sshd(sshd: dict[str, tuple[float | None, float]], rounds: int) -> list[common.Series]:
    """Each side's counted rounds cut in two where its console said sshd started: the guest's
    boot, then how long the client took to get in. Empty when a console never said it."""
    split = []
    for side, label in (("a", "A"), ("b", "B")):
        runs = [sshd[f"{side}{index}"] for index in range(1, rounds + 1)]
        if any(seen is None for seen, _total in runs):
            return []
        split += [
            common.Series(f"{label}: until the console says sshd started", [s for s, _ in runs]),
            common.Series(f"{label}: from there until logged in", [t - s for s, t in runs]),
        ]
    return split


def main(argv: Sequence[str] | None = None) -> int:
    args = common.parse_args(common.arguments(__doc__), argv)
    common.require("virsh", "ssh", "qemu-img", "genisoimage")
    report = common.Report("ssh_ready", args.rounds, args.warmup)
    with (
        common.state_dir("sr") as state,
        common.state_dir("sr-virsh") as folder,
        common.Cleanup() as cleanup,
    ):
        env = common.vmsandbox_env(state)
        sshd: dict[str, tuple[float | None, float]] = {}  # tag -> (sshd started, total)

        def vmsandbox(tag: str) -> float:
            name = common.name("sr", tag)
            cleanup.add(tag, lambda: common.destroy_sandbox(name, env))
            argv = [common.VMSANDBOX, "create", name, "--timeout", str(BOOT_TIMEOUT_S)]
            with ConsoleWatch(state / "sandboxes" / f"{name}.console.log") as watch:
                seconds = common.timed(argv, env=env, timeout=BOOT_TIMEOUT_S + 60)
            sshd[tag] = (watch.seen, seconds)
            return seconds

        def by_hand(tag: str) -> float:
            made = common.hand_made(folder, common.name("sr", tag))
            cleanup.add(tag, lambda: common.remove_hand_made(made))
            script = (
                f"virsh -q -c qemu:///system create {shlex.quote(str(made.xml))} >/dev/null && "
                f"until {shlex.join(made.ssh_argv())} 2>/dev/null; do sleep 0.1; done"
            )
            with ConsoleWatch(made.console_log) as watch:
                seconds = common.timed(["bash", "-c", script], timeout=BOOT_TIMEOUT_S)
            sshd[tag] = (watch.seen, seconds)
            return seconds

        print("vmsandbox create against virsh create + ssh every 0.1 s", flush=True)
        comparison = common.alternate(
            "create until SSH answers",
            ("vmsandbox create", vmsandbox),
            ("virsh create + ssh loop", by_hand),
            rounds=args.rounds,
            warmup=args.warmup,
            after=cleanup.now,
        )
    comparison.refs += split_at_sshd(sshd, args.rounds)
    report.comparisons.append(comparison)
    report.checks.append(
        common.at_most(
            "vmsandbox create / by hand, median ratio", comparison.median_ratio, TARGET_RATIO, "x"
        )
    )
    report.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(common.entry(main))
