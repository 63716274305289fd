"""An OpenShell DriverSandbox turned into vmsandbox's terms: the sandbox name, its SandboxSpec
and what its guest receives.

- Name: ``DriverSandbox.name`` when it is a valid vmsandbox name, else ``os-`` and 16 hex
  digits of the SHA-256 of the gateway's sandbox id. The gateway's id, namespace and workspace
  are kept as labels (ID_LABEL, NAMESPACE_LABEL, WORKSPACE_LABEL) in the domain metadata.
- Image: ``template.image`` names a vmsandbox image; empty means DEFAULT_IMAGE. Anything else
  (an OCI reference, say) is INVALID_ARGUMENT naming the images this host has.
- CPU and memory: ``template.resources`` Kubernetes quantities, the limit (else the request)
  rounded up; held to the host's caps by SandboxManager.
- GPUs: ``resource_requirements.gpu`` and ``template.driver_config`` through
  ``vmsandbox.compat.openshell``. ``driver_config`` is this driver's own block, read with the
  keys of OpenShell's VM driver block (``gpu_device_ids``), so a template moves over unchanged.
- Guest: the template's then the spec's environment, OPENSHELL_SANDBOX, OPENSHELL_SANDBOX_ID
  and OPENSHELL_LOG_LEVEL; the sandbox token written 0600 to TOKEN_PATH (named by
  OPENSHELL_SANDBOX_TOKEN_FILE), never put in the environment; ``command`` as the main process.
  ``tty`` has no meaning without the supervisor and is ignored. A request that gives the guest
  none of these (``gives_guest_nothing``) and fits a ``[pool]`` shape claims a ready pooled
  guest (service.py), which gets no environment: its identity is in the labels.
- Credential: a salted digest of the sandbox token (``vmsandbox.sandbox.credential``) goes into the
  record, so AuthenticateSandbox can tell which sandbox holds a token; the token does not.
- With a supervisor (``vmsandbox.openshell.supervisor``), the guest also gets the supervisor,
  and the command goes to it (OPENSHELL_MAIN_PROCESS_SPEC) instead of a vmsandbox unit.
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format

from vmsandbox.compat import openshell as compat
from vmsandbox.errors import InvalidArgument
from vmsandbox.guest.setup import GuestFile, GuestSetup, check_environment
from vmsandbox.openshell import quantity
from vmsandbox.openshell.proto import compute_driver_pb2 as pb
from vmsandbox.openshell.supervisor import Supervisor
from vmsandbox.sandbox import credential
from vmsandbox.sandbox.spec import SandboxSpec
from vmsandbox.validate import validate_name

DEFAULT_IMAGE = "minimal"
ID_LABEL = "openshell.sandbox-id"
NAMESPACE_LABEL = "openshell.namespace"
WORKSPACE_LABEL = "openshell.workspace"
TOKEN_PATH = "/etc/openshell/sandbox-token"
_SECRET_ENV = ("OPENSHELL_SANDBOX_TOKEN", "OPENSHELL_SANDBOX_TOKEN_FILE")


@dataclass(frozen=True)
class Translated:
    """A DriverSandbox in vmsandbox's terms."""

    name: str
    spec: SandboxSpec


def sandbox_name(name: str, sandbox_id: str) -> str:
    """The vmsandbox name of a gateway sandbox (see the module docstring)."""
    with contextlib.suppress(InvalidArgument):  # not a vmsandbox name: derive one below
        return validate_name(name)
    if not sandbox_id and not name:
        raise InvalidArgument(
            "the request names no sandbox: give sandbox_name or sandbox_id",
            details={"field": "sandbox_name"},
        )
    return "os-" + hashlib.sha256((sandbox_id or name).encode()).hexdigest()[:16]


