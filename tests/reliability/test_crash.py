"""Killed creates and reconcile: a ``vmsandbox create`` killed with SIGKILL at any point leaves
nothing behind once reconcile has run, the host lock is free at once, and reconcile never
touches a domain that is not a sandbox of its own state directory. A ``suspend`` or ``resume``
killed around libvirt's save or restore leaves a sandbox that runs or is suspended, never
half-way.

The kills use the manager's crash checkpoints: tests/framework/crash_cli.py runs the CLI with a
checkpoint that, at the given stage, prints ``vmsandbox-checkpoint <stage>`` on stderr and waits
there to be killed. Kills at ``start`` (with or without waiting for SSH) leave a running QEMU behind
(libvirtd's child, not ours), which reconcile must stop.
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
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import libvirt
import pytest
from framework.crash import SMALL, force_remove, kill9, start_cli, start_create, stop_and_clean
from framework.fake_hosts import umockdev_run
from framework.sandboxes import cli, cli_env, leftovers

from vmsandbox.config import Config
from vmsandbox.errors import FailedPrecondition
from vmsandbox.lock import host_lock
from vmsandbox.sandbox.holds import Holds
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.sandbox.record import SandboxFiles
from vmsandbox.sandbox.spec import SandboxSpec, generate_name
from vmsandbox.vm import domain as domain_xml

# Checkpoints after the lock is taken and after create steps (sandbox/create.py); "waiting" is
# the "start" checkpoint of a create that would wait for SSH next.
STAGES = ("locked", "overlay", "define", "start", "waiting")
KILLS_PER_STAGE = 4  # 20 kills in one run
NO_WAIT = ("--no-wait",)


def reconcile_cli(config: Config) -> dict[str, list[str]]:
    done = cli("reconcile", "--json", config=config)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def assert_lock_free(config: Config) -> None:
    """The host lock is taken within a second: no dead holder keeps it."""
    started = time.monotonic()
    with host_lock(config.lock_path, timeout=1.0):
        pass  # taking it is the test
    assert time.monotonic() - started < 1.0


def domain_exists(uri: str, domain: str) -> bool:
    conn = libvirt.open(uri)
    try:
        conn.lookupByName(domain)
        return True
    except libvirt.libvirtError:
        return False
    finally:
        conn.close()


@pytest.fixture
def own_state(config: Config) -> Iterator[Config]:
    """A second state directory on the same libvirtd (as a second installation would have)."""
    root = Path(tempfile.mkdtemp(prefix="vmsbx-rel-", dir="/var/tmp"))
    os.chmod(root, 0o711)
    yield replace(config, state_dir=root / "state")
    shutil.rmtree(root, ignore_errors=True)


# -- kills ------------------------------------------------------------------------------------


def test_kill_9_at_random_stages_then_reconcile_leaves_nothing(config: Config) -> None:
    """20 creates killed at checkpoints in random order: after each, reconcile removes every
    trace (domain, QEMU, overlay, seed, keys, console log) and the lock is free."""
    seed = int(os.environ.get("VMSANDBOX_CRASH_SEED") or random.SystemRandom().randrange(2**32))
    print(f"crash seed {seed} (rerun with VMSANDBOX_CRASH_SEED={seed})")
    rng = random.Random(seed)
    stages = list(STAGES) * KILLS_PER_STAGE
    rng.shuffle(stages)
    for round_, stage in enumerate(stages):
        name = f"t-{rng.getrandbits(32):08x}"
        where = f"kill {round_} at {stage!r}, sandbox {name}, seed {seed}"
        waits = stage == "waiting"
        proc = start_create(config, name, "start" if waits else stage, *(() if waits else NO_WAIT))
        try:
            kill9(proc)
            report = reconcile_cli(config)
            if stage != "locked":  # killed at 'locked' it had made nothing yet
                assert name in report["removed"], where
            assert leftovers(config, name) == [], where
            assert_lock_free(config)
        finally:
            if leftovers(config, name):
                force_remove(config, name)


# Where a suspend or resume process is killed, and what the next reconcile makes of the
# sandbox: state, whether its guest runs, whether libvirt keeps its save.
BOOT_ID = "/proc/sys/kernel/random/boot_id"
SUSPEND_KILLS = (
    ("suspend", "before-save", ("ready", True, False)),  # nothing saved: it runs on
    ("suspend", "after-save", ("suspended", False, True)),  # saved: the suspend is finished
    ("resume", "before-start", ("suspended", False, True)),  # nothing restored: still saved
    ("resume", "after-start", ("ready", True, False)),  # restored: it runs
)


def test_kill_9_mid_suspend_or_resume_leaves_a_sandbox_running_or_suspended(
    config: Config,
) -> None:
    """A ``vmsandbox suspend`` or ``resume`` killed with SIGKILL around libvirt's save or
    restore: reconcile settles the sandbox as running (ready) or suspended, never half-way,
    with its hold free; its guest's memory is intact (the same boot, a file written to its
    tmpfs before answers after) and a later suspend and resume work; destroy leaves nothing."""
    name = generate_name("t")
    done = cli("create", name, *SMALL, config=config)
    assert done.returncode == 0, done.stderr
    try:
        memory = f"echo kept > /dev/shm/kept; cat {BOOT_ID}"
        done = cli("exec", name, "--", "sh", "-c", memory, config=config)  # tmpfs: memory only
        assert done.returncode == 0, done.stderr
        boot = done.stdout.strip()
        for command, stage, (state, runs, saved) in SUSPEND_KILLS:
            where = f"{command} killed at {stage}"
            kill9(start_cli(config, stage, command, name))
            report = reconcile_cli(config)
            assert name not in report["removed"], where
            with SandboxManager(config, reconcile=False) as manager:
                sandbox = manager.get(name)
                hv = manager.hypervisor
                assert sandbox.state == state, where
                assert hv.running(sandbox.domain) is runs, where
                assert (hv.saved(sandbox.domain) is not None) is saved, where
                hold = Holds(config).all()[sandbox.uuid]
                assert hold.owner is None and hold.doing == "", where
                assert hold.saved_bytes > 0 if saved else hold.saved_bytes == 0, where
            assert_lock_free(config)
        done = cli("exec", name, "--", "sh", "-c", "cat /dev/shm/kept " + BOOT_ID, config=config)
        assert (done.returncode, done.stdout.split()) == (0, ["kept", boot]), done.stderr
        for command in ("suspend", "resume"):
            done = cli(command, name, config=config)
            assert done.returncode == 0, done.stderr
        done = cli("destroy", name, config=config)
        assert done.returncode == 0, done.stderr
        assert leftovers(config, name) == []
    finally:
        if leftovers(config, name):
            force_remove(config, name)


@pytest.mark.parametrize("tool", ["qemu-img", "genisoimage"])
def test_kill_9_inside_a_helper_tool_leaves_nothing_anywhere(
    config: Config, tmp_path: Path, tool: str
) -> None:
    """Killed while ``qemu-img`` writes the overlay or ``genisoimage`` the seed (the seed holds
    the guest's private host key): nothing is left in the state directory nor in TMPDIR."""
    shims, tmp = tmp_path / "bin", tmp_path / "tmp"
    shims.mkdir()
    tmp.mkdir()
    marker = tmp_path / "tool-started"
    shim = shims / tool
    real = shutil.which(tool)
    shim.write_text(
        "#!/bin/sh\n"
        f'[ "$1" = create ] || [ "{tool}" = genisoimage ] || exec {real} "$@"\n'
        'for arg; do case "$arg" in *.partial) echo half > "$arg";; esac; done\n'
        f"echo started > {marker}\n"
        "exec sleep 600\n"
    )
    shim.chmod(0o755)
    name = generate_name("t")
    env = cli_env(config, PATH=f"{shims}:{os.environ['PATH']}", TMPDIR=str(tmp))
    proc = subprocess.Popen(
        [sys.executable, "-m", "vmsandbox.cli", "create", name, *SMALL, "--no-wait"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()[1].decode()
            assert time.monotonic() < deadline, f"{tool} was never run"
            time.sleep(0.05)
        kill9(proc)
        reconcile_cli(config)
        assert leftovers(config, name) == []
        assert sorted(p.name for p in tmp.iterdir()) == []
        assert_lock_free(config)
    finally:
        stop_and_clean(proc, config, name)


def test_a_killed_creator_not_yet_reaped_counts_as_dead(config: Config) -> None:
    """A gateway that kills a create and reconciles before it reaps the child: the zombie is
    not a live creator, so its half-made sandbox is removed."""
    name = generate_name("t")
    proc = start_create(config, name, "define", "--no-wait")
    try:
        os.kill(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with SandboxManager(config, reconcile=False) as manager:
            report = manager.reconcile()
        assert name in report["removed"]
        assert leftovers(config, name) == []
    finally:
        stop_and_clean(proc, config, name)


def test_gpu_create_killed_at_defined_frees_the_gpu_after_reconcile(config: Config) -> None:
    """On a fake HGX H100 host: a ``create --gpu`` killed with its domain defined holds a GPU
    (a ``<hostdev>``); reconcile removes the domain and the GPU shows free again."""
    name = generate_name("t")
    # The inventory without the reconcile that opening a manager runs (which would already
    # free the GPU), so that the held GPU can be seen first.
    inventory = (
        "import json; from vmsandbox.sandbox.manager import SandboxManager;"
        "print(json.dumps(SandboxManager(reconcile=False).gpus().to_dict()))"
    )

    def in_use(argv: list[str], env: dict[str, str]) -> dict[str, str | None]:
        done = subprocess.run(
            [*argv, sys.executable, "-c", inventory],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return {gpu["bdf"]: gpu["in_use_by"] for gpu in json.loads(done.stdout)["gpus"]}

    def gpus_cli(argv: list[str], env: dict[str, str]) -> dict[str, str | None]:
        done = subprocess.run(
            [*argv, sys.executable, "-m", "vmsandbox.cli", "gpus", "--json"],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return {gpu["bdf"]: gpu["in_use_by"] for gpu in json.loads(done.stdout)["gpus"]}

    with umockdev_run("hgx_h100") as (argv, fake_env):
        env = {**fake_env, **cli_env(config)}
        proc = start_create(config, name, "define", "--gpu", "--no-wait", prefix=argv, env=env)
        try:
            kill9(proc)
            held = [bdf for bdf, user in in_use(argv, env).items() if user == f"vmsbx-{name}"]
            assert len(held) == 1, "the killed create's domain should hold one GPU"
            assert name in reconcile_cli(config)["removed"]
            assert gpus_cli(argv, env)[held[0]] is None
            assert leftovers(config, name) == []
        finally:
            stop_and_clean(proc, config, name)


# -- reconcile --------------------------------------------------------------------------------


def _bare_domain_xml(name: str, metadata: str = "") -> str:
    return (
        f"<domain type='qemu'><name>{name}</name><uuid>{uuid.uuid4()}</uuid>"
        f"<metadata>{metadata}</metadata><memory unit='MiB'>64</memory>"
        "<os><type arch='x86_64'>hvm</type></os></domain>"
    )


def _record_xml(record: object, state: str) -> str:
    from xml.sax.saxutils import escape, quoteattr

    return (
        f'<vmsandbox:sandbox xmlns:vmsandbox="{domain_xml.METADATA_NS}" '
        f"state={quoteattr(state)}>{escape(json.dumps(record))}</vmsandbox:sandbox>"
    )


@pytest.fixture
def define_domain(config: Config) -> Iterator[Callable[..., str]]:
    """Define (never start) hand-made domains; undefine exactly those afterwards."""
    conn = libvirt.open(config.uri)
    made: list[str] = []

    def define(name: str, metadata: str = "") -> str:
        conn.defineXML(_bare_domain_xml(name, metadata))
        made.append(name)
        return name

    yield define
    for name in made:
        with contextlib.suppress(libvirt.libvirtError):
            conn.lookupByName(name).undefine()
    conn.close()


def test_reconcile_never_touches_domains_that_are_not_ours(
    manager: SandboxManager, config: Config, define_domain: Callable[..., str]
) -> None:
    """A foreign domain, and one with our prefix but no vmsandbox metadata, survive reconcile
    from the API and the CLI; destroy refuses the second."""
    token = uuid.uuid4().hex[:8]
    foreign = define_domain(f"t-foreign-{token}")
    lookalike = define_domain(f"vmsbx-{token}")
    manager.reconcile()
    assert cli("reconcile", config=config).returncode == 0
    assert domain_exists(config.uri, foreign)
    assert domain_exists(config.uri, lookalike)
    with pytest.raises(FailedPrecondition, match="not made by vmsandbox"):
        manager.destroy(token)
    assert domain_exists(config.uri, lookalike)
    assert token not in [s.name for s in manager.list()]


def test_reconcile_ignores_records_that_do_not_name_their_own_domain(
    own_state: Config, define_domain: Callable[..., str]
) -> None:
    """Metadata is read as file paths: a half-made record whose name walks out of the state
    directory, or names another sandbox, must never make reconcile delete those files."""
    cfg = own_state
    token = uuid.uuid4().hex[:8]
    with SandboxManager(cfg, reconcile=False) as manager:
        pass  # makes the state directory
    # The victim: a sandbox of this state directory with its files.
    victim = f"t-victim-{token}"
    victim_record = {"name": victim, "keys": str(cfg.sandboxes / victim), "image": "minimal"}
    define_domain(f"vmsbx-{victim}", _record_xml(victim_record, "ready"))
    paths = SandboxFiles.of(cfg, victim)
    for path in (paths.overlay, paths.seed):
        path.write_text("victim")
    paths.keys_dir.mkdir()
    (paths.keys_dir / "id_ed25519").write_text("victim")
    # Outside the state directory, where '../../' from its sandboxes folder leads.
    canary = cfg.state_dir.parent / f"t-canary-{token}"
    canary.mkdir()
    (canary / "keep").write_text("canary")
    canary.with_name(canary.name + ".qcow2").write_text("canary")
    dead = {"pid": 1, "start": "0", "boot": "not-this-boot"}
    evil = [
        define_domain(
            f"vmsbx-t-evil1-{token}",
            _record_xml({"name": f"../../t-canary-{token}", "creator": dead}, "creating"),
        ),
        define_domain(
            f"vmsbx-t-evil2-{token}", _record_xml({"name": victim, "creator": dead}, "creating")
        ),
    ]
    with SandboxManager(cfg, reconcile=False) as manager:
        manager.reconcile()
    assert (canary / "keep").exists()
    assert canary.with_name(canary.name + ".qcow2").exists()
    assert sorted(map(str, paths.existing())) == sorted(
        map(str, [paths.overlay, paths.seed, paths.keys_dir])
    )
    assert (paths.keys_dir / "id_ed25519").exists()
    for name in evil:
        assert domain_exists(cfg.uri, name), f"{name} is not a sandbox; it must stay"


def test_metadata_that_is_not_an_object_is_not_a_sandbox() -> None:
    """A domain whose vmsandbox metadata holds JSON other than an object is not ours (it must
    not crash every manager that lists domains)."""
    for text in ("[1, 2]", '"vmsbx"', "42", "null"):
        xml = _bare_domain_xml(
            "vmsbx-t-x",
            f'<s:sandbox xmlns:s="{domain_xml.METADATA_NS}" state="creating">{text}</s:sandbox>',
        )
        assert domain_xml.read_metadata(xml) is None, text


def test_reconcile_runs_when_the_manager_opens(config: Config) -> None:
    name = generate_name("t")
    proc = start_create(config, name, "define", "--no-wait")
    try:
        kill9(proc)
        assert leftovers(config, name)
        SandboxManager(config).close()
        assert leftovers(config, name) == []
    finally:
        if leftovers(config, name):
            force_remove(config, name)


def test_reconcile_leaves_a_create_in_flight_alone(config: Config) -> None:
    """A domain marked creating whose creator still runs is not half-made: reconcile keeps it
    (and its QEMU) until the creator dies."""
    name = generate_name("t")
    proc = start_create(config, name, "start", "--no-wait")
    try:
        assert name not in reconcile_cli(config)["removed"]
        listed = json.loads(cli("list", "--json", config=config, check=True).stdout)
        states = {s["name"]: s["state"] for s in listed["sandboxes"]}
        assert states.get(name) == "creating"
        kill9(proc)
        assert name in reconcile_cli(config)["removed"]
        assert leftovers(config, name) == []
    finally:
        stop_and_clean(proc, config, name)


def test_reconcile_removes_files_without_a_domain(config: Config) -> None:
    name = generate_name("t")
    paths = SandboxFiles.of(config, name)
    paths.keys_dir.mkdir(mode=0o700)
    (paths.keys_dir / "id_ed25519").write_text("orphan")
    paths.overlay.with_name(paths.overlay.name + ".partial").write_text("half")
    paths.console_log.write_text("boot")
    report = reconcile_cli(config)
    assert name in report["removed"]
    assert leftovers(config, name) == []
    assert not paths.overlay.with_name(paths.overlay.name + ".partial").exists()


def test_reconcile_handles_a_domain_whose_files_are_gone(
    manager: SandboxManager, config: Config
) -> None:
    """A sandbox whose overlay was deleted under it: stopped, reconcile removes the rest of it;
    running, reconcile leaves it running and reports it (CLI exit 1) until it is destroyed."""
    stopped, running = generate_name("t"), generate_name("t")
    try:
        for name in (stopped, running):
            manager.create(SandboxSpec(name=name, memory_mib=256), wait=False)
            SandboxFiles.of(config, name).overlay.unlink()
        manager.conn.lookupByName(domain_xml.DOMAIN_PREFIX + stopped).destroy()
        report = manager.reconcile()
        assert stopped in report["removed"]
        assert leftovers(config, stopped) == []
        assert running not in report["removed"]
        assert [p for p in report["problems"] if running in p], report
        assert domain_exists(config.uri, domain_xml.DOMAIN_PREFIX + running)
        assert manager.get(running).state == "started"  # nobody waited for its SSH
        done = cli("reconcile", config=config)
        assert done.returncode == 1
        assert f"could not fix: {running}" in done.stdout
        manager.destroy(running)
        assert leftovers(config, running) == []
    finally:
        for name in (stopped, running):
            if leftovers(config, name):
                force_remove(config, name)


def test_reconcile_leaves_sandboxes_of_other_state_directories_alone(
    config: Config, own_state: Config
) -> None:
    """Two installations on one libvirtd: each reconciles only the sandboxes whose files live
    in its own state directory (another's half-made sandbox is that one's to remove)."""
    other = own_state
    name = generate_name("t")
    proc = start_create(other, name, "define", "--no-wait")
    try:
        kill9(proc)
        made = leftovers(other, name)
        assert f"domain vmsbx-{name}" in made
        reconcile_cli(config)
        assert leftovers(other, name) == made
        assert name in reconcile_cli(other)["removed"]
        assert leftovers(other, name) == []
    finally:
        if leftovers(other, name):
            force_remove(other, name)
