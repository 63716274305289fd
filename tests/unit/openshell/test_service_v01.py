"""What OpenShell v0.1 added to the compute-driver contract, served in this process on the fake
hypervisor and driven by a client built from the upstream v0.1.2 descriptors: capability
negotiation, the resource admission policy, runtime identity through create, stop, start and
authentication, and the new spec fields (policy, workload identity, user namespaces,
await_main_process_attachment, launch credentials), down to the launch script run for real in
a private mount namespace."""

from __future__ import annotations

import json
import pwd
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from framework.fake_hypervisor import FakeHypervisor
from framework.openshell_client import (
    CONTRACT,
    DEFAULT_ADMISSION,
    GATEWAY,
    UpstreamClient,
    in_process,
)

from vmsandbox.config import Config
from vmsandbox.errors import FailedPrecondition, InvalidArgument
from vmsandbox.guest.ssh import ExecResult
from vmsandbox.openshell import negotiation
from vmsandbox.openshell.admission import AdmissionPolicy
from vmsandbox.openshell.caller import ANSWERED_METADATA
from vmsandbox.openshell.identity import INCARNATION_LABEL
from vmsandbox.openshell.launch import (
    AUTH_BUNDLE_PATH,
    OPENSHELL_MAIN_UNIT,
    LaunchCredentials,
    Workload,
    launch,
    script,
)
from vmsandbox.openshell.proto import compute_driver_pb2 as pb
from vmsandbox.openshell.proto import extension_pb2 as ext
from vmsandbox.openshell.request import translate
from vmsandbox.openshell.supervisor import SUPERVISOR_UNIT, Supervisor

IMAGES = {"minimal": "minimal-1a2b"}
GATEWAY_TOKEN = "eyJ0eXAiOiJKV1QifQ.gateway-bearer.sig"
SANDBOX_TOKEN = "eyJ0eXAiOiJKV1QifQ.sandbox-bearer.sig"
PEM = "-----BEGIN PUBLIC KEY-----\nMCowBQYDK2VwAyEA\n-----END PUBLIC KEY-----\n"


def _credentials(generation: str = "gen-1") -> bytes:
    """Launch credentials as a v0.1 gateway mints them (the public key as serde's byte list)."""
    return json.dumps(
        {
            "supervisor": {
                "session_id": "session-1",
                "runtime_generation": generation,
                "session_rotation": 0,
                "auth_epoch": 1,
                "gateway_token": GATEWAY_TOKEN,
                "sandbox_token": SANDBOX_TOKEN,
            },
            "gateway_id": "gateway-1",
            "verification_keys": [{"key_id": "k1", "public_key_pem": list(PEM.encode())}],
        }
    ).encode()


def _sandbox(**spec: Any) -> pb.DriverSandbox:
    return pb.DriverSandbox(id="gw-1", name="job-1", spec=pb.DriverSandboxSpec(**spec))


def _supervisor(tmp_path: Path) -> Supervisor:
    binary = tmp_path / "openshell-sandbox"
    binary.write_bytes(b"\x7fELF")
    config = Config.load(
        path="/nonexistent",
        openshell_supervisor=str(binary),
        openshell_gateway_endpoint="http://127.0.0.1:8080",
    )
    supervisor = Supervisor.from_config(config)
    assert supervisor is not None
    return supervisor


# -- negotiation ------------------------------------------------------------------------------


def _gateway(**changes: Any) -> ext.PeerMetadata:
    gateway = ext.PeerMetadata()
    gateway.CopyFrom(GATEWAY)
    for key, value in changes.items():
        if isinstance(value, list):
            getattr(gateway, key)[:] = value
        elif key == "major":
            gateway.protocol_version.major = value
        else:
            setattr(gateway, key, value)
    return gateway


def test_a_v01_gateway_negotiates_and_minor_versions_may_differ():
    negotiation.check_gateway(True, GATEWAY)
    newer = _gateway(supported_capabilities=[CONTRACT, "openshell.compute.future-thing"])
    newer.protocol_version.minor = 7
    negotiation.check_gateway(True, newer)


