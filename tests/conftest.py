"""Shared fixtures: an isolated vmsandbox state directory on the real libvirtd, one booted guest
that the end-to-end tests share (a TCG boot costs about a minute here), and the session-end check
that the run left no process of its own behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

import pytest

from vmsandbox.config import Config
from vmsandbox.errors import NotFound
from vmsandbox.sandbox.handle import Sandbox
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.sandbox.spec import SandboxSpec, generate_name

REPO = Path(__file__).resolve().parent.parent
IMAGES = Path(os.environ.get("VMSANDBOX_IMAGE_DIR", "/var/lib/vmsandbox/images"))

# -- which processes this test run started ---------------------------------------------------
# Other test runs share this machine (and libvirtd), and an external nested-host QEMU may run:
# a process is this run's when its environment carries this run's mark (every process the run
# starts inherits it), or when its command line names a directory this run made (QEMU started
# by libvirtd, whose environment libvirt clears, names the overlay in the test's state dir).
RUN_ID = uuid.uuid4().hex
os.environ["VMSANDBOX_TEST_RUN"] = RUN_ID
_RUN_DIRS: set[str] = set()


def _record_run_dirs(event: str, args: tuple[object, ...]) -> None:
    """Audit hook: every ``tempfile.mkdtemp`` of this process (TemporaryDirectory too), so the
    state directories of all tests are known without each test having to register its own."""
    if event == "tempfile.mkdtemp":
        _RUN_DIRS.add(os.fspath(args[0]))  # type: ignore[arg-type]


sys.addaudithook(_record_run_dirs)

# The tools whose processes a test must never leave running.
LEAK_TOOLS = ("qemu-system-*", "qemu-img", "genisoimage", "mmdebstrap", "vmsandbox")
LEAK_GRACE_SECONDS = 30.0  # a destroyed domain's QEMU, a probe's deadline: let them finish


@dataclass(frozen=True)
class Proc:
    """One live process as /proc shows it."""

    pid: int
    session: int
    argv: tuple[str, ...]
    environ: frozenset[bytes]

    @property
    def tool(self) -> str | None:
        """Which of LEAK_TOOLS this process is (scripts run by an interpreter count too)."""
        words = list(self.argv[:3])
        if "vmsandbox.cli" in words:
            return "vmsandbox"
        names = [os.path.basename(word) for word in words]
        return next((n for n in names if any(fnmatch(n, tool) for tool in LEAK_TOOLS)), None)

    def describe(self) -> str:
        return f"pid {self.pid}: {' '.join(self.argv)[:300]}"


def processes() -> list[Proc]:
    """Every live process (zombies, already dead, left out) that this user may read."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
            argv = Path(entry.path, "cmdline").read_bytes()
            environ = Path(entry.path, "environ").read_bytes()
        except OSError:
            continue  # gone while we looked, or not ours to read
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] in ("Z", "X") or not argv:
            continue  # a zombie, or a kernel thread
        found.append(
            Proc(
                pid=int(entry.name),
                session=int(fields[3]),
                argv=tuple(arg.decode(errors="replace") for arg in argv.rstrip(b"\0").split(b"\0")),
                environ=frozenset(environ.split(b"\0")),
            )
        )
    return found


