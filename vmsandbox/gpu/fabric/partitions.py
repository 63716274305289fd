"""Fabric Manager's GPU partitions, as ``fmpm -l`` prints them.

``fmpm -l`` (NVIDIA/Fabric-Manager-Client) prints one JSON object::

    {"version": V, "numPartitions": N, "maxNumPartitions": M,
     "partitionInfo": [{"partitionId": ID, "isActive": 0|1, "numGpus": K,
                        "gpuInfo": [{"physicalId": P, "uuid": "GPU-...",
                                     "pciBusId": "00000000:1B:00.0",
                                     "numNvLinksAvailable": L, "maxNumNvLinks": L,
                                     "nvlinkLineRateMBps": R}, ...]}, ...]}

``version`` is the version of the API structure (``fmFabricPartitionList_version``), not the
release of Fabric Manager. Physical ids do not follow PCI order, so a GPU is matched to the
inventory by ``pciBusId`` (NVML's spelling, canonicalised here).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from vmsandbox.errors import FailedPrecondition
from vmsandbox.host.bdf import canonical_bdf


@dataclass(frozen=True)
class PartitionGpu:
    """One GPU of a partition; ``bdf`` is the canonical form of FM's ``pciBusId``."""

    physical_id: int
    uuid: str
    bdf: str
    nvlinks_available: int
    max_nvlinks: int
    nvlink_line_rate_mbps: int


@dataclass(frozen=True)
class Partition:
    """A fixed set of GPUs that Fabric Manager can connect over NVLink, and whether it is on."""

    id: int
    active: bool
    gpus: tuple[PartitionGpu, ...]

    @property
    def size(self) -> int:
        return len(self.gpus)

    @property
    def bdfs(self) -> frozenset[str]:
        return frozenset(gpu.bdf for gpu in self.gpus)

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "active": self.active,
            "size": self.size,
            "gpus": [
                {
                    "physical_id": gpu.physical_id,
                    "uuid": gpu.uuid,
                    "bdf": gpu.bdf,
                    "nvlinks_available": gpu.nvlinks_available,
                    "max_nvlinks": gpu.max_nvlinks,
                    "nvlink_line_rate_mbps": gpu.nvlink_line_rate_mbps,
                }
                for gpu in self.gpus
            ],
        }


@dataclass(frozen=True)
class PartitionTable:
    """Every partition FM supports on this board (``max_partitions``: FM's upper bound)."""

    struct_version: int
    max_partitions: int
    partitions: tuple[Partition, ...]

    def by_id(self, partition_id: int) -> Partition | None:
        return next((p for p in self.partitions if p.id == partition_id), None)

    def active(self) -> tuple[Partition, ...]:
        return tuple(p for p in self.partitions if p.active)

    def sizes(self) -> list[int]:
        """The partition sizes on offer, smallest first, each once."""
        return sorted({p.size for p in self.partitions})


def parse_partition_list(text: str) -> PartitionTable:
    """The table from ``fmpm -l``'s output; FAILED_PRECONDITION naming what is wrong with it."""
    try:
        data = json.loads(text)
        partitions = tuple(
            Partition(
                id=int(part["partitionId"]),
                active=bool(int(part["isActive"])),
                gpus=tuple(
                    PartitionGpu(
                        physical_id=int(gpu["physicalId"]),
                        uuid=str(gpu["uuid"]),
                        bdf=canonical_bdf(str(gpu["pciBusId"])),
                        nvlinks_available=int(gpu["numNvLinksAvailable"]),
                        max_nvlinks=int(gpu["maxNumNvLinks"]),
                        nvlink_line_rate_mbps=int(gpu["nvlinkLineRateMBps"]),
                    )
                    for gpu in part["gpuInfo"]
                ),
            )
            for part in data["partitionInfo"]
        )
        table = PartitionTable(
            struct_version=int(data["version"]),
            max_partitions=int(data["maxNumPartitions"]),
            partitions=partitions,
        )
        counted = int(data["numPartitions"])
    except (ValueError, KeyError, TypeError) as exc:
        first = text.strip().splitlines()[0] if text.strip() else "nothing"
        raise FailedPrecondition(
            f"fmpm -l did not print a partition list ({type(exc).__name__}: {exc}); "
            f"it printed: {first[:200]}",
            details={"output": text[:2000]},
        ) from exc
    if counted != len(partitions):
        raise FailedPrecondition(
            f"fmpm -l says numPartitions {counted} but lists {len(partitions)} partitions",
            details={"output": text[:2000]},
        )
    return table
