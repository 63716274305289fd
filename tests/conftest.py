"""Shared fixtures: an isolated vmsandbox state directory on the real libvirtd, and one booted
guest that the end-to-end tests share (a TCG boot costs about a minute here).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from vmsandbox.config import Config
from vmsandbox.errors import NotFound
from vmsandbox.manager import Sandbox, SandboxManager
from vmsandbox.spec import SandboxSpec, generate_name

REPO = Path(__file__).resolve().parent.parent
IMAGES = Path(os.environ.get("VMSANDBOX_IMAGE_DIR", "/var/lib/vmsandbox/images"))


def make_config(state_dir: Path, **overrides: object) -> Config:
    return Config.load(
        path="/nonexistent",
        uri="qemu:///system",
        state_dir=state_dir,
        image_dir=IMAGES,
        virt_type="qemu",
        boot_timeout=600,  # TCG on a busy 2-core machine: generous, the tests assert no timing
        **overrides,
    )


@pytest.fixture(scope="session")
def state_dir() -> Iterator[Path]:
    """A state directory of this test run's own (disks must be reachable by libvirt-qemu)."""
    root = Path(tempfile.mkdtemp(prefix="vmsbx-test-", dir="/var/tmp"))
    os.chmod(root, 0o711)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def config(state_dir: Path) -> Config:
    return make_config(state_dir)


@pytest.fixture(scope="session")
def manager(config: Config) -> Iterator[SandboxManager]:
    with SandboxManager(config) as mgr:
        yield mgr


@pytest.fixture(scope="session")
def booted(manager: SandboxManager) -> Iterator[Sandbox]:
    """One minimal guest, booted once for the whole run and destroyed at the end."""
    name = generate_name("t")
    sandbox = manager.create(SandboxSpec(name=name, image="minimal", memory_mib=1024))
    try:
        yield sandbox
    finally:
        with contextlib.suppress(NotFound):  # a test may have destroyed it already
            manager.destroy(name)


def cli_env(config: Config, **extra: str) -> dict[str, str]:
    """The environment of a CLI process that works on ``config``'s libvirt and state directory."""
    env = dict(os.environ)
    env.update(
        VMSANDBOX_CONFIG="/nonexistent",
        VMSANDBOX_URI=config.uri,
        VMSANDBOX_STATE_DIR=str(config.state_dir),
        VMSANDBOX_IMAGE_DIR=str(config.images),
        VMSANDBOX_VIRT_TYPE=config.virt_type,
        VMSANDBOX_BOOT_TIMEOUT=str(config.boot_timeout),
    )
    env.update(extra)
    return env


def cli(
    *args: str, config: Config, check: bool = False, timeout: float = 900
) -> subprocess.CompletedProcess[str]:
    """Run the vmsandbox CLI as a separate process against ``config``."""
    return subprocess.run(
        [sys.executable, "-m", "vmsandbox.cli", *args],
        capture_output=True,
        text=True,
        env=cli_env(config),
        check=check,
        timeout=timeout,
    )


def leftovers(config: Config, name: str) -> list[str]:
    """Everything of sandbox ``name`` still on the host: domain, files."""
    import libvirt

    from vmsandbox.record import SandboxFiles

    found = [str(path) for path in SandboxFiles.of(config, name).existing()]
    conn = libvirt.open(config.uri)
    try:
        conn.lookupByName(f"vmsbx-{name}")
        found.append(f"domain vmsbx-{name}")
    except libvirt.libvirtError:
        pass  # no such domain: nothing left there
    finally:
        conn.close()
    return found
