"""In-guest checks of a fabric guest: are the NVLinks of its partition up, and did CUDA start?

``check(run, expected_gpus)`` runs three constant commands in the guest and returns findings:

- ``nvidia-smi nvlink --status``: per GPU, each link's speed or ``<inactive>``; every GPU of a
  multi-GPU partition must have links, all of them active;
- ``nvidia-smi topo -m``: every pair of GPUs must be connected by ``NV#`` (a bonded set of #
  NVLinks), not by a PCIe path (``SYS``, ``NODE``, ``PHB``, ``PXB``, ``PIX``);
- ``cuInit`` through ``libcuda.so.1``: CUDA error 802 (``CUDA_ERROR_SYSTEM_NOT_READY``, "system
  not yet initialized") on an NVSwitch GPU means its fabric was not set up for it.

A guest with one GPU has no NVLink to check, so only CUDA is probed there.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from vmsandbox.errors import VmSandboxError
from vmsandbox.guest.ssh import ExecResult

NVLINK_STATUS = "nvidia-smi nvlink --status"
TOPOLOGY = "nvidia-smi topo -m"
CUDA_INIT = "python3 -c \"import ctypes; print('cuInit', ctypes.CDLL('libcuda.so.1').cuInit(0))\""
QUERY_TIMEOUT = 60.0
SYSTEM_NOT_READY = 802
FABRIC_NOT_INITIALISED = (
    "fabric not initialised: CUDA error 802 (system not yet initialized) means the NVSwitch "
    "fabric was not set up for this guest's GPUs; in shared NVSwitch mode check that Fabric "
    "Manager runs with FABRIC_MODE=1 and activated this sandbox's partition (fmpm -l), and in "
    "full passthrough that nvidia-fabricmanager runs inside the guest, at the driver's release"
)
_802 = re.compile(
    r"\b802\b|system not yet initiali[sz]ed|cudaErrorSystemNotReady|CUDA_ERROR_SYSTEM_NOT_READY",
    re.IGNORECASE,
)
_GPU_LINE = re.compile(r"^GPU (\d+): (.*?)(?: \(UUID: (\S+)\))?\s*$")
_LINK_LINE = re.compile(r"^\s*Link (\d+): (.+?)\s*$")
_DEVICE = re.compile(r"^(GPU|NIC)\d+$")
# nvidia-smi underlines the matrix's header (ESC[4m ... ESC[0m), also when not on a terminal.
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class Runner(Protocol):
    """Runs one shell command in the guest (as ``vmsandbox.guest.verify.Runner``)."""

    def __call__(
        self, command: str, *, stdin: bytes | None = None, timeout: float | None = None
    ) -> ExecResult: ...


@dataclass(frozen=True)
class GpuLinks:
    """One GPU of ``nvidia-smi nvlink --status``: link number -> GB/s, None when inactive."""

    index: int
    name: str
    uuid: str | None
    links: dict[int, float | None]

    @property
    def active(self) -> list[int]:
        return [link for link, speed in self.links.items() if speed is not None]

    @property
    def inactive(self) -> list[int]:
        return [link for link, speed in self.links.items() if speed is None]


@dataclass(frozen=True)
class Finding:
    """One result: ``check`` names the command's concern, ``ok`` whether it passed."""

    check: str
    ok: bool
    message: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_nvlink_status(text: str) -> list[GpuLinks]:
    """The GPUs and links of ``nvidia-smi nvlink --status`` (``-s``)."""
    gpus: list[GpuLinks] = []
    for line in text.splitlines():
        if match := _GPU_LINE.match(line.strip()):
            gpus.append(GpuLinks(int(match[1]), match[2], match[3], {}))
        elif (match := _LINK_LINE.match(line)) and gpus:
            speed = re.match(r"([\d.]+) GB/s", match[2])
            gpus[-1].links[int(match[1])] = float(speed[1]) if speed else None
    return gpus


