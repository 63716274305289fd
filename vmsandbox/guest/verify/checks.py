"""The checks run in the guest, each a constant shell command (nothing from the request is ever
put into a command line) whose output is judged by a pure function.

A check returns its ``Findings`` (its result line, problems of the guest as a whole, problems
of single GPUs by host address) and the facts it read; ``vmsandbox.guest.verify.verify`` puts them
together into the report. No check changes anything shared.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, Protocol

from vmsandbox.errors import VmSandboxError
from vmsandbox.gpu.request import model_words
from vmsandbox.guest.ssh import ExecResult
from vmsandbox.host.bdf import slot_of

from .mapping import Placement, map_addresses
from .parse import (
    SmiResult,
    SmiRow,
    driver_version_of,
    first_line,
    handle_error_bdf,
    parse_kernel_log,
    parse_lspci,
    parse_nvidia_smi,
    parse_smoke,
    strip_timestamp,
)
from .report import FAILED, PASSED, SKIPPED, CheckResult, ExpectedGpu, ids_text

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
KERNEL_EVENTS_KEPT = 40

NO_DRIVER = "image has no NVIDIA driver"

# Words with digits that are no model: sizes, memory types and form factors many models share
# ("80GB", "HBM3", "GDDR6X", "SXM5", "PCIe4"), and chip codes ("GH100", "TU102GL"), which pci.ids
# names carry and drivers' names do not.
_NOT_MODEL_WORD_RE = re.compile(
    r"\d+(?:gb|g|gib)|hbm\d*e?|g?ddr\d*x?|sxm\d*|pcie\d*|[a-z]{2}\d{3}[a-z]*"
)


class Runner(Protocol):
    """Runs one shell command in the guest, e.g. ``functools.partial(guest.run, endpoint, keys)``.

    May raise ``VmSandboxError`` (guest unreachable, timeout): verification records it as the
    failure of the check that ran the command.
    """

    def __call__(
        self, command: str, *, stdin: bytes | None = None, timeout: float | None = None
    ) -> ExecResult: ...


@dataclass(frozen=True)
class Findings:
    """What one check found: its result, problems of the guest as a whole, and problems of
    single GPUs as (host BDF, problem)."""

    check: CheckResult
    problems: tuple[str, ...] = ()
    gpu_problems: tuple[tuple[str, str], ...] = ()

    @property
    def passed(self) -> bool:
        return self.check.status == PASSED


def skipped(name: str, why: str) -> Findings:
    return Findings(CheckResult(name, SKIPPED, why))


def _run(run: Runner, check: str, command: str, **kwargs: Any) -> ExecResult | Findings:
    """``run(command)``, or the check's failure when the guest could not run it."""
    try:
        return run(command, **kwargs)
    except VmSandboxError as exc:
        return Findings(
            CheckResult(check, FAILED, exc.message),
            problems=(f"{check}: could not run {command.split()[0]!r}: {exc.message}",),
        )


def check_pci(run: Runner, gpus: Sequence[ExpectedGpu]) -> tuple[Findings, Placement | None]:
    """``lspci`` lists exactly the vendor:device ids passed (GPUs and companions), and where."""
    if not gpus:
        return skipped("pci", "no GPU passed"), None
    result = _run(run, "pci", LSPCI, timeout=QUERY_TIMEOUT)
    if isinstance(result, Findings):
        return result, None
    functions = parse_lspci(result.stdout)
    if result.exit_status != 0 or not functions:
        detail = first_line(result.stderr or result.stdout) or f"exit {result.exit_status}"
        return Findings(
            CheckResult("pci", FAILED, f"lspci failed: {detail}"),
            problems=(f"pci: lspci -nn gave no PCI devices in the guest ({detail})",),
        ), None
    placement = map_addresses(gpus, functions)
    wanted: dict[tuple[str, str], int] = {}
    for gpu in gpus:
        for ids in (gpu.ids, *gpu.companion_ids):
            wanted[ids] = wanted.get(ids, 0) + 1
    problems = []
    for ids, count in wanted.items():
        seen = sum(1 for function in functions if function.ids == ids)
        if seen != count:
            problems.append(
                f"pci: the guest shows {seen} function(s) {ids_text(*ids)}, expected {count}"
            )
    gpu_problems = []
    for gpu, address, companions in zip(gpus, placement.gpus, placement.companions, strict=True):
        if address is None:
            gpu_problems.append(
                (gpu.bdf, f"not in the guest's lspci (no {ids_text(*gpu.ids)} left to match)")
            )
        for bdf, ids, found in zip(gpu.companions, gpu.companion_ids, companions, strict=True):
            if found is None:
                gpu_problems.append(
                    (gpu.bdf, f"companion {bdf} {ids_text(*ids)} is not in the guest's lspci")
                )
    seen_gpus = sum(1 for address in placement.gpus if address)
    ok = not problems and not gpu_problems
    detail = f"{seen_gpus} of {len(gpus)} GPUs seen"
    return Findings(
        CheckResult("pci", PASSED if ok else FAILED, detail), tuple(problems), tuple(gpu_problems)
    ), placement


