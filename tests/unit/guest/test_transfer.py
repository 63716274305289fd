"""The pure rules of a copy: which links stay inside the folder copied, which names no file can
have, and where a guest path leads."""

from __future__ import annotations

import pytest

from vmsandbox.guest.transfer import TransferSummary, bad_name, guest_path, link_inside


@pytest.mark.parametrize(
    ("target", "folder", "inside"),
    [
        ("f", "", True),
        ("sub/f", "", True),
        ("../f", "sub", True),
        ("../../f", "a/b", True),
        ("./x/../y", "", True),
        ("..", "", False),
        ("../f", "", False),
        ("../../f", "sub", False),
        ("a/../../f", "", False),
        ("/etc/passwd", "", False),
        ("", "", False),
    ],
)
def test_a_link_stays_inside_only_when_its_target_does(target: str, folder: str, inside: bool):
    assert link_inside(target, folder) is inside


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "/", "a\0b"])
def test_names_no_entry_can_have(name: str) -> None:
    assert bad_name(name)


@pytest.mark.parametrize("name", ["..a", "a..", "with space", "new\nline", "it's", "-x", "ünï"])
def test_odd_names_are_names(name: str) -> None:
    assert not bad_name(name)


def test_guest_paths_start_from_the_home_folder() -> None:
    home = "/home/sandbox"
    assert guest_path("", home) == home and guest_path("~", home) == home
    assert guest_path("~/x", home) == "/home/sandbox/x"
    assert guest_path("x/y", home) == "/home/sandbox/x/y"
    assert guest_path("/tmp/x", home) == "/tmp/x"


def test_the_summary_shows_bytes_per_second() -> None:
    summary = TransferSummary("a", "b", files=1, bytes=2000, seconds=2.0)
    summary.skip("c", "why")
    data = summary.to_dict()
    assert data["bytes_per_second"] == 1000 and data["skipped"] == [{"path": "c", "reason": "why"}]
