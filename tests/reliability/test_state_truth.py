"""State truth and tenant isolation: the paths that once lost sandboxes or crossed tenants, each
replayed. Reconcile and image users on a listing cut short by libvirt (its test driver, a real
connection closed as libvirtd's would be); IOMMU groups and reset methods on umockdev hosts; a
pool miss, a drain and a claim interleaved on the in-memory hypervisor; a cleanup that cannot
get the lock; a guest that drops its SSH session (a real paramiko server); the socket folder of
``serve``; discovery outside the host lock. docs/architecture-rules.md says which rule each
one keeps.
"""

from __future__ import annotations

import contextlib
import io
import os
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import libvirt
import paramiko
import pytest
from framework.crash import kill9, start_create, stop_and_clean
from framework.fake_hosts import inventory_from_dict, probe
from framework.fake_hypervisor import FakeHypervisor, refuse, unit_config
from framework.fake_pool import pooled_guest
from framework.sandboxes import leftovers

from vmsandbox.config import Config
from vmsandbox.errors import (
    AlreadyExists,
    FailedPrecondition,
    GuestVerificationFailed,
    NotFound,
    Unavailable,
)
from vmsandbox.gpu import allocator
from vmsandbox.gpu.request import GpuRequest
from vmsandbox.guest import ssh
from vmsandbox.guest.keys import SandboxKeys
from vmsandbox.guest.ssh import Endpoint, ExecResult
from vmsandbox.host.model import Inventory
from vmsandbox.image.store import ImageStore
from vmsandbox.image.users import image_users
from vmsandbox.openshell.socket import prepare_socket_path
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.sandbox.record import SandboxFiles
from vmsandbox.sandbox.spec import SandboxSpec, generate_name
from vmsandbox.vm.hypervisor import LibvirtHypervisor

SHAPE = {"image": "tiny", "memory_mib": 256, "disk_gib": 1, "count": 1}
HOLD_LOCK = (
    "import sys, time; from pathlib import Path; from vmsandbox.lock import host_lock\n"
    "with host_lock(Path(sys.argv[1])):\n"
    "    print('held', flush=True); time.sleep(float(sys.argv[2]))\n"
)


def spec(name: str = "unit") -> SandboxSpec:
    return SandboxSpec(name=name, image="tiny", memory_mib=256, disk_gib=1)


def left(config: Config, hv: FakeHypervisor, name: str = "unit") -> list[str]:
    found = [str(path) for path in SandboxFiles.of(config, name).existing()]
    return found + [domain for domain in hv.domains if domain == f"vmsbx-{name}"]


# -- 1. fail closed --------------------------------------------------------------------------------


class _CutShort:
    """A libvirt connection whose daemon goes away right after it has listed the domains:
    the listing comes back, and every read of a domain after it fails with libvirt's own
    error for a connection that is gone (asked of a connection closed for the purpose)."""

    def __init__(self, real: libvirt.virConnect) -> None:
        self.real = real

    def listAllDomains(self, flags: int = 0) -> list[Any]:
        gone = libvirt.open(self.real.getURI())
        gone.close()
        return [_Unreadable(dom, gone) for dom in self.real.listAllDomains(flags)]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


class _Unreadable:
    """A listed domain whose reads fail as on a connection that is gone."""

    def __init__(self, dom: libvirt.virDomain, gone: libvirt.virConnect) -> None:
        self.dom = dom
        self.gone = gone

    def XMLDesc(self, _flags: int = 0) -> str:
        return str(self.gone.lookupByName(self.dom.name()).XMLDesc(0))  # raises

    def __getattr__(self, name: str) -> Any:
        return getattr(self.dom, name)


class CutShortHypervisor(LibvirtHypervisor):
    """libvirt's test driver, its connection cut short (``_CutShort``) once ``cut`` is set."""

    cut = False

    @property
    def conn(self) -> Any:
        real = super().conn
        return _CutShort(real) if self.cut else real


@pytest.fixture
def test_driver(tmp_path: Path) -> Iterator[Config]:
    """A config on libvirt's test driver (``test:///default``, shared by the connections of
    this process while one stays open)."""
    keeper = libvirt.open("test:///default")
    config = replace(unit_config(tmp_path), uri="test:///default")
    try:
        yield config
    finally:
        for dom in keeper.listAllDomains(0):
            if dom.name().startswith("vmsbx-"):
                with contextlib.suppress(libvirt.libvirtError):
                    dom.undefine()
        keeper.close()


