"""Write docs/performance.md from the JSON reports that the benchmarks in bench/ write.

Every benchmark figure on the page comes from a report in docs/results/, with the date, the
machine and the command of the run that measured it. The page's last section, what ``make`` and
the test suite take, is docs/results/suite.md, timed by hand with ``time``, each row with its
command and date; the page carries it as it is. To refresh the benchmarks, run them with
``--out docs/results`` and then this script:

    .venv/bin/python bench/run_all.py --out docs/results      # or one bench/*.py --out docs/results
    .venv/bin/python docs/gen_performance.py

``--check`` writes nothing and exits 1 when the committed page differs from what the reports
give (tests/unit/test_docs.py runs the same comparison). Standard library only, so any Python 3.11
runs it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parent
RESULTS = DOCS / "results"
PAGE = DOCS / "performance.md"
SUITE = "suite.md"  # in the results folder: the page's last section, timed by hand

# What each benchmark measures, in the order the page shows them; sides A and B as the
# benchmark's own docstring defines them.
ABOUT: dict[str, tuple[str, str]] = {
    "fast_start": (
        "Fast start",
        "A cold `vmsandbox create` to SSH ready, and a pool hit (`create --no-refill` claiming "
        "a pooled guest), against the boot floor: the image's own kernel booted by QEMU "
        "(TCG, 1 vCPU, 1 GiB) into an initramfs that powers off at once.",
    ),
    "fast_start_nvidia": (
        "Fast start, nvidia image",
        "The same as Fast start with the `nvidia` image (the NVIDIA driver, no GPU passed): "
        "`bench/fast_start.py --image nvidia`.",
    ),
    "ssh_ready": (
        "Create until SSH",
        "A: `vmsandbox create`, which returns when SSH takes the sandbox's key. B: `virsh "
        "create` of the domain XML vmsandbox writes (files made beforehand, not timed), then "
        "`ssh true` every 0.1 s.",
    ),
    "create_overhead": (
        "Create to a running domain",
        "A: `vmsandbox create --no-wait`. B: what a user does by hand: `qemu-img` overlay, "
        "`ssh-keygen`, a NoCloud seed with `genisoimage`, `virt-install --import` with the same "
        "kernel, sizes, disks and SSH forward.",
    ),
    "destroy": (
        "Destroy",
        "A: `vmsandbox destroy`. B: `virsh destroy`, `virsh undefine --nvram` and `rm` of the "
        "overlay and seed. The floor both stand on: `virsh destroy` alone.",
    ),
    "parallel_creates": (
        "Parallel creates",
        "Several `vmsandbox create` at once against the same creates one after another, until "
        "all answer SSH.",
    ),
    "cli_startup": (
        "CLI start-up",
        "`vmsandbox --help` and `vmsandbox list` (no sandboxes) as whole processes, with "
        "`virsh --help` and `virsh list --all` for scale.",
    ),
    "inventory": (
        "GPU inventory",
        "`discover()` in process and `vmsandbox gpus --json` as a whole process, on a fake "
        "host of 200 PCI devices with 8 GPUs (umockdev).",
    ),
    "allocation": (
        "Allocation under contention",
        "Processes that each select and define a one-GPU domain under the host lock, hold it, "
        "and undefine it, on a fake HGX host against the real libvirtd; every hold is checked "
        "for a GPU held twice at once.",
    ),
    "lock_load": (
        "The host lock under load",
        "Clients in processes of their own creating GPU sandboxes (defined, not started), "
        "destroying, claiming pooled guests (defined, not booted: the claim's host side) and "
        "reconciling at once, with defined domains that every listing reads, on a fake "
        "64-GPU host (umockdev) against the real libvirtd; every wait for and hold of the host "
        "lock is timed. Count, median, 95th percentile and maximum of each.",
    ),
    "gpu_claim": (
        "GPU claim on the nested GPU host",
        "Inside the nested GPU host: a cold `vmsandbox create --gpu 1` against the same create "
        "claiming a GPU-ready pooled guest (the card attached live), each to ready with the "
        "in-guest verification.",
    ),
    "suspend": (
        "Suspend and resume",
        "One 1 GiB `minimal` sandbox suspended and resumed through the Python API, cycle after "
        "cycle, beside the boot floor of Fast start: a suspend (managed save), a resume until "
        "SSH answers (restore, SSH, the guest's clock and seed set), the resident memory of the "
        "domain's QEMU while suspended, and in each cycle a process started before the first "
        "(its PID and in-memory counter) and a file written before (its checksum) checked; "
        "then a claim from a parked pool by the `vmsandbox create` process, and, in the nested "
        "GPU host with two cards of one model, a 1-card sandbox suspended, its card given to "
        "another sandbox and the first resumed onto the other card, verified from inside.",
    ),
    "fleet": (
        "The fleet under faults",
        "Four fake hosts (36 GPUs) behind one fleet server, 8 clients creating sandboxes of 1 to "
        "8 GPUs and deleting some, while one host's driver is killed (its Ray node alive) and "
        "started again, another host is killed whole and joined again, and the fleet server is "
        "killed and started again; creates and deletes of unknown outcome asked again as a "
        "gateway does. Judged from each host's own records: sandboxes lost, duplicated or left "
        "under way, GPUs held twice, and how long the fleet took to mark each dead host lost. "
        "`bench/fleet.py`, [The fleet](fleet.md).",
    ),
    "gpu_handoff": (
        "GPU hand-offs on the nested GPU host",
        "Inside the nested GPU host: hand-offs of both emulated cards from one tenant's sandbox "
        "to the next (`create --gpu 2`, destroy), each tenant's guest searching its cards' whole "
        "video memory for the last tenant's marker before writing its own; each card's sanitize "
        "between them (a bus reset of its root port, the check that it answers, the scrub hook "
        "that zeroes its VRAM) step by step; one hand-off with `gpu_sanitize = false` (the probe "
        "can fail); one AER error injected at a card's root port until its quarantine.",
    ),
    "transfer": (
        "Copying a large file",
        "A: `vmsandbox cp` of a file of random bytes into a sandbox and out of it, each a whole "
        "process (start-up, libvirt lookup, SSH handshake included). B: plain `scp` with the "
        "same key and known hosts (the ssh_config `vmsandbox ssh-config` prints). The target is "
        "vmsandbox's throughput at least 0.9x scp's each way.",
    ),
}
VERDICTS = {True: "met", False: "missed", None: "-"}


def fmt(value: float, unit: str) -> str:
    """A value in ``unit`` for people: "s", "ms", "x" (a ratio), or a count with its unit."""
    if unit == "ms":
        return f"{value:.0f} ms" if value >= 10 else f"{value:.1f} ms"
    if unit == "s":
        return f"{value:.2f} s"
    if unit == "x":
        return f"{value:.2f}x"
    number = f"{value:.0f}" if float(value).is_integer() else f"{value:.1f}"
    return f"{number} {unit}".rstrip()


def seconds(value: float, unit: str) -> str:
    """Seconds shown in ``unit`` ("s" or "ms")."""
    return fmt(value * 1000 if unit == "ms" else value, unit)


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A Markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return lines


def machine(report: dict[str, Any]) -> str:
    """The machine a report was measured on, in one sentence."""
    info = report.get("machine") or {}
    parts = [
        f"{info.get('cpus', '?')} CPUs ({info.get('cpu_model', 'unknown')})",
        f"{info.get('memory_gib', '?')} GiB",
        f"kernel {info.get('kernel', '?')}",
    ]
    parts += [info[key] for key in ("qemu", "libvirt") if info.get(key)]
    parts.append(f"Python {info.get('python', '?')}")
    text = ", ".join(parts)
    load = info.get("load_average")
    if load:
        text += f"; load average {', '.join(str(x) for x in load)} (1, 5, 15 min) at the end"
    return text


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """fast_start's rounds: the floor, the cold create and the pool hit (means and each
    round), then where each one's time goes, stage by stage, from the guest's own clock."""
    floor, cold, hit = summary["floor"], summary["cold"], summary["hit"]
    lines = table(
        ("Measurement", "Mean", "Each round (the creates: times the floor)"),
        [
            (
                "boot floor (kernel + busybox initramfs, powers off)",
                fmt(floor["mean"], "s"),
                ", ".join(fmt(x, "s") for x in floor["per_round"]),
            ),
            *(
                (
                    label,
                    fmt(part["mean"], "s"),
                    ", ".join(fmt(x, "x") for x in part["ratio_per_round"]),
                )
                for label, part in (
                    ("cold create -> SSH ready", cold),
                    ("pool hit: create -> SSH ready (whole CLI process)", hit),
                )
            ),
        ],
    )
    for kind, title in (("cold", "Cold create"), ("hit", "Pool hit")):
        stages = summary[kind].get("stages_mean") or {}
        if stages:
            rows = [(stage, f"{sec:.3f}") for stage, sec in stages.items()]
            lines += ["", *table((f"{title}: stage", "Seconds (mean)"), rows)]
    return lines


def series_rows(report: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Measurement rows: each comparison's sides, ratio and references, then plain series."""
    rows: list[tuple[str, str, str]] = []
    for comparison in report.get("comparisons", []):
        unit = comparison.get("unit_shown", "s")
        for letter, side in (("A", comparison["a"]), ("B", comparison["b"])):
            rows.append(_series_row(f"{letter}: {side['label']}", side, unit))
        rows.append(
            (
                f"A/B per round ({comparison['name']})",
                fmt(comparison["median_ratio"], "x"),
                f"{fmt(comparison['min_ratio'], 'x')} - {fmt(comparison['max_ratio'], 'x')}",
            )
        )
        rows += [_series_row(f"ref: {ref['label']}", ref, unit) for ref in comparison["refs"]]
    for series in report.get("series", []):
        rows.append(_series_row(series["label"], series, "s"))
    for result in report.get("results", []):  # the inventory benchmark's own form
        rows.append(
            (
                result["name"],
                fmt(result["median_ms"], "ms"),
                f"{fmt(result['min_ms'], 'ms')} - {fmt(result['max_ms'], 'ms')}",
            )
        )
    return rows


