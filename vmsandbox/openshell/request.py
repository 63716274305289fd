"""An OpenShell DriverSandbox turned into vmsandbox's terms: the sandbox name, its SandboxSpec,
what its guest receives and how its workload is launched.

- Name: ``DriverSandbox.name`` when it is a valid vmsandbox name, else ``os-`` and 16 hex
  digits of the SHA-256 of the calling gateway's identity and its sandbox id. The gateway's
  id, namespace and workspace are kept as labels (ID_LABEL, NAMESPACE_LABEL, WORKSPACE_LABEL)
  in the domain metadata, with a fresh incarnation (``identity.INCARNATION_LABEL``), the
  image's id (IMAGE_ID_LABEL), the launch labels (``launch.Workload``) and the digest of the
  request (REQUEST_LABEL, ``request_digest``: secrets left out), by which a create sent again
  is told from a different one under the same id (``same_request``); the calling gateway's
  identity is the record's ``owner`` (openshell/caller.py).
- Image: ``template.image`` names a vmsandbox image; empty means DEFAULT_IMAGE. Anything else
  (an OCI reference, say) is INVALID_ARGUMENT naming the images this host has.
- CPU and memory: ``template.resources`` Kubernetes quantities, the limit (else the request)
  rounded up; held to the host's caps by SandboxManager.
- GPUs: ``resource_requirements.gpu`` and ``template.driver_config`` through
  ``vmsandbox.compat.openshell``. ``driver_config`` is this driver's own block, read with the
  keys of OpenShell's VM driver block (``gpu_device_ids``), so a template moves over
  unchanged; a non-empty one needs the operator's ``openshell_allow_driver_config``
  (``admission``), else INVALID_ARGUMENT naming ``template.driver_config``.
- Policy (``spec.policy``): its ``process`` user and group are honoured as the workload
  identity; filesystem, Landlock, network and middleware sections are enforced by the OpenShell
  supervisor in the guest, so without one configured a policy that sets any of them is
  FAILED_PRECONDITION naming them.
- Workload identity: ``workload_identity`` user and group (else the policy's, else the image's
  sandbox user), names or numbers, never root; resolved in the guest at launch (``launch``).
- ``await_main_process_attachment``: passed to the supervisor in the main process spec; a
  client can only attach through the supervisor, so without one it is FAILED_PRECONDITION.
- ``template.user_namespaces``: true runs the main process in a user namespace of its own
  (systemd's PrivateUsers); with a supervisor, which starts the workload itself, true is
  FAILED_PRECONDITION. Unset or false: no user namespace.
- ``launch_authentication``: checked and split here (``launch.LaunchCredentials``), delivered
  to the guest's memory at launch, never written to the seed or any host file.
- Guest: the template's then the spec's environment, OPENSHELL_SANDBOX, OPENSHELL_SANDBOX_ID
  and OPENSHELL_LOG_LEVEL; the sandbox token written 0600 to TOKEN_PATH (named by
  OPENSHELL_SANDBOX_TOKEN_FILE), never put in the environment; ``command`` as the main process
  (OPENSHELL_MAIN_UNIT, as the workload user). ``tty`` has no meaning without the supervisor
  and is ignored. Units are installed, not started: the launch starts them. A request that
  gives the guest none of these and fits a ``[pool]`` shape (``pooled_spec``) claims a
  ready pooled guest (service.py), which gets no environment: its identity is in the labels.
- Credential: a salted digest of the sandbox token (``vmsandbox.sandbox.credential``) goes into the
  record, so AuthenticateSandbox can tell which sandbox holds a token; the token does not.
- With a supervisor (``vmsandbox.openshell.supervisor``), the guest also gets the supervisor,
  and the command goes to it (OPENSHELL_MAIN_PROCESS_SPEC) instead of a main unit.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from google.protobuf import json_format

from vmsandbox.compat import openshell as compat
from vmsandbox.config import PoolShape
from vmsandbox.errors import FailedPrecondition, InvalidArgument, NotFound
from vmsandbox.guest.setup import (
    ENVIRONMENT_FILE,
    GuestFile,
    GuestSetup,
    check_environment,
    exec_line,
)
from vmsandbox.openshell import quantity
from vmsandbox.openshell.admission import AdmissionPolicy
from vmsandbox.openshell.identity import INCARNATION_LABEL, new_incarnation
from vmsandbox.openshell.launch import (
    OPENSHELL_MAIN_UNIT,
    WORKLOAD_LABELS,
    LaunchCredentials,
    Workload,
    check_selector,
)
from vmsandbox.openshell.proto import compute_driver_pb2 as pb
from vmsandbox.openshell.supervisor import SUPERVISOR_UNIT, Supervisor
from vmsandbox.sandbox import credential
from vmsandbox.sandbox.handle import Sandbox
from vmsandbox.sandbox.pool.shapes import fits
from vmsandbox.sandbox.record import SandboxRecord
from vmsandbox.sandbox.spec import SandboxSpec
from vmsandbox.validate import validate_name

DEFAULT_IMAGE = "minimal"
ID_LABEL = "openshell.sandbox-id"
NAMESPACE_LABEL = "openshell.namespace"
WORKSPACE_LABEL = "openshell.workspace"
IMAGE_ID_LABEL = "openshell.image-id"
REQUEST_LABEL = "openshell.request-digest"
TOKEN_PATH = "/etc/openshell/sandbox-token"
_SECRET_ENV = ("OPENSHELL_SANDBOX_TOKEN", "OPENSHELL_SANDBOX_TOKEN_FILE")


@dataclass(frozen=True)
class Translated:
    """A DriverSandbox in vmsandbox's terms, with its launch credentials (kept in memory)."""

    name: str
    spec: SandboxSpec
    credentials: LaunchCredentials | None = None


