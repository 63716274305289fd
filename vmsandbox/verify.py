"""Check from inside a booted guest that the GPUs it was given are there and work.

Five checks, each a constant shell command run over SSH (nothing from the request is ever put
into a command line):

- ``pci``: ``lspci -Dnn`` lists exactly the vendor:device ids passed (GPUs and companions), and
  gives the guest address of each host function;
- ``driver``: the image has the NVIDIA driver (``nvidia-smi``), and which module version runs;
- ``nvidia-smi``: one row per NVIDIA GPU, the expected model and memory, a driver version;
- ``kernel-log``: no NVIDIA Xid errors or failed GPU initialisations in the guest's kernel log;
- ``compute``: ``guest_tools/cuda_smoke.py`` (fed to ``python3 -``) runs a vector add on every GPU
  through the CUDA driver API.

The NVIDIA checks run when NVIDIA GPUs were passed; an image without the NVIDIA driver skips
them and fails verification (passing NVIDIA GPUs to it is almost always a mistake; ``--no-verify``
is the way to hand a driverless guest to someone who brings their own). ``verify`` returns a
``VerificationReport``; ``raise_if_failed`` turns a failed one into ``GuestVerificationFailed``.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from importlib import resources
from typing import Any, Protocol

from vmsandbox.errors import GuestVerificationFailed, VmSandboxError
from vmsandbox.gpuquery import model_words
from vmsandbox.guest import ExecResult
from vmsandbox.host.model import Gpu

LSPCI = "lspci -Dnn"
DRIVER_PROBE = (
    "if command -v nvidia-smi >/dev/null; then echo 'nvidia-smi: yes'; "
    "else echo 'nvidia-smi: no'; fi; cat /proc/driver/nvidia/version 2>/dev/null || true"
)
NVIDIA_SMI = (
    "nvidia-smi --query-gpu=name,pci.bus_id,uuid,memory.total,driver_version --format=csv,noheader"
)
# dmesg needs root on Debian (kernel.dmesg_restrict); the sandbox user has passwordless sudo.
KERNEL_LOG = "sudo -n dmesg 2>/dev/null || dmesg 2>/dev/null || journalctl -k -b -q --no-pager"
COMPUTE = "python3 -"

QUERY_TIMEOUT = 60.0
# Creating a context on a GPU without persistence mode takes seconds; JIT and the copies little.
COMPUTE_TIMEOUT_BASE = 60.0
COMPUTE_TIMEOUT_PER_GPU = 30.0

# nvidia-smi memory against the host's figure: ECC on GDDR boards hides 1/16 (6.25%) of it.
MEMORY_SLACK_PERCENT = 7

NVIDIA_VENDOR_ID = "10de"
PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"
NO_DRIVER = "image has no NVIDIA driver"
NO_NVIDIA_GPU = "no NVIDIA GPU passed"

_BDF_RE = re.compile(r"([0-9a-f]{1,8}):([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])", re.I)
_LSPCI_RE = re.compile(
    r"(?:(?P<domain>[0-9a-f]{4,8}):)?(?P<bus>[0-9a-f]{2}):(?P<slot>[0-9a-f]{2})\.(?P<fn>[0-7])"
    r" (?P<class_name>.*?) \[(?P<class_id>[0-9a-f]{4})\]: (?P<description>.*)"
    r" \[(?P<vendor>[0-9a-f]{4}):(?P<device>[0-9a-f]{4})\](?: \(rev [0-9a-f]{2}\))?",
    re.I,
)
_MODULE_VERSION_RE = re.compile(r"Kernel Module\s+(\d+(?:\.\d+)+)")
_MEMORY_RE = re.compile(r"(\d+)\s*MiB")
_XID_RE = re.compile(
    r"NVRM: Xid \(PCI:(?P<address>[0-9a-f]{1,8}:[0-9a-f]{2}:[0-9a-f]{2})\): (?P<code>\d+)", re.I
)
_NVRM_GPU_RE = re.compile(r"NVRM: (?:The NVIDIA )?GPU (?P<bdf>[0-9a-f]{1,8}:[0-9a-f:.]+)", re.I)
# Kernel log phrases of a GPU the driver could not bring up (besides Xids): failed
# initialisation, a lost GPU, BARs the guest did not map, a GPU another driver holds.
_NVRM_FATAL = (
    "RmInitAdapter failed",
    "rm_init_adapter failed",
    "fallen off the bus",
    "No NVIDIA GPU found",
    "probe routine failed",
    "probe routine was not called",
    "assigned to your NVIDIA device is invalid",
)
_HANDLE_RE = re.compile(
    r"Unable to determine the device handle for GPU\s*(?:\d+:\s*)?"
    r"(?P<bdf>[0-9a-f]{1,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7])?",
    re.I,
)
# Words with digits that are no model: sizes, memory types and form factors many models share
# ("80GB", "HBM3", "GDDR6X", "SXM5", "PCIe4"), and chip codes ("GH100", "TU102GL"), which pci.ids
# names carry and drivers' names do not.
_NOT_MODEL_WORD_RE = re.compile(
    r"\d+(?:gb|g|gib)|hbm\d*e?|g?ddr\d*x?|sxm\d*|pcie\d*|[a-z]{2}\d{3}[a-z]*"
)
_SMOKE_RE = re.compile(r"(?P<status>PASS|FAIL) (?P<where>\S+) ?(?P<text>.*)")


class Runner(Protocol):
    """Runs one shell command in the guest, e.g. ``functools.partial(guest.run, endpoint, keys)``.

    May raise ``VmSandboxError`` (guest unreachable, timeout): verification records it as the
    failure of the check that ran the command.
    """

    def __call__(
        self, command: str, *, stdin: bytes | None = None, timeout: float | None = None
    ) -> ExecResult: ...


@dataclass(frozen=True)
class ExpectedGpu:
    """A GPU passed to the guest, as the host saw it. Ids are 4 lowercase hex digits."""

    bdf: str
    vendor: str
    vendor_id: str
    device_id: str
    name: str | None = None
    memory_mib: int | None = None
    companions: tuple[str, ...] = ()
    companion_ids: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "vendor_id", _hex4(self.vendor_id))
        object.__setattr__(self, "device_id", _hex4(self.device_id))
        pairs = tuple((_hex4(v), _hex4(d)) for v, d in self.companion_ids)
        object.__setattr__(self, "companion_ids", pairs)

    @property
    def ids(self) -> tuple[str, str]:
        return self.vendor_id, self.device_id

    @property
    def is_nvidia(self) -> bool:
        return self.vendor_id == NVIDIA_VENDOR_ID

    @classmethod
    def from_gpu(cls, gpu: Gpu) -> ExpectedGpu:
        return cls(
            bdf=gpu.bdf,
            vendor=gpu.vendor,
            vendor_id=gpu.vendor_id,
            device_id=gpu.device_id,
            name=gpu.name,
            memory_mib=gpu.memory_mib,
            companions=tuple(gpu.companions),
            companion_ids=tuple(gpu.companion_ids),
        )

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> ExpectedGpu:
        """From the manager's per-GPU record (``Sandbox.gpus``)."""
        return cls(
            bdf=str(record["bdf"]),
            vendor=str(record.get("vendor", "")),
            vendor_id=str(record["vendor_id"]),
            device_id=str(record["device_id"]),
            name=record.get("name"),
            memory_mib=record.get("memory_mib"),
            companions=tuple(record.get("companions", ())),
            companion_ids=tuple(tuple(pair) for pair in record.get("companion_ids", ())),
        )


