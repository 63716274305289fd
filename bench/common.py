"""What every benchmark shares: timing whole processes, A/B alternation, statistics, the table,
the JSON report, and cleanup that also runs on Ctrl-C.

A benchmark compares vmsandbox (side A) with what a user would do instead (side B) on the same
machine and image in the same run. Rounds alternate A B A B ... after warm-up rounds that are
not counted, so drift (load from other work, caches) hits both sides alike. Every figure is
reported as median and min-max, and every pair as the ratio A/B.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import shutil
import signal
import socket
import statistics
import string
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vmsandbox.tables import render_grid

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
VMSANDBOX = str(Path(sys.executable).parent / "vmsandbox")
IMAGES = Path(os.environ.get("VMSANDBOX_IMAGE_DIR", "/var/lib/vmsandbox/images"))
IMAGE = "minimal"
DISK_GIB = 4  # vmsandbox create's default disk size, used by the baselines too
# Everything a benchmark makes on the shared libvirtd carries this prefix (vmsandbox adds
# its own "vmsbx-" in front of sandbox names); cleanup refuses to touch anything else.
PREFIX = "bench-"
# Names of this run's sandboxes and domains: <PREFIX><bench>-<pid>-<tag>.
RUN = str(os.getpid())
# A child that got Ctrl-C along with us may take this long to clean up after itself.
CHILD_GRACE_S = 30.0


class BenchError(Exception):
    """A benchmark could not measure (a command failed); not a missed target."""


# -- command line ---------------------------------------------------------------------------


def entry(main: Callable[[], int]) -> int:
    """Run a benchmark's ``main``: a failure or Ctrl-C ends it with a message, no traceback
    (its cleanup has run by then). Exit status 2: it could not measure; 130: interrupted."""
    try:
        return main()
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; what this run made has been removed", file=sys.stderr)
        return 130


def arguments(doc: str | None, *, rounds: int = 5, warmup: int = 1) -> argparse.ArgumentParser:
    """An argument parser with the options every benchmark takes; its text is ``doc``."""
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=rounds, help=f"counted rounds ({rounds})")
    parser.add_argument(
        "--warmup", type=int, default=warmup, help=f"uncounted rounds first ({warmup})"
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON report")
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0:
        parser.error("--rounds must be at least 1 and --warmup at least 0")
    return args


# -- processes ------------------------------------------------------------------------------


def run(
    argv: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    timeout: float = 600.0,
    ok: Sequence[int] = (0,),
) -> subprocess.CompletedProcess[str]:
    """Run a command to its end and return it; raise BenchError on an exit status not in ``ok``.

    On Ctrl-C the child (which got the signal too) is given time to clean up before it is
    killed, so a vmsandbox command is never cut off halfway through removing what it made.
    """
    with subprocess.Popen(
        list(argv),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except KeyboardInterrupt:
            reap(proc)
            raise
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise BenchError(f"{shlex.join(argv)} took more than {timeout:.0f}s") from None
    done = subprocess.CompletedProcess(list(argv), proc.returncode, out, err)
    if done.returncode not in ok:
        tail = "\n".join((err or out).strip().splitlines()[-8:])
        raise BenchError(f"{shlex.join(argv)} exited {done.returncode}:\n{tail}")
    return done


def reap(proc: subprocess.Popen[str]) -> None:
    """Wait for a child that got Ctrl-C (or its stdin closed) to finish; kill it after a grace."""
    try:
        proc.communicate(timeout=CHILD_GRACE_S)
    except (subprocess.TimeoutExpired, KeyboardInterrupt):
        proc.kill()
        proc.communicate()


def timed(argv: Sequence[str], **kwargs: Any) -> float:
    """Seconds that ``argv`` takes as a whole process (see ``run``)."""
    start = time.perf_counter()
    run(argv, **kwargs)
    return time.perf_counter() - start


def require(*tools: str) -> None:
    """Fail early, with the package to install, when a command-line tool is missing."""
    packages = {"virt-install": "virtinst", "umockdev-run": "umockdev", "virsh": "libvirt-clients"}
    for tool in tools:
        if shutil.which(tool) is None:
            raise BenchError(f"{tool} is missing: apt-get install {packages.get(tool, tool)}")


# -- vmsandbox and libvirt ------------------------------------------------------------------


@contextlib.contextmanager
def state_dir(tag: str, parent: str = "/var/tmp") -> Iterator[Path]:
    """An empty vmsandbox state directory of this run's own, removed afterwards.

    Under /var/tmp by default, reachable (0711) by the hypervisor's user, like the tests'.
    """
    root = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{tag}-", dir=parent))
    os.chmod(root, 0o711)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def vmsandbox_env(state: Path) -> dict[str, str]:
    """Environment for the vmsandbox CLI on ``state`` with the shared images, under TCG."""
    return {
        **os.environ,
        "VMSANDBOX_CONFIG": "/nonexistent",
        "VMSANDBOX_STATE_DIR": str(state),
        "VMSANDBOX_IMAGE_DIR": str(IMAGES),
        "VMSANDBOX_VIRT_TYPE": "qemu",
    }


def name(bench: str, tag: str) -> str:
    """The name of a sandbox or domain this run makes (a valid vmsandbox name)."""
    return f"{PREFIX}{bench}-{RUN}-{tag}"


def _check_ours(name: str) -> None:
    if not name.removeprefix("vmsbx-").startswith(PREFIX):
        raise ValueError(f"refusing to touch {name!r}: benchmarks only remove {PREFIX}* objects")


def destroy_sandbox(name: str, env: dict[str, str]) -> None:
    """Remove vmsandbox sandbox ``name`` (gone already is fine); virsh if its domain is left."""
    _check_ours(name)
    try:
        run([VMSANDBOX, "destroy", name], env=env, ok=(0, 3), timeout=120)
    except BenchError as exc:
        print(f"warning: {exc}", file=sys.stderr)
    if domain_exists(f"vmsbx-{name}"):
        print(f"warning: removing domain vmsbx-{name} with virsh", file=sys.stderr)
        remove_domain(f"vmsbx-{name}")


def domain_exists(domain: str) -> bool:
    state = ["virsh", "-q", "-c", "qemu:///system", "domstate", domain]
    return subprocess.run(state, capture_output=True, check=False).returncode == 0


def remove_domain(domain: str) -> None:
    """``virsh destroy`` and ``undefine --nvram`` a domain of ours, whatever state it is in."""
    _check_ours(domain)
    virsh = ["virsh", "-q", "-c", "qemu:///system"]
    subprocess.run([*virsh, "destroy", domain], capture_output=True, check=False)
    subprocess.run([*virsh, "undefine", domain, "--nvram"], capture_output=True, check=False)


# How long one ssh try waits for the connection and the server's banner, as vmsandbox's own
# wait does (paramiko, 5 s). With 1 s, ssh under TCG gives up during the banner exchange while
# sshd starts, each abandoned try leaves another sshd starting in the guest's one vCPU, and the
# loop can go on for minutes.
SSH_TRY_S = 5


def free_port() -> int:
    """A loopback port nothing listens on now (for a baseline's SSH forward)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass(frozen=True)
class HandMade:
    """A guest made by hand from vmsandbox's own pieces: its files and domain XML, not started."""

    name: str
    xml: Path
    port: int
    user: str
    client_key: Path
    known_hosts: Path
    console_log: Path
    files: tuple[Path, ...]

    def ssh_argv(self) -> list[str]:
        """OpenSSH running ``true`` in the guest with the pinned host key, one try."""
        return [
            "ssh",
            *("-o", "BatchMode=yes", "-o", f"ConnectTimeout={SSH_TRY_S}"),
            *("-o", "IdentitiesOnly=yes"),
            *("-o", "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={self.known_hosts}"),
            *("-o", f"HostKeyAlias={self.name}", "-i", str(self.client_key)),
            *("-p", str(self.port), f"{self.user}@127.0.0.1", "true"),
        ]


def hand_made(folder: Path, name: str, *, cpus: int = 1, memory_mib: int = 1024) -> HandMade:
    """Overlay, keys and seed as vmsandbox makes them, and the domain vmsandbox's planner
    (``vmsandbox.sandbox.plan``) makes for them, under a name of ours (no ``vmsbx-``: not a
    sandbox)."""
    from dataclasses import replace

    from vmsandbox.config import Config
    from vmsandbox.guest.keys import SandboxKeys
    from vmsandbox.guest.seed import network_config, write_seed
    from vmsandbox.image.store import ImageStore, make_overlay
    from vmsandbox.sandbox import plan
    from vmsandbox.sandbox.record import SandboxFiles
    from vmsandbox.sandbox.spec import SandboxSpec
    from vmsandbox.vm import domain

    _check_ours(name)
    config = Config(image_dir=IMAGES, virt_type="qemu")
    image = ImageStore(IMAGES).get(IMAGE)
    files = SandboxFiles(
        name=name,
        overlay=folder / f"{name}.qcow2",
        seed=folder / f"{name}-seed.iso",
        nvram=folder / f"{name}-vars.fd",
        keys_dir=folder / f"{name}-keys",
        console_log=folder / f"{name}.console.log",
        qemu_log=None,
    )
    spec = SandboxSpec(image=IMAGE, cpus=cpus, memory_mib=memory_mib, disk_gib=DISK_GIB)
    port = free_port()
    planned = plan.plan(
        spec, name=name, config=config, image=image, virt_type="qemu", port=port, files=files
    )
    xml = folder / f"{name}.xml"
    make_overlay(image.disk, files.overlay, DISK_GIB)
    keys, client, host = SandboxKeys.create(files.keys_dir, name)
    write_seed(
        files.seed,
        instance_id=str(uuid.uuid4()),
        hostname=name,
        user=config.ssh_user,
        client=client,
        host=host,
        network=network_config(planned.record.mac, user_net=True),
    )
    xml.write_text(domain.build_domain_xml(replace(planned.domain, domain_name=name)))
    made = (files.overlay, files.seed, files.keys_dir, files.console_log, xml)
    return HandMade(
        name, xml, port, config.ssh_user, keys.client_key, keys.known_hosts, files.console_log, made
    )


def remove_hand_made(made: HandMade) -> None:
    """Stop the guest (if running) and delete its files."""
    remove_domain(made.name)
    for path in made.files:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


class Cleanup:
    """Undo actions, run when the benchmark ends however it ends (also Ctrl-C and SIGTERM).

    ``add(key, action)`` registers what removes a thing; ``now(key)`` runs it at once (the
    untimed cleanup after a round). Whatever is left runs on exit, newest first, with Ctrl-C
    ignored so that a second Ctrl-C cannot leave a half-removed domain behind.
    """

    def __init__(self) -> None:
        self._actions: dict[str, Callable[[], None]] = {}
        self._saved: dict[int, Any] = {}

    def add(self, key: str, action: Callable[[], None]) -> None:
        self._actions[key] = action

    def now(self, key: str) -> None:
        """Run the action of ``key``; it stays registered until it has run to its end."""
        action = self._actions.get(key)
        if action is not None:
            action()
            del self._actions[key]

    def __enter__(self) -> Cleanup:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._saved[sig] = signal.signal(sig, _interrupt)
        return self

    def __exit__(self, *_exc: object) -> None:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            for key in reversed(list(self._actions)):
                try:
                    self.now(key)
                except Exception as exc:  # keep removing the rest
                    print(f"warning: cleanup of {key} failed: {exc}", file=sys.stderr)
        finally:
            signal.signal(signal.SIGINT, previous)
            for sig, handler in self._saved.items():
                signal.signal(sig, handler)


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


# -- statistics -----------------------------------------------------------------------------


@dataclass
class Series:
    """Samples of one measurement, in seconds (or in ``unit`` when it is not a time)."""

    label: str
    samples: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "median": self.median,
            "min": min(self.samples),
            "max": max(self.samples),
            "samples": self.samples,
        }


