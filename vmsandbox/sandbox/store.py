"""The sandboxes libvirt holds: their records read from and written to their domains' metadata,
and each one as a caller sees it (the state shown follows whether its domain runs).

libvirt is the only database: every sandbox is a persistent domain whose metadata holds its
record (record.py) and lifecycle state: ``vmsbx-<name>`` when it was created cold,
``vmsbx-pool-<id>`` when it was claimed from the warm pool (pool/shapes.py; the record's ``guest``
names that guest). Every reader finds a sandbox by the name in its record, never by its
domain's: the claimed guest's old name is not the sandbox's. The name is a label a user picks;
what a sandbox is, once found, is its domain's UUID (``Found.uuid``, ``Sandbox.uuid``), which
callers that act on it later (destroy, stop, start, a readiness wait) hand back so that they
reach that very sandbox and not a later one of the same name: every read and write of one
sandbox here takes that UUID, and a write that follows slow work commits only while the
sandbox is still there (``commit``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from vmsandbox.config import Config
from vmsandbox.errors import FailedPrecondition, NotFound, Unavailable
from vmsandbox.sandbox import credential
from vmsandbox.sandbox.handle import Sandbox
from vmsandbox.sandbox.holds import Holds
from vmsandbox.sandbox.record import (
    STATE_CREATING,
    STATE_DEFINED,
    STATE_PARKED,
    STATE_RESUMING,
    STATE_STARTED,
    STATE_STARTING,
    STATE_STOPPED,
    STATE_SUSPENDED,
    STATE_SUSPENDING,
    SandboxFiles,
    SandboxRecord,
    names_domain,
)
from vmsandbox.validate import validate_name
from vmsandbox.vm.domain import DOMAIN_PREFIX
from vmsandbox.vm.hypervisor import Hypervisor, Stored

# States shown as stored although the guest does not run: its memory is (being) saved.
SAVED_STATES = (STATE_SUSPENDED, STATE_SUSPENDING, STATE_RESUMING, STATE_PARKED)


@dataclass(frozen=True)
class Found:
    """A sandbox as found: its record, lifecycle state and domain UUID."""

    record: SandboxRecord
    state: str
    uuid: str


class SandboxStore:
    """Records of sandboxes in the domains of one hypervisor."""

    def __init__(self, hypervisor: Hypervisor, config: Config) -> None:
        self.hypervisor = hypervisor
        self.config = config

    def all(self) -> list[tuple[SandboxRecord, str]]:
        """Our sandboxes (any state directory) with their recorded state. A record of a newer
        vmsandbox is refused when it is this state directory's, and skipped otherwise."""
        return [(found.record, found.state) for found in self.found()]

    def found(self) -> list[Found]:
        """As ``all``, with each sandbox's domain UUID."""
        found = []
        for stored in self.hypervisor.list(DOMAIN_PREFIX):
            record = self._record(stored)
            if record is not None:
                found.append(Found(record, stored.state, stored.uuid))
        return found

    def _record(self, stored: Stored) -> SandboxRecord | None:
        if stored.data is None or not names_domain(stored.data, stored.domain):
            return None
        try:
            return SandboxRecord.from_dict(stored.data)
        except FailedPrecondition:
            if str(stored.data.get("keys", "")).startswith(f"{self.config.sandboxes}/"):
                raise
            return None

    def lookup(self, name: str) -> tuple[SandboxRecord, str] | None:
        """The record and state of sandbox ``name`` (``find``)."""
        found = self.find(name)
        return None if found is None else (found.record, found.state)

    def find(self, name: str) -> Found | None:
        """Sandbox ``name``: domain ``vmsbx-<name>`` when created cold and its record still
        has that name, else the claimed pooled guest whose record names it; None when there is
        none (a pooled guest claimed by another name is not found by its old one).
        FAILED_PRECONDITION for a domain of that name that vmsandbox did not make."""
        stored = self.hypervisor.metadata(DOMAIN_PREFIX + name)
        if stored is not None:
            if stored.data is None or not names_domain(stored.data, stored.domain):
                raise FailedPrecondition(
                    f"domain {stored.domain!r} exists but was not made by vmsandbox; "
                    "not touching it"
                )
            record = SandboxRecord.from_dict(stored.data)
            if record.name == name:
                return Found(record, stored.state, stored.uuid)
        return next(
            (found for found in self.found() if found.record.guest and found.record.name == name),
            None,
        )

    def by_domain(self, domain: str, uuid: str | None = None) -> Found | None:
        """The sandbox whose domain is ``domain`` (a claimed guest's keeps the guest's name;
        with ``uuid``, the domain of that UUID); None when that domain is gone or is not a
        sandbox."""
        stored = self.hypervisor.metadata(domain, uuid=uuid)
        if stored is None or (record := self._record(stored)) is None:
            return None
        return Found(record, stored.state, stored.uuid)

    def get(self, name: str) -> tuple[SandboxRecord, str]:
        """As ``lookup``, for a valid name; NOT_FOUND when there is no such sandbox."""
        found = self.require(name)
        return found.record, found.state

    def require(self, name: str, uuid: str | None = None) -> Found:
        """As ``find``, for a valid name; NOT_FOUND when there is no such sandbox, or (with
        ``uuid``) when the sandbox of that name now is another one."""
        validate_name(name)
        found = self.find(name)
        if found is None:
            raise NotFound(f"sandbox {name!r} does not exist", details={"name": name})
        if uuid is not None and found.uuid != uuid:
            raise NotFound(
                f"sandbox {name!r} with id {uuid} does not exist (a later sandbox has the name)",
                details={"name": name, "uuid": uuid},
            )
        return found

    def local(self, record: SandboxRecord) -> bool:
        """Whether this state directory made the sandbox (its record names our keys folder)."""
        return record.keys == str(SandboxFiles.of(self.config, record.stem).keys_dir)

    def put(self, record: SandboxRecord, state: str, uuid: str | None = None) -> None:
        """Write the record and state (with ``uuid``: into that domain only, NOT_FOUND when
        it is gone)."""
        self.hypervisor.set_metadata(record.domain, record.to_dict(), state, uuid=uuid or None)

    def update(self, name: str, *, uuid: str | None = None, **changes: Any) -> Sandbox:
        """Write ``changes`` (record fields) into sandbox ``name``'s record (with ``uuid``: only
        the sandbox of that identity, ``require``), under the host lock the caller holds; the
        sandbox as it is then."""
        found = self.require(name, uuid)
        record = replace(found.record, **changes)
        self.put(record, found.state, found.uuid)
        return self.view(record, found.state, found.uuid)

    def commit(
        self,
        found: Found,
        change: Callable[[SandboxRecord], SandboxRecord],
        state: str | None = None,
    ) -> Found:
        """Under the host lock the caller holds, for a call that looked ``found`` up and then
        did slow work (a boot wait, a verification): ``change`` applied to the record the
        sandbox has *now*, stored with ``state`` (default: the state it has now), only while
        its domain still has ``found.uuid`` and no teardown has taken its hold over (a
        compare-and-set: the domain of a later sandbox of that name is never written).
        NOT_FOUND otherwise."""
        stored = self.hypervisor.metadata(found.record.domain, uuid=found.uuid)
        hold = Holds(self.config).get(found.uuid)
        if stored is None or stored.data is None or (hold is not None and hold.being_removed):
            raise NotFound(
                f"sandbox {found.record.name!r} (id {found.uuid}) was removed while this call "
                "worked on it",
                details={"name": found.record.name, "uuid": found.uuid},
            )
        record = change(SandboxRecord.from_dict(stored.data))
        now = state or stored.state
        self.put(record, now, found.uuid)
        return Found(record, now, found.uuid)

    def holder(
        self, secret: str, among: Callable[[Sandbox], bool] = lambda _sandbox: True
    ) -> Sandbox | None:
        """The sandbox of those ``among`` accepts whose recorded credential ``secret`` matches
        (credential.py, each record compared in constant time); None when none does."""
        for f in self.found():
            if f.record.credential and credential.matches(secret, f.record.credential):
                shown = self.view(f.record, f.state, f.uuid)
                if among(shown):
                    return shown
        return None

    def with_address(self, record: SandboxRecord, state: str, uuid: str = "") -> SandboxRecord:
        """``record``, and for a libvirt-network guest whose address is not known yet the
        address of its DHCP lease once there is one, learned once and kept in the record
        (of the domain ``uuid``, when given)."""
        if record.ssh.port is None:
            address = self.hypervisor.lease_address(record.domain, uuid=uuid or None)
            if address is not None:
                record = replace(record, ssh=replace(record.ssh, host=address, port=22))
                self.put(record, state, uuid)
        return record

    def view(self, record: SandboxRecord, state: str, uuid: str = "") -> Sandbox:
        """The sandbox as a caller sees it: its recorded state while its domain runs (or while
        it is being made, only defined, or started by a process that still lives), else
        ``stopped``; ``started`` for one recorded ``starting`` whose starter is gone (after a
        ``start --no-wait`` nobody waits for it). When libvirtd cannot say whether it runs, the
        recorded state (a create that committed must not turn into an error on its last read).
        With ``uuid``, the domain of that identity (a record read earlier is not shown with a
        namesake's state)."""
        try:
            running = self.hypervisor.running(record.domain, uuid=uuid or None)
        except Unavailable:  # libvirtd is away: show what the record says, decide nothing
            running = True
        starter = record.starter
        starting = state == STATE_STARTING and starter is not None and starter.alive()
        held = running or starting or state in (STATE_CREATING, STATE_DEFINED, *SAVED_STATES)
        if running and state == STATE_STARTING and not starting:
            state = STATE_STARTED  # its starter is gone: nobody is waiting for it any more
        files = SandboxFiles.of(self.config, record.stem)
        sandbox = Sandbox.of(record, state if held else STATE_STOPPED, files)
        sandbox.uuid = uuid
        sandbox.local = self.local(record)
        return sandbox
