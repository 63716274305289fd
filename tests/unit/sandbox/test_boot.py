"""The boot wait's pure parts: the timeout rule, reading the console (escape sequences, lines
split across reads, the lines after which a guest never boots) and the watch that turns them and
a stopped domain into FAILED_PRECONDITION, on an in-memory hypervisor."""

from __future__ import annotations

from pathlib import Path

import pytest
from framework.fake_hypervisor import FakeDomain, FakeHypervisor

from vmsandbox.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument
from vmsandbox.guest.programs import firstboot
from vmsandbox.sandbox import boot
from vmsandbox.sandbox.record import SandboxFiles
from vmsandbox.vm import console

SEABIOS = (
    "\x1bc\x1b[?7l\x1b[2J\x1b[0mSeaBIOS (version 1.16.2-debian-1.16.2-1)\r\n"
    "Booting from Hard Disk...\r\nBoot failed: not a bootable disk\r\n\r\nNo bootable device.\r\n"
)


@pytest.mark.parametrize(
    ("memory_mib", "gpus", "expected"),
    [
        (2048, 0, 240.0),
        (65536, 0, 240.0),  # without VFIO nothing is pinned
        (16384, 1, 240.0 + 8.0 + 30.0),
        (2 * 1024 * 1024, 8, 240.0 + 1024.0 + 240.0),
    ],
)
def test_boot_timeout(memory_mib: int, gpus: int, expected: float) -> None:
    assert boot.boot_timeout(240.0, memory_mib, gpus) == expected


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), True, "10"])
def test_bad_timeouts_are_invalid_argument(bad: object) -> None:
    with pytest.raises(InvalidArgument) as caught:
        boot.check_timeout(bad)  # type: ignore[arg-type]
    assert caught.value.details["field"] == "timeout"


@pytest.mark.parametrize(
    "line",
    [
        "No bootable device.",
        "BdsDxe: No bootable option or device was found.",
        "[    2.1] Kernel panic - not syncing: VFS: Unable to mount root fs on unknown-block(0,0)",
        "Gave up waiting for root file system device.  Common problems:",
        "ALERT!  /dev/nonexistent does not exist.  Dropping to a shell!",
    ],
)
def test_fatal_console_lines_are_found(tmp_path: Path, line: str) -> None:
    log = tmp_path / "console.log"
    log.write_text(f"booting\r\n{line}\r\n")
    assert console.ConsoleWatch(log).poll() == line


def test_the_watch_reads_lines_split_across_polls_and_strips_escapes(tmp_path: Path) -> None:
    log = tmp_path / "console.log"
    watch = console.ConsoleWatch(log)
    assert watch.poll() is None  # no log yet
    half = len(SEABIOS) - 12
    log.write_text(SEABIOS[:half])
    assert watch.poll() is None
    with log.open("a") as handle:
        handle.write(SEABIOS[half:])
    assert watch.poll() == "No bootable device."
    assert not watch.seed_reader_seen
    assert console.tail(log, 1) == "No bootable device."
    assert "\x1b" not in console.tail(log, 10)


@pytest.mark.parametrize(
    "line",
    [
        "[  OK  ] Finished cloud-init-local.service",  # a stock cloud image
        "[    3.2] vmsandbox-firstboot[201]: vmsandbox-firstboot: reading the NoCloud seed",
        "         Starting vmsandbox-firstboot.service - vmsandbox first boot",
    ],
)
def test_a_seed_reader_is_noticed_once_seen(tmp_path: Path, line: str) -> None:
    log = tmp_path / "console.log"
    log.write_text(
        "[    0.0] Kernel command line: root=/dev/vda cloud-init=disabled "
        "systemd.mask=vmsandbox-firstboot.service console=ttyS0\r\n"
    )
    watch = console.ConsoleWatch(log)
    assert watch.poll() is None and not watch.seed_reader_seen  # the cmdline echo is not it
    with log.open("a") as handle:
        handle.write(f"{line}\r\nlater lines\r\n")
    assert watch.poll() is None and watch.seed_reader_seen