@dataclass
class Comparison:
    """Side A (vmsandbox) against side B (the baseline), sample i of each from round i.

    ``refs`` are further series measured in the same rounds for scale (a floor, say).
    """

    name: str
    a: Series
    b: Series
    unit: str = "s"  # how to show the times: "s" or "ms"
    refs: list[Series] = field(default_factory=list)

    @property
    def ratios(self) -> list[float]:
        return [a / b for a, b in zip(self.a.samples, self.b.samples, strict=True)]

    @property
    def median_ratio(self) -> float:
        return statistics.median(self.ratios)

    def to_dict(self) -> dict[str, Any]:
        ratios = self.ratios
        return {
            "name": self.name,
            "unit_shown": self.unit,
            "a": self.a.to_dict(),
            "b": self.b.to_dict(),
            "refs": [series.to_dict() for series in self.refs],
            "ratios": ratios,
            "median_ratio": statistics.median(ratios),
            "min_ratio": min(ratios),
            "max_ratio": max(ratios),
        }


Measure = Callable[[str], float]


def alternate(
    name: str,
    a: tuple[str, Measure],
    b: tuple[str, Measure],
    *refs: tuple[str, Measure],
    rounds: int,
    warmup: int,
    after: Callable[[str], None] | None = None,
    unit: str = "s",
) -> Comparison:
    """Run ``warmup + rounds`` rounds of A, B (then any ``refs``); keep the last ``rounds``.

    Each side is ``(label, measure)``; ``measure(tag)`` does its untimed setup, then the timed
    part, and returns the seconds it timed. ``tag`` ("a1", "bw1", ...: side letter, then the
    round, "w" for warm-up) names what it makes, and ``after(tag)`` removes it, untimed, after
    each side.
    """
    comparison = Comparison(name, Series(a[0]), Series(b[0]), unit, [Series(r[0]) for r in refs])
    series = [comparison.a, comparison.b, *comparison.refs]
    for index in range(warmup + rounds):
        counted = index >= warmup
        round_tag = str(index - warmup + 1) if counted else f"w{index + 1}"
        sides = zip(string.ascii_lowercase, (a, b, *refs), series, strict=False)
        for letter, (label, measure), into in sides:
            side_tag = f"{letter}{round_tag}"
            try:
                seconds = measure(side_tag)
            finally:
                if after is not None:
                    after(side_tag)
            if counted:
                into.samples.append(seconds)
            what = "round" if counted else "warm-up"
            print(f"  {what} {round_tag}: {label}: {fmt_time(seconds, unit)}", flush=True)
    return comparison


