"""Fast start: the boot floor, a cold create and a pool hit, measured in one run, and where the
time of each goes.

Floor: the sandbox image's own kernel booted by QEMU (TCG, 1 vCPU, 1 GiB, as a sandbox) into a
busybox initramfs whose /init powers the machine off at once: the least any guest of that
kernel can take. The initramfs is built here from the host's busybox-static.

Cold: ``vmsandbox create NAME`` as a whole process, in a state directory without a pool, cut
into stages:

    vmsandbox until QEMU runs   the create's start until its QEMU process starts (/proc)
    firmware                    QEMU's start until the guest kernel's: SeaBIOS, and the kernel
                                and initramfs read in through fw_cfg
    kernel                      the kernel until its initramfs runs
    initramfs                   until it starts systemd (vmsandbox's images apply the seed here)
    userspace until sshd        systemd's start until sshd is up
    vmsandbox until ready       sshd up until the create returns: the SSH wait and first login

The guest's stages are its own clock: vmsandbox's images write "vmsandbox-boot: <event> at
<uptime>s" on its console. The console log is read as it grows, and the lines' arrival places
the guest's clock on the host's. For images without those lines the stages are the host's time
to the first console line of each (older builds), and the stage table says so. Once the
guest is ready, ``systemd-analyze`` in it gives its own view (not timed).

Pool hit: ``vmsandbox --json create NAME --no-refill`` as a whole process, in a state directory
whose ``[pool]`` holds one guest of the create's shape, filled beforehand (not timed). Its
stages are the claim's steps as the create reports them (``stage_seconds``: the host lock's
wait, the claim, the hostname, the ready record), and the rest of the process (Python, imports,
libvirt's connection, the exit).

``--image NAME`` measures another image (``nvidia``: the driver's image, no GPU passed); its
report is ``fast_start_NAME.json``, minimal's ``fast_start.json``.

Targets: cold at most 3x the floor, a pool hit at most 0.2x the floor (the mean of the rounds'
ratios). Each round's floor is the mean of one boot right before its creates and one right
after them: on a machine others share, the load moves within a minute.

Usage: .venv/bin/python bench/fast_start.py [--rounds 1] [--warmup 0] [--image minimal]
                                            [--out DIR] [--json FILE]
       .venv/bin/python bench/fast_start.py --markdown FILE   (a report as a Markdown section)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import common

BOOT_TIMEOUT_S = 900.0
COLD_TARGET = 3.0
HIT_TARGET = 0.2
POLL_S = 0.01
# "vmsandbox-boot: <event> at <uptime>s": the guest's own clock (images/common/lean.sh).
MARK = re.compile(rb"vmsandbox-boot: (?P<event>[^\r\n]+?) at (?P<at>\d+(?:\.\d+)?)s")
INITRAMFS, SYSTEMD, SSHD = "initramfs started", "systemd starting", "sshd is up"
# Images without those lines: the first console line of each stage, in boot order.
LEGACY = (
    ("kernel started", re.compile(rb"Linux version")),
    ("initramfs /init runs", re.compile(rb"Run /init as init process")),
    ("systemd started", re.compile(rb"systemd\[1\]|Welcome to")),
    ("seed reader started", re.compile(rb"[Cc]loud-init|vmsandbox-firstboot")),
    ("sshd started", re.compile(rb"Started (?:\x1b\[[0-9;]*m)?ssh\.service")),
)
STAGES = (
    "vmsandbox until QEMU runs",
    "firmware",
    "kernel",
    "initramfs",
    "userspace until sshd",
    "vmsandbox until ready",
)
PROCESS_REST = "CLI process: Python, imports, libvirt, exit"


def now() -> float:
    """The host's clock of this benchmark: seconds since the host booted, as /proc counts a
    process's start."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def newc(entries: Sequence[tuple[str, int, bytes, int]]) -> bytes:
    """A cpio archive in the kernel's "newc" format: (path, mode, data, rdev) per entry."""
    out = bytearray()
    for ino, (path, mode, data, rdev) in enumerate([*entries, ("TRAILER!!!", 0, b"", 0)], 1):
        name = path.encode() + b"\0"
        fields = (ino, mode, 0, 0, 1, 0, len(data), 0, 0, rdev >> 8, rdev & 0xFF, len(name), 0)
        out += b"070701" + b"".join(f"{value:08X}".encode() for value in fields) + name
        out += b"\0" * (-len(out) % 4) + data + b"\0" * (-len(data) % 4)
    return bytes(out)


