"""Health signals: what the host and the guests say about a GPU, turned into one ``Signal``
per GPU concerned, each saying whether it quarantines the GPU and whether a reset cures it.

- config space (host sysfs) reads all ones, cannot be read, or stays in D3cold after a read
  woke it: quarantines; a reset cures it (once);
- AER in the host kernel's log, an uncorrected error (fatal or non-fatal) of the GPU, a
  function of its card or its port: quarantines; a reset cures it (once);
- AER, the kernel's recovery of the device failed: quarantines; a reset does not cure it;
- AER, a corrected error: reported only;
- libvirt, the GPU's domain paused on an error (QEMU's VFIO error handler stops the guest):
  quarantines; a reset cures it (once);
- an Xid in a guest's kernel log, by NVIDIA's catalogue (xid.py): an application's (13, 31,
  43, 45, 68, ...) is reported only; one whose cure is a reset (48, 62, 95, 119, ...)
  quarantines and a reset cures it (once); one whose cure is a reboot (79, ...) quarantines.

A reset that fails or times out, a GPU that does not answer after it, and a memory clear that
does not finish are the sanitize's own failures (sanitize.py): they quarantine at once. The
pure functions here read nothing; the monitor (``vmsandbox.sandbox.health``) gathers the
inputs and applies the signals to the custody records.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from vmsandbox.host import pcistate
from vmsandbox.host.aer import AerEvent
from vmsandbox.host.model import Gpu
from vmsandbox.host.sysfs import SYS_PCI_DEVICES

from .xid import APP, REBOOT, classify

CONFIRM_S = 0.3  # a config-space fault is read again after this long before it counts
FAULTS = ("cannot be read", "all ones", "D3cold")  # what not_answering says of a fault
# libvirt's paused reasons that a fault gives (vmsandbox never pauses a domain itself).
FAULT_PAUSES = ("ioerror", "unknown", "crashed", "api error", "postcopy failed")


@dataclass(frozen=True)
class Signal:
    bdf: str
    kind: str  # config, aer, vfio, xid
    words: str
    quarantines: bool = True
    reset_cures: bool = True


def functions_of(gpu: Gpu, port: str | None) -> tuple[str, ...]:
    """The functions whose errors concern ``gpu``: itself, its card's, the port above it."""
    return (gpu.bdf, *gpu.companions, *((port,) if port else ()))


def from_aer(
    events: Iterable[AerEvent], gpus: Iterable[Gpu], ports: Mapping[str, str | None]
) -> list[Signal]:
    """One signal per GPU that an AER event concerns (``ports``: each GPU's bridge)."""
    found = []
    listed = list(events)
    for gpu in gpus:
        functions = functions_of(gpu, ports.get(gpu.bdf))
        for event in listed:
            if not event.concerns(functions):
                continue
            where = "the GPU" if event.source == gpu.bdf else event.source
            if event.source == ports.get(gpu.bdf):
                where = f"its port {event.source}"
            words = f"AER: {event.severity} error at {where} ({event.line})"
            found.append(
                Signal(
                    gpu.bdf,
                    "aer",
                    words,
                    quarantines=event.severity != "corrected",
                    reset_cures=event.severity != "recovery-failed",
                )
            )
    return found


def from_config_space(
    gpu: Gpu,
    sysfs: str = SYS_PCI_DEVICES,
    sleep: Callable[[float], None] = time.sleep,
) -> Signal | None:
    """A signal when the GPU's config space says it does not answer, twice CONFIRM_S apart
    (a read in the middle of a reset a guest asked for is not a fault): it cannot be read, it
    reads all ones, or it stays in D3cold after a read that wakes it. Any other power state
    is someone's business (a guest's D3hot; "unknown" while vfio-pci takes the device)."""

    def fault() -> str | None:
        why = pcistate.not_answering(gpu.bdf, sysfs)
        if why is None or not any(word in why for word in FAULTS):
            return None
        return why

    if fault() is None:
        return None
    sleep(CONFIRM_S)
    why = fault()
    return None if why is None else Signal(gpu.bdf, "config", f"config space: {why}")


def from_pause(gpus: Iterable[str], domain: str, reason: str) -> list[Signal]:
    """The GPUs of a domain that libvirt reports paused for ``reason``, if a fault did it."""
    if reason not in FAULT_PAUSES:
        return []
    words = f"domain {domain} paused on an error ({reason}): QEMU stopped the guest"
    return [Signal(bdf, "vfio", words) for bdf in gpus]


def from_xid(bdf: str, xid: int, line: str) -> Signal:
    """An Xid a guest's kernel logged for the GPU it holds at host address ``bdf``."""
    kind = classify(xid, line)
    words = f"Xid {xid} ({kind.what}) in the guest: {line.strip()}"
    return Signal(bdf, "xid", words, quarantines=kind.kind != APP, reset_cures=kind.kind != REBOOT)