def translate(
    sandbox: pb.DriverSandbox, images: list[str], supervisor: Supervisor | None = None
) -> Translated:
    """The name and spec of ``sandbox``; ``images`` are the names this host can boot."""
    if not sandbox.id:
        raise InvalidArgument(
            "sandbox.id is empty: the gateway always sets it", details={"field": "id"}
        )
    name = sandbox_name(sandbox.name, sandbox.id)
    template = sandbox.spec.template
    image = template.image or DEFAULT_IMAGE
    if image not in images:
        raise InvalidArgument(
            f"template.image {image!r} is not an image of this host: vmsandbox boots its own "
            f"images, not OCI references; this host has {', '.join(sorted(images)) or 'none'}",
            details={"field": "template.image", "value": image, "allowed": sorted(images)},
        )
    resources = template.resources
    cpus = quantity.vcpus(
        resources.cpu_request, resources.cpu_limit, "template.resources.cpu", SandboxSpec.cpus
    )
    memory = quantity.memory_mib(
        resources.memory_request,
        resources.memory_limit,
        "template.resources.memory",
        SandboxSpec.memory_mib,
    )
    labels = dict(template.labels)
    labels.update({ID_LABEL: sandbox.id, NAMESPACE_LABEL: sandbox.namespace})
    labels[WORKSPACE_LABEL] = sandbox.workspace
    return Translated(
        name=name,
        spec=SandboxSpec(
            name=name,
            image=image,
            cpus=cpus,
            memory_mib=memory,
            gpu=compat.gpu_request(_compat_view(sandbox)),
            labels=labels,
            guest=_guest(sandbox, name, supervisor),
            credential=(
                credential.digest(sandbox.spec.sandbox_token)
                if sandbox.spec.sandbox_token
                else None
            ),
        ),
    )


def gives_guest_nothing(sandbox: pb.DriverSandbox) -> bool:
    """Whether ``sandbox`` hands its guest nothing of its own (no command, environment, token
    or log level): such a sandbox may be a ready pooled guest, its identity kept in labels."""
    spec = sandbox.spec
    return not (
        spec.command
        or spec.environment
        or spec.template.environment
        or spec.sandbox_token
        or spec.log_level
    )


def _compat_view(sandbox: pb.DriverSandbox) -> dict[str, Any]:
    """The GPU fields of ``sandbox`` in the JSON form ``compat.openshell`` reads."""
    view: dict[str, Any] = {}
    if sandbox.spec.resource_requirements.HasField("gpu"):
        gpu = sandbox.spec.resource_requirements.gpu
        view["resource_requirements"] = {
            "gpu": {"count": gpu.count} if gpu.HasField("count") else {}
        }
    template = sandbox.spec.template
    if template.HasField("driver_config"):
        block = json_format.MessageToDict(template.driver_config)
        view["template"] = {"driver_config": {"vm": block}}
    return view


def _guest(sandbox: pb.DriverSandbox, name: str, supervisor: Supervisor | None) -> GuestSetup:
    spec = sandbox.spec
    environment: dict[str, str] = {}
    for what, given in (
        ("template.environment", spec.template.environment),
        ("environment", spec.environment),
    ):
        for key, value in given.items():
            check_environment(key, value, what)
            if key not in _SECRET_ENV:
                environment[key] = value
    environment.update(OPENSHELL_SANDBOX=name, OPENSHELL_SANDBOX_ID=sandbox.id)
    if spec.log_level:
        environment["OPENSHELL_LOG_LEVEL"] = spec.log_level
    files: list[GuestFile] = []
    if spec.sandbox_token:
        files.append(GuestFile(TOKEN_PATH, spec.sandbox_token, mode="0600"))
        environment["OPENSHELL_SANDBOX_TOKEN_FILE"] = TOKEN_PATH
    if supervisor is None:
        return GuestSetup(environment=environment, files=tuple(files), main=tuple(spec.command))
    more, units = supervisor.guest_parts(environment, tuple(spec.command), spec.tty)
    return GuestSetup(environment=environment, files=(*files, *more), units=units)
