"""The OpenShell driver's newer contract (NVIDIA/OpenShell 484f076) over gRPC, served in this
process on the fake hypervisor: the capabilities a gateway reads, AuthenticateSandbox through a
sandbox's life, where the token is and is not kept, and condition times that a gateway at
2f7fb65 and one at 484f076 each decode from the same bytes."""

from __future__ import annotations

import importlib.util
import logging
import stat
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import grpc
import pytest
from fake_hypervisor import FakeHypervisor, unit_config
from grpc_tools import protoc
from openshell_client import check_capabilities, in_process, stub

from vmsandbox.config import Config
from vmsandbox.errors import InvalidArgument
from vmsandbox.openshell.proto import compute_driver_pb2 as pb
from vmsandbox.openshell.transitions import Transitions
from vmsandbox.sandbox import credential
from vmsandbox.sandbox.record import SandboxFiles
from vmsandbox.sandbox.spec import SandboxSpec

TOKEN = "eyJhbGciOiJFUzI1NiJ9.eyJzdWIiOiJndy1hdXRoLTEifQ.c2lnbmF0dXJlLW9mLXRoZS1nYXRld2F5"
WRONG = "eyJhbGciOiJFUzI1NiJ9.eyJzdWIiOiJzb21lb25lLWVsc2UifQ.bm90LXRoZS1zaWduYXR1cmU"


@pytest.fixture
def config(tmp_path: Path) -> Config:
    return unit_config(tmp_path)


@pytest.fixture
def hv() -> FakeHypervisor:
    return FakeHypervisor()


@pytest.fixture
def client(config: Config, hv: FakeHypervisor) -> Iterator[object]:
    with in_process(config, hv) as socket_path:
        channel, driver = stub(socket_path)
        with channel:
            yield driver


def _code(call: object, request: object) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as caught:
        call(request, timeout=60)  # type: ignore[operator]
    return caught.value.code(), caught.value.details()


def _files_holding(root: Path, secret: str) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


def test_the_gateways_order_with_authentication(
    client, config: Config, hv: FakeHypervisor, caplog: pytest.LogCaptureFixture
):
    """capabilities, listener requirements, validate, create with a token, authenticate (right,
    wrong, empty), get, delete, authenticate again."""
    caplog.set_level(logging.DEBUG)
    caps = client.GetCapabilities(pb.GetCapabilitiesRequest(), timeout=30)
    check_capabilities(caps, supervised=False)
    listeners = client.GetGatewayListenerRequirements(
        pb.GetGatewayListenerRequirementsRequest(), timeout=30
    )
    assert list(listeners.requirements) == []
    request = pb.DriverSandbox(
        id="gw-auth-1",
        name="t-auth",
        spec=pb.DriverSandboxSpec(
            template=pb.DriverSandboxTemplate(image="tiny"), sandbox_token=TOKEN
        ),
    )
    client.ValidateSandboxCreate(pb.ValidateSandboxCreateRequest(sandbox=request), timeout=60)
    client.CreateSandbox(pb.CreateSandboxRequest(sandbox=request), timeout=120)
    domain = hv.domains["vmsbx-t-auth"]
    assert domain.running

    # The record keeps a salted digest, never the token; on the host only the 0600 seed has it.
    stored = domain.data["credential"]
    assert stored.startswith("hmac-sha256$") and TOKEN not in stored
    assert credential.matches(TOKEN, stored)
    assert TOKEN not in domain.xml
    seed = SandboxFiles.of(config, "t-auth").seed
    assert _files_holding(config.state_dir, TOKEN) == [seed]
    assert stat.S_IMODE(seed.stat().st_mode) == 0o600

    answer = client.AuthenticateSandbox(pb.AuthenticateSandboxRequest(credential=TOKEN))
    assert answer.sandbox_id == "gw-auth-1"
    code, message = _code(
        client.AuthenticateSandbox, pb.AuthenticateSandboxRequest(credential=WRONG)
    )
    assert (code, message) == (
        grpc.StatusCode.UNAUTHENTICATED,
        "the credential is not the token of any sandbox here",
    )
    code, message = _code(client.AuthenticateSandbox, pb.AuthenticateSandboxRequest())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and message.startswith("credential is empty")

    got = client.GetSandbox(pb.GetSandboxRequest(sandbox_id="gw-auth-1", sandbox_name="t-auth"))
    (ready,) = [c for c in got.sandbox.status.conditions if c.type == "Ready"]
    assert ready.last_transition_time and ready.HasField("transition_time")

    deleted = client.DeleteSandbox(pb.DeleteSandboxRequest(sandbox_id="gw-auth-1"), timeout=120)
    assert deleted.deleted is True and "vmsbx-t-auth" not in hv.domains
    code, _ = _code(client.AuthenticateSandbox, pb.AuthenticateSandboxRequest(credential=TOKEN))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    logged = caplog.text
    assert TOKEN not in logged and WRONG not in logged


