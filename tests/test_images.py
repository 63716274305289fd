"""The image store's build folders (vmsandbox.images), without building a recipe."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from vmsandbox.images import ImageStore


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