def floor_initramfs(folder: Path) -> Path:
    """An initramfs holding busybox-static and an /init that powers off at once."""
    busybox = shutil.which("busybox")
    static = busybox and b"ld-linux" not in Path(busybox).read_bytes()[:4096]
    if not busybox or not static:
        raise common.BenchError("a static busybox is missing: apt-get install busybox-static")
    init = b"#!/bin/busybox sh\n/bin/busybox poweroff -f\n"
    archive = newc(
        [
            ("bin", 0o40755, b"", 0),
            ("dev", 0o40755, b"", 0),
            ("dev/console", 0o20600, b"", (5 << 8) | 1),
            ("bin/busybox", 0o100755, Path(busybox).read_bytes(), 0),
            ("init", 0o100755, init, 0),
        ]
    )
    path = folder / "floor.cpio"
    path.write_bytes(archive)
    return path


def floor_seconds(kernel: Path, initrd: Path, console: Path | None = None) -> float:
    """Seconds of one QEMU process that boots ``kernel`` into ``initrd`` until it powers off
    (``console``: where the serial console goes, to check it did)."""
    serial = f"file:{console}" if console else "null"
    argv = ["qemu-system-x86_64", "-machine", "q35", "-accel", "tcg", "-m", "1024", "-smp", "1"]
    argv += ["-display", "none", "-serial", serial, "-monitor", "none", "-no-reboot"]
    argv += ["-kernel", str(kernel), "-initrd", str(initrd)]
    argv += ["-append", "console=ttyS0 panic=-1" + ("" if console else " quiet")]
    return common.timed(argv, timeout=300)


def process_start(pid_file: Path) -> float | None:
    """When the process of ``pid_file`` started, on the clock of ``now``; None before it has."""
    try:
        pid = int(pid_file.read_text().strip())
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22: start time, in clock ticks
    return ticks / os.sysconf("SC_CLK_TCK")


class ConsoleClock:
    """Follows a booting guest from the host: when its QEMU process started, the guest clock of
    each "vmsandbox-boot" line and when the line arrived, and (older images) when the first line
    of each legacy stage arrived."""

    def __init__(self, console: Path, pid_file: Path) -> None:
        self.console = console
        self.pid_file = pid_file
        self.qemu_started: float | None = None
        self.marks: dict[str, tuple[float, float]] = {}  # event -> (guest clock, host arrival)
        self.legacy: dict[str, float] = {}  # stage -> host arrival
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> ConsoleClock:
        self.started = now()
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._read()

    def _poll(self) -> None:
        while not self._stop.is_set():
            self._read()
            time.sleep(POLL_S)

    def _read(self) -> None:
        arrived = now()
        if self.qemu_started is None:
            self.qemu_started = process_start(self.pid_file)
        text = self.console.read_bytes() if self.console.exists() else b""
        for match in MARK.finditer(text):
            event = match["event"].decode(errors="replace")
            self.marks.setdefault(event, (float(match["at"]), arrived))
        for stage, pattern in LEGACY:
            if stage not in self.legacy and pattern.search(text):
                self.legacy[stage] = arrived

    def stages(self, ended: float, sshd: float | None = None) -> dict[str, float]:
        """Seconds of each stage of STAGES (the create ran from ``started`` to ``ended``; sshd
        was up at ``sshd`` in the guest's clock, else when its console line says); empty when
        the guest wrote no "vmsandbox-boot" lines or QEMU's start was not seen."""
        if sshd is None and SSHD in self.marks:
            sshd = self.marks[SSHD][0]
        if self.qemu_started is None or sshd is None or not {INITRAMFS, SYSTEMD} <= set(self.marks):
            return {}
        # The guest's clock 0 on the host's: each line arrives after it was written, never
        # before, so the earliest estimate is the closest.
        kernel = min(arrived - at for at, arrived in self.marks.values())
        initramfs, systemd = (self.marks[event][0] for event in (INITRAMFS, SYSTEMD))
        values = (
            self.qemu_started - self.started,
            kernel - self.qemu_started,
            initramfs,
            systemd - initramfs,
            sshd - systemd,
            ended - (kernel + sshd),
        )
        return dict(zip(STAGES, (round(value, 3) for value in values), strict=True))

    def legacy_stages(self, ended: float) -> dict[str, float]:
        """Host seconds from the create's start to the first line of each legacy stage."""
        seen = {stage: round(at - self.started, 3) for stage, at in self.legacy.items()}
        return {**seen, "SSH ready (create returned)": round(ended - self.started, 3)}


