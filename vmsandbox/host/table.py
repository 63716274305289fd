"""The inventory as a fixed-width text table, for ``vmsandbox gpus``: each GPU with its custody
state (``STATE``), and why any cannot be bound or is not free."""

from __future__ import annotations

from vmsandbox.tables import render_grid

from .model import Inventory

GPU_HEADER = (
    "#",
    "BDF",
    "VENDOR",
    "NAME",
    "MEMORY",
    "NUMA",
    "GROUP",
    "DRIVER",
    "BINDABLE",
    "IN USE BY",
    "STATE",
)
FABRIC_HEADER = ("BDF", "VENDOR", "NAME", "NUMA", "GROUP", "DRIVER")


NAME_WIDTH = 40


def _cell(value: object) -> str:
    return "-" if value is None else str(value)


def _name(name: str | None) -> str:
    if name is None:
        return "-"
    return name if len(name) <= NAME_WIDTH else name[: NAME_WIDTH - 3] + "..."


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"


def _summary(inv: Inventory) -> str:
    host = inv.to_dict()["host"]
    return (
        f"{_count(host['gpus'], 'GPU')} ({host['bindable']} bindable, {host['free']} free), "
        f"{_count(host['fabric'], 'fabric device')}, "
        f"{_count(host['pci_devices'], 'PCI device')} scanned; "
        f"IOMMU {'on' if inv.iommu else 'off'}; NVML {'used' if inv.nvml else 'not used'}"
    )


def render_table(inv: Inventory) -> str:
    """The GPUs, why any cannot be bound, the fabric devices and a summary line."""
    lines: list[str] = []
    if not inv.gpus:
        lines.append(
            f"no GPUs found on this host ({_count(inv.pci_devices, 'PCI device')} scanned; "
            f"IOMMU {'on' if inv.iommu else 'off'})"
        )
    else:
        rows = [
            (
                str(gpu.index),
                gpu.bdf,
                gpu.vendor,
                _name(gpu.name),
                "-" if gpu.memory_mib is None else f"{gpu.memory_mib} MiB",
                _cell(gpu.numa_node),
                _cell(gpu.iommu_group),
                _cell(gpu.driver),
                "yes" if gpu.bindable else "no",
                _cell(gpu.in_use_by),
                gpu.custody,
            )
            for gpu in inv.gpus
        ]
        lines += render_grid(GPU_HEADER, rows)
        blocked = [gpu for gpu in inv.gpus if not gpu.bindable]
        if blocked:
            lines += ["", "not bindable:"]
            for gpu in blocked:
                lines += [f"  {gpu.index} {gpu.bdf}: {reason}" for reason in gpu.reasons]
        out = [gpu for gpu in inv.gpus if gpu.custody_reason]
        if out:
            lines += ["", "not free (custody):"]
            lines += [
                f"  {gpu.index} {gpu.bdf}: {gpu.custody} since {gpu.custody_since or '?'}: "
                f"{gpu.custody_reason}"
                for gpu in out
            ]
    if inv.fabric:
        fabric_rows = [
            (
                dev.bdf,
                dev.vendor,
                _name(dev.name),
                _cell(dev.numa_node),
                _cell(dev.iommu_group),
                _cell(dev.driver),
            )
            for dev in inv.fabric
        ]
        lines += ["", "fabric (not passed to guests):", *render_grid(FABRIC_HEADER, fabric_rows)]
    if inv.gpus:
        lines += ["", _summary(inv)]
    lines += [f"note: {note}" for note in inv.notes]
    return "\n".join(lines) + "\n"