def load_rows(report: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """A load benchmark's calls and lock holds (lock_load's form): count, median, p95, max."""
    named = [(f"{op} (succeeded)", figures) for op, figures in report["calls"].items()]
    named += [(f"lock: {what}", report["lock"][what]) for what in ("wait", "hold")]
    rows = []
    for label, figures in named:
        if not figures.get("count"):
            rows.append((label, "0", "-", "-", "-"))
            continue
        shown = [seconds(figures[key], "ms") for key in ("median_s", "p95_s", "max_s")]
        rows.append((label, str(figures["count"]), *shown))
    return rows


def load_errors(report: dict[str, Any]) -> str:
    """The calls that failed, by code, in one sentence."""
    failed = [
        f"{op}: " + ", ".join(f"{n} {code}" for code, n in sorted(codes.items()))
        for op, codes in report.get("errors", {}).items()
        if codes
    ]
    return "Failed calls: " + ("; ".join(failed) if failed else "none") + "."


def stage_rows(report: dict[str, Any]) -> list[tuple[str, str, str]]:
    """A cold boot's stages (fast_start's ``cold_stages``: per round, the seconds from the
    start of the create to each stage's first console line), as median and min - max."""
    rounds = report.get("cold_stages") or []
    stages = list(dict.fromkeys(stage for entry in rounds for stage in entry))
    rows = []
    for stage in stages:
        values = sorted(entry[stage] for entry in rounds if stage in entry)
        median = statistics.median(values)
        rows.append((stage, fmt(median, "s"), f"{fmt(values[0], 's')} - {fmt(values[-1], 's')}"))
    return rows


def _series_row(label: str, series: dict[str, Any], unit: str) -> tuple[str, str, str]:
    low, high = seconds(series["min"], unit), seconds(series["max"], unit)
    return label, seconds(series["median"], unit), f"{low} - {high}"


def checks(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The figures judged against a target (the inventory benchmark keeps its own form)."""
    if "checks" in report:
        return report["checks"]
    return [
        {
            "figure": result["name"],
            "value": result["median_ms"],
            "unit": "ms",
            "target": f"<= {result['target_ms']:.0f} ms",
            "met": result["ok"],
        }
        for result in report.get("results", [])
    ]


def load(results: Path) -> list[dict[str, Any]]:
    """The benchmark reports in ``results``, in the page's order (summary.json left out)."""
    reports = [
        json.loads(path.read_text())
        for path in sorted(results.glob("*.json"))
        if path.name != "summary.json"
    ]
    order = list(ABOUT)
    return sorted(
        reports, key=lambda r: order.index(r["bench"]) if r["bench"] in order else len(order)
    )


def render(results: Path) -> str:
    """The whole page."""
    reports = load(results)
    lines = [
        "# Performance",
        "",
        "<!-- Generated by docs/gen_performance.py from docs/results/: do not edit. -->",
        "",
        "Figures measured by the benchmarks in `bench/`. Each compares vmsandbox (side A) with "
        "what a user would do instead (side B) on the same machine and image in the same run, "
        "alternating the sides round by round after uncounted warm-up rounds; times are "
        "medians with min - max, a ratio is the median of the per-round ratios A/B. Guests in "
        "these benchmarks run under TCG (virt type `qemu`), as on the development machines, "
        "which have no usable KVM: on a host with KVM every boot is much shorter. The last "
        "section, [Building and testing](#building-and-testing), gives what `make` and the test "
        "suite take.",
        "",
        "Every section gives the date, the machine and the command of its run. To measure "
        "again and rewrite this page:",
        "",
        "```sh",
        "make bench                                               # setup, then every benchmark",
        ".venv/bin/python bench/run_all.py --out docs/results     # every benchmark, or one:",
        ".venv/bin/python bench/destroy.py --rounds 10 --out docs/results",
        ".venv/bin/python bench/run_all.py --quick --out /tmp/b   # one round each: they work",
        ".venv/bin/python docs/gen_performance.py                 # this page, from docs/results",
        "```",
        "",
        "Every script takes `--rounds N`, `--warmup N` and `--out DIR`; `run_all.py` also "
        "`--only NAME ...` and `--skip NAME ...`. Whatever a benchmark makes (sandboxes and "
        "domains named `bench-*`, files) is removed when it ends, Ctrl-C included. A script "
        "exits 2 when it could not measure and 130 when interrupted; `allocation` exits 1 "
        "when a GPU was held twice, and `run_all.py` 1 when a target was missed or a "
        "benchmark did not finish. `create_overhead` needs virt-install "
        "(`make bench` installs it); `gpu_claim` needs a running "
        "[nested GPU host](nested-gpu-host.md), and `gpu_handoff` starts one of its own.",
        "",
    ]
    ran = {report["bench"] for report in reports}
    missing = [title for name, (title, _) in ABOUT.items() if name not in ran]
    if missing:
        lines += ["Not run for this page: " + ", ".join(missing) + ".", ""]
    lines += ["## Summary", ""]
    rows = [
        (
            ABOUT.get(report["bench"], (report["bench"], ""))[0],
            check["figure"],
            fmt(check["value"], check["unit"]),
            check["target"],
            VERDICTS[check["met"]],
        )
        for report in reports
        for check in checks(report)
    ]
    lines += table(("Benchmark", "Figure", "Value", "Target", "Verdict"), rows)
    for report in reports:
        title, about = ABOUT.get(report["bench"], (report["bench"], ""))
        when = report.get("when", "?").replace("T", " ").replace("Z", " UTC")
        rounds = f"{report.get('rounds', '?')} rounds after {report.get('warmup', 0)} warm-up"
        if "clients" in report:
            rounds = (
                f"{report['clients']} clients for {report['seconds']:.0f} s, "
                f"{report['domains']} defined domains"
            )
        if "fleet_clients" in report:
            rounds = (
                f"{report['creates']} creates from {report['fleet_clients']} clients, "
                f"{report['seconds']:.0f} s in all"
            )
        lines += ["", f"## {title}", ""]
        if about:
            lines += [about, ""]
        lines += [
            f"- **When**: {when}, commit `{report.get('commit') or 'unknown'}`; {rounds}",
            f"- **Machine**: {machine(report)}",
            f"- **Command**: `{report.get('command', 'unknown')}`",
            "",
        ]
        if "calls" in report:
            headers = ("Measurement", "Count", "Median", "p95", "Max")
            lines += [*table(headers, load_rows(report)), "", load_errors(report)]
        elif "floor" in report.get("summary", {}):
            lines += summary_lines(report["summary"])
        else:
            lines += table(("Measurement", "Median", "Min - max"), series_rows(report))
        stages = stage_rows(report)
        if stages:
            lines += ["", "Where a cold create's time goes: seconds from its start to each stage."]
            lines += ["", *table(("Cold boot stage", "Median", "Min - max"), stages)]
        judged = checks(report)
        if judged:
            lines.append("")
            rows = [
                (c["figure"], fmt(c["value"], c["unit"]), c["target"], VERDICTS[c["met"]])
                for c in judged
            ]
            lines += table(("Figure", "Value", "Target", "Verdict"), rows)
        figures = report.get("figures")
        if figures:  # every figure of the run, as the benchmark prints them
            lines += ["", *table(("Figure", "Value"), [(k, str(v)) for k, v in figures.items()])]
    suite = results / SUITE
    if suite.is_file():
        lines += ["", *suite.read_text().rstrip("\n").splitlines()]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder of JSON reports")
    parser.add_argument("--page", type=Path, default=PAGE, help="the page to write")
    parser.add_argument(
        "--check", action="store_true", help="exit 1 when the page differs; write nothing"
    )
    args = parser.parse_args(argv)
    page = render(args.results)
    if args.check:
        current = args.page.read_text() if args.page.exists() else ""
        if current != page:
            print(f"{args.page} is stale: run docs/gen_performance.py", file=sys.stderr)
            return 1
        return 0
    args.page.write_text(page)
    print(f"written to {args.page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
