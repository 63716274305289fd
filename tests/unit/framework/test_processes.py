"""The session-end check of conftest (no process of this run left) finds this run's processes
and only them: other test runs and an external QEMU share this machine."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import pytest
from framework.processes import RUN_DIRS, run_leftovers, wait_for


@contextlib.contextmanager
def tool_process(tool: str, *args: str, env: dict[str, str]) -> Iterator[int]:
    """A process that sleeps under the name ``tool`` (argv[0]); its pid. Killed at the end."""
    python = shlex.quote(sys.executable)
    sleeper = f'exec -a {tool} {python} -c "import time; time.sleep(600)" "$@"'
    proc = subprocess.Popen(["bash", "-c", sleeper, tool, *args], env=env)
    try:
        assert wait_for(lambda: _argv0(proc.pid) == tool, 30.0)
        yield proc.pid
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def _argv0(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as handle:
        return handle.read().split(b"\0")[0].decode()


def found(pid: int, dirs: set[str]) -> bool:
    return pid in {proc.pid for proc in run_leftovers(dirs)}


@pytest.mark.parametrize(
    "tool", ["qemu-system-x86_64", "qemu-img", "genisoimage", "mmdebstrap", "vmsandbox"]
)
def test_a_process_of_this_run_is_found_by_its_environment(tool: str) -> None:
    with tool_process(tool, env=dict(os.environ)) as pid:
        assert found(pid, set())
    assert not found(pid, set())


def test_a_process_that_is_no_tool_of_ours_is_not_counted() -> None:
    with tool_process("sleepy", env=dict(os.environ)) as pid:
        assert not found(pid, set())


def test_without_the_mark_only_a_command_line_naming_a_run_directory_counts() -> None:
    """Like QEMU started by libvirtd (environment cleared): found by the state directory its
    command line names; the same process naming another run's directory is not counted."""
    stranger = {"PATH": os.environ["PATH"], "VMSANDBOX_TEST_RUN": "another-run"}
    ours = tempfile.mkdtemp(prefix="vmsbx-leak-", dir="/var/tmp")
    try:
        assert ours in RUN_DIRS  # recorded when it was made
        disk = f"file={ours}/disks/t.qcow2"
        with tool_process("qemu-system-x86_64", disk, env=stranger) as pid:
            assert found(pid, {ours})
        other = "file=/var/tmp/vmsbx-test-other/disks/t.qcow2"
        with tool_process("qemu-system-x86_64", other, env=stranger) as pid:
            assert not found(pid, {ours})
    finally:
        os.rmdir(ours)
