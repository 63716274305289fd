"""Guests that never come up. One that cannot boot fails at once with FAILED_PRECONDITION and the
console lines that say why (a blank disk: "No bootable device."; a kernel that panics); one
still running at the timeout is DEADLINE_EXCEEDED with the tail of its serial console, saying
when cloud-init never ran. Nothing is left behind either way.

The images live in an image directory of the test's own: an 8 MiB all-zeros disk (laid out as
the store would after an import, without the import's checks), and the minimal image booted with
another command line: a root that does not exist (without an initrd the kernel panics, with one
the initramfs gives up), ``poweroff.target`` (QEMU ends early), ``ssh.service`` masked (kernel,
systemd and the first-boot unit run; sshd never answers), or what reads the seed (cloud-init,
vmsandbox's first-boot unit) disabled as well.

Whether a failure came fast is shown by its code, not by timing: the waits are long (600 s), so
FAILED_PRECONDITION can only come from what the console or libvirt said.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from framework.sandboxes import leftovers

from vmsandbox.config import Config
from vmsandbox.errors import DeadlineExceeded, FailedPrecondition
from vmsandbox.image.store import ImageStore
from vmsandbox.sandbox.boot import NO_SEED_READER
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.sandbox.spec import SandboxSpec, generate_name

BUILD_ID = "0123456789abcdef"


def _publish(root: Path, name: str, meta: dict[str, object], files: dict[str, Path]) -> None:
    """Lay out image ``name`` as ImageStore does: <root>/<name>/<id>/..., current -> <id>."""
    build = root / name / BUILD_ID
    build.mkdir(parents=True)
    for file, source in files.items():
        (build / file).symlink_to(source)
    (build / "meta.json").write_text(json.dumps({**meta, "name": name, "id": BUILD_ID}))
    (root / name / "current").symlink_to(BUILD_ID)


@pytest.fixture(scope="module")
def image_dir(config: Config) -> Iterator[Path]:
    """Images ``blank`` (8 MiB of zeros, no kernel), ``panic``, ``no-root``, ``poweroff``,
    ``no-sshd`` and ``no-seed-reader`` (the minimal image's disk and kernel with the command
    lines above)."""
    root = Path(tempfile.mkdtemp(prefix="vmsbx-images-", dir="/var/tmp"))
    os.chmod(root, 0o755)
    blank = root / "blank.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(blank), "8M"], check=True)
    os.chmod(blank, 0o644)
    _publish(root, "blank", {"kind": "import", "virtual_size": 8 * 2**20}, {"disk.qcow2": blank})
    minimal = ImageStore(config.images).get("minimal")
    kernel = {"disk.qcow2": minimal.disk, "vmlinuz": minimal.path / "vmlinuz"}
    with_initrd = {**kernel, "initrd.img": minimal.path / "initrd.img"}
    panic = {**minimal.meta, "initrd": None, "cmdline": "root=/dev/nonexistent console=ttyS0"}
    _publish(root, "panic", panic, kernel)
    no_root = {**minimal.meta, "cmdline": "root=/dev/nonexistent rootdelay=1 console=ttyS0"}
    _publish(root, "no-root", no_root, with_initrd)
    poweroff = {**minimal.meta, "cmdline": minimal.cmdline + " systemd.unit=poweroff.target"}
    _publish(root, "poweroff", poweroff, with_initrd)
    no_sshd = minimal.cmdline + " systemd.mask=ssh.service"
    _publish(root, "no-sshd", {**minimal.meta, "cmdline": no_sshd}, with_initrd)
    no_reader = no_sshd + " cloud-init=disabled systemd.mask=vmsandbox-firstboot.service"
    _publish(root, "no-seed-reader", {**minimal.meta, "cmdline": no_reader}, with_initrd)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_a_blank_disk_fails_at_once_with_the_firmware_line_from_the_cli(
    config: Config, image_dir: Path
) -> None:
    """SeaBIOS finds nothing to boot: exit 5 (FAILED_PRECONDITION), one error line quoting the
    firmware, the console section, no trace, nothing left (libvirt's QEMU log included)."""
    name = generate_name("t")
    env = {
        **os.environ,
        "VMSANDBOX_CONFIG": "/nonexistent",
        "VMSANDBOX_URI": config.uri,
        "VMSANDBOX_STATE_DIR": str(config.state_dir),
        "VMSANDBOX_IMAGE_DIR": str(image_dir),
        "VMSANDBOX_VIRT_TYPE": config.virt_type,
    }
    argv = [sys.executable, "-m", "vmsandbox.cli", "create", name, "--image", "blank"]
    done = subprocess.run(
        [*argv, "--memory", "256", "--timeout", "600"],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        check=False,
    )
    assert done.returncode == 5, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: FAILED_PRECONDITION: sandbox '{name}' cannot boot: its console says "
        "'No bootable device.'"
    ]
    assert "--- guest console (last lines) ---" in done.stderr
    assert "Traceback" not in done.stderr
    assert leftovers(config, name) == []