def test_the_first_boot_units_error_line_is_fatal(tmp_path: Path) -> None:
    """What firstboot.py prints when it refuses a seed ends the wait at once."""
    line = f"{firstboot.PREFIX}: error: user-data key 'bootcmd' is not understood"
    log = tmp_path / "console.log"
    log.write_text(f"[    4.1] vmsandbox-firstboot[201]: {line}\r\n")
    assert console.ConsoleWatch(log).poll() == f"[    4.1] vmsandbox-firstboot[201]: {line}"


def _watch(tmp_path: Path, running: bool) -> tuple[boot.BootWatch, Path]:
    files = SandboxFiles(
        name="unit",
        overlay=tmp_path / "o",
        seed=tmp_path / "s",
        nvram=tmp_path / "n",
        keys_dir=tmp_path / "k",
        console_log=tmp_path / "console.log",
        qemu_log=tmp_path / "qemu.log",
    )
    hv = FakeHypervisor()
    hv.domains["vmsbx-unit"] = FakeDomain("<domain/>", None, "creating", running=running)
    hv.domains["vmsbx-unit"].reason = "QEMU failed to start or run"
    return boot.BootWatch(hv, "unit", "vmsbx-unit", files), files.console_log


def test_a_fatal_console_line_fails_the_wait_with_the_console(tmp_path: Path) -> None:
    watch, log = _watch(tmp_path, running=True)
    assert watch.check()
    log.write_text(SEABIOS)
    with pytest.raises(FailedPrecondition, match="cannot boot: its console says") as caught:
        watch.check()
    assert caught.value.details["console_line"] == "No bootable device."
    assert "SeaBIOS" in caught.value.details["console_tail"]


def test_a_stopped_domain_fails_the_wait_with_libvirts_reason(tmp_path: Path) -> None:
    watch, _log = _watch(tmp_path, running=False)
    (tmp_path / "qemu.log").write_text("qemu-system-x86_64: cannot set up guest memory\n")
    with pytest.raises(FailedPrecondition, match="stopped before SSH came up: QEMU failed") as c:
        watch.check()
    assert "cannot set up guest memory" in c.value.message


def test_the_timeout_says_when_no_seed_reader_ran(tmp_path: Path) -> None:
    watch, log = _watch(tmp_path, running=True)
    log.write_text("Debian GNU/Linux 12 localhost ttyS0\r\nlocalhost login: ")
    error = watch.timed_out(DeadlineExceeded("guest did not accept SSH within 60s"))
    assert boot.NO_SEED_READER in error.message
    assert error.details["seed_reader_seen"] is False
    for reader in ("Cloud-init v. 22.4.2 running 'init-local'", "vmsandbox-firstboot: reading"):
        log.write_text(f"{reader}\r\n")
        error = watch.timed_out(DeadlineExceeded("guest did not accept SSH within 60s"))
        assert boot.NO_SEED_READER not in error.message


STATUS_SSHD = (
    "[\x1b[0;32m  OK  \x1b[0m] Started "
    "\x1b[0;1;39mssh.service\x1b[0m - OpenBSD Secure Shell server."
)
STATUS_ONLINE = "[  OK  ] Reached target network-online.target - Network is Online."
# The project's images boot with "quiet": their own lines say it (images/common/lean.sh).
LEAN_NIC = "vmsandbox-firstboot: eth0 is up at 10.0.2.15/24"
LEAN_SSHD = "vmsandbox-boot: sshd is up at 2.71s"
LEAN_ONLINE = "vmsandbox-boot: network is online at 4.02s"


