"""A fake ``/sys/bus/pci/devices`` of plain files, for GPU custody: the sanitize steps reset,
read and scrub GPUs there (``Config.pci_sysfs``), so no unit test ever writes to a real device.

``gpu(tree, bdf, ...)`` makes one GPU function: ``uevent`` (its PCI ids and class),
``config`` (its config space, with a PM capability), ``power_state``, ``reset_method`` and
``reset``, and for NVIDIA a sparse ``resource0`` whose registers say its boot and memory clear
are done (nvclear.py). Its keyword arguments make it sick: config space all ones, stuck in
D3cold, no reset method, a memory clear that never finishes. ``shared()`` is one tree with a
healthy NVIDIA A100 at the address of every GPU of every fake host in tests/fixtures/hosts/,
made once per test process: what ``unit_config`` points ``pci_sysfs`` at.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile
from pathlib import Path

from framework.paths import FIXTURES

NVIDIA, AMD = 0x10DE, 0x1002
A100 = 0x20B0  # an Ampere part whose architecture comes from PMC_BOOT_0 (nvclear.py)
AMPERE_BOOT_0 = 0x170000A1
PM_CAP = 0x40
BOOT_DONE, CLEAR_DONE = (0x118234, 0x3FF), (0x100B20, 0x1)
_SHARED: list[Path] = []


def config_space(vendor: int, device: int, *, state: int = 0, all_ones: bool = False) -> bytes:
    """256 bytes of config space: ids, class 0x0302, a PM capability in D``state``."""
    if all_ones:
        return b"\xff" * 256
    data = bytearray(256)
    data[0:4] = vendor.to_bytes(2, "little") + device.to_bytes(2, "little")
    data[6:8] = (0x10).to_bytes(2, "little")  # status: a capability list
    data[0x0A:0x0C] = (0x0302).to_bytes(2, "little")
    data[0x34] = PM_CAP
    data[PM_CAP : PM_CAP + 2] = bytes([0x01, 0x00])  # PM capability, last in the list
    data[PM_CAP + 4 : PM_CAP + 6] = state.to_bytes(2, "little")
    return bytes(data)


def write_register(resource: Path, offset: int, value: int) -> None:
    with resource.open("r+b") as bar:
        bar.seek(offset)
        bar.write(value.to_bytes(4, "little"))


def gpu(
    tree: Path,
    bdf: str,
    *,
    vendor: int = NVIDIA,
    device: int = A100,
    klass: int = 0x030200,
    reset_method: str | None = "bus",
    power_state: str | None = "D0",
    all_ones: bool = False,
    clear_done: bool = True,
    driver: str | None = None,
) -> Path:
    """One GPU function in ``tree`` (see the module docstring); its folder."""
    folder = tree / bdf
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "uevent").write_text(
        f"PCI_CLASS={klass:X}\nPCI_ID={vendor:04X}:{device:04X}\nPCI_SLOT_NAME={bdf}\n"
        + (f"DRIVER={driver}\n" if driver else "")
    )
    (folder / "config").write_bytes(config_space(vendor, device, all_ones=all_ones))
    if power_state is not None:
        (folder / "power_state").write_text(power_state + "\n")
    if reset_method is not None:
        (folder / "reset_method").write_text(reset_method + "\n")
        (folder / "reset").write_text("")
    if vendor == NVIDIA:
        resource = folder / "resource0"
        with resource.open("wb") as bar:
            bar.truncate(0x200000)
        write_register(resource, 0, AMPERE_BOOT_0)
        write_register(resource, *BOOT_DONE)
        if clear_done:
            write_register(resource, *CLEAR_DONE)
    if driver:
        drivers = tree.parent / "drivers" / driver
        drivers.mkdir(parents=True, exist_ok=True)
        (drivers / "unbind").touch()
        (folder / "driver").symlink_to(drivers)
    (tree.parent / "drivers_probe").touch()
    return folder


def fixture_gpus() -> list[str]:
    """The address of every GPU of every fake host (NVIDIA and AMD display and compute
    functions)."""
    found: set[str] = set()
    for path in (FIXTURES / "hosts").glob("*.umockdev"):
        for paragraph in path.read_text().split("\n\n"):
            bdf = re.search(
                r"^P: .*/([0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7])$", paragraph, re.M
            )
            klass = re.search(r"^E: PCI_CLASS=([0-9A-Fa-f]+)$", paragraph, re.M)
            ids = re.search(r"^E: PCI_ID=([0-9A-Fa-f]{4}):", paragraph, re.M)
            if not (bdf and klass and ids):
                continue
            if int(ids[1], 16) in (NVIDIA, AMD) and int(klass[1], 16) >> 16 in (0x03, 0x12):
                found.add(bdf[1])
    return sorted(found)


def shared() -> Path:
    """The tree of healthy A100s at every fake host's GPU addresses (made once)."""
    if not _SHARED:
        root = Path(tempfile.mkdtemp(prefix="fake-sysfs-", dir=_tmp()))
        atexit.register(shutil.rmtree, root, True)
        tree = root / "devices"
        for bdf in fixture_gpus():
            gpu(tree, bdf)
        _SHARED.append(tree)
    return _SHARED[0]


def _tmp() -> str | None:
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
