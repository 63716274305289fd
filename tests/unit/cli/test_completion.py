"""Shell completion: the scripts, and completions answered by the real command as the shell
asks for them (argcomplete's protocol), sandbox names silently empty without libvirt."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from framework.paths import REPO

from vmsandbox.cli.completion import sandbox_names, script


@pytest.mark.parametrize("shell", ["bash", "zsh"])
def test_the_script_completes_vmsandbox(shell: str) -> None:
    code = script(shell)
    assert "vmsandbox" in code and "_ARGCOMPLETE" in code


def complete(line: str, tmp_path: Path, **env: str) -> list[str]:
    """What ``vmsandbox`` answers when the shell asks to complete ``line``."""
    out = tmp_path / "completions"
    done = subprocess.run(
        [sys.executable, "-m", "vmsandbox.cli"],
        cwd=REPO,
        env={
            **os.environ,
            "_ARGCOMPLETE": "1",
            "_ARGCOMPLETE_SHELL": "bash",
            "COMP_LINE": line,
            "COMP_POINT": str(len(line)),
            "_ARGCOMPLETE_STDOUT_FILENAME": str(out),
            **env,
        },
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    return out.read_text().split("\v") if out.read_text() else []


def test_commands_and_options_complete(tmp_path: Path) -> None:
    assert {"cp", "create", "ssh-config", "forward", "logs", "reap"} <= set(
        complete("vmsandbox ", tmp_path)
    )
    assert "--ttl" in complete("vmsandbox create --t", tmp_path)


def test_sandbox_names_complete_to_nothing_without_a_word_of_error(tmp_path: Path) -> None:
    env = {
        "VMSANDBOX_URI": "qemu+unix:///system?socket=/nonexistent",
        "VMSANDBOX_CONFIG": "/nonexistent",
    }
    env["VMSANDBOX_STATE_DIR"] = str(tmp_path / "state")
    assert [word for word in complete("vmsandbox show ", tmp_path, **env) if word[:1] != "-"] == []


def test_names_come_from_the_state_directory_when_libvirt_cannot_be_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = tmp_path / "state"
    (state / "sandboxes" / "box-1").mkdir(parents=True)
    (state / "sandboxes" / "pool-1234").mkdir()
    (state / "sandboxes" / "box-1.console.log").write_text("")
    monkeypatch.setenv("VMSANDBOX_CONFIG", "/nonexistent")
    monkeypatch.setenv("VMSANDBOX_STATE_DIR", str(state))
    monkeypatch.setenv("VMSANDBOX_URI", "qemu+unix:///system?socket=/nonexistent")
    assert sandbox_names() == ["box-1"]
    assert sandbox_names("x") == []
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("VMSANDBOX_STATE_DIR", str(tmp_path / "a-file"))  # not a folder
    assert sandbox_names() == []
