"""The warm pool's logic against the in-memory hypervisor (tests/framework/fake_hypervisor.py): the
``[pool]`` table and its caps, how a pooled guest is found, shown, drained and reconciled, and
which creates claim one. Files are real, guests are not: a claim that needs the guest's SSH
fails here, which is the path where the half-claimed guest must be removed. test_pool.py boots
real guests for the rest.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import socket
import threading
from dataclasses import replace
from pathlib import Path

import paramiko
import pytest
from framework.fake_hypervisor import IMAGE_ID, FakeHypervisor, unit_config
from framework.fake_pool import pooled_guest
from lxml import etree

from vmsandbox.config import Config, PoolShape, parse_pool
from vmsandbox.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, VmSandboxError
from vmsandbox.guest import control
from vmsandbox.guest.keys import KeyPair, generate
from vmsandbox.guest.programs import control as guest_control
from vmsandbox.guest.ssh import HostKeyMismatch
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.sandbox.record import names_domain
from vmsandbox.sandbox.spec import SandboxSpec
from vmsandbox.vm.domain import CONTROL_PORT

SHAPE = {"image": "tiny", "memory_mib": 256, "disk_gib": 1, "count": 1}


@pytest.fixture
def config(tmp_path: Path) -> Config:
    """A state directory, an image store holding ``tiny``, and a pool of one ``tiny`` guest."""
    return unit_config(tmp_path, pool={"small": SHAPE})


def everything(config: Config, hv: FakeHypervisor) -> list[str]:
    """Every domain and every file of the state directory."""
    files = [str(path) for folder in (config.disks, config.sandboxes) for path in folder.iterdir()]
    return sorted(hv.domains) + files


def test_a_count_names_the_image_and_a_table_names_a_shape() -> None:
    shapes = parse_pool({"minimal": 2, "big": {"image": "minimal", "cpus": 2, "count": 1}})
    assert shapes == (
        PoolShape("minimal", "minimal", 1, 1024, 4, 2),
        PoolShape("big", "minimal", 2, 1024, 4, 1),
    )
    ready = parse_pool({"gpu": {"image": "minimal", "gpus": 2}})
    assert ready == (PoolShape("gpu", "minimal", 1, 1024, 4, 1, gpus=2),)


@pytest.mark.parametrize(
    ("table", "field"),
    [
        ({"minimal": "two"}, "pool.minimal"),
        ({"minimal": -1}, "pool.minimal.count"),
        ({"big": {"image": "minimal", "gpu": 1}}, "pool.big.gpu"),
        ({"big": {"image": "minimal", "gpus": -1}}, "pool.big.gpus"),
        ({"big": {"image": "minimal", "gpus": True}}, "pool.big.gpus"),
        ({"big": {"image": "minimal", "gpus": "2"}}, "pool.big.gpus"),
        ({"big": {"image": "minimal", "cpus": 0}}, "pool.big.cpus"),
        ({"minimal": 1, "again": {"image": "minimal"}}, "pool.again"),
    ],
)
def test_a_bad_pool_entry_names_its_field(table: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        parse_pool(table)
    assert caught.value.details["field"] == field


def test_the_pool_stays_within_the_caps(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="over this host's cap") as caught:
        Config.load(
            path="/nonexistent",
            state_dir=tmp_path,
            max_memory_mib=2048,
            pool={"big": {"image": "minimal", "memory_mib": 4096}},
        )
    assert caught.value.details == {"field": "pool.big.memory_mib", "value": 4096, "max": 2048}


def test_the_pool_table_is_read_from_the_config_file(tmp_path: Path) -> None:
    file = tmp_path / "config.toml"
    file.write_text('[pool]\nminimal = 2\n[pool.big]\nimage = "minimal"\nmemory_mib = 2048\n')
    assert [shape.key for shape in Config.load(file).pool] == ["minimal", "big"]


def test_pool_names_are_kept_for_the_pool(manager: SandboxManager) -> None:
    with pytest.raises(InvalidArgument, match="kept for the warm pool") as caught:
        manager.create(SandboxSpec(name="pool-mine", image="tiny"), wait=False)
    assert caught.value.details["field"] == "name"


def test_a_pooled_guest_is_the_pools_not_a_sandbox(
    manager: SandboxManager, hv: FakeHypervisor
) -> None:
    guest = pooled_guest(manager)
    assert hv.domains[f"vmsbx-{guest}"].state == "pooled"
    assert manager.list() == []
    (shape,) = manager.pool.show()
    assert shape["ready"] == 1 and shape["guests"] == [{"name": guest, "state": "pooled"}]


def test_a_spec_the_pool_does_not_match_boots_cold(
    manager: SandboxManager, hv: FakeHypervisor
) -> None:
    guest = pooled_guest(manager)
    other = SandboxSpec(name="cold", image="tiny", memory_mib=512, disk_gib=1)
    sandbox = manager.create(other, wait=False)
    assert sandbox.domain == "vmsbx-cold"
    assert hv.domains[f"vmsbx-{guest}"].state == "pooled"  # left for a spec of its shape


def test_a_create_finding_no_ready_guest_boots_cold(
    manager: SandboxManager, hv: FakeHypervisor
) -> None:
    hit = SandboxSpec(name="cold", image="tiny", memory_mib=256, disk_gib=1)
    sandbox = manager.create(hit, wait=False)
    assert sandbox.domain == "vmsbx-cold" and sorted(hv.domains) == ["vmsbx-cold"]


def test_a_claim_that_fails_removes_the_guest_it_took(
    manager: SandboxManager, config: Config, hv: FakeHypervisor
) -> None:
    """The guest's sshd is not there: the claim's hostname step fails; the half-claimed guest
    is taken apart (it never goes back to the pool) and nothing is left."""
    pooled_guest(manager)
    stages: list[str] = []
    manager.checkpoint = stages.append
    with pytest.raises(VmSandboxError):
        manager.create(SandboxSpec(name="hit", image="tiny", memory_mib=256, disk_gib=1))
    assert stages[:3] == ["look", "locked", "claim"]
    assert everything(config, hv) == []


def test_a_claimed_guest_is_found_by_its_sandbox_name(
    manager: SandboxManager, config: Config, hv: FakeHypervisor
) -> None:
    """A claim killed after its claim step: the record names the sandbox, the domain and the
    files keep the guest's name; get, list and destroy find it by the sandbox's name."""
    guest = pooled_guest(manager)
    dom = hv.domains[f"vmsbx-{guest}"]
    assert dom.data is not None
    dom.data.update(name="hit", guest=guest)
    dom.state = "ready"
    sandbox = manager.get("hit")
    assert sandbox.domain == f"vmsbx-{guest}" and sandbox.key_file.parent.name == guest
    assert [s.name for s in manager.list()] == ["hit"] and manager.pool.show()[0]["guests"] == []
    manager.destroy("hit")
    assert everything(config, hv) == []


def test_stop_and_start_of_a_claimed_sandbox_act_on_its_guests_domain(
    manager: SandboxManager, hv: FakeHypervisor
) -> None:
    """sandbox/power.py finds a claimed sandbox by its record: stop and start act on the pooled
    guest's domain, and the record keeps the sandbox's name and its guest."""
    guest = pooled_guest(manager)
    dom = hv.domains[f"vmsbx-{guest}"]
    assert dom.data is not None and dom.running
    dom.data.update(name="hit", guest=guest)
    dom.state = "ready"
    assert manager.stop("hit", grace=0.1).state == "stopped" and not dom.running
    started = manager.start("hit", wait=False)
    assert (started.name, started.domain, started.state) == ("hit", f"vmsbx-{guest}", "starting")
    assert dom.running and dom.data["guest"] == guest and dom.data["name"] == "hit"


def test_a_pooled_guest_cannot_be_stopped_or_started_as_a_sandbox(
    manager: SandboxManager, hv: FakeHypervisor
) -> None:
    guest = pooled_guest(manager)
    for act in (manager.stop, manager.start):
        with pytest.raises(FailedPrecondition, match="is a guest of the warm pool"):
            act(guest)
    assert hv.domains[f"vmsbx-{guest}"].running


def test_reconcile_removes_a_half_claimed_or_half_filled_guest(
    manager: SandboxManager, config: Config, hv: FakeHypervisor
) -> None:
    dead = {"pid": 1, "start": "0", "boot": "another boot"}
    claimed, filling = pooled_guest(manager), pooled_guest(manager)
    for guest, name in ((claimed, "hit"), (filling, filling)):
        dom = hv.domains[f"vmsbx-{guest}"]
        assert dom.data is not None
        dom.data.update(name=name, guest=guest if name != guest else None, creator=dead)
        dom.state = "creating"
        (config.state_dir / "holds" / f"{dom.uuid}.json").unlink()  # made before them
    assert sorted(manager.reconcile()["removed"]) == sorted(["hit", filling])
    assert everything(config, hv) == []


def test_drain_removes_every_unclaimed_guest(
    manager: SandboxManager, config: Config, hv: FakeHypervisor
) -> None:
    guests = sorted([pooled_guest(manager), pooled_guest(manager)])
    assert sorted(manager.pool.drain()) == guests
    assert everything(config, hv) == []


def test_a_claimed_record_is_ours_only_in_its_guests_domain() -> None:
    claimed = {"name": "hit", "guest": "pool-1234"}
    assert names_domain(claimed, "vmsbx-pool-1234")
    assert not names_domain(claimed, "vmsbx-hit")
    assert not names_domain({"name": "hit", "guest": "../etc"}, "vmsbx-../etc")


def test_a_fill_replaces_guests_of_an_older_image_build(
    manager: SandboxManager, config: Config, hv: FakeHypervisor
) -> None:
    """A rebuilt image: no create claims the old build's guests, so a fill removes them and
    counts only guests of the current build (the new one is not waited for here)."""
    old = pooled_guest(manager)
    dom = hv.domains[f"vmsbx-{old}"]
    assert dom.data is not None
    dom.data["image_id"] = "00000000000000bb"

    class Stop(Exception):
        """Ends the fill once its new guest is defined (there is no guest to wait for)."""

    def stop_at_define(stage: str) -> None:
        if stage == "define":
            raise Stop(stage)

    manager.checkpoint = stop_at_define
    with pytest.raises(Stop):
        manager.pool.fill()
    assert everything(config, hv) == []  # the old guest removed, the new one undone


# -- the claim through the control channel ----------------------------------------------------


# What a guest of an older build (its control channel knows only "hostname NAME") answers to a
# claim request.
OLDER_ANSWER = b"error: unknown request 'claim' (the only one is 'hostname NAME')\n"


class FakeGuest:
    """What a claim talks to in a guest of an image with the control channel, on the host: the
    guest tool's own request handling behind the channel's socket (the names it would set are
    recorded; ``sshd`` says whether its sshd runs; ``older``: a build whose channel knows only
    the hostname request), and a paramiko SSH server showing ``host_key`` on the record's SSH
    port (``ssh_knocks`` counts the connections it got)."""

    def __init__(
        self,
        config: Config,
        guest: str,
        port: int,
        host_key: KeyPair,
        *,
        sshd: bool = True,
        older: bool = False,
    ) -> None:
        self.names: list[str] = []
        self.sshd_runs = sshd
        self.older = older
        self.ssh_knocks = 0
        self.control = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.control.bind(str(config.sandboxes / guest / "control.sock"))
        self.control.listen(1)
        self.sshd = socket.create_server(("127.0.0.1", port))
        key = paramiko.Ed25519Key.from_private_key(io.StringIO(host_key.private_openssh))
        self.threads = [
            threading.Thread(target=self._serve_control, daemon=True),
            threading.Thread(target=self._serve_ssh, args=(key,), daemon=True),
        ]
        for thread in self.threads:
            thread.start()

    def _serve_control(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.control.accept()
                with conn:
                    line = conn.makefile("rb").readline()
                    if self.older and line.startswith(b"claim "):
                        conn.sendall(OLDER_ANSWER)
                        continue
                    sshd = (lambda: None) if self.sshd_runs else (lambda: "sshd is not running")
                    conn.sendall(guest_control.answer(line, self.names.append, sshd))

    def _serve_ssh(self, key: paramiko.PKey) -> None:
        with contextlib.suppress(OSError, EOFError, paramiko.SSHException):
            conn, _ = self.sshd.accept()
            self.ssh_knocks += 1
            transport = paramiko.Transport(conn)
            transport.add_server_key(key)
            transport.start_server(server=paramiko.ServerInterface())
            while transport.is_active():  # until the client closes it
                transport.join(0.05)

    def close(self) -> None:
        for listener in (self.control, self.sshd):
            with contextlib.suppress(OSError):  # wakes an accept() still waiting
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        for thread in self.threads:
            thread.join(10)


def channel_guest(manager: SandboxManager, config: Config, hv: FakeHypervisor) -> str:
    """A pooled guest of an image that serves the control channel."""
    meta_path = config.images / "tiny" / IMAGE_ID / "meta.json"
    meta_path.write_text(
        json.dumps({**json.loads(meta_path.read_text()), "guest_tools": ["control.py"]})
    )
    return pooled_guest(manager)


def test_a_claim_is_one_request_on_the_control_channel(
    manager: SandboxManager, config: Config, hv: FakeHypervisor
) -> None:
    """No SSH at all: the guest takes the name once it has checked that its sshd runs (its
    pinned host key was proven when it entered the pool); the sandbox says where the claim's
    time went, step by step."""
    guest = channel_guest(manager, config, hv)
    dom = hv.domains[f"vmsbx-{guest}"]
    assert dom.data is not None
    fake = FakeGuest(config, guest, dom.data["ssh"]["port"], generate("h"))
    try:
        sandbox = manager.create(SandboxSpec(name="hit", image="tiny", memory_mib=256, disk_gib=1))
    finally:
        fake.close()
    assert (sandbox.name, sandbox.domain, sandbox.state) == ("hit", f"vmsbx-{guest}", "ready")
    assert (fake.names, fake.ssh_knocks) == (["hit"], 0)
    assert sandbox.stage_seconds is not None
    assert list(sandbox.stage_seconds) == [
        "look",
        "host lock wait",
        "claim",
        "taken",
        "restore",
        "hostname",
        "ready",
    ]
    assert all(seconds >= 0 for seconds in sandbox.stage_seconds.values())
    assert sandbox.to_dict()["stage_seconds"] == sandbox.stage_seconds


def test_a_claim_of_a_guest_whose_sshd_died_fails_and_leaves_nothing(
    manager: SandboxManager, config: Config, hv: FakeHypervisor
) -> None:
    guest = channel_guest(manager, config, hv)
    dom = hv.domains[f"vmsbx-{guest}"]
    assert dom.data is not None
    fake = FakeGuest(config, guest, dom.data["ssh"]["port"], generate("h"), sshd=False)
    try:
        with pytest.raises(FailedPrecondition, match=r"refused hostname 'hit' .*sshd is not"):
            manager.create(SandboxSpec(name="hit", image="tiny", memory_mib=256, disk_gib=1))
    finally:
        fake.close()
    assert fake.names == []
    assert everything(config, hv) == []


def test_a_claim_of_an_older_builds_guest_sets_the_hostname_and_proves_the_host_key(
    manager: SandboxManager, config: Config, hv: FakeHypervisor
) -> None:
    """A guest whose channel knows only the hostname request: the name goes through the
    channel, and a key exchange proves the guest's sshd shows the pinned host key."""
    guest = channel_guest(manager, config, hv)
    dom = hv.domains[f"vmsbx-{guest}"]
    channel = etree.fromstring(dom.xml.encode()).find("devices/channel")
    assert channel is not None and channel.find("target").get("name") == CONTROL_PORT
    assert channel.find("source").get("path") == str(config.sandboxes / guest / "control.sock")
    host = generate("h")
    (config.sandboxes / guest / "known_hosts").write_text(f"vmsbx-{guest} {host.public_openssh}\n")
    assert dom.data is not None
    fake = FakeGuest(config, guest, dom.data["ssh"]["port"], host, older=True)
    try:
        sandbox = manager.create(SandboxSpec(name="hit", image="tiny", memory_mib=256, disk_gib=1))
    finally:
        fake.close()
    assert (sandbox.name, sandbox.domain, sandbox.state) == ("hit", f"vmsbx-{guest}", "ready")
    assert (fake.names, fake.ssh_knocks) == (["hit"], 1)


