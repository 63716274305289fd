"""The sandboxes libvirt holds: their records read from and written to their domains' metadata,
and each one as a caller sees it (the state shown follows whether its domain runs).

libvirt is the only database: every sandbox is a persistent domain whose metadata holds its
record (record.py) and lifecycle state: ``vmsbx-<name>`` when it was created cold,
``vmsbx-pool-<id>`` when it was claimed from the warm pool (pool.py; the record's ``guest``
names that guest). Every reader finds a sandbox by the name in its record.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from vmsandbox.config import Config
from vmsandbox.errors import FailedPrecondition, NotFound
from vmsandbox.sandbox import credential, plan
from vmsandbox.sandbox.handle import Sandbox
from vmsandbox.sandbox.record import (
    DOMAIN_PREFIX,
    STATE_CREATING,
    STATE_DEFINED,
    STATE_STARTING,
    SandboxFiles,
    SandboxRecord,
    names_domain,
)
from vmsandbox.validate import validate_name
from vmsandbox.vm.hypervisor import Hypervisor


class SandboxStore:
    """Records of sandboxes in the domains of one hypervisor."""

    def __init__(self, hypervisor: Hypervisor, config: Config) -> None:
        self.hypervisor = hypervisor
        self.config = config

    def all(self) -> list[tuple[SandboxRecord, str]]:
        """Our sandboxes (any state directory) with their recorded state. A record of a newer
        vmsandbox is refused when it is this state directory's, and skipped otherwise."""
        found = []
        for stored in self.hypervisor.list(DOMAIN_PREFIX):
            if stored.data is None or not names_domain(stored.data, stored.domain):
                continue
            try:
                found.append((SandboxRecord.from_dict(stored.data), stored.state))
            except FailedPrecondition:
                if str(stored.data.get("keys", "")).startswith(f"{self.config.sandboxes}/"):
                    raise
        return found

    def lookup(self, name: str) -> tuple[SandboxRecord, str] | None:
        """The record and state of sandbox ``name``: domain ``vmsbx-<name>`` when created cold,
        else the claimed pooled guest whose record names it; None when there is none.
        FAILED_PRECONDITION for a domain of that name that vmsandbox did not make."""
        stored = self.hypervisor.metadata(DOMAIN_PREFIX + name)
        if stored is not None:
            if stored.data is None or not names_domain(stored.data, stored.domain):
                raise FailedPrecondition(
                    f"domain {stored.domain!r} exists but was not made by vmsandbox; "
                    "not touching it"
                )
            return SandboxRecord.from_dict(stored.data), stored.state
        return next(
            (found for found in self.all() if found[0].guest and found[0].name == name), None
        )

    def get(self, name: str) -> tuple[SandboxRecord, str]:
        """As ``lookup``, for a valid name; NOT_FOUND when there is no such sandbox."""
        validate_name(name)
        found = self.lookup(name)
        if found is None:
            raise NotFound(f"sandbox {name!r} does not exist", details={"name": name})
        return found

    def local(self, record: SandboxRecord) -> bool:
        """Whether this state directory made the sandbox (its record names our keys folder)."""
        return record.keys == str(SandboxFiles.of(self.config, record.stem).keys_dir)

    def free_port(self) -> int:
        """A loopback port that no sandbox of ours forwards and nothing listens on now."""
        return plan.free_port({record.ssh.port for record, _state in self.all()})

    def put(self, record: SandboxRecord, state: str) -> None:
        self.hypervisor.set_metadata(record.domain, record.to_dict(), state)

    def update(self, name: str, **changes: Any) -> Sandbox:
        """Write ``changes`` (record fields) into sandbox ``name``'s record, under the host lock
        the caller holds; the sandbox as it is then."""
        record, state = self.get(name)
        record = replace(record, **changes)
        self.put(record, state)
        return self.view(record, state)

    def holder(self, secret: str) -> Sandbox | None:
        """The sandbox whose recorded credential ``secret`` matches (credential.py, each record
        compared in constant time); None when none does."""
        for record, state in self.all():
            if record.credential and credential.matches(secret, record.credential):
                return self.view(record, state)
        return None

    def with_address(self, record: SandboxRecord, state: str) -> SandboxRecord:
        """``record``, and for a libvirt-network guest whose address is not known yet the
        address of its DHCP lease once there is one, learned once and kept in the record."""
        if record.ssh.port is None:
            address = self.hypervisor.lease_address(record.domain)
            if address is not None:
                record = replace(record, ssh=replace(record.ssh, host=address, port=22))
                self.put(record, state)
        return record

    def view(self, record: SandboxRecord, state: str) -> Sandbox:
        """The sandbox as a caller sees it: its recorded state while its domain runs (or while
        it is being made, only defined, or started by a process that still lives), else
        ``stopped``."""
        running = self.hypervisor.running(record.domain)
        starter = record.starter
        starting = state == STATE_STARTING and starter is not None and starter.alive()
        held = running or starting or state in (STATE_CREATING, STATE_DEFINED)
        return Sandbox.of(
            record, state if held else "stopped", SandboxFiles.of(self.config, record.stem)
        )
