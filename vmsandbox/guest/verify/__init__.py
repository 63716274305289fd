"""Check from inside a booted guest that the GPUs it was given are there and work.

Five checks (``vmsandbox.guest.verify.checks``), each a constant shell command run over SSH:

- ``pci``: ``lspci -Dnn`` lists exactly the vendor:device ids passed (GPUs and companions), and
  gives the guest address of each host function (``vmsandbox.guest.verify.mapping``);
- ``driver``: the image has the NVIDIA driver (``nvidia-smi``), and which module version runs;
- ``nvidia-smi``: one row per NVIDIA GPU, the expected model and memory, a driver version;
- ``kernel-log``: no NVIDIA Xid errors or failed GPU initialisations in the guest's kernel log;
- ``compute``: ``programs/cuda_smoke.py`` (fed to ``python3 -``) runs a vector add on every GPU
  through the CUDA driver API;
- ``fabric`` (only ``verify(..., fabric=True)``: GPUs that talk over NVLink through NVSwitches,
  a multi-GPU Fabric Manager partition or a whole board): CUDA starts (error 802 is reported as
  "fabric not initialised" with the fix), the NVLinks are up, every GPU pair is on NVLink
  (``vmsandbox.guest.verify.nvlink``).

The NVIDIA checks run when NVIDIA GPUs were passed; an image without the NVIDIA driver skips
them and fails verification (passing NVIDIA GPUs to it is almost always a mistake; ``--no-verify``
is the way to hand a driverless guest to someone who brings their own). ``verify`` returns a
``VerificationReport`` (``vmsandbox.guest.verify.report``); ``raise_if_failed`` turns a failed
one into ``GuestVerificationFailed``. The tools' outputs are read by
``vmsandbox.guest.verify.parse``.

Imports: the rest of ``guest``, ``gpu``, ``host`` and the shared core only.
"""

from __future__ import annotations

from collections.abc import Sequence

from .checks import (
    COMPUTE,
    COMPUTE_TIMEOUT_BASE,
    COMPUTE_TIMEOUT_PER_GPU,
    DRIVER_PROBE,
    KERNEL_LOG,
    LSPCI,
    NO_DRIVER,
    NVIDIA_SMI,
    QUERY_TIMEOUT,
    Findings,
    Runner,
    check_compute,
    check_driver,
    check_fabric,
    check_kernel_log,
    check_nvidia_smi,
    check_pci,
    cuda_smoke_program,
    names_agree,
    skipped,
)
from .mapping import Placement, map_addresses
from .parse import (
    KernelEvent,
    PciFunction,
    SmiResult,
    SmiRow,
    SmokeLine,
    driver_version_of,
    parse_kernel_log,
    parse_lspci,
    parse_nvidia_smi,
    parse_smoke,
)
from .report import (
    FAILED,
    PASSED,
    SKIPPED,
    CheckResult,
    CompanionReport,
    ExpectedGpu,
    GpuReport,
    VerificationReport,
    raise_if_failed,
    render_report,
)

__all__ = [
    "COMPUTE",
    "COMPUTE_TIMEOUT_BASE",
    "COMPUTE_TIMEOUT_PER_GPU",
    "DRIVER_PROBE",
    "FAILED",
    "KERNEL_LOG",
    "LSPCI",
    "NVIDIA_SMI",
    "PASSED",
    "QUERY_TIMEOUT",
    "SKIPPED",
    "CheckResult",
    "CompanionReport",
    "ExpectedGpu",
    "GpuReport",
    "KernelEvent",
    "PciFunction",
    "Placement",
    "Runner",
    "SmiResult",
    "SmiRow",
    "SmokeLine",
    "VerificationReport",
    "cuda_smoke_program",
    "driver_version_of",
    "map_addresses",
    "names_agree",
    "parse_kernel_log",
    "parse_lspci",
    "parse_nvidia_smi",
    "parse_smoke",
    "raise_if_failed",
    "render_report",
    "verify",
]

