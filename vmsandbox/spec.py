"""What a caller asks for: a sandbox (``SandboxSpec``) and its GPUs (``GpuRequest``).

Everything here validates on construction and raises ``InvalidArgument`` naming the field, the
value and what is allowed, so a bad request never gets further than this module.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, field

from vmsandbox.credential import check as check_credential
from vmsandbox.errors import InvalidArgument
from vmsandbox.gpuquery import GPU_VENDORS as GPU_VENDORS  # re-exported for callers
from vmsandbox.gpuquery import (
    check_count_matches_devices,
    invalid,
    normalise_device_ids,
    normalise_model,
    normalise_vendor,
    require_count,
    shown,
)
from vmsandbox.guestsetup import GuestSetup

NAME_MAX = 48
_NAME_RE = re.compile(r"^[a-z0-9](?:[a-z0-9-]*[a-z0-9])?\Z")  # \Z: "$" also matches before "\n"
IMAGE_NAME_MAX = 64
_IMAGE_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*\Z")
VIRT_TYPES = ("auto", "kvm", "qemu")


def validate_name(name: object, what: str = "name") -> str:
    """A sandbox name: lowercase letters, digits and inner dashes, at most NAME_MAX chars."""
    if not isinstance(name, str) or not name or len(name) > NAME_MAX or not _NAME_RE.match(name):
        raise InvalidArgument(
            f"{what} {name!r} is not valid: use 1-{NAME_MAX} lowercase letters, digits and dashes, "
            "starting and ending with a letter or digit",
            details={"field": what, "value": repr(name)},
        )
    return name


def validate_image_name(name: object) -> str:
    """An image name: lowercase letters, digits, '.', '_' and '-', not starting with a dot."""
    if (
        not isinstance(name, str)
        or not name
        or len(name) > IMAGE_NAME_MAX
        or not _IMAGE_NAME_RE.match(name)
    ):
        raise InvalidArgument(
            f"image {name!r} is not valid: use 1-{IMAGE_NAME_MAX} lowercase letters, digits, "
            "'.', '_' and '-', starting with a letter or digit",
            details={"field": "image", "value": repr(name)},
        )
    return name


def generate_name(prefix: str = "sbx") -> str:
    return f"{prefix}-{secrets.token_hex(4)}"


def _positive_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgument(
            f"{what} must be a positive integer, got {value!r}",
            details={"field": what, "value": repr(value)},
        )
    return value


@dataclass(frozen=True)
class GpuRequest:
    """Which GPUs a sandbox wants. No count, devices or ``all`` means one GPU.

    Validated and normalised on construction (see ``vmsandbox.gpuquery`` for the spellings):
    ``devices`` holds canonical BDFs (``0000:41:00.0``), NVIDIA or ROCm UUIDs (``GPU-...``), DRM
    card names (``card1``) or inventory indexes (as strings), in the order given; all but BDFs
    are resolved against the inventory at allocation time. ``count`` with ``devices`` must equal
    their number; ``all`` excludes both. ``vendor``, ``model`` (whole-word match) and
    ``min_memory_mib`` filter.
    """

    count: int | None = None
    devices: tuple[str, ...] = ()
    all: bool = False
    vendor: str | None = None
    model: str | None = None
    min_memory_mib: int | None = None

    def __post_init__(self) -> None:
        if self.count is not None:
            require_count(self.count, "count")
        if not isinstance(self.devices, tuple | list):
            raise invalid(
                "devices",
                self.devices,
                f"devices must be a list of device ids, got {shown(self.devices)}",
            )
        object.__setattr__(self, "devices", normalise_device_ids(self.devices, "devices"))
        if not isinstance(self.all, bool):
            raise invalid("all", self.all, f"all must be true or false, got {shown(self.all)}")
        if self.vendor is not None:
            object.__setattr__(self, "vendor", normalise_vendor(self.vendor, "vendor"))
        if self.model is not None:
            object.__setattr__(self, "model", normalise_model(self.model, "model"))
        if self.min_memory_mib is not None and (
            isinstance(self.min_memory_mib, bool)
            or not isinstance(self.min_memory_mib, int)
            or self.min_memory_mib < 1
        ):
            raise invalid(
                "min_memory_mib",
                self.min_memory_mib,
                f"min_memory_mib must be a whole number of MiB greater than 0, "
                f"got {shown(self.min_memory_mib)}",
            )
        if self.all and (self.count is not None or self.devices):
            taken = "count" if self.count is not None else "devices"
            raise invalid(
                taken,
                getattr(self, taken),
                f"all=True takes every free GPU, so {taken} cannot be given with it: "
                f"drop {taken} or all",
            )
        check_count_matches_devices(self.count, self.devices, "count", "devices")

    def wanted(self) -> int | None:
        """How many GPUs this asks for; None means every free one (``all``)."""
        if self.all:
            return None
        return self.count or len(self.devices) or 1


@dataclass(frozen=True)
class SandboxSpec:
    """A sandbox request. Sizes: ``memory_mib`` in MiB, ``disk_gib`` in GiB."""

    name: str | None = None
    image: str = "minimal"
    cpus: int = 1
    memory_mib: int = 1024
    disk_gib: int = 4
    gpu: GpuRequest | None = None
    virt_type: str = "auto"
    labels: dict[str, str] = field(default_factory=dict)
    # First-boot environment, files and main process; kept out of the domain and its record.
    guest: GuestSetup | None = None
    # A salted digest (vmsandbox.credential.digest) of a secret the guest holds, kept in the
    # record so the sandbox can be recognised by that secret; never the secret itself.
    credential: str | None = None

    def __post_init__(self) -> None:
        if self.name is not None:
            validate_name(self.name)
        validate_image_name(self.image)
        _positive_int(self.cpus, "cpus")
        _positive_int(self.memory_mib, "memory_mib")
        _positive_int(self.disk_gib, "disk_gib")
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
        if self.credential is not None:
            check_credential(self.credential, "credential")
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
