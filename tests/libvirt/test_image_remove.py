"""``images rm`` and ``images prune`` on the real libvirtd: a build that a sandbox's overlay backs
onto is never removed (rm refuses, naming the sandbox; prune spares it), builds that nothing
uses and that are not current go, and both report the disk space they freed."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from framework.disks import raw_disk
from framework.sandboxes import cli

from vmsandbox.config import Config
from vmsandbox.errors import NotFound
from vmsandbox.image.store import ImageStore, make_overlay
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.sandbox.spec import SandboxSpec, generate_name


@pytest.fixture
def store_config(config: Config) -> Iterator[Config]:
    """The test run's state directory with an image store of this test's own."""
    root = Path(tempfile.mkdtemp(prefix="vmsbx-imgstore-", dir="/var/tmp"))
    os.chmod(root, 0o755)
    yield replace(config, image_dir=root)
    shutil.rmtree(root, ignore_errors=True)


def import_version(config: Config, tmp: Path, version: int) -> str:
    """Import a new build of image ``disk`` (content differs per version); its build id."""
    source = raw_disk(tmp / f"v{version}.raw", size=(4 + version) << 20)
    return ImageStore(config.images).import_image(source, "disk", replace=True).id


def cli_json(config: Config, *args: str) -> tuple[int, dict]:
    done = cli("--json", "images", *args, config=config)
    return done.returncode, json.loads(done.stdout)


def test_rm_and_prune_spare_what_a_sandbox_uses(store_config: Config, tmp_path: Path) -> None:
    cfg = store_config
    old = import_version(cfg, tmp_path, 1)
    name = generate_name("t")
    with SandboxManager(cfg) as manager:
        manager.create(SandboxSpec(name=name, image="disk", memory_mib=256), start=False)
        try:
            new = import_version(cfg, tmp_path, 2)  # "current" moves on; the sandbox stays
            assert new != old
            killed = cfg.images / "disk" / f".build-{new}-999999"
            killed.mkdir()  # what a killed import leaves
            (killed / "disk.qcow2").write_bytes(b"x" * 8192)

            status, report = cli_json(cfg, "prune")
            assert status == 0, report
            assert [(r["id"], r["bytes"] > 0) for r in report["removed"]] == [(killed.name, True)]
            assert sorted(p.name for p in (cfg.images / "disk").iterdir()) == sorted(
                [".lock", "current", old, new]
            )

            done = cli("images", "rm", "disk", config=cfg)
            assert done.returncode == 5, done.stdout + done.stderr
            assert done.stderr.splitlines() == [
                f"error: FAILED_PRECONDITION: image 'disk' is in use by 1 sandbox(es): {name}; "
                "destroy them first"
            ]
            assert (cfg.images / "disk" / old / "disk.qcow2").is_file()
        finally:
            manager.destroy(name)

    status, report = cli_json(cfg, "prune")
    assert status == 0, report
    assert [r["id"] for r in report["removed"]] == [old]
    assert report["freed_bytes"] == report["removed"][0]["bytes"] > 0
    assert ImageStore(cfg.images).get("disk").id == new

    done = cli("images", "rm", "disk", config=cfg)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[0].startswith(f"removed disk {new} (")
    assert done.stdout.splitlines()[-1].startswith("freed ")
    assert not (cfg.images / "disk").exists()
    with pytest.raises(NotFound):
        ImageStore(cfg.images).get("disk")


def test_a_sandbox_found_by_its_overlay_alone_keeps_its_build(
    store_config: Config, tmp_path: Path
) -> None:
    """A domain that is not a sandbox (no record) but whose disk backs onto a build: still in
    use, named by its domain name (what libvirt shows), so rm refuses."""
    import libvirt

    cfg = store_config
    build = cfg.images / "disk" / import_version(cfg, tmp_path, 1)
    overlay = cfg.state_dir / f"foreign-{generate_name('t')}.qcow2"
    make_overlay(build / "disk.qcow2", overlay, 1)
    domain = f"foreign-{generate_name('t')}"
    conn = libvirt.open(cfg.uri)
    dom = conn.defineXML(
        f"""<domain type='qemu'><name>{domain}</name><memory unit='MiB'>64</memory>
        <os><type arch='x86_64' machine='q35'>hvm</type></os><devices>
        <disk type='file' device='disk'><driver name='qemu' type='qcow2'/>
        <source file='{overlay}'/><target dev='vda' bus='virtio'/></disk></devices></domain>"""
    )
    try:
        status, report = cli_json(cfg, "rm", "disk")
        assert status == 5, report
        assert report["error"]["details"]["sandboxes"] == [domain]
    finally:
        dom.undefine()
        conn.close()
        overlay.unlink()
    status, report = cli_json(cfg, "rm", "disk")
    assert status == 0, report
    assert [r["id"] for r in report["removed"]] == [build.name]


def test_rm_of_an_unknown_image_is_not_found(store_config: Config) -> None:
    status, report = cli_json(store_config, "rm", "never-built")
    assert status == 3, report
    assert report["error"]["code"] == "NOT_FOUND"
    assert not (store_config.images / "never-built").exists()
