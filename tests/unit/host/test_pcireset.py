"""Resetting a PCI function through the kernel (host/pcireset.py): the strongest method
chosen, written for the one reset and the list put back, failures in words."""

from __future__ import annotations

from pathlib import Path

import pytest
from framework import fake_sysfs

from vmsandbox.host import pcireset

BDF = "0000:01:00.0"


@pytest.mark.parametrize(
    ("methods", "chosen"),
    [
        (("flr", "bus"), "bus"),
        (("pm", "flr"), "flr"),
        (("af_flr",), "af_flr"),
        (("pm",), None),
        (("reset",), "reset"),
        ((), None),
    ],
)
def test_sbr_before_flr_and_pm_is_no_reset(methods: tuple[str, ...], chosen: str | None) -> None:
    assert pcireset.choose(methods) == chosen


def test_the_method_is_written_for_the_reset_and_the_list_put_back(tmp_path: Path) -> None:
    folder = fake_sysfs.gpu(tmp_path, BDF, reset_method="flr bus")
    assert pcireset.methods_of(BDF, str(tmp_path)) == ("flr", "bus")
    pcireset.reset(BDF, "bus", 5, str(tmp_path))
    assert (folder / "reset").read_text() == "1"
    assert (folder / "reset_method").read_text() == "flr bus"


def test_an_old_kernel_with_only_a_reset_file(tmp_path: Path) -> None:
    folder = fake_sysfs.gpu(tmp_path, BDF, reset_method=None)
    (folder / "reset").write_text("")
    assert pcireset.methods_of(BDF, str(tmp_path)) == ("reset",)
    pcireset.reset(BDF, "reset", 5, str(tmp_path))
    assert (folder / "reset").read_text() == "1"


def test_a_refused_reset_says_why(tmp_path: Path) -> None:
    folder = fake_sysfs.gpu(tmp_path, BDF)
    (folder / "reset").unlink()
    (folder / "reset").mkdir()  # the write fails: EISDIR
    with pytest.raises(pcireset.ResetFailed, match="the kernel refused the bus reset"):
        pcireset.reset(BDF, "bus", 5, str(tmp_path))
    assert (folder / "reset_method").read_text() == "bus"


def test_a_reset_that_does_not_return_times_out(tmp_path: Path) -> None:
    import os

    folder = fake_sysfs.gpu(tmp_path, BDF)
    (folder / "reset").unlink()
    os.mkfifo(folder / "reset")  # opening it for writing blocks: nobody reads
    with pytest.raises(pcireset.ResetFailed, match="did not return within 0 s"):
        pcireset.reset(BDF, "bus", 0.2, str(tmp_path))
    with open(folder / "reset", "rb"):  # let the thread go
        pass