def cold(state: Path, env: dict[str, str], tag: str, image: str) -> dict[str, Any]:
    """One cold create: its seconds, its stages, and systemd-analyze's view of the guest."""
    name = common.name("fs", tag)
    console = state / "sandboxes" / f"{name}.console.log"
    pid_file = Path("/run/libvirt/qemu") / f"vmsbx-{name}.pid"
    argv = [common.VMSANDBOX, "create", name, "--image", image, "--timeout", str(BOOT_TIMEOUT_S)]
    try:
        with ConsoleClock(console, pid_file) as clock:
            common.run(argv, env=env, timeout=BOOT_TIMEOUT_S + 60)
            ended = now()
        analyze = {}
        for key, command in (
            # once startup has finished: systemd-analyze refuses before that; as root, whose
            # systemctl needs no system bus
            ("time", "sudo -n systemctl is-system-running --wait >/dev/null; systemd-analyze time"),
            ("blame", "systemd-analyze blame --no-pager | head -n 12"),
            ("critical_chain", "systemd-analyze critical-chain --no-pager ssh.service"),
            # systemd's clock (since boot, in microseconds) when sshd said it was ready: the
            # guest's console line says so a process start later, and the SSH wait knocks
            # without waiting for that line
            ("sshd_ready_us", "systemctl show -p ActiveEnterTimestampMonotonic --value ssh"),
        ):
            exec_argv = [common.VMSANDBOX, "exec", name, "--", "sh", "-c", command]
            done = common.run(exec_argv, env=env, ok=(0, 1))
            analyze[key] = (done.stdout + done.stderr).strip()
    finally:
        common.destroy_sandbox(name, env)
    ready_us = analyze.get("sshd_ready_us", "")
    stages = clock.stages(ended, int(ready_us) / 1e6 if ready_us.isdigit() else None)
    return {
        "seconds": round(ended - clock.started, 3),
        "stages": stages,
        "guest_clock": {event: at for event, (at, _arrived) in clock.marks.items()},
        "legacy_stages": {} if stages else clock.legacy_stages(ended),
        "systemd_analyze": analyze,
    }


def pool_hit(env: dict[str, str], tag: str, image: str) -> dict[str, Any]:
    """Fill the pool (not timed), then one create that claims its guest."""
    common.run([common.VMSANDBOX, "pool", "fill"], env=env, timeout=BOOT_TIMEOUT_S + 60)
    name = common.name("fs", tag)
    argv = [common.VMSANDBOX, "--json", "create", name, "--image", image, "--no-refill"]
    try:
        start = time.perf_counter()
        done = common.run(argv, env=env, timeout=300)
        seconds = time.perf_counter() - start
        created = json.loads(done.stdout)
        if not created["domain"].startswith("vmsbx-pool-"):
            raise common.BenchError(f"the create did not claim a pooled guest: {created}")
    finally:
        common.destroy_sandbox(name, env)
    steps = {step: round(value, 3) for step, value in (created.get("stage_seconds") or {}).items()}
    rest = round(seconds - sum(steps.values()), 3)
    return {"seconds": round(seconds, 3), "stages": {**steps, PROCESS_REST: rest}}


