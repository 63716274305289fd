"""Host CPU topology: which host CPUs belong to which NUMA node, and libvirt cpuset strings.

A GPU sandbox runs best with its vCPUs and memory on the NUMA node its GPUs hang off
(``vmsandbox.gpu.passthrough`` pins them); the kernel lists each node's CPUs in
``/sys/devices/system/node/nodeN/cpulist``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

_NODE_DIR = re.compile(r"node([0-9]+)")


def parse_cpulist(text: str) -> list[int]:
    """CPUs of a kernel cpulist (``0-3,8,10-11``), ascending; blank text gives ``[]``.

    Raises ValueError on anything that is not a cpulist.
    """
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        start, end = int(first), int(last or first)
        if start < 0 or end < start:
            raise ValueError(f"not a cpulist: {text!r}")
        cpus.update(range(start, end + 1))
    return sorted(cpus)


def format_cpuset(cpus: Iterable[int]) -> str:
    """A libvirt cpuset (``0-3,8,10-11``) naming ``cpus``, consecutive runs collapsed."""
    runs: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def host_cpus_by_node(sysfs_root: str | Path = "/sys") -> dict[int, list[int]]:
    """Map each NUMA node of the host to its CPUs, read from sysfs.

    A node without CPUs (memory only, as CXL memory is) maps to ``[]``; a kernel without NUMA
    support has no node directory, which gives ``{}``.
    """
    nodes = Path(sysfs_root) / "devices" / "system" / "node"
    if not nodes.is_dir():
        return {}
    found: dict[int, list[int]] = {}
    for entry in nodes.iterdir():
        match = _NODE_DIR.fullmatch(entry.name)
        if match and (entry / "cpulist").is_file():
            found[int(match[1])] = parse_cpulist((entry / "cpulist").read_text())
    return dict(sorted(found.items()))
