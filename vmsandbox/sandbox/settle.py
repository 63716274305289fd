"""Keeping a sandbox's shown state true after the call that set it has gone.

Two states say only what the last call saw: ``started`` (started without waiting: nobody has
seen SSH answer; also a ``starting`` whose starter process is gone) and ``failed`` (the last
wait for the guest failed, its reason in the record's ``failure``), while the guest runs on and
may well have come up since. ``settle`` looks again for the readers (``get``, ``list``): when
SSH now accepts the sandbox's key with the pinned host key, the sandbox is stored ``ready``
(under the host lock, only if no other call changed it meanwhile). A guest of an image whose
console says when sshd runs is knocked at only once it has said so: a reader never waits on a
guest still booting. A sandbox with GPUs is left to ``start``, which waits for it and checks
its GPUs from inside, as ``ready`` promises.

``require_running`` is the check of the commands that need a running guest (exec, ssh, cp,
forward, verify): a stopped, never-started or suspended sandbox is FAILED_PRECONDITION saying
how to start or resume it, not a connection error.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from vmsandbox.errors import FailedPrecondition, NotFound, VmSandboxError
from vmsandbox.guest import ssh
from vmsandbox.sandbox.handle import Sandbox
from vmsandbox.sandbox.power import reports_sshd
from vmsandbox.sandbox.record import (
    STATE_CREATING,
    STATE_DEFINED,
    STATE_FAILED,
    STATE_PARKED,
    STATE_POOLED,
    STATE_READY,
    STATE_RESUMING,
    STATE_STARTED,
    STATE_STOPPED,
    STATE_SUSPENDED,
    STATE_SUSPENDING,
    SandboxFiles,
)
from vmsandbox.sandbox.store import Found, SandboxStore
from vmsandbox.vm import console

# Shown states that only say what the last call saw, while the guest runs.
UNSETTLED = (STATE_STARTED, STATE_FAILED)
# How long a reader waits for the guest's SSH login before it leaves the state as it is.
PROBE_TIMEOUT_S = 3.0
PROBES_AT_ONCE = 16
Lock = Callable[[str], contextlib.AbstractContextManager[None]]


def settle(store: SandboxStore, lock: Lock, found: Found) -> Found:
    """``found``, stored ready first when it shows an unsettled state, has no GPUs, and its
    guest's sshd now accepts the sandbox's key with the pinned host key."""
    shown = store.view(found.record, found.state, found.uuid)
    if shown.state not in UNSETTLED or found.record.gpus or shown.ssh is None:
        return found
    files = SandboxFiles.of(store.config, found.record.stem)
    if reports_sshd(store.config, found.record):
        watch = console.ConsoleWatch(files.console_log)
        watch.poll()
        if not watch.sshd_reachable:
            return found  # its console has not said that sshd runs: no SSH to knock at yet
    try:
        ssh.connect(
            shown.ssh, files.keys(found.record.host_key_alias), timeout=PROBE_TIMEOUT_S
        ).close()
    except VmSandboxError:
        return found  # still not answering (or answering wrongly): the state stays
    with lock("settle a sandbox's state"):
        now = store.by_domain(found.record.domain, found.uuid)
        if now is None or now.state != found.state:
            return now or found  # removed, or another call changed it meanwhile: its word stands
        try:
            return store.commit(now, lambda r: replace(r, failure=None, starter=None), STATE_READY)
        except NotFound:
            return found  # a teardown took it over meanwhile: the reader sees it as it was


def settle_all(store: SandboxStore, lock: Lock, found: list[Found]) -> list[Found]:
    """``settle`` of each, their SSH probes side by side: a ``list`` of many booting sandboxes
    costs one probe's time, not one per sandbox."""
    if not found:
        return []
    with ThreadPoolExecutor(max_workers=min(len(found), PROBES_AT_ONCE)) as pool:
        return list(pool.map(lambda one: settle(store, lock, one), found))


def require_running(sandbox: Sandbox, doing: str) -> None:
    """FAILED_PRECONDITION for ``doing`` (e.g. "run a command in it") on a sandbox whose
    guest does not run."""
    name = sandbox.name
    why = {
        STATE_STOPPED: f"it is stopped; start it with 'vmsandbox start {name}'",
        STATE_DEFINED: f"it was never started; start it with 'vmsandbox start {name}'",
        STATE_CREATING: "it is still being created",
        STATE_POOLED: "it is a warm-pool guest that no create has claimed",
        STATE_PARKED: "it is a parked warm-pool guest that no create has claimed",
        STATE_SUSPENDED: f"it is suspended; resume it with 'vmsandbox resume {name}'",
        STATE_SUSPENDING: "it is being suspended",
        STATE_RESUMING: "it is being resumed; try again once its resume has returned",
    }.get(sandbox.state)
    if why is not None:
        raise FailedPrecondition(
            f"cannot {doing} sandbox {name!r}: {why}",
            details={"name": name, "state": sandbox.state},
        )
    if sandbox.ssh is None:
        raise FailedPrecondition(
            f"cannot {doing} sandbox {name!r}: it has no SSH endpoint yet",
            details={"name": name, "state": sandbox.state},
        )
