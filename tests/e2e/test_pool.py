"""The warm pool on the real libvirtd with real guests: fill, claim (the guest becomes the
sandbox: name, hostname, record, keys of its own), stop/start of a claimed sandbox, the
background refill (whose guests cannot be stopped as sandboxes), a spec the pool does not
match, two concurrent creates, kill -9 during a refill and during a claim, drain.

Every pooled guest costs a TCG boot (40-120 s here), so the tests share one state directory and
run in order: four boots in all. The CLI runs as separate processes, as an operator runs it,
with a config file holding ``[pool] minimal = 1`` (the default shape of ``create``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import libvirt
import pytest
from framework.crash import CRASH_CLI, kill9, wait_for_output
from framework.sandboxes import cli_env, make_config

from vmsandbox.config import Config

NO_REFILL = ("--no-refill", "--json")


@pytest.fixture(scope="module")
def pool_config() -> Iterator[Config]:
    """A state directory of this module's own with a pool of one default-shape minimal guest;
    at the end every domain made there is removed, whatever a failed test left."""
    root = Path(tempfile.mkdtemp(prefix="vmsbx-pool-", dir="/var/tmp"))
    os.chmod(root, 0o711)
    (root / "config.toml").write_text("[pool]\nminimal = 1\n")
    config = make_config(root / "state", pool={"minimal": 1})
    yield config
    run("pool", "drain", config=config)
    conn = libvirt.open(config.uri)
    try:
        for dom in conn.listAllDomains(0):
            if str(config.state_dir) in dom.XMLDesc(0):
                if dom.isActive():
                    dom.destroy()
                dom.undefine()
    finally:
        conn.close()
    shutil.rmtree(root, ignore_errors=True)


def env(config: Config) -> dict[str, str]:
    return cli_env(config, VMSANDBOX_CONFIG=str(config.state_dir.parent / "config.toml"))


def run(*args: str, config: Config) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "vmsandbox.cli", *args],
        capture_output=True,
        text=True,
        env=env(config),
        timeout=900,
    )


def ok(*args: str, config: Config) -> dict:
    done = run(*args, "--json", config=config)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def ready_guests(config: Config) -> list[str]:
    (shape,) = ok("pool", config=config)["pool"]
    return [g["name"] for g in shape["guests"] if g["state"] == "pooled"]


def ours(config: Config) -> list[str]:
    """Every domain and file this module's state directory still has."""
    conn = libvirt.open(config.uri)
    try:
        domains = [
            d.name() for d in conn.listAllDomains(0) if str(config.state_dir) in d.XMLDesc(0)
        ]
    finally:
        conn.close()
    files = [p.name for d in (config.disks, config.sandboxes) if d.is_dir() for p in d.iterdir()]
    return sorted(domains) + sorted(files)


def keys_of(config: Config, guest: str) -> tuple[str, str]:
    """The client public key and the pinned host key of a pooled guest."""
    folder = config.sandboxes / guest
    client = next(folder.glob("*.pub")).read_text()
    return client, (folder / "known_hosts").read_text().split(" ", 1)[1]


