"""What a sandbox remembers of each of its GPUs: enough to verify them in the guest and to
attach them again, kept in the sandbox's record and read back from it."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vmsandbox.host.model import Gpu


@dataclass(frozen=True)
class GpuRecord:
    """What a sandbox remembers of each of its GPUs (enough to verify them in the guest)."""

    bdf: str
    vendor: str
    vendor_id: str
    device_id: str
    name: str | None = None
    memory_mib: int | None = None
    numa_node: int | None = None
    companions: tuple[str, ...] = ()
    companion_ids: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, gpu: Gpu) -> GpuRecord:
        return cls(
            bdf=gpu.bdf,
            vendor=gpu.vendor,
            vendor_id=gpu.vendor_id,
            device_id=gpu.device_id,
            name=gpu.name,
            memory_mib=gpu.memory_mib,
            numa_node=gpu.numa_node,
            companions=tuple(gpu.companions),
            companion_ids=tuple((str(a), str(b)) for a, b in gpu.companion_ids),
        )

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["companions"] = list(self.companions)
        data["companion_ids"] = [list(pair) for pair in self.companion_ids]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GpuRecord:
        return cls(
            bdf=str(data["bdf"]),
            vendor=str(data.get("vendor", "")),
            vendor_id=str(data["vendor_id"]),
            device_id=str(data["device_id"]),
            name=data.get("name"),
            memory_mib=data.get("memory_mib"),
            numa_node=data.get("numa_node"),
            companions=tuple(str(bdf) for bdf in data.get("companions", ())),
            companion_ids=tuple((str(a), str(b)) for a, b in data.get("companion_ids", ())),
        )
