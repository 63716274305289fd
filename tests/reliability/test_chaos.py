"""Chaos against the real libvirtd: libvirtd restarted during list, reconcile, create and pool
fill; ``vmsandbox serve`` killed mid-create and after a create; a guest's SSH dropped during a
watch; eight clients creating, destroying, claiming and reconciling at once for minutes, one of
them killed on the way. After each: no sandbox lost, no file of a live sandbox removed, no GPU
held by nobody, no Fabric Manager partition active without an owner, every error a clear code
and message.

The restarted libvirtd is a private one of each test, in a mount namespace of its own
(tests/reliability/test_libvirtd.py's ``PrivateLibvirtd``): restarting it disturbs no other
test's guests, and the fixture stops it however the test ends. ``make test`` runs the module
with the rest (about 5 minutes); ``make chaos`` (``-m chaos``) runs it alone.
``VMSANDBOX_CHAOS_SECONDS`` sets how long the eight clients run (default 120).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import libvirt
import pytest
from framework import fake_sysfs
from framework.crash import kill9, wait_for_output
from framework.disks import mbr_qcow2
from framework.fake_hosts import umockdev_run
from framework.openshell_client import Watch, phase, serving, stub
from framework.paths import REPO
from framework.private_libvirtd import PrivateLibvirtd
from framework.sandboxes import IMAGES, cli_env, leftovers

from vmsandbox.config import Config
from vmsandbox.errors import VmSandboxError
from vmsandbox.gpu.fabric.lease import FabricLease
from vmsandbox.image.store import ImageStore
from vmsandbox.openshell.proto import compute_driver_pb2 as pb
from vmsandbox.sandbox.holds import Holds
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.sandbox.pool.keeper import filling
from vmsandbox.sandbox.record import SandboxFiles
from vmsandbox.sandbox.spec import SandboxSpec, generate_name

FMPM = REPO / "tests" / "fixtures" / "fmpm"
CRASH_CLI = REPO / "tests" / "framework" / "crash_cli.py"
WORKER = REPO / "tests" / "framework" / "chaos_worker.py"
DRIVER = "535.216.01"
SECONDS = float(os.environ.get("VMSANDBOX_CHAOS_SECONDS", "120"))
CLIENTS = 8
# What a client may be told when others race it for the same GPUs, names and guests.
EXPECTED_CODES = {"RESOURCE_EXHAUSTED", "ALREADY_EXISTS", "NOT_FOUND"}


# -- the invariants --------------------------------------------------------------------------------


def check_state(config: Config, expected: set[str] | None = None) -> None:
    """What must hold after each chaos: every sandbox whose UUID is in ``expected`` exists; every
    sandbox of this state directory has its files; every reservation belongs to a domain and
    nobody is left at work; no PCI device is held by two domains; the Fabric Manager
    partitions leased are the ones sandboxes that exist hold. A pool filler a server started
    (it outlives the server) is let finish first: its guest under way is work, not a leak."""
    fillers_done(config)
    with SandboxManager(config, reconcile=False) as manager:
        domains = {stored.uuid: stored for stored in manager.hypervisor.every_domain()}
        sandboxes = {found.uuid: found for found in manager.store.found()}
        ours = {u: f for u, f in sandboxes.items() if manager.store.local(f.record)}
        with manager.locked("chaos check"):
            holds = Holds(config).all()
    lost = (expected or set()) - set(ours)
    assert not lost, f"sandboxes lost: {sorted(lost)}"
    for uuid, found in ours.items():
        files = SandboxFiles.of(config, found.record.stem)
        missing = [p for p in (files.overlay, files.seed, files.keys_dir) if not p.exists()]
        assert not missing, f"files of live sandbox {found.record.name} removed: {missing}"
        assert uuid in holds, f"sandbox {found.record.name} has no reservation"
    for uuid, hold in holds.items():
        assert uuid in domains, f"reservation of {hold.name} holds {hold.gpus} for no domain"
        assert hold.owner is None, f"reservation of {hold.name} still owned: {hold.owner}"
    held: dict[str, str] = {}
    for stored in domains.values():
        for bdf in stored.hostdevs:
            assert bdf not in held, f"{bdf} held by {held[bdf]} and {stored.domain}"
            held[bdf] = stored.domain
    leases = {lease.partition: lease.uuid for lease in FabricLease(config).leases()}
    for partition, uuid in leases.items():
        assert uuid in ours, f"partition {partition} leased to no sandbox ({uuid})"
    wanted = {f.record.fabric_partition for f in ours.values()} - {None}
    assert set(leases) == wanted
    fm = os.environ.get("FAKE_FMPM_STATE")
    if fm and (Path(fm) / "active.json").exists():
        active = set(json.loads((Path(fm) / "active.json").read_text()))
        assert active == wanted, f"partitions active {sorted(active)}, owned {sorted(wanted)}"


def clear_error(exc: VmSandboxError) -> None:
    """A clear error: a code of the tree and a message that says something."""
    assert exc.code in {"UNAVAILABLE", *EXPECTED_CODES, "FAILED_PRECONDITION"}, exc.to_dict()
    assert len(exc.message) > 20 and "Traceback" not in exc.message


# -- an image and a fabric of the test's own -------------------------------------------------------


@dataclass
class Host:
    """A state directory, an image store with a small imported image (its meta names FM's
    driver), a fake Fabric Manager in shared NVSwitch mode, and the config file naming them."""

    root: Path
    config: Config
    file: Path
    fm: Path
    env: dict[str, str] = field(default_factory=dict)


def make_host(uri: str, *, pool: int = 2, image: str = "chaos") -> Host:
    root = Path(tempfile.mkdtemp(prefix="vmsbx-chaos-", dir="/var/tmp"))
    os.chmod(root, 0o711)
    images = root / "images"
    if image == "chaos":
        disk = root / "disk.qcow2"
        mbr_qcow2(disk)
        built = ImageStore(images).import_image(disk, "chaos")
        meta = built.path / "meta.json"
        meta.write_text(json.dumps({**built.meta, "nvidia_driver_version": DRIVER}))
    fm = root / "fm"
    fm.mkdir()
    (fm / "version").write_text(DRIVER)
    (root / "fabricmanager.cfg").write_text("FABRIC_MODE=1\n")
    image_dir = images if image == "chaos" else IMAGES
    file = root / "config.toml"
    file.write_text(
        f'uri = "{uri}"\nstate_dir = "{root / "state"}"\nimage_dir = "{image_dir}"\n'
        f'virt_type = "qemu"\nboot_timeout = 600\nfmpm = "{FMPM / "fmpm"}"\n'
        f'fabric_manager = "{FMPM / "nv-fabricmanager"}"\n'
        f'fabric_manager_config = "{root / "fabricmanager.cfg"}"\n'
        f'pci_sysfs = "{fake_sysfs.shared()}"\n'
        f'[pool.{image}]\nimage = "{image}"\nmemory_mib = 256\ndisk_gib = 1\ncount = {pool}\n'
    )
    config = Config.load(file)
    env = {
        **cli_env(config),
        "VMSANDBOX_CONFIG": str(file),
        "FAKE_FMPM_STATE": str(fm),
    }
    for key in ("VMSANDBOX_URI", "VMSANDBOX_STATE_DIR", "VMSANDBOX_IMAGE_DIR"):
        env.pop(key, None)  # the file says it
    return Host(root, config, file, fm, env)


def fillers_done(config: Config, timeout: float = 600) -> None:
    """Wait until no pool filler works in ``config``'s state directory (a fill started by a
    create or a server runs as a process of its own and may outlive both)."""
    deadline = time.monotonic() + timeout
    while filling(config):
        assert time.monotonic() < deadline, "a pool filler still runs"
        time.sleep(0.5)


@contextlib.contextmanager
def own_host(uri: str, **kwargs: Any) -> Iterator[Host]:
    host = make_host(uri, **kwargs)
    saved = os.environ.get("FAKE_FMPM_STATE")
    os.environ["FAKE_FMPM_STATE"] = str(host.fm)
    try:
        yield host
    finally:
        if saved is None:
            os.environ.pop("FAKE_FMPM_STATE", None)
        else:
            os.environ["FAKE_FMPM_STATE"] = saved
        fillers_done(host.config)  # else a guest it boots after the drain outlives the test
        with SandboxManager(host.config, reconcile=False) as manager:
            for sandbox in [s for s in manager.list() if s.local]:  # this host's only
                with contextlib.suppress(VmSandboxError):
                    manager.destroy(sandbox.name)
            with contextlib.suppress(VmSandboxError):
                manager.pool.drain()
        shutil.rmtree(host.root, ignore_errors=True)


@pytest.fixture
def libvirtd() -> Iterator[PrivateLibvirtd]:
    """A libvirtd of the test's own, stopped however the test ends."""
    base = Path(tempfile.mkdtemp(prefix="vmsbx-libvirtd-", dir="/var/tmp"))
    os.chmod(base, 0o711)  # QEMU runs as another user and must reach the disks under it
    daemon = PrivateLibvirtd(base)
    try:
        daemon.setup()
        yield daemon
    finally:
        daemon.teardown()


