"""NVIDIA's hardware memory clear after a reset (host/nvclear.py), on fake BAR0 files: the
architecture from the device id or PMC_BOOT_0, the registers gpu-admin-tools polls, and a
clear that never finishes."""

from __future__ import annotations

from pathlib import Path

import pytest
from framework import fake_sysfs

from vmsandbox.host import nvclear

BDF = "0000:01:00.0"


def fake_clock() -> tuple[object, object]:
    now = [0.0]

    def clock() -> float:
        return now[0]

    def sleep(seconds: float) -> None:
        now[0] += max(seconds, 0.5)

    return clock, sleep


@pytest.mark.parametrize(
    ("device", "boot0", "arch"),
    [
        (0x2330, 0, "hopper"),  # H100 SXM: by device id
        (0x2901, 0, "blackwell-gb10x"),
        (0x2B85, 0, "blackwell-gb20x"),
        (0x20B0, 0x170000A1, "ampere"),  # A100: PMC_BOOT_0
        (0x2236, 0xB72000A1, "ampere"),  # A10
        (0x1EB8, 0x164000A1, "turing"),  # T4
        (0x27B8, 0x194000A1, "ada"),  # L4
        (0x1DB4, 0x140000A1, None),  # V100: no hardware clear
    ],
)
def test_the_architecture(tmp_path: Path, device: int, boot0: int, arch: str | None) -> None:
    folder = fake_sysfs.gpu(tmp_path, BDF, device=device)
    fake_sysfs.write_register(folder / "resource0", 0, boot0)
    assert nvclear.architecture(device, nvclear.Bar0(BDF, str(tmp_path))) == arch


def test_a_bar0_that_does_not_answer(tmp_path: Path) -> None:
    folder = fake_sysfs.gpu(tmp_path, BDF)
    fake_sysfs.write_register(folder / "resource0", 0, 0xFFFFFFFF)
    with pytest.raises(nvclear.ClearFailed, match="does not answer"):
        nvclear.architecture(0x20B0, nvclear.Bar0(BDF, str(tmp_path)))


def test_a_finished_clear_passes(tmp_path: Path) -> None:
    fake_sysfs.gpu(tmp_path, BDF)
    nvclear.wait_memory_clear(nvclear.Bar0(BDF, str(tmp_path)), "ampere")


def test_a_stuck_clear_times_out_naming_the_register(tmp_path: Path) -> None:
    fake_sysfs.gpu(tmp_path, BDF, clear_done=False)
    clock, sleep = fake_clock()
    with pytest.raises(nvclear.ClearFailed, match=r"memory clear finished not reported .*0x100b20"):
        nvclear.wait_memory_clear(
            nvclear.Bar0(BDF, str(tmp_path)), "ampere", clock=clock, sleep=sleep
        )


def test_hopper_waits_for_its_fsp_boot(tmp_path: Path) -> None:
    folder = fake_sysfs.gpu(tmp_path, BDF, device=0x2330)
    clock, sleep = fake_clock()
    bar0 = nvclear.Bar0(BDF, str(tmp_path))
    with pytest.raises(nvclear.ClearFailed, match=r"boot complete .*0x200bc"):
        nvclear.wait_memory_clear(bar0, "hopper", clock=clock, sleep=sleep)
    fake_sysfs.write_register(folder / "resource0", 0x200BC, 0xFF)
    nvclear.wait_memory_clear(bar0, "hopper")


def test_no_bar0_file(tmp_path: Path) -> None:
    with pytest.raises(nvclear.ClearFailed, match="cannot be opened"):
        nvclear.Bar0(BDF, str(tmp_path)).read(0)
