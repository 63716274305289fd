"""The shape of the compatibility table: a row per field of a platform, with examples."""

from __future__ import annotations

from dataclasses import dataclass

from vmsandbox.gpu.request import GpuRequest

A = "0000:41:00.0"  # the PCI address the examples name


@dataclass(frozen=True)
class Example:
    """One input (as decoded JSON) and each side's answer, in the page's words."""

    platform: str
    given: object
    platform_says: str
    vmsandbox_says: str


@dataclass(frozen=True)
class Row:
    """One field of one platform."""

    platform: str
    field: str
    platform_does: str
    vmsandbox_does: str
    examples: tuple[Example, ...]
    differs: str | None = None  # the intended difference's name in the test's table


def describe(request: GpuRequest | None) -> str:
    """A GpuRequest in the page's words: "no GPU", "2 nvidia GPUs", "1 GPU: 0000:41:00.0"."""
    if request is None:
        return "no GPU"
    vendor = f"{request.vendor} " if request.vendor else ""
    if request.all:
        text = f"every {vendor}GPU"
    else:
        count = request.count or len(request.devices) or 1
        text = f"{count} {vendor}GPU{'s' if count != 1 else ''}"
    if request.devices:
        text += ": " + ", ".join(request.devices)
    if request.model:
        text += f", model {request.model}"
    if request.min_memory_mib:
        text += f", >= {request.min_memory_mib} MiB"
    return text


def examples(platform: str, *cases: tuple[object, str, str]) -> tuple[Example, ...]:
    """``platform``'s examples, each (given, what the platform says, what vmsandbox says)."""
    return tuple(Example(platform, given, says, ours) for given, says, ours in cases)
