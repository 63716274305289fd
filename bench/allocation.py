"""GPU allocation under contention: N processes allocating and releasing on one fake 8-GPU host.

Each worker runs under ``umockdev-run`` with the HGX H100 host (tests/fixtures/hosts/
hgx_h100.umockdev: 8 GPUs among 72 PCI functions) and the real libvirtd. One allocation is what
``SandboxManager.create`` does before it starts a domain: under the host lock of a state
directory shared by the workers, read the inventory (``manager.gpus()``: sysfs plus the
``<hostdev>`` of every libvirt domain), ``allocator.select`` a GPU (RESOURCE_EXHAUSTED: retry)
and define a domain ``bench-alloc-<pid>-<n>`` holding it; the domain is never started. After a
short hold it is undefined (the release). Each hold is logged with its BDFs, its start (just
after the define, under the lock) and its end (just before the undefine). ``--gpus N`` asks
for N GPUs at a time: with N > 1 the processes want more than the host has, and some wait.

Afterwards the logs must show zero double allocations (no two holds of one BDF overlap in
time); throughput is counted rounds per second from the common start. Warm-up rounds run
before the start signal and are checked but not timed.

Usage: .venv/bin/python bench/allocation.py [--procs 8] [--rounds 50] [--warmup 1] [--gpus 1]
       [--hold-ms 50] [--out DIR]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import common

if TYPE_CHECKING:
    import libvirt
    from lxml import etree

HOST = "hgx_h100"
RETRY_S = 0.002


def add_hostdevs(root: etree._Element, bdfs: Sequence[str]) -> None:
    """A ``DomainPlan.extra``: one managed PCI ``<hostdev>`` per BDF."""
    from lxml import etree

    from vmsandbox.host.bdf import libvirt_address

    devices = root.find("devices")
    for bdf in bdfs:
        hostdev = etree.SubElement(devices, "hostdev", mode="subsystem", type="pci", managed="yes")
        source = etree.SubElement(hostdev, "source")
        etree.SubElement(source, "address", **libvirt_address(bdf))


class Worker:
    """One allocating process: a manager on the shared state directory and its own log."""

    def __init__(self, state: Path, log: IO[str], hold_s: float, gpus: int) -> None:
        from vmsandbox.config import Config
        from vmsandbox.sandbox.manager import SandboxManager

        config = Config.load(path="/nonexistent", state_dir=state, image_dir=common.IMAGES)
        self.manager = SandboxManager(config, reconcile=False)
        self.log = log
        self.hold_s = hold_s
        self.gpus = gpus  # per allocation
        self.defined: list[libvirt.virDomain] = []  # not undefined yet
        self.made = 0

    def _domain_xml(self, name: str, bdfs: list[str]) -> str:
        from vmsandbox.vm import domain

        state = self.manager.config.state_dir
        return domain.build_domain_xml(
            domain.DomainPlan(
                domain_name=name,
                uuid=str(uuid.uuid4()),
                virt_type="qemu",
                cpus=1,
                memory_mib=256,
                overlay=state / f"{name}.qcow2",
                seed=state / f"{name}-seed.iso",
                console_log=state / f"{name}.log",
                record={"bench": "allocation"},
                ssh_port=22,
                extra=[functools.partial(add_hostdevs, bdfs=bdfs)],
            )
        )

    def allocate(self) -> tuple[libvirt.virDomain, list[str], float, int]:
        """Select and define under the host lock, retrying while no GPU is free.

        Returns the domain, its BDFs, the hold's start and the number of retries.
        """
        from vmsandbox.errors import ResourceExhausted
        from vmsandbox.gpu import allocator
        from vmsandbox.gpu.request import GpuRequest
        from vmsandbox.lock import host_lock

        name = common.name("alloc", str(self.made))  # bench-alloc-<this pid>-<n>
        self.made += 1
        retries = 0
        while True:
            with host_lock(self.manager.config.lock_path):
                try:
                    gpus = allocator.select(GpuRequest(count=self.gpus), self.manager.gpus())
                except ResourceExhausted:
                    gpus = []
                if gpus:
                    bdfs = [gpu.bdf for gpu in gpus]
                    dom = self.manager.conn.defineXML(self._domain_xml(name, bdfs))
                    self.defined.append(dom)
                    return dom, bdfs, time.monotonic(), retries
            retries += 1
            time.sleep(RETRY_S)

    def release(self, dom: libvirt.virDomain) -> None:
        dom.undefine()
        self.defined.remove(dom)

    def round(self, counted: bool) -> None:
        asked = time.monotonic()
        dom, bdfs, start, retries = self.allocate()
        time.sleep(self.hold_s)
        end = time.monotonic()
        self.release(dom)
        record = {
            "pid": os.getpid(),
            "domain": dom.name(),
            "bdfs": bdfs,
            "asked": asked,
            "start": start,
            "end": end,
            "released": time.monotonic(),
            "retries": retries,
            "counted": counted,
        }
        self.log.write(json.dumps(record) + "\n")

    def cleanup(self) -> None:
        for dom in list(self.defined):
            try:
                self.release(dom)
            except Exception as exc:  # keep going: the coordinator sweeps what is left
                print(f"warning: undefining {dom.name()}: {exc}", file=sys.stderr)


def worker(args: argparse.Namespace) -> None:
    """Runs under umockdev-run: warm-up rounds, "ready", wait for "go", the counted rounds."""
    print(json.dumps({"pid": os.getpid()}), flush=True)
    with args.worker.open("w") as log:
        work = Worker(args.state, log, args.hold_ms / 1000, args.gpus)
        try:
            for _ in range(args.warmup):
                work.round(counted=False)
            print(json.dumps({"ready": True}), flush=True)
            if sys.stdin.readline().strip() != "go":
                return
            for _ in range(args.rounds):
                work.round(counted=True)
        finally:
            work.cleanup()


def double_allocations(holds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Pairs of holds of one BDF that overlap in time."""
    by_bdf: dict[str, list[dict[str, Any]]] = {}
    for hold in holds:
        for bdf in hold["bdfs"]:
            by_bdf.setdefault(bdf, []).append(hold)
    found = []
    for bdf, series in by_bdf.items():
        series.sort(key=lambda hold: hold["start"])
        latest = series[0]
        for hold in series[1:]:
            if hold["start"] < latest["end"]:
                found.append({"bdf": bdf, "first": latest["domain"], "second": hold["domain"]})
            if hold["end"] > latest["end"]:
                latest = hold
    return found


