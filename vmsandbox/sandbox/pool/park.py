"""The parked pool: pooled guests of a ``park = true`` shape saved to disk while they wait.

A fill boots a parked shape's guest as any pooled guest, waits for the rest of its boot, then
saves its memory with libvirt's managed save (``park``, as suspend.py saves a sandbox; the
guest holds no GPU, so nothing is quiesced): no QEMU process runs for it and it holds no host
memory, only its save file on disk, which its hold counts against ``max_saved_gib``. A park
that would pass that limit leaves the guest running (state ``pooled``). The guest is then
stored ``parked``. A guest left running so is parked by a later fill once the limit has room
(``park_waiting``).

A claim of a parked guest restores it (``restore``): the memory read back, the guest woken
as resume.py wakes a sandbox (clock set, entropy reseeded beside the VM generation ID) and
given the claim's hostname in the same exchange once it has checked that its sshd runs, as a
running pooled guest's claim is, before the claim's other steps (GPUs) run. A restore that fails
raises ``RestoreFailed`` once the claim's undos have removed the guest: the pool's keeper then
claims the next guest, or the create boots cold. A claimed guest is never handed out unless
its restore answered.

Reconcile leaves a parked guest and its save alone (its files are all there); destroy and
``pool drain`` remove it, and libvirt's undefine removes its save.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from vmsandbox.errors import VmSandboxError
from vmsandbox.guest import control
from vmsandbox.sandbox import create, resume
from vmsandbox.sandbox.holds import Holds, own, settled
from vmsandbox.sandbox.pool.shapes import holds as of_shape
from vmsandbox.sandbox.record import STATE_PARKED, STATE_POOLED, SandboxRecord
from vmsandbox.sandbox.suspend import GIB, MIB, saved_total, wait_for_control
from vmsandbox.vm import netguard

if TYPE_CHECKING:
    from vmsandbox.config import Config
    from vmsandbox.progress import Progress
    from vmsandbox.vm.hypervisor import Hypervisor

Lock = Callable[[], contextlib.AbstractContextManager[None]]


class RestoreFailed(Exception):
    """A claimed parked guest did not come back; the claim removed it (``cause`` says why)."""

    def __init__(self, guest: str, cause: BaseException) -> None:
        super().__init__(f"restoring parked guest {guest} failed: {cause}")
        self.guest = guest
        self.cause = cause


def parks(c: create.Creation) -> bool:
    """Whether the fill ``c`` is of a ``park`` shape."""
    return any(shape.key == c.pool_key and shape.park for shape in c.config.pool)


def park(c: create.Creation) -> None:
    """Fill, after the guest settled: its memory saved (the hold counting the save's room
    first, under the lock), unless the shape does not park or the host's saves are full."""
    if not parks(c):
        return
    assert c.record is not None  # made by the define step
    need = c.record.memory_mib * MIB
    with c.lock():
        holds = Holds(c.config)
        hold = c.own()
        limit = c.config.max_saved_gib * GIB
        if saved_total(holds.all(), but=c.uuid) + need > limit:
            c.progress(
                f"pooled guest {c.name} stays running: parking it would take the host's saved "
                f"memory past max_saved_gib = {c.config.max_saved_gib}"
            )
            return
        holds.put(replace(hold, saved_bytes=need))
    wait_for_control(c.hypervisor, c.domain, c.uuid, c.name, c.progress)
    c.progress(f"parking pooled guest {c.name}: saving its memory ({c.record.memory_mib} MiB)")
    c.hypervisor.save(c.domain, uuid=c.uuid)


def park_waiting(
    config: Config,
    hypervisor: Hypervisor,
    locked: Lock,
    guests: Sequence[tuple[SandboxRecord, str, str]],
    say: Progress,
) -> list[str]:
    """The running pooled guests of ``park`` shapes (``guests``: record, state, UUID) parked
    while ``max_saved_gib`` has room for them; their names. Each is taken from the claimable
    ones first, under the lock (its hold owned by this call, doing ``park``, its save's room
    counted: a claim meanwhile passes it by), then saved, then stored ``parked``. A save that
    fails leaves it running and ``pooled``; a call killed halfway leaves it to reconcile,
    which removes it (the pool boots another)."""
    parked: list[str] = []
    shapes = [shape for shape in config.pool if shape.park]
    for record, state, uuid in guests:
        if state != STATE_POOLED or not any(of_shape(shape, record) for shape in shapes):
            continue
        owner = own(config)
        try:
            with locked():
                book = Holds(config)
                hold = book.all().get(uuid)
                if hold is None or hold.owner is not None or hold.pool is None:
                    continue  # claimed, or being worked on, meanwhile
                need = record.memory_mib * MIB
                if saved_total(book.all(), but=uuid) + need > config.max_saved_gib * GIB:
                    break
                book.put(replace(hold, owner=owner.identity, doing="park", saved_bytes=need))
            say(f"parking pooled guest {record.name}: max_saved_gib has room for it now")
            try:
                wait_for_control(hypervisor, record.domain, uuid, record.name, say)
                hypervisor.save(record.domain, uuid=uuid)
            except VmSandboxError as exc:
                say(f"pooled guest {record.name} stays running: its save failed: {exc.message}")
            with locked():
                book = Holds(config)
                hold = book.all().get(uuid)
                if hold is None or not hold.owned_by(owner.identity):
                    continue  # a destroy took it over
                size = hypervisor.saved(record.domain, uuid=uuid)
                shown = STATE_POOLED if size is None else STATE_PARKED
                hypervisor.set_metadata(record.domain, record.to_dict(), shown, uuid=uuid)
                book.put(settled(replace(hold, saved_bytes=size or 0)))
            if size is not None:
                parked.append(record.name)
        finally:
            owner.end()
    return parked


def saved_bytes(c: create.Creation) -> int | None:
    """The size of the fill's or claim's guest's save; None when it has none (it runs)."""
    return c.hypervisor.saved(c.domain, uuid=c.uuid)


def restore(c: create.Creation) -> None:
    """Claim, outside the lock: a parked guest's memory restored and the guest woken (its
    clock, its entropy) and given its hostname, its sshd checked; nothing for a guest that
    runs. Its hold counts the save against ``max_saved_gib`` until it is restored. Any
    failure is ``RestoreFailed`` (the runner's undos remove the guest first)."""
    if saved_bytes(c) is None:
        return
    assert c.record is not None  # made by the claim step
    started = time.monotonic()
    try:
        netguard.before_start(c.config)
        c.progress(f"restoring parked guest {c.files.name}")
        c.hypervisor.start(c.domain, uuid=c.uuid)
        control.restrict(c.files.control)  # the restored guest runs with the claim's record
        reached = resume.reach(
            c.hypervisor, c.config, c.record, c.uuid, c.guest_run, c.progress, started, c.name
        )
    except (VmSandboxError, OSError, EOFError) as exc:
        raise RestoreFailed(c.files.name, exc) from exc
    with c.lock():  # restored: libvirt removed the save, which the hold counted until now
        c.holds.put(replace(c.own(), saved_bytes=0))
    c.hostname_set = reached.claimed
    back = "claimed, its sshd checked" if reached.claimed else "answers SSH"
    c.progress(f"parked guest {c.files.name} {back} {reached.seconds:.2f} s after its restore")
