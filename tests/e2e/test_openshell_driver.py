"""The OpenShell compute driver served by ``vmsandbox serve`` on the real libvirtd: the socket
and its peer check, capabilities, error paths, a gateway reconnecting, GPU requests on the fake
HGX host down to libvirt's refusal, and (e2e) the gateway's whole order of calls on one
supervised guest, and a main process launched as the workload user in a user namespace."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from framework.fake_hosts import umockdev_run
from framework.openshell_client import (
    LineGateway,
    Watch,
    capabilities_request,
    check_capabilities,
    phase,
    serving,
    stub,
)
from framework.paths import REPO
from framework.sandboxes import cli_env, leftovers

from vmsandbox.config import Config
from vmsandbox.openshell.proto import compute_driver_pb2 as pb
from vmsandbox.openshell.request import sandbox_name
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.sandbox.spec import SandboxSpec

OTHER_UID = 65534  # nobody
SUPERVISOR = REPO / "tests" / "fixtures" / "openshell" / "stand-in-supervisor.sh"


@pytest.fixture(scope="module")
def socket_path(config: Config) -> Iterator[Path]:
    """One served driver for the module, on this test run's state directory."""
    path = config.state_dir / "openshell" / "driver.sock"
    with serving(path, cli_env(config)):
        yield path


@pytest.fixture
def client(socket_path: Path) -> Iterator[object]:
    channel, driver = stub(socket_path)
    with channel:
        yield driver


def _request(name: str, **spec: object) -> pb.DriverSandbox:
    return pb.DriverSandbox(id=f"gw-{name}", name=name, spec=pb.DriverSandboxSpec(**spec))


def _code(call: object, *args: object) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as caught:
        call(*args, timeout=120)  # type: ignore[operator]
    return caught.value.code(), caught.value.details()


