"""What verification found: the GPUs it expected, per-GPU and per-check findings, rendering.

``ExpectedGpu`` is the one GPU identity verification knows (a GPU passed to the guest, as the
host saw it); a ``GpuReport`` is that identity plus what the guest showed of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from vmsandbox.errors import GuestVerificationFailed
from vmsandbox.gpu.record import GpuRecord
from vmsandbox.host.pci_ids import NVIDIA_VENDOR_ID, pci_id
from vmsandbox.tables import render_grid

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"
SHOWN_PROBLEMS = 5


@dataclass(frozen=True)
class ExpectedGpu:
    """A GPU passed to the guest, as the host saw it. Ids are spelled as sysfs does (``0x10de``)."""

    bdf: str
    vendor: str
    vendor_id: str
    device_id: str
    name: str | None = None
    memory_mib: int | None = None
    companions: tuple[str, ...] = ()
    companion_ids: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "vendor_id", pci_id(self.vendor_id))
        object.__setattr__(self, "device_id", pci_id(self.device_id))
        pairs = tuple((pci_id(v), pci_id(d)) for v, d in self.companion_ids)
        object.__setattr__(self, "companion_ids", pairs)

    @property
    def ids(self) -> tuple[str, str]:
        return self.vendor_id, self.device_id

    @property
    def is_nvidia(self) -> bool:
        return self.vendor_id == NVIDIA_VENDOR_ID

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> ExpectedGpu:
        """From the manager's per-GPU record (``Sandbox.gpus``), read by the record's own parser."""
        return cls.of(GpuRecord.from_dict(dict(record)))

    @classmethod
    def of(cls, gpu: GpuRecord) -> ExpectedGpu:
        """From a sandbox record's GPU: the identity the host saw when it passed the GPU on
        (every field of ExpectedGpu is one of GpuRecord's)."""
        return cls(**{item.name: getattr(gpu, item.name) for item in fields(cls)})


def ids_text(vendor_id: str, device_id: str) -> str:
    """``[10de:2330]``: a PCI ID pair as lspci prints it, for messages."""
    return f"[{vendor_id.removeprefix('0x')}:{device_id.removeprefix('0x')}]"


@dataclass
class CompanionReport:
    host_bdf: str
    vendor_id: str
    device_id: str
    guest_address: str | None = None


@dataclass
class GpuReport:
    """What verification found for one GPU."""

    gpu: ExpectedGpu
    guest_address: str | None = None
    name: str | None = None
    uuid: str | None = None
    memory_mib: int | None = None
    driver_version: str | None = None
    compute: str = SKIPPED  # passed | failed | skipped
    companions: list[CompanionReport] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def host_bdf(self) -> str:
        return self.gpu.bdf

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {
            "host_bdf": self.gpu.bdf,
            "vendor": self.gpu.vendor,
            "vendor_id": self.gpu.vendor_id,
            "device_id": self.gpu.device_id,
            "expected_name": self.gpu.name,
            "expected_memory_mib": self.gpu.memory_mib,
            "guest_address": self.guest_address,
            "name": self.name,
            "uuid": self.uuid,
            "memory_mib": self.memory_mib,
            "driver_version": self.driver_version,
            "compute": self.compute,
            "companions": [asdict(companion) for companion in self.companions],
            "problems": list(self.problems),
            "ok": self.ok,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GpuReport:
        companions = [CompanionReport(**companion) for companion in data.get("companions", [])]
        gpu = ExpectedGpu(
            bdf=data["host_bdf"],
            vendor=data.get("vendor", ""),
            vendor_id=data["vendor_id"],
            device_id=data["device_id"],
            name=data.get("expected_name"),
            memory_mib=data.get("expected_memory_mib"),
            companions=tuple(c.host_bdf for c in companions),
            companion_ids=tuple((c.vendor_id, c.device_id) for c in companions),
        )
        return cls(
            gpu=gpu,
            guest_address=data.get("guest_address"),
            name=data.get("name"),
            uuid=data.get("uuid"),
            memory_mib=data.get("memory_mib"),
            driver_version=data.get("driver_version"),
            compute=data.get("compute", SKIPPED),
            companions=companions,
            problems=list(data.get("problems", [])),
        )


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


def render_report(report: VerificationReport) -> str:
    """A table of the GPUs, the checks that ran or were skipped, and the problems."""
    lines = []
    if report.gpus:
        header = ("GPU", "GUEST", "NAME", "MEMORY", "DRIVER", "COMPUTE", "STATUS")
        rows = [
            (
                gpu.host_bdf,
                gpu.guest_address or "-",
                gpu.name or gpu.gpu.name or "-",
                f"{gpu.memory_mib} MiB" if gpu.memory_mib is not None else "-",
                gpu.driver_version or "-",
                gpu.compute,
                "ok" if gpu.ok else "FAILED",
            )
            for gpu in report.gpus
        ]
        lines.extend(render_grid(header, rows))
    for check in report.checks:
        detail = f" ({check.detail})" if check.detail else ""
        lines.append(f"{check.name}: {check.status}{detail}")
    lines.extend(f"problem: {problem}" for problem in report.problems)
    lines.append("verification: " + ("ok" if report.ok else "FAILED"))
    return "\n".join(line.rstrip() for line in lines) + "\n"


def raise_if_failed(
    report: VerificationReport, *, subject: str = "", details: Mapping[str, Any] | None = None
) -> None:
    """Raise ``GuestVerificationFailed`` (FAILED_PRECONDITION) when ``report`` failed, its first
    problems in the message (after ``subject``, e.g. "sandbox 'job-42'") and the report in
    ``details["verification"]`` beside any other ``details``."""
    if report.ok:
        return
    shown = report.problems[:SHOWN_PROBLEMS]
    more = len(report.problems) - len(shown)
    raise GuestVerificationFailed(
        (f"{subject}: " if subject else "")
        + "GPU verification in the guest failed: "
        + "; ".join(shown)
        + (f"; and {more} more" if more else ""),
        details={**(details or {}), "verification": report.to_dict()},
    )
