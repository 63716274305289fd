"""Record what a real NVIDIA GPU says to vmsandbox's NVIDIA code, on a machine with the GPU
and its driver (a GPU guest, as a vmsandbox guest is one), as root:

    python3 tests/hardware/probe.py OUT_DIR        # about 2 minutes, at most 5

It writes, under OUT_DIR (``manifest.json`` lists every step: command, exit status, seconds):

- ``verify/``: the stdout of each command vmsandbox's in-guest verification runs (the same
  constants, the same ``cuda_smoke.py``), named as a scenario of ``tests/fixtures/guest``, and
  ``report.json``/``report.txt``: ``vmsandbox.guest.verify.verify`` run here against the GPUs
  that ``vmsandbox.host.discover`` found;
- ``smi/``: ``nvidia-smi -q``, ``-q -x``, ``-L``, ``topo -m``, ``nvlink -s`` and the queries
  vmsandbox's guest programs send;
- ``host/``: each NVIDIA function's sysfs attributes and config space, the inventory
  ``discover`` builds from them (NVML included), the BARs, power state and reset methods as
  vmsandbox reads them, three BAR0 status registers the memory-clear wait reads;
- ``kernel/``: the kernel log's ``NVRM`` lines and what vmsandbox's parsers make of them;
- ``checkpoint/``: with ``cuda-checkpoint``, a CUDA counter program checkpointed and restored
  in place, each step timed, once by hand and once through ``programs/gpu_quiesce.py``.

Strictly read-only towards the GPU: nothing here resets it, changes its clocks, modes,
persistence or application settings, or loads or unloads a driver. The only GPU work is the
smoke test's vector add and the counter program's kernel, both of this probe's own processes.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from vmsandbox.guest import verify
from vmsandbox.guest.ssh import ExecResult
from vmsandbox.guest.verify import nvlink

DEADLINE_S = 280.0
SYS_PCI = Path("/sys/bus/pci/devices")
NVIDIA = "0x10de"
ATTRIBUTES = (
    "vendor",
    "device",
    "subsystem_vendor",
    "subsystem_device",
    "class",
    "revision",
    "resource",
    "reset_method",
    "current_link_speed",
    "current_link_width",
    "max_link_speed",
    "max_link_width",
    "numa_node",
    "local_cpulist",
    "power_state",
    "d3cold_allowed",
    "enable",
    "irq",
    "boot_vga",
    "msi_bus",
    "modalias",
    "uevent",
    "power/control",
    "power/runtime_status",
)
LINKS = ("driver", "iommu_group", "physfn")
BAR0_REGISTERS = {"PMC_BOOT_0": 0x0, "FSP_BOOT_COMPLETE": 0x200BC, "MEMORY_CLEAR": 0x100B20}
COUNTER_CU = r"""
#include <cstdio>
#include <unistd.h>
__global__ void bump(unsigned long long *c) { *c += 1; }
int main() {
  unsigned long long *d, h = 0;
  cudaError_t e = cudaMalloc(&d, sizeof *d);
  if (e == cudaSuccess) e = cudaMemset(d, 0, sizeof *d);
  for (;;) {
    if (e != cudaSuccess) { printf("ERR %s\n", cudaGetErrorString(e)); return 1; }
    bump<<<1, 1>>>(d);
    e = cudaMemcpy(&h, d, sizeof h, cudaMemcpyDeviceToHost);
    if (e == cudaSuccess) { printf("%llu\n", h); fflush(stdout); }
    usleep(20000);
  }
}
"""


class Probe:
    """Runs the steps, each bounded, and writes what they gave and the manifest."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.began = time.monotonic()
        self.steps: list[dict[str, Any]] = []

    def left(self) -> float:
        return DEADLINE_S - (time.monotonic() - self.began)

    def write(self, name: str, text: str | bytes) -> None:
        path = self.out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text.encode() if isinstance(text, str) else text)

    def shell(
        self, name: str, command: str, *, stdin: bytes | None = None, timeout: float = 60.0
    ) -> ExecResult:
        """Run ``command`` with ``sh -c``; NAME.out (stdout), NAME.err, NAME.status (non-zero)."""
        began = time.monotonic()
        timeout = max(1.0, min(timeout, self.left()))
        try:
            done = subprocess.run(
                ["sh", "-c", command], input=stdin, capture_output=True, timeout=timeout
            )
            result = ExecResult(
                done.returncode,
                done.stdout.decode(errors="replace"),
                done.stderr.decode(errors="replace"),
            )
        except subprocess.TimeoutExpired as exc:
            out = (exc.stdout or b"").decode(errors="replace")
            result = ExecResult(124, out, f"timed out after {timeout:.0f} s")
        seconds = round(time.monotonic() - began, 3)
        self.write(f"{name}.out", result.stdout)
        if result.stderr:
            self.write(f"{name}.err", result.stderr)
        if result.exit_status:
            self.write(f"{name}.status", f"{result.exit_status}\n")
        self.steps.append(
            {"step": name, "command": command, "exit": result.exit_status, "seconds": seconds}
        )
        return result

    def python(self, name: str, function: Callable[[], Any]) -> Any:
        """Run ``function``; NAME.json with what it returned, or NAME.error with the traceback."""
        began = time.monotonic()
        try:
            value = function()
            self.write(f"{name}.json", json.dumps(value, indent=2, default=str) + "\n")
            error = None
        except Exception:
            value, error = None, traceback.format_exc()
            self.write(f"{name}.error", error)
        self.steps.append(
            {
                "step": name,
                "python": getattr(function, "__name__", name),
                "ok": error is None,
                "seconds": round(time.monotonic() - began, 3),
            }
        )
        return value

    def finish(self) -> None:
        manifest = {
            "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "host": platform.uname()._asdict(),
            "python": sys.version,
            "seconds": round(time.monotonic() - self.began, 1),
            "steps": self.steps,
        }
        self.write("manifest.json", json.dumps(manifest, indent=2) + "\n")