@pytest.mark.parametrize(
    ("present", "changes", "code", "words"),
    [
        (False, {}, FailedPrecondition, "sent no protocol metadata"),
        (True, {"major": 2}, FailedPrecondition, "speaks extension protocol 2.0"),
        (
            True,
            {"required_capabilities": [CONTRACT, "openshell.compute.gpu-fence"]},
            FailedPrecondition,
            "requires capabilities vmsandbox does not support: openshell.compute.gpu-fence",
        ),
        (True, {"supported_capabilities": []}, FailedPrecondition, "requires: " + CONTRACT),
        (True, {"implementation_name": " "}, InvalidArgument, "must not be empty"),
        (True, {"required_capabilities": ["GPU"]}, InvalidArgument, "is not a capability"),
        (True, {"supported_capabilities": [CONTRACT, CONTRACT]}, InvalidArgument, "twice"),
    ],
)
def test_gateways_vmsandbox_cannot_serve_are_refused(
    present: bool, changes: dict[str, Any], code: type[Exception], words: str
):
    with pytest.raises(code, match=words.replace(".", r"\.")):
        negotiation.check_gateway(present, _gateway(**changes))


# -- admission --------------------------------------------------------------------------------


def test_the_admission_policy_is_written_as_the_gateway_writes_it(tmp_path: Path):
    assert AdmissionPolicy().acknowledgement() == DEFAULT_ADMISSION
    file = tmp_path / "config.toml"
    file.write_text(
        "openshell_allow_driver_config = true\n"
        "[openshell_required_labels]\n"
        '"example.com/approved" = "yes"\n'
        '"example.com/team" = "${workspace}"\n'
    )
    policy = AdmissionPolicy.from_config(Config.load(path=file))
    assert policy.acknowledgement() == (
        'v1:{"allow_driver_config":true,"resource_admission":{"enabled":true,'
        '"required_labels":{"example.com/approved":"yes","example.com/team":"${workspace}"}}}'
    )
    off = Config.load(
        path="/nonexistent", openshell_resource_admission=False, openshell_required_labels={}
    )
    assert AdmissionPolicy.from_config(off).acknowledgement() == (
        'v1:{"allow_driver_config":false,"resource_admission":{"enabled":false,'
        '"required_labels":{}}}'
    )


@pytest.mark.parametrize(
    ("labels", "words"),
    [
        ({}, "is empty while openshell_resource_admission is true"),
        ({"openshell.ai/managed-by": "x", "a": "b"}, "reserve for their own metadata"),
        ({"Bad_Prefix/a": "b"}, "is not a label key"),
        ({"a": "x/y"}, "is not a label value"),
        ({"a": "${workspace}"}, "needs a shared approval label"),
    ],
)
def test_a_policy_the_gateway_refuses_is_refused_naming_the_key(labels: dict[str, str], words: str):
    config = Config.load(path="/nonexistent", openshell_required_labels=labels)
    with pytest.raises(FailedPrecondition, match=words) as caught:
        AdmissionPolicy.from_config(config)
    assert caught.value.details == {"field": "openshell_required_labels"}


def test_driver_config_needs_the_operators_consent():
    sandbox = _sandbox()
    sandbox.spec.resource_requirements.gpu.count = 1
    sandbox.spec.template.driver_config.update({"gpu_device_ids": ["0000:41:00.0"]})
    with pytest.raises(InvalidArgument) as caught:
        translate(sandbox, IMAGES)
    assert caught.value.details == {
        "field": "template.driver_config",
        "value": ["gpu_device_ids"],
    }
    assert "openshell_allow_driver_config" in caught.value.message
    allowed = translate(sandbox, IMAGES, admission=AdmissionPolicy(allow_driver_config=True))
    assert allowed.spec.gpu is not None and allowed.spec.gpu.devices == ("0000:41:00.0",)
    empty = _sandbox()
    empty.spec.template.driver_config.SetInParent()  # present but empty: says nothing
    assert translate(empty, IMAGES).spec.gpu is None


# -- the new spec fields ----------------------------------------------------------------------


