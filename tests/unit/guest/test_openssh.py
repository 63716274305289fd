"""OpenSSH's side: the options ``vmsandbox ssh`` passes on or refuses, and ssh_config stanzas."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vmsandbox.errors import InvalidArgument
from vmsandbox.guest.keys import SandboxKeys
from vmsandbox.guest.openssh import (
    HostEntry,
    check_options,
    quote_value,
    render_config,
    split_options,
    ssh_argv,
)
from vmsandbox.guest.ssh import Endpoint

KEYS = SandboxKeys(Path("/var/lib/vmsandbox/sandboxes/box"), "vmsbx-box")
ENDPOINT = Endpoint("127.0.0.1", 40022, "sandbox")


def test_options_come_before_the_command_and_keep_their_values() -> None:
    assert split_options(["-L", "8080:localhost:80", "-N", "uname", "-a"]) == (
        ["-L", "8080:localhost:80", "-N"],
        ["uname", "-a"],
    )
    assert split_options(["-NL8080:localhost:80", "-vv"]) == (["-NL8080:localhost:80", "-vv"], [])
    assert check_options(["-L", "8080:localhost:80", "-o", "ServerAliveInterval=5"]) == [
        "-L",
        "8080:localhost:80",
        "-o",
        "ServerAliveInterval=5",
    ]


@pytest.mark.parametrize(
    ("options", "says"),
    [
        (["-A"], "agent forwarding"),
        (["-NA"], "agent forwarding"),
        (["-o", "ForwardAgent=yes"], "agent forwarding"),
        (["-oforwardagent yes"], "agent forwarding"),
        (["-o", "StrictHostKeyChecking=no"], "pins each sandbox's host key"),
        (["-oUserKnownHostsFile=/dev/null"], "pins each sandbox's host key"),
        (["-o", "HostKeyAlias other"], "pins each sandbox's host key"),
        (["-L"], "needs a value"),
        (["-Z"], "not an option of ssh"),
        (["uname"], "not an OpenSSH option"),
    ],
)
def test_options_that_would_loosen_the_pinning_or_hand_over_the_agent_are_refused(
    options: list[str], says: str
) -> None:
    with pytest.raises(InvalidArgument, match=says):
        check_options(options)


def test_agent_forwarding_when_asked_for_explicitly() -> None:
    argv = ssh_argv(ENDPOINT, KEYS, ["true"], options=["-A"], forward_agent=True)
    assert "ForwardAgent=yes" in argv and "-A" in argv
    plain = ssh_argv(ENDPOINT, KEYS, ["true"])
    assert "ForwardAgent=no" in plain and plain[-2:] == ["--", "true"]


def test_the_pinning_comes_first_so_no_later_option_overrides_it() -> None:
    argv = ssh_argv(ENDPOINT, KEYS, options=["-o", "ServerAliveInterval=5"])
    pinned = argv.index("StrictHostKeyChecking=yes")
    assert pinned < argv.index("ServerAliveInterval=5")
    assert f"UserKnownHostsFile={KEYS.known_hosts}" in argv and "HostKeyAlias=vmsbx-box" in argv


def test_a_stanza_carries_everything_ssh_needs_to_pin() -> None:
    text = render_config([HostEntry("box", ENDPOINT, KEYS)])
    lines = [line.strip() for line in text.splitlines()]
    assert lines[:4] == ["Host box", "HostName 127.0.0.1", "Port 40022", "User sandbox"]
    for line in (
        f"IdentityFile {KEYS.client_key}",
        "IdentitiesOnly yes",
        f"UserKnownHostsFile {KEYS.known_hosts}",
        "HostKeyAlias vmsbx-box",
        "StrictHostKeyChecking yes",
        "ForwardAgent no",
    ):
        assert line in lines
    two = render_config([HostEntry("a", ENDPOINT, KEYS), HostEntry("b", ENDPOINT, KEYS)])
    assert two.count("\nHost ") == 1 and "\n\nHost b\n" in two


def test_paths_are_quoted_and_percent_signs_kept_from_token_expansion() -> None:
    assert quote_value("/state dir/keys", "IdentityFile") == '"/state dir/keys"'
    assert quote_value("/st%ate/k", "IdentityFile") == "/st%%ate/k"
    for bad in ('/a"b', "/a\nb"):
        with pytest.raises(InvalidArgument):
            quote_value(bad, "IdentityFile")


@given(st.lists(st.text(min_size=1), max_size=6))
def test_every_word_a_user_gives_is_checked_or_refused_never_dropped(words: list[str]) -> None:
    options, command = split_options(words)
    assert options + command == words
    try:
        checked = check_options(options)
    except InvalidArgument:
        return
    assert checked == options
