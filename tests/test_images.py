"""The image store's build folders (vmsandbox.image.store), without building a recipe."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

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