def test_a_policy_only_the_supervisor_enforces_is_refused_without_one(tmp_path: Path):
    sandbox = _sandbox(command=["true"])
    policy = sandbox.spec.policy
    policy.version = 1
    policy.filesystem.read_only.append("/usr")
    policy.network_policies["gitlab"].name = "gitlab"
    policy.process.run_as_user = "daemon"
    with pytest.raises(FailedPrecondition) as caught:
        translate(sandbox, IMAGES)
    assert caught.value.details == {
        "field": "policy",
        "sections": ["filesystem", "network_policies (gitlab)"],
    }
    assert "OpenShell supervisor" in caught.value.message
    translate(sandbox, IMAGES, _supervisor(tmp_path))  # the supervisor enforces it
    only_process = _sandbox(command=["true"])
    only_process.spec.policy.process.run_as_user = "daemon"
    only_process.spec.policy.process.run_as_group = "nogroup"
    got = translate(only_process, IMAGES)
    assert Workload.of(got.spec.labels) == Workload(
        "daemon", "nogroup", "policy", (OPENSHELL_MAIN_UNIT,), ()
    )


def test_workload_identity_and_user_namespaces_shape_the_main_unit(tmp_path: Path):
    sandbox = _sandbox(
        command=["sleep", "1"],
        workload_identity=pb.WorkloadIdentityRequest(user="1000", group="users"),
        template=pb.DriverSandboxTemplate(user_namespaces=True),
    )
    sandbox.spec.policy.process.run_as_user = "daemon"  # the admitted selectors win
    got = translate(sandbox, IMAGES)
    assert got.spec.guest is not None
    unit = got.spec.guest.units[OPENSHELL_MAIN_UNIT]
    assert {"User=1000", "Group=users", "PrivateUsers=yes"} <= set(unit.splitlines())
    assert got.spec.labels["openshell.workload-source"] == "workload_identity"
    with pytest.raises(FailedPrecondition) as caught:
        translate(sandbox, IMAGES, _supervisor(tmp_path))
    assert caught.value.details == {"field": "template.user_namespaces"}


@pytest.mark.parametrize(
    ("identity", "field", "words"),
    [
        ({"user": "root"}, "workload_identity.user", "is root"),
        ({"user": "0"}, "workload_identity.user", "is root"),
        ({"user": "sandbox", "group": "0"}, "workload_identity.group", "is root"),
        ({"user": "-rf"}, "workload_identity.user", "is not a user or group"),
        ({"user": "a b"}, "workload_identity.user", "is not a user or group"),
    ],
)
def test_bad_workload_identities_name_their_field(identity: dict[str, str], field: str, words: str):
    sandbox = _sandbox(workload_identity=pb.WorkloadIdentityRequest(**identity))
    with pytest.raises(InvalidArgument, match=words) as caught:
        translate(sandbox, IMAGES)
    assert caught.value.details["field"] == field


def test_awaiting_attachment_goes_to_the_supervisor_or_is_refused(tmp_path: Path):
    sandbox = _sandbox(command=["bash"], tty=True, await_main_process_attachment=True)
    with pytest.raises(FailedPrecondition) as caught:
        translate(sandbox, IMAGES)
    assert caught.value.details == {"field": "await_main_process_attachment"}
    guest = translate(sandbox, IMAGES, _supervisor(tmp_path)).spec.guest
    assert guest is not None
    env = {f.path: f for f in guest.files}["/etc/openshell/supervisor.env"].content
    spec = json.dumps(
        {"version": 1, "command": ["bash"], "tty": True, "await_main_process_attachment": True},
        separators=(",", ":"),
    )
    assert f"OPENSHELL_MAIN_PROCESS_SPEC={json.dumps(spec)}" in env.splitlines()


def test_launch_credentials_are_split_and_never_repeated():
    credentials = LaunchCredentials.parse(_credentials(), "launch_authentication")
    supervisor = json.loads(credentials.supervisor)
    assert (supervisor["gateway_token"], supervisor["sandbox_token"]) == (
        GATEWAY_TOKEN,
        SANDBOX_TOKEN,
    )
    assert json.loads(credentials.verification) == {
        "gateway_id": "gateway-1",
        "verification_keys": [{"key_id": "k1", "public_key_pem": PEM}],
    }
    assert credentials.runtime_generation == "gen-1"
    assert GATEWAY_TOKEN not in repr(credentials) and SANDBOX_TOKEN not in repr(credentials)
    text = script(Workload("daemon", units=(SUPERVISOR_UNIT,)), credentials)
    assert GATEWAY_TOKEN not in text and SANDBOX_TOKEN not in text
    broken = _credentials().replace(b'"gateway_id": "gateway-1"', b'"gateway_id": ""')
    for data, words in (
        (b"\xff" + _credentials(), "not JSON"),
        (b"[]", "not a JSON object"),
        (broken, "no 'gateway_id'"),
        (_credentials().replace(b"verification_keys", b"keys"), "no 'verification_keys'"),
    ):
        with pytest.raises(InvalidArgument, match=words) as caught:
            LaunchCredentials.parse(data, "launch_authentication")
        assert caught.value.details == {"field": "launch_authentication"}
        assert GATEWAY_TOKEN not in caught.value.message


