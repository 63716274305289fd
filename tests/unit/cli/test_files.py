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


def test_the_progress_line_is_rewritten_in_place_once_a_copy_takes_a_while(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from vmsandbox.cli import files

    clock = iter([100.0, 100.1, 101.0, 101.1, 102.0])
    monkeypatch.setattr(files.time, "monotonic", lambda: next(clock))
    meter = files.Meter("big.bin -> box:/tmp/")  # started at 100.0
    meter(1, 4 * 2**20)  # 0.1 s in: nothing yet
    meter(2**20, 4 * 2**20)  # 1 s in
    meter(2 * 2**20, 4 * 2**20)  # 0.1 s after the last line: skipped
    meter(4 * 2**20, 4 * 2**20)
    meter.end()
    err = capsys.readouterr().err
    assert err.count("\r") == 2 and err.endswith("\n")
    assert "1.0 MiB of 4.0 MiB (25%)" in err and "4.0 MiB of 4.0 MiB (100%)" in err
