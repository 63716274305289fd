"""Taking a sandbox apart: destroy, and the removal of one pooled guest (pool drain, an old
build's guests), by the sandbox's identity and with the slow work outside the host lock.

A teardown first takes the sandbox's hold over, under the lock (holds.py): from then on no
other call can claim it, commit to it, or reserve its name, and the create that was making it
(if one still is) can no longer commit. It then stops QEMU and gives the Fabric Manager
partition back outside the lock, and under the lock again removes the domain (by UUID), the
files, and the hold, its GPUs marked sanitizing first; last, outside the lock, the GPUs are
sanitized (sandbox/custody.py) before anyone may take them again. What it could not remove
stays with a hold whose owner is gone, for reconcile.

A hold is taken over only once its domain exists: before that, its create is still writing
the files the name reserves, and removing them under it would let a later create of that name
lose its own. Nor is a hold another teardown is working on: a second destroy of a sandbox waits
for the first, then finds nothing (NOT_FOUND). A teardown waits for either (``lock_timeout``),
and says so when it waited in vain.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import replace

from vmsandbox.config import Config
from vmsandbox.errors import FailedPrecondition, NotFound, VmSandboxError
from vmsandbox.gpu.custody.work import release
from vmsandbox.gpu.fabric.lease import FabricLease
from vmsandbox.sandbox import custody
from vmsandbox.sandbox.create import Remains
from vmsandbox.sandbox.holds import TEARDOWNS, Hold, Holds, own
from vmsandbox.sandbox.record import SandboxFiles, SandboxRecord
from vmsandbox.sandbox.store import Found, SandboxStore
from vmsandbox.validate import validate_name
from vmsandbox.vm.process import Ownership

Lock = Callable[[], contextlib.AbstractContextManager[None]]
_POLL_S = 0.2


class _NotYet(Exception):
    """The sandbox's create has not defined its domain yet: wait and look again."""

    def __init__(self, hold: Hold) -> None:
        super().__init__(hold.name)
        self.hold = hold


def destroy(
    store: SandboxStore,
    lock: Lock,
    name: str,
    *,
    uuid: str | None = None,
    pooled_only: bool = False,
) -> None:
    """Remove sandbox ``name`` (see the module docstring). With ``uuid``, only the sandbox
    with that identity: NOT_FOUND when ``name`` is now another one. ``pooled_only``: only an
    unclaimed pooled guest (NOT_FOUND when it was claimed meanwhile)."""
    validate_name(name)
    hypervisor, config = store.hypervisor, store.config
    found = store.find(name)
    if uuid is not None and (found is None or found.uuid != uuid):
        raise NotFound(
            f"sandbox {name!r} with id {uuid} does not exist",
            details={"name": name, "uuid": uuid},
        )
    if found is not None and not store.local(found.record):
        raise FailedPrecondition(
            f"sandbox {name!r} was made with another state directory (its keys are in "
            f"{found.record.keys}); destroy it with that installation's configuration",
            details={"name": name, "keys": found.record.keys},
        )
    # Stopped before the lock, so that a hung QEMU cannot hold it; a pooled guest only once
    # taken over under the lock, since a claim may take it until then.
    if found is not None and not pooled_only:
        hypervisor.stop(found.record.domain, uuid=found.uuid)
    owner = own(config)
    try:
        deadline = time.monotonic() + config.lock_timeout
        while True:
            try:
                with lock():
                    remains = _take_over(store, name, found, owner, pooled_only)
                break
            except _NotYet as wait:
                if time.monotonic() >= deadline:
                    raise FailedPrecondition(
                        f"sandbox {name!r} is still busy with pid {_pid(wait.hold)} "
                        f"({wait.hold.doing}) after {config.lock_timeout:.0f} s; destroy it "
                        "once that call returns",
                        details={"name": name, "owner": _pid(wait.hold)},
                    ) from None
                time.sleep(_POLL_S)
        if remains is not None:
            finish(remains, lock)
    finally:
        owner.end()


def _pid(hold: Hold) -> int | None:
    return hold.owner.pid if hold.owner else None


def _take_over(
    store: SandboxStore, name: str, found: Found | None, owner: Ownership, pooled_only: bool
) -> Remains | None:
    """Under the lock: the sandbox's hold taken over by ``owner``, and what its teardown works
    from; None when only files were left (removed here). NOT_FOUND when nothing is left."""
    hypervisor, config = store.hypervisor, store.config
    holds = Holds(config)
    current = holds.all()
    if found is not None:  # looked up again: it may be gone, or another sandbox, by now
        stored = hypervisor.metadata(found.record.domain)
        if stored is None or stored.uuid != found.uuid:
            found = None
    hold = (
        current.get(found.uuid)
        if found is not None
        else next((h for h in current.values() if h.name == name), None)
    )
    if pooled_only and not _unclaimed(hold, found):
        raise NotFound(f"pooled guest {name!r} was claimed or removed meanwhile")
    if hold is not None and hold.busy and (found is None or hold.doing in TEARDOWNS):
        # a create still writing the files its name reserves, or another teardown: once it
        # is done there is a domain to take over, or nothing (NOT_FOUND)
        raise _NotYet(hold)
    files = SandboxFiles.of(config, hold.stem if hold else found.record.stem if found else name)
    if found is None and hold is None:
        if any(h.stem == name for h in current.values()) or not files.existing():
            # no such sandbox; files of that name, if any, are a claimed guest's
            raise NotFound(f"sandbox {name!r} does not exist", details={"name": name})
        files.remove()  # files with no domain and no reservation: nothing else to take apart
        return None
    record = found.record if found else None
    uuid = found.uuid if found else hold.uuid if hold else ""
    holds.put(replace(hold or hold_of(record, uuid), owner=owner.identity, doing="destroy"))
    return Remains(hypervisor, config, name, files, record, uuid=uuid, owner=owner)