def test_a_listing_cut_short_by_libvirtd_removes_nothing(test_driver: Config) -> None:
    """libvirtd goes away mid-scan: reconcile fails with UNAVAILABLE before it decides
    anything; the sandbox's overlay, seed and keys are all still there. (It used to take the
    short list for the truth and remove the files of a sandbox that still existed.)"""
    hypervisor = CutShortHypervisor(test_driver.uri)
    with SandboxManager(test_driver, hypervisor=hypervisor, reconcile=False) as manager:
        manager.create(spec("kept"), start=False)
        files = SandboxFiles.of(test_driver, "kept")
        before = files.existing()
        assert files.overlay in before and files.seed in before and files.keys_dir in before
        hypervisor.cut = True
        with pytest.raises(Unavailable, match="libvirt is unavailable"):
            manager.reconcile()
        hypervisor.cut = False
        assert files.existing() == before
        assert [s.name for s in manager.list()] == ["kept"]


def test_image_users_fail_closed_when_a_domain_cannot_be_read(test_driver: Config) -> None:
    """``images rm`` and ``prune`` must not see an image as unused because its user could not
    be read."""
    with SandboxManager(test_driver, hypervisor=LibvirtHypervisor(test_driver.uri)) as manager:
        manager.create(spec("user"), start=False)
        store = ImageStore(test_driver.images)
        assert list(image_users(manager.conn, store).values()) == [["user"]]
        with pytest.raises(Unavailable):
            image_users(_CutShort(libvirt.open(test_driver.uri)), store)  # type: ignore[arg-type]


# -- 3. the IOMMU group is the unit; GPUs without a reset method -----------------------------------


@pytest.fixture(scope="module")
def empty_proc(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("proc"))


def discovered(host: str, empty_proc: str, in_use: dict[str, str] | None = None) -> Inventory:
    case = {"use_nvml": False, "proc_root": empty_proc, "in_use": in_use or {}}
    return inventory_from_dict(probe(host, [case])[0]["inventory"])


def test_a_gpu_whose_iommu_group_is_held_is_held_too(empty_proc: str) -> None:
    """Two A6000s behind a switch without ACS share an IOMMU group: with one in a guest, the
    other is held by the same domain, and a one-GPU request takes the A6000 alone in its
    group. (It used to be reported free and picked every time: QEMU then failed, EBUSY.)"""
    held = discovered("shared_group_gpus", empty_proc, {"0000:03:00.0": "vmsbx-one"})
    by_bdf = {gpu.bdf: gpu for gpu in held.gpus}
    assert by_bdf["0000:04:00.0"].in_use_by == "vmsbx-one"
    assert by_bdf["0000:03:00.0"].iommu_group == by_bdf["0000:04:00.0"].iommu_group
    chosen = allocator.select(GpuRequest(count=1), held)
    assert [gpu.bdf for gpu in chosen] == ["0000:21:00.0"]
    free = discovered("shared_group_gpus", empty_proc)
    assert [gpu.bdf for gpu in allocator.select(GpuRequest(count=1), free)] == ["0000:21:00.0"]
    pair = allocator.select(GpuRequest(count=2), free)
    assert [gpu.bdf for gpu in pair] == ["0000:03:00.0", "0000:04:00.0"]  # one whole group


def test_a_gpu_the_kernel_cannot_reset_is_refused(empty_proc: str) -> None:
    """No reset method: the next guest could read the last one's GPU memory."""
    inventory = discovered("no_reset", empty_proc)
    by_bdf = {gpu.bdf: gpu for gpu in inventory.gpus}
    w6800, a4000 = by_bdf["0000:01:00.0"], by_bdf["0000:02:00.0"]
    assert not w6800.bindable
    assert "no reset method" in w6800.reasons[0] and "require_gpu_reset" in w6800.reasons[0]
    assert a4000.bindable
    with pytest.raises(FailedPrecondition, match="no reset method"):
        allocator.select(GpuRequest(devices=("0000:01:00.0",)), inventory)


# -- 2 and 7: identity, on the in-memory hypervisor with a pool ------------------------------------


@pytest.fixture
def pool_config(tmp_path: Path) -> Config:
    return unit_config(tmp_path, pool={"small": SHAPE})


@pytest.fixture
def hv() -> FakeHypervisor:
    return FakeHypervisor()


def answering(_endpoint: Endpoint, _keys: object, _command: str, **_kw: Any) -> ExecResult:
    """A guest whose every command succeeds (a claim's hostname step)."""
    return ExecResult(0, "", "")


class Interleaved(SandboxManager):
    """A manager that runs ``before_take[n]`` just before its n-th take of the host lock: what
    another process does while this one waits for the lock."""

    before_take: dict[int, Callable[[], object]] = {}
    takes = 0

    def locked(self, *args: Any, **kwargs: Any) -> contextlib.AbstractContextManager[None]:
        self.takes += 1
        hook = self.before_take.pop(self.takes, None)
        if hook is not None:
            hook()
        return super().locked(*args, **kwargs)


