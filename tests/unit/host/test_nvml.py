"""NVML enrichment through the NvmlApi seam (vmsandbox.host.nvml)."""

from __future__ import annotations

import pytest
from framework.fake_hosts import FakeNvml

from vmsandbox.host.nvml import NvmlError, NvmlGpu, PynvmlApi, read_nvml

H100 = {
    "bus_id": "00000000:41:00.0",
    "name": "NVIDIA H100 80GB HBM3",
    "memory_mib": 81559,
    "uuid": "GPU-5f3a1c52-8d4e-4b39-a1f0-6c2b7e9d0a11",
    "pids": [4242, 17, 4242],
}


def test_reads_every_device_and_shuts_down() -> None:
    nvml = FakeNvml({"devices": [H100, {**H100, "bus_id": "00000000:C2:00.0", "pids": []}]})
    report = read_nvml(nvml)
    assert report.answered is True
    assert report.notes == ()
    assert report.gpus == {
        "0000:41:00.0": NvmlGpu(
            bdf="0000:41:00.0",
            name="NVIDIA H100 80GB HBM3",
            memory_mib=81559,
            uuid="GPU-5f3a1c52-8d4e-4b39-a1f0-6c2b7e9d0a11",
            pids=(17, 4242),
        ),
        "0000:c2:00.0": NvmlGpu(
            bdf="0000:c2:00.0",
            name="NVIDIA H100 80GB HBM3",
            memory_mib=81559,
            uuid="GPU-5f3a1c52-8d4e-4b39-a1f0-6c2b7e9d0a11",
            pids=(),
        ),
    }
    assert nvml.calls == ["init", "shutdown"]


def test_init_failure_is_a_note() -> None:
    nvml = FakeNvml({"init_error": "Driver/library version mismatch"})
    report = read_nvml(nvml)
    assert (report.answered, report.gpus) == (False, {})
    assert report.notes == ("NVML unavailable: Driver/library version mismatch",)
    assert nvml.calls == ["init"]


def test_count_failure_is_a_note_and_still_shuts_down() -> None:
    nvml = FakeNvml({"count_error": "Unknown Error", "devices": []})
    report = read_nvml(nvml)
    assert (report.answered, report.notes) == (False, ("NVML unavailable: Unknown Error",))
    assert nvml.calls == ["init", "shutdown"]


def test_one_unreadable_device_does_not_hide_the_others() -> None:
    report = read_nvml(
        FakeNvml({"devices": [{"error": "GPU is lost"}, {**H100, "bus_id": "garbage"}, H100]})
    )
    assert report.answered is True
    assert list(report.gpus) == ["0000:41:00.0"]
    assert report.notes == (
        "NVML could not read device 0: GPU is lost",
        "NVML could not read device 1: not a PCI address: 'garbage'",
    )


def test_unlistable_processes_keep_the_rest() -> None:
    report = read_nvml(FakeNvml({"devices": [{**H100, "pids": "Function Not Found"}]}))
    assert report.gpus["0000:41:00.0"].memory_mib == 81559
    assert report.gpus["0000:41:00.0"].pids == ()
    assert report.notes == (
        "NVML could not list the processes on 0000:41:00.0: Function Not Found",
    )


def test_pynvml_errors_become_nvml_errors() -> None:
    """Before init, every pynvml call fails: with or without an NVIDIA driver on this host."""
    with pytest.raises(NvmlError):
        PynvmlApi().device_count()