# -- the launch script, run for real ----------------------------------------------------------


@pytest.fixture
def guest_root(tmp_path: Path) -> Iterator[tuple[Path, Any]]:
    """A ``run(command, stdin)`` that runs the launch in a private mount namespace of this
    machine whose /run is an empty tmpfs, with ``sudo`` and ``systemctl`` stand-ins that run
    the command / record the call; afterwards /run/openshell is copied to ``seen``."""
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "sudo").write_text('#!/bin/sh\n[ "$1" = -n ] && shift\nexec "$@"\n')
    (tools / "systemctl").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/systemctl.log\n')
    for tool in tools.iterdir():
        tool.chmod(0o755)
    seen = tmp_path / "seen"

    def run(command: str, stdin: bytes | None) -> ExecResult:
        inner = (
            f"mount -t tmpfs -o mode=0755 tmpfs /run && export PATH={tools}:$PATH && "
            f"{{ {command}\n}}; rc=$?; cp -a /run/openshell {seen} 2>/dev/null; exit $rc"
        )
        done = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", inner],
            input=stdin or b"",
            capture_output=True,
            timeout=60,
            check=False,
        )
        return ExecResult(done.returncode, done.stdout.decode(), done.stderr.decode())

    yield tmp_path, run


def test_the_launch_resolves_the_identity_and_keeps_secrets_in_memory(guest_root):
    root, run = guest_root
    credentials = LaunchCredentials.parse(_credentials(), "launch_authentication")
    workload = Workload("daemon", "nogroup", "policy", (SUPERVISOR_UNIT,), (SUPERVISOR_UNIT,))
    resolved = launch(run, workload, credentials)
    expected_gid = int(subprocess.check_output(["getent", "group", "nogroup"]).split(b":")[2])
    assert (resolved.uid, resolved.gid) == (pwd.getpwnam("daemon").pw_uid, expected_gid)
    assert 0 not in resolved.supplementary and expected_gid not in resolved.supplementary
    seen = root / "seen"
    bundle = seen / Path(AUTH_BUNDLE_PATH).name
    assert stat.S_IMODE(bundle.stat().st_mode) == 0o600 and bundle.stat().st_uid == 0
    assert json.loads(bundle.read_bytes())["gateway_token"] == GATEWAY_TOKEN
    verification = (seen / "gateway-verification.json").read_text()
    assert stat.S_IMODE((seen / "gateway-verification.json").stat().st_mode) == 0o644
    assert GATEWAY_TOKEN not in verification and "gateway-1" in verification
    assert (seen / "workload-identity").read_text().startswith(f"WorkloadUid={resolved.uid}\n")
    assert (seen / "launched").exists()
    assert (root / "systemctl.log").read_text() == f"start --no-block {SUPERVISOR_UNIT}\n"


@pytest.mark.parametrize(
    ("workload", "words"),
    [
        (Workload("no-such-user"), "the workload user no-such-user does not exist"),
        (Workload("daemon", "no-such-group"), "the workload group no-such-group does not exist"),
    ],
)
def test_a_launch_that_cannot_resolve_starts_nothing(guest_root, workload: Workload, words: str):
    root, run = guest_root
    with pytest.raises(FailedPrecondition, match=words):
        launch(run, Workload(workload.user, workload.group, units=(OPENSHELL_MAIN_UNIT,)), None)
    assert not (root / "systemctl.log").exists()
    assert not (root / "seen" / "launched").exists()


# -- the contract over gRPC, from the upstream protos -----------------------------------------


@pytest.fixture
def upstream(config: Config, hv: FakeHypervisor) -> Iterator[UpstreamClient]:
    with in_process(config, hv) as path, grpc.insecure_channel(f"unix:{path}") as channel:
        yield UpstreamClient(channel)


