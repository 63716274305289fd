"""A full or read-only disk under the state or image directory: a clear error that names the
path (FAILED_PRECONDITION, or RESOURCE_EXHAUSTED for a full disk), and nothing half-written.

The disks are small tmpfs mounts of the test's own, so the failure hits the real write at
whichever step runs out of room: the keys (8 KiB), the overlay (64 KiB), the seed (256 KiB).
"""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from framework.disks import mbr_qcow2
from framework.sandboxes import cli, leftovers

from vmsandbox.config import Config
from vmsandbox.errors import VmSandboxError
from vmsandbox.image.store import ImageStore
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.sandbox.spec import SandboxSpec, generate_name

CLEAR_CODES = ("FAILED_PRECONDITION", "RESOURCE_EXHAUSTED")
Mount = Callable[..., Path]


@pytest.fixture
def tmpfs() -> Iterator[Mount]:
    """Mount small tmpfs file systems (``size``, ``ro``) for one test; unmount them after."""
    mounted: list[Path] = []

    def mount(size: str = "64k", *, read_only: bool = False) -> Path:
        point = Path(tempfile.mkdtemp(prefix="vmsbx-tmpfs-", dir="/var/tmp"))
        options = f"size={size},mode=0711" + (",ro" if read_only else "")
        subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)], check=True)
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], check=False)
        point.rmdir()


def files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if not p.is_dir())


def assert_one_error_line(done: subprocess.CompletedProcess, path: Path) -> str:
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, done.stderr
    code = errors[0].split(":")[1].strip()
    assert code in CLEAR_CODES, errors[0]
    assert done.returncode == {"FAILED_PRECONDITION": 5, "RESOURCE_EXHAUSTED": 6}[code]
    assert str(path) in errors[0]
    assert "Traceback" not in done.stderr
    return errors[0]


@pytest.mark.parametrize("size", ["8k", "64k", "256k"])
def test_create_on_a_full_state_disk_fails_clearly_and_leaves_nothing(
    config: Config, tmpfs: Mount, size: str
) -> None:
    cfg = replace(config, state_dir=tmpfs(size) / "state")
    name = generate_name("t")
    with SandboxManager(cfg) as manager, pytest.raises(VmSandboxError) as caught:
        manager.create(SandboxSpec(name=name, memory_mib=256), wait=False)
    assert caught.value.code in CLEAR_CODES, caught.value.to_dict()
    assert str(cfg.state_dir) in caught.value.message
    assert leftovers(cfg, name) == []
    assert files_under(cfg.state_dir) == ["host.lock", "host.lock.d/counter"]


def test_cli_create_on_a_full_state_disk_is_one_clear_error_line(
    config: Config, tmpfs: Mount
) -> None:
    cfg = replace(config, state_dir=tmpfs("64k") / "state")
    name = generate_name("t")
    done = cli("create", name, "--memory", "256", "--no-wait", config=cfg, timeout=120)
    assert_one_error_line(done, cfg.state_dir)
    assert leftovers(cfg, name) == []
    assert files_under(cfg.state_dir) == ["host.lock", "host.lock.d/counter"]


def test_a_read_only_state_directory_is_failed_precondition(config: Config, tmpfs: Mount) -> None:
    cfg = replace(config, state_dir=tmpfs(read_only=True) / "state")
    name = generate_name("t")
    done = cli("create", name, "--no-wait", config=cfg, timeout=120)
    line = assert_one_error_line(done, cfg.state_dir)
    assert line.startswith("error: FAILED_PRECONDITION: ")
    assert leftovers(cfg, name) == []


@pytest.fixture(scope="module")
def small_image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("source") / "small.qcow2"
    return mbr_qcow2(path)


@pytest.mark.parametrize("how", ["full", "read-only"])
def test_image_import_into_an_unwritable_image_dir_fails_clearly(
    config: Config, tmpfs: Mount, small_image: Path, how: str
) -> None:
    """``images import`` that cannot write: the API error and the CLI line name the image
    directory, and no build folder or ``current`` link is left half-made."""
    root = tmpfs("64k", read_only=how == "read-only")
    with pytest.raises(VmSandboxError) as caught:
        ImageStore(root).import_image(small_image, "imported")
    assert caught.value.code in CLEAR_CODES, caught.value.to_dict()
    assert str(root) in caught.value.message
    done = cli(
        "images",
        "import",
        str(small_image),
        "again",
        config=replace(config, image_dir=root),
        timeout=120,
    )
    assert_one_error_line(done, root)
    leftover = [f for f in files_under(root) if not f.endswith("/.lock")]
    assert leftover == []
    assert not list(root.glob("*/.build-*"))
    assert not list(root.glob("*/current"))