def parse_topology(text: str) -> dict[tuple[int, int], str]:
    """GPU-to-GPU cells of ``nvidia-smi topo -m``: (row GPU, column GPU) -> ``NV18``, ``SYS``..."""
    lines = [line for line in _ANSI_ESCAPE.sub("", text).splitlines() if line.strip()]
    if not lines:
        return {}
    columns: list[str] = []
    for token in lines[0].split():
        if not _DEVICE.match(token):
            break
        columns.append(token)
    cells: dict[tuple[int, int], str] = {}
    for line in lines[1:]:
        tokens = line.split()
        if not tokens or not tokens[0].startswith("GPU") or not _DEVICE.match(tokens[0]):
            if tokens and tokens[0].startswith("Legend"):
                break
            continue
        row = int(tokens[0][3:])
        for column, cell in zip(columns, tokens[1:], strict=False):
            if column.startswith("GPU"):
                cells[(row, int(column[3:]))] = cell
    return cells


def cuda_error_802(text: str) -> bool:
    """Whether ``text`` (a CUDA program's output or error) reports CUDA error 802."""
    return bool(_802.search(text))


def check(run: Runner, expected_gpus: int) -> list[Finding]:
    """The fabric findings of a guest that holds ``expected_gpus`` GPUs of an NVSwitch board."""
    findings = [_check_cuda(run)]
    if expected_gpus >= 2:
        findings += [_check_links(run, expected_gpus), _check_topology(run, expected_gpus)]
    return findings


def _output(run: Runner, command: str) -> tuple[str | None, str]:
    """(stdout, why it failed) of ``command``: stdout None when it could not run or failed."""
    try:
        result = run(command, timeout=QUERY_TIMEOUT)
    except VmSandboxError as exc:
        return None, exc.message
    if result.exit_status != 0:
        text = (result.stdout + result.stderr).strip()
        return None, f"exit status {result.exit_status}: {text[:300]}"
    return result.stdout, ""


def _check_cuda(run: Runner) -> Finding:
    try:
        result = run(CUDA_INIT, timeout=QUERY_TIMEOUT)
    except VmSandboxError as exc:
        return Finding("cuda-init", False, f"could not probe CUDA: {exc.message}")
    text = (result.stdout + result.stderr).strip()
    if "cuInit 0" in text:
        return Finding("cuda-init", True, "cuInit succeeded")
    if cuda_error_802(text):
        return Finding("cuda-init", False, FABRIC_NOT_INITIALISED)
    return Finding("cuda-init", False, f"cuInit failed: {text[:300] or 'no output'}")


def _check_links(run: Runner, expected_gpus: int) -> Finding:
    text, why = _output(run, NVLINK_STATUS)
    if text is None:
        return Finding("nvlink", False, f"{NVLINK_STATUS} failed: {why}")
    gpus = parse_nvlink_status(text)
    problems = _count_problem(len(gpus), expected_gpus, "lists")
    for gpu in gpus:
        if not gpu.active:
            problems.append(f"GPU {gpu.index} has no active NVLink")
        elif gpu.inactive:
            shown = ", ".join(str(link) for link in gpu.inactive)
            problems.append(f"GPU {gpu.index} links {shown} are inactive")
    if problems:
        return Finding("nvlink", False, "; ".join(problems))
    links = sorted({len(gpu.active) for gpu in gpus})
    return Finding(
        "nvlink", True, f"{len(gpus)} GPUs, {'/'.join(map(str, links))} active links each"
    )


def _check_topology(run: Runner, expected_gpus: int) -> Finding:
    text, why = _output(run, TOPOLOGY)
    if text is None:
        return Finding("topology", False, f"{TOPOLOGY} failed: {why}")
    cells = parse_topology(text)
    gpus = sorted({row for row, _ in cells})
    problems = _count_problem(len(gpus), expected_gpus, "shows")
    pcie = [
        f"GPU{row}-GPU{column} {cell}"
        for (row, column), cell in sorted(cells.items())
        if row < column and not cell.startswith("NV")
    ]
    if pcie:
        problems.append("pairs not connected by NVLink: " + ", ".join(pcie))
    if problems:
        return Finding("topology", False, "; ".join(problems))
    kinds = sorted({cell for (row, column), cell in cells.items() if row != column})
    return Finding("topology", True, f"every GPU pair over NVLink ({', '.join(kinds)})")


def _count_problem(found: int, expected: int, verb: str) -> list[str]:
    return [] if found == expected else [f"it {verb} {found} GPUs, {expected} expected"]
