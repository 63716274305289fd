"""A private libvirtd for tests that restart it: the same binary and configuration, with
real QEMU guests, in a mount namespace of its own (its own /run/libvirt, /var/lib/libvirt,
/etc/libvirt, ...) and reached through its socket, so that restarting it never disturbs the
host's libvirtd or anyone else's guests.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import libvirt


@dataclass
class PrivateLibvirtd:
    """A libvirtd (and virtlogd) of the test's own, in a private mount namespace."""

    base: Path

    @property
    def socket(self) -> Path:
        return self.base / "run" / "libvirt-sock"

    @property
    def uri(self) -> str:
        return f"qemu+unix:///system?socket={self.socket}"

    def pid(self, daemon: str) -> int | None:
        try:
            return int((self.base / f"{daemon}.pid").read_text())
        except (OSError, ValueError):
            return None

    def setup(self) -> None:
        for folder in PRIVATE_DIRS:
            (self.base / folder).mkdir()
        # The daemons' configuration files, not the host's persistent domains and networks.
        for conf in Path("/etc/libvirt").glob("*.conf"):
            shutil.copy2(conf, self.base / "etc")
        (self.base / "etc" / "qemu").mkdir()
        # QEMU's capabilities cache: without it the first start probes QEMU for seconds.
        shutil.copytree("/var/cache/libvirt", self.base / "cache", dirs_exist_ok=True)
        self._namespace()
        self.start()

    def _namespace(self) -> None:
        """virtlogd in a mount namespace of its own with the private folders bound in; it
        keeps the namespace alive for libvirtd. Returns once its pid file is written."""
        mounts = " && ".join(
            f"mount --bind {self.base / src} {dst}" for src, dst in PRIVATE_DIRS.items()
        )
        script = f"{mounts} && virtlogd -d -p {self.base / 'virtlogd.pid'}"
        subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script],
            check=True,
            timeout=30,
        )
        deadline = time.monotonic() + 10
        while self.pid("virtlogd") is None:
            assert time.monotonic() < deadline, "private virtlogd wrote no pid file"
            time.sleep(0.05)

    def start(self) -> None:
        """Start libvirtd in the namespace that virtlogd keeps alive (a new one, with the
        same folders, if virtlogd has gone: seen in full runs, cause not known); wait until it
        answers."""
        holder = self.pid("virtlogd")
        if holder is None or not _running(holder):
            self._namespace()
            holder = self.pid("virtlogd")
        assert holder is not None
        pidfile = self.base / "libvirtd.pid"
        subprocess.run(
            ["nsenter", "-t", str(holder), "-m", "--", "libvirtd", "-d", "-p", str(pidfile)],
            check=True,
            timeout=30,
        )
        deadline = time.monotonic() + 60
        while not self.answers():
            assert time.monotonic() < deadline, "private libvirtd did not come up"
            time.sleep(0.1)

    def answers(self) -> bool:
        try:
            libvirt.open(self.uri).close()
            return True
        except libvirt.libvirtError:
            return False

    def stop(self, daemon: str = "libvirtd") -> None:
        """SIGTERM the daemon this test started; return once it no longer serves."""
        pid = self.pid(daemon)
        if pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while _running(pid):
            if time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        (self.base / f"{daemon}.pid").unlink(missing_ok=True)

    def teardown(self) -> None:
        if self.pid("libvirtd") is not None and self.answers():
            conn = libvirt.open(self.uri)
            try:
                for dom in conn.listAllDomains(0):  # every domain here is this test's
                    with contextlib.suppress(libvirt.libvirtError):
                        dom.destroy()
                    with contextlib.suppress(libvirt.libvirtError):
                        dom.undefine()
            finally:
                conn.close()
        self.stop("libvirtd")
        self.stop("virtlogd")
        shutil.rmtree(self.base, ignore_errors=True)


# Bind-mounted over the host's in the daemon's mount namespace: source folder -> target.
PRIVATE_DIRS = {
    "run": "/run/libvirt",
    "lib": "/var/lib/libvirt",
    "cache": "/var/cache/libvirt",
    "etc": "/etc/libvirt",
    "log": "/var/log/libvirt",
}


def _running(pid: int) -> bool:
    """Alive and not a zombie (daemons are reaped by init, which may take a while)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")
