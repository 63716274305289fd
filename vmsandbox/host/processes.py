"""Host processes holding a GPU open through its device nodes.

The nvidia driver names each GPU's node ``/dev/nvidiaN`` by its minor number, which it publishes
in ``/proc/driver/nvidia/gpus/<bdf>/information`` ("Device Minor: N"). A GPU on a DRM driver
(radeon, amdgpu, nouveau, and nvidia-drm beside nvidia) also has ``/dev/dri/cardN`` and
``/dev/dri/renderDN`` nodes, listed under the PCI device's ``drm/`` folder in sysfs. A process
holds the GPU when one of its ``/proc/<pid>/fd`` links points at one of its nodes. Entries that
vanish or cannot be read (other users' processes when not root) are skipped quietly.
"""

from __future__ import annotations

import os
from collections.abc import Iterable


def nvidia_minors(bdfs: Iterable[str], proc_root: str = "/proc") -> dict[str, int]:
    """Device minor of each nvidia-driven GPU in ``bdfs`` that the driver reports."""
    minors: dict[str, int] = {}
    for bdf in bdfs:
        path = os.path.join(proc_root, "driver", "nvidia", "gpus", bdf, "information")
        try:
            with open(path, encoding="utf-8") as handle:
                for line in handle:
                    key, _, value = line.partition(":")
                    if key.strip() == "Device Minor":
                        minors[bdf] = int(value)
                        break
        except (OSError, ValueError):
            continue
    return minors


def drm_nodes(sys_path: str) -> list[str]:
    """``/dev/dri`` nodes of the PCI device at ``sys_path`` (none when no DRM driver has it)."""
    try:
        names = sorted(os.listdir(os.path.join(sys_path, "drm")))
    except OSError:
        return []
    return [f"/dev/dri/{name}" for name in names if name.startswith(("card", "renderD"))]


def device_node_holders(nodes: Iterable[str], proc_root: str = "/proc") -> dict[str, set[int]]:
    """PIDs with an open file descriptor on each of ``nodes`` (paths like ``/dev/nvidia0``)."""
    holders: dict[str, set[int]] = {node: set() for node in nodes}
    if not holders:
        return holders
    try:
        entries = [entry.name for entry in os.scandir(proc_root) if entry.name.isdigit()]
    except OSError:
        return holders
    for pid in entries:
        fd_dir = os.path.join(proc_root, pid, "fd")
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(os.path.join(fd_dir, fd))
            except OSError:
                continue
            if target in holders:
                holders[target].add(int(pid))
    return holders


def process_name(pid: int, proc_root: str = "/proc") -> str | None:
    """Command name of a process (``/proc/<pid>/comm``), None when it is gone or hidden."""
    try:
        with open(os.path.join(proc_root, str(pid), "comm"), encoding="utf-8") as handle:
            return handle.read().strip() or None
    except OSError:
        return None
