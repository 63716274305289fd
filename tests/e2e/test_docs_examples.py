"""The README's tour and usage.md's example block run as written on this host, so they cannot
drift from what the commands do again (issue 42: 23 of a new user's 88 steps disagreed).

Each line of the block runs in bash, one after the other, with ``vmsandbox`` being this
checkout's command on the test run's state directory. A line whose comment begins "GPU host"
needs GPUs: on a host with no GPU it is checked for the refusal the docs promise
(FAILED_PRECONDITION, exit 5, saying the host has no GPUs); on a GPU host it runs. Every other
line must exit 0. The sandbox names of the docs get a suffix of this run's own, so that no
other run's domain of the same name is touched; nothing else of a line is changed.

The blocks boot their own guest rather than the session's shared one: they stop, start and
destroy their sandbox, which the shared guest must outlive. A boot costs 10 to 40 s here.
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from framework.paths import REPO
from framework.sandboxes import cli, cli_env

from vmsandbox.config import Config

# The sandbox names the blocks use: a word on its own, not part of a flag (--gpu) or a model.
NAMES_RE = re.compile(r"(?<![-\w])(box\d?|big|gpu|h100)(?![-\w])")
GPU_MARK = "GPU host"


def sh_block(path: Path, after: str) -> list[tuple[str, str]]:
    """The lines of the first ``sh`` block after the line ``after``: (command, comment)."""
    text = path.read_text()
    start = text.index("```sh\n", text.index(after)) + len("```sh\n")
    block = text[start : text.index("```", start)]
    lines = []
    for line in block.splitlines():
        command, _, comment = line.partition(" #")
        if command.strip():
            lines.append((command.strip(), comment.strip()))
    return lines


@pytest.fixture(scope="module")
def host_has_gpus(config: Config) -> bool:
    done = cli("gpus", "--json", config=config)
    assert done.returncode == 0, done.stderr
    return any(gpu.get("bindable") for gpu in json.loads(done.stdout)["gpus"])


@pytest.fixture
def run_block(config: Config, host_has_gpus: bool) -> Iterator[object]:
    """Runs a block's lines as the docs show them; destroys what they made at the end."""
    suffix = secrets.token_hex(3)
    made: set[str] = set()
    env = cli_env(config, PYTHONPATH=str(REPO))
    function = f'vmsandbox() {{ {sys.executable} -m vmsandbox.cli "$@"; }}; '

    def run(lines: list[tuple[str, str]]) -> dict[str, subprocess.CompletedProcess[str]]:
        results = {}
        for command, comment in lines:
            ours = NAMES_RE.sub(lambda m: f"{m.group(1)}-{suffix}", command)
            made.update(f"{name}-{suffix}" for name in NAMES_RE.findall(command))
            done = subprocess.run(
                ["bash", "-c", function + ours],
                cwd=REPO,
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=900,
                check=False,
            )
            shown = f"`{command}` exited {done.returncode}:\n{done.stdout}{done.stderr}"
            if comment.startswith(GPU_MARK) and not host_has_gpus:
                assert done.returncode == 5, shown
                assert "error: FAILED_PRECONDITION: " in done.stderr, shown
                assert "no GPUs" in done.stderr, shown
            else:
                assert done.returncode == 0, shown
            results[command] = done
        return results

    yield run
    for name in made:
        with contextlib.suppress(subprocess.TimeoutExpired):
            cli("destroy", name, config=config, timeout=300)


def test_the_readme_tour_runs_as_written(run_block: object) -> None:
    lines = sh_block(REPO / "README.md", "## A five-minute tour")
    assert [c for c, _ in lines if c.startswith("vmsandbox create box")] == ["vmsandbox create box"]
    assert any(comment.startswith(GPU_MARK) for _, comment in lines)
    results = run_block(lines)  # type: ignore[operator]
    assert "state:     ready" in results["vmsandbox create box"].stdout
    assert results["vmsandbox create big --dry-run"].stdout.startswith("<domain")
    assert "verification: ok" in results["vmsandbox verify box"].stdout


def test_the_usage_examples_run_as_written(run_block: object) -> None:
    lines = sh_block(REPO / "docs" / "usage.md", "## Commands")
    assert len(lines) >= 15
    results = run_block(lines)  # type: ignore[operator]
    done = json.loads(results["vmsandbox exec box1 --json -- uname -r"].stdout)
    assert done["exit_status"] == 0 and done["stdout"].strip()
    shown = results["vmsandbox show box1"].stdout
    assert "state:     ready" in shown and "size:      2 vCPU, 4096 MiB, 20 GiB disk" in shown
    assert "<domain" in results["vmsandbox create box2 --dry-run"].stdout
