"""GetCapabilities: what vmsandbox answers (``capabilities``, the same for a host's driver and
the fleet's), and the extension handshake, as an OpenShell v0.1 gateway makes it.

The gateway sends its ``PeerMetadata`` in ``GetCapabilitiesRequest.gateway`` and activates a
driver only when the driver's answer carries one too (``GetCapabilitiesResponse.extension``).
Both sides check the other the same way: the same protocol major version, and every capability
one side requires among those the other supports. The compute contract itself is the
capability ``openshell.compute.contract``, which each side both supports and requires.

vmsandbox answers protocol 1.0 as implementation ``vmsandbox`` at its own version, supporting
and requiring the contract. A request without gateway metadata (a gateway older than v0.1),
of another major version, or requiring a capability vmsandbox lacks is FAILED_PRECONDITION
naming what is missing; malformed metadata (an empty name, a capability that is not a
lowercase ``openshell.``-namespaced identifier, a repeated one) is INVALID_ARGUMENT naming the
field. The limits are the gateway's own.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import vmsandbox
from vmsandbox.errors import FailedPrecondition, InvalidArgument
from vmsandbox.openshell.admission import AdmissionPolicy
from vmsandbox.openshell.proto import compute_driver_pb2 as pb
from vmsandbox.openshell.proto import extension_pb2 as ext
from vmsandbox.openshell.request import DEFAULT_IMAGE

PROTOCOL_MAJOR = 1
PROTOCOL_MINOR = 0
CONTRACT = "openshell.compute.contract"
IMPLEMENTATION = "vmsandbox"
SUPPORTED = (CONTRACT,)
REQUIRED = (CONTRACT,)
_MAX_TEXT_BYTES = 128
_MAX_CAPABILITY_BYTES = 128
_MAX_CAPABILITIES = 128
_SEGMENT = re.compile(r"[a-z0-9-]+\Z")


def driver_metadata() -> ext.PeerMetadata:
    """What vmsandbox tells the gateway about itself."""
    return ext.PeerMetadata(
        protocol_version=ext.ProtocolVersion(major=PROTOCOL_MAJOR, minor=PROTOCOL_MINOR),
        implementation_name=IMPLEMENTATION,
        implementation_version=vmsandbox.__version__,
        supported_capabilities=list(SUPPORTED),
        required_capabilities=list(REQUIRED),
    )


def capabilities(admission: AdmissionPolicy, *, reports_readiness: bool) -> Any:
    """The GetCapabilitiesResponse: CPU and memory limits, a GPU count and a GPU request
    without one (vmsandbox picks) are honoured; rootfs tar sources are not (no staging
    directory, size 0); a sandbox's token identifies it; the extension protocol and the
    operator's admission policy. ``reports_readiness``: the driver says when a sandbox is
    ready (else the gateway also waits for a supervisor to call back)."""
    return pb.GetCapabilitiesResponse(
        driver_name="vmsandbox",
        driver_version=vmsandbox.__version__,
        default_image=DEFAULT_IMAGE,
        gateway_manages_lifecycle=False,
        supports_sandbox_authentication=True,
        driver_reports_runtime_readiness=reports_readiness,
        resource_capabilities=pb.ResourceCapabilities(
            cpu=pb.CpuResourceCapabilities(limit_supported=True),
            memory=pb.MemoryResourceCapabilities(limit_supported=True),
            gpu=pb.GpuResourceCapabilities(
                default_selection_supported=True, count_selection_supported=True
            ),
        ),
        rootfs_tar_staging_dir="",
        rootfs_tar_max_bytes=0,
        extension=driver_metadata(),
        resource_admission_policy=admission.acknowledgement(),
    )


def check_gateway(present: bool, gateway: ext.PeerMetadata) -> None:
    """Refuse a gateway this driver cannot serve (see the module docstring); ``present`` is
    whether the request carried ``gateway`` at all."""
    if not present:
        raise FailedPrecondition(
            "the gateway sent no protocol metadata (GetCapabilitiesRequest.gateway): vmsandbox "
            "serves OpenShell v0.1 gateways, which send it; upgrade the gateway",
            details={"field": "gateway"},
        )
    if not gateway.HasField("protocol_version"):
        raise FailedPrecondition(
            "the gateway's metadata has no protocol_version",
            details={"field": "gateway.protocol_version"},
        )
    version = gateway.protocol_version
    if version.major != PROTOCOL_MAJOR:
        raise FailedPrecondition(
            f"the gateway speaks extension protocol {version.major}.{version.minor}; vmsandbox "
            f"speaks {PROTOCOL_MAJOR}.{PROTOCOL_MINOR} (the major versions must match)",
            details={"field": "gateway.protocol_version", "value": version.major},
        )
    for field in ("implementation_name", "implementation_version"):
        _check_text(field, getattr(gateway, field))
    supported = _capabilities("supported_capabilities", gateway.supported_capabilities)
    required = _capabilities("required_capabilities", gateway.required_capabilities)
    unmet = sorted(required - set(SUPPORTED))
    if unmet:
        raise FailedPrecondition(
            f"the gateway requires capabilities vmsandbox does not support: {', '.join(unmet)} "
            f"(vmsandbox supports {', '.join(SUPPORTED)})",
            details={"field": "gateway.required_capabilities", "missing": unmet},
        )
    lacking = sorted(set(REQUIRED) - supported)
    if lacking:
        raise FailedPrecondition(
            f"the gateway does not support capabilities vmsandbox requires: {', '.join(lacking)}",
            details={"field": "gateway.supported_capabilities", "missing": lacking},
        )


def _check_text(field: str, value: str) -> None:
    problem = (
        "must not be empty"
        if not value.strip()
        else f"must be at most {_MAX_TEXT_BYTES} bytes"
        if len(value.encode()) > _MAX_TEXT_BYTES
        else "must not contain control characters"
        if any(ord(ch) < 0x20 or 0x7F <= ord(ch) < 0xA0 for ch in value)
        else None
    )
    if problem:
        raise InvalidArgument(
            f"gateway.{field} {value!r} {problem}",
            details={"field": f"gateway.{field}", "value": value},
        )


def _capabilities(field: str, values: Sequence[str]) -> set[str]:
    if len(values) > _MAX_CAPABILITIES:
        raise InvalidArgument(
            f"gateway.{field} has {len(values)} entries; at most {_MAX_CAPABILITIES} are allowed",
            details={"field": f"gateway.{field}"},
        )
    seen: set[str] = set()
    for value in values:
        if not valid_capability(value):
            raise InvalidArgument(
                f"gateway.{field} entry {value!r} is not a capability: use a lowercase "
                "identifier of at least three dot-separated parts starting with 'openshell.'",
                details={"field": f"gateway.{field}", "value": value},
            )
        if value in seen:
            raise InvalidArgument(
                f"gateway.{field} names {value!r} twice",
                details={"field": f"gateway.{field}", "value": value},
            )
        seen.add(value)
    return seen


def valid_capability(value: str) -> bool:
    """A capability name as the gateway allows them: ``openshell.`` and at least two more
    dot-separated parts of lowercase letters, digits and dashes, at most 128 bytes."""
    parts = value.split(".")
    return (
        0 < len(value) <= _MAX_CAPABILITY_BYTES
        and parts[0] == "openshell"
        and len(parts) >= 3
        and all(_SEGMENT.match(part) for part in parts)
    )