def nvidia_functions() -> list[Path]:
    return sorted(
        path for path in SYS_PCI.iterdir() if (path / "vendor").read_text().strip() == NVIDIA
    )


def sysfs_of(path: Path) -> dict[str, Any]:
    """One PCI function's attributes as text (or the error reading it) and its links."""
    found: dict[str, Any] = {"path": str(path.resolve())}
    for name in ATTRIBUTES:
        try:
            found[name] = (path / name).read_text()
        except OSError as exc:
            found[name] = f"<{exc.strerror}>"
    for name in LINKS:
        link = path / name
        found[name] = os.readlink(link) if link.is_symlink() else None
    try:
        found["config_hex"] = (path / "config").read_bytes().hex()
    except OSError as exc:
        found["config_hex"] = f"<{exc.strerror}>"
    return found


def bridges_above(path: Path) -> list[dict[str, Any]]:
    """The sysfs of each bridge between a function and its root bus, nearest first."""
    found = []
    parent = path.resolve().parent
    while parent.name and (parent / "config").exists():
        found.append({parent.name: sysfs_of(parent)})
        parent = parent.parent
    return found


def host_steps(probe: Probe) -> list[Any]:
    """sysfs, the inventory and the readers custody uses; the GPUs discover found."""
    from vmsandbox.host import bars, nvclear, pcistate

    functions = nvidia_functions()
    probe.python("host/sysfs", lambda: {p.name: sysfs_of(p) for p in functions})
    for path in functions:
        name = f"host/parents-{path.name.replace(':', '-')}"
        probe.python(name, functools.partial(bridges_above, path))

    def readers() -> dict[str, Any]:
        found = {}
        for path in functions:
            bdf = path.name
            found[bdf] = {
                "bars": [repr(b) for b in bars.parse_resource((path / "resource").read_text())],
                "power_state": pcistate.power_state(bdf),
                "not_answering": pcistate.not_answering(bdf),
                "config_pm_state": pcistate.pm_state(pcistate.read_config(bdf, 256)),
                "parent_bridge": pcistate.parent_bridge(bdf),
            }
        return found

    probe.python("host/readers", readers)

    def bar0() -> dict[str, Any]:
        found: dict[str, Any] = {}
        for path in functions:
            if not _is_display(path):
                continue
            reader = nvclear.Bar0(path.name)
            values: dict[str, Any] = {}
            for name, offset in BAR0_REGISTERS.items():
                try:
                    values[name] = f"{reader.read(offset):#010x}"
                except nvclear.ClearFailed as exc:
                    values[name] = f"<{exc}>"
            device_id = int((path / "device").read_text(), 16)
            try:
                values["architecture"] = nvclear.architecture(device_id, reader)
            except nvclear.ClearFailed as exc:
                values["architecture"] = f"<{exc}>"
            found[path.name] = values
        return found

    probe.python("host/bar0", bar0)

    found: list[Any] = []

    def inventory() -> dict[str, Any]:
        from vmsandbox.host import discover

        result = discover(require_reset=False)
        found.extend(result.gpus)
        return result.to_dict()

    probe.python("host/inventory", inventory)

    def nvml_report() -> dict[str, Any]:
        from vmsandbox.host.nvml import read_nvml

        report = read_nvml()
        return {
            "answered": report.answered,
            "notes": list(report.notes),
            "gpus": {bdf: repr(gpu) for bdf, gpu in report.gpus.items()},
        }

    probe.python("host/nvml", nvml_report)
    probe.python("host/nvml-extra", nvml_extra)
    return found or [sysfs_gpu(path) for path in functions if _is_display(path)]


