"""Optional NVML enrichment: memory, UUID, name and running processes of nvidia-bound GPUs.

NVML is only asked when the host ``nvidia`` driver owns a GPU. ``NvmlApi`` is the seam: the
few calls the inventory makes, indexed by NVML device number. ``PynvmlApi`` implements it over
``pynvml`` (imported on first use; its import costs ~30 ms), tests pass a fake. Any failure
turns into a note: the inventory then falls back to sysfs and the built-in PCI ID table.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from .bdf import canonical_bdf

MIB = 1024 * 1024
T = TypeVar("T")


class NvmlError(Exception):
    """NVML is missing or refused a call."""


class NvmlApi(Protocol):
    """The NVML calls the inventory needs, by NVML device index; each may raise NvmlError."""

    def init(self) -> None:
        """Load and initialise NVML."""

    def shutdown(self) -> None:
        """Release NVML."""

    def device_count(self) -> int:
        """Number of devices NVML sees."""

    def bus_id(self, index: int) -> str:
        """PCI address, in NVML's spelling ``00000000:41:00.0``."""

    def name(self, index: int) -> str:
        """Product name (``NVIDIA H100 80GB HBM3``)."""

    def memory_total(self, index: int) -> int:
        """Total framebuffer memory in bytes."""

    def uuid(self, index: int) -> str:
        """``GPU-...`` UUID."""

    def running_pids(self, index: int) -> list[int]:
        """PIDs of the compute and graphics processes on the device."""


@dataclass(frozen=True)
class NvmlGpu:
    """What NVML says about one GPU."""

    bdf: str
    name: str
    memory_mib: int | None  # None: NVML gives none (unified-memory parts such as GB10)
    uuid: str
    pids: tuple[int, ...]


@dataclass(frozen=True)
class NvmlReport:
    """NVML's view of the host: ``answered`` is False when NVML could not be used at all."""

    answered: bool
    gpus: dict[str, NvmlGpu]
    notes: tuple[str, ...] = ()


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


class PynvmlApi:
    """NvmlApi over the ``pynvml`` module of nvidia-ml-py."""

    def __init__(self) -> None:
        try:
            import pynvml
        except ImportError as exc:
            raise NvmlError("pynvml is not installed (pip install nvidia-ml-py)") from exc
        self._nvml: Any = pynvml
        self._handles: dict[int, Any] = {}

    def _call(self, function: Callable[..., T], *args: Any) -> T:
        try:
            return function(*args)
        except self._nvml.NVMLError as exc:
            raise NvmlError(str(exc)) from exc

    def _handle(self, index: int) -> Any:
        if index not in self._handles:
            self._handles[index] = self._call(self._nvml.nvmlDeviceGetHandleByIndex, index)
        return self._handles[index]

    def init(self) -> None:
        self._call(self._nvml.nvmlInit)

    def shutdown(self) -> None:
        self._handles.clear()
        self._call(self._nvml.nvmlShutdown)

    def device_count(self) -> int:
        count: int = self._call(self._nvml.nvmlDeviceGetCount)
        return count

    def bus_id(self, index: int) -> str:
        return _text(self._call(self._nvml.nvmlDeviceGetPciInfo, self._handle(index)).busId)

    def name(self, index: int) -> str:
        return _text(self._call(self._nvml.nvmlDeviceGetName, self._handle(index)))

    def memory_total(self, index: int) -> int:
        total: int = self._call(self._nvml.nvmlDeviceGetMemoryInfo, self._handle(index)).total
        return total

    def uuid(self, index: int) -> str:
        return _text(self._call(self._nvml.nvmlDeviceGetUUID, self._handle(index)))

    def running_pids(self, index: int) -> list[int]:
        handle = self._handle(index)
        compute = self._call(self._nvml.nvmlDeviceGetComputeRunningProcesses, handle)
        graphics = self._call(self._nvml.nvmlDeviceGetGraphicsRunningProcesses, handle)
        return [process.pid for process in [*compute, *graphics]]


def read_nvml(api: NvmlApi | None = None) -> NvmlReport:
    """Ask NVML about every GPU it sees; ``api`` None loads pynvml."""
    try:
        api = api or PynvmlApi()
        api.init()
    except NvmlError as exc:
        return NvmlReport(False, {}, (f"NVML unavailable: {exc}",))
    try:
        return _read_devices(api)
    finally:
        with contextlib.suppress(NvmlError):
            api.shutdown()


def _read_devices(api: NvmlApi) -> NvmlReport:
    try:
        count = api.device_count()
    except NvmlError as exc:
        return NvmlReport(False, {}, (f"NVML unavailable: {exc}",))
    gpus: dict[str, NvmlGpu] = {}
    notes: list[str] = []
    for index in range(count):
        try:
            bdf = canonical_bdf(api.bus_id(index))
            name, uuid = api.name(index), api.uuid(index)
        except (NvmlError, ValueError) as exc:
            notes.append(f"NVML could not read device {index}: {exc}")
            continue
        try:
            memory_mib: int | None = api.memory_total(index) // MIB
        except NvmlError as exc:  # "Not Supported" on GPUs that use the host's memory
            notes.append(f"NVML gives no memory size for {bdf}: {exc}")
            memory_mib = None
        try:
            pids = tuple(sorted(set(api.running_pids(index))))
        except NvmlError as exc:
            notes.append(f"NVML could not list the processes on {bdf}: {exc}")
            pids = ()
        gpus[bdf] = NvmlGpu(bdf, name, memory_mib, uuid, pids)
    return NvmlReport(True, gpus, tuple(notes))
