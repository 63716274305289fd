"""Killing a ``vmsandbox create`` at a crash checkpoint, and cleaning up after it.

tests/framework/crash_cli.py runs the CLI with a checkpoint that, at the given stage, prints
``vmsandbox-checkpoint <stage>`` on stderr and waits there to be killed (``start_create``,
``wait_for_output``); ``kill9`` ends its process group, ``stop_and_clean`` and ``force_remove``
take away whatever the kill left.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from framework.sandboxes import cli_env, leftovers

from vmsandbox.config import Config
from vmsandbox.errors import NotFound
from vmsandbox.sandbox.manager import SandboxManager

CRASH_CLI = (
    Path(__file__).resolve().parent / "crash_cli.py"
)  # the guest is killed long before it needs more


def wait_for_output(proc: subprocess.Popen[bytes], marker: str, timeout: float = 90.0) -> str:
    """Read ``proc``'s stderr until ``marker`` shows up; fail with what it said otherwise."""
    assert proc.stderr is not None
    seen = b""
    deadline = time.monotonic() + timeout
    fd = proc.stderr.fileno()
    while marker.encode() not in seen:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(
                f"no {marker!r} within {timeout}s; stderr so far:\n{seen.decode()}"
            )
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                proc.wait()
                raise AssertionError(
                    f"process exited ({proc.returncode}) before {marker!r}:\n{seen.decode()}"
                )
            seen += chunk
    return seen.decode()


def start_create(
    config: Config,
    name: str,
    stage: str,
    *args: str,
    prefix: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``vmsandbox create NAME`` in a process group of its own; return once it waits at
    checkpoint ``stage`` (``prefix``: a wrapper such as umockdev-run)."""
    return start_cli(config, stage, "create", name, *SMALL, *args, prefix=prefix, env=env)


def start_cli(
    config: Config,
    stage: str,
    *args: str,
    prefix: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``vmsandbox ARGS...`` in a process group of its own; return once it waits at
    checkpoint ``stage`` (crash_cli.py)."""
    proc = subprocess.Popen(
        [*prefix, sys.executable, str(CRASH_CLI), stage, *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env or cli_env(config),
        start_new_session=True,
    )
    try:
        wait_for_output(proc, f"vmsandbox-checkpoint {stage}")
    except BaseException:
        kill9(proc)
        raise
    return proc


def kill9(proc: subprocess.Popen[bytes], *, reap: bool = True) -> None:
    """SIGKILL the process group ``proc`` leads (it and any tool it was running); with
    ``reap``, return once no process of the group runs any more. (A wrapper such as
    ``unshare --fork`` dies first; the create under it may still hold its owner file a
    moment later.)"""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    if reap:
        proc.wait(timeout=30)
        if proc.stderr is not None:
            proc.stderr.close()
        deadline = time.monotonic() + 30
        while group_members(proc.pid):
            assert time.monotonic() < deadline, f"group {proc.pid} still runs after SIGKILL"
            time.sleep(0.05)


def group_members(pgid: int) -> list[int]:
    """The PIDs of process group ``pgid``'s members that are not zombies."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited meanwhile
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def stop_and_clean(proc: subprocess.Popen[bytes], config: Config, name: str) -> None:
    """Test cleanup: the create process killed, and whatever it left removed."""
    kill9(proc)
    if leftovers(config, name):
        force_remove(config, name)


SMALL = ("--memory", "256")


def force_remove(config: Config, name: str) -> None:
    """Test cleanup of one of our own sandboxes, whatever state it was left in."""
    with SandboxManager(config, reconcile=False) as manager, contextlib.suppress(NotFound):
        manager.destroy(name)
