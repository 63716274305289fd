"""The hardware memory clear of NVIDIA GPUs after a reset, waited for as NVIDIA's
gpu-admin-tools waits for it (``wait_for_memory_clear`` in its nvidia_gpu_tools.py).

From Turing on, an NVIDIA GPU clears its memory by itself after a reset, before it is used
again; a GPU whose clear has not finished can still hand the last tenant's data to the next.
gpu-admin-tools first waits for the GPU's boot to complete (Turing does several clears
asynchronously, and the last one starts only then), then polls the register that says the
clear has finished. Both are 32-bit registers in BAR0, read here through the function's sysfs
``resource0`` file (mapped one page at a time):

| Architecture | Boot complete | Memory clear finished | Timeout |
|---|---|---|---|
| Turing, Ampere, Ada | ``0x118234 == 0x3ff`` | ``0x100b20`` bit 0 | 5 s each |
| Hopper | ``0x200bc == 0xff`` (FSP boot) | ``0x100b20`` bit 0 | 5 s each |
| Blackwell GB10x | ``0x200bc == 0xff`` | ``0x8a004c`` bit 0 | 10 s, 5 s |
| Blackwell GB20x | ``0xad00bc == 0xff`` | ``0x8a004c`` bit 0 | 10 s, 5 s |

The architecture comes from the device id where gpu-admin-tools takes it from there (Hopper:
0x22f0-0x237f; Blackwell: its device-id ranges), else from PMC_BOOT_0 (BAR0 offset 0, the
architecture in bits 28:24: 0x16 Turing, 0x17 Ampere, 0x19 Ada). Older GPUs (Volta and
before) have no hardware clear: ``architecture`` says so and the caller must clear their
memory otherwise.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from .sysfs import SYS_PCI_DEVICES

PMC_BOOT_0 = 0x0
PAGE = mmap.PAGESIZE
POLL_S = 0.01
# Device-id ranges gpu-admin-tools knows the chip of (gpu/devid_chips.py), and Hopper's.
_BY_DEVICE_ID = (
    (0x22F0, 0x237F, "hopper"),
    (0x2900, 0x297F, "blackwell-gb10x"),  # GB100
    (0x2980, 0x29FF, "blackwell-gb10x"),  # GB102
    (0x3180, 0x31FF, "blackwell-gb10x"),  # GB110 (GB100's registers)
    (0x3200, 0x327F, "blackwell-gb10x"),  # GB112 (GB102's registers)
    (0x2B80, 0x2BFF, "blackwell-gb20x"),  # GB202
    (0x2C00, 0x2C7F, "blackwell-gb20x"),  # GB203
    (0x2F00, 0x2F7F, "blackwell-gb20x"),  # GB205
    (0x2D00, 0x2D7F, "blackwell-gb20x"),  # GB206
    (0x2D80, 0x2DFF, "blackwell-gb20x"),  # GB207
)
# PMC_BOOT_0's architecture field (bits 28:24) for the rest.
_BY_BOOT_0 = {0x16: "turing", 0x17: "ampere", 0x19: "ada", 0x18: "hopper"}


@dataclass(frozen=True)
class ClearRegisters:
    """Where one architecture says its boot is complete and its memory clear has finished."""

    boot: int
    boot_value: int
    boot_timeout: float
    clear: int
    clear_timeout: float = 5.0


REGISTERS = {
    "turing": ClearRegisters(0x118234, 0x3FF, 5.0, 0x100B20),
    "ampere": ClearRegisters(0x118234, 0x3FF, 5.0, 0x100B20),
    "ada": ClearRegisters(0x118234, 0x3FF, 5.0, 0x100B20),
    "hopper": ClearRegisters(0x200BC, 0xFF, 5.0, 0x100B20),
    "blackwell-gb10x": ClearRegisters(0x200BC, 0xFF, 10.0, 0x8A004C),
    "blackwell-gb20x": ClearRegisters(0xAD00BC, 0xFF, 10.0, 0x8A004C),
}


class ClearFailed(Exception):
    """BAR0 could not be read, or the GPU did not report its clear in time."""


class Bar0:
    """32-bit reads of a GPU's BAR0 through its sysfs ``resource0`` file."""

    def __init__(self, bdf: str, sysfs: str = SYS_PCI_DEVICES) -> None:
        self.path = os.path.join(sysfs, bdf, "resource0")

    def read(self, offset: int) -> int:
        base = offset - offset % PAGE
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_SYNC)
        except OSError as exc:
            raise ClearFailed(f"BAR0 cannot be opened: {exc.strerror or exc}") from exc
        try:
            with mmap.mmap(fd, PAGE, mmap.MAP_SHARED, mmap.PROT_READ, offset=base) as page:
                start = offset - base
                return int.from_bytes(page[start : start + 4], "little")
        except (OSError, ValueError) as exc:
            raise ClearFailed(f"BAR0 offset {offset:#x} cannot be read: {exc}") from exc
        finally:
            os.close(fd)


def architecture(device_id: int, bar0: Bar0) -> str | None:
    """The GPU's architecture as REGISTERS names it; None for one without a hardware memory
    clear (Volta and older) or that vmsandbox does not know."""
    for low, high, arch in _BY_DEVICE_ID:
        if low <= device_id <= high:
            return arch
    boot0 = bar0.read(PMC_BOOT_0)
    if boot0 == 0xFFFFFFFF or boot0 >> 16 in (0xBADF, 0xBAD0):
        raise ClearFailed(f"PMC_BOOT_0 reads {boot0:#010x}: the GPU's BAR0 does not answer")
    return _BY_BOOT_0.get((boot0 >> 24) & 0x1F)


def _poll(
    bar0: Bar0,
    what: str,
    offset: int,
    done: Callable[[int], bool],
    timeout: float,
    clock: Callable[[], float],
    sleep: Callable[[float], None],
) -> None:
    began = clock()
    while True:
        value = bar0.read(offset)
        if done(value):
            return
        if clock() - began > timeout:
            raise ClearFailed(
                f"{what} not reported within {timeout:.0f} s (register {offset:#x} = {value:#x})"
            )
        sleep(POLL_S)


def wait_memory_clear(
    bar0: Bar0,
    arch: str,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Wait until a GPU of ``arch`` (a key of REGISTERS) has booted and cleared its memory;
    ClearFailed with the register and its value when it has not within the timeout."""
    regs = REGISTERS[arch]
    _poll(
        bar0,
        "boot complete",
        regs.boot,
        lambda value: value == regs.boot_value,
        regs.boot_timeout,
        clock,
        sleep,
    )
    _poll(
        bar0,
        "memory clear finished",
        regs.clear,
        lambda value: bool(value & 0x1),
        regs.clear_timeout,
        clock,
        sleep,
    )
