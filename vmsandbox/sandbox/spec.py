"""What a caller asks for: a sandbox (``SandboxSpec``), its GPUs a ``GpuRequest`` (gpu/request.py).

Everything here validates on construction and raises ``InvalidArgument`` naming the field, the
value and what is allowed, so a bad request never gets further than this module.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from vmsandbox.config import DEFAULT_CPUS, DEFAULT_DISK_GIB, DEFAULT_MEMORY_MIB
from vmsandbox.errors import InvalidArgument
from vmsandbox.gpu.request import GpuRequest
from vmsandbox.guest.setup import GuestSetup
from vmsandbox.sandbox.credential import check as check_credential
from vmsandbox.validate import check_duration, positive_int, validate_image_name, validate_name

VIRT_TYPES = ("auto", "kvm", "qemu")


def generate_name(prefix: str = "sbx") -> str:
    return f"{prefix}-{secrets.token_hex(4)}"


@dataclass(frozen=True)
class SandboxSpec:
    """A sandbox request. Sizes: ``memory_mib`` in MiB, ``disk_gib`` in GiB."""

    name: str | None = None
    image: str = "minimal"
    cpus: int = DEFAULT_CPUS
    memory_mib: int = DEFAULT_MEMORY_MIB
    disk_gib: int = DEFAULT_DISK_GIB
    gpu: GpuRequest | None = None
    virt_type: str = "auto"
    labels: dict[str, str] = field(default_factory=dict)
    # First-boot environment, files and main process; kept out of the domain and its record.
    guest: GuestSetup | None = None
    # A salted digest (vmsandbox.sandbox.credential.digest) of a secret the guest holds, kept in the
    # record so the sandbox can be recognised by that secret; never the secret itself.
    credential: str | None = None
    # Who asks, when a driver asks for a caller (the OpenShell driver's gateway identity,
    # openshell/caller.py): kept in the record, never interpreted here.
    owner: str | None = None
    # Seconds the sandbox lives, from its create: ``vmsandbox reap`` (or ``serve``) destroys it
    # after that (lifetime.py). None: it lives until destroyed.
    ttl: int | float | None = None

    def __post_init__(self) -> None:
        if self.name is not None:
            validate_name(self.name)
        validate_image_name(self.image)
        positive_int(self.cpus, "cpus")
        positive_int(self.memory_mib, "memory_mib")
        positive_int(self.disk_gib, "disk_gib")
        if self.virt_type not in VIRT_TYPES:
            raise InvalidArgument(
                f"virt_type {self.virt_type!r} is not one of {', '.join(VIRT_TYPES)}",
                details={"field": "virt_type", "value": repr(self.virt_type)},
            )
        if self.gpu is not None and not isinstance(self.gpu, GpuRequest):
            raise InvalidArgument(
                f"gpu must be a GpuRequest or None, got {type(self.gpu).__name__}",
                details={"field": "gpu"},
            )
        if self.guest is not None and not isinstance(self.guest, GuestSetup):
            raise InvalidArgument(
                f"guest must be a GuestSetup or None, got {type(self.guest).__name__}",
                details={"field": "guest"},
            )
        if self.ttl is not None:
            check_duration(self.ttl, "ttl")
        if self.credential is not None:
            check_credential(self.credential, "credential")
        if self.owner is not None and (
            not isinstance(self.owner, str)
            or not 0 < len(self.owner) <= 200
            or not self.owner.isprintable()
        ):
            raise InvalidArgument(
                "owner must be 1 to 200 printable characters", details={"field": "owner"}
            )
        if not isinstance(self.labels, dict):
            raise InvalidArgument(
                f"labels must map strings to strings, got {type(self.labels).__name__}",
                details={"field": "labels"},
            )
        for key, value in self.labels.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise InvalidArgument(
                    "labels must map strings to strings", details={"field": "labels"}
                )
