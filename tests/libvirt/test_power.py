"""vmsandbox stop/start: a stopped sandbox keeps its GPUs (its inactive domain's hostdevs
still count as held), and a start libvirt refuses leaves it as it was. On the fake
HGX host against the real libvirtd, where every passthrough start is refused."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from framework.fake_hosts import umockdev_run
from framework.sandboxes import cli, cli_env, leftovers

from vmsandbox.config import Config

_DEFINE = textwrap.dedent(
    """
    import sys
    from vmsandbox.sandbox.manager import SandboxManager
    from vmsandbox.gpu.request import GpuRequest
    from vmsandbox.sandbox.spec import SandboxSpec
    with SandboxManager() as manager:
        manager.create(SandboxSpec(name=sys.argv[1], gpu=GpuRequest(count=1)), start=False)
    """
)


def _under_hgx(config: Config, *argv: str) -> subprocess.CompletedProcess[str]:
    with umockdev_run("hgx_h100") as (prefix, env):
        testbed = {k: v for k, v in env.items() if k == "TMPDIR"}
        return subprocess.run(
            [*prefix, sys.executable, *argv],
            capture_output=True,
            text=True,
            timeout=300,
            env=cli_env(config, **testbed),
            check=False,
        )


def test_a_stopped_sandbox_keeps_its_gpus_and_a_refused_start_changes_nothing(config: Config):
    name = "t-power-gpu"
    try:
        defined = _under_hgx(config, "-c", _DEFINE, name)
        assert defined.returncode == 0, defined.stderr
        started = _under_hgx(config, "-m", "vmsandbox.cli", "start", name)
        assert started.returncode == 5, started.stderr
        assert f"error: FAILED_PRECONDITION: starting sandbox '{name}': libvirt refused" in (
            started.stderr
        )
        shown = json.loads(cli("show", name, "--json", config=config).stdout)
        assert shown["state"] == "defined"  # as it was: defined, never started
        gpus = _under_hgx(config, "-m", "vmsandbox.cli", "gpus", "--json")
        held = [gpu["in_use_by"] for gpu in json.loads(gpus.stdout)["gpus"] if gpu["in_use_by"]]
        assert held == [f"vmsbx-{name}"]  # one GPU: this NVSwitch board gives 1 or all 8
        stopped = cli("stop", name, "--json", config=config)
        assert stopped.returncode == 0, stopped.stderr
        assert json.loads(stopped.stdout)["state"] == "defined"  # nothing ran: nothing to stop
    finally:
        cli("destroy", name, config=config)
    assert leftovers(config, name) == []


def test_stop_and_start_of_a_sandbox_that_does_not_exist(config: Config):
    for command in ("stop", "start"):
        done = cli(command, "t-power-none", config=config)
        assert done.returncode == 3
        assert done.stderr == "error: NOT_FOUND: sandbox 't-power-none' does not exist\n"
