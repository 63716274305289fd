"""GPU verification inside the guest, against the outputs in tests/fixtures/guest/ (see README)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from framework import paths
from framework.verify_guest import FakeGuest

from vmsandbox.errors import GuestVerificationFailed, Unavailable
from vmsandbox.guest import verify
from vmsandbox.guest.ssh import ExecResult
from vmsandbox.guest.verify import ExpectedGpu, nvlink

FIXTURES = paths.FIXTURES / "guest"
SMOKE = Path(verify.__file__).parent.parent / "programs" / "cuda_smoke.py"
FABRIC = FIXTURES / "fabric"
# The HGX H100 host of tests/fixtures/hosts/hgx_h100.umockdev, in allocation (hostdev) order.
HGX_BDFS = [
    "0000:18:00.0",
    "0000:19:00.0",
    "0000:41:00.0",
    "0000:42:00.0",
    "0000:9a:00.0",
    "0000:9b:00.0",
    "0000:c1:00.0",
    "0000:c2:00.0",
]
NO_SMI_DRIVER = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    "Make sure that the latest NVIDIA driver is installed and running.\n"
)


def h100(bdf: str, name: str | None = "NVIDIA H100 80GB HBM3") -> ExpectedGpu:
    return ExpectedGpu(
        bdf=bdf,
        vendor="nvidia",
        vendor_id="0x10de",
        device_id="0x2330",
        name=name,
        memory_mib=81559,
    )


HGX = [h100(bdf) for bdf in HGX_BDFS]


def statuses(report: verify.VerificationReport) -> dict[str, str]:
    return {check.name: check.status for check in report.checks}


# -- parsers ------------------------------------------------------------------------------------


def test_parse_lspci_reads_a_real_q35_guest() -> None:
    functions = verify.parse_lspci((FIXTURES / "lspci_q35_no_gpu.txt").read_text())
    assert len(functions) == 14
    assert functions[0] == verify.PciFunction(
        address="0000:00:00.0",
        class_name="Host bridge",
        class_id="0600",
        description="Intel Corporation 82G33/G31/P35/P31 Express DRAM Controller",
        vendor_id="0x8086",
        device_id="0x29c0",
    )
    sata = next(f for f in functions if f.address == "0000:00:1f.2")
    assert sata.description.endswith("6 port SATA Controller [AHCI mode]")
    assert sata.ids == ("0x8086", "0x2922")
    assert sum(1 for f in functions if f.ids == ("0x1b36", "0x000c")) == 5


@pytest.mark.parametrize(
    ("line", "address", "ids", "class_id"),
    [
        (
            "01:00.0 3D controller [0302]: NVIDIA Corporation GH100 [H100 SXM5 80GB] [10de:2330] "
            "(rev a1)",
            "0000:01:00.0",
            ("0x10de", "0x2330"),
            "0302",
        ),
        (  # Debian 12's pci.ids spelling, as the guest prints it
            "0000:06:00.0 3D controller [0302]: NVIDIA Corporation GH100[H100 SXM5 80GB] "
            "[10de:2330] (rev a1)",
            "0000:06:00.0",
            ("0x10de", "0x2330"),
            "0302",
        ),
        (  # H200 (DGX), as lspci -nn printed it on a real host (see README)
            "1b:00.0 3D controller [0302]: NVIDIA Corporation GH100 [H200 SXM 141GB] [10de:2335] "
            "(rev a1)",
            "0000:1b:00.0",
            ("0x10de", "0x2335"),
            "0302",
        ),
        (  # no pci.ids in the guest
            "0000:06:00.0 Class [0302]: Device [10de:2330] (rev a1)",
            "0000:06:00.0",
            ("0x10de", "0x2330"),
            "0302",
        ),
        (  # a PCI domain above 0 (multi-segment hosts)
            "0001:c3:00.0 Display controller [0380]: Advanced Micro Devices, Inc. [AMD/ATI] "
            "Aqua Vanjaram [Instinct MI300X] [1002:74a1]",
            "0001:c3:00.0",
            ("0x1002", "0x74a1"),
            "0380",
        ),
    ],
)
def test_parse_lspci_line_shapes(
    line: str, address: str, ids: tuple[str, str], class_id: str
) -> None:
    (function,) = verify.parse_lspci(line + "\n")
    assert (function.address, function.ids, function.class_id) == (address, ids, class_id)


def test_parse_lspci_ignores_other_lines() -> None:
    text = "pcilib: Cannot open /proc/bus/pci\nlspci: Cannot find any working access method.\n"
    assert verify.parse_lspci(text) == []


def test_parse_nvidia_smi_rows_and_errors() -> None:
    text = (FIXTURES / "hgx_h100x8_xid" / "nvidia-smi.out").read_text()
    parsed = verify.parse_nvidia_smi(text)
    assert len(parsed.rows) == 7
    assert parsed.rows[0] == verify.SmiRow(
        name="NVIDIA H100 80GB HBM3",
        bus_id="0000:06:00.0",
        uuid="GPU-4e1b7c62-0a9d-3f57-8c21-5d6e0f9a1b34",
        memory_mib=81559,
        driver_version="535.309.01",
    )
    assert parsed.rows[3].bus_id == "0000:0a:00.0"
    assert parsed.errors == (
        "Unable to determine the device handle for GPU0000:08:00.0: Unknown Error",
    )


@pytest.mark.parametrize(
    "text", [NO_SMI_DRIVER, "No devices were found\n", "Failed to initialize NVML: Unknown Error\n"]
)
def test_parse_nvidia_smi_failure_outputs(text: str) -> None:
    parsed = verify.parse_nvidia_smi(text)
    assert parsed.rows == ()
    assert parsed.errors == (text.strip(),)


def test_parse_nvidia_smi_memory_not_available() -> None:
    row = "NVIDIA H100 80GB HBM3, 00000000:06:00.0, GPU-4e1b7c62, [N/A], 535.309.01\n"
    assert verify.parse_nvidia_smi(row).rows[0].memory_mib is None


def test_parse_kernel_log_xid_and_fallen_off_the_bus() -> None:
    text = (FIXTURES / "hgx_h100x8_xid" / "kernel-log.out").read_text()
    events, nvrm = verify.parse_kernel_log(text)
    assert [(event.address, event.xid) for event in events] == [
        ("0000:08:00", 79),
        ("0000:08:00", None),
    ]
    assert events[0].line.endswith(
        "79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
    )
    assert any("loading NVIDIA UNIX x86_64 Kernel Module  535.309.01" in line for line in nvrm)


@pytest.mark.parametrize(
    ("line", "address", "xid"),
    [
        (  # journalctl -k, older drivers' pid=N form
            "Mar 05 23:33:35 gpu-7 kernel: NVRM: Xid (PCI:0000:3b:00): 48, pid=1797, "
            "name=python3, DBE (double bit error) ECC Error",
            "0000:3b:00",
            48,
        ),
        (  # NVLink Xids carry no pid; multi-segment domain
            "[ 8812.102001] NVRM: Xid (PCI:0019:01:00): 149, NETIR Fatal XC0 i0 Link -1 "
            "(0x000fe406 0x00000000 0x00000000 0x00000000 0x00000000 0x00000000)",
            "0019:01:00",
            149,
        ),
        (
            "[    7.411392] NVRM: GPU 0000:06:00.0: RmInitAdapter failed! (0x22:0x56:667)",
            "0000:06:00",
            None,
        ),
        # recorded in a TCG guest of the nvidia image: nvidia-smi loaded the module, no GPU
        ("[   46.205271] NVRM: No NVIDIA GPU found.", None, None),
        (  # BARs the guest firmware did not assign
            "[    5.912204] NVRM: This PCI I/O region assigned to your NVIDIA device is invalid:",
            None,
            None,
        ),
        ("[    6.002311] NVRM: The NVIDIA probe routine failed for 1 device(s).", None, None),
    ],
)
def test_parse_kernel_log_line_shapes(line: str, address: str | None, xid: int | None) -> None:
    events, _nvrm = verify.parse_kernel_log(line + "\n")
    assert [(event.address, event.xid) for event in events] == [(address, xid)]


def test_parse_kernel_log_multi_line_fallen_off_the_bus() -> None:
    text = (
        "[ 1843.308145] NVRM: The NVIDIA GPU 0000:b3:00.0\n"
        "               NVRM: (PCI ID: 10de:26b5) installed in this system has\n"
        "               NVRM: fallen off the bus and is not responding to commands.\n"
    )
    events, _nvrm = verify.parse_kernel_log(text)
    assert [(event.address, event.xid) for event in events] == [("0000:b3:00", None)]


def test_parse_kernel_log_clean_boot_has_no_events() -> None:
    events, nvrm = verify.parse_kernel_log((FIXTURES / "h100x1" / "kernel-log.out").read_text())
    assert events == []
    assert len(nvrm) == 1


def test_driver_version_of_proc_file() -> None:
    text = (FIXTURES / "h100x1" / "probe.out").read_text()
    assert verify.driver_version_of(text) == "535.309.01"
    assert verify.driver_version_of("nvidia-smi: yes\n") is None


@pytest.mark.parametrize(
    ("expected", "reported", "agree"),
    [
        ("NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3", True),
        ("GH100[H100 SXM5 80GB]", "NVIDIA H100 80GB HBM3", True),
        ("TU102 [GeForce RTX 2080 Ti Rev. A]", "NVIDIA GeForce RTX 2080 Ti", True),
        ("NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-80GB", True),
        (None, "NVIDIA H100 80GB HBM3", True),
        ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", False),
        ("Tesla T4", "NVIDIA L4", False),
        ("TU104GL [Tesla T4]", "Tesla T4", True),
        ("NVIDIA H100 80GB HBM3", "NVIDIA H200", False),
        ("GH100", "NVIDIA H200", True),  # a chip name alone says nothing of the model
    ],
)
def test_names_agree(expected: str | None, reported: str, agree: bool) -> None:
    assert verify.names_agree(expected, reported) is agree


def test_parse_smoke_lines() -> None:
    text = (
        "PASS 0000:06:00.0 NVIDIA H100 80GB HBM3\n"
        "FAIL 0000:07:00.0 cuLaunchKernel: CUDA_ERROR_LAUNCH_FAILED (719)\n"
        "FAIL - cuInit: CUDA_ERROR_NO_DEVICE (100)\n"
        "Traceback (most recent call last):\n"
    )
    assert verify.parse_smoke(text) == [
        verify.SmokeLine(True, "0000:06:00.0", "NVIDIA H100 80GB HBM3"),
        verify.SmokeLine(False, "0000:07:00.0", "cuLaunchKernel: CUDA_ERROR_LAUNCH_FAILED (719)"),
        verify.SmokeLine(False, None, "cuInit: CUDA_ERROR_NO_DEVICE (100)"),
    ]


# -- verification decisions ---------------------------------------------------------------------


def test_one_h100_passes_every_check() -> None:
    guest = FakeGuest.scenario("h100x1")
    report = verify.verify(guest, [h100("0000:41:00.0")])
    assert report.ok, report.problems
    assert guest.checks_run == ["lspci", "probe", "nvidia-smi", "kernel-log", "compute"]
    assert statuses(report) == dict.fromkeys(
        ["pci", "driver", "nvidia-smi", "kernel-log", "compute"], "passed"
    )
    (gpu,) = report.gpus
    assert (gpu.host_bdf, gpu.guest_address, gpu.name) == (
        "0000:41:00.0",
        "0000:06:00.0",
        "NVIDIA H100 80GB HBM3",
    )
    assert (gpu.memory_mib, gpu.driver_version, gpu.compute) == (81559, "535.309.01", "passed")
    assert gpu.uuid == "GPU-4e1b7c62-0a9d-3f57-8c21-5d6e0f9a1b34"
    assert report.driver_version == "535.309.01"
    verify.raise_if_failed(report)  # does not raise


def test_compute_ships_the_smoke_program_on_stdin_with_a_timeout_per_gpu() -> None:
    guest = FakeGuest.scenario("hgx_h100x8")
    verify.verify(guest, HGX)
    command, stdin, timeout = guest.calls[-1]
    assert command == "python3 -"
    assert stdin == SMOKE.read_bytes()
    assert timeout == verify.COMPUTE_TIMEOUT_BASE + 8 * verify.COMPUTE_TIMEOUT_PER_GPU
    assert all(timeout == verify.QUERY_TIMEOUT for _c, _s, timeout in guest.calls[:-1])


def test_eight_h100_map_to_guest_buses_in_hostdev_order() -> None:
    report = verify.verify(FakeGuest.scenario("hgx_h100x8"), HGX)
    assert report.ok, report.problems
    assert [(gpu.host_bdf, gpu.guest_address) for gpu in report.gpus] == [
        (bdf, f"0000:{bus:02x}:00.0") for bdf, bus in zip(HGX_BDFS, range(6, 14), strict=True)
    ]
    assert {gpu.compute for gpu in report.gpus} == {"passed"}
    assert len({gpu.uuid for gpu in report.gpus}) == 8
    assert report.check("nvidia-smi") == verify.CheckResult(
        "nvidia-smi", "passed", "8 of 8 GPUs listed"
    )


def test_a_missing_gpu_fails_and_is_attributed_to_its_host_bdf() -> None:
    report = verify.verify(FakeGuest.scenario("hgx_h100x8_missing"), HGX)
    assert not report.ok
    missing = report.gpus[3]
    assert (missing.host_bdf, missing.guest_address) == ("0000:42:00.0", None)
    assert missing.compute == "failed"
    assert [gpu.guest_address for gpu in report.gpus[4:]] == [
        "0000:0a:00.0",
        "0000:0b:00.0",
        "0000:0c:00.0",
        "0000:0d:00.0",
    ]
    assert all(gpu.ok for i, gpu in enumerate(report.gpus) if i != 3)
    assert report.problems[0] == "pci: the guest shows 7 function(s) [10de:2330], expected 8"
    assert any(p.startswith("GPU 0000:42:00.0: not in the guest's lspci") for p in report.problems)
    assert statuses(report) == {
        "pci": "failed",
        "driver": "passed",
        "nvidia-smi": "failed",
        "kernel-log": "passed",
        "compute": "failed",
    }


def test_xid_errors_fail_the_gpu_they_name() -> None:
    report = verify.verify(FakeGuest.scenario("hgx_h100x8_xid"), HGX)
    assert not report.ok
    lost = report.gpus[2]
    assert (lost.host_bdf, lost.guest_address, lost.compute) == (
        "0000:41:00.0",
        "0000:08:00.0",
        "failed",
    )
    assert lost.problems == [
        "nvidia-smi does not list it: "
        "Unable to determine the device handle for GPU0000:08:00.0: Unknown Error",
        "kernel log: NVRM: Xid (PCI:0000:08:00): 79, pid='<unknown>', name=<unknown>, "
        "GPU has fallen off the bus.",
        "kernel log: NVRM: GPU 0000:08:00.0: GPU has fallen off the bus.",
        "compute test failed: no result (exit 0)",
    ]
    assert all(gpu.ok for gpu in report.gpus if gpu is not lost)
    assert report.check("kernel-log") == verify.CheckResult(
        "kernel-log", "failed", "1 Xid error(s), 1 other GPU failure(s)"
    )
    with pytest.raises(GuestVerificationFailed) as raised:
        verify.raise_if_failed(report)
    assert raised.value.code == "FAILED_PRECONDITION"
    assert raised.value.details["verification"] == report.to_dict()
    assert "GPU 0000:41:00.0 (guest 0000:08:00.0): nvidia-smi does not list it" in str(raised.value)
    with pytest.raises(GuestVerificationFailed) as raised:
        verify.raise_if_failed(report, subject="sandbox 'job-42'", details={"kept": True})
    assert raised.value.message.startswith(
        "sandbox 'job-42': GPU verification in the guest failed: GPU 0000:41:00.0 "
    )
    assert raised.value.details["kept"] is True


def test_newer_drivers_device_handle_error_names_the_gpu() -> None:
    rows = (FIXTURES / "hgx_h100x8" / "nvidia-smi.out").read_text().splitlines(keepends=True)
    lost = "Unable to determine the device handle for GPU1: 0000:07:00.0: Unknown Error"
    rows[1] = lost + "\n"
    guest = FakeGuest.scenario("hgx_h100x8", **{"nvidia-smi": (15, "".join(rows), "")})
    report = verify.verify(guest, HGX)
    assert [gpu.host_bdf for gpu in report.gpus if not gpu.ok] == ["0000:19:00.0"]
    assert report.gpus[1].problems == ["nvidia-smi does not list it: " + lost]


def test_raise_if_failed_shows_the_first_five_problems() -> None:
    report = verify.VerificationReport(gpus=[], checks=[], problems=[f"p{i}" for i in range(7)])
    with pytest.raises(GuestVerificationFailed) as raised:
        verify.raise_if_failed(report)
    assert raised.value.message == (
        "GPU verification in the guest failed: p0; p1; p2; p3; p4; and 2 more"
    )


def test_driver_not_loaded_fails_and_skips_compute() -> None:
    guest = FakeGuest.scenario(
        "h100x1",
        probe="nvidia-smi: yes\n",
        **{"nvidia-smi": (9, NO_SMI_DRIVER, "")},
    )
    report = verify.verify(guest, [h100("0000:41:00.0")])
    assert not report.ok
    assert "compute" not in guest.checks_run
    assert statuses(report) == {
        "pci": "passed",
        "driver": "passed",
        "nvidia-smi": "failed",
        "kernel-log": "passed",
        "compute": "skipped",
    }
    assert report.check("nvidia-smi").detail == "0 of 1 GPUs listed: " + NO_SMI_DRIVER.strip()
    assert report.gpus[0].problems == ["nvidia-smi does not list it: " + NO_SMI_DRIVER.strip()]
    assert report.driver_version is None


def test_no_devices_found() -> None:
    guest = FakeGuest.scenario("h100x1", **{"nvidia-smi": (6, "No devices were found\n", "")})
    report = verify.verify(guest, [h100("0000:41:00.0")])
    assert report.gpus[0].problems == ["nvidia-smi does not list it: No devices were found"]


def test_image_without_driver_fails_only_when_nvidia_gpus_were_passed() -> None:
    guest = FakeGuest.scenario("h100x1", probe="nvidia-smi: no\n")
    report = verify.verify(guest, [h100("0000:41:00.0")])
    assert not report.ok
    assert guest.checks_run == ["lspci", "probe"]
    assert statuses(report) == {
        "pci": "passed",
        "driver": "failed",
        "nvidia-smi": "skipped",
        "kernel-log": "skipped",
        "compute": "skipped",
    }
    assert report.check("compute").detail == "image has no NVIDIA driver"
    assert "--no-verify" in report.problems[0]


def test_no_gpus_runs_nothing_and_passes() -> None:
    guest = FakeGuest({})
    report = verify.verify(guest, [])
    assert report.ok
    assert guest.calls == []
    assert statuses(report) == dict.fromkeys(
        ["pci", "driver", "nvidia-smi", "kernel-log", "compute"], "skipped"
    )


def test_companions_get_their_gpus_guest_slot() -> None:
    gpu = ExpectedGpu(
        bdf="0000:0a:00.0",
        vendor="nvidia",
        vendor_id="0x10de",
        device_id="0x1e07",
        name="TU102 [GeForce RTX 2080 Ti Rev. A]",
        memory_mib=None,
        companions=("0000:0a:00.1", "0000:0a:00.2", "0000:0a:00.3"),
        companion_ids=(("0x10de", "0x10f7"), ("0x10de", "0x1ad6"), ("0x10de", "0x1ad7")),
    )
    report = verify.verify(FakeGuest.scenario("rtx2080ti_companions"), [gpu])
    assert report.ok, report.problems
    assert verify.VerificationReport.from_dict(report.to_dict()) == report
    assert report.gpus[0].guest_address == "0000:06:00.0"
    assert [(c.host_bdf, c.guest_address) for c in report.gpus[0].companions] == [
        ("0000:0a:00.1", "0000:06:00.1"),
        ("0000:0a:00.2", "0000:06:00.2"),
        ("0000:0a:00.3", "0000:06:00.3"),
    ]


def rtx2080ti(bdf: str) -> ExpectedGpu:
    """A GeForce RTX 2080 Ti: four functions (GPU, audio, USB, UCSI) on one card."""
    slot = bdf[:-1]
    return ExpectedGpu(
        bdf=bdf,
        vendor="nvidia",
        vendor_id="0x10de",
        device_id="0x1e07",
        companions=(slot + "1", slot + "2", slot + "3"),
        companion_ids=(("0x10de", "0x10f7"), ("0x10de", "0x1ad6"), ("0x10de", "0x1ad7")),
    )


def test_multi_function_cards_map_by_their_function_0_when_the_first_is_missing() -> None:
    """Defect 8b: two 4-function cards on guest buses 06 and 07, the first missing. The second
    card (host 42:00.0) is the one at 07:00.0; the first is reported missing, not the second."""
    lspci = (FIXTURES / "rtx2080ti_companions" / "lspci.out").read_text()
    port = "0000:00:01.5 PCI bridge [0604]: Red Hat, Inc. QEMU PCIe Root port [1b36:000c]\n"
    lspci = lspci.replace(port, port + port.replace("01.5", "01.6")).replace(
        "0000:06:00.", "0000:07:00."
    )
    cards = [rtx2080ti("0000:41:00.0"), rtx2080ti("0000:42:00.0")]
    placement = verify.map_addresses(cards, verify.parse_lspci(lspci))
    assert placement.gpus == (None, "0000:07:00.0")
    assert placement.companions == (
        (None, None, None),
        ("0000:07:00.1", "0000:07:00.2", "0000:07:00.3"),
    )
    report = verify.verify(FakeGuest.scenario("rtx2080ti_companions", lspci=lspci), cards)
    assert report.check("pci").detail == "1 of 2 GPUs seen"
    assert report.gpus[0].problems[0] == ("not in the guest's lspci (no [10de:1e07] left to match)")
    assert report.gpus[1].guest_address == "0000:07:00.0"
    assert not any("lspci" in problem for problem in report.gpus[1].problems)


def test_multi_function_cards_all_present_map_in_hostdev_order() -> None:
    lspci = (FIXTURES / "rtx2080ti_companions" / "lspci.out").read_text()
    port = "0000:00:01.5 PCI bridge [0604]: Red Hat, Inc. QEMU PCIe Root port [1b36:000c]\n"
    second = "".join(line for line in lspci.splitlines(True) if line.startswith("0000:06:00."))
    lspci = lspci.replace(port, port + port.replace("01.5", "01.6"))
    lspci += second.replace("0000:06:00.", "0000:07:00.")
    cards = [rtx2080ti("0000:41:00.0"), rtx2080ti("0000:42:00.0")]
    placement = verify.map_addresses(cards, verify.parse_lspci(lspci))
    assert placement.gpus == ("0000:06:00.0", "0000:07:00.0")
    assert placement.companions[1] == ("0000:07:00.1", "0000:07:00.2", "0000:07:00.3")


def test_a_missing_companion_fails() -> None:
    lspci = (FIXTURES / "rtx2080ti_companions" / "lspci.out").read_text()
    lspci = "".join(line for line in lspci.splitlines(True) if "[10de:1ad7]" not in line)
    gpu = ExpectedGpu(
        bdf="0000:0a:00.0",
        vendor="nvidia",
        vendor_id="10de",
        device_id="1e07",
        companions=("0000:0a:00.1", "0000:0a:00.3"),
        companion_ids=(("10de", "10f7"), ("10de", "1ad7")),
    )
    report = verify.verify(FakeGuest.scenario("rtx2080ti_companions", lspci=lspci), [gpu])
    assert report.gpus[0].problems == [
        "companion 0000:0a:00.3 [10de:1ad7] is not in the guest's lspci"
    ]
    assert report.check("pci").status == "failed"


def test_model_and_memory_mismatch_are_problems() -> None:
    expected = ExpectedGpu(
        bdf="0000:41:00.0",
        vendor="nvidia",
        vendor_id="10de",
        device_id="2330",
        name="NVIDIA A100-SXM4-80GB",
        memory_mib=40960,
    )
    report = verify.verify(FakeGuest.scenario("h100x1"), [expected])
    assert report.gpus[0].problems == [
        "nvidia-smi names it 'NVIDIA H100 80GB HBM3', the host inventory 'NVIDIA A100-SXM4-80GB'",
        "nvidia-smi reports 81559 MiB, the host inventory 40960 MiB",
    ]


def test_an_amd_gpu_gets_the_pci_check_only() -> None:
    lspci = (
        "0000:06:00.0 Processing accelerators [1200]: Advanced Micro Devices, Inc. [AMD/ATI] "
        "Aqua Vanjaram [Instinct MI300X] [1002:74a1]\n"
    )
    amd = ExpectedGpu(bdf="0000:c3:00.0", vendor="amd", vendor_id="0x1002", device_id="0x74a1")
    guest = FakeGuest({"lspci": lspci})
    report = verify.verify(guest, [amd])
    assert report.ok
    assert statuses(report)["compute"] == "skipped"
    assert report.check("driver").detail == "no NVIDIA GPU passed"


def test_compute_failure_of_one_device() -> None:
    compute = "FAIL 0000:06:00.0 cuLaunchKernel: CUDA_ERROR_LAUNCH_FAILED (719)\n" + "".join(
        f"PASS 0000:{bus:02X}:00.0 NVIDIA H100 80GB HBM3\n" for bus in range(7, 14)
    )
    guest = FakeGuest.scenario("hgx_h100x8", compute=(1, compute, ""))
    report = verify.verify(guest, HGX)
    assert [gpu.compute for gpu in report.gpus] == ["failed"] + ["passed"] * 7
    assert report.gpus[0].problems == [
        "compute test failed: cuLaunchKernel: CUDA_ERROR_LAUNCH_FAILED (719)"
    ]


def test_compute_failure_of_the_driver_applies_to_every_gpu() -> None:
    guest = FakeGuest.scenario(
        "h100x1", compute=(1, "FAIL - cuInit: CUDA_ERROR_NO_DEVICE (100)\n", "")
    )
    report = verify.verify(guest, [h100("0000:41:00.0")])
    assert report.gpus[0].problems == ["compute test failed: cuInit: CUDA_ERROR_NO_DEVICE (100)"]
    assert report.check("compute").detail == "0 of 1 GPUs passed"


def test_compute_crash_reports_stderr() -> None:
    guest = FakeGuest.scenario("h100x1", compute=(127, "", "bash: line 1: python3: not found\n"))
    report = verify.verify(guest, [h100("0000:41:00.0")])
    assert report.gpus[0].problems == ["compute test failed: bash: line 1: python3: not found"]


def test_unreadable_kernel_log_is_skipped_not_failed() -> None:
    denied = (1, "", "dmesg: read kernel buffer failed: Operation not permitted\n")
    guest = FakeGuest.scenario("h100x1", **{"kernel-log": denied})
    report = verify.verify(guest, [h100("0000:41:00.0")])
    assert report.ok
    assert report.check("kernel-log") == verify.CheckResult(
        "kernel-log",
        "skipped",
        "cannot read it: dmesg: read kernel buffer failed: Operation not permitted",
    )


def test_a_guest_that_stops_answering_fails_the_check() -> None:
    def unreachable(
        command: str, *, stdin: bytes | None = None, timeout: float | None = None
    ) -> ExecResult:
        raise Unavailable("cannot reach the guest over SSH at 127.0.0.1:2222: timed out")

    report = verify.verify(unreachable, [h100("0000:41:00.0")])
    assert not report.ok
    assert report.check("pci") == verify.CheckResult(
        "pci", "failed", "cannot reach the guest over SSH at 127.0.0.1:2222: timed out"
    )
    assert report.problems[0].startswith("pci: could not run 'lspci'")


def test_expected_gpu_from_record_spells_ids_as_sysfs_does() -> None:
    record = {
        "bdf": "0000:0a:00.0",
        "vendor": "nvidia",
        "vendor_id": "0x10DE",
        "device_id": "1e07",
        "name": "TU102 [GeForce RTX 2080 Ti Rev. A]",
        "memory_mib": 11264,
        "numa_node": None,
        "companions": ["0000:0a:00.1"],
        "companion_ids": [["10de", "0x10F7"]],
    }
    expected = ExpectedGpu.from_record(record)
    assert (expected.vendor_id, expected.device_id) == ("0x10de", "0x1e07")
    assert expected.companion_ids == (("0x10de", "0x10f7"),)
    assert expected.is_nvidia


def test_render_report_table() -> None:
    report = verify.verify(FakeGuest.scenario("hgx_h100x8_xid"), HGX)
    text = verify.render_report(report)
    lines = text.splitlines()
    assert lines[0].split() == ["GPU", "GUEST", "NAME", "MEMORY", "DRIVER", "COMPUTE", "STATUS"]
    assert lines[1].split() == [
        "0000:18:00.0",
        "0000:06:00.0",
        "NVIDIA",
        "H100",
        "80GB",
        "HBM3",
        "81559",
        "MiB",
        "535.309.01",
        "passed",
        "ok",
    ]
    assert lines[3].startswith("0000:41:00.0  0000:08:00.0  NVIDIA H100 80GB HBM3  -")
    assert lines[3].endswith("failed   FAILED")
    assert "kernel-log: failed (1 Xid error(s), 1 other GPU failure(s))" in lines
    assert lines[-1] == "verification: FAILED"
    assert verify.render_report(verify.verify(FakeGuest({}), [])).splitlines()[-1] == (
        "verification: ok"
    )


def test_report_to_dict_is_json() -> None:
    report = verify.verify(FakeGuest.scenario("hgx_h100x8_xid"), HGX)
    data = json.loads(json.dumps(report.to_dict()))
    assert data["ok"] is False
    assert data["gpus"][2]["ok"] is False
    assert data["gpus"][2]["host_bdf"] == "0000:41:00.0"
    assert data["checks"][0] == {"name": "pci", "status": "passed", "detail": "8 of 8 GPUs seen"}
    assert verify.VerificationReport.from_dict(data) == report


# -- the smoke program, on a stand-in libcuda ---------------------------------------------------


@pytest.fixture(scope="module")
def fake_libcuda(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/fixtures/guest/fakecuda.c built as libcuda.so.1 in a folder of its own."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler, "a C compiler is needed (setup installs gcc)"
    folder = tmp_path_factory.mktemp("fakecuda")
    library = folder / "libcuda.so.1"
    flags = ["-shared", "-fPIC", "-O1", "-Wall", "-Werror"]
    subprocess.run([compiler, *flags, "-o", str(library), str(FIXTURES / "fakecuda.c")], check=True)
    return folder


def run_smoke(libdir: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """The smoke program as the guest runs it: ``python3 -`` with the program on stdin."""
    return subprocess.run(
        [sys.executable, "-"],
        input=verify.cuda_smoke_program().decode(),
        capture_output=True,
        text=True,
        env={**os.environ, "LD_LIBRARY_PATH": str(libdir), **env},
        check=False,
        timeout=60,
    )


def test_smoke_program_passes_on_every_device(fake_libcuda: Path) -> None:
    done = run_smoke(fake_libcuda, FAKECUDA_DEVICES="8")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"PASS 0000:{bus:02X}:00.0 NVIDIA H100 80GB HBM3" for bus in range(6, 14)
    ]
    guest = FakeGuest.scenario("hgx_h100x8", compute=done.stdout)
    assert verify.verify(guest, HGX).ok


@pytest.mark.parametrize(
    ("env", "lines"),
    [
        (
            {"FAKECUDA_DEVICES": "2", "FAKECUDA_WRONG_DEVICE": "1"},
            [
                "PASS 0000:06:00.0 NVIDIA H100 80GB HBM3",
                "FAIL 0000:07:00.0 wrong result in 1 of 4096 elements "
                "(c[2048] = 6145.0, expected 6144.0)",
            ],
        ),
        (
            {"FAKECUDA_DEVICES": "2", "FAKECUDA_LAUNCH_ERROR_DEVICE": "0"},
            [
                "FAIL 0000:06:00.0 cuLaunchKernel: CUDA_ERROR_LAUNCH_FAILED (719)",
                "PASS 0000:07:00.0 NVIDIA H100 80GB HBM3",
            ],
        ),
        ({"FAKECUDA_INIT_ERROR": "100"}, ["FAIL - cuInit: CUDA_ERROR_NO_DEVICE (100)"]),
        ({"FAKECUDA_DEVICES": "0"}, ["FAIL - no CUDA devices"]),
    ],
)
def test_smoke_program_failures(fake_libcuda: Path, env: dict[str, str], lines: list[str]) -> None:
    done = run_smoke(fake_libcuda, **env)
    assert done.returncode == 1
    assert done.stdout.splitlines() == lines


def test_smoke_program_without_libcuda(tmp_path: Path) -> None:
    done = run_smoke(tmp_path)
    assert done.returncode == 1
    assert done.stdout.startswith("FAIL - cannot load the CUDA driver library libcuda.so.1: ")


# -- the NVLink fabric of NVSwitch guests (verify(..., fabric=True)) ----------------------------


def eight_gpu_nvlink_status() -> str:
    """``nvidia-smi nvlink --status`` of eight GPUs with every link up: the posted A100 text
    (tests/fixtures/guest/fabric, cut by its poster after two GPUs) repeated for GPUs 0 to 7."""
    pair = (FABRIC / "a100x2_nvlink_status.out").read_text()
    first = pair[: pair.index("GPU 1:")]
    return "".join(first.replace("GPU 0:", f"GPU {index}:", 1) for index in range(8))


def test_fabric_check_passes_eight_gpus_all_on_nvlink() -> None:
    guest = FakeGuest.scenario(
        "hgx_h100x8",
        **{
            "cuda-init": "cuInit 0\n",
            "nvlink": eight_gpu_nvlink_status(),
            "topology": (FABRIC / "h100x8_topo.out").read_text(),
        },
    )
    report = verify.verify(guest, HGX, fabric=True)
    assert report.ok, report.problems
    assert guest.checks_run[-3:] == ["cuda-init", "nvlink", "topology"]
    assert report.check("fabric") == verify.CheckResult(
        "fabric",
        "passed",
        "cuda-init: cuInit succeeded; nvlink: 8 GPUs, 12 active links each; "
        "topology: every GPU pair over NVLink (NV18)",
    )


def test_fabric_not_initialised_and_pcie_pairs_fail_with_the_fix() -> None:
    guest = FakeGuest.scenario(
        "hgx_h100x8",
        **{
            "cuda-init": (1, "", (FABRIC / "cuda802_pytorch_h200.out").read_text()),
            "nvlink": (FABRIC / "a100x2_nvlink_status.out").read_text(),
            "topology": (FABRIC / "rtx4090x8_sys_topo.out").read_text(),
        },
    )
    report = verify.verify(guest, HGX, fabric=True)
    assert not report.ok
    assert report.check("fabric").status == "failed"
    fabric = [problem for problem in report.problems if problem.startswith("fabric: ")]
    assert fabric[0] == "fabric: cuda-init: " + nvlink.FABRIC_NOT_INITIALISED
    assert "activated this sandbox's partition (fmpm -l)" in fabric[0]
    assert fabric[1] == "fabric: nvlink: it lists 2 GPUs, 8 expected"
    assert fabric[2].startswith("fabric: topology: pairs not connected by NVLink: GPU0-GPU1 SYS")
    with pytest.raises(GuestVerificationFailed, match="fabric not initialised"):
        verify.raise_if_failed(report)


def test_inactive_links_fail_the_fabric_check() -> None:
    v100 = (FABRIC / "v100_inactive_nvlink_status.out").read_text()
    guest = FakeGuest.scenario(
        "hgx_h100x8",
        **{
            "cuda-init": "cuInit 0\n",
            "nvlink": v100,
            "topology": (FABRIC / "h100x8_topo.out").read_text(),
        },
    )
    report = verify.verify(guest, HGX, fabric=True)
    assert report.check("fabric").detail == (
        "nvlink: it lists 1 GPUs, 8 expected; GPU 3 links 3, 5 are inactive"
    )


def test_fabric_is_skipped_without_the_driver_and_never_run_unasked() -> None:
    driverless = FakeGuest.scenario("hgx_h100x8", probe="nvidia-smi: no\n")
    report = verify.verify(driverless, HGX, fabric=True)
    assert driverless.checks_run == ["lspci", "probe"]
    assert report.check("fabric") == verify.CheckResult(
        "fabric", "skipped", "image has no NVIDIA driver"
    )
    plain = FakeGuest.scenario("hgx_h100x8")
    assert verify.verify(plain, HGX).check("fabric") is None
    assert not {"cuda-init", "nvlink", "topology"} & set(plain.checks_run)