def _is_display(path: Path) -> bool:
    return (path / "class").read_text().strip()[:4] == "0x03"


def sysfs_gpu(path: Path) -> verify.ExpectedGpu:
    """What verify expects of a GPU when discover could not run: its ids, from sysfs."""
    ids = ((path / "vendor").read_text().strip(), (path / "device").read_text().strip())
    return verify.ExpectedGpu(path.name, "nvidia", *ids)


def nvml_extra() -> dict[str, Any]:
    """NVML fields beside those vmsandbox reads that custody's health checks may want."""
    import pynvml as nv

    nv.nvmlInit()
    try:
        found: dict[str, Any] = {
            "driver": nv.nvmlSystemGetDriverVersion(),
            "nvml": nv.nvmlSystemGetNVMLVersion(),
            "gpus": [],
        }
        for index in range(nv.nvmlDeviceGetCount()):
            handle = nv.nvmlDeviceGetHandleByIndex(index)
            gpu: dict[str, Any] = {}
            queries: dict[str, Callable[[Any], Any]] = {
                "pci": nv.nvmlDeviceGetPciInfo,
                "name": nv.nvmlDeviceGetName,
                "uuid": nv.nvmlDeviceGetUUID,
                "serial": nv.nvmlDeviceGetSerial,
                "memory": nv.nvmlDeviceGetMemoryInfo,
                "bar1": nv.nvmlDeviceGetBAR1MemoryInfo,
                "persistence": nv.nvmlDeviceGetPersistenceMode,
                "compute_mode": nv.nvmlDeviceGetComputeMode,
                "ecc_mode": nv.nvmlDeviceGetEccMode,
                "ecc_uncorrected_volatile": lambda h: nv.nvmlDeviceGetTotalEccErrors(
                    h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC
                ),
                "retired_pending": nv.nvmlDeviceGetRetiredPagesPendingStatus,
                "remapped_rows": nv.nvmlDeviceGetRemappedRows,
                "pcie_gen": nv.nvmlDeviceGetCurrPcieLinkGeneration,
                "pcie_width": nv.nvmlDeviceGetCurrPcieLinkWidth,
                "throttle": nv.nvmlDeviceGetCurrentClocksEventReasons,
                "temperature": lambda h: nv.nvmlDeviceGetTemperature(h, 0),
                "mig_mode": nv.nvmlDeviceGetMigMode,
                "compute_processes": nv.nvmlDeviceGetComputeRunningProcesses,
                "graphics_processes": nv.nvmlDeviceGetGraphicsRunningProcesses,
                "nvlink_state_0": lambda h: nv.nvmlDeviceGetNvLinkState(h, 0),
                "architecture": nv.nvmlDeviceGetArchitecture,
                "cuda_capability": nv.nvmlDeviceGetCudaComputeCapability,
            }
            for key, query in queries.items():
                try:
                    gpu[key] = plain(query(handle))
                except Exception as exc:
                    gpu[key] = f"<{type(exc).__name__}: {exc}>"
            found["gpus"].append(gpu)
        return found
    finally:
        nv.nvmlShutdown()


def plain(value: Any) -> Any:
    """NVML's ctypes structures as dicts of their fields."""
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    fields = getattr(value, "_fields_", None)
    if fields:
        return {name: plain(getattr(value, name)) for name, *_ in fields}
    return value


