"""Resetting one PCI function through the kernel, by the strongest method its topology allows.

The kernel lists the methods it can use for a function in sysfs ``reset_method`` (Linux 5.15
and later) and resets it when ``1`` is written to ``reset``, saving and restoring its config
space around the reset and telling the bound driver, if any, before and after. Of those
methods, two count as a reset of a GPU between tenants:

- ``bus``: a secondary bus reset (SBR) of the bridge above it. The kernel offers it only when
  nothing else sits below that bridge (``pci_parent_bus_reset``), so it resets the GPU's own
  link and nobody else's device. It is the strongest: the whole device, its memory controller
  and firmware included, starts again (NVIDIA GPUs clear their memory after it).
- ``flr``: a Function Level Reset (also ``af_flr``, its form for conventional PCI), for a GPU
  that shares its bus (other functions of its card: HDMI audio, USB).

``pm`` (D3hot and back) is not counted: devices that set No_Soft_Reset keep their state
through it. A function with neither is not bindable (``discover``, NO_RESET). The method is
chosen by writing it to ``reset_method`` for the one reset and writing the previous list back
afterwards. On kernels without ``reset_method`` the ``reset`` file alone says the kernel can
reset it, its own way (``reset``).

The write to ``reset`` returns when the kernel is done (it waits for the device itself); a
write that never returns (a device that hangs the bus) is given up after ``timeout`` seconds
from a thread of its own, and the reset counts as failed.
"""

from __future__ import annotations

import contextlib
import os
import threading

from .sysfs import SYS_PCI_DEVICES

SBR = ("bus", "cxl_bus")
FLR = ("flr", "af_flr")
KERNEL_CHOICE = "reset"  # a kernel without reset_method: its own order


class ResetFailed(Exception):
    """The kernel refused the reset, or it did not return in time."""


def choose(methods: tuple[str, ...]) -> str | None:
    """The reset to use of ``methods`` (``reset_method``'s words): SBR first, then FLR; the
    kernel's own choice where it lists no methods but has a ``reset`` file; None without."""
    for method in (*SBR, *FLR):
        if method in methods:
            return method
    return KERNEL_CHOICE if methods == (KERNEL_CHOICE,) else None


def methods_of(bdf: str, sysfs: str = SYS_PCI_DEVICES) -> tuple[str, ...]:
    """``reset_method``'s words now; ("reset",) on a kernel that has only the ``reset``
    file; () when the kernel cannot reset the function."""
    folder = os.path.join(sysfs, bdf)
    try:
        with open(os.path.join(folder, "reset_method")) as listed:
            return tuple(listed.read().split())
    except FileNotFoundError:
        return (KERNEL_CHOICE,) if os.path.exists(os.path.join(folder, "reset")) else ()
    except OSError:
        return ()


def _write(path: str, text: str) -> None:
    with open(path, "w") as attribute:
        attribute.write(text)


def reset(bdf: str, method: str, timeout: float, sysfs: str = SYS_PCI_DEVICES) -> None:
    """Reset the function with ``method`` (one of ``choose``'s answers); ResetFailed with the
    kernel's words, or when the reset has not returned after ``timeout`` seconds."""
    folder = os.path.join(sysfs, bdf)
    listed = os.path.join(folder, "reset_method")
    before = None
    if method != KERNEL_CHOICE:
        try:
            with open(listed) as current:
                before = current.read().strip()
            _write(listed, method)
        except OSError as exc:
            raise ResetFailed(f"choosing the {method} reset: {exc.strerror or exc}") from exc
    failure: list[str] = []

    def press() -> None:
        try:
            _write(os.path.join(folder, "reset"), "1")
        except OSError as exc:
            failure.append(f"the kernel refused the {method} reset: {exc.strerror or exc}")

    worker = threading.Thread(target=press, name=f"reset-{bdf}", daemon=True)
    worker.start()
    worker.join(timeout)
    try:
        if worker.is_alive():
            raise ResetFailed(f"the {method} reset did not return within {timeout:.0f} s")
        if failure:
            raise ResetFailed(failure[0])
    finally:
        if before is not None and not worker.is_alive():
            # on failure the kernel keeps the one method: later resets still choose it
            with contextlib.suppress(OSError):
                _write(listed, before or "default")
