"""A PCI function's live state, read from sysfs at the moment of the call: its config space,
its power state, and the bridge it sits behind.

Nothing here is cached (``sysfs.PciFunction`` caches what the inventory reads once): a GPU's
sanitize steps poll these while the device comes back from a reset, and the health signals
read them while a device fails. A function answers when its config space can be read and is
not all ones (what a read returns from a device that is gone, in D3cold, or whose link is
down) and it is in D0.

Every function takes ``sysfs``, the folder of PCI functions (``/sys/bus/pci/devices``), so
the tests run on a folder of plain files made under ``tmp_path``.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Callable, Iterator

from .sysfs import SYS_PCI_DEVICES

ALL_ONES = 0xFFFF
_STATUS = 0x06
_STATUS_CAP_LIST = 0x10
_CAP_POINTER = 0x34
_PM_CAP_ID = 0x01
_PMCSR = 4  # the PM capability's control/status register, from the capability's start
_BDF_NAME = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
POLL_S = 0.05
D_STATES = ("D0", "D1", "D2", "D3hot")  # PMCSR PowerState 0..3; D3cold reads as all ones


class DeviceGone(Exception):
    """The function did not answer in time: the words say what was last seen."""


def path_of(bdf: str, sysfs: str = SYS_PCI_DEVICES) -> str:
    return os.path.join(sysfs, bdf)


def read_config(bdf: str, length: int = 64, sysfs: str = SYS_PCI_DEVICES) -> bytes:
    """The first ``length`` bytes of the function's config space (OSError when it cannot be
    read: the function is gone from sysfs)."""
    with open(os.path.join(path_of(bdf, sysfs), "config"), "rb") as config:
        return config.read(length)


def _word(data: bytes, offset: int) -> int:
    return int.from_bytes(data[offset : offset + 2], "little")


def pm_state(config: bytes) -> str | None:
    """The D-state in the PM capability's control register, None without one (or without
    enough of the config space to find it)."""
    if len(config) < 0x40 or not _word(config, _STATUS) & _STATUS_CAP_LIST:
        return None
    pointer, seen = config[_CAP_POINTER] & 0xFC, set()
    while pointer and pointer not in seen and pointer + 8 <= len(config):
        seen.add(pointer)
        if config[pointer] == _PM_CAP_ID:
            return D_STATES[_word(config, pointer + _PMCSR) & 0x3]
        pointer = config[pointer + 1] & 0xFC
    return None


def power_state(bdf: str, sysfs: str = SYS_PCI_DEVICES) -> str | None:
    """``D0``, ``D3hot``, ``D3cold``, ... from the kernel's ``power_state`` attribute (Linux
    5.17 and later), else from the PM capability; None when neither says."""
    try:
        with open(os.path.join(path_of(bdf, sysfs), "power_state")) as attribute:
            return attribute.read().strip() or None
    except OSError:
        pass
    try:
        return pm_state(read_config(bdf, 256, sysfs))
    except OSError:
        return None


def not_answering(bdf: str, sysfs: str = SYS_PCI_DEVICES) -> str | None:
    """Why the function does not answer now, None when it does: its config space is readable,
    not all ones, and it is in D0. Reading the config space through sysfs wakes a function
    that the kernel let sleep (runtime power management), so one still in D3cold after the
    read did not come back."""
    try:
        config = read_config(bdf, 256, sysfs)
    except OSError as exc:
        return f"its config space cannot be read ({exc.strerror or exc})"
    if len(config) < 4:
        return f"its config space is {len(config)} bytes long"
    if _word(config, 0) == ALL_ONES:
        return "its config space reads all ones (the device does not answer)"
    state = power_state(bdf, sysfs)
    if state is not None and state != "D0":
        return f"it is in {state}, not D0"
    return None


def wait_answering(
    bdf: str,
    timeout: float,
    sysfs: str = SYS_PCI_DEVICES,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> float:
    """Seconds until the function answers (``not_answering`` is None); DeviceGone with the
    last words after ``timeout`` seconds."""
    began = clock()
    while True:
        why = not_answering(bdf, sysfs)
        if why is None:
            return clock() - began
        if clock() - began >= timeout:
            raise DeviceGone(f"{why}, still after {timeout:.0f} s")
        sleep(POLL_S)


def parent_bridge(bdf: str, sysfs: str = SYS_PCI_DEVICES) -> str | None:
    """The bridge the function sits behind (its upstream port), None on a root bus."""
    parent = os.path.basename(os.path.dirname(os.path.realpath(path_of(bdf, sysfs))))
    return parent if _BDF_NAME.fullmatch(parent) else None


def siblings(bdf: str, sysfs: str = SYS_PCI_DEVICES) -> list[str]:
    """The other functions on the function's bus (below the same bridge)."""
    here = os.path.dirname(os.path.realpath(path_of(bdf, sysfs)))
    try:
        names = os.listdir(here)
    except OSError:
        return []
    return sorted(n for n in names if _BDF_NAME.fullmatch(n) and n != bdf)


@contextlib.contextmanager
def memory_decoding(bdf: str, sysfs: str = SYS_PCI_DEVICES) -> Iterator[None]:
    """The function's memory decoding on for the block (sysfs ``enable``), as it was after:
    a function without a driver may have it off, and its BARs then read all ones."""
    enable = os.path.join(path_of(bdf, sysfs), "enable")
    try:
        with open(enable) as state:
            was_off = state.read().strip() == "0"
    except OSError:
        was_off = False
    if was_off:
        with open(enable, "w") as state:
            state.write("1")
    try:
        yield
    finally:
        if was_off:
            with contextlib.suppress(OSError), open(enable, "w") as state:
                state.write("0")
