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

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

from allocation import double_allocations, most_held  # noqa: E402
from fast_start import floor_initramfs, floor_seconds  # noqa: E402


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


@pytest.mark.libvirt
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


@pytest.mark.e2e
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
