"""What a suspended sandbox keeps in its record to come back (record.py's ``suspended``).

A suspend saves the guest's memory to disk and gives its GPUs back (suspend.py); the record
then says which GPUs it had, by model and in the order of its guest slots, and where each
was in the guest (the PCI bus of the root port it sat behind), so that a resume (resume.py)
takes GPUs of the same model and count, whatever their host addresses, and attaches each at
its old guest slot. A sandbox whose GPUs were joined by a Fabric Manager partition (shared
NVSwitch mode) gives its partition back too and keeps its size (``partition_size``): a resume
activates a free partition of that size. It also keeps what the guest did to let its GPUs go
(CUDA processes checkpointed, driver unloaded: ``guest``, the in-guest program's report) and
how many bytes the saved memory takes (``save_bytes``, counted against ``max_saved_gib``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vmsandbox.gpu.record import GpuRecord


@dataclass(frozen=True)
class Suspension:
    """A sandbox's suspension: when (``at``, UTC), the GPUs it had and their guest buses (one
    per GPU, in the same order), whether its GPUs boot with their option ROMs
    (``firmware``), the guest program's report of what it quiesced (``guest``), the size
    of the saved memory (None until it is saved), and the number of GPUs of the Fabric
    Manager partition that joined them (None: they had none)."""

    at: str
    gpus: tuple[GpuRecord, ...] = ()
    buses: tuple[int, ...] = ()
    firmware: str = "bios"
    guest: dict[str, Any] = field(default_factory=dict)
    save_bytes: int | None = None
    partition_size: int | None = None

    @property
    def checkpointed(self) -> list[int]:
        """The guest's CUDA processes that cuda-checkpoint checkpointed (by PID)."""
        return [int(pid) for pid in self.guest.get("checkpointed", [])]

    def to_dict(self) -> dict[str, Any]:
        return {
            "at": self.at,
            "gpus": [gpu.to_dict() for gpu in self.gpus],
            "buses": list(self.buses),
            "firmware": self.firmware,
            "guest": dict(self.guest),
            "save_bytes": self.save_bytes,
            "partition_size": self.partition_size,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Suspension:
        size = data.get("save_bytes")
        partition_size = data.get("partition_size")
        guest = data.get("guest")
        return cls(
            at=str(data.get("at", "")),
            gpus=tuple(GpuRecord.from_dict(gpu) for gpu in data.get("gpus") or ()),
            buses=tuple(int(bus) for bus in data.get("buses") or ()),
            firmware=str(data.get("firmware", "bios")),
            guest=dict(guest) if isinstance(guest, dict) else {},
            save_bytes=None if size is None else int(size),
            partition_size=None if partition_size is None else int(partition_size),
        )

    def shown(self) -> dict[str, Any]:
        """What a caller sees of it (``Sandbox.suspended``)."""
        return {
            "at": self.at,
            "gpus": [gpu.to_dict() for gpu in self.gpus],
            "save_bytes": self.save_bytes,
            "checkpointed": self.checkpointed,
        }
