"""Suspend and resume: the boot floor, a suspend, a resume until SSH answers, the host memory a
suspended guest holds, and cycles of one sandbox in which a process and a file must survive.

Floor: as fast_start.py's, the image's own kernel booted by QEMU (TCG, 1 vCPU, 1 GiB) into a
busybox initramfs that powers off at once; the mean of one boot before the cycles and one after.

One 1 GiB ``minimal`` sandbox is created (not timed) through the Python API. Before the first
cycle a process started in it counts in its own memory (a shell loop writing its count to
/tmp every 0.2 s), and 1 MiB of random bytes is written to a file and its checksum taken.
Then each cycle:

    suspend_s        ``SandboxManager.suspend``: managed save, QEMU gone
    suspended RSS    the resident memory of the domain's QEMU process while suspended (0 MiB
                     when there is none: the save is on disk, not in memory)
    resume_ssh_s     ``SandboxManager.resume``: restore, SSH answers, clock and seed set
    intact           the process has its PID, its count went on from where it was, and the
                     file has its checksum

The running guest's QEMU RSS is read before the first cycle, for scale.

Then a parked pool (``park = true``) of one 1 GiB ``minimal`` guest is filled through the
Python API (not timed), and:

    parked_rss_mib   the resident memory of the parked guest's QEMU process (0 MiB when there
                     is none)
    parked_claim_s   a claim of it timed as users time it: the ``vmsandbox create --no-refill``
                     process, start to exit (restore, wake, claim, and the CLI's own start,
                     from the package's compiled bytecode as an installed package runs)

Last, on the nested GPU host with two cards of one model (``setup/nested.sh`` with
``VMSANDBOX_NESTED_CARDS=twin``, its own L1 folder /var/tmp/vmsandbox-suspend-nested): a 1-card
sandbox suspended, its card given to another sandbox, and the first resumed onto the other card
(tests/framework/card_handover.py, the step the nested suspend test module runs):

    nested_resumed_elsewhere  the resumed sandbox holds the other card, at its old guest slot
    nested_verified           its in-guest verification passed and its memory (a token in
                              tmpfs, its boot ID) is as it was
    nested_suspend_s, nested_resume_s   the two commands in L1 (L2 runs under KVM in a TCG L1:
                              slow, and not comparable with the figures above)

``--no-nested`` skips it (it needs the ``nested`` image, about 4 minutes).

Targets (issue 40): resume until SSH answers at most 0.5x the floor (medians); every cycle
intact; a claim from the parked pool at most 0.5x the floor, with 0 MiB held while parked; the
nested sandbox resumed on the other card and verified.

Usage: .venv/bin/python bench/suspend.py [--cycles 50] [--no-nested] [--out DIR] [--json FILE]
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import common
import fast_start

RESUME_TARGET = 0.5
MEMORY_MIB = 1024
COUNTER = (
    "setsid sh -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/counter; sleep 0.2; done' "
    "</dev/null >/dev/null 2>&1 & echo $!"
)
PID_DIR = Path("/run/libvirt/qemu")


def qemu_rss_mib(domain: str) -> float:
    """The resident memory of the domain's QEMU process (0.0 when none runs)."""
    try:
        pid = int((PID_DIR / f"{domain}.pid").read_text().strip())
        status = Path(f"/proc/{pid}/status").read_text()
    except (OSError, ValueError):
        return 0.0
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def out(manager: Any, name: str, command: str) -> str:
    result = manager.exec(name, command, timeout=120)
    if result.exit_status != 0:
        raise common.BenchError(f"{command!r} failed in {name}: {result.stderr.strip()}")
    return str(result.stdout.strip())


