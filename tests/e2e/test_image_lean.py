"""End to end: the lean boot of vmsandbox's own images (images/common/lean.sh, and the driver's
part in images/nvidia/lean.sh), in a fresh guest of each: sshd before the rest of the boot, then
the whole boot, with nothing failed, nothing left waiting and no timeout hit; the guest works as
users expect (journald for their own services, the network managed, the seed applied without an
interpreter); the NVIDIA driver loads only for a GPU that is there.

No GPU is passed here (none on this machine): the persistence daemon's start for an appearing
GPU is checked with the image's own udev rule matched to a device the guest has, both through
``udevadm test`` and through a real "add" event that systemd acts on.
"""

from __future__ import annotations

import contextlib
import functools
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from vmsandbox.errors import NotFound
from vmsandbox.guest import ssh, verify
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.sandbox.record import SandboxFiles
from vmsandbox.sandbox.spec import SandboxSpec, generate_name
from vmsandbox.vm.console import BOOT_MARK_RE

PERSISTENCED_RULE = "/etc/udev/rules.d/71-vmsandbox-nvidia-persistenced.rules"
# The test's copy of that rule, matched to the guest's NIC instead of an NVIDIA GPU.
TEST_RULE = "/run/udev/rules.d/71-vmsandbox-test.rules"
EARLY_FILE = "/tmp/vmsandbox-early"  # written the moment the create returns


@dataclass
class Guest:
    image: str
    name: str
    run: verify.Runner
    console_log: Path
    # What `systemctl is-system-running --wait` said: SSH answers before the rest of the boot
    # (D-Bus, logind, networkd...) has run, so the fixture waits for it once.
    boot_state: str = ""

    def out(self, command: str, *, stdin: str | None = None) -> str:
        """The stdout of ``command``, which must succeed."""
        done = self.run(command, timeout=60, stdin=stdin.encode() if stdin else None)
        assert done.exit_status == 0, f"{command}: {done.stdout}{done.stderr}"
        return done.stdout


@pytest.fixture(scope="module", params=["minimal", "nvidia"])
def guest(request: pytest.FixtureRequest, manager: SandboxManager) -> Iterator[Guest]:
    """A fresh guest of the image (built here when its recipe changed), without guest setup."""
    image = manager.images.build(request.param)
    name = generate_name("lean")
    created = manager.create(SandboxSpec(name=name, image=image.name, memory_mib=1024))
    try:
        assert created.ssh is not None
        run = functools.partial(ssh.run, created.ssh, manager.keys_of(created))
        assert run(f"echo early > {EARLY_FILE}", timeout=60).exit_status == 0
        state = run("sudo -n systemctl is-system-running --wait", timeout=300).stdout.strip()
        console_log = SandboxFiles.of(manager.config, name).console_log
        yield Guest(image.name, name, run, console_log, state)
    finally:
        with contextlib.suppress(NotFound):
            manager.destroy(name)


def test_sshd_starts_before_the_rest_of_the_boot(guest: Guest) -> None:
    """The guest's own clock: initramfs, then systemd, then sshd (the console's boot lines),
    and the default target only after sshd (systemd's own record)."""
    marks: dict[str, float] = {}
    deadline = time.monotonic() + 60
    while "sshd is up" not in marks and time.monotonic() < deadline:
        time.sleep(0.2)  # SSH may answer before the line that follows sshd's start is written
        text = guest.console_log.read_text(errors="replace")
        marks = {m["event"]: float(m["at"]) for m in BOOT_MARK_RE.finditer(text)}
    assert marks["initramfs started"] < marks["systemd starting"] < marks["sshd is up"], marks
    ssh_up, default_up = (
        int(guest.out(f"systemctl show -P ActiveEnterTimestampMonotonic {unit}"))
        for unit in ("ssh.service", "multi-user.target")
    )
    assert 0 < ssh_up < default_up


def test_the_boot_finishes_with_nothing_failed_waiting_or_timed_out(guest: Guest) -> None:
    """``is-system-running --wait`` returns once no job is left: "running", not "degraded"."""
    failed = guest.out("systemctl --failed --plain --no-legend")
    assert guest.boot_state == "running", failed
    assert guest.out("systemctl list-jobs --no-legend") == ""
    # systemd's own lines: a job or unit that timed out, failed or lost a dependency
    journal = guest.out("sudo -n journalctl -b -q --no-pager _PID=1")
    waited = [
        line
        for line in journal.splitlines()
        if re.search(r"timed out|timeout|Dependency failed|Failed to start", line, re.IGNORECASE)
    ]
    assert waited == []
    assert "Startup finished" in guest.out("systemd-analyze time")


def test_the_seed_was_applied_without_an_interpreter(guest: Guest) -> None:
    """A seed without guest setup is applied by the initramfs (firstboot_lean.sh); the Python
    unit found its flag and stood down."""
    assert guest.run("test -e /run/vmsandbox/firstboot-lean").exit_status == 0
    result = guest.out("systemctl show -P ConditionResult vmsandbox-firstboot.service")
    assert result.strip() == "no"


