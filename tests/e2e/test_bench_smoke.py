"""Smoke tests of the benchmarks in bench/: the fast ones run one round and write their report.

No timing assertions: the figures depend on the machine. The boot-heavy benchmarks
(create_overhead, ssh_ready, parallel_creates) take minutes under TCG and are left to
``make bench``; destroy, the quickest of them, runs once as an e2e test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from framework.paths import REPO

BENCH = REPO / "bench"
sys.path.insert(0, str(BENCH))

from allocation import double_allocations, most_held  # noqa: E402
from fast_start import STAGES, ConsoleClock, floor_initramfs, floor_seconds, markdown  # noqa: E402


def run_bench(script: str, out: Path, *args: str) -> dict[str, Any]:
    """Run ``bench/<script>`` with one round and no warm-up; return its JSON report."""
    done = subprocess.run(
        [
            sys.executable,
            str(BENCH / script),
            "--rounds",
            "1",
            "--warmup",
            "0",
            "--out",
            str(out),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "written to" in done.stdout
    return json.loads((out / script.replace(".py", ".json")).read_text())


def domains() -> list[str]:
    listed = subprocess.run(
        ["virsh", "-q", "-c", "qemu:///system", "list", "--all", "--name"],
        capture_output=True,
        text=True,
        check=True,
    )
    return listed.stdout.split()


def test_cli_startup_compares_both_commands_with_virsh(tmp_path: Path) -> None:
    report = run_bench("cli_startup.py", tmp_path)
    assert [c["name"] for c in report["comparisons"]] == ["vmsandbox --help", "vmsandbox list"]
    for comparison in report["comparisons"]:
        assert len(comparison["a"]["samples"]) == len(comparison["b"]["samples"]) == 1
        assert comparison["b"]["label"].startswith("virsh")
    assert [c["target"] for c in report["checks"]] == ["<= 150 ms", "<= 250 ms"]
    assert report["machine"]["cpus"] >= 1
    assert report["command"] == (
        f".venv/bin/python bench/cli_startup.py --rounds 1 --warmup 0 --out {tmp_path}"
    )


def test_allocation_finds_no_double_allocation_and_leaves_no_domain(tmp_path: Path) -> None:
    report = run_bench("allocation.py", tmp_path, "--procs", "2", "--rounds", "3")
    assert report["double_allocations"] == []
    assert report["counted_rounds"] == 6
    assert len(report["worker_pids"]) == 2
    prefixes = tuple(f"bench-alloc-{pid}-" for pid in report["worker_pids"])
    assert [name for name in domains() if name.startswith(prefixes)] == []


def _hold(domain: str, start: float, end: float, bdf: str = "0000:18:00.0") -> dict[str, Any]:
    return {"domain": domain, "bdfs": [bdf], "start": start, "end": end}


def test_overlapping_holds_of_one_gpu_are_double_allocations() -> None:
    holds = [
        _hold("a", 0, 10),
        _hold("b", 2, 3),  # inside a
        _hold("c", 5, 11),  # overlaps a
        _hold("d", 11, 12),  # starts as c ends: fine
        _hold("e", 0, 12, bdf="0000:19:00.0"),  # another GPU: fine
    ]
    assert double_allocations(holds) == [
        {"bdf": "0000:18:00.0", "first": "a", "second": "b"},
        {"bdf": "0000:18:00.0", "first": "a", "second": "c"},
    ]
    assert most_held(holds) == 3


def test_inventory_bench_measures_on_the_fake_host(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(BENCH / "bench_inventory.py"),
            "--rounds",
            "1",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    # 1: a target missed on a busy machine; the report is written either way
    assert done.returncode in (0, 1), done.stdout + done.stderr
    report = json.loads((tmp_path / "inventory.json").read_text())
    assert report["gpus"] == 8
    assert [len(result["samples_ms"]) for result in report["results"]] == [1, 1, 1]
    assert report["command"].endswith(f"bench/bench_inventory.py --rounds 1 --out {tmp_path}")
    assert report["machine"]["cpus"] >= 1 and report["when"].endswith("Z")


def test_destroy_bench_runs_and_cleans_up(tmp_path: Path) -> None:
    report = run_bench("destroy.py", tmp_path)
    [comparison] = report["comparisons"]
    assert len(comparison["ratios"]) == 1
    assert [name for name in domains() if name.startswith(f"vmsbx-bench-de-{report['run']}-")] == []


def test_the_boot_floor_initramfs_boots_the_image_kernel_and_powers_off(tmp_path: Path) -> None:
    """fast_start's floor: QEMU exits by itself (a failed /init panics, and panic=-1 with
    -no-reboot ends QEMU too, so the console must show no panic)."""
    kernel = Path(os.environ.get("VMSANDBOX_IMAGE_DIR", "/var/lib/vmsandbox/images"))
    kernel = kernel / "minimal" / "current" / "vmlinuz"
    initrd = floor_initramfs(tmp_path)
    log = tmp_path / "console.log"
    assert floor_seconds(kernel, initrd, console=log) > 0
    text = log.read_text(errors="replace")
    assert "Kernel panic" not in text and "reboot: Power down" in text


def test_fast_start_places_the_guests_clock_on_the_hosts(tmp_path: Path) -> None:
    """The stages of a cold create from its console's "vmsandbox-boot" lines (a console and a
    QEMU PID file of the test's own): they add up to the create's time; a console without
    those lines gives none (the report then has the older images' stages)."""
    console, pid_file = tmp_path / "console.log", tmp_path / "qemu.pid"
    console.write_bytes(b"SeaBIOS (version 1.16.2)\r\n")
    with ConsoleClock(console, pid_file) as clock:
        pid_file.write_text(f"{os.getpid()}\n")  # this process stands in for QEMU
        with console.open("ab") as handle:
            handle.write(b"vmsandbox-boot: initramfs started at 0.50s\r\n")
            handle.write(b"vmsandbox-firstboot: eth0 is up at 10.0.2.15/24\r\n")
            handle.write(b"vmsandbox-boot: systemd starting at 0.70s\r\n")
            handle.write(b"vmsandbox-boot: sshd is up at 1.50s\r\n")
        ended = clock.started + 3.0
    stages = clock.stages(ended)
    assert list(stages) == list(STAGES)
    assert (stages["kernel"], stages["initramfs"], stages["userspace until sshd"]) == (
        0.5,
        0.2,
        0.8,
    )
    assert abs(sum(stages.values()) - 3.0) < 0.01
    assert clock.marks["sshd is up"][0] == 1.5
    # systemd's own time of sshd's start, where the bench could read it, comes first
    assert clock.stages(ended, sshd=1.25)["userspace until sshd"] == 0.55
    bare = tmp_path / "bare.log"
    bare.write_bytes(b"[    0.000000] Linux version 6.1.0\r\n")
    with ConsoleClock(bare, pid_file) as old:
        pass
    assert old.stages(old.started + 1.0) == {}
    assert list(old.legacy_stages(old.started + 1.0)) == [
        "kernel started",
        "SSH ready (create returned)",
    ]


def test_fast_start_writes_its_report_as_the_performance_pages_section() -> None:
    stages = {stage: 0.5 for stage in STAGES}
    report = {
        "rounds": 2,
        "when": "2026-01-01T00:00:00Z",
        "machine": {"cpus": 2, "cpu_model": "EPYC", "qemu": "QEMU 7.2", "load_average": [1.5]},
        "checks": [
            {"figure": "cold / floor", "value": 2.9, "target": "<= 3.00x", "met": True},
            {"figure": "pool hit / floor", "value": 0.25, "target": "<= 0.20x", "met": False},
        ],
        "summary": {
            "floor": {"mean": 1.6, "per_round": [1.5, 1.7]},
            "cold": {"mean": 4.6, "ratio_per_round": [3.0, 2.8], "stages_mean": stages},
            "hit": {"mean": 0.4, "ratio_per_round": [0.26, 0.24], "stages_mean": {"claim": 0.1}},
        },
    }
    page = markdown(report)
    assert "| boot floor, each round | 1.50 s, 1.70 s | - | - |" in page
    assert "each round: 3.00x, 2.80x | **2.90x** (mean) | <= 3.00x | met |" in page
    assert "| <= 0.20x | **missed** |" in page
    assert "| userspace until sshd | 0.500 |" in page and "| claim | 0.100 |" in page


def test_lock_load_times_every_kind_of_call_and_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "lock_load.json"
    done = subprocess.run(
        [
            *(sys.executable, str(BENCH / "lock_load.py")),
            *("--clients", "3", "--seconds", "8", "--domains", "3", "--json", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert {"create", "destroy", "claim", "fill"} <= set(report["calls"])
    assert report["calls"]["create"]["count"] > 0
    assert report["lock"]["wait"]["count"] > 0 and report["lock"]["hold"]["count"] > 0
    assert (
        report["checks"][0]["figure"].startswith("calls that timed out")
        and report["checks"][0]["met"]
    )
    ours = f"vmsbx-bench-lock-{report['run']}-"
    assert [name for name in domains() if name.startswith(ours)] == []
