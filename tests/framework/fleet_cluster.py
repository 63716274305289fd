"""A whole fleet on this machine for the fleet tests: a Ray head, hosts that join it, and the
fleet server, all inside a network namespace of the test's own with only loopback up (Ray would
otherwise announce this machine's address instead of 127.0.0.1).

``own_network()`` moves this process into a new network namespace (``unshare``; every thread
and child started from then on is in it) and back at the end (``setns``). Unix sockets are not
in a network namespace, so a host driver started before (``vmsandbox serve`` on the real
libvirtd, whose guests forward SSH to the machine's own loopback) serves the namespace too.

``Cluster`` starts the head (``ray start --head --block``, health checks at 1 s x 3, token
authentication on, with this process's token when it has one: Ray reads it once, when it is
imported), each host's ``vmsandbox fleet join`` and ``vmsandbox fleet serve``, each
process in a session of its own so that stopping it stops what it started. Ray's files go to a
temporary folder of the cluster's own.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from framework.paths import REPO

CLONE_NEWNET = 0x40000000
HEALTH = {  # Ray's node health checks: a node that misses 3 checks 1 s apart is dead
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
    "RAY_health_check_initial_delay_ms": "1000",
}
START_TIMEOUT = 180.0


@contextlib.contextmanager
def own_network() -> Iterator[int]:
    """This process in a new network namespace with loopback up, then back in its own; yields
    a descriptor of the machine's namespace (``setns`` to it goes back)."""
    libc = ctypes.CDLL(None, use_errno=True)
    original = os.open("/proc/self/ns/net", os.O_RDONLY)
    try:
        if libc.unshare(CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET) failed")
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
        try:
            yield original
        finally:
            if libc.setns(original, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back to the original network failed")
    finally:
        os.close(original)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def stop(process: subprocess.Popen[bytes] | None, sig: int = signal.SIGTERM) -> None:
    """Signal ``process`` (and, on a timeout, kill its session), then reap it."""
    if process is None or process.poll() is not None:
        return
    process.send_signal(sig)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def kill_session(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


@dataclass
class Host:
    """One host: its driver socket and its ``fleet join`` process."""

    name: str
    socket: Path
    join: subprocess.Popen[bytes] | None = None
    log: Path | None = None


@dataclass
class Cluster:
    """A fleet's processes, started by ``start`` and stopped by ``close``."""

    root: Path
    env: dict[str, str]
    port: int = 0
    head: subprocess.Popen[bytes] | None = None
    hosts: dict[str, Host] = field(default_factory=dict)
    servers: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @classmethod
    def make(cls, root: Path, extra_env: dict[str, str] | None = None) -> Cluster:
        env = {
            **os.environ,
            **HEALTH,
            **(extra_env or {}),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": os.environ.get("RAY_AUTH_TOKEN") or secrets.token_hex(32),
            "RAY_DISABLE_USAGE_STATS": "1",
        }
        return cls(root=root, env=env)

    def _spawn(self, argv: list[str], log: Path) -> subprocess.Popen[bytes]:
        with log.open("ab") as out:
            return subprocess.Popen(
                argv, env=self.env, stdout=out, stderr=out, start_new_session=True
            )

    def start_head(self) -> None:
        self.port = free_port()
        ray = str(Path(sys.executable).with_name("ray"))
        self.head = self._spawn(
            [
                ray, "start", "--head", "--block",
                "--node-ip-address", "127.0.0.1", "--port", str(self.port),
                "--temp-dir", str(self.root / "ray"),
                "--num-cpus", "0", "--num-gpus", "0",
                "--object-store-memory", str(80 * 2**20),
                "--include-dashboard", "false", "--disable-usage-stats",
            ],
            self.root / "head.log",
        )  # fmt: skip

    def join(self, name: str, socket_path: Path) -> Host:
        """Start ``vmsandbox fleet join`` for host ``name`` (not waited for: ``wait_joined``)."""
        log = self.root / f"join-{name}.log"
        host = self.hosts.get(name) or Host(name, socket_path)
        host.socket, host.log = socket_path, log
        host.join = self._spawn(
            [
                sys.executable, "-m", "vmsandbox.cli", "fleet", "join", self.address,
                "--openshell-socket", str(socket_path), "--name", name,
                "--temp-dir", str(self.root / f"r-{name}"),  # one per node: no shared sockets
            ],
            log,
        )  # fmt: skip
        self.hosts[name] = host
        return host

    def wait_joined(self, *names: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        for name in names:
            host = self.hosts[name]
            assert host.log is not None and host.join is not None
            while "joined the fleet" not in host.log.read_text():
                if host.join.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"host {name} did not join: {host.log.read_text()}")
                time.sleep(0.2)

    def kill(self, name: str) -> None:
        """The host's Ray side dies at once (its join, its node, its agent); its driver, and so
        its sandboxes, live on."""
        host = self.hosts[name]
        assert host.join is not None
        children = subprocess.run(
            ["pgrep", "-P", str(host.join.pid)], capture_output=True, text=True, check=False
        ).stdout.split()
        for pid in children:  # `ray start --block`, in a session of its own
            kill_session(int(pid))
        kill_session(host.join.pid)
        host.join.wait()

    def leave(self, name: str) -> None:
        """The host leaves cleanly (SIGTERM to its join)."""
        stop(self.hosts[name].join)

    def serve(self, socket_path: Path, gateway: str, *extra: str) -> subprocess.Popen[bytes]:
        """``vmsandbox fleet serve`` for ``gateway``, once it answers on its socket."""
        log = self.root / f"serve-{gateway}.log"
        seen = log.stat().st_size if log.exists() else 0  # a server before this one wrote there
        server = self._spawn(
            [
                sys.executable, "-m", "vmsandbox.cli", "fleet", "serve",
                "--openshell-socket", str(socket_path), "--address", self.address,
                "--gateway", gateway, *extra,
            ],
            log,
        )  # fmt: skip
        self.servers.append(server)
        deadline = time.monotonic() + START_TIMEOUT
        while "serving the fleet's compute driver" not in log.read_text()[seen:]:
            if server.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"fleet serve did not start: {log.read_text()}")
            time.sleep(0.2)
        return server

    def close(self) -> None:
        for server in self.servers:
            stop(server)
        for host in self.hosts.values():
            stop(host.join)
        stop(self.head)
        for process in (self.head, *(h.join for h in self.hosts.values()), *self.servers):
            if process is not None:
                kill_session(process.pid)


def start_fake_host(
    root: Path, name: str, umockdev: str, fabric: str, pooled: int, metrics_port: int
) -> tuple[subprocess.Popen[bytes], Path]:
    """Host ``name``'s driver (tests/framework/fleet_host.py) under umockdev host ``umockdev``, once
    its socket is there; its files under ``root/name``."""
    from framework.fake_hosts import umockdev_run

    socket_path = root / name / "driver.sock"
    socket_path.parent.mkdir(parents=True)
    log_path = root / f"driver-{name}.log"
    with umockdev_run(umockdev) as (prefix, env), log_path.open("ab") as log:
        process = subprocess.Popen(
            [
                *prefix, sys.executable, str(REPO / "tests" / "framework" / "fleet_host.py"),
                "--socket", str(socket_path), "--root", str(root / name),
                "--fabric", fabric, "--pool", str(pooled),
                "--metrics-address", f"127.0.0.1:{metrics_port}",
            ],
            env={**env, "PYTHONPATH": f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"},
            stdout=log,
            stderr=log,
            start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + START_TIMEOUT
        while not socket_path.exists():  # umockdev-run has read the device files by then
            if process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"host {name} did not start: {log_path.read_text()}")
            time.sleep(0.1)
    return process, socket_path


@contextlib.contextmanager
def cluster(prefix: str) -> Iterator[Cluster]:
    """A cluster's folder and head, closed and removed at the end (the caller is already in
    its own network: ``own_network``). Keep ``prefix`` short: Ray's socket paths under the
    folder must fit in the 107 bytes of a Unix socket address."""
    root = Path(
        tempfile.mkdtemp(prefix=prefix, dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    )
    made = Cluster.make(root)
    try:
        made.start_head()
        yield made
    finally:
        made.close()
        keep = os.environ.get("VMSANDBOX_FLEET_LOGS")  # a folder to keep the logs in
        if keep:
            Path(keep).mkdir(parents=True, exist_ok=True)
            for log in root.glob("*.log"):
                shutil.copy(log, Path(keep) / log.name)
        shutil.rmtree(root, ignore_errors=True)
