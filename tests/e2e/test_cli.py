"""The CLI's rules that need a booted guest: guest commands passed on whole, dashes and all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from framework.sandboxes import cli, cli_env

from vmsandbox.config import Config
from vmsandbox.sandbox.handle import Sandbox


def test_exec_passes_a_guest_command_that_starts_with_dashes(config: Config, booted: Sandbox):
    """``exec NAME -- -- echo hi`` sends ``-- echo hi`` to the guest, whose shell refuses it
    (bash: "--: invalid option"), rather than running ``echo hi``: the CLI does not take a
    second ``--`` away."""
    done = cli("exec", booted.name, "--", "--", "echo", "hi", config=config)
    assert done.returncode != 0
    assert "hi" not in done.stdout
    assert done.stderr.startswith("bash: --: "), done.stderr
    done = cli("exec", booted.name, "--", "printf", "%s|", "--", "-x", config=config)
    assert (done.returncode, done.stdout) == (0, "--|-x|")


def test_ssh_passes_a_guest_command_that_starts_with_dashes(
    config: Config, booted: Sandbox, tmp_path: Path
):
    shim = tmp_path / "ssh"
    shim.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    shim.chmod(0o755)
    env = cli_env(config, PATH=f"{tmp_path}:{os.environ['PATH']}")
    done = subprocess.run(
        [sys.executable, "-m", "vmsandbox.cli", "ssh", booted.name, "--", "--", "ls"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)[-3:] == ["--", "--", "ls"]
