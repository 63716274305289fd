"""The supervisor option: configuration checks and what every guest gets (binary, TLS files,
root-only environment, a unit, the endpoint on the guest's loopback where the driver's SSH
tunnel ends). The tunnel itself is exercised in the e2e test of test_openshell_driver."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from vmsandbox.config import Config
from vmsandbox.errors import FailedPrecondition
from vmsandbox.openshell.proto import compute_driver_pb2 as pb
from vmsandbox.openshell.request import translate
from vmsandbox.openshell.supervisor import ENV_FILE, SUPERVISOR_UNIT, Supervisor


def _config(tmp_path: Path, **changes: str) -> Config:
    binary = tmp_path / "openshell-sandbox"
    binary.write_bytes(b"\x7fELF fake")
    key = tmp_path / "key.pem"
    key.write_text("KEY")
    settings = {
        "openshell_supervisor": str(binary),
        "openshell_gateway_endpoint": "https://localhost:8443",
        "openshell_tls_key": str(key),
        **changes,
    }
    return Config.load(path="/nonexistent", **settings)


def test_no_supervisor_configured_means_none(tmp_path: Path):
    assert Supervisor.from_config(Config.load(path="/nonexistent")) is None


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"openshell_gateway_endpoint": "https://gateway.example:8443"}, "on this host's loopback"),
        ({"openshell_gateway_endpoint": ""}, "must be an http(s) URL"),
        ({"openshell_supervisor": "/nonexistent/openshell-sandbox"}, "cannot be read"),
        ({"openshell_tls_ca": "/nonexistent/ca.pem"}, "openshell_tls_ca"),
        ({"network": "default"}, "needs network = 'user'"),
    ],
)
def test_configurations_that_cannot_work_are_refused(
    tmp_path: Path, changes: dict[str, str], words: str
):
    with pytest.raises(FailedPrecondition, match=words.replace("(", r"\(").replace(")", r"\)")):
        Supervisor.from_config(_config(tmp_path, **changes))


def test_every_guest_gets_the_supervisor_and_the_command_goes_to_it(tmp_path: Path):
    supervisor = Supervisor.from_config(_config(tmp_path))
    assert supervisor is not None
    sandbox = pb.DriverSandbox(
        id="gw-1",
        name="job-1",
        spec=pb.DriverSandboxSpec(
            sandbox_token="jwt-secret-value", command=["run", "it"], tty=True
        ),
    )
    guest = translate(sandbox, {"minimal": "minimal-1"}, supervisor).spec.guest
    assert guest is not None
    assert guest.main == () and not guest.autostart
    files = {item.path: item for item in guest.files}
    binary = files["/opt/openshell/bin/openshell-sandbox"]
    assert (base64.b64decode(binary.content), binary.mode, binary.base64) == (
        b"\x7fELF fake",
        "0755",
        True,
    )
    assert files["/opt/openshell/tls/key.pem"].mode == "0600"
    env_file = files[ENV_FILE]
    assert env_file.mode == "0600"
    spec = json.dumps(
        {
            "version": 1,
            "command": ["run", "it"],
            "tty": True,
            "await_main_process_attachment": False,
        },
        separators=(",", ":"),
    )
    escaped = spec.replace('"', '\\"')
    for line in (
        'OPENSHELL_ENDPOINT="https://127.0.0.1:8443"',
        'OPENSHELL_GATEWAY_TLS_SERVER_NAME="localhost"',
        'OPENSHELL_SANDBOX_TOKEN_FILE="/etc/openshell/sandbox-token"',
        'OPENSHELL_TLS_KEY="/opt/openshell/tls/key.pem"',
        'OPENSHELL_AUTH_BUNDLE_FILE="/run/openshell/auth-bundle.json"',
        'OPENSHELL_GATEWAY_VERIFICATION_FILE="/run/openshell/gateway-verification.json"',
        'OPENSHELL_WORKLOAD_IDENTITY_FILE="/run/openshell/workload-identity"',
        f'OPENSHELL_MAIN_PROCESS_SPEC="{escaped}"',
    ):
        assert line in env_file.content.splitlines()
    assert "jwt-secret-value" not in env_file.content
    assert "User=root\n" in guest.units[SUPERVISOR_UNIT]
    cloud = guest.cloud_config("sandbox")
    written = {item["path"]: item for item in cloud["write_files"]}
    assert written["/opt/openshell/bin/openshell-sandbox"]["encoding"] == "b64"
    # installed, not started: the launch starts it once the workload identity is resolved
    assert cloud["runcmd"] == [["systemctl", "daemon-reload"]]
    assert f"/etc/systemd/system/{SUPERVISOR_UNIT}" in written