def check_driver(run: Runner) -> tuple[Findings, str | None]:
    """Whether the image has the NVIDIA driver (the check passes), and the module version when
    the module is loaded."""
    result = _run(run, "driver", DRIVER_PROBE, timeout=QUERY_TIMEOUT)
    if isinstance(result, Findings):
        return result, None
    if "nvidia-smi: yes" not in result.stdout:
        return Findings(
            CheckResult("driver", FAILED, NO_DRIVER),
            problems=(
                f"driver: NVIDIA GPUs were passed but the {NO_DRIVER} (nvidia-smi is missing); "
                "use an image with the driver (e.g. --image nvidia) or create with --no-verify",
            ),
        ), None
    # nvidia-smi loads the module itself (through nvidia-modprobe) when udev has not yet.
    version = driver_version_of(result.stdout)
    loaded = f"module {version}" if version else "module not loaded yet"
    return Findings(CheckResult("driver", PASSED, f"nvidia-smi installed, {loaded}")), version


def check_nvidia_smi(
    run: Runner, gpus: Sequence[ExpectedGpu], addresses: Sequence[str | None]
) -> tuple[Findings, dict[str, SmiRow], SmiResult]:
    """One row per GPU with the expected model and memory; the rows by host BDF, and all that
    nvidia-smi printed."""
    result = _run(run, "nvidia-smi", NVIDIA_SMI, timeout=QUERY_TIMEOUT)
    if isinstance(result, Findings):
        return result, {}, SmiResult((), ())
    parsed = parse_nvidia_smi(result.stdout + "\n" + result.stderr)
    handle_errors: dict[str, str] = {}
    general = []
    for line in parsed.errors:
        bdf = handle_error_bdf(line)
        if bdf:
            handle_errors[bdf] = line
        else:
            general.append(line)
    by_bus = {row.bus_id: row for row in parsed.rows}
    rows: dict[str, SmiRow] = {}
    gpu_problems = []
    for gpu, address in zip(gpus, addresses, strict=True):
        row = by_bus.get(address or "")
        if row is None:
            reason = handle_errors.get(address or "") or "; ".join(general[:2])
            gpu_problems.append(
                (gpu.bdf, "nvidia-smi does not list it" + (f": {reason}" if reason else ""))
            )
            continue
        rows[gpu.bdf] = row
        if not names_agree(gpu.name, row.name):
            gpu_problems.append(
                (gpu.bdf, f"nvidia-smi names it {row.name!r}, the host inventory {gpu.name!r}")
            )
        if not _memory_agrees(gpu.memory_mib, row.memory_mib):
            gpu_problems.append(
                (
                    gpu.bdf,
                    f"nvidia-smi reports {row.memory_mib} MiB, the host inventory "
                    f"{gpu.memory_mib} MiB",
                )
            )
    known = set(addresses)
    problems = tuple(
        f"nvidia-smi: lists a GPU at {row.bus_id} ({row.name}) that was not passed"
        for row in parsed.rows
        if row.bus_id not in known
    )
    detail = f"{len(rows)} of {len(gpus)} GPUs listed"
    if not parsed.rows and general:
        detail += f": {general[0]}"
    status = FAILED if problems or gpu_problems else PASSED
    findings = Findings(CheckResult("nvidia-smi", status, detail), problems, tuple(gpu_problems))
    return findings, rows, parsed