def restarting(daemon: PrivateLibvirtd, times: int, down: float = 1.0) -> threading.Thread:
    """A thread that restarts ``daemon`` ``times`` times, ``down`` seconds each."""

    def run() -> None:
        for _ in range(times):
            time.sleep(random.uniform(0.5, 1.5))
            daemon.stop()
            time.sleep(down)
            daemon.start()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


# -- libvirtd restarted ----------------------------------------------------------------------------


def test_libvirtd_restarted_during_list_reconcile_and_create(
    libvirtd: PrivateLibvirtd,
) -> None:
    """Twelve sandboxes, and libvirtd restarted three times while lists, reconciles and
    creates run: each call gives the whole answer or UNAVAILABLE; reconcile removes nothing
    of a sandbox that exists; a create either made its sandbox or left nothing once
    reconciled."""
    with own_host(libvirtd.uri) as host:
        expected: set[str] = set()
        with SandboxManager(host.config, reconcile=False) as manager:
            for n in range(12):
                spec = SandboxSpec(name=f"r{n}", image="chaos", memory_mib=256, disk_gib=1)
                expected.add(manager.create(spec, start=False).uuid)
            restarts = restarting(libvirtd, 3)
            calls: dict[str, int] = {"whole": 0, "unavailable": 0}
            failed_creates: list[str] = []
            n = 0
            while restarts.is_alive():
                n += 1
                for call in ("list", "reconcile", "create"):
                    try:
                        if call == "list":
                            names = {s.uuid for s in manager.list()}
                            assert expected <= names, "a listing left sandboxes out"
                        elif call == "reconcile":
                            report = manager.reconcile()
                            assert not set(report["removed"]) & {f"r{i}" for i in range(12)}
                        else:
                            name = f"n{n}"
                            spec = SandboxSpec(name=name, image="chaos", memory_mib=256, disk_gib=1)
                            try:
                                expected.add(manager.create(spec, start=False).uuid)
                            except VmSandboxError:
                                failed_creates.append(name)
                                raise
                        calls["whole"] += 1
                    except VmSandboxError as exc:
                        assert exc.code == "UNAVAILABLE", exc.to_dict()
                        clear_error(exc)
                        calls["unavailable"] += 1
            restarts.join()
            assert calls["whole"] and calls["unavailable"], calls
            manager.reconcile()
        check_state(host.config, expected)
        for name in failed_creates:
            assert leftovers(host.config, name) == [], name


