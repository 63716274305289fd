"""``vmsandbox fleet join ADDRESS``: this host's Ray node and its agent, in the foreground until
SIGTERM or SIGINT.

1. Read what the host has from its own driver socket (``vmsandbox serve``'s HostInfo).
2. Bind the host's name to this machine (records.py): the digest of its *machine key*, a
   random secret made at the first join (``--machine-key``, default MACHINE_KEY under the
   state directory). Another machine under a name bound to a different key is refused, live
   or lost, until an operator releases the name (``release``): a lost host's sandboxes are
   never taken for another machine's.
3. Start a Ray node (``ray start --block``, a child process) that joins the cluster at ADDRESS
   with the host's capacity as resources and labels (model.py names them), no CPUs or GPUs of
   Ray's own (nothing else is scheduled there) and a small object store.
4. Start the host's agent actor on that node (agent.py), with its concurrency groups (ping
   never waits behind a create), and wait until it is ready: the host's pinned claim placed,
   so survivors of an earlier run are covered before new work comes.

``release NAME`` (``vmsandbox fleet release``) says a host's machine is gone for good: its
name is unbound and the fleet forgets the sandboxes recorded on it; refused while the host is
in the fleet.

On SIGTERM the agent gives its pinned claim back and the node stops. Ray's token
authentication must be on (``RAY_AUTH_MODE=token`` and a token); without it the command
refuses to start, since anyone who reaches a Ray port could run code on the host.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc

from vmsandbox.config import Config
from vmsandbox.errors import AlreadyExists, DeadlineExceeded, FailedPrecondition, Unavailable
from vmsandbox.fleet import model
from vmsandbox.fleet.auth import check_token_auth
from vmsandbox.openshell.dial import Checked
from vmsandbox.openshell.proto import host_info_pb2 as info_pb
from vmsandbox.openshell.proto import host_info_pb2_grpc as info_grpc

log = logging.getLogger("vmsandbox.fleet")
JOIN_TIMEOUT = 120.0  # seconds for the node to register and the agent to be ready
OBJECT_STORE_BYTES = 100 * 2**20  # the agent moves small messages only
_STOP_GRACE = 30.0  # seconds the Ray node gets to stop
MACHINE_KEY = "fleet/machine.key"  # under the state directory: this machine's key


def machine_key(path: str | os.PathLike[str] | None = None) -> str:
    """The digest of this machine's key, kept in ``path`` (default: MACHINE_KEY under the
    state directory), made (0600) at the first call."""
    where = Path(path) if path else Config.load().state_dir / MACHINE_KEY
    try:
        key = where.read_text().strip()
    except FileNotFoundError:
        where.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        key = secrets.token_hex(32)
        try:
            with os.fdopen(os.open(where, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as out:
                out.write(key + "\n")
        except FileExistsError:  # another join made it meanwhile
            key = where.read_text().strip()
    if not key:
        raise FailedPrecondition(
            f"the machine key {where} is empty: remove it to make a new one (the host's name "
            "must then be released first)",
            details={"field": "machine_key", "value": str(where)},
        )
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def read_host(socket_path: str, timeout: float = 30.0, *, wait: bool = True) -> dict:
    """The host's HostInfo document, read from its driver socket (``wait``: for up to
    ``timeout`` seconds while the driver does not answer yet). Only a server that runs as
    root or as this uid is spoken to (``openshell.dial``): FAILED_PRECONDITION otherwise."""
    deadline = time.monotonic() + (timeout if wait else 0.0)
    with Checked(socket_path) as dialled:
        stub = info_grpc.HostInfoStub(dialled.channel)
        while True:
            try:
                answer = stub.GetHostInfo(info_pb.GetHostInfoRequest(), timeout=timeout)
                return json.loads(answer.json)
            except grpc.RpcError as exc:
                dialled.check()
                if time.monotonic() > deadline or exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise Unavailable(
                        f"no vmsandbox driver answers on {socket_path} "
                        f"({exc.code().name}: {exc.details()}): start `vmsandbox serve "
                        f"--openshell-socket {socket_path}` first",
                        details={"field": "socket", "value": socket_path},
                    ) from exc
            time.sleep(0.5)


def ray_start_argv(
    address: str,
    totals: dict[str, float],
    labels: dict[str, str],
    node_ip: str | None,
    temp_dir: str | None = None,
) -> list[str]:
    """The ``ray start`` command line of the host's node."""
    ray_cli = Path(sys.executable).with_name("ray")
    argv = [
        str(ray_cli),
        "start",
        "--address",
        address,
        "--block",
        "--num-cpus",
        "0",
        "--num-gpus",
        "0",
        "--object-store-memory",
        str(OBJECT_STORE_BYTES),
        "--include-log-monitor",  # nothing reads the agent's logs from elsewhere
        "false",
        "--resources",
        json.dumps(totals, sort_keys=True),
        "--labels",
        ",".join(f"{key}={value}" for key, value in sorted(labels.items())),
        "--disable-usage-stats",
    ]
    if node_ip:
        argv += ["--node-ip-address", node_ip]
    if temp_dir:
        argv += ["--temp-dir", temp_dir]
    return argv