def test_the_journal_lives_in_memory_and_keeps_a_users_service(guest: Guest) -> None:
    guest.out(
        "sudo -n systemd-run --wait --quiet --unit=vmsbx-journal-check "
        "sh -c 'echo the-users-own-line'"
    )
    lines = guest.out("sudo -n journalctl -q --no-pager -u vmsbx-journal-check -o cat")
    assert "the-users-own-line" in lines
    assert guest.run("test -d /var/log/journal").exit_status != 0
    assert guest.run("test -d /run/log/journal").exit_status == 0


def test_udev_has_seen_the_nic_and_networkd_manages_it(guest: Guest) -> None:
    """The NIC's coldplug is kept: networkd configures a link only once udev has seen it."""
    status = guest.out("networkctl list --no-legend eth0")
    assert re.search(r"\beth0\b.*\broutable\b.*\bconfigured\b", status), status


def test_a_file_written_to_tmp_at_once_outlives_the_rest_of_the_boot(guest: Guest) -> None:
    """Written as soon as the create returned, while the boot went on after sshd: the boot's
    file setup (systemd-tmpfiles-setup, seconds later here) must leave /tmp as it is."""
    state = guest.out("systemctl show -P ActiveState systemd-tmpfiles-setup.service")
    assert state.strip() == "active"
    assert guest.out(f"cat {EARLY_FILE}").strip() == "early"


def test_create_returns_with_the_root_filesystem_grown_to_the_disk(
    manager: SandboxManager,
) -> None:
    """``create --disk 8G`` used to return with the image's 0.9 GB root filesystem, grown only
    seconds after SSH answered: a job started at once filled it at 465 MiB (issue 42, point
    4). The growth now comes before sshd: the first command sees the whole disk."""
    image = manager.images.build("minimal")
    name = generate_name("grow")
    created = manager.create(SandboxSpec(name=name, image=image.name, disk_gib=8))
    try:
        assert created.ssh is not None
        done = ssh.run(created.ssh, manager.keys_of(created), "df -B1 --output=size /", timeout=60)
        size = int(done.stdout.split()[-1])
        assert size > 7.5 * 2**30, done.stdout
    finally:
        manager.destroy(name)


# The NVIDIA driver's part of the boot: the nvidia image's guest only.
nvidia_only = pytest.mark.parametrize("guest", ["nvidia"], indirect=True)


@nvidia_only
def test_no_nvidia_module_loads_without_a_gpu(guest: Guest) -> None:
    assert "nvidia" not in guest.out("cat /proc/modules")
    assert guest.out("systemctl is-enabled nvidia-persistenced || true").strip() == "disabled"
    assert guest.out("systemctl is-active nvidia-persistenced || true").strip() == "inactive"


@nvidia_only
def test_an_appearing_gpu_starts_the_persistence_daemon(guest: Guest) -> None:
    """The image's rule, with the NIC's vendor and class in place of an NVIDIA GPU's, tags the
    device for systemd with the daemon as its wanted unit; a real "add" event of the device then
    makes systemd start the daemon (which fails here: there is no GPU; with one it stays)."""
    nic = guest.out("readlink -f /sys/class/net/eth0/device/..").strip()
    vendor, pci_class = (guest.out(f"cat {nic}/{a}").strip() for a in ("vendor", "class"))
    rule = guest.out(f"cat {PERSISTENCED_RULE}")
    assert 'ATTR{vendor}=="0x10de", ATTR{class}=="0x03*"' in rule
    ours = rule.replace("0x10de", vendor).replace("0x03*", pci_class)
    guest.out(f"sudo -n mkdir -p /run/udev/rules.d && sudo -n tee {TEST_RULE}", stdin=ours)
    try:
        guest.out("sudo -n udevadm control --reload")
        tested = guest.out(f"sudo -n udevadm test --action=add {nic} 2>&1")
        assert "SYSTEMD_WANTS=nvidia-persistenced.service" in tested
        guest.out(f"sudo -n udevadm trigger --settle --action=add {nic}")
        started = guest.out(
            "for i in $(seq 100); do t=$(systemctl show -P InactiveExitTimestampMonotonic "
            'nvidia-persistenced); [ "$t" != 0 ] && break; sleep 0.2; done; echo $t'
        )
        assert int(started) > 0
    finally:
        guest.out(
            f"sudo -n rm -f {TEST_RULE}; sudo -n udevadm control --reload; "
            # without a GPU the daemon's child ignores SIGTERM (a stop would wait 90 s for it)
            "sudo -n systemctl kill -s KILL nvidia-persistenced; "
            "sudo -n systemctl stop nvidia-persistenced; sudo -n systemctl reset-failed"
        )


@pytest.mark.parametrize("guest", ["minimal"], indirect=True)  # the same /init in both images
def test_tmp_starts_empty_at_every_boot(guest: Guest, manager: SandboxManager) -> None:
    """/tmp is emptied before systemd starts (by /init, not by the boot's file setup)."""
    guest.out("mkdir -p /tmp/.kept-dir && touch /tmp/kept /tmp/.kept /tmp/..kept")
    manager.stop(guest.name)
    started = manager.start(guest.name)
    assert started.ssh is not None
    listed = ssh.run(started.ssh, manager.keys_of(started), "ls -A /tmp", timeout=60).stdout
    assert [entry for entry in listed.split() if "kept" in entry or "early" in entry] == []
