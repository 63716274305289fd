"""The sandboxes libvirt holds: their records read from and written to their domains' metadata,
and each one as a caller sees it (the state shown follows whether its domain runs).

libvirt is the only database: every sandbox is a persistent domain named ``vmsbx-<name>`` whose
metadata holds its record (record.py) and lifecycle state.
"""

from __future__ import annotations

from vmsandbox.config import Config
from vmsandbox.errors import FailedPrecondition, NotFound
from vmsandbox.hypervisor import Hypervisor
from vmsandbox.record import (
    DOMAIN_PREFIX,
    STATE_CREATING,
    STATE_DEFINED,
    STATE_STARTING,
    SandboxFiles,
    SandboxRecord,
    names_domain,
)
from vmsandbox.sandbox import Sandbox
from vmsandbox.spec import validate_name


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
        """The record and state of sandbox ``name``, None when no domain has its name;
        FAILED_PRECONDITION for a domain of that name that vmsandbox did not make."""
        stored = self.hypervisor.metadata(DOMAIN_PREFIX + name)
        if stored is None:
            return None
        if stored.data is None or not names_domain(stored.data, stored.domain):
            raise FailedPrecondition(
                f"domain {stored.domain!r} exists but was not made by vmsandbox; not touching it"
            )
        return SandboxRecord.from_dict(stored.data), stored.state

    def get(self, name: str) -> tuple[SandboxRecord, str]:
        """As ``lookup``, for a valid name; NOT_FOUND when there is no such sandbox."""
        validate_name(name)
        found = self.lookup(name)
        if found is None:
            raise NotFound(f"sandbox {name!r} does not exist", details={"name": name})
        return found

    def put(self, record: SandboxRecord, state: str) -> None:
        self.hypervisor.set_metadata(DOMAIN_PREFIX + record.name, record.to_dict(), state)

    def view(self, record: SandboxRecord, state: str) -> Sandbox:
        """The sandbox as a caller sees it: its recorded state while its domain runs (or while
        it is being made, only defined, or started by a process that still lives), else
        ``stopped``."""
        running = self.hypervisor.running(DOMAIN_PREFIX + record.name)
        starter = record.starter
        starting = state == STATE_STARTING and starter is not None and starter.alive()
        held = running or starting or state in (STATE_CREATING, STATE_DEFINED)
        return Sandbox.of(
            record, state if held else "stopped", SandboxFiles.of(self.config, record.name)
        )