def test_a_pool_miss_never_removes_a_create_of_the_same_name(
    pool_config: Config, hv: FakeHypervisor
) -> None:
    """No pooled guest is ready: the claim finds none and makes nothing. Another process
    creates 'box' while this one waits for the lock again; this create then fails with
    ALREADY_EXISTS and the other's sandbox stays. (The claim's undo used to remove
    vmsbx-box by name in its second hold of the lock, destroying the other's sandbox.)"""
    other = SandboxManager(pool_config, hypervisor=hv, reconcile=False)
    made: list[Any] = []
    Interleaved.before_take = {2: lambda: made.append(other.create(spec("box"), wait=False))}
    with Interleaved(pool_config, hypervisor=hv, reconcile=False) as manager:
        with pytest.raises(AlreadyExists):
            manager.create(spec("box"), wait=False, refill=False)
        survivor = manager.get("box")
    assert made and survivor.uuid == made[0].uuid
    assert hv.domains["vmsbx-box"].running


def test_a_claimed_guest_is_not_found_by_its_old_name(
    pool_config: Config, hv: FakeHypervisor
) -> None:
    with SandboxManager(pool_config, hypervisor=hv, reconcile=False) as manager:
        manager.pool.guest_run = answering
        guest = pooled_guest(manager)
        claimed = manager.create(spec("hit"), refill=False)
        assert claimed.domain == f"vmsbx-{guest}"
        for act in (manager.get, manager.destroy):
            with pytest.raises(NotFound):
                act(guest)
        assert manager.get("hit").domain == f"vmsbx-{guest}"


def test_drain_beside_a_claim_keeps_the_claimed_sandbox(
    pool_config: Config, hv: FakeHypervisor
) -> None:
    """A claim lands between drain's listing and its removal of that guest: drain leaves the
    sandbox alone. (Drain used to remove it by the guest's name.)"""
    with SandboxManager(pool_config, hypervisor=hv, reconcile=False) as manager:
        manager.pool.guest_run = answering
        guest = pooled_guest(manager)

        def claim_now(domain: str) -> None:
            if domain == f"vmsbx-{guest}" and "metadata" in hv.before:
                del hv.before["metadata"]
                claimer = SandboxManager(pool_config, hypervisor=hv, reconcile=False)
                claimer.pool.guest_run = answering
                claimer.create(spec("hit"), refill=False)

        hv.before["metadata"] = claim_now
        assert manager.pool.drain() == []
        assert manager.get("hit").state == "ready"


