"""A GPU sandbox template built with the ``openshell`` SDK from the package index (pinned in
setup/platforms/requirements.txt, installed by setup/platforms.sh in .venv-platforms, apart
from vmsandbox's own packages) reaches vmsandbox's allocator as asked.

The SDK runs in its own virtualenv: ``SandboxTemplateClient.create(gpu_count=2, gpu=True,
driver_config=...)`` sends its template to a stand-in gateway (a gRPC server of the SDK's own
service classes, on a socket in the test's folder) that prints what it received. The test then
does what the gateway does with a template for the selected driver: the workload's GPU request
becomes ``DriverSandboxSpec.resource_requirements.gpu`` and the driver's block of
``driver_config`` (keyed by the driver's name) becomes ``DriverSandboxTemplate.driver_config``,
and feeds that to the driver in this process."""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import grpc
import pytest
from framework.fake_hosts import inventory_from_dict, probe
from framework.fake_hypervisor import FakeHypervisor, unit_config
from framework.openshell_client import in_process, stub
from framework.paths import REPO
from google.protobuf import json_format

from vmsandbox.gpu.fabric.policy import allocate
from vmsandbox.openshell.admission import AdmissionPolicy
from vmsandbox.openshell.proto import compute_driver_pb2 as pb
from vmsandbox.openshell.request import translate

PLATFORMS_PYTHON = REPO / ".venv-platforms" / "bin" / "python"
DEVICES = ["0000:41:00.0", "0000:42:00.0"]  # a PCIe switch pair of the fake HGX host

_SDK_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from concurrent import futures
    import grpc
    from google.protobuf import json_format
    import openshell
    from openshell import sandbox
    from openshell._proto import openshell_pb2, openshell_pb2_grpc

    received = []

    class Gateway(openshell_pb2_grpc.OpenShellServicer):
        def CreateSandboxTemplate(self, request, context):
            received.append(request.template)
            return openshell_pb2.SandboxTemplateResponse(template=request.template)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    openshell_pb2_grpc.add_OpenShellServicer_to_server(Gateway(), server)
    server.add_insecure_port("unix:" + sys.argv[1])
    server.start()
    with grpc.insecure_channel("unix:" + sys.argv[1]) as channel:
        sandbox.SandboxTemplateClient(channel).create(
            workspace="default",
            name="gpu-job",
            gpu_count=2,
            gpu=True,
            driver_config={"vmsandbox": {"gpu_device_ids": json.loads(sys.argv[2])}},
        )
    server.stop(None)
    (template,) = received
    print(json.dumps({
        "sdk": openshell.__version__ if hasattr(openshell, "__version__") else "",
        "template": json_format.MessageToDict(template, preserving_proto_field_name=True),
    }))
    """
)


def _sdk_template(tmp_path: Path) -> dict:
    """The template the SDK sent, as proto3 JSON."""
    if not PLATFORMS_PYTHON.exists():
        pytest.fail(
            f"{PLATFORMS_PYTHON} is missing: run `bash setup/platforms.sh` (make test does)"
        )
    done = subprocess.run(
        [str(PLATFORMS_PYTHON), "-c", _SDK_SCRIPT, str(tmp_path / "gw.sock"), json.dumps(DEVICES)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["template"]


def _as_the_gateway_does(template: dict, driver: str = "vmsandbox") -> pb.DriverSandbox:
    """The DriverSandbox a gateway sends driver ``driver`` for a public sandbox template."""
    spec = template["spec"]
    workload = spec.get("workload", {})
    sandbox = pb.DriverSandbox(id="gw-sdk-1", name="t-os-sdk")
    sandbox.spec.template.image = workload.get("image", "")
    gpu = workload.get("resources", {}).get("gpu")
    if gpu is not None:
        json_format.ParseDict(gpu, sandbox.spec.resource_requirements.gpu)
        sandbox.spec.resource_requirements.gpu.SetInParent()
    block = spec.get("driver_config", {}).get(driver)
    if block is not None:
        sandbox.spec.template.driver_config.update(block)
    return sandbox


def test_an_sdk_gpu_template_reaches_the_allocator_as_asked(tmp_path: Path):
    template = _sdk_template(tmp_path)
    workload = template["spec"]["workload"]
    assert workload["resources"]["gpu"] == {"count": 2}
    sandbox = _as_the_gateway_does(template)
    assert sandbox.spec.resource_requirements.gpu.count == 2

    # What SandboxManager.allocate hands the allocator is the translated spec's GpuRequest.
    request = translate(
        sandbox, {"minimal": "minimal-1"}, admission=AdmissionPolicy(allow_driver_config=True)
    ).spec.gpu
    assert request is not None
    assert (request.count, request.devices, request.wanted()) == (2, tuple(DEVICES), 2)
    (found,) = probe("hgx_h100", [{"use_nvml": False, "proc_root": str(tmp_path)}])
    chosen = allocate(request, inventory_from_dict(found["inventory"]))
    assert [gpu.bdf for gpu in chosen.gpus] == DEVICES

    # Over the wire, the driver in this process takes the same request to its allocator: on
    # this GPU-less machine the allocator names the devices it was asked for.
    config = unit_config(tmp_path, openshell_allow_driver_config=True)
    sandbox.spec.template.image = "tiny"
    with in_process(config, FakeHypervisor()) as socket_path:
        channel, client = stub(socket_path)
        with channel, pytest.raises(grpc.RpcError) as caught:
            client.ValidateSandboxCreate(pb.ValidateSandboxCreateRequest(sandbox=sandbox))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith(f"devices: no GPU '{DEVICES[0]}' on this host")


def test_without_the_operators_consent_the_sdks_driver_config_is_refused(tmp_path: Path):
    sandbox = _as_the_gateway_does(_sdk_template(tmp_path))
    sandbox.spec.template.image = "tiny"
    with in_process(unit_config(tmp_path), FakeHypervisor()) as socket_path:
        channel, client = stub(socket_path)
        with channel, pytest.raises(grpc.RpcError) as caught:
            client.ValidateSandboxCreate(pb.ValidateSandboxCreateRequest(sandbox=sandbox))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("template.driver_config (gpu_device_ids)")
