"""An OpenShell DriverSandbox in vmsandbox's terms: quantities, images, names, GPUs through
compat.openshell (and the operator's driver_config admission), environment, the token (a file,
never the environment), the main unit and launch labels."""

from __future__ import annotations

from decimal import Decimal

import pytest

from vmsandbox.errors import InvalidArgument
from vmsandbox.openshell import quantity
from vmsandbox.openshell.admission import AdmissionPolicy
from vmsandbox.openshell.identity import INCARNATION_LABEL
from vmsandbox.openshell.launch import OPENSHELL_MAIN_UNIT, Workload
from vmsandbox.openshell.proto import compute_driver_pb2 as pb
from vmsandbox.openshell.request import (
    ID_LABEL,
    REQUEST_LABEL,
    TOKEN_PATH,
    request_digest,
    sandbox_name,
    translate,
)

IMAGES = {"minimal": "minimal-1a2b", "nvidia": "nvidia-3c4d"}
ALLOWED = AdmissionPolicy(allow_driver_config=True)


def _sandbox(**spec: object) -> pb.DriverSandbox:
    return pb.DriverSandbox(id="gw-1", name="job-1", spec=pb.DriverSandboxSpec(**spec))


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("500m", Decimal("0.5")),
        ("2", Decimal(2)),
        ("1.5", Decimal("1.5")),
        ("4Gi", Decimal(4 * 2**30)),
        ("256Mi", Decimal(256 * 2**20)),
        ("1e9", Decimal(10**9)),
        ("2G", Decimal(2 * 10**9)),
        (".5Ki", Decimal(512)),
    ],
)
def test_quantities_parse_as_kubernetes_writes_them(text: str, value: Decimal):
    assert quantity.parse(text, "f") == value


@pytest.mark.parametrize("text", ["", "abc", "4GiB", "1.2.3", "Gi", "4 Gi", "1e", "0", "-1"])
def test_bad_quantities_name_the_field_and_value(text: str):
    with pytest.raises(InvalidArgument) as caught:
        quantity.parse(text, "template.resources.cpu_limit")
    assert caught.value.details == {"field": "template.resources.cpu_limit", "value": text}


def test_vcpus_and_memory_take_the_limit_rounded_up():
    assert quantity.vcpus("500m", "", "cpu", 1) == 1
    assert quantity.vcpus("1", "2500m", "cpu", 1) == 3
    assert quantity.vcpus("", "", "cpu", 1) == 1
    assert quantity.memory_mib("1Gi", "", "memory", 1024) == 1024
    assert quantity.memory_mib("", "1e9", "memory", 1024) == 954
    with pytest.raises(InvalidArgument, match="memory_limit '1Gi' is below memory_request '2Gi'"):
        quantity.memory_mib("2Gi", "1Gi", "memory", 1024)


def test_spec_resources_labels_and_environment():
    sandbox = _sandbox(
        environment={"B": "spec", "OPENSHELL_SANDBOX_TOKEN": "leak"},
        log_level="debug",
        template=pb.DriverSandboxTemplate(
            image="nvidia",
            labels={"team": "ml"},
            environment={"A": "template", "B": "template"},
            resources=pb.DriverResourceRequirements(cpu_limit="2", memory_request="4Gi"),
        ),
        sandbox_token="secret.jwt.value",
        command=["python3", "-m", "http.server"],
    )
    sandbox.namespace, sandbox.workspace = "ns", "ws"
    got = translate(sandbox, IMAGES)
    spec = got.spec
    assert (got.name, spec.image, spec.cpus, spec.memory_mib, spec.gpu) == (
        "job-1",
        "nvidia",
        2,
        4096,
        None,
    )
    incarnation = spec.labels.pop(INCARNATION_LABEL)
    assert len(incarnation) == 32 and int(incarnation, 16) >= 0
    assert spec.labels == {
        "team": "ml",
        ID_LABEL: "gw-1",
        "openshell.namespace": "ns",
        "openshell.workspace": "ws",
        "openshell.image-id": "nvidia-3c4d",
        REQUEST_LABEL: request_digest(sandbox),
        **Workload("sandbox", "", "image", (OPENSHELL_MAIN_UNIT,), ()).labels(),
    }
    assert "secret.jwt.value" not in str(spec.labels)
    assert spec.guest is not None
    assert spec.guest.environment == {
        "A": "template",
        "B": "spec",
        "OPENSHELL_SANDBOX": "job-1",
        "OPENSHELL_SANDBOX_ID": "gw-1",
        "OPENSHELL_LOG_LEVEL": "debug",
        "OPENSHELL_SANDBOX_TOKEN_FILE": TOKEN_PATH,
    }
    (token,) = spec.guest.files
    assert (token.path, token.content, token.mode) == (TOKEN_PATH, "secret.jwt.value", "0600")
    assert "secret.jwt.value" not in repr(spec)
    assert spec.guest.main == () and not spec.guest.autostart
    unit = spec.guest.units[OPENSHELL_MAIN_UNIT]
    assert "User=sandbox\n" in unit and "ExecStart=python3 -m http.server\n" in unit
    assert "Group=" not in unit and "PrivateUsers" not in unit
    assert translate(sandbox, IMAGES).spec.labels[INCARNATION_LABEL] != incarnation


