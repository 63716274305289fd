"""Waiting for a started guest to boot: its SSH endpoint, the wait for its sshd, and failing fast
when the console or libvirt shows that it never will.

A guest that cannot boot (firmware finds no bootable disk, the kernel panics, the initramfs finds
no root, QEMU exits) fails with FAILED_PRECONDITION as soon as that shows, with the console lines:
waiting longer cannot help, the image or the host must change. DEADLINE_EXCEEDED is kept for a
guest still running at the timeout, whose boot may just be slow.

The watch follows the domain by its UUID: a sandbox removed while it boots is NOT_FOUND, and
the console file of its name (which a later sandbox of that name may write by then) counts
only while that domain is still there.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from vmsandbox.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from vmsandbox.guest.keys import SandboxKeys
from vmsandbox.guest.ssh import Endpoint, wait_ready
from vmsandbox.progress import Progress
from vmsandbox.sandbox.record import SandboxFiles, SshRecord
from vmsandbox.vm import console
from vmsandbox.vm.hypervisor import Hypervisor

# Guest boot time beyond ``base`` once GPUs are passed (see ``boot_timeout``).
PIN_SECONDS_PER_GIB = 0.5
SECONDS_PER_GPU = 30.0
CONSOLE_LINES = 30
LEASE_POLL_S = 0.5
# How long the SSH wait holds back for the console to say that sshd started (guests that say so).
SSHD_REPORT_GRACE_S = 60.0
NO_SEED_READER = (
    "neither cloud-init nor vmsandbox's first-boot unit (what reads the NoCloud seed that "
    "installs the SSH keys) was seen on the guest console: the image may lack both or have "
    "them disabled"
)


STILL_IN_FIRMWARE = (
    "the guest was still in its firmware or bootloader: its console shows nothing from a "
    "kernel yet (TCG on a busy host starts slowly: a longer --timeout may do)"
)


def check_timeout(timeout: float | None, field: str = "timeout") -> None:
    """A timeout (or ``field``, another span such as stop's grace) is None (the default) or a
    finite number of seconds above 0 (NaN never expires: every comparison with it is false)."""
    if timeout is None:
        return
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not math.isfinite(timeout)
        or timeout <= 0
    ):
        raise InvalidArgument(
            f"{field} must be a finite number of seconds above 0, got {timeout!r}",
            details={"field": field, "value": repr(timeout)},
        )


def boot_timeout(base: float, memory_mib: int, gpus: int) -> float:
    """Seconds to wait for SSH: ``base`` without GPUs; with GPUs, ``PIN_SECONDS_PER_GIB`` more
    per GiB of guest memory and ``SECONDS_PER_GPU`` more per GPU.

    With VFIO the host pins every page of guest RAM for DMA (faulting in and zeroing each one:
    real hosts take from a fraction of a second to seconds per GiB, much of it while QEMU
    starts), and the firmware and guest kernel then walk all of it; per GPU, OVMF sizes and maps
    its BARs and the guest driver boots it (GSP firmware on Turing and later), tens of seconds
    each. A 2 TiB guest with eight GPUs waits ``base`` + 1024 + 240 seconds.
    """
    if gpus <= 0:
        return base
    return base + PIN_SECONDS_PER_GIB * memory_mib / 1024 + SECONDS_PER_GPU * gpus


@dataclass
class BootWatch:
    """Watches one booting guest (the domain ``uuid``; "" for the domain of that name):
    raises FAILED_PRECONDITION when its console shows a line after which it never boots, or
    when its domain is no longer running; NOT_FOUND when its domain is gone."""

    hypervisor: Hypervisor
    name: str
    domain: str
    files: SandboxFiles
    # The guest's console says when sshd has started (images with vmsandbox's first boot).
    reports_sshd: bool = False
    uuid: str = ""

    def __post_init__(self) -> None:
        self.console = console.ConsoleWatch(self.files.console_log)
        self._since = time.monotonic()

    def sshd_reported(self) -> bool:
        """Whether the console has said that sshd started and the network is up; also once
        SSHD_REPORT_GRACE_S have passed without it, so that a lost console line costs time,
        never the boot."""
        self.console.poll()
        grace_over = time.monotonic() - self._since > SSHD_REPORT_GRACE_S
        return self.console.sshd_reachable or grace_over

    def check(self) -> bool:
        """True while the guest may still come up; raises once it cannot. The console is read
        first and believed only once the domain is seen still there after the read."""
        fatal = self.console.poll()
        uuid = self.uuid or None
        try:
            running: bool | None = self.hypervisor.running(self.domain, uuid=uuid)
            if not running and self.hypervisor.metadata(self.domain, uuid=uuid) is None:
                raise NotFound(
                    f"sandbox {self.name!r} was removed while this call waited for it to boot",
                    details={"name": self.name, "uuid": self.uuid},
                )
        except Unavailable:
            running = None  # libvirtd restarting: cannot tell, so the wait goes on (fail closed)
        if fatal is None and self.console.restarts >= console.RESTARTS_FATAL:
            tail = console.tail(self.files.console_log, CONSOLE_LINES)
            raise FailedPrecondition(
                f"sandbox {self.name!r} cannot boot: it started over {self.console.restarts} "
                "times before SSH came up (a reset loop: its kernel may not fit in its memory)"
                + _console_section(tail),
                details={"restarts": self.console.restarts, "console_tail": tail},
            )
        if fatal is not None:
            tail = console.tail(self.files.console_log, CONSOLE_LINES)
            raise FailedPrecondition(
                f"sandbox {self.name!r} cannot boot: its console says {fatal!r}"
                + _console_section(tail),
                details={"console_line": fatal, "console_tail": tail},
            )
        if running is False:
            reason = self.hypervisor.stop_reason(self.domain, uuid=uuid)
            qemu = console.tail(self.files.qemu_log, 5) if self.files.qemu_log else ""
            tail = console.tail(self.files.console_log, CONSOLE_LINES)
            raise FailedPrecondition(
                f"sandbox {self.name!r} stopped before SSH came up: {reason}"
                + (f"\n--- libvirt's QEMU log (last lines) ---\n{qemu}" if qemu else "")
                + _console_section(tail),
                details={"reason": reason, "qemu_log_tail": qemu, "console_tail": tail},
            )
        return True

    def timed_out(self, exc: DeadlineExceeded) -> DeadlineExceeded:
        """The timeout error, saying whether a seed reader ever ran, with the console's tail."""
        self.console.poll()
        tail = console.tail(self.files.console_log, CONSOLE_LINES)
        seen = self.console.seed_reader_seen
        if seen:
            note = ""
        elif console.kernel_started(self.files.console_log):
            note = f"; {NO_SEED_READER}"
        else:  # the seed's turn never came: say how far the boot got, not what it lacks
            note = f"; {STILL_IN_FIRMWARE}"
        return DeadlineExceeded(
            f"sandbox {self.name!r}: {exc.message}{note}" + _console_section(tail),
            details={"console_tail": tail, "seed_reader_seen": seen},
        )


def _console_section(tail: str) -> str:
    return f"\n--- guest console (last lines) ---\n{tail or '(console log is empty)'}"


def lease_endpoint(
    hypervisor: Hypervisor,
    domain: str,
    user: str,
    *,
    timeout: float,
    check: Callable[[], bool],
    uuid: str = "",
) -> Endpoint:
    """The guest's sshd at its DHCP address (libvirt-network mode), once it has a lease (of
    the domain ``uuid``, when given)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        check()
        address = hypervisor.lease_address(domain, uuid=uuid or None)
        if address is not None:
            return Endpoint(address, 22, user)
        time.sleep(LEASE_POLL_S)
    raise DeadlineExceeded(f"domain {domain!r} got no DHCP lease within {timeout:.0f}s")


def endpoint(watch: BootWatch, ssh: SshRecord, *, timeout: float) -> Endpoint:
    """Where the booting guest's sshd is: its forwarded loopback port, or (libvirt network) its
    DHCP address once it has a lease."""
    if ssh.port is not None:
        return Endpoint(ssh.host, ssh.port, ssh.user)
    try:
        return lease_endpoint(
            watch.hypervisor,
            watch.domain,
            ssh.user,
            timeout=timeout,
            check=watch.check,
            uuid=watch.uuid,
        )
    except DeadlineExceeded as exc:
        raise watch.timed_out(exc) from exc


def wait_for_ssh(
    watch: BootWatch,
    endpoint: Endpoint,
    keys: SandboxKeys,
    *,
    timeout: float,
    progress: Progress,
) -> float:
    """Wait until the guest's sshd accepts the sandbox key; return the seconds waited."""
    try:
        waited = wait_ready(
            endpoint,
            keys,
            timeout=timeout,
            progress=progress,
            still_running=watch.check,
            stage=lambda: console.stage(watch.files.console_log),
            sshd_reported=watch.sshd_reported if watch.reports_sshd else None,
        )
    except DeadlineExceeded as exc:
        raise watch.timed_out(exc) from exc
    progress(f"SSH is up after {waited:.1f}s")
    return round(waited, 2)