def run_rounds(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Warm-up and counted rounds: a floor, a cold create and a pool hit each."""
    image = common.IMAGES / args.image / "current"
    if not (image / "vmlinuz").is_file():
        raise common.BenchError(
            f"no built image {args.image!r} in {common.IMAGES}: vmsandbox images build {args.image}"
        )
    rounds: list[dict[str, Any]] = []
    with (
        common.state_dir("fs-cold") as cold_state,
        common.state_dir("fs-pool") as pool_state,
        tempfile.TemporaryDirectory(prefix="bench-fs-") as folder,
        common.Cleanup() as cleanup,
    ):
        initrd = floor_initramfs(Path(folder))
        (pool_state / "config.toml").write_text(f"[pool]\n{args.image} = 1\n")
        cold_env = common.vmsandbox_env(cold_state)
        pool_env = {
            **common.vmsandbox_env(pool_state),
            "VMSANDBOX_CONFIG": str(pool_state / "config.toml"),
        }
        cleanup.add("pool", lambda: common.run([common.VMSANDBOX, "pool", "drain"], env=pool_env))
        for number in range(args.warmup + args.rounds):
            tag = f"r{number}"
            before = floor_seconds(image / "vmlinuz", initrd)
            made = cold(cold_state, cold_env, f"c{tag}", args.image)
            hit = pool_hit(pool_env, f"h{tag}", args.image)
            after = floor_seconds(image / "vmlinuz", initrd)
            floor = round((before + after) / 2, 3)
            print(
                f"round {number}: floor {floor:.2f} s, cold {made['seconds']:.2f} s "
                f"({made['seconds'] / floor:.2f}x), pool hit {hit['seconds']:.2f} s "
                f"({hit['seconds'] / floor:.2f}x)" + (" (warm-up)" if number < args.warmup else "")
            )
            if number >= args.warmup:
                floors = [round(before, 3), round(after, 3)]
                rounds.append({"floor": floor, "floors": floors, "cold": made, "hit": hit})
    return rounds


def summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each round's figures and ratios, their means, and each stage's mean."""
    floors = [r["floor"] for r in rounds]
    cold_ratios = [r["cold"]["seconds"] / r["floor"] for r in rounds]
    hit_ratios = [r["hit"]["seconds"] / r["floor"] for r in rounds]

    def stage_means(kind: str) -> dict[str, float]:
        names = dict.fromkeys(name for r in rounds for name in r[kind]["stages"])
        return {
            name: round(statistics.mean(r[kind]["stages"].get(name, 0.0) for r in rounds), 3)
            for name in names
        }

    return {
        "floor": {"mean": statistics.mean(floors), "per_round": floors},
        "cold": {
            "mean": statistics.mean(r["cold"]["seconds"] for r in rounds),
            "ratio_mean": statistics.mean(cold_ratios),
            "ratio_per_round": [round(x, 3) for x in cold_ratios],
            "stages_mean": stage_means("cold"),
        },
        "hit": {
            "mean": statistics.mean(r["hit"]["seconds"] for r in rounds),
            "ratio_mean": statistics.mean(hit_ratios),
            "ratio_per_round": [round(x, 3) for x in hit_ratios],
            "stages_mean": stage_means("hit"),
        },
    }


def tables(data: dict[str, Any]) -> str:
    """The figures and the stages (means over the rounds), as plain text tables."""
    s = data["summary"]
    rows = [
        ("boot floor (each round)", ", ".join(f"{f:.2f} s" for f in s["floor"]["per_round"])),
        ("cold create -> SSH ready", f"{s['cold']['mean']:.2f} s"),
        ("cold / floor (each round)", ", ".join(f"{x:.2f}x" for x in s["cold"]["ratio_per_round"])),
        ("pool hit: create -> SSH ready", f"{s['hit']['mean']:.2f} s"),
        (
            "pool hit / floor (each round)",
            ", ".join(f"{x:.2f}x" for x in s["hit"]["ratio_per_round"]),
        ),
    ]
    text = [common.render(("figure (mean over the rounds)", "value"), rows)]
    for kind, title in (("cold", "cold create"), ("hit", "pool hit")):
        stages = s[kind]["stages_mean"]
        if stages:
            rows = [(stage, f"{seconds:.3f} s") for stage, seconds in stages.items()]
            text.append(common.render((f"{title}: stage (mean)", "seconds"), rows))
    legacy = [r["cold"]["legacy_stages"] for r in data["per_round"] if r["cold"]["legacy_stages"]]
    if legacy:
        rows = [(stage, f"{at:.2f} s") for stage, at in legacy[-1].items()]
        header = ("cold create: first console line of (no vmsandbox-boot lines)", "host s")
        text.append(common.render(header, rows))
    return "\n\n".join(text)


def markdown(data: dict[str, Any]) -> str:
    """A report as the performance page's section: the machine, the figures, the stages."""
    s, m = data["summary"], data["machine"]
    lines = [
        f"`bench/fast_start.py --rounds {data['rounds']} --image {data.get('image', 'minimal')}` "
        f"({data['when']}): {m['cpus']} CPUs "
        f"({m['cpu_model']}), {m['qemu']}, load average {m['load_average'][0]} at the end. "
        "Each round boots the floor, then a cold create, then a pool hit.",
        "",
        "| Figure | Value | Target | Verdict |",
        "|---|---|---|---|",
        "| boot floor, each round | "
        + ", ".join(f"{f:.2f} s" for f in s["floor"]["per_round"])
        + " | - | - |",
    ]
    for check, kind in zip(data["checks"], ("cold", "hit"), strict=True):
        label = "cold create -> SSH ready" if kind == "cold" else "pool hit -> SSH ready"
        each = ", ".join(f"{x:.2f}x" for x in s[kind]["ratio_per_round"])
        verdict = "met" if check["met"] else "**missed**"
        lines.append(
            f"| {label} (mean {s[kind]['mean']:.2f} s) / floor, each round: {each} | "
            f"**{check['value']:.2f}x** (mean) | {check['target']} | {verdict} |"
        )
    for kind, title in (("cold", "Cold create"), ("hit", "Pool hit")):
        stages = s[kind]["stages_mean"]
        if stages:
            lines += ["", f"| {title}: stage | Seconds (mean) |", "|---|---|"]
            lines += [f"| {stage} | {seconds:.3f} |" for stage, seconds in stages.items()]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = common.arguments(__doc__, rounds=1, warmup=0)
    parser.add_argument("--json", type=Path, help="also write the report to this file")
    parser.add_argument(
        "--image", default=common.IMAGE, help=f"the image to measure ({common.IMAGE})"
    )
    parser.add_argument(
        "--markdown", type=Path, metavar="FILE", help="print report FILE as Markdown; no run"
    )
    args = common.parse_args(parser, argv)
    if args.markdown:
        print(markdown(json.loads(args.markdown.read_text())), end="")
        return 0
    common.require("qemu-system-x86_64", "qemu-img", "genisoimage")
    bench = "fast_start" if args.image == common.IMAGE else f"fast_start_{args.image}"
    report = common.Report(bench, args.rounds, args.warmup)
    report.extra["image"] = args.image
    rounds = run_rounds(args)
    report.extra.update(per_round=rounds, summary=summary(rounds))
    s = report.extra["summary"]
    report.checks += [
        common.at_most("cold / floor", s["cold"]["ratio_mean"], COLD_TARGET, "x"),
        common.at_most("pool hit / floor", s["hit"]["ratio_mean"], HIT_TARGET, "x"),
    ]
    print(tables(report.extra))
    written = report.write(args.out)
    if args.json:
        args.json.write_text(written.read_text())
        print(f"written to {args.json}")
    analyze = rounds[-1]["cold"]["systemd_analyze"]
    print(analyze.get("time", ""))
    print(analyze.get("critical_chain", ""))
    return 0 if all(check.met for check in report.checks) else 1


if __name__ == "__main__":
    sys.exit(common.entry(main))