def run_leftovers(dirs: set[str]) -> list[Proc]:
    """Processes of LEAK_TOOLS that this run started and that still run."""
    mark = f"VMSANDBOX_TEST_RUN={RUN_ID}".encode()
    prefixes = tuple(d.rstrip("/") + "/" for d in dirs)
    return [
        proc
        for proc in processes()
        if proc.pid != os.getpid()
        and proc.tool is not None
        and (mark in proc.environ or any(p in arg for arg in proc.argv for p in prefixes))
    ]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The nested GPU host's module runs first. Its L2 guests run under KVM inside a TCG L1,
    which crawls when the 2-core machine is busy; later modules leave guests running (the
    session's shared one boots with the CLI tests and runs to the end)."""
    items.sort(key=lambda item: item.path.name != "test_e2e_nested.py")  # stable: order kept


def wait_for(condition: Callable[[], bool], limit: float = 60.0) -> bool:
    """Poll ``condition`` until it holds (True) or ``limit`` seconds pass (False)."""
    deadline = time.monotonic() + limit
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def wait_until_gone(find: Callable[[], list[Proc]], limit: float) -> list[Proc]:
    """Poll ``find`` until it finds nothing or ``limit`` seconds pass; what is left."""
    deadline = time.monotonic() + limit
    while (left := find()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.fixture(scope="session", autouse=True)
def no_process_left(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """At the end of the run: fail, naming them, if processes this run started still run."""
    yield
    dirs = {*_RUN_DIRS, str(tmp_path_factory.getbasetemp())}
    left = wait_until_gone(lambda: run_leftovers(dirs), LEAK_GRACE_SECONDS)
    if left:
        pytest.fail(
            "the test run left processes running:\n"
            + "\n".join(f"  {proc.tool} {proc.describe()}" for proc in left),
            pytrace=False,
        )


def make_config(state_dir: Path, **overrides: object) -> Config:
    return Config.load(
        path="/nonexistent",
        uri="qemu:///system",
        state_dir=state_dir,
        image_dir=IMAGES,
        virt_type="qemu",
        boot_timeout=600,  # TCG on a busy 2-core machine: generous, the tests assert no timing
        **overrides,
    )


@pytest.fixture(scope="session")
def state_dir() -> Iterator[Path]:
    """A state directory of this test run's own (disks must be reachable by libvirt-qemu)."""
    root = Path(tempfile.mkdtemp(prefix="vmsbx-test-", dir="/var/tmp"))
    os.chmod(root, 0o711)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def config(state_dir: Path) -> Config:
    return make_config(state_dir)


@pytest.fixture(scope="session")
def manager(config: Config) -> Iterator[SandboxManager]:
    with SandboxManager(config) as mgr:
        yield mgr


@pytest.fixture(scope="session")
def booted(manager: SandboxManager) -> Iterator[Sandbox]:
    """One minimal guest, booted once for the whole run and destroyed at the end."""
    name = generate_name("t")
    sandbox = manager.create(SandboxSpec(name=name, image="minimal", memory_mib=1024))
    try:
        yield sandbox
    finally:
        with contextlib.suppress(NotFound):  # a test may have destroyed it already
            manager.destroy(name)


def cli_env(config: Config, **extra: str) -> dict[str, str]:
    """The environment of a CLI process that works on ``config``'s libvirt and state directory."""
    env = dict(os.environ)
    env.update(
        VMSANDBOX_CONFIG="/nonexistent",
        VMSANDBOX_URI=config.uri,
        VMSANDBOX_STATE_DIR=str(config.state_dir),
        VMSANDBOX_IMAGE_DIR=str(config.images),
        VMSANDBOX_VIRT_TYPE=config.virt_type,
        VMSANDBOX_BOOT_TIMEOUT=str(config.boot_timeout),
    )
    env.update(extra)
    return env


def cli(
    *args: str, config: Config, check: bool = False, timeout: float = 900
) -> subprocess.CompletedProcess[str]:
    """Run the vmsandbox CLI as a separate process against ``config``."""
    return subprocess.run(
        [sys.executable, "-m", "vmsandbox.cli", *args],
        capture_output=True,
        text=True,
        env=cli_env(config),
        check=check,
        timeout=timeout,
    )


def leftovers(config: Config, name: str) -> list[str]:
    """Everything of sandbox ``name`` still on the host: domain, files."""
    import libvirt

    from vmsandbox.sandbox.record import SandboxFiles

    found = [str(path) for path in SandboxFiles.of(config, name).existing()]
    conn = libvirt.open(config.uri)
    try:
        conn.lookupByName(f"vmsbx-{name}")
        found.append(f"domain vmsbx-{name}")
    except libvirt.libvirtError:
        pass  # no such domain: nothing left there
    finally:
        conn.close()
    return found