def verify_steps(probe: Probe, gpus: list[Any]) -> None:
    """The verification's commands as a scenario, then ``verify`` itself."""
    probe.shell("verify/lspci", verify.LSPCI)
    probe.shell("verify/probe", verify.DRIVER_PROBE)
    probe.shell("verify/nvidia-smi", verify.NVIDIA_SMI)
    probe.shell("verify/kernel-log", verify.KERNEL_LOG)
    probe.shell("verify/compute", verify.COMPUTE, stdin=verify.cuda_smoke_program(), timeout=120)

    def run(command: str, *, stdin: bytes | None = None, timeout: float | None = None) -> Any:
        return probe.shell(
            f"verify/run/{len(probe.steps):02d}", command, stdin=stdin, timeout=timeout or 60
        )

    def report() -> dict[str, Any]:
        expected = [
            gpu if isinstance(gpu, verify.ExpectedGpu) else verify.ExpectedGpu.of(gpu)
            for gpu in gpus
            if gpu.vendor_id == NVIDIA
        ]
        if not expected:
            raise RuntimeError("discover found no NVIDIA GPU to verify against")
        result = verify.verify(run, expected)
        probe.write("verify/report.txt", verify.render_report(result))
        return result.to_dict()

    probe.python("verify/report", report)


def smi_steps(probe: Probe) -> None:
    probe.shell("smi/q", "nvidia-smi -q")
    probe.shell("smi/q-x", "nvidia-smi -q -x")
    probe.shell("smi/L", "nvidia-smi -L")
    probe.shell("smi/topo-m", "nvidia-smi topo -m")
    probe.shell("smi/nvlink-s", "nvidia-smi nvlink -s")
    probe.shell("smi/nvlink-status", nvlink.NVLINK_STATUS)
    probe.shell("smi/cuda-init", nvlink.CUDA_INIT)
    probe.shell("smi/uuids", "nvidia-smi --query-gpu=pci.bus_id,uuid --format=csv,noheader")
    probe.shell(
        "smi/compute-apps",
        "nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv",
    )
    probe.shell("smi/version", "cat /proc/driver/nvidia/version; nvidia-smi --version")


def kernel_steps(probe: Probe) -> None:
    log = probe.shell("kernel/dmesg-nvrm", "dmesg | grep -E 'NVRM|nvidia' || true")

    def parsed() -> dict[str, Any]:
        from vmsandbox.host import aer

        full = subprocess.run(["dmesg"], capture_output=True, text=True).stdout
        events, nvrm = verify.parse_kernel_log(full)
        return {
            "events": [repr(e) for e in events],
            "nvrm": nvrm,
            "aer": [repr(e) for e in aer.parse(full.splitlines())],
            "lines": len(log.stdout.splitlines()),
        }

    probe.python("kernel/parsed", parsed)


def checkpoint_steps(probe: Probe) -> None:
    """A CUDA counter checkpointed and restored in place: by hand, then as gpu_quiesce does."""
    tool = shutil.which("cuda-checkpoint") or next(
        (
            p
            for p in ("/usr/local/nvidia/bin/cuda-checkpoint", "/usr/bin/cuda-checkpoint")
            if os.access(p, os.X_OK)
        ),
        None,
    )
    probe.python("checkpoint/tool", lambda: {"path": tool})
    if tool is None or probe.left() < 60:
        return
    os.environ["PATH"] = f"{os.path.dirname(tool)}:{os.environ['PATH']}"
    probe.shell("checkpoint/help", "cuda-checkpoint --help")
    work = Path(tempfile.mkdtemp(prefix="counter-"))
    (work / "counter.cu").write_text(COUNTER_CU)
    built = probe.shell(
        "checkpoint/build", f"nvcc -O2 -o {work}/counter {work}/counter.cu", timeout=90
    )
    if built.exit_status:
        return
    output = open(work / "counter.log", "w")  # noqa: SIM115 - the counter's lifetime
    counter = subprocess.Popen([str(work / "counter")], stdout=output, stderr=subprocess.STDOUT)
    try:
        by_hand(probe, counter.pid, work / "counter.log")
        through_quiesce(probe, counter.pid, work / "counter.log")
    finally:
        counter.kill()
        counter.wait()
        output.close()
        probe.write("checkpoint/counter.log", _tail((work / "counter.log").read_text(), 200))


def _tail(text: str, lines: int) -> str:
    return "\n".join(text.splitlines()[-lines:]) + "\n"


def _count(log: Path) -> int | None:
    lines = [line for line in log.read_text().splitlines() if line.isdigit()]
    return int(lines[-1]) if lines else None