@pytest.mark.parametrize(
    ("image", "says"),
    [
        ("panic", "Kernel panic - not syncing"),
        ("no-root", "Gave up waiting for root"),
    ],
)
def test_a_guest_that_cannot_mount_its_root_fails_at_once(
    config: Config, image_dir: Path, image: str, says: str
) -> None:
    """Without an initrd the kernel panics; with one, the initramfs gives up on the root."""
    name = generate_name("t")
    spec = SandboxSpec(name=name, image=image, memory_mib=256)
    with (
        SandboxManager(replace(config, image_dir=image_dir), reconcile=False) as manager,
        pytest.raises(FailedPrecondition) as caught,
    ):
        manager.create(spec, timeout=600)
    assert says in caught.value.details["console_line"]
    assert "cannot boot" in caught.value.message
    assert leftovers(config, name) == []


def test_a_guest_that_powers_off_fails_at_once_with_libvirts_reason(
    config: Config, image_dir: Path
) -> None:
    """QEMU ends before SSH is up (the guest powered off): libvirt's shutoff reason is given."""
    name = generate_name("t")
    spec = SandboxSpec(name=name, image="poweroff", memory_mib=512)
    with (
        SandboxManager(replace(config, image_dir=image_dir), reconcile=False) as manager,
        pytest.raises(FailedPrecondition) as caught,
    ):
        manager.create(spec, timeout=600)
    assert "stopped before SSH came up: the guest powered itself off" in caught.value.message
    assert leftovers(config, name) == []


def test_a_guest_without_sshd_is_deadline_exceeded_with_its_console(
    config: Config, image_dir: Path
) -> None:
    """The kernel and systemd boot, sshd never starts: DEADLINE_EXCEEDED after the timeout,
    with the console's last lines in the message and in ``details``, and nothing left."""
    name, timeout = generate_name("t"), 60.0
    with SandboxManager(replace(config, image_dir=image_dir), reconcile=False) as manager:
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded) as caught:
            manager.create(SandboxSpec(name=name, image="no-sshd", memory_mib=512), timeout=timeout)
        took = time.monotonic() - started
    error = caught.value
    assert error.code == "DEADLINE_EXCEEDED"
    assert took >= timeout  # it waited the whole timeout: nothing on the console ended it early
    tail = error.details["console_tail"]
    assert re.search(r"\[\s*\d+\.\d+\]|systemd|cloud-init|login:", tail), tail
    assert tail in error.message
    assert leftovers(config, name) == []


def test_a_guest_without_a_seed_reader_times_out_saying_so(config: Config, image_dir: Path) -> None:
    """An image without cloud-init or the first-boot unit boots, but nothing installs the
    sandbox's keys: the timeout says neither was seen on the console."""
    name = generate_name("t")
    spec = SandboxSpec(name=name, image="no-seed-reader", memory_mib=512)
    with (
        SandboxManager(replace(config, image_dir=image_dir), reconcile=False) as manager,
        pytest.raises(DeadlineExceeded) as caught,
    ):
        manager.create(spec, timeout=90)
    assert NO_SEED_READER in caught.value.message
    assert caught.value.details["seed_reader_seen"] is False
    assert leftovers(config, name) == []