def test_an_oci_reference_is_refused_naming_the_hosts_images():
    with pytest.raises(InvalidArgument) as caught:
        translate(_sandbox(template=pb.DriverSandboxTemplate(image="ghcr.io/x/y:1")), IMAGES)
    assert "template.image 'ghcr.io/x/y:1' is not an image of this host" in caught.value.message
    assert "this host has minimal, nvidia" in caught.value.message
    assert translate(_sandbox(), IMAGES).spec.image == "minimal"


def test_names_that_are_not_vmsandbox_names_are_derived_from_the_gateway_id():
    assert sandbox_name("job-1", "gw-1") == "job-1"
    derived = sandbox_name("Job_1", "gw-1")
    assert derived.startswith("os-") and len(derived) == 19
    assert derived == sandbox_name("", "gw-1")
    with pytest.raises(InvalidArgument, match="names no sandbox"):
        sandbox_name("", "")


def test_gpu_count_and_driver_config_devices_go_through_compat():
    sandbox = _sandbox()
    sandbox.spec.resource_requirements.gpu.count = 2
    sandbox.spec.template.driver_config.update({"gpu_device_ids": ["0000:41:00.0", "3"]})
    gpu = translate(sandbox, IMAGES, admission=ALLOWED).spec.gpu
    assert gpu is not None
    assert (gpu.count, gpu.devices) == (2, ("0000:41:00.0", "3"))
    presence_only = _sandbox()
    presence_only.spec.resource_requirements.gpu.SetInParent()
    assert translate(presence_only, IMAGES).spec.gpu.wanted() == 1


def test_bad_gpu_fields_are_invalid_argument_from_compat():
    devices_alone = _sandbox()
    devices_alone.spec.template.driver_config.update({"gpu_device_ids": ["0000:41:00.0"]})
    with pytest.raises(InvalidArgument, match="gpu_device_ids requires a gpu request"):
        translate(devices_alone, IMAGES, admission=ALLOWED)
    unknown = _sandbox()
    unknown.spec.resource_requirements.gpu.SetInParent()
    unknown.spec.template.driver_config.update({"gpus": 2})
    with pytest.raises(InvalidArgument, match="gpus"):
        translate(unknown, IMAGES, admission=ALLOWED)


def test_bad_environment_and_resources_name_their_field():
    with pytest.raises(InvalidArgument) as caught:
        translate(_sandbox(environment={"A": "two\nlines"}), IMAGES)
    assert caught.value.details["field"] == "environment.A"
    bad_cpu = pb.DriverSandboxTemplate(resources=pb.DriverResourceRequirements(cpu_request="x"))
    with pytest.raises(InvalidArgument) as caught:
        translate(_sandbox(template=bad_cpu), IMAGES)
    assert caught.value.details["field"] == "template.resources.cpu_request"


@pytest.mark.parametrize("word", ["true\nUser=root", "a\rb", "x\x00y", "\x0bz"])
def test_a_command_word_with_a_line_break_never_reaches_the_unit(word: str):
    """The main unit is written line by line: a word with a newline would end ExecStart and
    let the request write directives of its own (User=root overriding the workload
    identity)."""
    with pytest.raises(InvalidArgument, match="command") as caught:
        translate(_sandbox(command=["sh", "-c", word]), IMAGES)
    assert caught.value.details["field"] == "command"


def test_a_derived_name_and_the_request_digest_belong_to_the_calling_gateway():
    """Two gateways' sandboxes with the same id and no usable name get different names; the
    digest that tells a create sent again from a different one leaves the secrets out."""
    assert sandbox_name("", "same", "uid:0") != sandbox_name("", "same", "uid:65534")
    assert sandbox_name("web", "same", "uid:0") == "web"
    first, again = _sandbox(sandbox_token="token.one"), _sandbox(sandbox_token="token.two")
    again.spec.launch_authentication = b"{}"
    assert request_digest(first) == request_digest(again)
    assert request_digest(first) != request_digest(_sandbox(command=["true"]))
