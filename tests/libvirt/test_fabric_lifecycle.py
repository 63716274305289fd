"""A sandbox's Fabric Manager partition through create, failure, destroy, crash and reconcile,
on the umockdev HGX host against the real libvirtd, with the fake fmpm in shared NVSwitch mode.

Starting a domain with GPUs fails here (no VFIO), which is the failed create every test sees
after activation: the partition must be deactivated and nothing left. The image is a small
imported disk whose metadata records driver 535.216.01, as a build of the nvidia recipe does.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from framework import paths
from framework.crash import kill9, start_create, stop_and_clean
from framework.disks import mbr_qcow2
from framework.fake_hosts import umockdev_run
from framework.sandboxes import cli_env, leftovers

from vmsandbox.config import Config
from vmsandbox.image.store import ImageStore
from vmsandbox.sandbox.spec import generate_name

FIXTURES = paths.FIXTURES / "fmpm"
DRIVER = "535.216.01"


@dataclass
class FabricHost:
    """The fake FM's state folder, and the CLI environment of a shared-mode HGX host."""

    config: Config
    fm: Path
    env: dict[str, str]

    def calls(self) -> list[str]:
        log = self.fm / "calls.log"
        return log.read_text().splitlines() if log.exists() else []

    def active(self) -> list[int]:
        file = self.fm / "active.json"
        return json.loads(file.read_text()) if file.exists() else []

    def ledger(self) -> list[str]:
        folder = self.config.state_dir / "fabric"
        return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []

    def run(self, *args: str, fake_host: bool = True) -> subprocess.CompletedProcess[str]:
        """``vmsandbox ARGS`` (under umockdev's HGX host unless ``fake_host`` is False)."""
        command = [sys.executable, "-m", "vmsandbox.cli", *args]
        if not fake_host:
            return subprocess.run(
                command, capture_output=True, text=True, env=self.env, timeout=300, check=False
            )
        with umockdev_run("hgx_h100") as (prefix, umockdev_env):
            testbed = {k: v for k, v in umockdev_env.items() if k == "TMPDIR"}
            return subprocess.run(
                [*prefix, *command],
                capture_output=True,
                text=True,
                env={**self.env, **testbed},
                timeout=300,
                check=False,
            )


@pytest.fixture
def host(config: Config) -> Iterator[FabricHost]:
    root = Path(tempfile.mkdtemp(prefix="vmsbx-fabric-", dir="/var/tmp"))
    os.chmod(root, 0o711)
    own = replace(config, state_dir=root / "state", image_dir=root / "images")
    disk = root / "disk.qcow2"
    mbr_qcow2(disk)
    image = ImageStore(own.images).import_image(disk, "fabric")
    meta = image.path / "meta.json"
    meta.write_text(json.dumps({**image.meta, "nvidia_driver_version": DRIVER}))
    fm = root / "fm"
    fm.mkdir()
    (fm / "version").write_text(DRIVER)
    cfg = root / "fabricmanager.cfg"
    cfg.write_text("FABRIC_MODE=1\n")
    env = cli_env(
        own,
        VMSANDBOX_FMPM=str(FIXTURES / "fmpm"),
        VMSANDBOX_FABRIC_MANAGER=str(FIXTURES / "nv-fabricmanager"),
        VMSANDBOX_FABRIC_MANAGER_CONFIG=str(cfg),
        FAKE_FMPM_STATE=str(fm),
    )
    yield FabricHost(own, fm, env)
    shutil.rmtree(root, ignore_errors=True)


def create(host: FabricHost, name: str, *args: str) -> subprocess.CompletedProcess[str]:
    return host.run("create", name, "--image", "fabric", "--memory", "256", *args)


def test_failed_start_deactivates_the_partition_and_leaves_nothing(host: FabricHost) -> None:
    done = create(host, "t-fab-start", "--gpu-count", "2")
    assert done.returncode == 5, done.stderr
    assert "activating Fabric Manager partition 4" in done.stderr
    assert "starting sandbox 't-fab-start': libvirt refused" in done.stderr
    # the pair on one PCIe switch (18, 19) is partition 4; activated, then deactivated
    assert host.calls() == ["-l", "-a 4", "-l", "-d 4"]
    assert host.active() == [] and host.ledger() == []
    assert leftovers(host.config, "t-fab-start") == []