def test_fill_then_a_create_claims_the_guest_and_a_refill_follows(pool_config: Config) -> None:
    config = pool_config
    assert ok("pool", "fill", config=config)["made"]
    (first,) = ready_guests(config)
    first_keys = keys_of(config, first)
    # the minimal image serves the control channel: the claim sets the hostname through it
    assert (config.sandboxes / first / "control.sock").is_socket()

    sandbox = ok("create", "x", config=config)
    assert sandbox["name"] == "x" and sandbox["state"] == "ready"
    assert sandbox["domain"] == f"vmsbx-{first}"  # the guest became the sandbox
    assert sandbox["known_hosts"].startswith(str(config.sandboxes / first))
    hostname = run(
        "exec", "x", "--", "sh", "-c", "hostname; grep 127.0.1.1 /etc/hosts", config=config
    )
    assert (hostname.returncode, hostname.stdout.split()) == (0, ["x", "127.0.1.1", "x"]), (
        hostname.stderr
    )
    listed = [s["name"] for s in ok("list", config=config)["sandboxes"]]  # all state dirs'
    assert "x" in listed and not [name for name in listed if name.startswith("pool-")]
    conn = libvirt.open(config.uri)
    try:
        title = conn.lookupByName(f"vmsbx-{first}").metadata(
            libvirt.VIR_DOMAIN_METADATA_TITLE, None
        )
    finally:
        conn.close()
    assert title == "x"

    # stop/start (sandbox/power.py) find the claimed sandbox by its record and act on its guest's
    # domain
    assert ok("stop", "x", "--grace", "30", config=config)["state"] == "stopped"
    started = ok("start", "x", config=config)
    assert (started["state"], started["domain"]) == ("ready", f"vmsbx-{first}")
    hostname = run("exec", "x", "--", "hostname", config=config)
    assert (hostname.returncode, hostname.stdout.strip()) == (0, "x"), hostname.stderr

    ok("pool", "fill", config=config)  # waits for the refill the create started
    (second,) = ready_guests(config)
    assert second != first
    assert set(keys_of(config, second)).isdisjoint(first_keys)  # keys of its own
    refused = run("stop", second, config=config)  # the pool's guest, not a sandbox
    assert refused.returncode == 5, refused.stderr
    assert f"FAILED_PRECONDITION: '{second}' is a guest of the warm pool" in refused.stderr

    ok("destroy", "x", config=config)
    assert [name for name in ours(config) if first in name] == []


def test_a_spec_the_pool_does_not_match_boots_cold(pool_config: Config) -> None:
    config = pool_config
    guests = ready_guests(config)
    sandbox = ok("create", "w", "--memory", "768", "--no-wait", config=config)
    assert sandbox["domain"] == "vmsbx-w"
    assert ready_guests(config) == guests
    ok("destroy", "w", config=config)


def test_two_concurrent_creates_never_claim_the_same_guest(pool_config: Config) -> None:
    config = pool_config
    (guest,) = ready_guests(config)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "vmsandbox.cli", "create", name, "--no-wait", *NO_REFILL],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env(config),
        )
        for name in ("y", "z")
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, out + err
        results.append(json.loads(out))
    domains = sorted(r["domain"] for r in results)
    claimed = [d for d in domains if d == f"vmsbx-{guest}"]
    assert len(claimed) == 1 and len(set(domains)) == 2
    assert ready_guests(config) == []
    ok("destroy", "y", "z", config=config)
    assert ours(config) == []


def crash(config: Config, stage: str, *args: str) -> subprocess.Popen[bytes]:
    """``vmsandbox ARGS`` stopped at checkpoint ``stage`` (tests/framework/crash_cli.py), to be
    killed."""
    proc = subprocess.Popen(
        [sys.executable, str(CRASH_CLI), stage, *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env(config),
        start_new_session=True,
    )
    try:
        wait_for_output(proc, f"vmsandbox-checkpoint {stage}", timeout=300)
    except BaseException:
        kill9(proc)
        raise
    return proc


def test_kill_9_during_a_refill_then_reconcile_leaves_nothing(pool_config: Config) -> None:
    config = pool_config
    kill9(crash(config, "start", "pool", "fill"))
    assert ours(config) != []  # the killed fill left a booting guest
    report = ok("reconcile", config=config)
    assert len(report["removed"]) == 1 and report["problems"] == []
    assert ours(config) == []


def test_kill_9_during_a_claim_then_reconcile_leaves_nothing(pool_config: Config) -> None:
    config = pool_config
    ok("pool", "fill", config=config)
    kill9(crash(config, "claim", "create", "q", "--no-refill"))
    report = ok("reconcile", config=config)
    assert report == {"removed": ["q"], "problems": [], "fabric_partitions": []}  # guest gone
    assert ours(config) == []


def test_drain_removes_the_pooled_guests(pool_config: Config) -> None:
    config = pool_config
    ok("pool", "fill", config=config)
    (guest,) = ready_guests(config)
    assert ok("pool", "drain", config=config) == {"removed": [guest]}
    assert ours(config) == [] and ready_guests(config) == []