def sweep(pids: Sequence[int]) -> None:
    """Remove every domain the workers defined and did not undefine (a worker that died)."""
    listed = subprocess.run(
        ["virsh", "-q", "-c", "qemu:///system", "list", "--all", "--name"],
        capture_output=True,
        text=True,
        check=False,
    )
    prefixes = tuple(f"{common.PREFIX}alloc-{pid}-" for pid in pids)
    for name in listed.stdout.split():
        if name.startswith(prefixes):
            print(f"removing leftover domain {name}", file=sys.stderr)
            common.remove_domain(name)


def coordinate(
    args: argparse.Namespace, state: Path, cleanup: common.Cleanup
) -> tuple[float, list[int], list[dict[str, Any]]]:
    """Start the workers, let them go at once, wait; return the start, the workers' pids and
    all their holds."""
    sys.path.insert(0, str(common.REPO / "tests"))
    from framework.fake_hosts import umockdev_run

    logs = [state / f"worker-{index}.jsonl" for index in range(args.procs)]
    procs: list[subprocess.Popen[str]] = []
    pids: list[int] = []
    cleanup.add("leftover domains", lambda: sweep(pids))
    cleanup.add("workers", lambda: stop(procs))
    with umockdev_run(HOST) as (umockdev, env):
        for log in logs:
            argv = [
                *umockdev,
                sys.executable,
                __file__,
                *("--worker", str(log), "--state", str(state), "--gpus", str(args.gpus)),
                *("--hold-ms", str(args.hold_ms)),
                *("--rounds", str(args.rounds), "--warmup", str(args.warmup)),
            ]
            procs.append(
                subprocess.Popen(
                    argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
                )
            )
        for proc in procs:
            pids.append(_message(proc, "pid"))
        for proc in procs:
            _message(proc, "ready")
        go = time.monotonic()
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.close()
        failed = [proc.wait() for proc in procs]
    if any(failed):
        raise common.BenchError(f"workers exited {failed}; see their messages above")
    holds = [json.loads(line) for log in logs for line in log.read_text().splitlines()]
    return go, pids, holds


