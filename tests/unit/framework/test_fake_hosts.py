"""The fake hosts: committed device files match their generator; the module entry point."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from types import ModuleType

import pytest
from framework.fake_hosts import HOSTS, umockdev_run


def load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_hosts", HOSTS / "make_hosts.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


GENERATOR = load_generator()


@pytest.mark.parametrize("name", sorted(GENERATOR.HOSTS))
def test_device_file_is_generated(name: str) -> None:
    """Edit make_hosts.py and rerun it, never the .umockdev files by hand."""
    host = GENERATOR.HOSTS[name]()
    assert (HOSTS / f"{name}.umockdev").read_text() == host.render()


def test_every_host_is_documented() -> None:
    readme = (HOSTS / "README.md").read_text()
    for name in GENERATOR.HOSTS:
        assert f"`{name}.umockdev`" in readme


def test_python_m_vmsandbox_host() -> None:
    with umockdev_run("mi300x") as (argv, env):
        as_json = subprocess.run(
            [*argv, sys.executable, "-m", "vmsandbox.host"],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )
        as_table = subprocess.run(
            [*argv, sys.executable, "-m", "vmsandbox.host", "--table", "--no-nvml"],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )
    inventory = json.loads(as_json.stdout)
    assert [gpu["bdf"] for gpu in inventory["gpus"]] == ["0000:03:00.0"]
    assert inventory["host"]["pci_devices"] == 10
    assert "0000:03:00.0  amd" in as_table.stdout
