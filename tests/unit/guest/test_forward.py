"""Forward specs: what ``vmsandbox forward`` and ``SandboxManager.forward`` accept."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vmsandbox.errors import InvalidArgument
from vmsandbox.guest.forward import ForwardSpec, parse_forward


@pytest.mark.parametrize(
    ("spec", "parsed"),
    [
        ("80", ForwardSpec("127.0.0.1", 80, 80)),
        ("8080:80", ForwardSpec("127.0.0.1", 8080, 80)),
        ("0:80", ForwardSpec("127.0.0.1", 0, 80)),
        ("0.0.0.0:8080:80", ForwardSpec("0.0.0.0", 8080, 80)),
        ("[::1]:8080:80", ForwardSpec("::1", 8080, 80)),
        ("localhost:9000:9000", ForwardSpec("localhost", 9000, 9000)),
    ],
)
def test_specs_listen_on_loopback_unless_an_address_is_given(
    spec: str, parsed: ForwardSpec
) -> None:
    assert parse_forward(spec) == parsed


@pytest.mark.parametrize(
    "spec",
    [
        "",
        "0",
        "65536",
        "-1",
        "80x",
        ":80",
        "8080:",
        "a:b:c:d",
        "host.example:1:2",
        "1.2.3:1:2",
        "[::1]:80",
    ],
)
def test_anything_else_is_refused_naming_the_spec_and_the_forms(spec: str) -> None:
    with pytest.raises(InvalidArgument, match="forward") as caught:
        parse_forward(spec)
    assert caught.value.details["field"] == "forward"


@given(st.text(max_size=30))
def test_a_spec_parses_to_valid_ports_or_is_refused(spec: str) -> None:
    try:
        parsed = parse_forward(spec)
    except InvalidArgument:
        return
    assert 0 <= parsed.local <= 65535 and 1 <= parsed.remote <= 65535