def sandbox_name(name: str, sandbox_id: str, owner: str = "") -> str:
    """The vmsandbox name of gateway ``owner``'s sandbox (see the module docstring)."""
    with contextlib.suppress(InvalidArgument):  # not a vmsandbox name: derive one below
        return validate_name(name)
    if not sandbox_id and not name:
        raise InvalidArgument(
            "the request names no sandbox: give name or sandbox_id",
            details={"field": "name"},
        )
    key = (f"{owner}\0" if owner else "") + (sandbox_id or name)
    return "os-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def request_digest(sandbox: pb.DriverSandbox) -> str:
    """A digest of ``sandbox`` as the gateway sent it, its secrets (the sandbox token, the
    launch credentials) left out: equal for a create sent again."""
    plain = pb.DriverSandbox()
    plain.CopyFrom(sandbox)
    plain.spec.ClearField("sandbox_token")
    plain.spec.ClearField("launch_authentication")
    return "sha256:" + hashlib.sha256(plain.SerializeToString(deterministic=True)).hexdigest()


def same_request(record: SandboxRecord, sandbox: pb.DriverSandbox) -> bool:
    """Whether ``sandbox`` asks again for the sandbox of ``record``: the same request, with
    the same sandbox token (matched against the record's digest of it) or none in both."""
    if record.labels.get(REQUEST_LABEL) != request_digest(sandbox):
        return False
    token = sandbox.spec.sandbox_token
    if not token or record.credential is None:
        return not token and record.credential is None
    return credential.matches(token, record.credential)


def translate(
    sandbox: pb.DriverSandbox,
    images: Mapping[str, str],
    supervisor: Supervisor | None = None,
    *,
    admission: AdmissionPolicy | None = None,
    default_user: str = "sandbox",
    owner: str | None = None,
) -> Translated:
    """The name, spec and launch of ``sandbox`` asked for by gateway ``owner``
    (openshell/caller.py); ``images`` maps the names of the images this host can boot to
    their ids."""
    if not sandbox.id:
        raise InvalidArgument(
            "sandbox.id is empty: the gateway always sets it", details={"field": "id"}
        )
    spec = sandbox.spec
    template = spec.template
    (admission or AdmissionPolicy()).check_driver_config(
        template.driver_config if template.HasField("driver_config") else None
    )
    name = sandbox_name(sandbox.name, sandbox.id, owner or "")
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
    _check_policy(spec, supervisor)
    private_users = _user_namespaces(template, supervisor)
    if spec.await_main_process_attachment and supervisor is None:
        raise FailedPrecondition(
            "await_main_process_attachment: a client attaches to the main process through the "
            "OpenShell supervisor in the guest, and this host runs none (config "
            "openshell_supervisor)",
            details={"field": "await_main_process_attachment"},
        )
    credentials = (
        LaunchCredentials.parse(spec.launch_authentication, "launch_authentication")
        if spec.launch_authentication
        else None
    )
    guest, workload = _guest(sandbox, name, supervisor, default_user, private_users)
    labels = dict(template.labels)
    labels.update(workload.labels())
    labels.update(
        {
            ID_LABEL: sandbox.id,
            NAMESPACE_LABEL: sandbox.namespace,
            WORKSPACE_LABEL: sandbox.workspace,
            INCARNATION_LABEL: new_incarnation(),
            IMAGE_ID_LABEL: images[image],
            REQUEST_LABEL: request_digest(sandbox),
        }
    )
    return Translated(
        name=name,
        spec=SandboxSpec(
            name=name,
            image=image,
            cpus=cpus,
            memory_mib=memory,
            gpu=compat.gpu_request(_compat_view(sandbox)),
            labels=labels,
            guest=guest,
            credential=credential.digest(spec.sandbox_token) if spec.sandbox_token else None,
            owner=owner,
        ),
        credentials=credentials,
    )


def find_ours(ours: Iterable[Sandbox], sandbox_id: str, name: str) -> Sandbox:
    """The sandbox of ``ours`` (this driver's own) a request addresses: by ``sandbox_id`` when
    it has one (then its ``name`` is not looked at), else by ``name``. A sandbox the driver did
    not make (a CLI one, a pooled guest) is never found, whatever the request names.
    INVALID_ARGUMENT with neither; NOT_FOUND when none matches."""
    if not sandbox_id and not name:
        raise InvalidArgument(
            "sandbox_id and name are both empty: a request names its sandbox by one of them",
            details={"field": "sandbox_id"},
        )
    for sandbox in ours:
        if sandbox.labels.get(ID_LABEL) == sandbox_id if sandbox_id else sandbox.name == name:
            return sandbox
    raise NotFound(
        f"no sandbox {'with id ' + repr(sandbox_id) if sandbox_id else repr(name)} was made "
        "by this driver",
        details={"sandbox_id": sandbox_id, "name": name},
    )