@dataclass(frozen=True)
class PciFunction:
    """One line of ``lspci -nn``."""

    address: str  # canonical: 0000:01:00.0
    class_name: str
    class_id: str
    description: str
    vendor_id: str
    device_id: str

    @property
    def ids(self) -> tuple[str, str]:
        return self.vendor_id, self.device_id


@dataclass(frozen=True)
class SmiRow:
    """One row of the ``nvidia-smi --query-gpu`` CSV."""

    name: str
    bus_id: str  # canonical
    uuid: str
    memory_mib: int | None
    driver_version: str


@dataclass(frozen=True)
class SmiResult:
    rows: tuple[SmiRow, ...]
    errors: tuple[str, ...]  # lines that are not rows: nvidia-smi's own error messages


@dataclass(frozen=True)
class KernelEvent:
    """A kernel log line that says a GPU is broken (an Xid, a failed initialisation)."""

    address: str | None  # guest domain:bus:slot, lowercase, when the line names one
    xid: int | None
    line: str


@dataclass(frozen=True)
class SmokeLine:
    passed: bool
    bus_id: str | None  # canonical; None for a failure of the driver as a whole
    text: str


@dataclass
class CompanionReport:
    host_bdf: str
    vendor_id: str
    device_id: str
    guest_address: str | None = None