def test_dry_run_reads_fm_and_activates_nothing(host: FabricHost) -> None:
    done = create(host, "t-fab-dry", "--gpu-count", "4", "--dry-run")
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("<hostdev ") == 4
    assert host.calls() == ["-l"]
    assert leftovers(host.config, "t-fab-dry") == []


def test_fm_unreachable_says_so_and_leaves_nothing(host: FabricHost) -> None:
    (host.fm / "unreachable").touch()
    done = create(host, "t-fab-down", "--gpu-count", "2")
    assert done.returncode != 0
    assert "error: UNAVAILABLE: listing partitions: Fabric Manager at 127.0.0.1" in done.stderr
    assert "Failed to connect to Fabric Manager instance." in done.stderr
    assert host.calls() == ["-l"] and host.ledger() == []
    assert leftovers(host.config, "t-fab-down") == []


def test_driver_other_than_fm_is_refused_before_activation(host: FabricHost) -> None:
    (host.fm / "version").write_text("550.54.15")
    done = create(host, "t-fab-version", "--gpu-count", "2")
    assert done.returncode == 5, done.stderr
    assert f"image 'fabric' has NVIDIA driver {DRIVER}, but this host's Fabric Manager is " in (
        done.stderr
    )
    assert "550.54.15" in done.stderr
    assert host.calls() == ["-l"] and host.active() == [] and host.ledger() == []
    assert leftovers(host.config, "t-fab-version") == []


def test_no_partition_of_that_size_names_the_sizes(host: FabricHost) -> None:
    done = create(host, "t-fab-three", "--gpu-count", "3")
    assert done.returncode == 5, done.stderr
    assert "partitions that fit the request have 1, 2, 4 or 8 GPUs" in done.stderr
    assert leftovers(host.config, "t-fab-three") == []


@pytest.mark.parametrize("stage", ["fabric", "define"])
def test_kill_9_after_activation_then_reconcile_deactivates(host: FabricHost, stage: str) -> None:
    name = generate_name("t")
    with umockdev_run("hgx_h100") as (prefix, umockdev_env):
        testbed = {k: v for k, v in umockdev_env.items() if k == "TMPDIR"}
        env = {**host.env, **testbed}
        args = ("--image", "fabric", "--gpu-count", "4", "--no-wait")
        proc = start_create(host.config, name, stage, *args, prefix=prefix, env=env)
        try:
            kill9(proc)
            assert host.active() == [1]  # node 0's four GPUs, left active by the kill
            assert host.ledger() == ["1.json"]
            done = host.run("reconcile", "--json", fake_host=False)
            assert done.returncode == 0, done.stderr
            report = json.loads(done.stdout)
            assert report["fabric_partitions"] == ["1"]
            assert report["problems"] == []
            assert host.active() == [] and host.ledger() == []
            assert host.calls()[-2:] == ["-l", "-d 1"]
            assert leftovers(host.config, name) == []
        finally:
            stop_and_clean(proc, host.config, name)


def test_reconcile_with_fm_down_reports_and_keeps_the_lease(host: FabricHost) -> None:
    name = generate_name("t")
    with umockdev_run("hgx_h100") as (prefix, umockdev_env):
        testbed = {k: v for k, v in umockdev_env.items() if k == "TMPDIR"}
        env = {**host.env, **testbed}
        args = ("--image", "fabric", "--gpu-count", "1", "--no-wait")
        proc = start_create(host.config, name, "fabric", *args, prefix=prefix, env=env)
        try:
            kill9(proc)
            [lease] = host.ledger()
            (host.fm / "unreachable").touch()
            done = host.run("reconcile", "--json", fake_host=False)
            assert done.returncode == 1, done.stderr  # reconcile's status when it could not fix
            fabric, gpu = json.loads(done.stdout)["problems"]
            assert "cannot be reached" in fabric
            # its GPU is not reset under an active partition: it waits, not free
            assert "waits to be sanitized" in gpu and "still active" in gpu
            assert host.ledger() == [lease]
            (host.fm / "unreachable").unlink()
            done = host.run("reconcile", "--json", fake_host=False)
            assert json.loads(done.stdout)["fabric_partitions"] == [lease.split(".")[0]]
            assert json.loads(done.stdout)["problems"] == []  # deactivated, then sanitized
            assert host.active() == [] and host.ledger() == []
        finally:
            stop_and_clean(proc, host.config, name)
