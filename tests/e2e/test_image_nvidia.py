"""End to end: the nvidia image builds (or is current), boots under TCG here, carries a driver
module built for its own kernel, and verifies; with no GPU in the guest the driver finds nothing,
which these tests expect."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator

import pytest

from vmsandbox.errors import NotFound
from vmsandbox.guest import ssh, verify
from vmsandbox.guest.verify import ExpectedGpu
from vmsandbox.image.store import BaseImage
from vmsandbox.sandbox.handle import Sandbox
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.sandbox.spec import SandboxSpec, generate_name


@pytest.fixture(scope="module")
def image(manager: SandboxManager) -> BaseImage:
    """The nvidia image: built here when its recipe changed (about 10 minutes), else current."""
    return manager.images.build("nvidia")


@pytest.fixture(scope="module")
def sandbox(manager: SandboxManager, image: BaseImage) -> Iterator[Sandbox]:
    name = generate_name("nv")
    created = manager.create(SandboxSpec(name=name, image=image.name, memory_mib=2048))
    try:
        yield created
    finally:
        with contextlib.suppress(NotFound):
            manager.destroy(name)


@pytest.fixture(scope="module")
def runner(manager: SandboxManager, sandbox: Sandbox) -> verify.Runner:
    assert sandbox.ssh is not None
    return functools.partial(ssh.run, sandbox.ssh, manager.keys_of(sandbox))


def test_a_current_image_is_not_rebuilt(manager: SandboxManager, image: BaseImage) -> None:
    started = time.monotonic()
    again = manager.images.build("nvidia")
    assert again.id == image.id
    assert time.monotonic() - started < 10
    assert "nvidia-kernel-dkms" in image.meta["packages"]


def test_driver_module_is_built_for_the_guest_kernel(
    runner: verify.Runner, image: BaseImage
) -> None:
    """Debian names the modules' files nvidia-current*.ko (``modprobe nvidia`` follows an
    install rule to them; modinfo does not)."""
    done = runner(
        "uname -r; /usr/sbin/modinfo -F vermagic nvidia-current; "
        "/usr/sbin/modinfo -F vermagic nvidia-current-uvm"
    )
    assert done.exit_status == 0, done.stderr
    kernel, nvidia, uvm = done.stdout.splitlines()
    assert kernel == image.meta["kernel_version"]
    assert nvidia.split()[0] == kernel
    assert uvm.split()[0] == kernel


def test_nvidia_smi_is_installed_and_finds_no_gpu(runner: verify.Runner) -> None:
    assert runner("command -v nvidia-smi").stdout.strip() == "/usr/bin/nvidia-smi"
    done = runner(verify.NVIDIA_SMI)
    assert done.exit_status != 0
    parsed = verify.parse_nvidia_smi(done.stdout + done.stderr)
    assert parsed.rows == ()
    assert parsed.errors[0].startswith("NVIDIA-SMI has failed because it couldn't communicate")


def test_smoke_program_loads_the_real_libcuda(runner: verify.Runner) -> None:
    """Every driver API symbol the program binds exists in the image's libcuda.so.1; cuInit
    then fails for want of a GPU."""
    done = runner(verify.COMPUTE, stdin=verify.cuda_smoke_program(), timeout=120)
    assert done.exit_status == 1, done.stderr
    assert done.stdout.startswith("FAIL - cuInit: CUDA_ERROR_"), done.stdout


def test_verification_without_gpus_passes(runner: verify.Runner) -> None:
    report = verify.verify(runner, [])
    assert report.ok, report.problems


def test_verification_of_a_gpu_that_is_not_there_fails(runner: verify.Runner) -> None:
    missing = ExpectedGpu(
        bdf="0000:41:00.0",
        vendor="nvidia",
        vendor_id="0x10de",
        device_id="0x2330",
        name="NVIDIA H100 80GB HBM3",
        memory_mib=81559,
    )
    report = verify.verify(runner, [missing])
    assert not report.ok
    assert {check.name: check.status for check in report.checks} == {
        "pci": "failed",
        "driver": "passed",
        "nvidia-smi": "failed",
        # no NVIDIA device, so nothing loaded the module (images/nvidia/lean.sh): no NVRM line
        "kernel-log": "passed",
        "compute": "skipped",
    }
    assert report.gpus[0].guest_address is None
    assert any("nvidia-smi" in problem for problem in report.gpus[0].problems), report.to_dict()