NO_NVIDIA_GPU = "no NVIDIA GPU passed"
NVIDIA_CHECKS = ("driver", "nvidia-smi", "kernel-log", "compute")


def verify(
    run: Runner, expected: Sequence[ExpectedGpu], *, fabric: bool = False
) -> VerificationReport:
    """Run the checks in the guest behind ``run`` against the GPUs it was given.

    ``expected`` in the order of the domain's ``<hostdev>`` elements (the order the GPUs were
    chosen): guest bus numbers follow it, which is how guest addresses map to host BDFs when
    several GPUs share one model. ``fabric``: the GPUs talk through NVSwitches, so their NVLink
    fabric is checked too.
    """
    gpus = [
        GpuReport(
            gpu=gpu,
            companions=[
                CompanionReport(host_bdf=bdf, vendor_id=ids[0], device_id=ids[1])
                for bdf, ids in zip(gpu.companions, gpu.companion_ids, strict=True)
            ],
        )
        for gpu in expected
    ]
    by_bdf = {gpu.host_bdf: gpu for gpu in gpus}
    pci, placement = check_pci(run, expected)
    findings = [pci]
    if placement is not None:
        for gpu, address, companions in zip(
            gpus, placement.gpus, placement.companions, strict=True
        ):
            gpu.guest_address = address
            for companion, found in zip(gpu.companions, companions, strict=True):
                companion.guest_address = found
    nvidia = [gpu for gpu in gpus if gpu.gpu.is_nvidia]
    identities = [gpu.gpu for gpu in nvidia]
    addresses = [gpu.guest_address for gpu in nvidia]
    driver_version = None
    kernel_events: list[str] = []
    checks = (*NVIDIA_CHECKS, "fabric") if fabric else NVIDIA_CHECKS
    if not nvidia:
        findings += [skipped(name, NO_NVIDIA_GPU) for name in checks]
    else:
        driver, driver_version = check_driver(run)
        findings.append(driver)
        if not driver.passed:
            findings += [skipped(name, NO_DRIVER) for name in checks[1:]]
        else:
            smi, rows, listed = check_nvidia_smi(run, identities, addresses)
            for bdf, row in rows.items():
                gpu = by_bdf[bdf]
                gpu.name, gpu.uuid = row.name, row.uuid
                gpu.memory_mib, gpu.driver_version = row.memory_mib, row.driver_version
            if driver_version is None and listed.rows:
                driver_version = listed.rows[0].driver_version
            kernel, kernel_events = check_kernel_log(run, identities, addresses)
            findings += [smi, kernel]
            if listed.rows:
                compute, passed = check_compute(run, identities, addresses)
                for bdf, ok in passed.items():
                    by_bdf[bdf].compute = PASSED if ok else FAILED
                findings.append(compute)
            else:
                findings.append(skipped("compute", "nvidia-smi failed"))
            if fabric:
                findings.append(check_fabric(run, len(nvidia)))
    return _report(gpus, findings, driver_version, kernel_events)


def _report(
    gpus: list[GpuReport],
    findings: Sequence[Findings],
    driver_version: str | None,
    kernel_events: list[str],
) -> VerificationReport:
    """The checks' findings as one report: problems of the guest first, then GPU by GPU."""
    by_bdf = {gpu.host_bdf: gpu for gpu in gpus}
    for found in findings:
        for bdf, problem in found.gpu_problems:
            by_bdf[bdf].problems.append(problem)
    problems = [problem for found in findings for problem in found.problems]
    for gpu in gpus:
        where = f" (guest {gpu.guest_address})" if gpu.guest_address else ""
        problems.extend(f"GPU {gpu.host_bdf}{where}: {p}" for p in gpu.problems)
    return VerificationReport(
        gpus=gpus,
        checks=[found.check for found in findings],
        problems=problems,
        driver_version=driver_version,
        kernel_events=kernel_events,
    )
