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
import json
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
    seen: int = 0  # where the latest join's lines begin in the log


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

    def join(self, name: str, socket_path: Path, machine: str | None = None) -> Host:
        """Start ``vmsandbox fleet join`` for host ``name`` (not waited for: ``wait_joined``) on
        ``machine`` (its key in ``root/machine/``; default: the host's own folder)."""
        log = self.root / f"join-{name}.log"
        host = self.hosts.get(name) or Host(name, socket_path)
        host.socket, host.log = socket_path, log
        host.seen = log.stat().st_size if log.exists() else 0
        key = self.root / (machine or name) / "machine.key"
        host.join = self._spawn(
            [
                sys.executable, "-m", "vmsandbox.cli", "fleet", "join", self.address,
                "--openshell-socket", str(socket_path), "--name", name,
                "--temp-dir", str(self.root / f"r-{name}"),  # one per node: no shared sockets
                "--machine-key", str(key),
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
            while "joined the fleet" not in host.log.read_text()[host.seen :]:
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
    it serves; its files under ``root/name``. Started again on the same ``root`` (after
    ``kill_driver``), it finds the domains it had, as a restarted ``vmsandbox serve`` finds
    libvirt's."""
    from framework.fake_hosts import umockdev_run

    socket_path = root / name / "driver.sock"
    socket_path.parent.mkdir(parents=True, exist_ok=True)
    socket_path.unlink(missing_ok=True)  # a killed driver's
    log_path = root / f"driver-{name}.log"
    seen = log_path.stat().st_size if log_path.exists() else 0
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
        while b"serving" not in log_path.read_bytes()[seen:]:  # umockdev-run has read the devices
            if process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"host {name} did not start: {log_path.read_text()}")
            time.sleep(0.1)
    return process, socket_path


def kill_driver(process: subprocess.Popen[bytes]) -> None:
    """A host's driver dies at once (SIGKILL to its session: umockdev-run and the driver);
    its domains stay in its state file, as libvirt's outlive ``vmsandbox serve``."""
    kill_session(process.pid)
    process.wait()


@contextlib.contextmanager
def cluster(prefix: str) -> Iterator[Cluster]:
    """A cluster's folder and head, closed and removed at the end (the caller is already in
    its own network: ``own_network``). Keep ``prefix`` short: Ray's socket paths under the
    folder must fit in the 107 bytes of a Unix socket address."""
    # Not under /dev: umockdev-run takes every file a host opens under /dev/ for a device
    # and tracks at most 50 at once, so a host's lock tickets there would overflow it.
    root = Path(tempfile.mkdtemp(prefix=prefix))
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
            for log in root.glob("r-*/session_*/logs/*"):  # each node's Ray processes
                if log.suffix in (".err", ".out", ".log") and log.stat().st_size:
                    shutil.copy(log, Path(keep) / f"{log.parts[-4]}-{log.name}")
        shutil.rmtree(root, ignore_errors=True)


@dataclass
class FakeFleet:
    """A cluster of fake hosts (``start_fake_host``) and one fleet server per gateway, for the
    tests that break parts of it: each host's driver can be killed and started again on its
    files, and each host is judged by its own records (``domains``), never through the fleet."""

    cluster: Cluster
    hosts: dict[str, tuple[str, str, int]]  # name -> (umockdev host, fabric, pooled guests)
    drivers: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    sockets: dict[str, Path] = field(default_factory=dict)
    fleet_sockets: dict[str, Path] = field(default_factory=dict)  # gateway -> its server's
    servers: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)  # by gateway
    serve_args: tuple[str, ...] = ()

    def start_driver(self, name: str) -> None:
        process, socket_path = start_fake_host(
            self.cluster.root, name, *self.hosts[name], free_port()
        )
        self.drivers[name], self.sockets[name] = process, socket_path

    def kill_driver(self, name: str) -> None:
        kill_driver(self.drivers[name])

    def domains(self, name: str) -> list[dict]:
        """Host ``name``'s domains as its own (fake) libvirt keeps them."""
        from framework.fleet_host import domains

        return domains(self.cluster.root / name)

    def fault(self, name: str, **faults: object) -> None:
        """Inject ``faults`` into host ``name`` (none: clear them); fleet_host.py reads them."""
        from framework.fleet_host import FAULTS

        (self.cluster.root / name / FAULTS).write_text(json.dumps(faults))

    def serve(self, gateway: str) -> None:
        """(Again) a fleet server for ``gateway``, on its socket."""
        path = self.fleet_sockets.setdefault(gateway, self.cluster.root / f"fleet-{gateway}.sock")
        self.servers[gateway] = self.cluster.serve(path, gateway, *self.serve_args)

    def kill_server(self, gateway: str) -> None:
        """``gateway``'s fleet server dies at once (SIGKILL)."""
        kill_session(self.servers[gateway].pid)
        self.servers[gateway].wait()

    def close(self) -> None:
        self.cluster.close()
        for process in self.drivers.values():
            stop(process)


@contextlib.contextmanager
def fake_fleet(
    prefix: str,
    hosts: dict[str, tuple[str, str, int]],
    gateways: tuple[str, ...],
    *serve_args: str,
) -> Iterator[FakeFleet]:
    """``hosts`` joined and a fleet server for each of ``gateways`` (with ``serve_args``), in
    a network of this process's own; all of it stopped at the end."""
    with own_network(), cluster(prefix) as made:
        fleet = FakeFleet(made, dict(hosts), serve_args=serve_args)
        try:
            for name in hosts:
                fleet.start_driver(name)
                made.join(name, fleet.sockets[name])
            made.wait_joined(*hosts)
            for gateway in gateways:
                fleet.serve(gateway)
            yield fleet
        finally:
            fleet.close()
