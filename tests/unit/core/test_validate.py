"""Durations (``create --ttl``, ``extend``): what is one, and how a bad one is refused."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vmsandbox.errors import InvalidArgument
from vmsandbox.validate import DURATION_MAX_S, format_duration, parse_duration


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90", 90),
        ("90s", 90),
        ("30m", 1800),
        ("2h", 7200),
        ("1d", 86400),
        ("1h30m", 5400),
        ("1.5h", 5400),
        (" 2H ", 7200),
        ("0.2", 1),
        ("366d", DURATION_MAX_S),
    ],
)
def test_durations_in_seconds_and_units(text: str, seconds: int) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    "text", ["", "0", "0s", "-5", "-1h", "abc", "1x", "h", "5e3", "1h-", "367d", "nan", "inf", "½h"]
)
def test_anything_else_is_invalid_naming_field_value_and_what_is_allowed(text: str) -> None:
    with pytest.raises(InvalidArgument, match="--ttl") as caught:
        parse_duration(text, "--ttl")
    assert caught.value.details["field"] == "--ttl"
    assert caught.value.details["value"] == repr(text)
    assert "30m" in caught.value.message and "366d" in caught.value.message


@given(st.integers(min_value=1, max_value=DURATION_MAX_S))
def test_a_duration_shown_reads_back_within_a_minute(seconds: int) -> None:
    shown = format_duration(seconds)
    assert abs(parse_duration(shown) - seconds) < 3600 if "d" in shown else 60


@given(st.text(max_size=12))
def test_any_text_is_a_duration_in_range_or_refused(text: str) -> None:
    try:
        seconds = parse_duration(text)
    except InvalidArgument:
        return
    assert 1 <= seconds <= DURATION_MAX_S