def test_libvirtd_restarted_during_a_pool_fill(libvirtd: PrivateLibvirtd) -> None:
    """A pool fill booting a guest (TCG) while libvirtd restarts: the boot wait cannot tell
    whether the guest runs and waits on; the fill ends with a ready pooled guest or a clear
    error, and nothing is left half-made once reconciled."""
    with own_host(libvirtd.uri, pool=1, image="minimal") as host:
        fill = subprocess.Popen(
            [sys.executable, "-m", "vmsandbox.cli", "pool", "fill"],
            env=host.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            conn = libvirt.open(libvirtd.uri)
            deadline = time.monotonic() + 120
            while not any(d.isActive() for d in conn.listAllDomains(0)):
                assert time.monotonic() < deadline and fill.poll() is None, "no guest started"
                time.sleep(0.2)
            conn.close()
            time.sleep(5)  # the fill waits for the guest's SSH now
            restarting(libvirtd, 2).join()
            _out, err = fill.communicate(timeout=600)
        finally:
            kill9_quiet(fill)
        if fill.returncode != 0:
            lines = [line for line in err.splitlines() if line.startswith("error: ")]
            assert len(lines) == 1 and "Traceback" not in err, err
        with SandboxManager(host.config, reconcile=False) as manager:
            manager.reconcile()
            ready = [g for g in manager.pool.guests() if g[1] == "pooled"]
            assert len(ready) == (1 if fill.returncode == 0 else 0), err
        check_state(host.config)


def kill9_quiet(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


# -- vmsandbox serve killed ------------------------------------------------------------------------


def _sandbox(name: str) -> pb.DriverSandbox:
    return pb.DriverSandbox(
        id=f"gw-{name}",
        name=name,
        spec=pb.DriverSandboxSpec(
            template=pb.DriverSandboxTemplate(
                resources=pb.DriverResourceRequirements(memory_limit="512Mi")
            )
        ),
    )


def test_serve_killed_mid_create_leaves_nothing_held(config: Config) -> None:
    """The server is killed while a create has just started QEMU: the gateway gets
    UNAVAILABLE; the restarted server reconciles at start and the half-made sandbox, its QEMU
    and its reservation are gone."""
    with own_host(config.uri, image="minimal") as host:
        path = host.root / "sock" / "driver.sock"
        server = subprocess.Popen(
            [sys.executable, str(CRASH_CLI), "start", "serve", "--openshell-socket", str(path)],
            env=host.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        name = generate_name("c")
        outcome: list[grpc.StatusCode] = []
        try:
            deadline = time.monotonic() + 60
            while not path.exists():
                assert time.monotonic() < deadline, "serve did not come up"
                time.sleep(0.1)
            channel, client = stub(path)

            def create() -> None:
                try:
                    request = pb.CreateSandboxRequest(sandbox=_sandbox(name))
                    client.CreateSandbox(request, timeout=300)
                    outcome.append(grpc.StatusCode.OK)
                except grpc.RpcError as exc:
                    outcome.append(exc.code())

            thread = threading.Thread(target=create, daemon=True)
            thread.start()
            wait_for_output(server, "vmsandbox-checkpoint start", timeout=120)
            assert leftovers(host.config, name)
            kill9(server)
            thread.join(60)
            channel.close()
            assert outcome == [grpc.StatusCode.UNAVAILABLE]
        finally:
            kill9(server)
        with serving(path, host.env):  # reconciles at start
            deadline = time.monotonic() + 60
            while leftovers(host.config, name):
                assert time.monotonic() < deadline, leftovers(host.config, name)
                time.sleep(0.5)
        check_state(host.config)


_DROP_SSH = "printf '#!/bin/sh\\nkill -9 $PPID\\n' > /usr/local/bin/systemctl && chmod 755 {0}"


def test_serve_restarted_and_a_guest_dropping_ssh_during_a_watch(config: Config) -> None:
    """A sandbox created through the driver, whose server is then killed before the guest is
    ready: the restarted server waits again and the watch sees it ready. Then the guest drops
    every SSH session that reads its main process: lists, gets and watches go on (without that
    condition), and a stop still reaches the open watch."""
    with own_host(config.uri, image="minimal") as host:
        path = host.root / "sock" / "driver.sock"
        name = generate_name("w")
        sandbox_id = f"gw-{name}"
        first = subprocess.Popen(
            [sys.executable, "-m", "vmsandbox.cli", "serve", "--openshell-socket", str(path)],
            env=host.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 60
            while not path.exists():
                assert time.monotonic() < deadline
                time.sleep(0.1)
            channel, client = stub(path)
            with channel:
                request = pb.CreateSandboxRequest(sandbox=_sandbox(name))
                client.CreateSandbox(request, timeout=300)
        finally:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
        path.unlink(missing_ok=True)
        with serving(path, host.env):
            watch = Watch(path)
            try:
                assert watch.until("Ready", sandbox_id, timeout=900)[-1] == "Ready"
                with SandboxManager(host.config, reconcile=False) as manager:
                    shim = _DROP_SSH.format("/usr/local/bin/systemctl")
                    done = manager.exec(name, ["sudo", "sh", "-c", shim], timeout=120)
                    assert done.exit_status == 0, done.stderr
                channel, client = stub(path)
                with channel:
                    listed = client.ListSandboxes(pb.ListSandboxesRequest(), timeout=120)
                    [snap] = [s for s in listed.sandboxes if s.id == sandbox_id]
                    assert phase(snap) == "Ready"
                    kinds = {c.type for c in snap.status.conditions}
                    assert "MainProcess" not in kinds  # the guest dropped that session
                    got = client.GetSandbox(pb.GetSandboxRequest(sandbox_id=sandbox_id))
                    assert phase(got.sandbox) == "Ready"
                    second = Watch(path)
                    try:
                        assert second.until("Ready", sandbox_id, timeout=120)
                    finally:
                        second.close()
                    client.StopSandbox(pb.StopSandboxRequest(sandbox_id=sandbox_id), timeout=300)
                    assert watch.until("Stopped", sandbox_id, timeout=300)[-1] == "Stopped"
                    deleted = client.DeleteSandbox(
                        pb.DeleteSandboxRequest(sandbox_id=sandbox_id), timeout=300
                    )
                    assert deleted.deleted
                    assert watch.until("deleted", sandbox_id, timeout=120)[-1] == "deleted"
            finally:
                watch.close()
        assert leftovers(host.config, name) == []
        check_state(host.config)


# -- eight clients at once -------------------------------------------------------------------------


def _start_worker(host: Host, worker: str, log: Path, seconds: float, filler: bool) -> Any:
    stack = contextlib.ExitStack()
    prefix, env = stack.enter_context(umockdev_run("hgx_h100"))
    testbed = {k: v for k, v in env.items() if k == "TMPDIR"}
    argv = [
        *prefix,
        sys.executable,
        str(WORKER),
        *("--worker", worker, "--seconds", str(seconds), "--log", str(log)),
        *("--seed", str(random.randrange(1 << 30)), *(["--filler"] if filler else [])),
    ]
    proc = subprocess.Popen(
        argv,
        env={**host.env, **testbed},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    proc.stack = stack  # type: ignore[attr-defined]
    assert proc.stdout is not None and proc.stdout.readline() == "started\n", proc.stderr
    return proc


def _outcomes(logs: list[Path]) -> list[dict[str, Any]]:
    return [
        json.loads(line)
        for log in logs
        if log.exists()
        for line in log.read_text().split("\n")
        if line
    ]


def test_eight_clients_create_destroy_claim_and_reconcile_at_once(config: Config) -> None:
    """Seven clients create (GPU sandboxes of 1, 2 and 4 GPUs with their Fabric Manager
    partitions, and plain ones), destroy, claim and reconcile at random, and one keeps the
    pool filled, on the fake HGX host for ``VMSANDBOX_CHAOS_SECONDS``; one client is killed
    half-way and replaced. Every outcome is a result or a clear, expected error; afterwards
    nothing is lost, held by nobody or active without an owner."""
    with own_host(config.uri, pool=3) as host:
        logs = [host.root / f"worker-{n}.jsonl" for n in range(CLIENTS)]
        workers = [
            _start_worker(host, str(n), logs[n], SECONDS, filler=n == 0) for n in range(CLIENTS)
        ]
        try:
            time.sleep(SECONDS / 2)
            kill9(workers[1], reap=True)
            logs.append(host.root / "worker-1r.jsonl")
            workers.append(_start_worker(host, "1r", logs[-1], SECONDS / 2, filler=False))
            for proc in workers[2:] + workers[:1]:
                proc.wait(timeout=SECONDS + 300)
                assert proc.returncode == 0, proc.stderr.read()
        finally:
            for proc in workers:
                kill9(proc, reap=True)
                proc.stack.close()
        outcomes = _outcomes(logs)
        raw = [o for o in outcomes if o.get("code") == "RAW"]
        assert not raw, raw[0]
        unclear = [
            o
            for o in outcomes
            if o.get("ok") is False
            and not (
                o["code"] in EXPECTED_CODES
                or (
                    o["code"] == "FAILED_PRECONDITION"
                    and "while this call was making" in o["message"]
                )
            )
        ]
        assert not unclear, json.dumps(unclear[:5], indent=1)
        assert all(len(o["message"]) > 20 for o in outcomes if o.get("ok") is False)
        done = {o["op"] for o in outcomes if o.get("ok")}
        assert {"create", "destroy", "claim", "fill"} <= done, done
        with SandboxManager(host.config, reconcile=False) as manager:
            manager.reconcile()
        made = {o.get("uuid") for o in outcomes if o.get("ok") and o["op"] in ("create", "claim")}
        made.discard(None)
        gone = {o.get("uuid") for o in outcomes if o.get("ok") and o["op"] == "destroy"}
        in_flight = {  # the killed client's last destroy may or may not have happened
            o["uuid"] for o in outcomes if o["op"] == "begin-destroy" and o["worker"] == "1"
        }
        try:
            check_state(host.config, made - gone - in_flight)
        except AssertionError:
            print(json.dumps([o for o in outcomes if o.get("uuid") or o.get("name")], indent=0))
            raise


def test_the_invariants_see_a_sandbox_lost(config: Config) -> None:
    """The checks above find what they look for: a sandbox's overlay removed behind its back,
    and a reservation whose domain is gone."""
    with own_host(config.uri) as host, SandboxManager(host.config, reconcile=False) as manager:
        made = manager.create(
            SandboxSpec(name="v", image="chaos", memory_mib=256, disk_gib=1), start=False
        )
        check_state(host.config, {made.uuid})
        SandboxFiles.of(host.config, "v").overlay.unlink()
        with pytest.raises(AssertionError, match="files of live sandbox v removed"):
            check_state(host.config, {made.uuid})
        manager.hypervisor.undefine("vmsbx-v", uuid=made.uuid)
        with pytest.raises(AssertionError, match="sandboxes lost"):
            check_state(host.config, {made.uuid})
