"""A sandbox as a caller sees it: its record, its state now, and where its keys are."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vmsandbox.guest.ssh import Endpoint
from vmsandbox.sandbox.record import SandboxFiles, SandboxRecord


@dataclass
class Sandbox:
    """A sandbox as a caller sees it."""

    name: str
    domain: str
    state: str  # ready | started | starting | failed | creating | defined | stopped | ...
    image: str
    cpus: int
    memory_mib: int
    disk_gib: int
    virt_type: str
    ssh: Endpoint | None
    key_file: Path
    known_hosts: Path
    host_key_alias: str
    created_at: str
    gpus: list[dict[str, Any]] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)
    verification: dict[str, Any] | None = None
    boot_seconds: float | None = None
    # A pool claim's steps, seconds each: where its time went (None for other creates).
    stage_seconds: dict[str, float] | None = None
    # State failed: {code, message} of why (power.wait); with reason "GpuQuarantined" when the
    # health monitor took one of its GPUs out (health.py).
    failure: dict[str, str] | None = None
    generation: str | None = None  # the OpenShell gateway's last start generation (record.py)
    owner: str | None = None  # who asked for it through the OpenShell driver (record.py)
    expires_at: str | None = None  # when its lifetime ends (UTC); None: never (lifetime.py)
    # The domain's UUID: the sandbox's identity (its name is a label that can be used again).
    uuid: str = ""
    local: bool = True  # made with this manager's state directory
    # Its serial console's log (firmware, kernel, first boot): a claimed guest's keeps its name.
    console_log: Path | None = None
    # Suspended: when, the GPUs it will take again, the size of its saved memory
    # (suspension.py's ``shown``); None when it is not suspended.
    suspended: dict[str, Any] | None = None

    @property
    def saved_bytes(self) -> int:
        """The disk its saved memory takes (0 when it is not suspended)."""
        return int((self.suspended or {}).get("save_bytes") or 0)

    @classmethod
    def of(cls, record: SandboxRecord, state: str, files: SandboxFiles) -> Sandbox:
        ssh = record.ssh
        keys = files.keys(record.host_key_alias)
        return cls(
            name=record.name,
            domain=record.domain,
            state=state,
            image=record.image,
            cpus=record.cpus,
            memory_mib=record.memory_mib,
            disk_gib=record.disk_gib,
            virt_type=record.virt_type,
            ssh=Endpoint(ssh.host, ssh.port, ssh.user) if ssh.port else None,
            key_file=keys.client_key,
            known_hosts=keys.known_hosts,
            host_key_alias=record.host_key_alias,
            created_at=record.created_at,
            gpus=[gpu.to_dict() for gpu in record.gpus],
            labels=dict(record.labels),
            verification=record.verification,
            failure=record.failure,
            generation=record.generation,
            owner=record.owner,
            boot_seconds=record.boot_seconds,
            console_log=files.console_log,
            expires_at=record.expires_at,
            suspended=record.suspended.shown() if record.suspended else None,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "uuid": self.uuid,
            "domain": self.domain,
            "state": self.state,
            "image": self.image,
            "cpus": self.cpus,
            "memory_mib": self.memory_mib,
            "disk_gib": self.disk_gib,
            "virt_type": self.virt_type,
            "ssh": (
                {"host": self.ssh.host, "port": self.ssh.port, "user": self.ssh.user}
                if self.ssh
                else None
            ),
            "key_file": str(self.key_file),
            "known_hosts": str(self.known_hosts),
            "host_key_alias": self.host_key_alias,
            "created_at": self.created_at,
            "gpus": self.gpus,
            "labels": self.labels,
            "verification": self.verification,
            "boot_seconds": self.boot_seconds,
            "stage_seconds": self.stage_seconds,
            "failure": self.failure,
            "generation": self.generation,
            "console_log": str(self.console_log) if self.console_log else None,
            "expires_at": self.expires_at,
            "expires_in_seconds": self.expires_in_seconds,
            "suspended": self.suspended,
            "saved_bytes": self.saved_bytes,
        }

    @property
    def expires_in_seconds(self) -> int | None:
        """Whole seconds left of its lifetime now (0 once it has ended, until it is reaped);
        None when it has none."""
        from vmsandbox.sandbox.expiry import seconds_left

        left = seconds_left(self.expires_at)
        return None if left is None else int(left)