def test_two_sandboxes_given_the_same_token_keep_different_digests():
    first, second = credential.digest(TOKEN), credential.digest(TOKEN)
    assert first != second
    assert credential.matches(TOKEN, first) and credential.matches(TOKEN, second)
    assert not credential.matches(WRONG, first)
    assert not credential.matches("", first)
    assert not credential.matches(TOKEN, "hmac-sha256$00$00")  # not a digest: never matches


def test_a_raw_token_is_refused_as_a_spec_credential_without_being_repeated():
    with pytest.raises(InvalidArgument) as caught:
        SandboxSpec(name="t-raw", credential=TOKEN)
    assert caught.value.details == {"field": "credential"}
    assert TOKEN not in caught.value.message
    with pytest.raises(InvalidArgument):
        credential.digest("")


def test_a_conditions_time_holds_until_its_status_or_reason_changes():
    now = [1_790_000_000.7]
    transitions = Transitions(clock=lambda: now[0])

    def ready(status: str, reason: str) -> pb.DriverCondition:
        snap = pb.DriverSandbox(
            status=pb.DriverSandboxStatus(
                instance_id="vmsbx-a",
                conditions=[pb.DriverCondition(type="Ready", status=status, reason=reason)],
            )
        )
        return transitions.stamp(snap).status.conditions[0]

    first = ready("False", "Starting")
    assert (first.last_transition_time, first.transition_time.seconds) == (
        "2026-09-21T14:13:20Z",
        1_790_000_000,
    )
    now[0] += 30
    assert ready("False", "Starting").transition_time.seconds == 1_790_000_000
    assert ready("True", "SandboxReady").transition_time.seconds == 1_790_000_030
    transitions.forget("vmsbx-a")
    now[0] += 5
    assert ready("True", "SandboxReady").transition_time.seconds == 1_790_000_035


# The two revisions' own shapes of the messages that carry a time, written here from their
# field lists (package names differ only so both load into one process).
_REVISIONS = {
    "openshell_2f7fb65": """
        message DriverCondition {
          string type = 1; string status = 2; string reason = 3; string message = 4;
          string last_transition_time = 5;
        }
        message DriverPlatformEvent {
          int64 timestamp_ms = 1; string source = 2; string type = 3;
        }
    """,
    "openshell_484f076": """
        import "google/protobuf/timestamp.proto";
        message DriverCondition {
          reserved 5;
          string type = 1; string status = 2; string reason = 3; string message = 4;
          google.protobuf.Timestamp transition_time = 105;
        }
        message DriverPlatformEvent {
          reserved 1;
          google.protobuf.Timestamp event_time = 101; string source = 2; string type = 3;
        }
    """,
}


def _revision(tmp_path: Path, name: str) -> ModuleType:
    """The Python stub protoc generates for one revision's messages."""
    body = textwrap.dedent(_REVISIONS[name])
    imports = [line for line in body.splitlines() if line.startswith("import")]
    rest = [line for line in body.splitlines() if not line.startswith("import")]
    source = tmp_path / f"{name}.proto"
    source.write_text(
        "\n".join(['syntax = "proto3";', *imports, f"package {name}.v1;", *rest]) + "\n"
    )
    well_known = Path(protoc.__file__).parent / "_proto"
    argv = ["protoc", f"-I{tmp_path}", f"-I{well_known}", f"--python_out={tmp_path}", str(source)]
    assert protoc.main(argv) == 0
    spec = importlib.util.spec_from_file_location(f"{name}_pb2", tmp_path / f"{name}_pb2.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_revision_reads_the_time_it_knows_from_the_same_bytes(tmp_path: Path):
    old, new = _revision(tmp_path, "openshell_2f7fb65"), _revision(tmp_path, "openshell_484f076")
    snap = pb.DriverSandbox(
        status=pb.DriverSandboxStatus(
            instance_id="vmsbx-b",
            conditions=[pb.DriverCondition(type="Ready", status="True", reason="SandboxReady")],
        )
    )
    sent = Transitions(clock=lambda: 1_790_000_000).stamp(snap).status.conditions[0]
    wire = sent.SerializeToString()
    as_old = old.DriverCondition.FromString(wire)
    as_new = new.DriverCondition.FromString(wire)
    assert (as_old.type, as_old.status, as_old.last_transition_time) == (
        "Ready",
        "True",
        "2026-09-21T14:13:20Z",
    )
    assert (as_new.type, as_new.reason, as_new.transition_time.seconds) == (
        "Ready",
        "SandboxReady",
        1_790_000_000,
    )
    event = pb.DriverPlatformEvent(timestamp_ms=1_790_000_000_250, source="vmsandbox")
    event.event_time.FromMilliseconds(1_790_000_000_250)
    wire = event.SerializeToString()
    assert old.DriverPlatformEvent.FromString(wire).timestamp_ms == 1_790_000_000_250
    assert new.DriverPlatformEvent.FromString(wire).event_time.ToMilliseconds() == (
        1_790_000_000_250
    )


def test_a_digest_with_a_trailing_newline_is_not_a_digest():
    stored = credential.digest(TOKEN)
    assert credential.check(stored, "credential") == stored
    with pytest.raises(InvalidArgument):
        credential.check(stored + "\n", "credential")
    assert not credential.matches(TOKEN, stored + "\n")