# -- verdicts, table, report ----------------------------------------------------------------


@dataclass
class Check:
    """One figure against its target (``met`` None: reported, no target)."""

    figure: str
    value: float
    unit: str  # "s", "ms", "x" (a ratio), "" (a count), "rounds/s"
    target: str
    met: bool | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "figure": self.figure,
            "value": self.value,
            "unit": self.unit,
            "target": self.target,
            "met": self.met,
        }


def at_most(figure: str, value: float, limit: float, unit: str) -> Check:
    """``value`` against the target ``<= limit``, both in ``unit``."""
    return Check(figure, value, unit, f"<= {fmt(limit, unit)}", value <= limit)


def fmt(value: float, unit: str) -> str:
    """A value in ``unit``, for people."""
    if unit == "ms":
        return f"{value:.0f} ms"
    if unit == "s":
        return f"{value:.2f} s"
    if unit == "x":
        return f"{value:.2f}x"
    number = f"{value:.0f}" if value == int(value) else f"{value:.1f}"
    return f"{number} {unit}".rstrip()


def fmt_time(seconds: float, unit: str) -> str:
    """Seconds shown in ``unit`` ("s" or "ms")."""
    return fmt(seconds * 1000 if unit == "ms" else seconds, unit)


def render(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain text table, columns padded to their widest cell (vmsandbox's own renderer)."""
    return "\n".join(render_grid(headers, rows))


def comparison_rows(comparison: Comparison) -> list[tuple[str, str, str]]:
    """Table rows: A, B, the ratio A/B, then any reference series."""

    def row(label: str, series: Series) -> tuple[str, str, str]:
        unit = comparison.unit
        low, high = min(series.samples), max(series.samples)
        return (
            label,
            fmt_time(series.median, unit),
            f"{fmt_time(low, unit)} - {fmt_time(high, unit)}",
        )

    ratios = comparison.ratios
    return [
        row(f"A {comparison.a.label}", comparison.a),
        row(f"B {comparison.b.label}", comparison.b),
        (
            "A/B per round",
            fmt(comparison.median_ratio, "x"),
            f"{fmt(min(ratios), 'x')} - {fmt(max(ratios), 'x')}",
        ),
        *(row(f"ref {series.label}", series) for series in comparison.refs),
    ]


def check_rows(checks: Sequence[Check]) -> list[tuple[str, str, str, str]]:
    verdicts = {True: "met", False: "MISSED", None: "-"}
    return [
        (check.figure, fmt(check.value, check.unit), check.target, verdicts[check.met])
        for check in checks
    ]


def machine() -> dict[str, Any]:
    """The machine the figures come from, and how busy it was."""
    info: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "cpu_model": _first_value("/proc/cpuinfo", "model name"),
        "memory_gib": round(int(_first_value("/proc/meminfo", "MemTotal").split()[0]) / 2**20, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "load_average": [round(load, 2) for load in os.getloadavg()],
    }
    for key, argv in (
        ("qemu", ["qemu-system-x86_64", "--version"]),
        ("libvirt", ["libvirtd", "--version"]),
    ):
        try:
            info[key] = subprocess.run(argv, capture_output=True, text=True, check=False).stdout
            info[key] = info[key].splitlines()[0].strip()
        except (OSError, IndexError):
            info[key] = None
    return info


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command that ran this benchmark, as a person would type it from the repository root
    (the script's path relative to it), for the report and the performance page."""
    script, *rest = list(argv if argv is not None else sys.argv)
    path = Path(script).resolve()
    shown = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else script
    return shlex.join([".venv/bin/python", shown, *rest])


def commit() -> str | None:
    """The commit of the checkout measured (None outside a git checkout)."""
    done = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.strip() if done.returncode == 0 else None


def _first_value(path: str, key: str) -> str:
    with contextlib.suppress(OSError):
        for line in Path(path).read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == key:
                return value.strip()
    return "0" if key == "MemTotal" else "unknown"


@dataclass
class Report:
    """What one benchmark found: comparisons, figures against targets, anything else."""

    bench: str
    rounds: int
    warmup: int
    comparisons: list[Comparison] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        return {
            "bench": self.bench,
            "run": RUN,
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started)),
            "seconds": round(time.time() - self.started, 1),
            "command": command_line(),
            "commit": commit(),
            "rounds": self.rounds,
            "warmup": self.warmup,
            "machine": machine(),
            "comparisons": [comparison.to_dict() for comparison in self.comparisons],
            "checks": [check.to_dict() for check in self.checks],
            **self.extra,
        }

    def text(self) -> str:
        lines = [f"{self.bench}: {self.rounds} rounds after {self.warmup} warm-up"]
        rows = [row for comparison in self.comparisons for row in comparison_rows(comparison)]
        if rows:
            lines[0] += ", A and B alternated"
            lines += ["", render(("measurement", "median", "min - max"), rows)]
        if self.checks:
            headers = ("figure", "value", "target", "verdict")
            lines += ["", render(headers, check_rows(self.checks))]
        return "\n".join(lines)

    def write(self, out: Path) -> Path:
        """Print the table and write ``<out>/<bench>.json``; return its path."""
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{self.bench}.json"
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        print(self.text())
        print(f"written to {path}")
        return path
