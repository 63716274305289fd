"""The image store's build folders (vmsandbox.image.store) and what a recipe adds to its guests'
kernel command line, without building a recipe."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from vmsandbox.errors import FailedPrecondition
from vmsandbox.image.build import KERNEL_CMDLINE, kernel_cmdline
from vmsandbox.image.recipe import load_recipe
from vmsandbox.image.store import ImageStore


def _make_disk(tmp: Path) -> dict[str, Any]:
    subprocess.run(
        ["qemu-img", "create", "-q", "-f", "qcow2", str(tmp / "disk.qcow2"), "16M"], check=True
    )
    return {"kind": "import"}


def test_a_rebuild_never_changes_a_published_build_folder(tmp_path: Path) -> None:
    """``images build --force`` with an unchanged recipe (defect 8d): the first build's folder,
    which sandboxes' overlays back onto, stays as it was; the rebuild gets a folder of its own
    and ``current`` moves to it."""
    store = ImageStore(tmp_path)
    first = store._publish("img", "0123456789abcdef", _make_disk)
    disk = first.disk.stat()
    second = store._publish("img", "0123456789abcdef", _make_disk)
    third = store._publish("img", "0123456789abcdef", _make_disk)

    assert (first.id, second.id, third.id) == (
        "0123456789abcdef",
        "0123456789abcdef-2",
        "0123456789abcdef-3",
    )
    assert (first.disk.stat().st_ino, first.disk.stat().st_mtime_ns) == (
        disk.st_ino,
        disk.st_mtime_ns,
    )
    assert store.get("img").path == third.path
    assert store.get("img").meta["id"] == third.id
    assert store.is_current("img", "0123456789abcdef")
    assert not store.is_current("img", "0123456789abcde0")
    assert sorted(p.name for p in (tmp_path / "img").iterdir()) == [
        "0123456789abcdef",
        "0123456789abcdef-2",
        "0123456789abcdef-3",
        "current",
    ]


def test_an_unchanged_recipe_makes_its_kept_build_current_again(tmp_path: Path) -> None:
    """Building a recipe whose build is on disk but not current (another recipe was built
    meanwhile) points ``current`` back at the newest finished build instead of rebuilding."""
    store = ImageStore(tmp_path)
    store._publish("img", "0123456789abcdef", _make_disk)
    forced = store._publish("img", "0123456789abcdef", _make_disk)
    other = store._publish("img", "fedcba9876543210", _make_disk)
    assert store.get("img").id == other.id
    (tmp_path / "img" / ".build-0123456789abcdef-3-1").mkdir()  # a killed build: never chosen

    again = store.reuse("img", "0123456789abcdef")
    assert again is not None and again.id == forced.id == "0123456789abcdef-2"
    assert store.get("img").path == forced.path
    assert store.reuse("img", "0000000000000000") is None
    assert store.get("img").id == forced.id


def test_a_recipes_kernel_args_follow_vmsandboxs_own() -> None:
    """vmsandbox's guest images boot quiet, sshd first; the nested host keeps the plain line."""
    lean = f"{KERNEL_CMDLINE} quiet systemd.unit=vmsandbox-sshd.target"
    assert kernel_cmdline(load_recipe("minimal")) == lean
    assert kernel_cmdline(load_recipe("nvidia")) == lean
    assert kernel_cmdline(load_recipe("nested")) == KERNEL_CMDLINE


@pytest.mark.parametrize("args", ['"quiet"', '["quiet ro"]', "[1]", '[""]'])
def test_kernel_args_are_a_list_of_words(tmp_path: Path, args: str) -> None:
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd/recipe.toml").write_text(f"kernel_args = {args}\n")
    with pytest.raises(FailedPrecondition, match=r"recipe 'odd': kernel_args must be a list"):
        load_recipe("odd", tmp_path)
