"""Guests that never come up: DEADLINE_EXCEEDED within the timeout, with the tail of the
serial console in the error, and nothing left behind.

Both images live in an image directory of the test's own: a blank disk that firmware finds
nothing to boot on, and the minimal image booted with ``ssh.service`` masked (the kernel,
systemd and cloud-init run; sshd never answers).
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
from conftest import leftovers

from vmsandbox.config import Config
from vmsandbox.errors import DeadlineExceeded
from vmsandbox.images import ImageStore
from vmsandbox.manager import SandboxManager
from vmsandbox.spec import SandboxSpec, generate_name

pytestmark = pytest.mark.e2e

BUILD_ID = "0123456789abcdef"
SLACK = 30.0  # start and cleanup around the wait itself, on a loaded 2-core machine


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
    """Images ``blank`` (a zeroed qcow2, no kernel) and ``no-sshd`` (minimal, sshd masked)."""
    root = Path(tempfile.mkdtemp(prefix="vmsbx-images-", dir="/var/tmp"))
    os.chmod(root, 0o755)
    blank = root / "blank.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(blank), "1G"], check=True)
    os.chmod(blank, 0o644)
    _publish(root, "blank", {"kind": "import", "virtual_size": 2**30}, {"disk.qcow2": blank})
    minimal = ImageStore(config.images).get("minimal")
    meta = {**minimal.meta, "cmdline": minimal.cmdline + " systemd.mask=ssh.service"}
    files = {"disk.qcow2": minimal.disk, "vmlinuz": minimal.path / "vmlinuz"}
    files["initrd.img"] = minimal.path / "initrd.img"
    _publish(root, "no-sshd", meta, files)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_an_unbootable_disk_is_deadline_exceeded_from_the_cli(
    config: Config, image_dir: Path
) -> None:
    """Firmware finds nothing to boot: exit 8, one error line, the console section, no trace."""
    name, timeout = generate_name("t"), 20
    env = {
        **os.environ,
        "VMSANDBOX_CONFIG": "/nonexistent",
        "VMSANDBOX_URI": config.uri,
        "VMSANDBOX_STATE_DIR": str(config.state_dir),
        "VMSANDBOX_IMAGE_DIR": str(image_dir),
        "VMSANDBOX_VIRT_TYPE": config.virt_type,
    }
    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "vmsandbox.cli",
            "create",
            name,
            "--image",
            "blank",
            "--memory",
            "256",
            "--timeout",
            str(timeout),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout + 120,
        check=False,
    )
    took = time.monotonic() - started
    assert done.returncode == 8, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1
    assert re.match(rf"error: DEADLINE_EXCEEDED: sandbox '{name}': guest did not accept", errors[0])
    assert "--- guest console (last lines) ---" in done.stderr
    assert "Traceback" not in done.stderr
    assert took < timeout + SLACK
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
    assert timeout <= took < timeout + SLACK
    tail = error.details["console_tail"]
    assert re.search(r"\[\s*\d+\.\d+\]|systemd|cloud-init|login:", tail), tail
    assert tail in error.message
    assert leftovers(config, name) == []
