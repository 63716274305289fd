"""Verification and its parsers on what real NVIDIA GPUs said: the recordings in
tests/fixtures/real (see its README), made by tests/hardware/probe.py on machines with one H100
or one H200 and driver 580.159.04 (the open kernel module)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from framework import paths
from framework.fake_hosts import inventory_from_dict
from framework.verify_guest import FakeGuest

from vmsandbox.guest import verify
from vmsandbox.guest.verify import ExpectedGpu, nvlink

RECORDINGS = paths.FIXTURES / "real"
H100, H200 = RECORDINGS / "h100-580.159.04", RECORDINGS / "h200-580.159.04"
REAL = H200  # the one with the underlined matrix checked below (both have it)
FABRIC = paths.FIXTURES / "guest" / "fabric"
DRIVER = "580.159.04"
# recording -> (name, memory) as nvidia-smi and NVML give them
GPUS = {H100: ("NVIDIA H100 80GB HBM3", 81559), H200: ("NVIDIA H200", 143771)}


def expected(recording: Path) -> list[ExpectedGpu]:
    """The GPUs as vmsandbox.host.discover found them on that machine."""
    text = (recording / "host" / "inventory.json").read_text()
    return [ExpectedGpu.of(gpu) for gpu in inventory_from_dict(json.loads(text)).gpus]


@pytest.mark.parametrize("recording", list(GPUS), ids=lambda path: path.name)
def test_verification_passes_on_the_recorded_outputs(recording: Path) -> None:
    report = verify.verify(FakeGuest.scenario(recording / "verify"), expected(recording))

    assert report.ok, report.problems
    assert {check.name: check.detail for check in report.checks} == {
        "pci": "1 of 1 GPUs seen",
        "driver": f"nvidia-smi installed, module {DRIVER}",
        "nvidia-smi": "1 of 1 GPUs listed",
        "kernel-log": "",
        "compute": "1 of 1 GPUs passed",
    }
    (gpu,) = report.gpus
    assert (gpu.guest_address, gpu.name, gpu.memory_mib) == ("0000:00:06.0", *GPUS[recording])
    assert gpu.uuid is not None and gpu.uuid.startswith("GPU-")
    assert report.driver_version == gpu.driver_version == DRIVER


@pytest.mark.parametrize("recording", list(GPUS), ids=lambda path: path.name)
def test_the_open_kernel_modules_version_file_gives_its_version(recording: Path) -> None:
    text = (recording / "verify" / "probe.out").read_text()

    assert "Open Kernel Module for x86_64" in text
    assert verify.driver_version_of(text) == DRIVER


@pytest.mark.parametrize("recording", list(GPUS), ids=lambda path: path.name)
def test_a_healthy_gpus_kernel_log_has_no_failure_and_keeps_its_nvrm_lines(
    recording: Path,
) -> None:
    events, nvrm = verify.parse_kernel_log((recording / "verify" / "kernel-log.out").read_text())

    assert events == []
    assert any("FBHUB Interrupt detected" in line for line in nvrm)
    assert any(f"Open Kernel Module for x86_64  {DRIVER}" in line for line in nvrm)


def test_the_topology_matrix_is_read_through_nvidia_smis_underlined_header() -> None:
    real = (REAL / "smi" / "topo-m.out").read_text()
    header, rest = (FABRIC / "h100x8_topo.out").read_text().split("\n", 1)
    underlined = f"\t\x1b[4m{header.strip()}\x1b[0m\n{rest}"  # as nvidia-smi writes it

    assert real.startswith("\t\x1b[4mGPU0\t")
    assert nvlink.parse_topology(real) == {(0, 0): "X"}
    assert nvlink.parse_topology(underlined) == nvlink.parse_topology(header + "\n" + rest)
    assert len(nvlink.parse_topology(underlined)) == 64


def test_a_gpu_that_shows_no_nvlink_lists_none() -> None:
    assert (REAL / "smi" / "nvlink-status.out").read_text() == ""
    assert nvlink.parse_nvlink_status("") == []


def test_the_quiesce_programs_uuid_query_matches_the_verified_bus_id() -> None:
    bus, uuid = (REAL / "smi" / "uuids.out").read_text().strip().split(", ")
    row = verify.parse_nvidia_smi((REAL / "verify" / "nvidia-smi.out").read_text()).rows[0]

    assert (row.bus_id, row.uuid) == (bus.lower()[-12:], uuid)


def test_the_reconstructed_h100_scenarios_have_the_real_gpu_line() -> None:
    def gpu_line(path: Path) -> str:
        line = next(line for line in path.read_text().splitlines() if "[10de:2330]" in line)
        return line.split(" ", 1)[1]  # without the guest address

    reconstructed = paths.FIXTURES / "guest" / "h100x1" / "lspci.out"
    assert gpu_line(reconstructed) == gpu_line(H100 / "verify" / "lspci.out")
