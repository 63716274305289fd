#!/usr/bin/python3
"""vmsandbox's GPU hand-over in the guest: its GPUs let go before a suspend, and the GPUs a
resume attached taken up again. Fed to ``python3 - quiesce|revive ...`` over SSH as root
(vmsandbox/guest/quiesce.py); standard library only.

``quiesce [--force] ID...`` (each ID the ``vendor:device`` of one of the sandbox's GPU
functions, e.g. ``10de:2330``):

1. the guest's PCI functions of those ids, each with the driver bound to it;
2. with NVIDIA's driver, each GPU's UUID by its guest PCI address (nvidia-smi): the map of old
   UUIDs to new ones that a restore after the resume needs;
3. the processes that hold a GPU: an open ``/dev/nvidia*`` node, or a DRM node of one of
   the functions (nvidia-persistenced aside: it is stopped below);
4. where ``cuda-checkpoint`` is installed, each of them that runs CUDA checkpointed: its GPU
   state goes to its own memory, it lets the GPU go, and it keeps its PID. Its GPU memory
   (nvidia-smi) then takes that much of the guest's memory, and some more
   (CHECKPOINT_OVERHEAD_MIB): one that would not fit in the guest's available memory is not
   checkpointed (the out-of-memory killer would end it, or another process), and is named
   with that reason in step 5;
5. processes that still hold a GPU: ended (SIGKILL) with ``--force``; else the checkpointed
   ones are restored and the answer names them (exit 3: the suspend fails);
6. nvidia-persistenced stopped, NVIDIA's modules unloaded (``modprobe -r``), any other driver
   unbound from the functions.

``revive``: what quiesce unloaded is loaded again, each function that had a driver waited for
until one has it again (the GPUs a resume attached sit at the same guest addresses), the
checkpointed processes restored with the map of old GPU UUIDs to new ones by guest address
(``cuda-checkpoint --device-map``, drivers 580 and later; earlier ones restore onto GPUs of the
same UUIDs only), and nvidia-persistenced started again.

The answer is one JSON object on stdout (exit 0; 3 for processes that hold a GPU; 4 for
anything else that failed, with ``error``). What quiesce did is kept in STATE, in the guest's
memory (saved and restored with it), until revive has undone it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

STATE = Path("/run/vmsandbox/gpu-quiesce.json")
NVIDIA_MODULES = ("nvidia_uvm", "nvidia_drm", "nvidia_modeset", "nvidia")  # unload order
PERSISTENCED = "nvidia-persistenced"
EXIT_HELD = 3
EXIT_FAILED = 4
END_WAIT_S = 10.0
DRIVER_WAIT_S = 60.0
POLL_S = 0.2
COMMAND_TIMEOUT_S = 120.0
# Measured on an H100 with driver 580 (bench/gpu_checkpoint.py): a checkpointed process takes
# its GPU memory and about 460 MiB more of host memory; checkpoint 0.63 s and restore 0.24 s
# per GiB of GPU memory. The time limits give each step three times that.
CHECKPOINT_OVERHEAD_MIB = 512
CHECKPOINT_S_PER_GIB = 2.0
RESTORE_S_PER_GIB = 1.0

Run = Callable[..., "subprocess.CompletedProcess[str]"]  # (argv, timeout=seconds)


class Failed(Exception):
    """A step failed; the message says which and why."""


def run_command(
    argv: Sequence[str], timeout: float = COMMAND_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, check=False, timeout=timeout)


class Guest:
    """The guest as this program sees it: ``root`` holds sys/, proc/, dev/ and run/ (``/`` in a
    guest, a folder in the tests), ``run`` runs a command."""

    def __init__(self, root: Path = Path("/"), run: Run = run_command) -> None:
        self.root = root
        self.run = run
        self.state = root / STATE.relative_to("/")

    # -- what is there --------------------------------------------------------------------

    def functions(self, ids: Sequence[str]) -> dict[str, str]:
        """Guest PCI address -> bound driver ("" for none) of the functions of ``ids``."""
        wanted = {i.lower() for i in ids}
        found: dict[str, str] = {}
        devices = self.root / "sys/bus/pci/devices"
        for device in sorted(devices.iterdir()) if devices.is_dir() else []:
            try:
                vendor = (device / "vendor").read_text().strip().removeprefix("0x")
                product = (device / "device").read_text().strip().removeprefix("0x")
            except OSError:
                continue
            if f"{vendor}:{product}".lower() in wanted:
                driver = device / "driver"
                bound = driver.is_symlink()
                found[device.name] = os.path.basename(os.readlink(driver)) if bound else ""
        return found

    def loaded(self, module: str) -> bool:
        return (self.root / "sys/module" / module).is_dir()

    def uuids(self) -> dict[str, str]:
        """Guest PCI address -> NVIDIA GPU UUID, from nvidia-smi ({} without it)."""
        if not shutil.which("nvidia-smi"):
            return {}
        done = self.run(["nvidia-smi", "--query-gpu=pci.bus_id,uuid", "--format=csv,noheader"])
        found = {}
        for line in done.stdout.splitlines() if done.returncode == 0 else []:
            bus, _, uuid = (part.strip() for part in line.partition(","))
            if bus and uuid:
                found[bus.lower()[-12:]] = uuid
        return found

    def gpu_memory(self) -> dict[int, int]:
        """PID -> MiB of GPU memory each CUDA process uses, all GPUs together (nvidia-smi;
        {} without it)."""
        if not shutil.which("nvidia-smi"):
            return {}
        query = "--query-compute-apps=pid,used_memory"
        done = self.run(["nvidia-smi", query, "--format=csv,noheader,nounits"])
        found: dict[int, int] = {}
        for line in done.stdout.splitlines() if done.returncode == 0 else []:
            pid, _, used = (part.strip() for part in line.partition(","))
            if pid.isdigit() and used.isdigit():
                found[int(pid)] = found.get(int(pid), 0) + int(used)
        return found

    def available_mib(self) -> int:
        """The guest's available memory (``MemAvailable``), MiB."""
        for line in (self.root / "proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
        return 0

    def nodes(self, addresses: Sequence[str]) -> set[str]:
        """The DRM device nodes of ``addresses``."""
        found = set()
        for address in addresses:
            drm = self.root / "sys/bus/pci/devices" / address / "drm"
            for node in drm.iterdir() if drm.is_dir() else []:
                found.add(f"/dev/dri/{node.name}")
        return found

    def holders(self, addresses: Sequence[str]) -> dict[int, str]:
        """PID -> command of the processes with a GPU's device node open (this one and
        nvidia-persistenced aside)."""
        nodes = self.nodes(addresses)
        found: dict[int, str] = {}
        proc = self.root / "proc"
        for entry in proc.iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                command = (entry / "comm").read_text().strip()
                targets = [os.readlink(fd) for fd in (entry / "fd").iterdir()]
            except OSError:
                continue  # gone meanwhile, or a kernel thread
            if command == PERSISTENCED:
                continue
            if any(t.startswith("/dev/nvidia") or t in nodes for t in targets):
                found[int(entry.name)] = command
        return found

    def alive(self, pid: int) -> bool:
        return (self.root / "proc" / str(pid)).exists()

    def kill(self, pid: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    # -- cuda-checkpoint ------------------------------------------------------------------

    def checkpointer(self) -> str:
        """How cuda-checkpoint is driven: "action" (--action, drivers 570 and later),
        "toggle" (--toggle, 550 and later) or "" (not installed)."""
        if not shutil.which("cuda-checkpoint"):
            return ""
        done = self.run(["cuda-checkpoint", "--help"])
        return "action" if "--action" in done.stdout + done.stderr else "toggle"

    def checkpoint(self, pid: int, style: str, memory_mib: int = 0) -> bool:
        """Checkpoint ``pid`` (``memory_mib`` of GPU memory) if it runs CUDA; whether it was."""
        state = self.run(["cuda-checkpoint", "--get-state", "--pid", str(pid)])
        if state.returncode != 0 or state.stdout.strip() != "running":
            return False
        steps = [["--toggle"]]
        if style == "action":
            steps = [["--action", "lock"], ["--action", "checkpoint"]]
        timeout = COMMAND_TIMEOUT_S + CHECKPOINT_S_PER_GIB * memory_mib / 1024
        for step in steps:
            done = self.run(["cuda-checkpoint", *step, "--pid", str(pid)], timeout=timeout)
            if done.returncode != 0:
                raise Failed(f"cuda-checkpoint {' '.join(step)} of process {pid}: {_said(done)}")
        return True

    def restore(
        self, pid: int, style: str, device_map: dict[str, str], memory_mib: int = 0
    ) -> None:
        """Restore checkpointed ``pid`` (``memory_mib`` of GPU memory), its GPUs mapped from
        old UUIDs to new ones."""
        moved = {old: new for old, new in device_map.items() if old != new}
        if style == "action":
            mapped = ["--device-map", ",".join(f"{o}={n}" for o, n in moved.items())]
            steps = [["--action", "restore", *(mapped if moved else [])], ["--action", "unlock"]]
        elif moved:
            raise Failed(
                f"process {pid} was checkpointed on GPUs that are now others and this "
                "cuda-checkpoint has no --device-map (driver 580 or later has)"
            )
        else:
            steps = [["--toggle"]]
        timeout = COMMAND_TIMEOUT_S + RESTORE_S_PER_GIB * memory_mib / 1024
        for step in steps:
            done = self.run(["cuda-checkpoint", *step, "--pid", str(pid)], timeout=timeout)
            if done.returncode != 0:
                raise Failed(f"cuda-checkpoint {' '.join(step)} of process {pid}: {_said(done)}")

    # -- drivers --------------------------------------------------------------------------

    def unbind(self, address: str) -> None:
        path = self.root / "sys/bus/pci/devices" / address / "driver/unbind"
        path.write_text(address)

    def systemctl(self, verb: str) -> bool:
        """``systemctl VERB nvidia-persistenced``; whether it succeeded."""
        return self.run(["systemctl", verb, PERSISTENCED]).returncode == 0


def _said(done: subprocess.CompletedProcess[str]) -> str:
    """A failed command's last line of output, or its exit status."""
    lines = (done.stderr or done.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit {done.returncode}"


def quiesce(guest: Guest, ids: Sequence[str], *, force: bool) -> dict[str, object]:
    """Let the GPUs of ``ids`` go (see the module docstring); the report, also kept in
    STATE for revive. Raises Held for processes that hold a GPU (unless ``force``)."""
    drivers = guest.functions(ids)
    addresses = sorted(drivers)
    nvidia = any(driver == "nvidia" for driver in drivers.values())
    report: dict[str, object] = {
        "functions": drivers,
        "uuids": guest.uuids() if nvidia else {},
        "checkpointed": [],
        "ended": [],
        "unloaded": [],
        "unbound": [],
        "persistenced": False,
    }
    checkpointed: list[int] = []
    style = guest.checkpointer()
    holders = guest.holders(addresses)
    memory = guest.gpu_memory() if style and nvidia else {}
    why: dict[int, str] = {}
    try:
        if style:
            room = guest.available_mib()
            for pid in sorted(holders):
                need = memory.get(pid, 0) + CHECKPOINT_OVERHEAD_MIB
                if pid in memory and need > room:
                    why[pid] = (
                        f"not checkpointed: its {memory[pid]} MiB of GPU memory needs about "
                        f"{need} MiB of the guest's memory, {room} MiB is available"
                    )
                elif guest.checkpoint(pid, style, memory.get(pid, 0)):
                    checkpointed.append(pid)
                    room -= need
            holders = guest.holders(addresses)
        if holders and not force:
            raise Held(holders, why)
        ended = _end(guest, holders)
    except BaseException:
        for pid in checkpointed:  # they run on as before
            guest.restore(pid, style, {}, memory.get(pid, 0))
        raise
    report["checkpointed"], report["ended"], report["style"] = checkpointed, ended, style
    report["memory"] = {str(pid): memory[pid] for pid in checkpointed if pid in memory}
    if nvidia:
        report["persistenced"] = guest.systemctl("is-active") and guest.systemctl("stop")
        loaded = [module for module in NVIDIA_MODULES if guest.loaded(module)]
        done = guest.run(["modprobe", "-r", *loaded]) if loaded else None
        if done is not None and done.returncode != 0:
            raise Failed(f"unloading {', '.join(loaded)} failed: {_said(done)}")
        report["unloaded"] = loaded
    unbound = [address for address, driver in drivers.items() if driver and driver != "nvidia"]
    for address in unbound:
        guest.unbind(address)
    report["unbound"] = unbound
    guest.state.parent.mkdir(parents=True, exist_ok=True)
    guest.state.write_text(json.dumps(report))
    return report


class Held(Exception):
    """Processes hold a GPU and were not to be ended; ``why`` says of some why they were not
    checkpointed."""

    def __init__(self, holders: dict[int, str], why: dict[int, str] | None = None) -> None:
        named = (f"{pid} ({command})" for pid, command in sorted(holders.items()))
        super().__init__(", ".join(named))
        self.holders = holders
        self.why = {pid: reason for pid, reason in (why or {}).items() if pid in holders}


def _end(guest: Guest, holders: dict[int, str]) -> list[int]:
    """SIGKILL each holder and wait until it is gone."""
    for pid in holders:
        guest.kill(pid)
    deadline = time.monotonic() + END_WAIT_S
    while any(guest.alive(pid) for pid in holders):
        if time.monotonic() > deadline:
            raise Failed(f"processes {sorted(holders)} did not end within {END_WAIT_S:.0f} s")
        time.sleep(POLL_S)
    return sorted(holders)


def revive(guest: Guest, *, wait: float = DRIVER_WAIT_S) -> dict[str, object]:
    """Take the GPUs up again after a resume (module docstring); the report."""
    if not guest.state.exists():
        return {"revived": False}
    before = json.loads(guest.state.read_text())
    loaded = []
    for module in reversed(before.get("unloaded", [])):
        done = guest.run(["modprobe", module])
        if done.returncode != 0:
            raise Failed(f"loading {module} failed: {_said(done)}")
        loaded.append(module)
    functions: dict[str, str] = before.get("functions", {})
    deadline = time.monotonic() + wait
    while True:
        ids = _ids(guest, functions)
        now = guest.functions(ids)
        missing = [a for a, driver in functions.items() if driver and not now.get(a)]
        if not missing:
            break
        if time.monotonic() > deadline:
            raise Failed(f"no driver took {', '.join(missing)} within {wait:.0f} s")
        time.sleep(POLL_S)
    if before.get("persistenced"):
        guest.systemctl("start")
    old: dict[str, str] = before.get("uuids", {})
    new = guest.uuids() if old else {}
    device_map = {uuid: new.get(address, uuid) for address, uuid in old.items()}
    restored = []
    memory: dict[str, int] = before.get("memory", {})
    for pid in before.get("checkpointed", []):
        style = str(before.get("style", ""))
        guest.restore(int(pid), style, device_map, memory.get(str(pid), 0))
        restored.append(int(pid))
    guest.state.unlink()
    return {"revived": True, "loaded": loaded, "restored": restored, "device_map": device_map}


def _ids(guest: Guest, functions: dict[str, str]) -> list[str]:
    """The vendor:device ids present now at ``functions``' addresses."""
    ids = []
    for address in functions:
        device = guest.root / "sys/bus/pci/devices" / address
        try:
            vendor = (device / "vendor").read_text().strip().removeprefix("0x")
            product = (device / "device").read_text().strip().removeprefix("0x")
        except OSError:
            continue
        ids.append(f"{vendor}:{product}")
    return ids


def main(argv: list[str], guest: Guest | None = None) -> int:
    guest = guest or Guest()
    try:
        if argv[:1] == ["quiesce"]:
            args = argv[1:]
            force = "--force" in args
            report = quiesce(guest, [a for a in args if a != "--force"], force=force)
        elif argv == ["revive"]:
            report = revive(guest)
        else:
            raise Failed(f"usage: gpu_quiesce.py quiesce [--force] ID... | revive, got {argv!r}")
    except Held as held:
        named = {str(pid): command for pid, command in sorted(held.holders.items())}
        print(json.dumps({"held": named, "why": {str(p): w for p, w in held.why.items()}}))
        return EXIT_HELD
    except (Failed, OSError, subprocess.SubprocessError, ValueError) as exc:
        print(json.dumps({"error": str(exc)}))
        return EXIT_FAILED
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
