"""One exception tree whose classes carry gRPC-style status codes.

A gateway can forward ``err.code`` and ``str(err)`` unchanged; ``to_dict`` gives the JSON form
the CLI prints with ``--json``.
"""

from __future__ import annotations

from typing import Any


class VmSandboxError(Exception):
    """Base of every error vmsandbox raises on purpose."""

    code = "INTERNAL"

    def __init__(self, message: str, *, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = details or {}

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.details:
            out["details"] = self.details
        return out


class InvalidArgument(VmSandboxError):
    """The request itself is wrong: a field has a value that is not allowed."""

    code = "INVALID_ARGUMENT"


class FailedPrecondition(VmSandboxError):
    """The host, as configured, cannot satisfy the request; retrying will not help."""

    code = "FAILED_PRECONDITION"


class ResourceExhausted(VmSandboxError):
    """The request would work once resources (GPUs, ports) are freed: retryable."""

    code = "RESOURCE_EXHAUSTED"


class NotFound(VmSandboxError):
    code = "NOT_FOUND"


class AlreadyExists(VmSandboxError):
    code = "ALREADY_EXISTS"


class Unavailable(VmSandboxError):
    """libvirt (or another service we depend on) cannot be reached right now."""

    code = "UNAVAILABLE"


class DeadlineExceeded(VmSandboxError):
    """The guest did not come up (or answer) within its timeout."""

    code = "DEADLINE_EXCEEDED"


class Unauthenticated(VmSandboxError):
    """A credential identifies no sandbox, or the OpenShell driver cannot tell who calls (gRPC
    code 16). Its message never repeats a credential."""

    code = "UNAUTHENTICATED"


class PermissionDenied(VmSandboxError):
    """The caller is known but may not do this (gRPC code 7): a peer of the OpenShell driver's
    socket that names a gateway without being a trusted delegate (openshell/caller.py)."""

    code = "PERMISSION_DENIED"


class Internal(VmSandboxError):
    code = "INTERNAL"


class GuestVerificationFailed(FailedPrecondition):
    """The guest booted but the GPUs it was promised do not all work inside it."""


ALL_CODES = (
    "INVALID_ARGUMENT",
    "FAILED_PRECONDITION",
    "RESOURCE_EXHAUSTED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "UNAVAILABLE",
    "DEADLINE_EXCEEDED",
    "UNAUTHENTICATED",
    "PERMISSION_DENIED",
    "INTERNAL",
)