def join(
    address: str,
    socket_path: str,
    name: str,
    *,
    node_ip: str | None = None,
    temp_dir: str | None = None,
    key_path: str | None = None,
    stop: threading.Event | None = None,
) -> int:
    """Join the fleet at ``address`` as host ``name`` until ``stop`` is set (SIGTERM/SIGINT when
    not given); returns the exit status."""
    import ray

    from vmsandbox.fleet import agent as agent_module
    from vmsandbox.fleet.claims import live_nodes
    from vmsandbox.fleet.records import Records

    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s"
    )
    check_token_auth()
    name = model.check_host_name(name)
    key = machine_key(key_path)
    info = read_host(socket_path)
    totals = model.host_totals(name, info)
    labels = model.host_labels(name, info)
    ray.init(address=address, namespace=model.NAMESPACE, logging_level=logging.WARNING)
    if stop is None:  # after Ray's start, which sets handlers of its own
        stop = threading.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: stop.set())
    try:
        records = Records()
        records.bind(name, key)  # another machine's name is refused, live or lost
        if name in live_nodes():
            raise AlreadyExists(
                f"host {name} is already in the fleet at {address}: stop its other "
                "`vmsandbox fleet join` first",
                details={"field": "name", "value": name},
            )
        node = subprocess.Popen(
            ray_start_argv(address, totals, labels, node_ip, temp_dir),
            stdout=subprocess.DEVNULL,  # its errors go to stderr, which is ours
            text=True,
            start_new_session=True,
            env=os.environ.copy(),
        )
        try:
            _wait_node(name, node)
            records.bind(name, key, live_nodes()[name].node_id)
            groups = agent_module.CONCURRENCY_GROUPS
            remote = ray.remote(concurrency_groups=groups)  # type: ignore[call-overload]
            agent = (
                remote(agent_module.HostAgent)
                .options(
                    name=model.agent_name(name),
                    namespace=model.NAMESPACE,
                    lifetime="detached",
                    num_cpus=0,
                    resources={model.HOST + name: 1.0},
                    max_concurrency=agent_module.CALLS,
                    max_restarts=0,
                )
                .remote(name, str(Path(socket_path).resolve()), totals)
            )
            _wait_ready(name, agent, node)
            log.info("host %s joined the fleet at %s", name, address)
            ray.shutdown()  # the agent is detached: this process need not stay connected
            while not stop.wait(1.0):
                if node.poll() is not None:
                    log.error("host %s: the Ray node stopped: %s", name, _tail(node))
                    return 1
            log.info("host %s leaves the fleet", name)
            _leave(address, name)
            return 0
        finally:
            _stop_node(node)
    finally:
        ray.shutdown()


def release(name: str) -> list[model.Record]:
    """Host ``name``'s machine is gone for good: unbind the name and forget the sandboxes
    recorded on it (their claims removed); the records forgotten. FAILED_PRECONDITION while
    the host is in the fleet (the process is connected to the cluster)."""
    from vmsandbox.fleet import claims
    from vmsandbox.fleet.records import Records

    name = model.check_host_name(name)
    if name in claims.live_nodes():
        raise FailedPrecondition(
            f"host {name} is in the fleet now: stop its `vmsandbox fleet join` first; release "
            "is for a machine that is gone for good",
            details={"field": "name", "value": name},
        )
    forgotten = Records().release(name)
    for record in forgotten:
        claims.remove(model.claim_name(record.gateway, record.sandbox_id))
    claims.remove(model.pin_name(name))
    log.warning(
        "host %s released: its name is free, %d sandboxes recorded on it forgotten",
        name, len(forgotten),
    )  # fmt: skip
    return forgotten


def _leave(address: str, name: str) -> None:
    """Close the host's agent (its pinned claim given back) and stop it."""
    import ray

    ray.init(address=address, namespace=model.NAMESPACE, logging_level=logging.WARNING)
    try:
        agent = ray.get_actor(model.agent_name(name), namespace=model.NAMESPACE)
        ray.get(agent.close.remote(), timeout=10)
        ray.kill(agent)
    except Exception as exc:  # the node may be gone already: nothing to give back
        log.warning("host %s: the agent did not close: %s", name, exc)


def _wait_node(name: str, node: subprocess.Popen[str]) -> None:
    from vmsandbox.fleet.claims import live_nodes

    deadline = time.monotonic() + JOIN_TIMEOUT
    while name not in live_nodes():
        if node.poll() is not None:
            raise Unavailable(f"host {name}: `ray start` failed: {_tail(node)}")
        if time.monotonic() > deadline:
            raise DeadlineExceeded(f"host {name}: the Ray node did not register in time")
        time.sleep(0.2)


def _wait_ready(name: str, agent: Any, node: subprocess.Popen[str]) -> None:
    import ray

    deadline = time.monotonic() + JOIN_TIMEOUT
    last: dict[str, Any] | None = None
    while time.monotonic() < deadline:
        if node.poll() is not None:
            raise Unavailable(f"host {name}: the Ray node stopped: {_tail(node)}")
        try:
            last = ray.get(agent.ping.remote(), timeout=10)
        except ray.exceptions.GetTimeoutError:
            continue
        if last["ready"]:
            return
        time.sleep(0.2)
    raise DeadlineExceeded(
        f"host {name}: the agent did not get ready in {JOIN_TIMEOUT:.0f} s: "
        f"{(last or {}).get('error') or 'no answer'}"
    )


def _tail(node: subprocess.Popen[str]) -> str:
    return f"exit status {node.returncode} (its messages are above)"


def _stop_node(node: subprocess.Popen[str]) -> None:
    """SIGTERM to ``ray start --block``, which stops the node's processes."""
    if node.poll() is None:
        node.send_signal(signal.SIGTERM)
        try:
            node.wait(timeout=_STOP_GRACE)
        except subprocess.TimeoutExpired:
            os.killpg(node.pid, signal.SIGKILL)
            node.wait()
