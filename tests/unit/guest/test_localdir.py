"""A download's local side: nothing lands outside the destination, whatever links are there,
and a file appears only whole."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from vmsandbox.errors import FailedPrecondition, InvalidArgument, NotFound
from vmsandbox.guest.localdir import open_parent


def test_a_link_where_a_folder_goes_is_refused_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "sub").symlink_to(outside)
    parent, name = open_parent(dest, "ignored", contents=True)
    folder = parent.child_dir(name)
    with pytest.raises(FailedPrecondition, match="never writes through a link"):
        folder.child_dir("sub")
    folder.write_file("sub", [b"x"], 0o644, None)  # a file of that name replaces the link
    folder.close()
    assert (dest / "sub").read_bytes() == b"x" and not (dest / "sub").is_symlink()
    parent.close()
    assert list(outside.iterdir()) == []


def test_a_file_replaces_a_link_of_its_name_instead_of_writing_through_it(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "f").symlink_to(victim)
    parent, _ = open_parent(dest / "x", "x", contents=False)
    parent.write_file("f", [b"new"], 0o640, None)
    parent.close()
    assert victim.read_text() == "untouched"
    assert not (dest / "f").is_symlink() and (dest / "f").read_bytes() == b"new"
    assert oct((dest / "f").stat().st_mode & 0o777) == oct(0o640)


def test_a_failed_copy_leaves_no_file_behind(tmp_path: Path) -> None:
    def broken() -> Iterator[bytes]:
        yield b"half"
        raise OSError(5, "the connection broke")

    parent, _ = open_parent(tmp_path / "f", "f", contents=False)
    with pytest.raises(FailedPrecondition):
        parent.write_file("f", broken(), 0o644, None)
    parent.close()
    assert os.listdir(tmp_path) == []


def test_a_folders_mode_is_given_after_its_contents(tmp_path: Path) -> None:
    parent, name = open_parent(tmp_path / "ro", "ro", contents=False)
    folder = parent.child_dir(name)
    folder.write_file("inside", [b"x"], 0o444, 1_000_000.0)
    folder.finish(0o555, 1_000_000.0, 1_000_000.0)
    parent.close()
    assert (tmp_path / "ro" / "inside").stat().st_mtime == 1_000_000.0
    assert oct((tmp_path / "ro").stat().st_mode & 0o777) == oct(0o555)


def test_where_a_download_lands(tmp_path: Path) -> None:
    parent, name = open_parent(tmp_path, "guestname", contents=False)
    assert (parent.path, name) == (str(tmp_path), "guestname")
    parent.close()
    parent, name = open_parent(tmp_path / "new", "guestname", contents=False)
    assert (parent.path, name) == (str(tmp_path), "new")
    parent.close()
    with pytest.raises(NotFound, match="no such folder on this host"):
        open_parent(tmp_path / "none" / "x", "g", contents=False)
    with pytest.raises(NotFound):
        open_parent(f"{tmp_path}/none/", "g", contents=False)
    with pytest.raises(InvalidArgument):
        open_parent(Path("/"), "", contents=True)
