"""``vmsandbox gpus`` on the fake HGX host, with the fake Fabric Manager's partitions, against
the real libvirtd (which says which GPUs domains hold)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from framework.fabric import FAKE_FMPM, fmpm
from framework.fake_hosts import umockdev_run
from framework.sandboxes import cli_env

from vmsandbox.config import Config


def test_gpus_cli_on_the_fake_hgx_host(fm: Path, tmp_path: Path, config: Config) -> None:
    cfg = tmp_path / "fabricmanager.cfg"
    cfg.write_text("FABRIC_MODE=1\n")
    fmpm().activate(2)
    env_extra = {
        "VMSANDBOX_FMPM": str(FAKE_FMPM),
        "VMSANDBOX_FABRIC_MANAGER_CONFIG": str(cfg),
        "FAKE_FMPM_STATE": str(fm),
    }
    with umockdev_run("hgx_h100") as (prefix, umockdev_env):
        testbed = {k: v for k, v in umockdev_env.items() if k == "TMPDIR"}
        env = cli_env(config, **testbed, **env_extra)
        run = [*prefix, sys.executable, "-m", "vmsandbox.cli", "gpus"]
        as_json = subprocess.run([*run, "--json"], capture_output=True, text=True, env=env)
        as_text = subprocess.run(run, capture_output=True, text=True, env=env)
    assert as_json.returncode == 0, as_json.stderr
    data = json.loads(as_json.stdout)
    assert len(data["gpus"]) == 8 and len(data["fabric"]) == 4
    fabric = data["nvswitch_fabric"]
    assert fabric["mode"] == "shared-nvswitch" and len(fabric["nvswitches"]) == 4
    assert [p["id"] for p in fabric["partitions"] if p["active"]] == [2]
    assert fabric["partitions"][2]["state"] == "active, no domain"
    assert fabric["partitions"][3]["state"] == "free"
    assert as_text.returncode == 0, as_text.stderr
    assert "Fabric Manager partitions:" in as_text.stdout
    assert "fabric: shared-nvswitch" in as_text.stdout
