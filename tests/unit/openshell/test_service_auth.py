"""Sandbox authentication of the OpenShell v0.1 contract over gRPC, served in this process on
the fake hypervisor: the capabilities a gateway reads, AuthenticateSandbox through a sandbox's
life and bound to its runtime identity, where the token is and is not kept, and condition
times."""

from __future__ import annotations

import logging
import stat
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from framework.fake_hypervisor import FakeHypervisor
from framework.openshell_client import capabilities_request, check_capabilities, in_process, stub

from vmsandbox.config import Config
from vmsandbox.errors import InvalidArgument
from vmsandbox.openshell.proto import compute_driver_pb2 as pb
from vmsandbox.openshell.status import Transitions
from vmsandbox.sandbox import credential
from vmsandbox.sandbox.record import SandboxFiles
from vmsandbox.sandbox.spec import SandboxSpec

TOKEN = "eyJhbGciOiJFUzI1NiJ9.eyJzdWIiOiJndy1hdXRoLTEifQ.c2lnbmF0dXJlLW9mLXRoZS1nYXRld2F5"
WRONG = "eyJhbGciOiJFUzI1NiJ9.eyJzdWIiOiJzb21lb25lLWVsc2UifQ.bm90LXRoZS1zaWduYXR1cmU"


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
    """capabilities, validate, create with a token, authenticate (right, wrong, empty), get,
    delete, authenticate again; the identity authentication reports is create's."""
    caplog.set_level(logging.DEBUG)
    caps = client.GetCapabilities(capabilities_request(), timeout=30)
    check_capabilities(caps, supervised=False)
    request = pb.DriverSandbox(
        id="gw-auth-1",
        name="t-auth",
        spec=pb.DriverSandboxSpec(
            template=pb.DriverSandboxTemplate(image="tiny"), sandbox_token=TOKEN
        ),
    )
    client.ValidateSandboxCreate(pb.ValidateSandboxCreateRequest(sandbox=request), timeout=60)
    created = client.CreateSandbox(pb.CreateSandboxRequest(sandbox=request), timeout=120)
    assert created.runtime_identity.startswith("vmsandbox:")
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
    assert (answer.sandbox_id, answer.runtime_identity) == ("gw-auth-1", created.runtime_identity)
    code, message = _code(
        client.AuthenticateSandbox, pb.AuthenticateSandboxRequest(credential=WRONG)
    )
    assert (code, message) == (
        grpc.StatusCode.UNAUTHENTICATED,
        "the credential is not the token of any sandbox here",
    )
    code, message = _code(client.AuthenticateSandbox, pb.AuthenticateSandboxRequest())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and message.startswith("credential is empty")

    got = client.GetSandbox(pb.GetSandboxRequest(sandbox_id="gw-auth-1", name="t-auth"))
    (ready,) = [c for c in got.sandbox.status.conditions if c.type == "Ready"]
    assert ready.HasField("transition_time") and ready.transition_time.seconds > 0

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
    assert (first.transition_time.seconds, first.transition_time.nanos) == (1_790_000_000, 0)
    now[0] += 30
    assert ready("False", "Starting").transition_time.seconds == 1_790_000_000
    assert ready("True", "SandboxReady").transition_time.seconds == 1_790_000_030
    transitions.forget("vmsbx-a")
    now[0] += 5
    assert ready("True", "SandboxReady").transition_time.seconds == 1_790_000_035


def test_a_digest_with_a_trailing_newline_is_not_a_digest():
    stored = credential.digest(TOKEN)
    assert credential.check(stored, "credential") == stored
    with pytest.raises(InvalidArgument):
        credential.check(stored + "\n", "credential")
    assert not credential.matches(TOKEN, stored + "\n")