def check_kernel_log(
    run: Runner, gpus: Sequence[ExpectedGpu], addresses: Sequence[str | None]
) -> tuple[Findings, list[str]]:
    """No Xid errors or failed GPU initialisations; the last NVRM lines, for context."""
    result = _run(run, "kernel-log", KERNEL_LOG, timeout=QUERY_TIMEOUT)
    if isinstance(result, Findings):
        return result, []
    if result.exit_status != 0 and not result.stdout.strip():
        detail = first_line(result.stderr) or f"exit {result.exit_status}"
        return skipped("kernel-log", f"cannot read it: {detail}"), []
    events, nvrm = parse_kernel_log(result.stdout)
    by_slot = {
        slot_of(address): gpu.bdf for gpu, address in zip(gpus, addresses, strict=True) if address
    }
    problems, gpu_problems = [], []
    for event in events:
        bdf = by_slot.get(event.address or "")
        if bdf is not None:
            gpu_problems.append((bdf, f"kernel log: {strip_timestamp(event.line)}"))
        else:
            problems.append(f"kernel-log: {strip_timestamp(event.line)}")
    xids = sum(1 for event in events if event.xid is not None)
    detail = f"{xids} Xid error(s), {len(events) - xids} other GPU failure(s)" if events else ""
    check = CheckResult("kernel-log", FAILED if events else PASSED, detail)
    return Findings(check, tuple(problems), tuple(gpu_problems)), nvrm[-KERNEL_EVENTS_KEPT:]


def check_fabric(run: Runner, gpus: int) -> Findings:
    """The NVLink fabric of a guest whose ``gpus`` GPUs talk through NVSwitches
    (``nvlink``): CUDA starts (802 is "fabric not initialised", with the fix), every GPU's
    links are up and every GPU pair is connected over NVLink."""
    from . import nvlink

    findings = nvlink.check(run, gpus)
    failed = [finding for finding in findings if not finding.ok]
    detail = "; ".join(f"{finding.check}: {finding.message}" for finding in failed or findings)
    problems = tuple(f"fabric: {finding.check}: {finding.message}" for finding in failed)
    return Findings(CheckResult("fabric", FAILED if failed else PASSED, detail), problems)


def check_compute(
    run: Runner, gpus: Sequence[ExpectedGpu], addresses: Sequence[str | None]
) -> tuple[Findings, dict[str, bool]]:
    """``programs/cuda_smoke.py`` (fed to ``python3 -``) runs a vector add on every GPU
    through the CUDA driver API; whether it passed, by host BDF."""
    timeout = COMPUTE_TIMEOUT_BASE + COMPUTE_TIMEOUT_PER_GPU * len(gpus)
    result = _run(run, "compute", COMPUTE, stdin=cuda_smoke_program(), timeout=timeout)
    if isinstance(result, Findings):
        return result, {gpu.bdf: False for gpu in gpus}
    lines = parse_smoke(result.stdout)
    by_bus = {line.bus_id: line for line in lines if line.bus_id}
    general = [line.text for line in lines if line.bus_id is None]
    passed: dict[str, bool] = {}
    gpu_problems = []
    for gpu, address in zip(gpus, addresses, strict=True):
        line = by_bus.get(address or "")
        passed[gpu.bdf] = line is not None and line.passed
        if passed[gpu.bdf]:
            continue
        if line is not None:
            reason = line.text
        elif general:
            reason = general[0]
        else:
            reason = first_line(result.stderr) or f"no result (exit {result.exit_status})"
        gpu_problems.append((gpu.bdf, f"compute test failed: {reason}"))
    count = sum(passed.values())
    problems = []
    if count == len(gpus) and result.exit_status != 0:
        problems.append(
            f"compute: the smoke test exited {result.exit_status}: "
            + (first_line(result.stderr) or "; ".join(general) or "no reason given")
        )
    ok = count == len(gpus) and result.exit_status == 0
    check = CheckResult("compute", PASSED if ok else FAILED, f"{count} of {len(gpus)} GPUs passed")
    return Findings(check, tuple(problems), tuple(gpu_problems)), passed


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
    return resources.files("vmsandbox.guest.programs").joinpath("cuda_smoke.py").read_bytes()


def _is_model_word(word: str) -> bool:
    return any(ch.isdigit() for ch in word) and _NOT_MODEL_WORD_RE.fullmatch(word) is None


def _memory_agrees(expected: int | None, reported: int | None) -> bool:
    if expected is None or reported is None:
        return True
    return abs(expected - reported) * 100 <= expected * MEMORY_SLACK_PERCENT
