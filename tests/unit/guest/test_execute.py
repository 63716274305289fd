"""Command lines for exec: environment, folder and user, quoted so that a local ``sh`` (standing
in for the guest's shell) runs exactly what was asked."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vmsandbox.errors import InvalidArgument
from vmsandbox.guest.execute import command_line, parse_env

VALUES = st.text(
    st.characters(blacklist_characters="\0", blacklist_categories=("Cs",)), max_size=20
)


def sh(line: str) -> str:
    """What ``line`` prints, byte for byte (no newline translation)."""
    return subprocess.run(["sh", "-c", line], capture_output=True, check=True).stdout.decode()


@settings(max_examples=40, deadline=None)
@given(value=VALUES, word=VALUES)
def test_env_values_and_words_reach_the_command_as_given(value: str, word: str) -> None:
    shown = command_line(["sh", "-c", 'printf "%s|%s" "$X" "$1"', "sh", word], env={"X": value})
    assert sh(shown) == f"{value}|{word}"


def test_cwd_runs_there_and_a_missing_one_stops_before_the_command(tmp_path: Path) -> None:
    odd = tmp_path / "it's a dir"
    odd.mkdir()
    assert sh(command_line("pwd", cwd=str(odd))) == f"{odd}\n"
    done = subprocess.run(
        ["sh", "-c", command_line("echo ran", cwd=str(tmp_path / "none"))],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 1 and "ran" not in done.stdout


def test_another_user_goes_through_sudo_with_everything_inside() -> None:
    line = command_line(["id", "-u"], env={"A": "1"}, cwd="/tmp", user="root")
    assert line.startswith("sudo -n -H -u root -- sh -c ")
    assert "cd -- /tmp" in line and "export A=1" in line


@pytest.mark.parametrize("user", ["", "Root", "root;id", "a b", "x" * 40])
def test_a_user_name_that_is_not_one_is_refused(user: str) -> None:
    with pytest.raises(InvalidArgument, match="user"):
        command_line(["true"], user=user)


def test_env_words_are_checked() -> None:
    assert parse_env(["A=1", "B=x=y", "A=2", "EMPTY="]) == {"A": "2", "B": "x=y", "EMPTY": ""}
    for bad in (["NOEQUALS"], ["1A=x"], ["A-B=x"], ["=x"], ["A B=x"]):
        with pytest.raises(InvalidArgument, match="env") as caught:
            parse_env(bad)
        assert caught.value.details["field"] in ("env", "--env")
    with pytest.raises(InvalidArgument, match="NUL"):
        command_line(["true"], env={"A": "x\0y"})
