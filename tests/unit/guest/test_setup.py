"""First-boot guest setup in the seed: environment files, secret files with their mode, the
main-process unit, and refusal of values no environment file can carry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from framework.seeds import read_iso

from vmsandbox.errors import InvalidArgument
from vmsandbox.guest.keys import generate
from vmsandbox.guest.seed import network_config, write_seed
from vmsandbox.guest.setup import ENVIRONMENT_FILE, MAIN_UNIT, GuestFile, GuestSetup, exec_line


def _files(config: dict) -> dict[str, dict]:
    return {item["path"]: item for item in config["write_files"]}


def test_environment_goes_to_pam_and_systemd_files():
    setup = GuestSetup(environment={"A": 'x "y" \\z', "B": "$HOME"})
    files = _files(setup.cloud_config("sandbox"))
    assert files["/etc/environment"] == {
        "path": "/etc/environment",
        "content": 'A=x "y" \\z\nB=$HOME\n',
        "append": True,
    }
    assert files[ENVIRONMENT_FILE]["content"] == 'A="x \\"y\\" \\\\z"\nB="$HOME"\n'
    assert "runcmd" not in setup.cloud_config("sandbox")


def test_main_command_gets_a_unit_started_at_first_boot():
    setup = GuestSetup(main=("python3", "-c", "print('50%')"))
    config = setup.cloud_config("sandbox")
    unit = _files(config)[f"/etc/systemd/system/{MAIN_UNIT}"]["content"]
    assert "User=sandbox\n" in unit
    assert f"EnvironmentFile={ENVIRONMENT_FILE}\n" in unit
    assert "ExecStart=python3 -c 'print('\"'\"'50%%'\"'\"')'\n" in unit
    assert config["runcmd"][-1] == ["systemctl", "start", "--no-block", MAIN_UNIT]


def test_units_without_autostart_are_installed_for_the_caller_to_start():
    setup = GuestSetup(main=("true",), units={"extra.service": "[Service]\n"}, autostart=False)
    config = setup.cloud_config("sandbox")
    files = _files(config)
    assert {f"/etc/systemd/system/{MAIN_UNIT}", "/etc/systemd/system/extra.service"} <= set(files)
    assert config["runcmd"] == [["systemctl", "daemon-reload"]]


@pytest.mark.parametrize(
    ("environment", "field"),
    [
        ({"1A": "x"}, "environment"),
        ({"A": "two\nlines"}, "environment.A"),
        ({"A": "\0"}, "environment.A"),
    ],
)
def test_bad_environment_names_the_field(environment: dict[str, str], field: str):
    with pytest.raises(InvalidArgument) as caught:
        GuestSetup(environment=environment)
    assert caught.value.details["field"] == field


def test_bad_files_and_units_are_refused():
    with pytest.raises(InvalidArgument, match="must be absolute"):
        GuestFile("etc/x", "")
    with pytest.raises(InvalidArgument, match="four octal digits"):
        GuestFile("/etc/x", "", mode="600")
    with pytest.raises(InvalidArgument, match=r"NAME\.service"):
        GuestSetup(units={MAIN_UNIT: ""})


def test_secret_file_travels_only_in_the_0600_seed(tmp_path: Path):
    secret = "eyJhbGciOi.secret.token"
    setup = GuestSetup(files=(GuestFile("/etc/openshell/token", secret, mode="0600"),))
    iso = tmp_path / "seed.iso"
    write_seed(
        iso,
        instance_id="iid",
        hostname="box",
        user="sandbox",
        client=generate("c"),
        host=generate("h"),
        network=network_config("52:54:00:00:00:01", user_net=True),
        guest=setup,
        workdir=tmp_path,
    )
    assert iso.stat().st_mode & 0o777 == 0o600
    user_data = json.loads(read_iso(iso, "user-data").split("\n", 1)[1])
    token = _files(user_data)["/etc/openshell/token"]
    assert (token["content"], token["permissions"], token["owner"]) == (secret, "0600", "root:root")
    assert [p.name for p in tmp_path.iterdir()] == ["seed.iso"]


@pytest.mark.parametrize("word", ["true\nUser=root", "a\rb", "x\x00y"])
def test_a_main_command_word_with_a_line_break_is_refused(word: str):
    """A unit file is read line by line: a line break in ExecStart's words would add
    directives of the caller's choosing."""
    with pytest.raises(InvalidArgument, match="command"):
        GuestSetup(main=("sh", "-c", word))
    with pytest.raises(InvalidArgument, match="command"):
        exec_line(["sh", "-c", word])
