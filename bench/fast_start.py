"""Fast start: the boot floor, a cold create and a pool hit, measured in one run.

Floor: the sandbox image's own kernel booted by QEMU (TCG, 1 vCPU, 1 GiB, as a sandbox) into a
busybox initramfs whose /init powers the machine off at once: the least any guest of that
kernel can take. The initramfs is built here from the host's busybox-static.

Cold: ``vmsandbox create NAME`` as a whole process, in a state directory without a pool. Its
console log is watched while it runs, which splits the boot into stages (host time from the
start of the process to the first line of each), and once it is ready ``systemd-analyze`` in
the guest gives the kernel/userspace split, the slowest units and the critical chain to sshd.

Pool hit: ``vmsandbox create NAME --no-refill`` as a whole process, in a state directory whose
``[pool]`` holds one guest of the create's shape, filled beforehand (not timed).

Targets (issue 15): cold at most 6x the floor, a pool hit at most 0.5x the floor.

Usage: .venv/bin/python bench/fast_start.py [--rounds 1] [--warmup 0] [--out DIR]
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import common

BOOT_TIMEOUT_S = 900.0
COLD_TARGET = 6.0
HIT_TARGET = 0.5
# First console line of each stage of a cold boot, in boot order.
STAGES = (
    ("kernel started", re.compile(rb"Linux version")),
    ("initramfs /init runs", re.compile(rb"Run /init as init process")),
    ("systemd started", re.compile(rb"systemd\[1\]|Welcome to")),
    # cloud-init in stock images, vmsandbox's first-boot unit in the project's own
    ("seed reader started", re.compile(rb"[Cc]loud-init|vmsandbox-firstboot")),
    ("sshd started", re.compile(rb"Started (?:\x1b\[[0-9;]*m)?ssh\.service")),
)
POLL_S = 0.05


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


class StageWatch:
    """Host seconds, from the start, to the first console line of each stage."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seen: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._start = 0.0

    def __enter__(self) -> StageWatch:
        self._start = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        while not self._stop.is_set():
            text = self.path.read_bytes() if self.path.exists() else b""
            for stage, pattern in STAGES:
                if stage not in self.seen and pattern.search(text):
                    self.seen[stage] = time.perf_counter() - self._start
            time.sleep(POLL_S)


def cold(state: Path, env: dict[str, str], tag: str) -> tuple[float, dict[str, float], dict]:
    """One cold create: its seconds, the stages seen on its console, systemd-analyze's view."""
    name = common.name("fs", tag)
    console = state / "sandboxes" / f"{name}.console.log"
    argv = [common.VMSANDBOX, "create", name, "--timeout", str(BOOT_TIMEOUT_S)]
    try:
        with StageWatch(console) as watch:
            seconds = common.timed(argv, env=env, timeout=BOOT_TIMEOUT_S + 60)
        analyze = {}
        for key, command in (
            # once startup has finished: systemd-analyze refuses before that
            ("time", "systemctl is-system-running --wait >/dev/null; systemd-analyze time"),
            ("blame", "systemd-analyze blame --no-pager | head -n 12"),
            ("critical_chain", "systemd-analyze critical-chain --no-pager ssh.service"),
        ):
            exec_argv = [common.VMSANDBOX, "exec", name, "--", "sh", "-c", command]
            done = common.run(exec_argv, env=env, ok=(0, 1))
            analyze[key] = (done.stdout + done.stderr).strip()
    finally:
        common.destroy_sandbox(name, env)
    return seconds, {**watch.seen, "SSH ready (create returned)": seconds}, analyze


def pool_hit(env: dict[str, str], tag: str) -> tuple[float, float | None]:
    """Fill the pool (not timed), then one create that claims its guest."""
    common.run([common.VMSANDBOX, "pool", "fill"], env=env, timeout=BOOT_TIMEOUT_S + 60)
    name = common.name("fs", tag)
    argv = [common.VMSANDBOX, "--json", "create", name, "--no-refill"]
    try:
        start = time.perf_counter()
        done = common.run(argv, env=env, timeout=300)
        seconds = time.perf_counter() - start
        created = json.loads(done.stdout)
        if not created["domain"].startswith("vmsbx-pool-"):
            raise common.BenchError(f"the create did not claim a pooled guest: {created}")
        return seconds, created.get("boot_seconds")
    finally:
        common.destroy_sandbox(name, env)


def main(argv: Sequence[str] | None = None) -> int:
    args = common.parse_args(common.arguments(__doc__, rounds=1, warmup=0), argv)
    common.require("qemu-system-x86_64", "qemu-img", "genisoimage")
    report = common.Report("fast_start", args.rounds, args.warmup)
    image = common.IMAGES / common.IMAGE / "current"
    floor, cold_s, hit_s, claim_s = [], [], [], []
    stages: list[dict[str, float]] = []
    analyzes: list[dict] = []
    with (
        common.state_dir("fs-cold") as cold_state,
        common.state_dir("fs-pool") as pool_state,
        tempfile.TemporaryDirectory(prefix="bench-fs-") as folder,
        common.Cleanup() as cleanup,
    ):
        initrd = floor_initramfs(Path(folder))
        (pool_state / "config.toml").write_text(f"[pool]\n{common.IMAGE} = 1\n")
        cold_env = common.vmsandbox_env(cold_state)
        pool_env = {
            **common.vmsandbox_env(pool_state),
            "VMSANDBOX_CONFIG": str(pool_state / "config.toml"),
        }
        cleanup.add("pool", lambda: common.run([common.VMSANDBOX, "pool", "drain"], env=pool_env))
        for round_no in range(args.warmup + args.rounds):
            counted = round_no >= args.warmup
            tag = f"r{round_no}"
            f = floor_seconds(image / "vmlinuz", initrd)
            c, seen, analyze = cold(cold_state, cold_env, f"c{tag}")
            h, claim = pool_hit(pool_env, f"h{tag}")
            print(f"round {round_no}: floor {f:.2f} s, cold {c:.2f} s, pool hit {h:.2f} s")
            if counted:
                floor.append(f)
                cold_s.append(c)
                hit_s.append(h)
                claim_s.append(claim or 0.0)
                stages.append(seen)
                analyzes.append(analyze)
    series = [
        common.Series("boot floor (kernel + busybox initramfs, powers off)", floor),
        common.Series("cold create -> SSH ready", cold_s),
        common.Series("pool hit: create -> SSH ready (whole CLI process)", hit_s),
        common.Series("pool hit: the claim's hostname step (channel + key proof, or SSH)", claim_s),
    ]
    median_floor = series[0].median
    report.checks += [
        common.at_most("cold / floor", series[1].median / median_floor, COLD_TARGET, "x"),
        common.at_most("pool hit / floor", series[2].median / median_floor, HIT_TARGET, "x"),
    ]
    report.extra.update(
        series=[s.to_dict() for s in series],
        cold_stages=stages,
        systemd_analyze=analyzes,
    )
    rows = [(s.label, common.fmt(s.median, "s")) for s in series]
    rows += [(f"cold: {stage}", common.fmt(at, "s")) for stage, at in stages[-1].items()]
    print(common.render(("measurement (median; stages: last round)", "seconds"), rows))
    report.write(args.out)
    if analyzes:
        print(analyzes[-1].get("time", ""))
        print(analyzes[-1].get("critical_chain", ""))
    return 0 if all(check.met for check in report.checks) else 1


if __name__ == "__main__":
    sys.exit(common.entry(main))
