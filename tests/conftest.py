"""The test tree's shared fixtures and its one rule of scope.

Each directory under tests/ is a scope, and a test's marker comes from its directory (see
``SCOPES``): ``pytest -m unit`` or ``pytest tests/unit`` runs what needs no libvirtd. The
session-wide pieces live here: an isolated vmsandbox state directory on the real libvirtd, one
booted guest that the end-to-end tests share (a TCG boot costs seconds to a minute here), the
session-end check that the run left no process of its own behind (framework/processes.py), and
after each module that may touch libvirt the removal, named in the run's summary, of the domains
it left defined (framework/leftover_domains.py).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from framework import leftover_domains
from framework.processes import LEAK_GRACE_SECONDS, RUN_DIRS, run_leftovers, wait_until_gone
from framework.sandboxes import make_config

from vmsandbox.config import Config
from vmsandbox.errors import NotFound
from vmsandbox.sandbox.handle import Sandbox
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.sandbox.spec import SandboxSpec, generate_name

TESTS = Path(__file__).resolve().parent
# Fixtures shared across scopes: the fake hosts' inventories and libvirt connections for domain
# XML (framework/domains.py), the HGX board and Fabric Manager's fake (framework/fabric.py).
pytest_plugins = ["framework.domains", "framework.fabric"]

# Directory -> (marker, what its tests need). docs/contributing.md says the same to people.
SCOPES = {
    "unit": ("unit", "nothing but this checkout: no libvirtd, no guest (umockdev, fakes)"),
    "libvirt": ("libvirt", "the real libvirtd or libvirt's test driver; no guest boots"),
    "e2e": ("e2e", "boots real guests under TCG (the nested GPU host too) or a Ray cluster"),
    "reliability": ("reliability", "crashes, chaos, hostile input and state truth"),
}
FIRST = ("e2e/test_nested.py", "e2e/test_nested_suspend.py")  # in this order
SESSION_DIRS: set[str] = set()  # the shared state directory: its guest lives across modules
LEFT_DOMAINS: list[leftover_domains.LeftDomain] = []


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test with its directory's scope; run the nested GPU host's modules first. Their
    L2 guests run under KVM inside a TCG L1, which crawls when the 2-core machine is busy;
    later modules leave guests running (the session's shared one boots with the first test
    that asks for it and runs to the end)."""
    for item in items:
        scope = item.path.relative_to(TESTS).parts[0]
        if scope not in SCOPES:
            raise pytest.UsageError(
                f"{item.path}: a test lives in one of tests/{{{','.join(SCOPES)}}}/"
            )
        item.add_marker(SCOPES[scope][0])
    rank = {module: place for place, module in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.relative_to(TESTS).as_posix(), len(FIRST)))


@pytest.fixture(scope="session", autouse=True)
def no_process_left(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """At the end of the run: fail, naming them, if processes this run started still run."""
    yield
    dirs = {*RUN_DIRS, str(tmp_path_factory.getbasetemp())}
    left = wait_until_gone(lambda: run_leftovers(dirs), LEAK_GRACE_SECONDS)
    if left:
        pytest.fail(
            "the test run left processes running:\n"
            + "\n".join(f"  {proc.tool} {proc.describe()}" for proc in left),
            pytrace=False,
        )


@pytest.fixture(scope="module", autouse=True)
def no_domain_left(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a module that may touch libvirt: remove the domains it left defined in a folder
    of this run's (a parked or shut-off guest runs no process), and name them in the summary."""
    scope = request.node.path.relative_to(TESTS).parts[0]
    before = leftover_domains.defined() if scope != "unit" else None
    yield
    if before is None:
        return
    module = request.node.path.relative_to(TESTS).as_posix()
    for uuid, left in leftover_domains.new_in(before, RUN_DIRS - SESSION_DIRS, module):
        leftover_domains.remove(uuid)
        LEFT_DOMAINS.append(left)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if LEFT_DOMAINS:
        terminalreporter.section("domains left defined (removed after their module)")
        for left in LEFT_DOMAINS:
            terminalreporter.write_line(f"{left.module}: {left.name} (in {left.folder})")


@pytest.fixture(scope="session")
def state_dir() -> Iterator[Path]:
    """A state directory of this test run's own (disks must be reachable by libvirt-qemu)."""
    root = Path(tempfile.mkdtemp(prefix="vmsbx-test-", dir="/var/tmp"))
    os.chmod(root, 0o711)
    SESSION_DIRS.add(str(root))
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
