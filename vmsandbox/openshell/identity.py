"""A sandbox's runtime identity and fence evidence, as an OpenShell v0.1 gateway binds them.

The gateway records the ``runtime_identity`` CreateSandbox and each StartSandbox return, and
lets a sandbox bootstrap (AuthenticateSandbox) only when the identity the driver then reports
is the recorded one. vmsandbox's identity is ``vmsandbox:<incarnation>:<generation>``:

- ``incarnation``: 32 hex digits drawn when the guest is created (the INCARNATION_LABEL of its
  record). It stays across stops, starts and restarts of ``vmsandbox serve``, and a guest
  created anew, even under the same name and gateway id, gets another.
- ``generation``: ``0`` until a StartSandbox carries a ``generation_id``; then the first 16
  hex digits of that id's SHA-256 (the id is kept in the record's ``generation``).

StartSandbox checks ``expected_runtime_identity`` (the identity the gateway recorded last)
before starting anything: it must be this sandbox's identity now, or, for a retry of the start
that already happened (same incarnation, the request's generation is the current one), the
identity that start replaced. Anything else is FAILED_PRECONDITION: the start was meant for
another incarnation or generation. A retry carries the same ``generation_id`` and leaves the
identity as it is; a later start brings a new id, and the identity's generation changes.

Fence evidence (``DriverSandboxStatus.fence_evidence``) states what the sandbox runs on for
its generation: the domain, incarnation, image, GPUs by PCI address and the guest network, as
``resource_claims``, and ``evidence_digest``, the SHA-256 of the generation and claims as
compact JSON with sorted keys.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from dataclasses import dataclass

from vmsandbox.errors import FailedPrecondition, InvalidArgument
from vmsandbox.openshell.proto import compute_driver_pb2 as pb
from vmsandbox.sandbox.handle import Sandbox

INCARNATION_LABEL = "openshell.incarnation"
SCHEME = "vmsandbox"
_GENERATION_MAX = 256
_INCARNATION = re.compile(r"[0-9a-f]{32}\Z")


def new_incarnation() -> str:
    """A fresh incarnation for a guest being created."""
    return secrets.token_hex(16)


def check_generation_id(value: str) -> str:
    """A gateway generation id: printable ASCII without spaces, at most 256 characters."""
    if len(value) > _GENERATION_MAX or not all(0x21 <= ord(ch) <= 0x7E for ch in value):
        raise InvalidArgument(
            f"generation_id {value[:40]!r} is not a generation id: use at most "
            f"{_GENERATION_MAX} printable ASCII characters without spaces",
            details={"field": "generation_id"},
        )
    return value


@dataclass(frozen=True)
class RuntimeIdentity:
    """One incarnation of a sandbox at one start generation."""

    incarnation: str
    generation: str | None = None  # the gateway's generation id; None: never restarted so

    @classmethod
    def of(cls, sandbox: Sandbox) -> RuntimeIdentity:
        """The identity of ``sandbox`` now. A guest made before incarnations were recorded
        gets one derived from its domain and creation time, which are as stable."""
        incarnation = sandbox.labels.get(INCARNATION_LABEL, "")
        if not _INCARNATION.match(incarnation):
            seed = f"{sandbox.domain}\0{sandbox.created_at}".encode()
            incarnation = hashlib.sha256(seed).hexdigest()[:32]
        return cls(incarnation, sandbox.generation)

    @property
    def generation_part(self) -> str:
        if not self.generation:
            return "0"
        return hashlib.sha256(self.generation.encode()).hexdigest()[:16]

    def __str__(self) -> str:
        return f"{SCHEME}:{self.incarnation}:{self.generation_part}"

    def check_start(self, expected: str, generation_id: str) -> None:
        """FAILED_PRECONDITION unless a start with ``expected_runtime_identity`` ``expected``
        and ``generation_id`` may go ahead (see the module docstring). Empty ``expected``: the
        gateway binds nothing, and any start goes ahead."""
        if not expected or expected == str(self):
            return
        retry = bool(generation_id) and generation_id == self.generation
        if retry and expected.startswith(f"{SCHEME}:{self.incarnation}:"):
            return
        raise FailedPrecondition(
            f"expected_runtime_identity {expected!r} is not this sandbox's runtime identity "
            f"{str(self)!r}: the start was meant for another incarnation or generation of it",
            details={"field": "expected_runtime_identity", "value": expected},
        )

    def fence_evidence(self, sandbox: Sandbox, network: str) -> pb.DriverFenceEvidence:
        """What the sandbox runs on, for its generation (see the module docstring)."""
        claims = {
            "domain": sandbox.domain,
            "incarnation": self.incarnation,
            "image": sandbox.image,
            "gpus": ",".join(str(gpu.get("bdf", "")) for gpu in sandbox.gpus),
            "network": network,
        }
        generation = self.generation or ""
        body = json.dumps(
            {"generation": generation, "resource_claims": claims},
            sort_keys=True,
            separators=(",", ":"),
        )
        return pb.DriverFenceEvidence(
            generation=generation,
            evidence_digest=hashlib.sha256(body.encode()).hexdigest(),
            resource_claims=claims,
        )
