"""The real host the libvirt, e2e and reliability tests work on: the images, a configuration
on qemu:///system with a state directory of the test's own, the CLI run as a separate process
against it, and what a sandbox left behind."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from framework import fake_sysfs

from vmsandbox.config import Config

IMAGES = Path(os.environ.get("VMSANDBOX_IMAGE_DIR", "/var/lib/vmsandbox/images"))


def make_config(state_dir: Path, **overrides: object) -> Config:
    """A configuration of the real libvirtd with a state directory of the test's own; GPU
    custody resets and reads the fake hosts' GPUs in a fake sysfs (framework/fake_sysfs.py),
    never a device of this machine."""
    return Config.load(
        path="/nonexistent",
        uri="qemu:///system",
        state_dir=state_dir,
        image_dir=IMAGES,
        virt_type="qemu",
        boot_timeout=600,  # TCG on a busy 2-core machine: generous, the tests assert no timing
        **{"pci_sysfs": fake_sysfs.shared(), **overrides},
    )


def cli_env(config: Config, **extra: str) -> dict[str, str]:
    """The environment of a CLI process that works on ``config``'s libvirt and state directory
    (and its GPU custody's sysfs: a config file says it, no variable does)."""
    env = dict(os.environ)
    env.update(
        VMSANDBOX_CONFIG=config_file(config),
        VMSANDBOX_URI=config.uri,
        VMSANDBOX_STATE_DIR=str(config.state_dir),
        VMSANDBOX_IMAGE_DIR=str(config.images),
        VMSANDBOX_VIRT_TYPE=config.virt_type,
        VMSANDBOX_BOOT_TIMEOUT=str(config.boot_timeout),
    )
    env.update(extra)
    return env


def config_file(config: Config) -> str:
    """A config file of the keys no environment variable sets (``pci_sysfs``), in the temporary
    folder (never in the state directory, whose files some tests count; it may be read-only);
    "/nonexistent" when they are the defaults."""
    if config.pci_sysfs == Path("/sys/bus/pci/devices"):
        return "/nonexistent"
    key = hashlib.sha256(str(config.state_dir).encode()).hexdigest()[:16]
    file = Path(tempfile.gettempdir()) / f"vmsbx-test-config-{key}.toml"
    file.write_text(f'pci_sysfs = "{config.pci_sysfs}"\n')
    return str(file)


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

    from vmsandbox.sandbox.record import SandboxFiles

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