def test_a_claim_whose_guest_shows_another_host_key_fails_and_leaves_nothing(
    manager: SandboxManager, config: Config, hv: FakeHypervisor
) -> None:
    guest = channel_guest(manager, config, hv)
    dom = hv.domains[f"vmsbx-{guest}"]
    assert dom.data is not None
    pinned_not = generate("not the pinned one")
    fake = FakeGuest(config, guest, dom.data["ssh"]["port"], pinned_not, older=True)
    try:
        with pytest.raises(HostKeyMismatch, match=f"not the key pinned for vmsbx-{guest}"):
            manager.create(SandboxSpec(name="hit", image="tiny", memory_mib=256, disk_gib=1))
    finally:
        fake.close()
    assert everything(config, hv) == []


def test_a_claim_whose_channel_is_silent_fails_by_deadline_and_leaves_nothing(
    manager: SandboxManager, config: Config, hv: FakeHypervisor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The socket is there (QEMU listens) but nothing in the guest answers."""
    monkeypatch.setattr(control, "TIMEOUT_S", 0.2)
    guest = channel_guest(manager, config, hv)
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.bind(str(config.sandboxes / guest / "control.sock"))
    silent.listen(1)
    try:
        with pytest.raises(DeadlineExceeded, match="did not answer on its control channel"):
            manager.create(SandboxSpec(name="hit", image="tiny", memory_mib=256, disk_gib=1))
    finally:
        silent.close()
    assert everything(config, hv) == []


def test_a_burst_of_claims_starts_no_second_filler(manager: SandboxManager, config: Config) -> None:
    """While a filler holds the fill lock, a claim's refill starts no process (a burst of
    claims used to start one ``pool fill`` each)."""
    with open(config.state_dir / "pool-fill.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for _ in range(5):
            manager.pool.refill_in_background()
    assert not (config.state_dir / "pool-fill.log").exists()  # no process was started


def test_a_cold_create_starts_a_refill_when_the_pool_is_short(
    manager: SandboxManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a ``--no-refill`` claim or a burst, later cold creates never refilled the pool
    (issue 42, point 8): a create that boots cold now starts one while the pool is short."""
    started: list[str] = []
    monkeypatch.setattr(manager.pool, "refill_in_background", lambda: started.append("fill"))
    cold = SandboxSpec(name="cold", image="tiny", memory_mib=512, disk_gib=1)
    manager.create(cold, wait=False, refill=False)
    assert started == []
    manager.create(replace(cold, name="cold2"), wait=False)
    assert started == ["fill"]
    pooled_guest(manager)  # the pool is full now: nothing to refill
    manager.create(replace(cold, name="cold3"), wait=False)
    assert started == ["fill"]
