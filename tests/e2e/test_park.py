"""The parked pool on the real libvirtd with a real guest: a fill boots one minimal guest and
saves it (no QEMU process holds its memory; libvirt keeps its save), a ``vmsandbox create``
process claims it, and the sandbox answers SSH as the same boot of the same guest, with a file
written in the guest before it was parked. One TCG boot.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import libvirt
import pytest
from framework.sandboxes import cli_env, make_config

from vmsandbox.config import Config
from vmsandbox.guest import ssh
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.sandbox.record import SandboxFiles

SHAPE = {"image": "minimal", "count": 1, "park": True}
MARKER = "/var/tmp/parked-marker"


@pytest.fixture
def park_config() -> Iterator[Config]:
    """A state directory of its own with a parked pool of one default-shape minimal guest; at
    the end every domain made there is removed, whatever a failed test left."""
    root = Path(tempfile.mkdtemp(prefix="vmsbx-park-", dir="/var/tmp"))
    os.chmod(root, 0o711)
    config = make_config(root / "state", pool={"minimal": SHAPE})
    (root / "config.toml").write_text(
        f'pci_sysfs = "{config.pci_sysfs}"\n[pool.minimal]\ncount = 1\npark = true\n'
    )
    yield config
    conn = libvirt.open(config.uri)
    try:
        for dom in conn.listAllDomains(0):
            if str(config.state_dir) in dom.XMLDesc(0):
                if dom.isActive():
                    dom.destroy()
                dom.undefineFlags(libvirt.VIR_DOMAIN_UNDEFINE_MANAGED_SAVE)
    finally:
        conn.close()
    shutil.rmtree(root, ignore_errors=True)


def cli(config: Config, *args: str) -> subprocess.CompletedProcess[str]:
    env = cli_env(config, VMSANDBOX_CONFIG=str(config.state_dir.parent / "config.toml"))
    return subprocess.run(
        [sys.executable, "-m", "vmsandbox.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )


def qemu_of(domain: str) -> list[int]:
    """The PIDs of QEMU processes whose command line names ``domain``."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                line = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "qemu" in line and f"guest={domain}," in line:
                pids.append(int(proc.name))
    return pids


def test_a_parked_guest_holds_no_memory_and_a_claim_restores_it(park_config: Config) -> None:
    config = park_config
    token = uuid.uuid4().hex
    before: dict[str, str] = {}

    def mark(stage: str) -> None:
        """After the fill's settle step (the guest booted, not yet saved): a file and the boot
        ID written down in the guest."""
        if stage != "settle":
            return
        ((record, _state, _uuid),) = manager.pool.guests()  # this state directory's own
        assert record.ssh.port is not None
        endpoint = ssh.Endpoint(record.ssh.host, record.ssh.port, record.ssh.user)
        keys = SandboxFiles.of(config, record.stem).keys(record.host_key_alias)
        done = ssh.run(
            endpoint,
            keys,
            f"echo {token} > {MARKER}; cat /proc/sys/kernel/random/boot_id",
            timeout=120,
        )
        assert done.exit_status == 0, done.stderr
        before["boot_id"] = done.stdout.strip()

    with SandboxManager(config) as manager:
        manager.checkpoint = mark
        (guest,) = manager.pool.fill()
        domain = f"vmsbx-{guest}"
        assert manager.hypervisor.running(domain) is False
        assert (manager.hypervisor.saved(domain) or 0) > 0  # libvirt keeps its save
        (shape,) = manager.pool.show()
        assert shape["guests"] == [{"name": guest, "state": "parked"}]
    assert before["boot_id"]
    assert qemu_of(domain) == []  # no QEMU process holds its memory

    created = cli(config, "create", "parked", "--no-refill", "--json")
    assert created.returncode == 0, created.stdout + created.stderr
    sandbox = json.loads(created.stdout)
    assert (sandbox["state"], sandbox["domain"]) == ("ready", domain)
    assert qemu_of(domain)  # restored: its QEMU runs again

    done = cli(
        config,
        "exec",
        "parked",
        "--",
        "sh",
        "-c",
        f"cat {MARKER} /proc/sys/kernel/random/boot_id; hostname",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [token, before["boot_id"], "parked"]

    destroyed = cli(config, "destroy", "parked", "--json")
    assert destroyed.returncode == 0, destroyed.stderr
    conn = libvirt.open(config.uri)
    try:
        assert domain not in [dom.name() for dom in conn.listAllDomains(0)]
    finally:
        conn.close()
