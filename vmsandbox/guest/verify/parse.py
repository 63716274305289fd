"""Parsers of what the guest's tools print: ``lspci -nn``, ``nvidia-smi --query-gpu`` CSV, the
kernel log, ``/proc/driver/nvidia/version`` and the compute smoke test's PASS/FAIL lines.

Pure functions of text; PCI addresses are read with ``vmsandbox.host.bdf`` and come out
canonical, vendor and device ids in sysfs's spelling (``0x10de``).
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass

from vmsandbox.host.bdf import BDF_PATTERN, SLOT_PATTERN, canonical_slot, parse_bdf
from vmsandbox.host.pci_ids import pci_id

_LSPCI_RE = re.compile(
    rf"(?P<address>{BDF_PATTERN})"
    r" (?P<class_name>.*?) \[(?P<class_id>[0-9a-fA-F]{4})\]: (?P<description>.*)"
    r" \[(?P<vendor>[0-9a-fA-F]{4}):(?P<device>[0-9a-fA-F]{4})\](?: \(rev [0-9a-fA-F]{2}\))?"
)
# "... x86_64 Kernel Module  535.309.01 ..." (proprietary), "... Open Kernel Module for x86_64
# 580.159.04 ..." (open).
_MODULE_VERSION_RE = re.compile(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)")
_MEMORY_RE = re.compile(r"(\d+)\s*MiB")
_XID_RE = re.compile(rf"NVRM: Xid \(PCI:(?P<address>{SLOT_PATTERN})\): (?P<code>\d+)")
_NVRM_GPU_RE = re.compile(rf"NVRM: (?:The NVIDIA )?GPU (?P<bdf>{BDF_PATTERN})")
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
    r"Unable to determine the device handle for GPU\s*(?:\d+:\s*)?" rf"(?P<bdf>{BDF_PATTERN})?"
)
_SMOKE_RE = re.compile(r"(?P<status>PASS|FAIL) (?P<where>\S+) ?(?P<text>.*)")


@dataclass(frozen=True)
class PciFunction:
    """One line of ``lspci -nn``."""

    address: str  # canonical: 0000:01:00.0
    class_name: str
    class_id: str  # lspci's 4 digits: 0302
    description: str
    vendor_id: str  # 0x10de
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


def guest_bdf(text: str) -> str | None:
    """A canonical PCI address from a guest tool's spelling (``00000000:0A:00.0``); None if the
    text is not one."""
    bdf = parse_bdf(text)
    return str(bdf) if bdf else None


def parse_lspci(text: str) -> list[PciFunction]:
    """The functions in ``lspci -nn`` (or ``-Dnn``) output; lines of other shapes are ignored."""
    found = []
    for line in text.splitlines():
        match = _LSPCI_RE.fullmatch(line.strip())
        if match is None or (address := guest_bdf(match["address"])) is None:
            continue
        found.append(
            PciFunction(
                address=address,
                class_name=match["class_name"],
                class_id=match["class_id"].lower(),
                description=match["description"],
                vendor_id=pci_id(match["vendor"]),
                device_id=pci_id(match["device"]),
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
        bus_id = guest_bdf(fields[1]) if len(fields) == 5 else None
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


def handle_error_bdf(line: str) -> str | None:
    """The GPU an nvidia-smi "Unable to determine the device handle for GPU..." line names."""
    match = _HANDLE_RE.search(line)
    return guest_bdf(match["bdf"]) if match and match["bdf"] else None


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
            address = canonical_slot(xid["address"])
            events.append(KernelEvent(address=address, xid=int(xid["code"]), line=line))
            continue
        if gpu := _NVRM_GPU_RE.search(line):
            bdf = parse_bdf(gpu["bdf"])
            last_gpu = bdf.slot_address if bdf else last_gpu
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
                bus_id=guest_bdf(where) if where != "-" else None,
                text=match["text"] or where,
            )
        )
    return found


def driver_version_of(proc_version: str) -> str | None:
    """The module version in ``/proc/driver/nvidia/version``."""
    match = _MODULE_VERSION_RE.search(proc_version)
    return match[1] if match else None


def strip_timestamp(line: str) -> str:
    """A kernel log line without dmesg's ``[ 12.345678]`` or journalctl's host prefix."""
    return line[line.index("NVRM:") :] if "NVRM:" in line else line


def first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")