def cycles(manager: Any, name: str, domain: str, count: int) -> dict[str, Any]:
    """``count`` suspend/resume cycles of sandbox ``name``, each checked."""
    pid = out(manager, name, COUNTER)
    out(manager, name, "head -c 1048576 /dev/urandom > ~/data && sync")
    checksum = out(manager, name, "sha256sum ~/data")
    time.sleep(0.5)
    running_rss = qemu_rss_mib(domain)
    suspend_s, resume_s, rss, saved, intact = [], [], [], [], 0
    counted = int(out(manager, name, "cat /tmp/counter"))
    for number in range(count):
        start = time.perf_counter()
        suspended = manager.suspend(name)
        suspend_s.append(time.perf_counter() - start)
        rss.append(qemu_rss_mib(domain))
        saved.append(suspended.saved_bytes)
        start = time.perf_counter()
        manager.resume(name)
        resume_s.append(time.perf_counter() - start)
        alive = out(manager, name, f"kill -0 {pid} && echo alive") == "alive"
        time.sleep(0.3)
        now = int(out(manager, name, "cat /tmp/counter"))
        same = out(manager, name, "sha256sum ~/data") == checksum
        ok = alive and now > counted and same
        intact += ok
        counted = now
        print(
            f"cycle {number + 1}: suspend {suspend_s[-1]:.2f} s, resume {resume_s[-1]:.2f} s, "
            f"suspended RSS {rss[-1]:.0f} MiB, saved {saved[-1] / 2**20:.0f} MiB, "
            + ("intact" if ok else f"NOT intact (pid {alive}, count {now}, file {same})")
        )
    return {
        "suspend_s": [round(x, 3) for x in suspend_s],
        "resume_ssh_s": [round(x, 3) for x in resume_s],
        "suspended_rss_mib": rss,
        "saved_bytes": saved,
        "running_rss_mib": running_rss,
        "intact": intact,
    }


def parked(folder: Path, state: Path) -> dict[str, float]:
    """A parked pool of one guest: its QEMU RSS while parked, and a claim of it by a
    ``vmsandbox create`` process (start to exit)."""
    from vmsandbox.config import Config
    from vmsandbox.sandbox.manager import SandboxManager

    file = folder / "config.toml"
    file.write_text(
        f'[pool.parked]\nimage = "{common.IMAGE}"\nmemory_mib = {MEMORY_MIB}\n'
        "count = 1\npark = true\n"
    )
    env = {**common.vmsandbox_env(state), "VMSANDBOX_CONFIG": str(file)}
    name = common.name("suspend", "p")
    argv = [sys.executable, "-m", "vmsandbox.cli", "create", name, "--image", common.IMAGE]
    # As an installed package has it (pip compiles it): the command runs from bytecode, not
    # compiling its modules on every start (a checkout with PYTHONDONTWRITEBYTECODE set would).
    common.run([sys.executable, "-m", "compileall", "-q", str(common.REPO / "vmsandbox")])
    with SandboxManager(Config.load(file)) as manager:
        try:
            (guest,) = manager.pool.fill()
            rss = qemu_rss_mib(f"vmsbx-{guest}")
            claim_s = common.timed([*argv, "--no-refill"], env=env)
            if manager.get(name).domain != f"vmsbx-{guest}":
                raise common.BenchError(f"create {name} did not claim parked guest {guest}")
        finally:
            with contextlib.suppress(Exception):
                manager.destroy(name)
            manager.pool.drain()
    print(f"parked guest: RSS {rss:.0f} MiB; a claim by 'vmsandbox create' {claim_s:.2f} s")
    return {"parked_claim_s": round(claim_s, 3), "parked_rss_mib": rss}