def stop(procs: Sequence[subprocess.Popen[str]]) -> None:
    """Let workers still waiting for "go" give up, and wait for all to clean up and exit."""
    for proc in procs:
        if proc.stdin is not None and not proc.stdin.closed:
            proc.stdin.close()
    for proc in procs:
        try:
            proc.wait(timeout=common.CHILD_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _message(proc: subprocess.Popen[str], key: str) -> Any:
    """The next JSON line a worker prints, which must carry ``key``."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    try:
        return json.loads(line)[key]
    except (ValueError, KeyError):
        proc.wait()
        raise common.BenchError(f"a worker said {line!r} instead of {key!r}") from None


def most_held(holds: list[dict[str, Any]]) -> int:
    """The most GPUs held at one time: how much the holds overlapped."""
    events = sorted(
        event
        for hold in holds
        for event in ((hold["start"], len(hold["bdfs"])), (hold["end"], -len(hold["bdfs"])))
    )
    held = most = 0
    for _when, change in events:
        held += change
        most = max(most, held)
    return most


def main(argv: Sequence[str] | None = None) -> int:
    parser = common.arguments(__doc__, rounds=50)
    parser.add_argument("--procs", type=int, default=8, help="allocating processes (8)")
    parser.add_argument("--gpus", type=int, default=1, help="GPUs per allocation (1)")
    parser.add_argument("--hold-ms", type=float, default=50.0, help="hold before release (50)")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # its log file
    parser.add_argument("--state", type=Path, help=argparse.SUPPRESS)
    args = common.parse_args(parser, argv)
    if args.worker:
        worker(args)
        return 0
    common.require("umockdev-run", "virsh")
    report = common.Report("allocation", args.rounds, args.warmup)
    with common.state_dir("alloc", parent="/tmp") as state, common.Cleanup() as cleanup:
        go, pids, holds = coordinate(args, state, cleanup)
    counted = [hold for hold in holds if hold["counted"]]
    window = max(hold["released"] for hold in counted) - go
    doubles = double_allocations(holds)
    allocate_ms = [(hold["start"] - hold["asked"]) * 1000 for hold in counted]
    retries = sum(hold["retries"] for hold in holds)
    report.extra.update(
        {
            "host": HOST,
            "procs": args.procs,
            "worker_pids": pids,
            "gpus_per_allocation": args.gpus,
            "hold_ms": args.hold_ms,
            "holds": len(holds),
            "counted_rounds": len(counted),
            "window_s": window,
            "retries": retries,
            "most_gpus_held_at_once": most_held(holds),
            "double_allocations": doubles,
            "allocate_ms": common.Series("allocate", allocate_ms).to_dict(),
        }
    )
    report.checks += [
        common.Check("double allocations", len(doubles), "", "= 0", not doubles),
        common.Check(
            "allocate+release rounds per second", len(counted) / window, "rounds/s", "-", None
        ),
        common.Check(
            "allocate (lock wait, select, define), median",
            statistics.median(allocate_ms),
            "ms",
            "-",
            None,
        ),
        common.Check("allocate, slowest", max(allocate_ms), "ms", "-", None),
    ]
    print(
        f"{args.procs} processes x {args.rounds} rounds (+{args.warmup} warm-up) of {args.gpus} "
        f"GPU(s), {args.hold_ms:g} ms holds on {HOST}: {len(holds)} holds, at most "
        f"{report.extra['most_gpus_held_at_once']} GPUs held at once, {retries} retries on "
        "RESOURCE_EXHAUSTED"
    )
    report.write(args.out)
    return 1 if doubles else 0


if __name__ == "__main__":
    sys.exit(common.entry(main))