@pytest.mark.parametrize(
    "lines",
    [
        [STATUS_SSHD, STATUS_ONLINE],
        [STATUS_ONLINE, STATUS_SSHD],
        # the lean boot: once its network is up (refused knocks cost it nothing)
        ["vmsandbox-boot: initramfs started at 1.07s", LEAN_NIC],
        [LEAN_SSHD, LEAN_ONLINE],  # a NIC left to udev and networkd
        ["[  OK  ] Reached target multi-user.target - Multi-User System."],  # both are behind it
    ],
)
def test_the_ssh_wait_is_let_through_once_the_console_says_the_guest_answers(
    tmp_path: Path, lines: list[str]
) -> None:
    watch, log = _watch(tmp_path, running=True)
    watch.reports_sshd = True
    log.write_text("[  OK  ] Started systemd-udevd.service\r\n         Starting ssh.service\r\n")
    assert not watch.sshd_reported()
    for line in lines[:-1]:
        with log.open("a") as handle:
            handle.write(f"{line}\r\n")
        assert not watch.sshd_reported()
    with log.open("a") as handle:
        handle.write(f"{lines[-1]}\r\n")
    assert watch.sshd_reported()


def test_the_boot_lines_give_each_event_in_the_guests_clock() -> None:
    found = [
        (m["event"], float(m["at"]))
        for line in ("vmsandbox-boot: initramfs started at 1.07s", LEAN_SSHD, LEAN_NIC)
        if (m := console.BOOT_MARK_RE.search(line))
    ]
    assert found == [("initramfs started", 1.07), ("sshd is up", 2.71)]


def test_the_stage_names_the_lean_boots_lines(tmp_path: Path) -> None:
    log = tmp_path / "console.log"
    for line, stage in (
        ("vmsandbox-boot: initramfs started at 1.07s", "initramfs"),
        (LEAN_NIC, "first-boot unit running"),
        ("vmsandbox-boot: systemd starting at 1.50s", "systemd starting"),
        (LEAN_SSHD, "sshd up"),
    ):
        with log.open("a") as handle:
            handle.write(f"{line}\r\n")
        assert console.stage(log) == stage


def test_a_lost_console_line_costs_the_grace_never_the_boot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    watch, _log = _watch(tmp_path, running=True)
    assert not watch.sshd_reported()
    monkeypatch.setattr(boot, "SSHD_REPORT_GRACE_S", 0.0)
    assert watch.sshd_reported()


def test_a_fatal_line_is_still_seen_after_another_reader_polled(tmp_path: Path) -> None:
    """The SSH wait's gate polls the console too: a fatal line it read first is not lost."""
    watch, log = _watch(tmp_path, running=True)
    log.write_text(SEABIOS)
    assert not watch.sshd_reported()
    with pytest.raises(FailedPrecondition, match="No bootable device"):
        watch.check()


RESET = (
    "SeaBIOS (version 1.16.2-debian-1.16.2-1)\r\nMachine UUID 1458cc23\r\nBooting from ROM...\r\n"
)


def test_a_guest_that_starts_over_in_a_loop_fails_the_wait(tmp_path: Path) -> None:
    """``--memory 32M``: the kernel cannot fit and the machine resets at once, again and again;
    the create used to wait out its whole timeout (issue 42, point 6)."""
    watch, log = _watch(tmp_path, running=True)
    log.write_text(RESET * 3)
    assert watch.check()  # started over twice: may still be a guest's own reboot
    log.write_text(RESET * 4)
    with pytest.raises(FailedPrecondition, match="started over 3 times before SSH came up") as c:
        watch.check()
    assert "its kernel may not fit in its memory" in c.value.message
    assert c.value.details["restarts"] == 3


def test_a_timeout_in_the_firmware_does_not_blame_the_image(tmp_path: Path) -> None:
    """A guest still in its firmware at the timeout used to be told that "the image may lack
    both cloud-init and the first-boot unit"."""
    watch, log = _watch(tmp_path, running=True)
    for text in ("", RESET):
        log.write_text(text)
        error = watch.timed_out(DeadlineExceeded("guest did not accept SSH within 5s"))
        assert boot.NO_SEED_READER not in error.message
        assert "still in its firmware or bootloader" in error.message
    log.write_text(RESET + "vmsandbox-boot: initramfs started at 0.91s\r\n")
    error = watch.timed_out(DeadlineExceeded("guest did not accept SSH within 5s"))
    assert boot.NO_SEED_READER in error.message
