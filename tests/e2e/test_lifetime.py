"""A lifetime on the real libvirtd: a sandbox created with a short ttl shows its time left,
takes an extension, and is destroyed by ``vmsandbox reap`` once it has passed; one without a
ttl is left alone."""

from __future__ import annotations

import json
import time

from framework.sandboxes import cli, leftovers

from vmsandbox.config import Config
from vmsandbox.sandbox.handle import Sandbox
from vmsandbox.sandbox.spec import generate_name


def test_a_short_lived_sandbox_is_reaped_and_the_others_are_not(
    config: Config, booted: Sandbox
) -> None:
    name = generate_name("ttl")
    done = cli("create", name, "--ttl", "20s", "--no-wait", "--json", config=config)
    try:
        assert done.returncode == 0, done.stderr
        created = json.loads(done.stdout)
        assert 0 < created["expires_in_seconds"] <= 20
        done = cli("extend", name, "5s", "--json", config=config)
        assert done.returncode == 0, done.stderr
        extended = json.loads(done.stdout)
        assert extended["expires_at"] > created["expires_at"]
        listed = cli("list", config=config).stdout.splitlines()
        row = next(line for line in listed if line.startswith(name)).split()
        assert row[listed[0].split().index("EXPIRES")].endswith("s")  # seconds left
        done = cli("reap", "--json", config=config)
        assert json.loads(done.stdout)["destroyed"] == []  # not yet
        time.sleep(max(0.0, extended["expires_in_seconds"]) + 2)
        done = cli("reap", "--json", config=config)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == {"destroyed": [name], "failed": {}}
        assert leftovers(config, name) == []
        shown = cli("show", booted.name, "--json", config=config)
        assert json.loads(shown.stdout)["expires_at"] is None  # no ttl: never reaped
    finally:
        cli("destroy", name, config=config)


def test_a_ttl_that_is_no_duration_is_refused_before_anything_is_made(config: Config) -> None:
    for ttl in ("0", "-5m", "soon", "400d"):
        done = cli("create", "never", "--ttl", ttl, config=config)
        assert done.returncode == 2 and "--ttl" in done.stderr, ttl
    assert leftovers(config, "never") == []