def test_socket_is_private_to_its_user(socket_path: Path):
    assert stat.S_IMODE(socket_path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(socket_path.stat().st_mode) == 0o600
    assert stat.S_ISSOCK(socket_path.stat().st_mode)


def test_capabilities_and_workspaces(client):
    check_capabilities(client.GetCapabilities(capabilities_request(), timeout=30), supervised=False)
    client.EnsureWorkspace(pb.EnsureWorkspaceRequest(workspace="w"), timeout=30)
    client.DeleteWorkspace(pb.DeleteWorkspaceRequest(workspace="w"), timeout=30)


def test_bad_requests_come_back_with_vmsandboxs_code_and_message(client, config: Config):
    oci = _request("t-os-oci", template=pb.DriverSandboxTemplate(image="docker.io/library/ubuntu"))
    code, message = _code(client.CreateSandbox, pb.CreateSandboxRequest(sandbox=oci))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "template.image 'docker.io/library/ubuntu' is not an image of this host" in message
    assert "minimal" in message
    huge = _request(
        "t-os-huge",
        template=pb.DriverSandboxTemplate(
            resources=pb.DriverResourceRequirements(memory_limit="1Ti")
        ),
    )
    code, message = _code(
        client.ValidateSandboxCreate, pb.ValidateSandboxCreateRequest(sandbox=huge)
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"over this host's cap of {config.max_memory_mib}" in message
    bad_cpu = _request(
        "t-os-cpu",
        template=pb.DriverSandboxTemplate(
            resources=pb.DriverResourceRequirements(cpu_limit="lots")
        ),
    )
    code, message = _code(client.CreateSandbox, pb.CreateSandboxRequest(sandbox=bad_cpu))
    assert (code, message.split(" is not")[0]) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "template.resources.cpu_limit 'lots'",
    )
    for name in ("t-os-oci", "t-os-huge", "t-os-cpu"):
        assert leftovers(config, name) == []


def test_unknown_sandboxes(client):
    code, message = _code(
        client.GetSandbox, pb.GetSandboxRequest(sandbox_id="nope", name="t-os-none")
    )
    assert (code, message) == (
        grpc.StatusCode.NOT_FOUND,
        "no sandbox with id 'nope' was made by this driver",
    )
    code, _ = _code(client.StopSandbox, pb.StopSandboxRequest(sandbox_id="nope"))
    assert code == grpc.StatusCode.NOT_FOUND
    deleted = client.DeleteSandbox(pb.DeleteSandboxRequest(sandbox_id="nope"), timeout=60)
    assert deleted.deleted is False


def test_a_sandbox_the_driver_did_not_make_is_out_of_reach(client, config: Config):
    """A sandbox the driver did not make (a CLI one) is out of reach whatever the request
    names: Get, Stop, Start and Delete with its name, with or without another id, find nothing
    and leave it as it is; a request with neither an id nor a name is refused."""
    with SandboxManager(config, reconcile=False) as manager:
        made = manager.create(SandboxSpec(name="t-os-cli", memory_mib=256), start=False)
    try:
        for call, request in (
            (client.GetSandbox, pb.GetSandboxRequest),
            (client.StopSandbox, pb.StopSandboxRequest),
            (client.StartSandbox, pb.StartSandboxRequest),
        ):
            code, _ = _code(call, request(sandbox_id="gw-other", name="t-os-cli"))
            assert code == grpc.StatusCode.NOT_FOUND
            code, _ = _code(call, request(name="t-os-cli"))
            assert code == grpc.StatusCode.NOT_FOUND
            code, message = _code(call, request())
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "both empty" in message
        for named in (pb.DeleteSandboxRequest(sandbox_id="gw-other", name="t-os-cli"),
                      pb.DeleteSandboxRequest(name="t-os-cli")):  # fmt: skip
            assert client.DeleteSandbox(named, timeout=60).deleted is False
        with SandboxManager(config, reconcile=False) as manager:
            still = manager.get("t-os-cli")
        assert (still.uuid, still.state) == (made.uuid, "defined")
        listed = client.ListSandboxes(pb.ListSandboxesRequest(), timeout=60).sandboxes
        assert "t-os-cli" not in [sandbox.name for sandbox in listed]
    finally:
        with SandboxManager(config, reconcile=False) as manager:
            manager.destroy("t-os-cli")
    assert leftovers(config, "t-os-cli") == []


def test_a_gateway_that_disconnects_and_reconnects_is_served_again(socket_path: Path):
    for _ in range(3):
        channel, driver = stub(socket_path)
        with channel:
            assert driver.ListSandboxes(pb.ListSandboxesRequest(), timeout=30) is not None


def test_a_second_server_on_the_same_socket_is_refused(socket_path: Path, config: Config):
    done = subprocess.run(
        [sys.executable, "-m", "vmsandbox.cli", "serve", "--openshell-socket", str(socket_path)],
        capture_output=True,
        text=True,
        env=cli_env(config),
        timeout=120,
        check=False,
    )
    assert done.returncode == 5, done.stderr
    assert f"another server already listens on {socket_path}" in done.stderr
    assert stat.S_ISSOCK(socket_path.stat().st_mode)  # the first one's socket is untouched


_PEER_CLIENT = textwrap.dedent(
    """
    import sys, grpc
    from vmsandbox.openshell.proto import compute_driver_pb2 as pb, compute_driver_pb2_grpc as g
    with grpc.insecure_channel("unix:" + sys.argv[1]) as channel:
        try:
            g.ComputeDriverStub(channel).ListSandboxes(pb.ListSandboxesRequest(), timeout=20)
        except grpc.RpcError as exc:
            print(exc.code().name, exc.details())
        else:
            print("OK")
    """
)


def _as_uid(uid: int, socket_path: Path) -> str:
    done = subprocess.run(
        [
            *("setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"),
            *(sys.executable, "-c", _PEER_CLIENT, str(socket_path)),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
        check=True,
    )
    return done.stdout.strip()


def test_another_uid_cannot_reach_the_socket(socket_path: Path):
    assert _as_uid(OTHER_UID, socket_path).startswith("UNAVAILABLE")


def test_the_peer_check_refuses_uids_the_config_does_not_allow(config: Config):
    allowed = OTHER_UID - 1
    path = config.state_dir / "shared" / "shared.sock"  # the state dir is 0711: reachable
    env = cli_env(config, VMSANDBOX_OPENSHELL_ALLOWED_UIDS=str(allowed))
    with serving(path, env):
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o711
        assert stat.S_IMODE(path.stat().st_mode) == 0o666
        assert _as_uid(allowed, path) == "OK"
        assert _as_uid(OTHER_UID, path).startswith("UNAVAILABLE")
    assert (
        "refused a connection from uid 65534" in (config.state_dir / "shared.sock.log").read_text()
    )


def test_gpu_requests_on_the_fake_hgx_host_end_at_libvirts_refusal(config: Config, tmp_path: Path):
    path = tmp_path / "gpu" / "driver.sock"
    with umockdev_run("hgx_h100") as (prefix, umockdev_env):
        testbed = {k: v for k, v in umockdev_env.items() if k == "TMPDIR"}
        with serving(path, cli_env(config, **testbed), prefix=prefix):
            channel, driver = stub(path)
            with channel:
                too_many = _request("t-os-gpu9")
                too_many.spec.resource_requirements.gpu.count = 9
                code, message = _code(
                    driver.ValidateSandboxCreate, pb.ValidateSandboxCreateRequest(sandbox=too_many)
                )
                assert code in (
                    grpc.StatusCode.FAILED_PRECONDITION,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                )
                assert "9" in message
                # one GPU: on this NVSwitch board (full passthrough) a guest takes 1 or all 8
                one = _request("t-os-gpu1")
                one.spec.resource_requirements.gpu.count = 1
                driver.ValidateSandboxCreate(
                    pb.ValidateSandboxCreateRequest(sandbox=one), timeout=120
                )
                code, message = _code(driver.CreateSandbox, pb.CreateSandboxRequest(sandbox=one))
                assert code == grpc.StatusCode.FAILED_PRECONDITION
                assert "starting sandbox 't-os-gpu1': libvirt refused" in message
                assert "passthrough" in message
                listed = driver.ListSandboxes(pb.ListSandboxesRequest(), timeout=60)
                assert "t-os-gpu1" not in [s.name for s in listed.sandboxes]
    assert leftovers(config, "t-os-gpu1") == []


def test_phase_port_matches_the_gateways_rules():
    def snap(*conditions: tuple[str, str, str], deleting: bool = False) -> pb.DriverSandbox:
        return pb.DriverSandbox(
            status=pb.DriverSandboxStatus(
                deleting=deleting,
                conditions=[
                    pb.DriverCondition(type=t, status=s, reason=r) for t, s, r in conditions
                ],
            )
        )

    assert phase(pb.DriverSandbox()) == "Unknown"
    assert phase(snap(("Ready", "True", ""), deleting=True)) == "Deleting"
    assert phase(snap(("Ready", "True", ""), ("Suspended", "true", ""))) == "Stopped"
    assert phase(snap(("Ready", "False", "Starting"))) == "Provisioning"
    assert phase(snap(("Ready", "False", "BootFailed"))) == "Error"
    assert phase(snap(("Ready", "Unknown", ""))) == "Provisioning"
    assert phase(snap(("Ready", "True", "SandboxReady"))) == "Ready"


def test_a_derived_name_is_stable_for_the_gateway_id():
    assert sandbox_name("Not A Name", "gw-7") == sandbox_name("", "gw-7")


def _launch_credentials(generation: str, bearer: str) -> bytes:
    """Launch credentials as a v0.1 gateway mints them, its bearer token ``bearer``."""
    return json.dumps(
        {
            "supervisor": {
                "session_id": "session-e2e",
                "runtime_generation": generation,
                "session_rotation": 0,
                "auth_epoch": 1,
                "gateway_token": bearer,
            },
            "gateway_id": "gateway-e2e",
            "verification_keys": [{"key_id": "k1", "public_key_pem": list(b"PEM")}],
        }
    ).encode()


def _guest_credentials(manager, name: str) -> list[str]:
    """Mode, owner and a distinguishing value of each launch credential file in the guest,
    once the launch has written them."""
    field = 'grep -o \'"{0}":"[^"]*"\' {1} | cut -d\'"\' -f4'
    shown = manager.exec(
        name,
        "for i in $(seq 120); do sudo test -e /run/openshell/launched && break; sleep 1; done; "
        "cd /run/openshell && sudo stat -c '%a %U' auth-bundle.json && "
        f"sudo {field.format('gateway_token', 'auth-bundle.json')} && "
        "stat -c '%a %U' gateway-verification.json && "
        f"{field.format('gateway_id', 'gateway-verification.json')}",
    ).stdout.splitlines()
    return [f"{shown[0]} {shown[1]}", f"{shown[2]} {shown[3]}"]


def _readable_by_others_containing(root: Path, secret: str) -> list[str]:
    """Files under ``root`` that users other than root could read and that hold ``secret``."""
    found = []
    for path in root.rglob("*"):
        readable = path.is_file() and path.stat().st_mode & 0o004
        if readable and secret.encode() in path.read_bytes():
            found.append(str(path))
    return found


@pytest.fixture
def supervised(config: Config) -> Iterator[tuple[Path, LineGateway]]:
    """A driver configured with the stand-in supervisor, https endpoint and TLS files, and the
    stand-in gateway listener its guests dial on this host's loopback."""
    gateway = LineGateway()
    folder = config.state_dir / "supervised"
    folder.mkdir(mode=0o700)
    tls = {kind: folder / f"{kind}.pem" for kind in ("ca", "cert", "key")}
    for kind, path in tls.items():
        path.write_text(f"-----BEGIN TEST {kind.upper()}-----\n")
    settings = {
        "openshell_supervisor": str(SUPERVISOR),
        "openshell_gateway_endpoint": f"https://127.0.0.1:{gateway.port}",
        **{f"openshell_tls_{kind}": str(path) for kind, path in tls.items()},
    }
    config_file = folder / "config.toml"
    config_file.write_text("".join(f'{key} = "{value}"\n' for key, value in settings.items()))
    path = config.state_dir / "supervised" / "supervised.sock"
    try:
        with serving(path, cli_env(config, VMSANDBOX_CONFIG=str(config_file))):
            yield path, gateway
    finally:
        gateway.close()
        shutil.rmtree(folder)  # the state directory is the module's: the next user starts clean


def test_with_a_supervisor_the_gateway_waits_for_its_callback(
    supervised: tuple[Path, LineGateway],
):
    socket_path, _gateway = supervised
    channel, client = stub(socket_path)
    with channel:
        caps = client.GetCapabilities(capabilities_request(), timeout=30)
    check_capabilities(caps, supervised=True)


def test_the_gateways_order_of_calls_on_one_guest(
    supervised: tuple[Path, LineGateway], config: Config, manager
):
    """One guest, booted twice (create, then start after stop), carries every e2e check: the
    gateway's order of calls, what the guest and the stand-in supervisor received, the
    workload identity resolved in the guest, the launch credentials in the guest's memory
    (fresh ones after the restart), the runtime identity, and that the token is nowhere on the
    host but in the 0600 seed and the launch credentials nowhere on the host at all."""
    socket_path, gateway = supervised
    name, sandbox_id = "t-os-e2e", "gw-e2e-1"
    token = "eyJ0eXAiOiJKV1QifQ.e2e-payload.signature"
    channel, client = stub(socket_path)
    caps = client.GetCapabilities(capabilities_request(), timeout=30)
    command = ["sh", "-c", "echo main"]
    request = pb.DriverSandbox(
        id=sandbox_id,
        name=name,
        namespace="ns",
        workspace="ws",
        spec=pb.DriverSandboxSpec(
            environment={"GREETING": 'hello "world" $HOME'},
            template=pb.DriverSandboxTemplate(
                image=caps.default_image,  # the gateway fills an empty image with it
                labels={"team": "ml"},
                environment={"FROM_TEMPLATE": "yes"},
                resources=pb.DriverResourceRequirements(cpu_request="500m", memory_limit="1Gi"),
            ),
            sandbox_token=token,
            command=command,
            await_main_process_attachment=True,
            workload_identity=pb.WorkloadIdentityRequest(user="nobody", group="nogroup"),
            launch_authentication=_launch_credentials("gen-1", "bearer-one"),
        ),
    )
    watch = Watch(socket_path)
    try:
        client.ValidateSandboxCreate(pb.ValidateSandboxCreateRequest(sandbox=request), timeout=120)
        created = client.CreateSandbox(pb.CreateSandboxRequest(sandbox=request), timeout=600)
        phases = watch.until("Ready", sandbox_id)
        assert set(phases) <= {"Provisioning", "Ready"}, phases
        listed = client.ListSandboxes(pb.ListSandboxesRequest(), timeout=60).sandboxes
        (mine,) = [snap for snap in listed if snap.id == sandbox_id]
        assert (mine.name, mine.namespace, mine.workspace, phase(mine)) == (
            name,
            "ns",
            "ws",
            "Ready",
        )

        # What the guest received: environment in exec sessions, the token as a root 0600 file.
        env = manager.exec(name, ["env"]).stdout
        for line in (
            'GREETING=hello "world" $HOME',
            "FROM_TEMPLATE=yes",
            f"OPENSHELL_SANDBOX={name}",
            f"OPENSHELL_SANDBOX_ID={sandbox_id}",
            "OPENSHELL_SANDBOX_TOKEN_FILE=/etc/openshell/sandbox-token",
        ):
            assert line in env.splitlines(), env
        assert token not in env
        assert manager.get(name).labels["team"] == "ml"

        # What the stand-in supervisor received, and its dial to the gateway on the host.
        recorded = manager.exec(
            name,
            "for i in $(seq 300); do sudo test -e /var/lib/stand-in/reply && break; sleep 1; done; "
            "sudo sh -c 'cd /var/lib/stand-in && cat uid token-mode token tls reply env'",
        ).stdout.splitlines()
        assert recorded[:3] == ["0", "600 root", token]
        assert recorded[3:6] == [
            "/opt/openshell/tls/ca.pem 644",
            "/opt/openshell/tls/cert.pem 644",
            "/opt/openshell/tls/key.pem 600",
        ]
        assert recorded[6] == f"gateway saw: hello from {sandbox_id}"
        assert gateway.lines == [f"hello from {sandbox_id}"]
        supervisor_env = set(recorded[7:])
        main_spec = json.dumps(
            {
                "version": 1,
                "command": command,
                "tty": False,
                "await_main_process_attachment": True,
            },
            separators=(",", ":"),
        )
        assert {
            f"OPENSHELL_ENDPOINT=https://127.0.0.1:{gateway.port}",
            "OPENSHELL_GATEWAY_TLS_SERVER_NAME=127.0.0.1",
            f"OPENSHELL_SANDBOX={name}",
            f"OPENSHELL_SANDBOX_ID={sandbox_id}",
            "OPENSHELL_SANDBOX_TOKEN_FILE=/etc/openshell/sandbox-token",
            "OPENSHELL_TLS_CA=/opt/openshell/tls/ca.pem",
            "OPENSHELL_TLS_CERT=/opt/openshell/tls/cert.pem",
            "OPENSHELL_TLS_KEY=/opt/openshell/tls/key.pem",
            f"OPENSHELL_MAIN_PROCESS_SPEC={main_spec}",
            "OPENSHELL_AUTH_BUNDLE_FILE=/run/openshell/auth-bundle.json",
            "FROM_TEMPLATE=yes",
        } <= supervisor_env, supervisor_env

        # The workload identity resolved in the guest, and the launch credentials in its /run.
        got = client.GetSandbox(
            pb.GetSandboxRequest(sandbox_id=sandbox_id, name=name), timeout=60
        ).sandbox.status
        nobody = manager.exec(name, "id -u nobody; getent group nogroup").stdout.split()
        resolved = got.resolved_identity
        assert (resolved.uid, resolved.gid, resolved.source) == (
            int(nobody[0]),
            int(nobody[1].split(":")[2]),
            "workload_identity",
        )
        assert got.fence_evidence.generation == "gen-1"
        assert _guest_credentials(manager, name) == ["600 root bearer-one", "644 root gateway-e2e"]

        # The token is nowhere on the host but the 0600 seed; the credentials nowhere at all.
        domain_xml = manager.conn.lookupByName(f"vmsbx-{name}").XMLDesc(0)
        log = (socket_path.parent.parent / "supervised.sock.log").read_text()
        assert token not in domain_xml and token not in log
        assert _readable_by_others_containing(config.state_dir, token) == []
        for secret in ("bearer-one", "bearer-two"):
            assert secret not in domain_xml and secret not in log
            assert not any(
                secret.encode() in path.read_bytes()
                for path in config.state_dir.rglob("*")
                if path.is_file()
            )

        client.StopSandbox(pb.StopSandboxRequest(sandbox_id=sandbox_id, name=name), timeout=300)
        assert watch.until("Stopped", sandbox_id)[-1] == "Stopped"
        code, _ = _code(
            client.StartSandbox,
            pb.StartSandboxRequest(
                sandbox_id=sandbox_id,
                name=name,
                generation_id="gen-2",
                expected_runtime_identity="vmsandbox:x:0",
            ),
        )
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        started = client.StartSandbox(
            pb.StartSandboxRequest(
                sandbox_id=sandbox_id,
                name=name,
                generation_id="gen-2",
                expected_runtime_identity=created.runtime_identity,
                launch_authentication=_launch_credentials("gen-2", "bearer-two"),
            ),
            timeout=300,
        )
        assert started.runtime_identity.split(":")[:2] == created.runtime_identity.split(":")[:2]
        assert started.runtime_identity != created.runtime_identity
        phases = watch.until("Ready", sandbox_id)
        # Snapshots of the stop's own later events (shutdown, then stopped) may come first.
        booting = phases[phases.index("Provisioning") :]
        assert set(booting) <= {"Provisioning", "Ready"} and set(phases) - set(booting) <= {
            "Stopped"
        }, phases
        assert _guest_credentials(manager, name) == ["600 root bearer-two", "644 root gateway-e2e"]
        authenticated = client.AuthenticateSandbox(
            pb.AuthenticateSandboxRequest(credential=token), timeout=60
        )
        assert authenticated.runtime_identity == started.runtime_identity

        deleted = client.DeleteSandbox(pb.DeleteSandboxRequest(sandbox_id=sandbox_id), timeout=300)
        assert deleted.deleted is True
        assert watch.until("deleted", sandbox_id)[-1] == "deleted"
        again = client.DeleteSandbox(pb.DeleteSandboxRequest(sandbox_id=sandbox_id), timeout=300)
        assert again.deleted is False
    finally:
        watch.close()
        channel.close()
        if leftovers(config, name):
            manager.destroy(name)
    assert leftovers(config, name) == []


def test_the_main_process_runs_as_the_workload_user_in_a_user_namespace(
    socket_path: Path, client, config: Config, manager
):
    """Without a supervisor, the main unit runs as the requested workload user, resolved in
    the guest, inside a user namespace of its own (template.user_namespaces); the snapshot
    reports the resolved identity and the main process's exit."""
    name, sandbox_id = "t-os-main", "gw-main-1"
    # written whole, then renamed: the reader below waits for the file and must not see half
    probe = (
        "{ id -u; id -g; cat /proc/self/uid_map; } > /tmp/main-id.part; "
        "mv /tmp/main-id.part /tmp/main-id"
    )
    request = pb.DriverSandbox(
        id=sandbox_id,
        name=name,
        spec=pb.DriverSandboxSpec(
            command=["sh", "-c", probe],
            workload_identity=pb.WorkloadIdentityRequest(user="nobody"),
            template=pb.DriverSandboxTemplate(user_namespaces=True),
        ),
    )
    watch = Watch(socket_path)
    try:
        created = client.CreateSandbox(pb.CreateSandboxRequest(sandbox=request), timeout=600)
        assert created.runtime_identity.startswith("vmsandbox:")
        watch.until("Ready", sandbox_id)
        shown = manager.exec(
            name,
            "for i in $(seq 120); do test -s /tmp/main-id && break; sleep 1; done; "
            "cat /tmp/main-id; id -u nobody; id -g nobody",
        ).stdout.split("\n")
        uid, gid, *maps = [line.split() for line in shown if line.strip()]
        nobody_uid, nobody_gid = maps[-2][0], maps[-1][0]
        assert (uid[0], gid[0]) == (nobody_uid, nobody_gid)
        uid_map = maps[:-2]
        # in its own user namespace only root and the unit's user are mapped, one id each
        assert ["0", "0", "1"] in uid_map and [nobody_uid, nobody_uid, "1"] in uid_map
        assert ["0", "0", "4294967295"] not in uid_map
        status = client.GetSandbox(
            pb.GetSandboxRequest(sandbox_id=sandbox_id, name=name), timeout=60
        ).sandbox.status
        assert (status.resolved_identity.uid, status.resolved_identity.source) == (
            int(nobody_uid),
            "workload_identity",
        )
        (main,) = [c for c in status.conditions if c.type == "MainProcess"]
        assert (main.status, main.reason, main.message) == (
            "False",
            "Exited",
            "the main process exited (0)",
        )
        assert client.DeleteSandbox(
            pb.DeleteSandboxRequest(sandbox_id=sandbox_id, name=name), timeout=300
        ).deleted
    finally:
        watch.close()
        if leftovers(config, name):
            manager.destroy(name)
    assert leftovers(config, name) == []