def _wait_counting(log: Path, past: int | None, timeout: float = 20.0) -> int | None:
    """The counter's value once it has moved past ``past``; None if it does not in time."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = _count(log)
        if value is not None and (past is None or value > past):
            return value
        time.sleep(0.05)
    return None


def _fds(pid: int) -> list[str]:
    found = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("/dev/"):
                found.append(target)
    return sorted(set(found))


def by_hand(probe: Probe, pid: int, log: Path) -> None:
    started = _wait_counting(log, None, timeout=60)
    probe.python("checkpoint/hand-00-started", lambda: {"count": started, "fds": _fds(pid)})
    if started is None:
        return
    probe.shell(
        "checkpoint/hand-00-compute-apps",
        "nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv",
    )
    probe.shell(
        "checkpoint/hand-00-gpu-memory",
        "nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits",
    )
    probe.shell("checkpoint/hand-01-state", f"cuda-checkpoint --get-state --pid {pid}")
    probe.shell("checkpoint/hand-02-lock", f"cuda-checkpoint --action lock --pid {pid}")
    probe.shell("checkpoint/hand-03-state", f"cuda-checkpoint --get-state --pid {pid}")
    probe.shell("checkpoint/hand-04-checkpoint", f"cuda-checkpoint --action checkpoint --pid {pid}")
    probe.shell("checkpoint/hand-05-state", f"cuda-checkpoint --get-state --pid {pid}")
    before = _count(log)
    probe.python("checkpoint/hand-06-checkpointed", lambda: {"count": before, "fds": _fds(pid)})
    probe.shell(
        "checkpoint/hand-07-compute-apps",
        "nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv;"
        " nvidia-smi --query-gpu=memory.used --format=csv",
    )
    uuid = probe.shell(
        "checkpoint/hand-08-uuid", "nvidia-smi --query-gpu=uuid --format=csv,noheader"
    ).stdout.strip()
    restore = f"cuda-checkpoint --action restore --pid {pid}"
    probe.shell("checkpoint/hand-09-restore", restore)
    probe.shell("checkpoint/hand-10-state", f"cuda-checkpoint --get-state --pid {pid}")
    probe.shell("checkpoint/hand-11-unlock", f"cuda-checkpoint --action unlock --pid {pid}")
    after = _wait_counting(log, before)
    probe.python(
        "checkpoint/hand-12-resumed", lambda: {"before": before, "after": after, "fds": _fds(pid)}
    )
    if uuid and "\n" not in uuid and probe.left() > 40:
        # The map a resume onto other GPUs passes, here onto the same GPU.
        probe.shell("checkpoint/hand-13-lock", f"cuda-checkpoint --action lock --pid {pid}")
        probe.shell(
            "checkpoint/hand-14-checkpoint", f"cuda-checkpoint --action checkpoint --pid {pid}"
        )
        probe.shell("checkpoint/hand-15-restore-mapped", f"{restore} --device-map {uuid}={uuid}")
        probe.shell("checkpoint/hand-16-unlock", f"cuda-checkpoint --action unlock --pid {pid}")
        again = _wait_counting(log, _count(log))
        probe.python("checkpoint/hand-17-resumed", lambda: {"after": again})


def through_quiesce(probe: Probe, pid: int, log: Path) -> None:
    """gpu_quiesce's own steps (its Guest), on the real process: finding the holder, the
    checkpoint, the holders left, the restore."""
    if probe.left() < 40:
        return
    from vmsandbox.guest.programs import gpu_quiesce

    guest = gpu_quiesce.Guest()
    addresses = [p.name for p in nvidia_functions()]

    def run() -> dict[str, Any]:
        found: dict[str, Any] = {
            "style": guest.checkpointer(),
            "uuids": guest.uuids(),
            "holders_before": guest.holders(addresses),
            "gpu_memory": guest.gpu_memory(),
            "available_mib": guest.available_mib(),
        }
        began = time.monotonic()
        memory = found["gpu_memory"].get(pid, 0)
        found["checkpointed"] = guest.checkpoint(pid, found["style"], memory)
        found["checkpoint_s"] = round(time.monotonic() - began, 3)
        found["holders_checkpointed"] = guest.holders(addresses)
        count = _count(log)
        began = time.monotonic()
        guest.restore(pid, found["style"], {}, memory)
        found["restore_s"] = round(time.monotonic() - began, 3)
        found["counting_again"] = _wait_counting(log, count)
        found["count_before"] = count
        return found

    probe.python("checkpoint/quiesce", run)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    probe = Probe(out)
    probe.shell(
        "environment",
        "uname -a; cat /etc/os-release; id; for t in lspci nvidia-smi "
        "cuda-checkpoint nvcc dmesg journalctl sudo python3; do "
        "printf '%s: ' $t; command -v $t || echo missing; done",
    )
    try:
        gpus = host_steps(probe)
        verify_steps(probe, gpus)
        smi_steps(probe)
        kernel_steps(probe)
        checkpoint_steps(probe)
    finally:
        probe.finish()
    print(json.dumps(probe.steps, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
