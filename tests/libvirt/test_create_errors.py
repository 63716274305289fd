"""Bad create requests: each gives its error code, from the API and the CLI, and leaves nothing
(the requests fail before any guest boots)."""

from __future__ import annotations

import json

import pytest
from framework.sandboxes import cli, leftovers

from vmsandbox.config import Config
from vmsandbox.errors import InvalidArgument, NotFound
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.sandbox.spec import SandboxSpec


def test_unknown_image_is_not_found_and_leaves_nothing(manager: SandboxManager, config: Config):
    with pytest.raises(NotFound, match="image 'no-such-image' is not built"):
        manager.create(SandboxSpec(name="t-unknown-image", image="no-such-image"))
    assert leftovers(config, "t-unknown-image") == []


@pytest.mark.parametrize(
    "name", ["Upper", "-dash", "dash-", "a_b", "a" * 49, "a'/><devices>", "../../etc", "", "a b"]
)
def test_bad_names_are_invalid_argument(name: str):
    with pytest.raises(InvalidArgument) as caught:
        SandboxSpec(name=name)
    assert caught.value.details["field"] == "name"


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (SandboxSpec(name="t-cap", cpus=9), "cpus"),
        (SandboxSpec(name="t-cap", memory_mib=65537), "memory_mib"),
        (SandboxSpec(name="t-cap", disk_gib=257), "disk_gib"),
    ],
)
def test_over_cap_requests_are_rejected(
    manager: SandboxManager, config: Config, spec: SandboxSpec, field: str
):
    with pytest.raises(InvalidArgument) as caught:
        manager.create(spec)
    assert caught.value.details["field"] == field
    assert "cap" in caught.value.message
    assert leftovers(config, "t-cap") == []


def test_cli_errors_are_one_line_with_code_and_exit_status(config: Config):
    done = cli("create", "Bad_Name", config=config)
    assert done.returncode == 2
    assert done.stderr.startswith("error: INVALID_ARGUMENT: name 'Bad_Name' is not valid")
    assert "Traceback" not in done.stderr


def test_cli_json_errors_are_objects(config: Config):
    done = cli("--json", "create", "t-x", "--image", "nope", config=config)
    assert done.returncode == 3
    error = json.loads(done.stdout)["error"]
    assert error["code"] == "NOT_FOUND"
    assert leftovers(config, "t-x") == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["create", "--memory", "lots"], "--memory 'lots' is not a size"),
        (["create", "--cpus", "0"], "--cpus '0' is not a whole number of at least 1"),
        (["create", "--disk", "1.5X"], "--disk '1.5X' is not a size"),
        # argparse would take a negative value for an option ("expected one argument")
        (["create", "--memory", "-1G"], "--memory '-1G' is not a size"),
        (["create", "--disk", "-5G"], "--disk '-5G' is not a size"),
        (["create", "--disk", "-5"], "--disk '-5' is not a size"),
        (["create", "--cpus", "-1"], "--cpus '-1' is not a whole number of at least 1"),
        (["create", "--timeout", "-3"], "--timeout '-3' is not a number of seconds above 0"),
        (["show", "NOPE"], "name 'NOPE' is not valid"),
        (["exec", "x"], "exec needs a command"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_cli_rejects_bad_arguments_without_traceback(config: Config, args, message):
    done = cli(*args, config=config)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(("field", "value"), [("--memory", "-1G"), ("--disk", "-5G")])
def test_cli_negative_sizes_name_the_field_and_value(config: Config, field: str, value: str):
    """The same error object as any other bad size: INVALID_ARGUMENT with field and value."""
    done = cli("--json", "create", field, value, config=config)
    assert done.returncode == 2, done.stderr
    error = json.loads(done.stdout)["error"]
    assert error["code"] == "INVALID_ARGUMENT"
    assert error["details"] == {"field": field, "value": value}


def test_destroy_of_a_missing_sandbox_is_not_found(manager: SandboxManager):
    with pytest.raises(NotFound):
        manager.destroy("t-never-existed")
