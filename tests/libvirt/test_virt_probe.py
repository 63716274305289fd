"""The KVM probe of ``virt_type = auto`` (vmsandbox/vm/virt.py) never leaves a QEMU behind, and two
creates that start at once on a fresh host run it once.

A create that must probe: a fresh state directory, ``VMSANDBOX_VIRT_TYPE=auto``, no cached
answer. On these machines the real KVM hangs, so the real QEMU probe runs until its deadline;
the stand-in QEMU (``VMSANDBOX_PROBE_QEMU``) sleeps and ignores SIGTERM, so only the SIGKILL
that follows can end it.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from framework.processes import Proc, processes, wait_for, wait_until_gone
from framework.sandboxes import cli_env, leftovers

from vmsandbox.config import Config
from vmsandbox.sandbox.spec import generate_name
from vmsandbox.vm import virt

SLEEPER = """#!/bin/sh
# A QEMU whose KVM guest hangs: prints nothing, ignores SIGTERM, never exits by itself.
echo "$$" >> {log}
trap '' TERM
exec sleep 3600
"""
GATED = """#!/bin/sh
# A QEMU whose KVM guest prints nothing and exits once the test opens the gate.
echo "$$" >> {log}
while [ ! -e {gate} ]; do sleep 0.05; done
"""


@pytest.fixture
def fresh(config: Config) -> Iterator[Config]:
    """A state directory with no cached probe answer, and ``virt_type = auto``."""
    root = Path(tempfile.mkdtemp(prefix="vmsbx-probe-", dir="/var/tmp"))
    os.chmod(root, 0o711)
    yield replace(config, state_dir=root, virt_type="auto")
    shutil.rmtree(root, ignore_errors=True)


def stand_in(folder: Path, script: str, **paths: Path) -> Path:
    """An executable named like QEMU that runs ``script`` (its ``{log}`` counts its starts)."""
    qemu = folder / "qemu-system-x86_64"
    qemu.write_text(script.format(log=folder / "starts.log", **paths))
    qemu.chmod(0o755)
    return qemu


def starts(folder: Path) -> list[str]:
    log = folder / "starts.log"
    return log.read_text().split() if log.exists() else []


def start_create(config: Config, qemu: str, *args: str) -> subprocess.Popen[bytes]:
    """``vmsandbox create`` in a session of its own (the session id finds all it started)."""
    return subprocess.Popen(
        [sys.executable, "-m", "vmsandbox.cli", "create", *args, "--memory", "256"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=cli_env(config, VMSANDBOX_PROBE_QEMU=qemu),
        start_new_session=True,
    )


def session_of(proc: subprocess.Popen[bytes]) -> list[Proc]:
    return [p for p in processes() if p.session == proc.pid and p.pid != proc.pid]


def read_until(proc: subprocess.Popen[bytes], marker: str, limit: float = 120.0) -> str:
    """``proc``'s stderr up to ``marker``; fails with what it said when it never comes."""
    assert proc.stderr is not None
    seen = b""
    deadline = time.monotonic() + limit
    while marker.encode() not in seen:
        ready, _, _ = select.select([proc.stderr], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(proc.stderr.fileno(), 65536) if ready else b""
        if not chunk:
            raise AssertionError(f"no {marker!r} from the create; it said:\n{seen.decode()}")
        seen += chunk
    return seen.decode()


def kill_session(proc: subprocess.Popen[bytes]) -> None:
    """Cleanup after a failed test: SIGKILL whatever of ``proc``'s session still runs."""
    for left in [*session_of(proc), proc]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(left.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    if proc.stderr is not None:
        proc.stderr.close()


@pytest.mark.parametrize("qemu", ["real", "stand-in"])
def test_a_create_killed_during_the_probe_leaves_no_process(
    fresh: Config, tmp_path: Path, qemu: str
) -> None:
    """SIGKILL to the create alone (not its group, as a supervisor or the OOM killer would):
    within the probe's limit nothing it started is left, and it made nothing on the host."""
    binary = virt.QEMU if qemu == "real" else str(stand_in(tmp_path, SLEEPER))
    name = generate_name("t")
    proc = start_create(fresh, binary, name)
    try:
        read_until(proc, "probing whether KVM runs guests")
        if qemu == "real":
            assert wait_for(lambda: any(p.argv[0] == binary for p in session_of(proc))), (
                "the probe's QEMU never started"
            )
        else:
            assert wait_for(lambda: bool(starts(tmp_path))), "the stand-in QEMU never started"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        left = wait_until_gone(lambda: session_of(proc), virt.PROBE_LIMIT)
        assert not left, "\n".join(p.describe() for p in left)
        assert leftovers(fresh, name) == []
        assert virt.cached(cache=fresh.state_dir / "virt-probe.json", qemu=binary) is None
    finally:
        kill_session(proc)


def test_two_creates_at_once_on_a_fresh_host_run_one_probe(fresh: Config, tmp_path: Path) -> None:
    """Both creates are past their look at the cache before the first probe ends; the second
    waits for the probe lock, finds the answer and runs no QEMU of its own."""
    gate = tmp_path / "gate"
    qemu = str(stand_in(tmp_path, GATED, gate=gate))
    # A GPU no host has: each create fails cleanly right after choosing its virt type.
    args = ("--gpu", "--gpu-model", "NoSuchGpu")
    first = start_create(fresh, qemu, generate_name("t"), *args)
    second = None
    try:
        read_until(first, "probing whether KVM runs guests")
        assert wait_for(lambda: bool(starts(tmp_path))), "the first create's probe never started"
        second = start_create(fresh, qemu, generate_name("t"), *args)
        read_until(second, "probing whether KVM runs guests")
        gate.touch()
        for proc in (first, second):
            _out, err = proc.communicate(timeout=120)
            assert proc.returncode == 5, err.decode()
            assert "this host can never give 1 GPU" in err.decode()
        assert len(starts(tmp_path)) == 1
        cache = json.loads((fresh.state_dir / "virt-probe.json").read_text())
        assert cache["kvm"] is False
    finally:
        gate.touch()
        for proc in (first, second):
            if proc is not None:
                kill_session(proc)


def test_the_cached_answer_outlives_a_change_of_dev_kvm_attributes(tmp_path: Path) -> None:
    """libvirt changes /dev/kvm's attributes (its change time) when it starts a domain; the
    cached answer must still hold then, or every create would probe again."""
    cache = tmp_path / "virt-probe.json"
    cache.write_text(json.dumps({"host": virt.host_key(), "kvm": True}))
    if os.path.exists("/dev/kvm"):
        mode = os.stat("/dev/kvm").st_mode
        os.chmod("/dev/kvm", mode)  # the same mode: only the change time moves
    assert virt.cached(cache=cache) == "kvm"
    other_boot = virt.host_key().replace(virt.BOOT_ID.read_text().strip(), "another-boot")
    cache.write_text(json.dumps({"host": other_boot, "kvm": True}))
    assert virt.cached(cache=cache) is None  # a reboot asks again