def _unclaimed(hold: Hold | None, found: Found | None) -> bool:
    if hold is not None:
        return hold.pool is not None
    return found is not None and found.record.guest is None and found.state in ("pooled", "parked")


def hold_of(record: SandboxRecord | None, uuid: str) -> Hold:
    """A hold for a sandbox made before holds existed, read from its record with everything
    it holds: once a hold names its UUID, the allocation counts its domain's GPUs and
    partition from the hold alone, and they must not look free until the domain is gone."""
    assert record is not None
    functions = [bdf for gpu in record.gpus for bdf in (gpu.bdf, *gpu.companions)]
    return Hold(
        uuid=uuid,
        name=record.name,
        stem=record.stem,
        gpus=tuple(functions + list(record.switches)),
        port=record.ssh.port,
        partition=record.fabric_partition,
    )


def finish(remains: Remains, lock: Lock, *, fabric_too: bool = True) -> None:
    """Take apart what ``remains`` names (its hold taken over by its owner): QEMU stopped and
    the partition released outside the lock; domain, files and hold removed under it. A
    partition that could not be released keeps its lease (reconcile's fabric pass releases
    it); anything else left keeps the hold, for reconcile. FAILED_PRECONDITION naming what is
    left. ``fabric_too`` False leaves the partition to the caller (reconcile's fabric pass,
    which releases every lease whose sandbox is gone). The files of the name are removed only
    while this teardown owns the hold of ``remains.uuid`` and no other hold reserves the name
    (``_remove_files``)."""
    failures: list[str] = []
    hypervisor = remains.hypervisor
    _collect(lambda: hypervisor.stop(remains.domain, uuid=remains.uuid), failures)
    fabric: list[str] = []
    if fabric_too:
        _collect(lambda: FabricLease(remains.config).release(remains.uuid, remains.name), fabric)
    try:
        with lock():
            for step in (
                lambda: hypervisor.stop(remains.domain, uuid=remains.uuid),
                lambda: hypervisor.undefine(remains.domain, uuid=remains.uuid),
                lambda: _remove_files(remains),
            ):
                _collect(step, failures)
            hold = remains.mine() if not failures else None
            if hold is not None:
                remains.holds.drop(remains.uuid)  # its GPUs marked sanitizing
    except VmSandboxError as exc:  # the lock
        failures.append(exc.message)
        hold = None
    if hold is not None:
        custody.sanitize(remains.config, lock, hold.gpus)
    if failures or fabric:
        raise FailedPrecondition(
            f"sandbox {remains.name!r} was not removed completely: " + "; ".join(failures + fabric),
            details={"remaining": [str(path) for path in remains.files.existing()]},
        )


def release_gpus(holds: Holds, hold: Hold, cause: str, *, deactivated: bool = False) -> Hold:
    """Under the lock: ``hold`` keeps its sandbox (name, port, owner) but lets its GPUs, their
    companions and the Fabric Manager partition that joined them go (a suspend, or a resume
    that did not keep the GPUs it reserved): the same release ``Holds.drop`` makes for a
    destroy, each GPU ``sanitizing`` in its custody before the hold stops naming it (``cause``
    says why), so that no GPU is free before it is reset and cleared. Unless the partition is
    ``deactivated`` already, each GPU waits for it (custody resets it once its lease is gone;
    a lease its sandbox's settled hold no longer names is deactivated by the caller's
    recovery or by reconcile). Returns the hold as written; the caller hands ``hold.gpus``
    to ``sanitize_released`` once the lock is let go."""
    if hold.gpus:
        release(holds.config, hold.gpus, cause, None if deactivated else hold.partition)
    return holds.put(replace(hold, gpus=(), partition=None))


def sanitize_released(config: Config, lock: Lock, gpus: tuple[str, ...]) -> list[str]:
    """Outside the lock, once ``release_gpus`` let ``gpus`` go: each reset, checked and
    cleared by custody, as ``finish`` does after a destroy (a GPU that fails is quarantined);
    what went wrong, one line per GPU."""
    return custody.sanitize(config, lock, gpus)


def _remove_files(remains: Remains) -> None:
    """Under the lock: the files of the name, while they are this teardown's (its hold by
    UUID owned, the name reserved by no other hold: else they are another sandbox's)."""
    if remains.mine() is None or remains.holds.others_named(remains.uuid, remains.files.name):
        return
    remains.files.remove()


def _collect(step: Callable[[], object], failures: list[str]) -> None:
    try:
        step()
    except VmSandboxError as exc:
        failures.append(exc.message)
    except OSError as exc:
        failures.append(str(exc))
