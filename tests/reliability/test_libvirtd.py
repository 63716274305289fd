"""libvirtd restarts: a running sandbox survives one (listed, reachable, destroyable), calls
made while libvirtd is down fail with UNAVAILABLE (API and CLI exit 7), and the same
SandboxManager works again once libvirtd is back.

The libvirtd restarted here is a private one of this test, in a mount namespace of its own
(its own /run/libvirt, /var/lib/libvirt, /etc/libvirt, ...) and reached through its socket,
so restarting it never disturbs the host's libvirtd or anyone else's guests. It is the same
libvirtd binary and configuration with real QEMU guests, only started by the test.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from framework.private_libvirtd import PrivateLibvirtd
from framework.sandboxes import cli, leftovers

from vmsandbox.config import Config
from vmsandbox.errors import Unavailable
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.sandbox.spec import SandboxSpec, generate_name


@pytest.fixture
def private_libvirtd() -> Iterator[PrivateLibvirtd]:
    base = Path(tempfile.mkdtemp(prefix="vmsbx-libvirtd-", dir="/var/tmp"))
    os.chmod(base, 0o711)  # QEMU runs as another user and must reach the disks under it
    daemon = PrivateLibvirtd(base)
    try:
        daemon.setup()
        yield daemon
    finally:
        daemon.teardown()


def test_a_sandbox_survives_a_libvirtd_restart(
    config: Config, private_libvirtd: PrivateLibvirtd
) -> None:
    # A state directory of its own: one state directory belongs to one libvirtd (reconcile on
    # the private one would take the session's sandboxes for files without a domain).
    cfg = replace(config, uri=private_libvirtd.uri, state_dir=private_libvirtd.base / "state")
    box, spare = generate_name("t"), generate_name("t")
    with SandboxManager(cfg) as manager:
        try:
            manager.create(SandboxSpec(name=box, memory_mib=768))
            manager.create(SandboxSpec(name=spare, memory_mib=256), wait=False)

            private_libvirtd.stop()
            try:
                down_at = time.monotonic()
                for call in (
                    manager.list,
                    lambda: manager.get(box),
                    lambda: manager.exec(box, ["true"]),
                    lambda: manager.destroy(spare),
                    lambda: SandboxManager(cfg),
                ):
                    with pytest.raises(Unavailable):
                        call()
                done = cli("list", config=cfg, timeout=120)
                assert done.returncode == 7, done.stderr
                assert done.stderr.startswith("error: UNAVAILABLE: ")
                assert "Traceback" not in done.stderr
                down_for = time.monotonic() - down_at
            finally:
                private_libvirtd.start()
            assert down_for < 30

            states = {s.name: s.state for s in manager.list()}  # the same manager reconnects
            assert states == {box: "ready", spare: "started"}  # spare: --no-wait
            result = manager.exec(box, ["cat", "/etc/hostname"])
            assert (result.exit_status, result.stdout.strip()) == (0, box)
            assert cli("exec", box, "--", "true", config=cfg, timeout=120).returncode == 0
            manager.destroy(spare)
            assert leftovers(cfg, spare) == []
            assert manager.exec(box, ["true"]).exit_status == 0
            manager.destroy(box)
            assert leftovers(cfg, box) == []
        finally:
            for name in (box, spare):
                with contextlib.suppress(Exception):
                    manager.destroy(name)