def pooled_spec(
    sandbox: pb.DriverSandbox, spec: SandboxSpec, shapes: Iterable[PoolShape]
) -> SandboxSpec | None:
    """The spec with which a ready pooled guest may serve ``sandbox`` (``spec`` translated):
    only for a request that gives the guest nothing and fits a ``[pool]`` shape, else None. No
    guest setup and no workload labels; the identity stays in the labels."""
    labels = {k: v for k, v in spec.labels.items() if k not in WORKLOAD_LABELS}
    pooled = replace(spec, guest=None, labels=labels)
    if gives_guest_nothing(sandbox) and any(fits(shape, pooled) for shape in shapes):
        return pooled
    return None


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
        or spec.launch_authentication
        or spec.HasField("workload_identity")
        or spec.HasField("policy")
    )


def _check_policy(spec: pb.DriverSandboxSpec, supervisor: Supervisor | None) -> None:
    """FAILED_PRECONDITION for policy sections only the supervisor enforces, when there is
    none (see the module docstring)."""
    if supervisor is not None or not spec.HasField("policy"):
        return
    policy = spec.policy
    found = [
        section
        for section, message in (("filesystem", policy.filesystem), ("landlock", policy.landlock))
        if policy.HasField(section) and message.ByteSize()
    ]
    for section in ("network_policies", "network_middlewares"):
        entries = getattr(policy, section)
        if entries:
            found.append(f"{section} ({', '.join(sorted(entries))})")
    if found:
        raise FailedPrecondition(
            f"policy sets {'; '.join(found)}, which vmsandbox enforces only through the "
            "OpenShell supervisor in the guest, and this host runs none (config "
            "openshell_supervisor); policy.process (the workload's user and group) is honoured",
            details={"field": "policy", "sections": found},
        )


def _user_namespaces(template: pb.DriverSandboxTemplate, supervisor: Supervisor | None) -> bool:
    if not (template.HasField("user_namespaces") and template.user_namespaces):
        return False
    if supervisor is not None:
        raise FailedPrecondition(
            "template.user_namespaces: the OpenShell supervisor starts the workload in this "
            "host's guests, and vmsandbox cannot give it a user namespace; leave it unset",
            details={"field": "template.user_namespaces"},
        )
    return True


def _workload(
    spec: pb.DriverSandboxSpec, default_user: str, units: tuple[str, ...], restart: tuple[str, ...]
) -> Workload:
    wanted, process = spec.workload_identity, spec.policy.process
    if wanted.user:
        user, source = check_selector(wanted.user, "workload_identity.user"), "workload_identity"
    elif process.run_as_user:
        user, source = check_selector(process.run_as_user, "policy.process.run_as_user"), "policy"
    else:
        user, source = default_user, "image"
    group = ""
    if wanted.group:
        group = check_selector(wanted.group, "workload_identity.group")
    elif process.run_as_group:
        group = check_selector(process.run_as_group, "policy.process.run_as_group")
    return Workload(user, group, source, units, restart)


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


def _guest(
    sandbox: pb.DriverSandbox,
    name: str,
    supervisor: Supervisor | None,
    default_user: str,
    private_users: bool,
) -> tuple[GuestSetup, Workload]:
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
    if supervisor is not None:
        more, units = supervisor.guest_parts(
            environment, tuple(spec.command), spec.tty, spec.await_main_process_attachment
        )
        workload = _workload(spec, default_user, (SUPERVISOR_UNIT,), (SUPERVISOR_UNIT,))
        setup = GuestSetup(
            environment=environment, files=(*files, *more), units=units, autostart=False
        )
        return setup, workload
    names = (OPENSHELL_MAIN_UNIT,) if spec.command else ()
    workload = _workload(spec, default_user, names, ())
    units = {OPENSHELL_MAIN_UNIT: _main_unit(tuple(spec.command), workload, private_users)}
    setup = GuestSetup(
        environment=environment,
        files=tuple(files),
        units=units if spec.command else {},
        autostart=False,
    )
    return setup, workload


def _main_unit(command: tuple[str, ...], workload: Workload, private_users: bool) -> str:
    """The unit of the sandbox's main process: as the workload's user and group, started by
    the launch, never restarted, so its exit status stays readable."""
    service = [
        "Type=exec",
        f"User={workload.user}",
        *([f"Group={workload.group}"] if workload.group else []),
        *(["PrivateUsers=yes"] if private_users else []),
        f"EnvironmentFile={ENVIRONMENT_FILE}",
        "WorkingDirectory=-~",  # a user without a home (nobody) starts in /
        f"ExecStart={exec_line(command)}",
    ]
    return (
        "[Unit]\nDescription=OpenShell sandbox main process\nAfter=network-online.target\n\n"
        "[Service]\n" + "".join(f"{line}\n" for line in service)
    )
