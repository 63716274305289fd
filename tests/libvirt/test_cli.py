"""The CLI's own rules, run as a separate process against the real libvirtd: --json anywhere,
which commands repair, destroy's report of a partial failure."""

from __future__ import annotations

import json

import pytest
from framework.sandboxes import cli

from vmsandbox.config import Config
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.sandbox.record import SandboxFiles
from vmsandbox.sandbox.spec import generate_name


def half_made(config: Config) -> tuple[str, SandboxFiles]:
    """A sandbox name with files and no domain: what a create killed early leaves."""
    name = generate_name("t")
    paths = SandboxFiles.of(config, name)
    paths.overlay.parent.mkdir(parents=True, exist_ok=True)
    paths.overlay.write_text("half")
    paths.keys_dir.mkdir(parents=True)
    return name, paths


@pytest.mark.parametrize(
    "args",
    [("--json", "images", "list"), ("images", "--json", "list"), ("images", "list", "--json")],
)
def test_json_is_accepted_before_or_after_the_command(config: Config, args: tuple[str, ...]):
    done = cli(*args, config=config)
    assert done.returncode == 0, done.stderr
    assert "images" in json.loads(done.stdout)


@pytest.mark.parametrize("where", ["before", "after"])
def test_json_errors_wherever_json_is_written(config: Config, where: str):
    args = ("--json", "show", "Bad_Name") if where == "before" else ("show", "Bad_Name", "--json")
    done = cli(*args, config=config)
    assert done.returncode == 2
    assert json.loads(done.stdout)["error"]["code"] == "INVALID_ARGUMENT"


def test_only_create_and_reconcile_repair(manager: SandboxManager, config: Config):
    """list, show, gpus, verify and images never delete a half-made sandbox's files (they used
    to run reconcile on opening); reconcile does."""
    name, paths = half_made(config)
    for args in (("list",), ("show", name), ("verify", name), ("gpus",), ("images", "list")):
        cli(*args, "--json", config=config)
        assert paths.existing() == [paths.overlay, paths.keys_dir], args
    done = cli("reconcile", "--json", config=config)
    assert name in json.loads(done.stdout)["removed"]
    assert paths.existing() == []


def test_destroy_json_reports_what_was_done_before_a_failure(
    manager: SandboxManager, config: Config
):
    first, first_paths = half_made(config)
    last, last_paths = half_made(config)
    missing = generate_name("t")
    try:
        done = cli("destroy", first, missing, last, "--json", config=config)
        assert done.returncode == 3, done.stderr
        report = json.loads(done.stdout)
        assert report["destroyed"] == [first]
        assert report["failed"] == missing
        assert report["not_tried"] == [last]
        assert report["error"]["code"] == "NOT_FOUND"
        assert first_paths.existing() == []
        assert last_paths.existing() != []
        text = cli("destroy", last, missing, config=config)
        assert text.stdout == f"destroyed {last}\n"
        assert text.stderr.startswith("error: NOT_FOUND: ")
    finally:
        last_paths.remove()