def test_drain_that_found_the_guest_just_before_a_claim_leaves_it_running(
    pool_config: Config, hv: FakeHypervisor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The claim commits after drain's teardown looked the guest up and before it took the
    guest over under the lock: the claimed sandbox keeps running. (The teardown used to stop
    the domain it had found before taking the lock.)"""
    with SandboxManager(pool_config, hypervisor=hv, reconcile=False) as manager:
        manager.pool.guest_run = answering
        guest = pooled_guest(manager)
        find = manager.store.find

        def find_then_claim(name: str) -> Any:
            found = find(name)
            if name == guest and found is not None and found.state == "pooled":
                claimer = SandboxManager(pool_config, hypervisor=hv, reconcile=False)
                claimer.pool.guest_run = answering
                claimer.create(spec("hit"), refill=False)
            return found

        monkeypatch.setattr(manager.store, "find", find_then_claim)
        assert manager.pool.drain() == []
        assert manager.get("hit").state == "ready"
        assert hv.running(f"vmsbx-{guest}")


# -- 8: a cleanup that cannot get the lock ---------------------------------------------------------


class ImpatientManager(SandboxManager):
    """A manager that waits half a second for the lock (another process holds it here)."""

    def locked(self, *_args: Any, **_kwargs: Any) -> contextlib.AbstractContextManager[None]:
        from vmsandbox.lock import host_lock

        return host_lock(self.config.lock_path, timeout=0.5)


def test_a_busy_lock_at_cleanup_keeps_the_error_and_leaves_the_rest_to_reconcile(
    tmp_path: Path, hv: FakeHypervisor
) -> None:
    """QEMU fails to start; while the create takes itself apart another process holds the
    lock past the create's wait. The caller gets QEMU's error (the lock's is a note), and the
    sandbox is reconcile's at once although this process lives on. (The lock's timeout used
    to replace the error, and the record stayed 'creating' with a live creator.)"""
    config = unit_config(tmp_path)
    holders: list[subprocess.Popen[str]] = []

    def hold_the_lock(_domain: str) -> None:
        if holders:
            return
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLD_LOCK, str(config.lock_path), "3"],
            stdout=subprocess.PIPE,
            text=True,
        )
        holders.append(holder)
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"

    hv.before["start"] = refuse("libvirt refused: QEMU exited")
    hv.before["stop"] = hold_the_lock
    with (
        ImpatientManager(config, hypervisor=hv, reconcile=False) as manager,
        pytest.raises(FailedPrecondition, match="QEMU exited") as caught,
    ):
        manager.create(spec(), wait=False)
    assert any("left for reconcile" in note for note in caught.value.__notes__)
    assert left(config, hv)  # the domain and files the locked undos could not remove
    holders[0].wait(timeout=30)
    del hv.before["stop"]
    with SandboxManager(config, hypervisor=hv, reconcile=False) as manager:
        assert manager.reconcile()["removed"] == ["unit"]
    assert left(config, hv) == []


# -- 9: a guest that drops its SSH session ---------------------------------------------------------


class DroppingSshd:
    """A real SSH server (paramiko) that logs the client in, then drops the connection when a
    session is opened (``at``="open") or while its command runs (``at``="command")."""

    def __init__(self, host_key: str, at: str, port: int = 0) -> None:
        self.key = paramiko.Ed25519Key.from_private_key(io.StringIO(host_key))
        self.at = at
        self.listener = socket.create_server(("127.0.0.1", port))
        self.port = self.listener.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            transport = paramiko.Transport(conn)
            transport.add_server_key(self.key)
            with contextlib.suppress(paramiko.SSHException, EOFError, OSError):
                transport.start_server(server=_Dropping(conn, self.at))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()


class _Dropping(paramiko.ServerInterface):
    def __init__(self, conn: socket.socket, at: str) -> None:
        self.conn = conn
        self.at = at

    def _drop(self, after: float = 0.0) -> None:
        def cut() -> None:
            threading.Event().wait(after)
            with contextlib.suppress(OSError):
                self.conn.shutdown(socket.SHUT_RDWR)
            self.conn.close()

        threading.Thread(target=cut, daemon=True).start()

    def get_allowed_auths(self, username: str) -> str:
        return "publickey"

    def check_auth_publickey(self, username: str, key: paramiko.PKey) -> int:
        return paramiko.AUTH_SUCCESSFUL

    def check_channel_request(self, kind: str, chanid: int) -> int:
        if self.at == "open":
            self._drop()
        return paramiko.OPEN_SUCCEEDED

    def check_channel_exec_request(self, channel: paramiko.Channel, command: bytes) -> bool:
        self._drop(after=0.2)
        return True


@pytest.mark.parametrize("at", ["open", "command"])
def test_a_guest_dropping_its_ssh_session_is_unavailable(tmp_path: Path, at: str) -> None:
    """A session the guest drops is UNAVAILABLE, at once: never paramiko's own exception
    (which reached the OpenShell driver as UNKNOWN), never a wait until the timeout."""
    keys, _client, host = SandboxKeys.create(tmp_path / "keys", "vmsbx-t")
    sshd = DroppingSshd(host.private_openssh, at)
    try:
        endpoint = Endpoint("127.0.0.1", sshd.port, "sandbox")
        with pytest.raises(Unavailable, match=r"SSH session at 127\.0\.0\.1:\d+ broke"):
            ssh.run(endpoint, keys, "sleep 5", timeout=60)
    finally:
        sshd.close()


def test_a_wait_whose_guest_drops_ssh_ends_failed(
    tmp_path: Path, hv: FakeHypervisor, empty_proc: str
) -> None:
    """The readiness wait of a started GPU sandbox: sshd lets the key in, then drops the
    session of each in-guest check. The wait ends with the verification's failure, each check
    saying the session broke, and the sandbox's record has the report (the raw paramiko
    error used to end the OpenShell driver's readiness thread and leave the sandbox starting
    for good)."""
    config = unit_config(tmp_path)
    board = discovered("no_reset", empty_proc)

    class OnBoard(SandboxManager):
        def gpus(self, in_use: Any = None) -> Inventory:
            return board

    with OnBoard(config, hypervisor=hv, reconcile=False) as manager:
        gpu = GpuRequest(devices=("0000:02:00.0",))
        made = manager.create(replace(spec(), gpu=gpu), wait=False)
        assert made.ssh is not None
        host = SandboxKeys.create(tmp_path / "host", "vmsbx-unit")[2]
        known = SandboxFiles.of(config, "unit").keys_dir / "known_hosts"
        known.write_text((tmp_path / "host" / "known_hosts").read_text())
        sshd = DroppingSshd(host.private_openssh, "open", port=made.ssh.port)
        try:
            with pytest.raises(GuestVerificationFailed, match="could not run 'lspci': the guest"):
                manager.wait("unit", timeout=60)
        finally:
            sshd.close()
        waited = manager.get("unit")
    assert waited.state == "ready" and waited.verification is not None
    assert not waited.verification["ok"]
    assert "SSH session at 127.0.0.1" in str(waited.verification["problems"])


# -- 10: the socket folder of ``serve`` ------------------------------------------------------------


def test_the_socket_folder_that_exists_keeps_its_mode(tmp_path: Path) -> None:
    """``serve --openshell-socket /run/x.sock`` must not make /run 0700."""
    shared = tmp_path / "run"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o1777)
    prepare_socket_path(shared / "x.sock", shared=False)
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777
    made = tmp_path / "own" / "x.sock"
    prepare_socket_path(made, shared=False)
    assert stat.S_IMODE(made.parent.stat().st_mode) == 0o700


# -- 12: slow work outside the host lock -----------------------------------------------------------


def test_gpu_discovery_runs_outside_the_host_lock(
    tmp_path: Path, hv: FakeHypervisor, empty_proc: str
) -> None:
    """Discovery (NVML, the scan of host processes, every domain's XML) happens before the
    create takes the lock: another process can take the lock meanwhile."""
    config = unit_config(tmp_path)
    board = discovered("no_reset", empty_proc)
    free_while_discovering: list[bool] = []

    class Probing(SandboxManager):
        def gpus(self, in_use: Any = None) -> Inventory:
            taken = subprocess.run(
                ["flock", "--nonblock", str(config.lock_path), "true"], check=False
            )
            free_while_discovering.append(taken.returncode == 0)
            return board

    with Probing(config, hypervisor=hv, reconcile=False) as manager:
        gpu = GpuRequest(devices=("0000:02:00.0",))
        manager.create(replace(spec(), gpu=gpu), start=False)
    assert free_while_discovering == [True]


def test_the_drivers_listing_asks_its_guests_at_once(
    tmp_path: Path, hv: FakeHypervisor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A listing of four ready sandboxes asks the four guests for their state at the same
    time: each query waits at a barrier that only four queries at once can pass (one after the
    other, each would give up, and the snapshots would lack the guests' state)."""
    from framework.openshell_client import Unwatched

    from vmsandbox.openshell import service, snapshots
    from vmsandbox.openshell.socket import Peers
    from vmsandbox.sandbox.record import STATE_READY

    config = unit_config(tmp_path)
    together = threading.Barrier(4, timeout=20)

    def query(_endpoint: Endpoint, _keys: object, _command: str, **_kw: Any) -> ExecResult:
        together.wait()  # BrokenBarrierError, when fewer arrive, fails the test below
        return ExecResult(0, "", "")

    monkeypatch.setattr(snapshots, "ssh_run", query)
    asked: list[object] = []
    real_state = snapshots.guest_state
    monkeypatch.setattr(snapshots, "guest_state", lambda out: asked.append(out) or real_state(out))
    with SandboxManager(config, hypervisor=hv, reconcile=False) as manager:
        for n in range(4):
            made = manager.create(spec(f"s{n}"), wait=False)
            record, _state = manager.store.get(made.name)
            manager.store.put(record, STATE_READY)
        driver = service.ComputeDriver(config, Unwatched(), manager=lambda: manager, peers=Peers())
        driver.snapshots.many(manager, manager.list())
    assert len(asked) == 4 and not together.broken


# -- a creator in another PID namespace ------------------------------------------------------------


def test_a_create_in_another_pid_namespace_is_left_alone_while_it_runs(config: Config) -> None:
    """A create running in a PID namespace of its own (a container) is alive to a reconcile
    on the host, whose pids are not its own: its owner file is what tells. Once it is
    killed, reconcile removes what it left. (Its pid read as another process's, so reconcile
    took a running create apart.)"""
    name = generate_name("t")
    prefix = ("unshare", "--pid", "--fork", "--mount-proc")
    proc = start_create(config, name, "start", "--no-wait", prefix=prefix)
    try:
        with SandboxManager(config, reconcile=False) as manager:
            assert name not in manager.reconcile()["removed"]
            assert leftovers(config, name)
            kill9(proc)
            assert name in manager.reconcile()["removed"]
        assert leftovers(config, name) == []
    finally:
        stop_and_clean(proc, config, name)