@dataclass
class GpuReport:
    """What verification found for one GPU."""

    host_bdf: str
    vendor: str
    vendor_id: str
    device_id: str
    expected_name: str | None
    expected_memory_mib: int | None
    guest_address: str | None = None
    name: str | None = None
    uuid: str | None = None
    memory_mib: int | None = None
    driver_version: str | None = None
    compute: str = SKIPPED  # passed | failed | skipped
    companions: list[CompanionReport] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GpuReport:
        fields = {key: value for key, value in data.items() if key not in ("ok", "companions")}
        companions = [CompanionReport(**companion) for companion in data.get("companions", [])]
        return cls(**fields, companions=companions)


@dataclass
class CheckResult:
    name: str
    status: str  # passed | failed | skipped
    detail: str = ""


@dataclass
class VerificationReport:
    """The outcome: ``ok`` when no check failed; ``problems`` says what is wrong, GPU by GPU."""

    gpus: list[GpuReport]
    checks: list[CheckResult]
    problems: list[str]
    driver_version: str | None = None
    kernel_events: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def check(self, name: str) -> CheckResult | None:
        return next((check for check in self.checks if check.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "problems": list(self.problems),
            "driver_version": self.driver_version,
            "checks": [asdict(check) for check in self.checks],
            "gpus": [gpu.to_dict() for gpu in self.gpus],
            "kernel_events": list(self.kernel_events),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> VerificationReport:
        """The report ``to_dict`` made (as stored in ``Sandbox.verification``)."""
        return cls(
            gpus=[GpuReport.from_dict(gpu) for gpu in data.get("gpus", [])],
            checks=[CheckResult(**check) for check in data.get("checks", [])],
            problems=list(data.get("problems", [])),
            driver_version=data.get("driver_version"),
            kernel_events=list(data.get("kernel_events", [])),
        )


# -- parsers ------------------------------------------------------------------------------------


def parse_lspci(text: str) -> list[PciFunction]:
    """The functions in ``lspci -nn`` (or ``-Dnn``) output; lines of other shapes are ignored."""
    found = []
    for line in text.splitlines():
        match = _LSPCI_RE.fullmatch(line.strip())
        if match is None:
            continue
        address = (
            f"{int(match['domain'] or '0', 16):04x}:{match['bus']}:{match['slot']}.{match['fn']}"
        )
        found.append(
            PciFunction(
                address=address.lower(),
                class_name=match["class_name"],
                class_id=match["class_id"].lower(),
                description=match["description"],
                vendor_id=match["vendor"].lower(),
                device_id=match["device"].lower(),
            )
        )
    return found


def parse_nvidia_smi(text: str) -> SmiResult:
    """Rows of ``--query-gpu=name,pci.bus_id,uuid,memory.total,driver_version`` CSV output;
    every other non-empty line is kept as an error message."""
    rows, errors = [], []
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = next(csv.reader([line], skipinitialspace=True))
        bus_id = canonical_bdf(fields[1]) if len(fields) == 5 else None
        if bus_id is None:
            errors.append(line.strip())
            continue
        memory = _MEMORY_RE.fullmatch(fields[3].strip())
        rows.append(
            SmiRow(
                name=fields[0].strip(),
                bus_id=bus_id,
                uuid=fields[2].strip(),
                memory_mib=int(memory[1]) if memory else None,
                driver_version=fields[4].strip(),
            )
        )
    return SmiResult(rows=tuple(rows), errors=tuple(errors))


def parse_kernel_log(text: str) -> tuple[list[KernelEvent], list[str]]:
    """GPU failures in ``dmesg``/``journalctl -k`` output, and every NVRM line (for context).

    Failures: Xid lines and the phrases of ``_NVRM_FATAL``, each given the GPU named on its line
    or on the last ``NVRM: [The NVIDIA] GPU <bdf>`` line before it (the driver splits some
    messages over several lines).
    """
    events: list[KernelEvent] = []
    nvrm: list[str] = []
    last_gpu: str | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if "NVRM:" not in line:
            continue
        nvrm.append(line)
        if xid := _XID_RE.search(line):
            address = _short_address(xid["address"])
            events.append(KernelEvent(address=address, xid=int(xid["code"]), line=line))
            continue
        if gpu := _NVRM_GPU_RE.search(line):
            last_gpu = _short_address(gpu["bdf"])
        if any(marker in line for marker in _NVRM_FATAL):
            events.append(KernelEvent(address=last_gpu, xid=None, line=line))
    return events, nvrm


def parse_smoke(text: str) -> list[SmokeLine]:
    """The PASS/FAIL lines of ``cuda_smoke.py``."""
    found = []
    for line in text.splitlines():
        match = _SMOKE_RE.fullmatch(line.strip())
        if match is None:
            continue
        where = match["where"]
        found.append(
            SmokeLine(
                passed=match["status"] == "PASS",
                bus_id=canonical_bdf(where) if where != "-" else None,
                text=match["text"] or where,
            )
        )
    return found


def driver_version_of(proc_version: str) -> str | None:
    """The module version in ``/proc/driver/nvidia/version``."""
    match = _MODULE_VERSION_RE.search(proc_version)
    return match[1] if match else None


def canonical_bdf(text: str) -> str | None:
    """``0000:01:00.0`` from any domain width or case (``00000000:01:00.0``); None if not one."""
    match = _BDF_RE.fullmatch(text.strip())
    if match is None:
        return None
    domain, bus, slot, function = match.groups()
    return f"{int(domain, 16):04x}:{bus.lower()}:{slot.lower()}.{function}"


def names_agree(expected: str | None, reported: str) -> bool:
    """Whether two names of one GPU model agree: they share a model word (a word with a digit
    that is not a memory size, memory type, form factor or chip code: "H100", "2080", "T4"), or
    one of them has none to compare.

    Loose on purpose: the host may name a GPU after pci.ids ("GH100 [H100 SXM5 80GB]") and the
    guest driver after its marketing name ("NVIDIA H100 80GB HBM3"); the PCI ids, checked
    exactly by the pci check, are what pins the model down.
    """
    if not expected:
        return True
    want = {word for word in model_words(expected) if _is_model_word(word)}
    have = {word for word in model_words(reported) if _is_model_word(word)}
    return not want or not have or bool(want & have)


def cuda_smoke_program() -> bytes:
    """The compute smoke program shipped to guests."""
    return resources.files("vmsandbox.guest_tools").joinpath("cuda_smoke.py").read_bytes()


# -- verification -------------------------------------------------------------------------------


def verify(run: Runner, expected: Sequence[ExpectedGpu]) -> VerificationReport:
    """Run the checks in the guest behind ``run`` against the GPUs it was given.

    ``expected`` in the order of the domain's ``<hostdev>`` elements (the order the GPUs were
    chosen): guest bus numbers follow it, which is how guest addresses map to host BDFs when
    several GPUs share one model.
    """
    gpus = [
        GpuReport(
            host_bdf=gpu.bdf,
            vendor=gpu.vendor,
            vendor_id=gpu.vendor_id,
            device_id=gpu.device_id,
            expected_name=gpu.name,
            expected_memory_mib=gpu.memory_mib,
            companions=[
                CompanionReport(host_bdf=bdf, vendor_id=ids[0], device_id=ids[1])
                for bdf, ids in zip(gpu.companions, gpu.companion_ids, strict=True)
            ],
        )
        for gpu in expected
    ]
    report = VerificationReport(gpus=gpus, checks=[], problems=[])
    _check_pci(run, report, expected)
    nvidia = [gpu for gpu, want in zip(gpus, expected, strict=True) if want.is_nvidia]
    if not nvidia:
        for name in ("driver", "nvidia-smi", "kernel-log", "compute"):
            report.checks.append(CheckResult(name, SKIPPED, NO_NVIDIA_GPU))
    elif _check_driver(run, report):
        smi_ok = _check_nvidia_smi(run, report, nvidia)
        _check_kernel_log(run, report, nvidia)
        if smi_ok:
            _check_compute(run, report, nvidia)
        else:
            report.checks.append(CheckResult("compute", SKIPPED, "nvidia-smi failed"))
    else:
        for name in ("nvidia-smi", "kernel-log", "compute"):
            report.checks.append(CheckResult(name, SKIPPED, NO_DRIVER))
    for gpu in gpus:
        where = f" (guest {gpu.guest_address})" if gpu.guest_address else ""
        report.problems.extend(f"GPU {gpu.host_bdf}{where}: {p}" for p in gpu.problems)
    return report


def raise_if_failed(
    report: VerificationReport, *, subject: str = "", details: Mapping[str, Any] | None = None
) -> None:
    """Raise ``GuestVerificationFailed`` (FAILED_PRECONDITION) when ``report`` failed, its first
    problems in the message (after ``subject``, e.g. "sandbox 'job-42'") and the report in
    ``details["verification"]`` beside any other ``details``."""
    if report.ok:
        return
    shown = report.problems[:5]
    more = len(report.problems) - len(shown)
    raise GuestVerificationFailed(
        (f"{subject}: " if subject else "")
        + "GPU verification in the guest failed: "
        + "; ".join(shown)
        + (f"; and {more} more" if more else ""),
        details={**(details or {}), "verification": report.to_dict()},
    )


def render_report(report: VerificationReport) -> str:
    """A table of the GPUs, the checks that ran or were skipped, and the problems."""
    lines = []
    if report.gpus:
        header = ("GPU", "GUEST", "NAME", "MEMORY", "DRIVER", "COMPUTE", "STATUS")
        rows = [
            (
                gpu.host_bdf,
                gpu.guest_address or "-",
                gpu.name or gpu.expected_name or "-",
                f"{gpu.memory_mib} MiB" if gpu.memory_mib is not None else "-",
                gpu.driver_version or "-",
                gpu.compute,
                "ok" if gpu.ok else "FAILED",
            )
            for gpu in report.gpus
        ]
        widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
        lines.extend(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
            for row in (header, *rows)
        )
    for check in report.checks:
        detail = f" ({check.detail})" if check.detail else ""
        lines.append(f"{check.name}: {check.status}{detail}")
    lines.extend(f"problem: {problem}" for problem in report.problems)
    lines.append("verification: " + ("ok" if report.ok else "FAILED"))
    return "\n".join(line.rstrip() for line in lines) + "\n"


# -- the checks ---------------------------------------------------------------------------------


def _run(
    run: Runner, report: VerificationReport, check: str, command: str, **kwargs: Any
) -> ExecResult | None:
    """``run(command)``, or None with the check failed when the guest could not run it."""
    try:
        return run(command, **kwargs)
    except VmSandboxError as exc:
        report.checks.append(CheckResult(check, FAILED, exc.message))
        report.problems.append(f"{check}: could not run {command.split()[0]!r}: {exc.message}")
        return None


def _check_pci(run: Runner, report: VerificationReport, expected: Sequence[ExpectedGpu]) -> None:
    if not expected:
        report.checks.append(CheckResult("pci", SKIPPED, "no GPU passed"))
        return
    result = _run(run, report, "pci", LSPCI, timeout=QUERY_TIMEOUT)
    if result is None:
        return
    functions = parse_lspci(result.stdout)
    if result.exit_status != 0 or not functions:
        detail = _first_line(result.stderr or result.stdout) or f"exit {result.exit_status}"
        report.checks.append(CheckResult("pci", FAILED, f"lspci failed: {detail}"))
        report.problems.append(f"pci: lspci -nn gave no PCI devices in the guest ({detail})")
        return
    _map_addresses(report.gpus, functions)
    wanted: dict[tuple[str, str], int] = {}
    for gpu in expected:
        for ids in (gpu.ids, *gpu.companion_ids):
            wanted[ids] = wanted.get(ids, 0) + 1
    counts_ok = True
    for ids, count in wanted.items():
        seen = sum(1 for function in functions if function.ids == ids)
        if seen != count:
            counts_ok = False
            report.problems.append(
                f"pci: the guest shows {seen} function(s) [{ids[0]}:{ids[1]}], expected {count}"
            )
    for gpu in report.gpus:
        if gpu.guest_address is None:
            gpu.problems.append(
                f"not in the guest's lspci (no [{gpu.vendor_id}:{gpu.device_id}] left to match)"
            )
        for companion in gpu.companions:
            if companion.guest_address is None:
                gpu.problems.append(
                    f"companion {companion.host_bdf} [{companion.vendor_id}:"
                    f"{companion.device_id}] is not in the guest's lspci"
                )
    ok = counts_ok and all(
        gpu.guest_address and all(c.guest_address for c in gpu.companions) for gpu in report.gpus
    )
    passed = sum(1 for gpu in report.gpus if gpu.guest_address)
    report.checks.append(
        CheckResult("pci", PASSED if ok else FAILED, f"{passed} of {len(report.gpus)} GPUs seen")
    )


def _map_addresses(gpus: Sequence[GpuReport], functions: Sequence[PciFunction]) -> None:
    """Give each GPU and companion its guest address.

    ``vmsandbox.passthrough`` puts GPU k (in hostdev order) behind its own root port, after the
    domain's other ports, so the GPUs sit on consecutive guest buses: GPU k at ``base + k``,
    slot 00, even when a GPU before it failed to show up (its empty port keeps its bus). The
    base is the one under which most GPUs are where their ids say; ties go to the base the root
    ports predict (one bus per port, the GPUs' ports last). GPUs left over take the free
    functions with their ids in address order. A companion sits in its GPU's guest slot with
    its host function number, or else takes the first free function with its ids.
    """
    free = sorted(functions, key=lambda function: function.address)
    wanted = [(gpu.vendor_id, gpu.device_id) for gpu in gpus]
    by_bus = {int(f.address[5:7], 16): f for f in free if f.address.startswith("0000:")}
    by_bus = {bus: f for bus, f in by_bus.items() if f.address.endswith(":00.0")}
    ports = sum(1 for f in free if f.class_id == "0604" and f.address.startswith("0000:00:"))
    predicted = ports - len(gpus) + 1

    def placed(base: int) -> int:
        return sum(1 for k, ids in enumerate(wanted) if _ids_at(by_bus, base + k) == ids)

    bases = {bus - k for k, ids in enumerate(wanted) for bus, f in by_bus.items() if f.ids == ids}
    if bases:
        base = max(sorted(bases), key=lambda b: (placed(b), b == predicted))
        for k, gpu in enumerate(gpus):
            if _ids_at(by_bus, base + k) == wanted[k]:
                gpu.guest_address = by_bus[base + k].address
                free.remove(by_bus[base + k])
    for gpu in gpus:
        if gpu.guest_address is None:
            match = next((f for f in free if f.ids == (gpu.vendor_id, gpu.device_id)), None)
            if match is not None:
                gpu.guest_address = match.address
                free.remove(match)
    for gpu in gpus:
        for companion in gpu.companions:
            ids = (companion.vendor_id, companion.device_id)
            candidates = [f for f in free if f.ids == ids]
            if gpu.guest_address is not None:
                slot_address = gpu.guest_address[:-1] + companion.host_bdf[-1]
                candidates = [f for f in candidates if f.address == slot_address] or candidates
            if candidates:
                companion.guest_address = candidates[0].address
                free.remove(candidates[0])


def _ids_at(by_bus: Mapping[int, PciFunction], bus: int) -> tuple[str, str] | None:
    function = by_bus.get(bus)
    return function.ids if function else None


def _check_driver(run: Runner, report: VerificationReport) -> bool:
    """Whether the image has the NVIDIA driver; notes the module version when it is loaded."""
    result = _run(run, report, "driver", DRIVER_PROBE, timeout=QUERY_TIMEOUT)
    if result is None:
        return False
    if "nvidia-smi: yes" not in result.stdout:
        report.checks.append(CheckResult("driver", FAILED, NO_DRIVER))
        report.problems.append(
            f"driver: NVIDIA GPUs were passed but the {NO_DRIVER} (nvidia-smi is missing); "
            "use an image with the driver (e.g. --image nvidia) or create with --no-verify"
        )
        return False
    # nvidia-smi loads the module itself (through nvidia-modprobe) when udev has not yet.
    report.driver_version = driver_version_of(result.stdout)
    loaded = f"module {report.driver_version}" if report.driver_version else "module not loaded yet"
    report.checks.append(CheckResult("driver", PASSED, f"nvidia-smi installed, {loaded}"))
    return True


def _check_nvidia_smi(run: Runner, report: VerificationReport, gpus: Sequence[GpuReport]) -> bool:
    """One row per GPU with the expected model and memory; True when nvidia-smi listed any."""
    result = _run(run, report, "nvidia-smi", NVIDIA_SMI, timeout=QUERY_TIMEOUT)
    if result is None:
        return False
    parsed = parse_nvidia_smi(result.stdout + "\n" + result.stderr)
    handle_errors: dict[str | None, str] = {}
    general = []
    for line in parsed.errors:
        handle = _HANDLE_RE.search(line)
        if handle and handle["bdf"]:
            handle_errors[canonical_bdf(handle["bdf"])] = line
        else:
            general.append(line)
    by_bus = {row.bus_id: row for row in parsed.rows}
    problems_before = sum(len(gpu.problems) for gpu in gpus)
    for gpu in gpus:
        row = by_bus.get(gpu.guest_address or "")
        if row is None:
            reason = handle_errors.get(gpu.guest_address) or "; ".join(general[:2])
            gpu.problems.append("nvidia-smi does not list it" + (f": {reason}" if reason else ""))
            continue
        gpu.name, gpu.uuid = row.name, row.uuid
        gpu.memory_mib, gpu.driver_version = row.memory_mib, row.driver_version
        if not names_agree(gpu.expected_name, row.name):
            gpu.problems.append(
                f"nvidia-smi names it {row.name!r}, the host inventory {gpu.expected_name!r}"
            )
        if not _memory_agrees(gpu.expected_memory_mib, row.memory_mib):
            gpu.problems.append(
                f"nvidia-smi reports {row.memory_mib} MiB, the host inventory "
                f"{gpu.expected_memory_mib} MiB"
            )
    known = {gpu.guest_address for gpu in gpus}
    extra = [row for row in parsed.rows if row.bus_id not in known]
    report.problems.extend(
        f"nvidia-smi: lists a GPU at {row.bus_id} ({row.name}) that was not passed" for row in extra
    )
    if parsed.rows and report.driver_version is None:
        report.driver_version = parsed.rows[0].driver_version
    failed = extra or sum(len(gpu.problems) for gpu in gpus) > problems_before
    listed = sum(1 for gpu in gpus if gpu.name is not None)
    detail = f"{listed} of {len(gpus)} GPUs listed"
    if not parsed.rows and general:
        detail += f": {general[0]}"
    report.checks.append(CheckResult("nvidia-smi", FAILED if failed else PASSED, detail))
    return bool(parsed.rows)


def _check_kernel_log(run: Runner, report: VerificationReport, gpus: Sequence[GpuReport]) -> None:
    result = _run(run, report, "kernel-log", KERNEL_LOG, timeout=QUERY_TIMEOUT)
    if result is None:
        return
    if result.exit_status != 0 and not result.stdout.strip():
        detail = _first_line(result.stderr) or f"exit {result.exit_status}"
        report.checks.append(CheckResult("kernel-log", SKIPPED, f"cannot read it: {detail}"))
        return
    events, nvrm = parse_kernel_log(result.stdout)
    report.kernel_events = nvrm[-40:]
    by_slot = {gpu.guest_address[:-2]: gpu for gpu in gpus if gpu.guest_address}
    for event in events:
        gpu = by_slot.get(event.address or "")
        if gpu is not None:
            gpu.problems.append(f"kernel log: {_strip_timestamp(event.line)}")
        else:
            report.problems.append(f"kernel-log: {_strip_timestamp(event.line)}")
    xids = sum(1 for event in events if event.xid is not None)
    detail = f"{xids} Xid error(s), {len(events) - xids} other GPU failure(s)" if events else ""
    report.checks.append(CheckResult("kernel-log", FAILED if events else PASSED, detail))


def _check_compute(run: Runner, report: VerificationReport, gpus: Sequence[GpuReport]) -> None:
    timeout = COMPUTE_TIMEOUT_BASE + COMPUTE_TIMEOUT_PER_GPU * len(gpus)
    result = _run(run, report, "compute", COMPUTE, stdin=cuda_smoke_program(), timeout=timeout)
    if result is None:
        for gpu in gpus:
            gpu.compute = FAILED
        return
    lines = parse_smoke(result.stdout)
    by_bus = {line.bus_id: line for line in lines if line.bus_id}
    general = [line.text for line in lines if line.bus_id is None]
    for gpu in gpus:
        line = by_bus.get(gpu.guest_address or "")
        if line is not None and line.passed:
            gpu.compute = PASSED
            continue
        gpu.compute = FAILED
        if line is not None:
            reason = line.text
        elif general:
            reason = general[0]
        else:
            reason = _first_line(result.stderr) or f"no result (exit {result.exit_status})"
        gpu.problems.append(f"compute test failed: {reason}")
    passed = sum(1 for gpu in gpus if gpu.compute == PASSED)
    ok = passed == len(gpus) and result.exit_status == 0
    if passed == len(gpus) and result.exit_status != 0:
        report.problems.append(
            f"compute: the smoke test exited {result.exit_status}: "
            + (_first_line(result.stderr) or "; ".join(general) or "no reason given")
        )
    report.checks.append(
        CheckResult("compute", PASSED if ok else FAILED, f"{passed} of {len(gpus)} GPUs passed")
    )


# -- helpers ------------------------------------------------------------------------------------


def _hex4(value: str) -> str:
    return value.strip().lower().removeprefix("0x").zfill(4)


def _short_address(text: str) -> str:
    """``domain:bus:slot`` of a PCI address, domain as 4 digits (Xid lines name no function)."""
    parts = text.lower().split(":")
    return f"{int(parts[0], 16):04x}:{parts[1]}:{parts[2][:2]}"


def _is_model_word(word: str) -> bool:
    return any(ch.isdigit() for ch in word) and _NOT_MODEL_WORD_RE.fullmatch(word) is None


def _memory_agrees(expected: int | None, reported: int | None) -> bool:
    if expected is None or reported is None:
        return True
    return abs(expected - reported) * 100 <= expected * MEMORY_SLACK_PERCENT


def _strip_timestamp(line: str) -> str:
    """A kernel log line without dmesg's ``[ 12.345678]`` or journalctl's host prefix."""
    return line[line.index("NVRM:") :] if "NVRM:" in line else line


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")