def nested() -> dict[str, Any]:
    """A suspended 1-card sandbox resumed onto the other card of the nested host (docstring)."""
    sys.path.insert(0, str(common.REPO / "tests"))
    from framework.card_handover import sandbox_of, suspend_onto_the_other_card
    from framework.nested_host import module_host, nested_env

    state = Path("/var/tmp/vmsandbox-suspend-nested")
    env = nested_env(VMSANDBOX_NESTED_CARDS="twin", VMSANDBOX_NESTED_DIR=str(state))
    hosts = contextlib.contextmanager(module_host)
    logs = state.with_name(f"{state.name}-logs")
    with hosts(common.REPO / "setup" / "nested.sh", env, state, logs, 1800.0) as host:
        run = host.attempt("suspend onto the other card", lambda: suspend_onto_the_other_card(host))
    before, after = sandbox_of(run.create_a), sandbox_of(run.resume)
    slot = [g["guest_address"] for g in before["verification"]["gpus"]]
    elsewhere = (
        [g["bdf"] for g in sandbox_of(run.create_b)["gpus"]] == [g["bdf"] for g in before["gpus"]]
        and {g["bdf"] for g in after["gpus"]}.isdisjoint(g["bdf"] for g in before["gpus"])
        and [g["guest_address"] for g in after["verification"]["gpus"]] == slot
    )
    kept = (
        run.view_before is not None
        and run.view_after is not None
        and run.view_after.token == run.token
        and run.view_after.boot_id == run.view_before.boot_id
    )
    verified = bool(after["verification"]["ok"]) and kept
    print(
        f"nested: card {before['gpus'][0]['bdf']} -> {after['gpus'][0]['bdf']} at guest slot"
        f" {slot[0]}; suspend {run.suspend_s:.1f} s, resume {run.resume_s:.1f} s; verified"
        f" {verified}"
    )
    return {
        "nested_resumed_elsewhere": elsewhere,
        "nested_verified": verified,
        "nested_suspend_s": round(run.suspend_s, 1),
        "nested_resume_s": round(run.resume_s, 1),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = common.arguments(__doc__, rounds=1, warmup=0)
    parser.add_argument("--cycles", type=int, default=50, help="suspend/resume cycles (50)")
    parser.add_argument("--json", type=Path, help="also write the report to this file")
    parser.add_argument("--no-nested", action="store_true", help="skip the nested GPU host")
    args = common.parse_args(parser, argv)
    common.require("qemu-system-x86_64", "qemu-img", "genisoimage", "busybox")
    image = common.IMAGES / common.IMAGE / "current"
    report = common.Report("suspend", args.rounds, args.warmup)
    with (
        common.state_dir("suspend") as state,
        tempfile.TemporaryDirectory(prefix="bench-suspend-") as folder,
    ):
        os.environ.update(common.vmsandbox_env(state))
        from vmsandbox.config import Config
        from vmsandbox.sandbox.manager import SandboxManager
        from vmsandbox.sandbox.spec import SandboxSpec

        initrd = fast_start.floor_initramfs(Path(folder))
        before = fast_start.floor_seconds(image / "vmlinuz", initrd)
        name = common.name("suspend", "s")
        with SandboxManager(Config.load()) as manager:
            try:
                made = manager.create(
                    SandboxSpec(name=name, image=common.IMAGE, memory_mib=MEMORY_MIB)
                )
                found = cycles(manager, name, made.domain, args.cycles)
            finally:
                manager.destroy(name)
        pool = parked(Path(folder), state)
        after = fast_start.floor_seconds(image / "vmlinuz", initrd)
    floor = (before + after) / 2
    figures = {
        "floor_s": round(floor, 3),
        "floors_s": [round(before, 3), round(after, 3)],
        "suspend_s": round(statistics.median(found["suspend_s"]), 3),
        "resume_ssh_s": round(statistics.median(found["resume_ssh_s"]), 3),
        "resume_over_floor": round(statistics.median(found["resume_ssh_s"]) / floor, 3),
        "suspended_rss_mib": max(found["suspended_rss_mib"]),
        "running_rss_mib": found["running_rss_mib"],
        "saved_mib": round(statistics.median(found["saved_bytes"]) / 2**20, 1),
        "parked_claim_s": pool["parked_claim_s"],
        "parked_claim_over_floor": round(pool["parked_claim_s"] / floor, 3),
        "parked_rss_mib": pool["parked_rss_mib"],
        "cycles": args.cycles,
        "cycles_intact": found["intact"],
    }
    if not args.no_nested:
        figures.update(nested())
    series = [
        common.Series("boot floor", [before, after]),
        common.Series("suspend (managed save)", found["suspend_s"]),
        common.Series("resume until SSH answers, clock set", found["resume_ssh_s"]),
    ]
    report.extra.update(
        series=[s.to_dict() for s in series], figures=figures, per_cycle=found, **figures
    )
    report.checks += [
        common.at_most("resume until SSH / floor", figures["resume_over_floor"], 0.5, "x"),
        common.at_most("cycles not intact", args.cycles - found["intact"], 0, ""),
        common.at_most("parked claim / floor", figures["parked_claim_over_floor"], 0.5, "x"),
        common.at_most("parked guest's QEMU RSS", figures["parked_rss_mib"], 0, " MiB"),
    ]
    if not args.no_nested:
        failed = not (figures["nested_resumed_elsewhere"] and figures["nested_verified"])
        report.checks.append(
            common.at_most("nested: not resumed on the other card and verified", failed, 0, "")
        )
    rows = [(key, str(value)) for key, value in figures.items()]
    print(common.render(("figure", "value"), rows))
    written = report.write(args.out)
    if args.json:
        args.json.write_text(written.read_text())
        print(f"written to {args.json}")
    print(json.dumps(figures))
    return 0 if all(check.met for check in report.checks) else 1


if __name__ == "__main__":
    sys.exit(common.entry(main))