def _code(call: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value.code(), caught.value.details()


def _upstream_gateway(client: UpstreamClient, *extra: str) -> Any:
    gateway = client.message("openshell.extension.v1.PeerMetadata")
    gateway.ParseFromString(GATEWAY.SerializeToString())
    gateway.required_capabilities.extend(extra)
    return gateway


def test_a_v012_client_negotiates_and_an_unmet_requirement_is_refused(upstream: UpstreamClient):
    caps = upstream.call(
        "GetCapabilities",
        upstream.message("GetCapabilitiesRequest", gateway=_upstream_gateway(upstream)),
    )
    assert caps.extension.implementation_name == "vmsandbox"
    assert list(caps.extension.required_capabilities) == [CONTRACT]
    assert caps.resource_admission_policy == DEFAULT_ADMISSION
    assert caps.supports_sandbox_authentication and caps.driver_reports_runtime_readiness
    wanting = _upstream_gateway(upstream, "openshell.compute.gpu-fence")
    code, message = _code(
        lambda: upstream.call(
            "GetCapabilities", upstream.message("GetCapabilitiesRequest", gateway=wanting)
        )
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "openshell.compute.gpu-fence" in message
    code, _ = _code(
        lambda: upstream.call("GetCapabilities", upstream.message("GetCapabilitiesRequest"))
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION


def test_runtime_identity_through_create_stop_start_and_authentication(
    upstream: UpstreamClient, config: Config, hv: FakeHypervisor
):
    """Create returns an identity; Get, Stop, Start and Delete find it by ``sandbox_id``; a
    start with another identity is refused and changes nothing; one with the right identity and
    a new generation returns the new identity, which authentication reports (after a restart of
    the driver too); a retried start keeps it; a guest created anew has another incarnation."""
    request = upstream.message(
        "DriverSandbox",
        id="gw-v01",
        name="t-v01",
        spec=upstream.message(
            "DriverSandboxSpec",
            template=upstream.message("DriverSandboxTemplate", image="tiny"),
            sandbox_token=SANDBOX_TOKEN,
            launch_authentication=_credentials("gen-1"),
            workload_identity=upstream.message("WorkloadIdentityRequest", user="daemon"),
        ),
    )
    upstream.call(
        "ValidateSandboxCreate", upstream.message("ValidateSandboxCreateRequest", sandbox=request)
    )
    created = upstream.call(
        "CreateSandbox", upstream.message("CreateSandboxRequest", sandbox=request)
    )
    identity = created.runtime_identity
    scheme, incarnation, generation = identity.split(":")
    assert (scheme, len(incarnation), len(generation)) == ("vmsandbox", 32, 16)
    record = hv.domains["vmsbx-t-v01"].data
    assert record["labels"][INCARNATION_LABEL] == incarnation
    assert record["generation"] == "gen-1"  # the credentials' runtime generation
    assert GATEWAY_TOKEN.encode() not in _host_bytes(config) and SANDBOX_TOKEN.encode() not in (
        hv.domains["vmsbx-t-v01"].xml.encode()
    )

    got = upstream.call(
        "GetSandbox", upstream.message("GetSandboxRequest", sandbox_id="gw-v01", name="t-v01")
    )
    by_name = upstream.call("GetSandbox", upstream.message("GetSandboxRequest", name="t-v01"))
    assert by_name.sandbox.id == "gw-v01"  # a request with a name and no id finds it too
    status = got.sandbox.status
    assert (status.name, status.instance_id, status.fence_evidence.generation) == (
        "t-v01",
        "vmsbx-t-v01",
        "gen-1",
    )
    claims = dict(status.fence_evidence.resource_claims)
    assert (claims["incarnation"], claims["domain"], claims["network"]) == (
        incarnation,
        "vmsbx-t-v01",
        "user",
    )
    assert len(status.fence_evidence.evidence_digest) == 64

    upstream.call("StopSandbox", upstream.message("StopSandboxRequest", name="t-v01"))
    assert not hv.domains["vmsbx-t-v01"].running
    wrong = f"vmsandbox:{'0' * 32}:0"
    code, message = _code(
        lambda: upstream.call(
            "StartSandbox",
            upstream.message(
                "StartSandboxRequest",
                sandbox_id="gw-v01",
                name="t-v01",
                generation_id="gen-2",
                expected_runtime_identity=wrong,
            ),
        )
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION and wrong in message
    assert not hv.domains["vmsbx-t-v01"].running

    def start(expected: str, generation_id: str) -> str:
        return upstream.call(
            "StartSandbox",
            upstream.message(
                "StartSandboxRequest",
                sandbox_id="gw-v01",
                name="t-v01",
                generation_id=generation_id,
                expected_runtime_identity=expected,
                launch_authentication=_credentials(generation_id),
            ),
        ).runtime_identity

    started = start(identity, "gen-2")
    assert hv.domains["vmsbx-t-v01"].running
    assert started.startswith(f"vmsandbox:{incarnation}:") and started != identity
    assert start(identity, "gen-2") == started  # the gateway retrying the same start
    authenticated = upstream.call(
        "AuthenticateSandbox",
        upstream.message("AuthenticateSandboxRequest", credential=SANDBOX_TOKEN),
    )
    assert (authenticated.sandbox_id, authenticated.runtime_identity) == ("gw-v01", started)
    # another vmsandbox serve, the same sandboxes
    with in_process(config, hv) as path, grpc.insecure_channel(f"unix:{path}") as channel:
        again = UpstreamClient(channel).call(
            "AuthenticateSandbox",
            upstream.message("AuthenticateSandboxRequest", credential=SANDBOX_TOKEN),
        )
    assert again.runtime_identity == started

    deleted = upstream.call(
        "DeleteSandbox", upstream.message("DeleteSandboxRequest", sandbox_id="gw-v01", name="t-v01")
    )
    assert deleted.deleted and "vmsbx-t-v01" not in hv.domains
    gone = upstream.call(
        "DeleteSandbox", upstream.message("DeleteSandboxRequest", sandbox_id="gw-v01", name="t-v01")
    )
    assert not gone.deleted
    recreated = upstream.call(
        "CreateSandbox", upstream.message("CreateSandboxRequest", sandbox=request)
    )
    assert recreated.runtime_identity.split(":")[1] != incarnation
    deleted = upstream.call("DeleteSandbox", upstream.message("DeleteSandboxRequest", name="t-v01"))
    assert deleted.deleted and "vmsbx-t-v01" not in hv.domains


def _host_bytes(config: Config) -> bytes:
    return b"".join(p.read_bytes() for p in config.state_dir.rglob("*") if p.is_file())


def test_driver_config_without_consent_is_refused_over_the_wire(upstream: UpstreamClient):
    template = upstream.message("DriverSandboxTemplate", image="tiny")
    template.driver_config.update({"gpu_device_ids": ["0000:41:00.0"]})
    spec = upstream.message("DriverSandboxSpec", template=template)
    spec.resource_requirements.gpu.count = 1
    sandbox = upstream.message("DriverSandbox", id="gw-dc", name="t-dc", spec=spec)
    for method in ("ValidateSandboxCreate", "CreateSandbox"):
        request = upstream.message(f"{method}Request", sandbox=sandbox)
        code, message = _code(lambda m=method, r=request: upstream.call(m, r))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert message.startswith("template.driver_config (gpu_device_ids) is not allowed")


def test_an_error_the_driver_answers_is_marked_as_its_own(upstream: UpstreamClient, tmp_path):
    sandbox = upstream.message("DriverSandbox", id="gw-bad", name="t-bad")
    sandbox.spec.template.image = "no-such-image"
    with pytest.raises(grpc.RpcError) as answered:
        upstream.call("CreateSandbox", upstream.message("CreateSandboxRequest", sandbox=sandbox))
    assert (ANSWERED_METADATA, answered.value.code().name) in answered.value.trailing_metadata()
    nobody = f"unix:{tmp_path / 'nobody.sock'}"  # no driver there: nothing it could answer
    with grpc.insecure_channel(nobody) as channel, pytest.raises(grpc.RpcError) as unreached:
        UpstreamClient(channel).call("ListSandboxes", upstream.message("ListSandboxesRequest"))
    assert unreached.value.code() == grpc.StatusCode.UNAVAILABLE
    assert not any(key == ANSWERED_METADATA for key, _ in unreached.value.trailing_metadata())
