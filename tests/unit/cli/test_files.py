"""``cp``'s locations: which side is a sandbox's."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vmsandbox.cli.files import parse_location, printable
from vmsandbox.errors import InvalidArgument


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("box:/tmp/x", ("box", "/tmp/x")),
        ("box:", ("box", "")),
        ("box:~/a b", ("box", "~/a b")),
        ("box:a:b", ("box", "a:b")),
        ("/tmp/a:b", (None, "/tmp/a:b")),
        ("./a:b", (None, "./a:b")),
        ("dir/a:b", (None, "dir/a:b")),
        ("plain", (None, "plain")),
        ("~/x:y", (None, "~/x:y")),
    ],
)
def test_a_colon_before_any_slash_names_a_sandbox(text: str, parsed: tuple[str | None, str]):
    assert parse_location(text, "source") == parsed


@pytest.mark.parametrize("text", ["", "Box:/x", "bad_name:/x", "-x:/y", "a b:/c"])
def test_a_location_that_is_neither_is_refused_naming_it(text: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        parse_location(text, "destination")
    assert caught.value.details["field"] == "destination"


@given(st.text())
def test_a_location_parses_or_is_refused_and_never_loses_its_path(text: str) -> None:
    try:
        name, path = parse_location(text, "source")
    except InvalidArgument:
        return
    assert (f"{name}:{path}" if name else path) == text


def test_file_names_are_shown_on_one_line() -> None:
    assert printable("a\nb\x1b[31m") == "a\\nb\\x1b[31m"
