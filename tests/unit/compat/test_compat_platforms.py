"""vmsandbox's compat adapters against the platforms' own released code, spec for spec.

Each platform's pinned package (setup/platforms/requirements.txt) runs in .venv-platforms, in
one long-lived subprocess per platform (tests/framework/platform_oracle.py); the same specs go to it
and, in this process, to ``vmsandbox.compat``. Where the two answers differ, the difference must be
one of INTENDED below, each asserted on its own example and on every generated spec it explains: a
difference not in that table fails the test.

Rules that live only in a platform's source repository are restated in the oracle and cite
their file and commit there: OpenShell's gateway and VM driver (NVIDIA/OpenShell 2f7fb655) and
FlowMesh's worker (mlsys-io/FlowMesh 7d2a77ac, 6f1ac4c2, 202106ee).

The compatibility page (docs/compatibility.md, from vmsandbox.compat.fields) is checked here
too: each of its examples is run through both sides and must read as the page says.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from framework.paths import FRAMEWORK, REPO
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from vmsandbox.compat import fields, flowmesh, opensandbox, openshell, tako
from vmsandbox.errors import InvalidArgument
from vmsandbox.gpu.request import GpuRequest, bytes_to_mib, normalise_device_ids

PLATFORMS_PYTHON = REPO / ".venv-platforms" / "bin" / "python"
ORACLE = FRAMEWORK / "platform_oracle.py"
DIFFERENTIAL = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

A, B = "0000:41:00.0", "0000:c1:00.0"
UUID = "GPU-0a1b2c3d-4e5f-6789-abcd-ef0123456789"


# --- the oracles -----------------------------------------------------------------------------


class Oracle:
    """One platform's oracle process: a JSON line in, a JSON line out."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed by close())
        self.process = subprocess.Popen(
            [str(PLATFORMS_PYTHON), str(ORACLE)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            bufsize=1,
        )

    def ask(self, platform: str, value: object, absent: bool = False) -> dict[str, Any]:
        """The platform's answer to ``value`` (``absent``: the field is not given at all)."""
        assert self.process.stdin is not None and self.process.stdout is not None
        request = {"platform": platform, "input": value, "absent": absent}
        self.process.stdin.write(json.dumps(request) + "\n")
        line = self.process.stdout.readline()
        if not line:
            self.stderr.seek(0)
            raise AssertionError(f"the {self.name} oracle died:\n{self.stderr.read()}")
        answer = json.loads(line)
        assert "oracle_error" not in answer, answer.get("oracle_error")
        return answer

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=60)
        self.stderr.close()


@pytest.fixture(scope="session")
def oracles() -> Iterator[Callable[[str], Oracle]]:
    """One oracle process per platform, started on first use and kept for the session."""
    if not PLATFORMS_PYTHON.exists():
        pytest.fail(f"{PLATFORMS_PYTHON} is missing: run setup/platforms.sh (make test does)")
    started: dict[str, Oracle] = {}

    def get(name: str) -> Oracle:
        if name not in started:
            started[name] = Oracle(name)
        return started[name]

    yield get
    for oracle in started.values():
        oracle.close()


# --- answers in one shape --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What a request comes to: refused, no GPU, or GPUs (count 0 with every=True: all)."""

    kind: str  # "refused", "none" or "gpus"
    count: int = 0
    every: bool = False
    devices: tuple[str, ...] = ()
    vendor: str | None = None
    model: str | None = None
    min_memory_mib: int | None = None


REFUSED = Verdict("refused")
NO_GPU = Verdict("none")


def ours(adapter: Callable[[Any], GpuRequest | None], value: object) -> Verdict:
    """vmsandbox's verdict; an InvalidArgument must name its field in its message."""
    try:
        request = adapter(value)
    except InvalidArgument as err:
        assert err.code == "INVALID_ARGUMENT"
        assert err.details["field"] in err.message, err.message
        return REFUSED
    if request is None:
        return NO_GPU
    count = 0 if request.all else request.count or len(request.devices) or 1
    return Verdict(
        "gpus",
        count,
        request.all,
        request.devices,
        request.vendor,
        request.model.casefold() if request.model else None,
        request.min_memory_mib,
    )


def canonical(ids: list[str] | None) -> tuple[str, ...] | None:
    """Platform device ids in vmsandbox's spelling; None when vmsandbox cannot resolve them."""
    try:
        return normalise_device_ids(ids or [], "ids")
    except InvalidArgument:
        return None


def openshell_verdict(answer: dict[str, Any]) -> Verdict:
    """What OpenShell does with the spec, its one-GPU VM driver included."""
    return REFUSED if answer.get("vm_driver_limit") else openshell_asks(answer)


def openshell_asks(answer: dict[str, Any]) -> Verdict:
    """What the spec asks OpenShell's drivers for, once parsed and checked."""
    if "refused" in answer:
        return REFUSED
    if not answer["gpu"]:
        return NO_GPU
    devices = canonical(answer["device_ids"])
    if devices is None:
        return Verdict("gpus", -1)  # ids vmsandbox cannot resolve: never equal to ours
    return Verdict("gpus", answer["count"] or 1, devices=devices)


def opensandbox_verdict(answer: dict[str, Any]) -> Verdict:
    """What OpenSandbox's Docker runtime does, the one vmsandbox follows on ``gpu``."""
    if answer["status"] != 200 or answer["docker"]["status"] != 200:
        return REFUSED
    gpu = answer["docker"]["gpu"]
    if gpu is None:
        return NO_GPU
    return Verdict("gpus", 0 if gpu == -1 else gpu, every=gpu == -1, vendor="nvidia")


def tako_reading(reader: dict[str, Any]) -> Verdict:
    if not reader["ok"]:
        return REFUSED
    if not reader["enabled"]:
        return NO_GPU
    vendor = reader["vendor"]
    if reader["count"] is not None:
        return Verdict("gpus", reader["count"], vendor=vendor)
    if reader["device_ids"]:
        devices = canonical(reader["device_ids"])
        if devices is None:
            return Verdict("gpus", -1)
        return Verdict("gpus", len(devices), devices=devices, vendor=vendor)
    return Verdict("gpus", every=True, vendor=vendor)


def tako_verdict(answer: dict[str, Any]) -> Verdict:
    """Both readers' verdict where they agree; a disagreement is a refusal."""
    readings = {tako_reading(reader) for reader in answer.values()}
    return readings.pop() if len(readings) == 1 else REFUSED


def flowmesh_verdict(answer: dict[str, Any]) -> Verdict:
    if "refused" in answer:
        return REFUSED
    if answer["gpus"] == "none":
        return NO_GPU
    if answer["gpus"] == "all":
        return Verdict("gpus", every=True)
    minimum = answer["min_memory_bytes"]
    return Verdict(
        "gpus",
        answer["gpus"],
        model=answer["type"],
        min_memory_mib=bytes_to_mib(minimum) if minimum else None,
    )


# --- the platforms, as the test drives them --------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Platform:
    name: str
    oracle: str  # the oracle's handler
    adapter: Callable[[Any], GpuRequest | None]
    verdict: Callable[[dict[str, Any]], Verdict]


PLATFORMS = {
    "openshell": Platform("openshell", "openshell", openshell.gpu_request, openshell_verdict),
    "opensandbox": Platform(
        "opensandbox", "opensandbox", opensandbox.gpu_request, opensandbox_verdict
    ),
    "tako": Platform("tako", "tako", tako.gpu_request, tako_verdict),
    "tako_job": Platform("tako", "tako_job", tako.job_type_gpu_request, tako_verdict),
    "flowmesh": Platform("flowmesh", "flowmesh", flowmesh.gpu_request, flowmesh_verdict),
}


# --- intended differences: the one place they are listed -------------------------------------


@dataclasses.dataclass(frozen=True)
class Intended:
    """A deliberate difference: where ``applies``, vmsandbox's verdict passes ``ours_ok``."""

    name: str
    platform: str  # a key of PLATFORMS
    example: object
    platform_says: str
    vmsandbox_says: str
    why: str
    applies: Callable[[object, dict[str, Any]], bool]
    ours_ok: Callable[[Verdict], bool]


def _keys(value: object) -> set[str]:
    return {key for key in value if isinstance(key, str)} if isinstance(value, dict) else set()


def _vm_ids(spec: object) -> object:
    """The raw ``gpu_device_ids`` of a spec's vm block, by either spelling of the fields."""
    if not isinstance(spec, dict):
        return None
    template = spec.get("template")
    if not isinstance(template, dict):
        return None
    config = template.get("driver_config") or template.get("driverConfig")
    vm = config.get("vm") if isinstance(config, dict) else None
    return vm.get("gpu_device_ids") if isinstance(vm, dict) else None


def _unresolvable(ids: object) -> bool:
    """A list of strings vmsandbox cannot resolve to distinct GPUs."""
    if not isinstance(ids, list) or not all(isinstance(item, str) for item in ids):
        return False
    devices = canonical(ids)
    return devices is None or len(set(devices)) != len(ids)


def _refused(verdict: Verdict) -> bool:
    return verdict == REFUSED


_LEGACY_KEYS = {"gpu", "gpu_device", "gpuDevice"}
_UNREAD = [name for name, kind in openshell.SPEC_SCHEMA.items() if kind is openshell._not_read]


def _refused_on_unread_field(answer: dict[str, Any]) -> bool:
    """json_format refused the value of a spec field that is not about GPUs."""
    why = answer.get("why", "") if answer.get("refused") == "json_format" else ""
    return any(why.startswith(f"ParseError: Failed to parse {name} field") for name in _UNREAD)


_OPENSANDBOX_VENDOR_KEYS = {"nvidia.com/gpu": "nvidia", "amd.com/gpu": "amd"}


def _vendor_key_reading(limits: object, verdict: Verdict) -> bool:
    """vmsandbox on vendor keys: that vendor, a whole-number count; or a refusal."""
    if verdict == REFUSED:
        return True
    assert isinstance(limits, dict)
    given = [(key, limits[key]) for key in _OPENSANDBOX_VENDOR_KEYS if key in limits]
    if len(given) != 1 or verdict.kind != "gpus":
        return False
    key, value = given[0]
    return (
        verdict.vendor == _OPENSANDBOX_VENDOR_KEYS[key]
        and value.strip().isdigit()
        and verdict.count == int(value.strip())
    )


def _typo_key(limits: object) -> bool:
    return any(
        key not in ("gpu", *_OPENSANDBOX_VENDOR_KEYS)
        and key.strip().lower() in ("gpu", *_OPENSANDBOX_VENDOR_KEYS)
        for key in _keys(limits)
    )


def _tako_refusal_names(answer: dict[str, Any], words: str) -> bool:
    return all(not reader["ok"] and words in reader["why"] for reader in answer.values())


def _tako_ids(block: object) -> object:
    if not isinstance(block, dict):
        return None
    return block.get("device_ids", block.get("gpu_device_ids"))


def _flat_and_nested_differ(job: object, _answer: dict[str, Any]) -> bool:
    if not isinstance(job, dict) or not isinstance(job.get("gpu"), dict):
        return False
    nested = job["gpu"]
    return any(
        f"gpu_{key}" in job
        and key in nested
        and nested[key] not in ([],)
        and nested[key] != job[f"gpu_{key}"]
        for key in ("enabled", "vendor", "count", "device_ids")
    )


INTENDED: tuple[Intended, ...] = (
    Intended(
        "openshell-more-than-one-gpu",
        "openshell",
        {"resource_requirements": {"gpu": {"count": 4}}},
        "4 GPUs asked; the VM driver refuses more than one",
        "4 GPUs",
        "a vmsandbox VM takes as many GPUs as the host has free; OpenShell's VM driver passes one",
        lambda spec, answer: bool(answer.get("vm_driver_limit")),
        lambda verdict: verdict.kind == "gpus" and verdict.count > 1,
    ),
    Intended(
        "openshell-device-ids-resolve",
        "openshell",
        {
            "resource_requirements": {"gpu": {}},
            "template": {"driver_config": {"vm": {"gpu_device_ids": ["gpu0"]}}},
        },
        "1 GPU: gpu0",
        f"refused ({openshell._IDS})",
        "an id that names no GPU, or a second spelling of the same GPU, would make a sandbox "
        "that cannot start: vmsandbox refuses it before allocating anything",
        lambda spec, answer: "refused" not in answer and _unresolvable(_vm_ids(spec)),
        _refused,
    ),
    Intended(
        "openshell-earlier-spec",
        "openshell",
        {"gpu": True, "gpu_device": "41:00.0"},
        "refused (json_format: no field named gpu)",
        "1 GPU: 0000:41:00.0",
        "the spec before OpenShell 2c545893 and 1dc59853 (gpu, gpu_device) is still read, so "
        "clients written against it keep working",
        lambda spec, answer: (
            bool(_keys(spec) & _LEGACY_KEYS) and answer.get("refused") == "json_format"
        ),
        lambda verdict: True,
    ),
    Intended(
        "openshell-other-fields-not-read",
        "openshell",
        {"log_level": 5, "resource_requirements": {"gpu": {}}},
        "refused (json_format: log_level must be a string)",
        "1 GPU",
        "fields that are not about GPUs are checked by name only here; their values are left "
        "to the reader of that field",
        lambda spec, answer: _refused_on_unread_field(answer),
        lambda verdict: verdict != REFUSED,
    ),
    Intended(
        "opensandbox-vendor-keys",
        "opensandbox",
        {"nvidia.com/gpu": "2"},
        "Docker: no GPU; Kubernetes: nvidia.com/gpu=2",
        "2 nvidia GPUs",
        "the vendor keys ask for that vendor's GPUs, as they do on Kubernetes (Docker ignores "
        "them); their value must be a whole number, as Kubernetes requires of an extended "
        "resource",
        lambda limits, answer: (
            bool(_keys(limits) & set(_OPENSANDBOX_VENDOR_KEYS)) and "gpu" not in _keys(limits)
        ),
        lambda verdict: True,  # narrowed by _vendor_key_reading in judge()
    ),
    Intended(
        "opensandbox-gpu-and-vendor-key",
        "opensandbox",
        {"gpu": "1", "nvidia.com/gpu": "2"},
        "Docker: 1 nvidia GPU; Kubernetes: nvidia.com/gpu=1",
        'refused (resourceLimits["gpu"])',
        "gpu beside a vendor key that says otherwise: Docker ignores the vendor key, Kubernetes "
        "overwrites it, so the two runtimes start different sandboxes; vmsandbox asks which "
        "was meant",
        lambda limits, answer: (
            "gpu" in _keys(limits) and bool(_keys(limits) & set(_OPENSANDBOX_VENDOR_KEYS))
        ),
        _refused,
    ),
    Intended(
        "opensandbox-typo-key",
        "opensandbox",
        {"GPU": "1"},
        "Docker: no GPU; Kubernetes: GPU=1 (an unknown resource)",
        'refused (resourceLimits["GPU"])',
        "a key that differs from a GPU key only in case or spaces is a typo that would start "
        "the sandbox without the GPU asked for",
        lambda limits, answer: _typo_key(limits),
        _refused,
    ),
    Intended(
        "tako-amd-count",
        "tako",
        {"enabled": True, "vendor": "amd", "count": 2},
        "config: refused (count is only supported for nvidia); from_dict: refused (count is "
        "only supported for nvidia)",
        "2 amd GPUs",
        "a VM passes N AMD GPUs through; Tako's container runtime cannot",
        lambda block, answer: _tako_refusal_names(answer, "only supported for gpu.vendor"),
        lambda verdict: verdict.kind == "gpus" and verdict.vendor == "amd",
    ),
    Intended(
        "tako-device-ids-resolve",
        "tako",
        {"enabled": True, "vendor": "nvidia", "device_ids": ["gpu0"]},
        "config: GPUs gpu0; from_dict: GPUs gpu0",
        "refused (gpu.device_ids)",
        "an id that names no GPU, or a second spelling of the same GPU, would make a sandbox "
        "that cannot start: vmsandbox refuses it before allocating anything",
        lambda block, answer: _unresolvable(_tako_ids(block)),
        _refused,
    ),
    Intended(
        "tako-job-amd-count",
        "tako_job",
        {"name": "job", "gpu_enabled": True, "gpu_vendor": "amd", "gpu_count": 2},
        "from_dict: refused (count is only supported for nvidia)",
        "2 amd GPUs",
        "a VM passes N AMD GPUs through; Tako's container runtime cannot",
        lambda job, answer: _tako_refusal_names(answer, "only supported for gpu.vendor"),
        lambda verdict: verdict.kind == "gpus" and verdict.vendor == "amd",
    ),
    Intended(
        "tako-job-device-ids-resolve",
        "tako_job",
        {"name": "job", "gpu": {"enabled": True, "vendor": "nvidia", "device_ids": ["gpu0"]}},
        "from_dict: GPUs gpu0",
        "refused (gpu.device_ids)",
        "an id that names no GPU would make a sandbox that cannot start",
        lambda job, answer: (
            isinstance(job, dict)
            and (_unresolvable(_tako_ids(job)) or _unresolvable(_tako_ids(job.get("gpu"))))
        ),
        _refused,
    ),
    Intended(
        "tako-job-flat-and-nested",
        "tako_job",
        {"name": "job", "gpu_count": 1, "gpu": {"enabled": True, "vendor": "nvidia", "count": 2}},
        "from_dict: 1 nvidia GPU",
        "refused (gpu_count)",
        "a legacy top-level field that disagrees with the same key in gpu is dropped by Tako "
        "without a word; vmsandbox asks which one was meant",
        _flat_and_nested_differ,
        _refused,
    ),
    Intended(
        "flowmesh-negative-count",
        "flowmesh",
        {"count": -1},
        "no GPU",
        "refused (resources.hardware.gpu.count)",
        "FlowMesh's worker reads a negative count as no GPU, its binding executor as every GPU",
        lambda block, answer: (
            isinstance(block, dict) and isinstance(block.get("count"), int) and block["count"] < 0
        ),
        _refused,
    ),
    Intended(
        "flowmesh-memory-number",
        "flowmesh",
        {"memory": 1.5},
        "1 GPU, >= 1 byte",
        "refused (resources.hardware.gpu.memory)",
        "FlowMesh truncates a fractional size and ignores a negative one: the minimum asked "
        "for is not the one applied",
        lambda block, answer: (
            isinstance(block, dict)
            and isinstance(block.get("memory"), int | float)
            and not isinstance(block.get("memory"), bool)
            and (block["memory"] < 0 or block["memory"] != int(block["memory"]))
        ),
        _refused,
    ),
    Intended(
        "flowmesh-type-words",
        "flowmesh",
        {"type": "--"},
        "1 GPU, type --",
        "refused (resources.hardware.gpu.type)",
        "vmsandbox matches a model by whole words (A10 does not pick an A100); a type with no "
        "letter or digit matches nothing there",
        lambda block, answer: (
            isinstance(block, dict)
            and isinstance(block.get("type"), str)
            and block["type"].strip().lower() not in ("", "any", "auto", "*")
            and not any(char.isalnum() for char in block["type"])
        ),
        _refused,
    ),
)


def judge(platform: Platform, value: object, answer: dict[str, Any]) -> str:
    """'same', or the name of the intended difference that explains vmsandbox's answer."""
    theirs = platform.verdict(answer)
    mine = ours(platform.adapter, value)
    if mine == theirs:
        return "same"
    for difference in INTENDED:
        if PLATFORMS[difference.platform] is not platform:
            continue
        if not difference.applies(value, answer) or not difference.ours_ok(mine):
            continue
        if difference.name == "opensandbox-vendor-keys" and not _vendor_key_reading(value, mine):
            continue
        return difference.name
    raise AssertionError(
        f"{platform.name}: {value!r}\n  platform: {answer}\n  -> {theirs}\n  vmsandbox: {mine}"
    )


def check(oracles: Callable[[str], Oracle], key: str, value: object, absent: bool = False) -> str:
    """Both sides' answers to ``value``: the same, or a difference INTENDED names."""
    platform = PLATFORMS[key]
    answer = oracles(platform.name).ask(platform.oracle, value, absent)
    outcome = judge(platform, value, answer)
    if outcome == "openshell-earlier-spec":
        # OpenShell stops at the first unknown key: the rest of the spec must still parse.
        assert isinstance(value, dict)
        rest = {k: v for k, v in value.items() if k not in _LEGACY_KEYS}
        if oracles(platform.name).ask(platform.oracle, rest).get("refused") == "json_format":
            assert ours(platform.adapter, value) == REFUSED, value
    return outcome


# --- the six rules the platforms' code settled -----------------------------------------------


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        # 1. proto3 JSON names
        ("openshell", {"resourceRequirements": {"gpu": {"count": 2}}}, Verdict("gpus", 2)),
        (
            "openshell",
            {
                "resourceRequirements": {"gpu": {}},
                "template": {"driverConfig": {"vm": {"gpu_device_ids": ["41:00.0"]}}},
            },
            Verdict("gpus", 1, devices=(A,)),
        ),
        # 2. an unknown key inside resource_requirements
        ("openshell", {"resource_requirements": {"gpus": {"count": 2}}}, REFUSED),
        ("openshell", {"resource_requirements": {"gpus": {"count": 2}, "gpu": {}}}, REFUSED),
        # 3. integral floats
        ("openshell", {"resource_requirements": {"gpu": {"count": 2.0}}}, Verdict("gpus", 2)),
        ("openshell", {"resource_requirements": {"gpu": {"count": 1e2}}}, Verdict("gpus", 100)),
        # 4. an empty string, alone or beside a vendor key
        ("opensandbox", {"gpu": ""}, REFUSED),
        ("opensandbox", {"gpu": "", "nvidia.com/gpu": "2"}, REFUSED),
        # 5. null
        ("opensandbox", {"gpu": None}, REFUSED),
        # 6. null device ids
        ("tako", {"enabled": True, "vendor": "nvidia", "device_ids": None}, REFUSED),
    ],
)
def test_issue_rules_follow_the_platform(
    oracles: Callable[[str], Oracle], key: str, value: object, expected: Verdict
) -> None:
    platform = PLATFORMS[key]
    answer = oracles(platform.name).ask(platform.oracle, value)
    verdict = openshell_asks if key == "openshell" else platform.verdict
    assert verdict(answer) == expected
    assert ours(platform.adapter, value) == expected


# --- hand-picked edge cases ------------------------------------------------------------------

OPENSHELL_CASES = [
    {},
    [],
    "",
    None,
    7,
    {"resource_requirements": None},
    {"resource_requirements": []},
    {"resource_requirements": ["gpu"]},
    {"resource_requirements": "gpu"},
    {"resource_requirements": {"gpu": None}},
    {"resource_requirements": {"gpu": {}}},
    {"resource_requirements": {"gpu": True}},
    {"resource_requirements": {"gpu": {"count": None}}},
    {"resource_requirements": {"gpu": {"count": 0}}},
    {"resource_requirements": {"gpu": {"count": -0.0}}},
    {"resource_requirements": {"gpu": {"count": "-0"}}},
    {"resource_requirements": {"gpu": {"count": "1"}}},
    {"resource_requirements": {"gpu": {"count": "+1"}}},
    {"resource_requirements": {"gpu": {"count": "1.0"}}},
    {"resource_requirements": {"gpu": {"count": "1e0"}}},
    {"resource_requirements": {"gpu": {"count": " 1"}}},
    {"resource_requirements": {"gpu": {"count": "\t1"}}},
    {"resource_requirements": {"gpu": {"count": "1_0"}}},
    {"resource_requirements": {"gpu": {"count": "0x1"}}},
    {"resource_requirements": {"gpu": {"count": "Infinity"}}},
    {"resource_requirements": {"gpu": {"count": 1.5}}},
    {"resource_requirements": {"gpu": {"count": float("nan")}}},
    {"resource_requirements": {"gpu": {"count": float("inf")}}},
    {"resource_requirements": {"gpu": {"count": True}}},
    {"resource_requirements": {"gpu": {"count": [1]}}},
    {"resource_requirements": {"gpu": {"count": 2**32 - 1}}},
    {"resource_requirements": {"gpu": {"count": 2**32}}},
    {"resource_requirements": {"gpu": {"count": 4294967295.0}}},
    {"resource_requirements": {"gpu": {"Count": 1}}},
    {"resource_requirements": {"gpu": {"device_ids": [A]}}},
    {"resource_requirements": {"gpu": {"count": 2}}, "resourceRequirements": {"gpu": {}}},
    {"resource_requirements": {"gpu": {"count": 2}}, "resourceRequirements": {"gpu": None}},
    {"resource_requirements": {"gpu": {"count": 2}}, "resourceRequirements": None},
    {"resource_requirement": {"gpu": {}}},
    {"driver_config": {"vm": {"gpu_device_ids": [A]}}},
    {"log_level": "debug", "tty": True, "resource_requirements": {"gpu": {}}},
    {"template": None},
    {"template": {"driver_config": None}},
    {"template": {"driver_config": []}},
    {"template": {"driver_config": {"docker": [1]}}},
    {"template": {"driver_config": {"vm": None}}},
    {"template": {"driver_config": {"vm": [A]}}},
    {"template": {"driver_config": {"vm": {}}}},
    {"template": {"driver_config": {"vm": {"gpu_device_ids": None}}}},
    {"template": {"driver_config": {"vm": {"gpu_device_ids": [A]}}}},
    {
        "template": {"driverConfig": {"vm": {"gpu_device_ids": [A]}}},
        "resourceRequirements": {"gpu": {}},
    },
    {"template": {"driver_config": {"vm": {"gpuDeviceIds": [A]}}}},
    {
        "resource_requirements": {"gpu": {}},
        "template": {"driver_config": {"vm": {"gpu_device_ids": []}}},
    },
    {
        "resource_requirements": {"gpu": {}},
        "template": {"driver_config": {"vm": {"gpu_device_ids": [" "]}}},
    },
    {
        "resource_requirements": {"gpu": {}},
        "template": {"driver_config": {"vm": {"gpu_device_ids": ["\x1c"]}}},
    },
    {
        "resource_requirements": {"gpu": {}},
        "template": {"driver_config": {"vm": {"gpu_device_ids": [1]}}},
    },
    {
        "resource_requirements": {"gpu": {}},
        "template": {"driver_config": {"vm": {"gpu_device_ids": [A, B]}}},
    },
    {
        "resource_requirements": {"gpu": {"count": 2}},
        "template": {"driver_config": {"vm": {"gpu_device_ids": [A, A]}}},
    },
    {
        "resource_requirements": {"gpu": {"count": 2}},
        "template": {"driver_config": {"vm": {"gpu_device_ids": [A, "pci_0000_c1_00_0"]}}},
    },
    {
        "resource_requirements": {"gpu": {"count": 1}},
        "template": {"driver_config": {"vm": {"gpu_device_ids": [UUID.upper()]}}},
    },
    {
        "resource_requirements": {"gpu": {}},
        "template": {"driver_config": {"vm": {"gpu_device_ids": ["gpu0"]}}},
    },
    {"gpu": True},
    {"gpu": False},
    {"gpu_device": A},
    {"gpuDevice": A, "gpu": True},
]


@pytest.mark.parametrize("spec", OPENSHELL_CASES, ids=repr)
def test_openshell_cases(oracles: Callable[[str], Oracle], spec: object) -> None:
    check(oracles, "openshell", spec)


OPENSANDBOX_CASES = [
    {},
    [],
    "gpu=1",
    {"cpu": "2", "memory": "4Gi"},
    {"cpu": 2, "gpu": "1"},
    {"gpu": None},
    {"gpu": 1},
    {"gpu": True},
    {"gpu": ["1"]},
    {"gpu": ""},
    {"gpu": " "},
    {"gpu": "1"},
    {"gpu": " 2 "},
    {"gpu": "\u20032"},
    {"gpu": "+2"},
    {"gpu": "02"},
    {"gpu": "1_0"},
    {"gpu": "\u0663"},
    {"gpu": "0"},
    {"gpu": "-1"},
    {"gpu": "1.5"},
    {"gpu": "1e3"},
    {"gpu": "two"},
    {"gpu": "9" * 5000},
    {"gpu": "all"},
    {"gpu": " ALL "},
    {"gpu": "\u2003all"},
    {"gpu": "all gpus"},
    {"nvidia.com/gpu": "2"},
    {"nvidia.com/gpu": " 2"},
    {"nvidia.com/gpu": "all"},
    {"nvidia.com/gpu": "+2"},
    {"nvidia.com/gpu": "0"},
    {"amd.com/gpu": "1", "cpu": "8"},
    {"gpu": "2", "nvidia.com/gpu": "2"},
    {"gpu": "1", "nvidia.com/gpu": "2"},
    {"gpu": "all", "nvidia.com/gpu": "2"},
    {"gpu": "3", "amd.com/gpu": "3"},
    {"nvidia.com/gpu": "1", "amd.com/gpu": "1"},
    {"GPU": "1"},
    {" gpu": "1"},
    {"NVIDIA.com/gpu": "1"},
]


@pytest.mark.parametrize("limits", OPENSANDBOX_CASES, ids=repr)
def test_opensandbox_cases(oracles: Callable[[str], Oracle], limits: object) -> None:
    check(oracles, "opensandbox", limits)


def test_opensandbox_absent_limits_mean_no_gpu(oracles: Callable[[str], Oracle]) -> None:
    answer = oracles("opensandbox").ask("opensandbox", None, absent=True)
    assert opensandbox_verdict(answer) == NO_GPU == ours(opensandbox.gpu_request, None)


ON = {"enabled": True, "vendor": "nvidia"}
SHIPPED = {"enabled": False, "vendor": None, "count": None, "device_ids": []}
TAKO_CASES = [
    {},
    SHIPPED,
    {**SHIPPED, **ON},
    [],
    "nvidia",
    True,
    ON,
    {"enabled": False},
    {"enabled": None},
    {"enabled": "false"},
    {"enabled": "true", "vendor": "nvidia"},
    {"enabled": "YES", "vendor": "nvidia"},
    {"enabled": " true", "vendor": "nvidia"},
    {"enabled": 1, "vendor": "nvidia"},
    {"enabled": 2, "vendor": "nvidia"},
    {"enabled": 0.0},
    {"enabled": True},
    {"enabled": True, "vendor": " AMD "},
    {"enabled": True, "vendor": "intel"},
    {"enabled": True, "vendor": 1},
    {"vendor": "nvidia"},
    {"enabled": False, "count": 2},
    {"enabled": False, "device_ids": [A]},
    {"enabled": False, "device_ids": []},
    {**ON, "count": 1},
    {**ON, "count": 16},
    {**ON, "count": 17},
    {**ON, "count": 0},
    {**ON, "count": "2"},
    {**ON, "count": " 2 "},
    {**ON, "count": "2.0"},
    {**ON, "count": "1_0"},
    {**ON, "count": "2.5"},
    {**ON, "count": 2.0},
    {**ON, "count": True},
    {**ON, "count": None},
    {**ON, "count": 2, "device_ids": []},
    {**ON, "count": 2, "device_ids": [A, B]},
    {**ON, "device_ids": None},
    {**ON, "device_ids": "ab"},
    {**ON, "device_ids": [A]},
    {**ON, "device_ids": [" 41:00.0 ", UUID.upper(), "0"]},
    {**ON, "device_ids": [str(i) for i in range(16)]},
    {**ON, "device_ids": [str(i) for i in range(17)]},
    {**ON, "device_ids": [""]},
    {**ON, "device_ids": ["0,1"]},
    {**ON, "device_ids": [3]},
    {**ON, "device_ids": [UUID, UUID.lower()]},
    {**ON, "device_ids": ["41:00.0", A]},
    {**ON, "device_ids": ["gpu0"]},
    {**ON, "devices": [A]},
    {"enabled": True, "vendor": "amd", "count": 2},
    {"enabled": True, "vendor": "amd", "device_ids": ["card1"]},
]


@pytest.mark.parametrize("block", TAKO_CASES, ids=repr)
def test_tako_cases(oracles: Callable[[str], Oracle], block: object) -> None:
    check(oracles, "tako", block)


def test_tako_absent_block_means_no_gpu(oracles: Callable[[str], Oracle]) -> None:
    answer = oracles("tako").ask("tako", None, absent=True)
    assert tako_verdict(answer) == NO_GPU == ours(tako.gpu_request, None)


TAKO_JOB_CASES = [
    {"name": "job"},
    {"name": "job", "gpu": None},
    {"name": "job", "gpu": []},
    {"name": "job", "gpu": SHIPPED},
    {"name": "job", "gpu": {**ON, "count": 2, "device_ids": []}},
    {"name": "job", "gpu_enabled": True, "gpu_vendor": "amd", "gpu_device_ids": ["0", "1"]},
    {
        "name": "job",
        "gpu_enabled": True,
        "gpu_vendor": "nvidia",
        "gpu": SHIPPED | {"enabled": True},
    },
    {"name": "job", "gpu_enabled": None},
    {"name": "job", "gpu_enabled": True, "gpu": {"vendor": "nvidia", "count": 2}},
    {"name": "job", "gpu_enabled": True, "gpu_vendor": "nvidia", "gpu_device_ids": None},
    {"name": "job", "gpu_count": None, "gpu": {**ON, "count": 2}},
    {"name": "job", "gpu_count": 1, "gpu": {**ON, "count": 2}},
    {"name": "job", "gpu_vendor": "nvidia"},
]


@pytest.mark.parametrize("job", TAKO_JOB_CASES, ids=repr)
def test_tako_job_cases(oracles: Callable[[str], Oracle], job: object) -> None:
    check(oracles, "tako_job", job)


FLOWMESH_CASES = [
    None,
    {},
    {"count": None, "type": None, "memory": None},
    {"type": "", "memory": ""},
    {"memory": 0},
    {"memory": 0.0},
    {"count": 0},
    {"count": 0, "type": "H100", "memory": "80G"},
    {"count": 1},
    {"count": 3},
    {"count": -1},
    {"type": "H100"},
    {"type": " A10 "},
    {"type": "any"},
    {"type": " * "},
    {"type": "   "},
    {"type": "--"},
    {"memory": "40Gi"},
    {"memory": "80 gib"},
    {"memory": "80GB"},
    {"memory": "1kB"},
    {"memory": "80"},
    {"memory": "0"},
    {"memory": "1.5Gi"},
    {"memory": "80B"},
    {"memory": "1Pi"},
    {"memory": "lots"},
    {"memory": "\u0668\u0660G"},
    {"memory": 85899345920},
    {"memory": 85899345920.0},
    {"memory": 1.5},
    {"memory": -1},
    {"memory": float("nan")},
    {"memory": float("inf")},
    {"count": 2, "type": "H100", "memory": "80G"},
    {"gpus": 1},
    {"count": 1, "vendor": "nvidia"},
    "H100",
]


@pytest.mark.parametrize("block", FLOWMESH_CASES, ids=repr)
def test_flowmesh_cases(oracles: Callable[[str], Oracle], block: object) -> None:
    check(oracles, "flowmesh", block)


# --- every intended difference, asserted on its own example ----------------------------------


@pytest.mark.parametrize("difference", INTENDED, ids=lambda d: d.name)
def test_intended_difference(oracles: Callable[[str], Oracle], difference: Intended) -> None:
    platform = PLATFORMS[difference.platform]
    answer = oracles(platform.name).ask(platform.oracle, difference.example)
    mine = ours(platform.adapter, difference.example)
    assert describe_platform(platform.oracle, answer) == difference.platform_says
    assert describe_ours(platform.adapter, difference.example) == difference.vmsandbox_says
    assert platform.verdict(answer) != mine, "not a difference: drop it from INTENDED"
    assert judge(platform, difference.example, answer) == difference.name


# --- generated specs -------------------------------------------------------------------------

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**33), 2**33),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
GOOD_IDS = [A, "41:00.0", B, "pci_0000_c1_00_0", UUID, UUID.upper(), "GPU-3f5a9c0e71b2d486"]
BAD_IDS = ["gpu0", "", " ", "MIG-x", "0,1"]
device_ids = st.sampled_from([*GOOD_IDS, "card1", "0", "3", *BAD_IDS])
id_lists = st.lists(device_ids, max_size=3)
COUNT_TEXTS = ["1", "2", " 2", "2 ", "\t2", "+2", "-1", "0", "02", "2.0", "2.5", "1e1", "1_0"]
count_texts = st.sampled_from(
    [*COUNT_TEXTS, "0x2", "", "two", "\u0663", "Infinity", "16", "17", "4294967295", "4294967296"]
)


def mostly(good: st.SearchStrategy) -> st.SearchStrategy:
    """The plausible value three times in four, anything at all otherwise."""
    return st.one_of(good, good, good, json_values)


def some_keys(**keys: st.SearchStrategy) -> st.SearchStrategy[dict]:
    """Dicts holding any subset of ``keys``; now and then one key more, misspelt or unknown."""
    extra = st.dictionaries(
        st.sampled_from(["gpus", "Count", "device_ids", "deviceIds", "x"]),
        json_values,
        min_size=1,
        max_size=1,
    )
    return st.fixed_dictionaries({}, optional=keys).flatmap(
        lambda d: st.one_of(st.just(d), st.just(d), st.just(d), extra.map(d.__or__))
    )


counts = st.one_of(
    st.integers(-1, 4), st.integers(0, 2**33), st.sampled_from([2.0, 1e2, 1.5, True]), count_texts
)
gpu_blocks = mostly(some_keys(count=mostly(counts)))
vm_blocks = mostly(some_keys(gpu_device_ids=mostly(id_lists)))
driver_configs = mostly(
    st.fixed_dictionaries({}, optional={"vm": vm_blocks, "docker": json_values})
)
openshell_specs = some_keys(
    resource_requirements=mostly(some_keys(gpu=gpu_blocks)),
    resourceRequirements=mostly(some_keys(gpu=gpu_blocks)),
    template=mostly(
        some_keys(
            driver_config=driver_configs, driverConfig=driver_configs, image=st.just("minimal")
        )
    ),
    log_level=st.just("info"),
    gpu=st.booleans(),
    gpu_device=device_ids,
    gpuDevice=device_ids,
)


@DIFFERENTIAL
@given(st.one_of(openshell_specs, openshell_specs, openshell_specs, json_values))
def test_openshell_generated(oracles: Callable[[str], Oracle], spec: object) -> None:
    event(check(oracles, "openshell", spec))


limit_values = st.one_of(
    count_texts, st.sampled_from(["all", " ALL ", "all gpus", "\u2003all"]), json_values
)
opensandbox_limits = st.one_of(
    st.fixed_dictionaries(
        {},
        optional={
            "gpu": limit_values,
            "nvidia.com/gpu": limit_values,
            "amd.com/gpu": limit_values,
            "cpu": st.sampled_from(["2", 2]),
            "GPU": st.just("1"),
        },
    ),
    json_values,
)


@DIFFERENTIAL
@given(opensandbox_limits)
def test_opensandbox_generated(oracles: Callable[[str], Oracle], limits: object) -> None:
    # None is how a caller says there is no resourceLimits, as for a pooled sandbox.
    event(check(oracles, "opensandbox", limits, absent=limits is None))


enabled_values = st.one_of(
    st.booleans(),
    st.sampled_from([0, 1, 2, 0.0, 1.0, None, "true", "false", "YES", "no", "on", "", " t"]),
)
vendors = st.sampled_from(["nvidia", " AMD ", "amd", "intel", "", None, 1])
tako_counts = st.one_of(st.integers(-1, 17), count_texts, st.sampled_from([2.0, 2.5, True]))
tako_blocks = st.one_of(
    some_keys(
        enabled=mostly(enabled_values),
        vendor=mostly(vendors),
        count=mostly(tako_counts),
        device_ids=mostly(id_lists),
    ),
    st.fixed_dictionaries(
        {"enabled": st.just(True), "vendor": st.sampled_from(["nvidia", " AMD "])},
        optional={"count": tako_counts, "device_ids": st.one_of(id_lists, st.none())},
    ),
    json_values,
)


@DIFFERENTIAL
@given(tako_blocks)
def test_tako_generated(oracles: Callable[[str], Oracle], block: object) -> None:
    event(check(oracles, "tako", block, absent=block is None))


# Whole job types through from_dict: well-typed values, so the legacy keys are what varies.
tako_job_fields = {
    "enabled": st.booleans(),
    "vendor": st.sampled_from(["nvidia", "amd", None]),
    "count": st.one_of(st.integers(1, 3), st.none()),
    "device_ids": st.lists(st.sampled_from([A, B, "0", "1"]), max_size=2, unique=True),
}
tako_jobs = st.fixed_dictionaries(
    {"name": st.just("job")},
    optional={
        "gpu": st.fixed_dictionaries({}, optional=tako_job_fields),
        **{f"gpu_{key}": value for key, value in tako_job_fields.items()},
    },
)


@DIFFERENTIAL
@given(tako_jobs)
def test_tako_job_generated(oracles: Callable[[str], Oracle], job: dict) -> None:
    event(check(oracles, "tako_job", job))


# FlowMesh's model types the block (count an integer, type a string, memory a string or a
# number): the oracle restates the worker's rule on blocks of that shape.
memories = st.one_of(
    st.sampled_from(["80Gi", "80 gib", "80gb", "512Mi", "1kB", "0", "0Gi", "80", "", "  "]),
    st.sampled_from(["1.5Gi", "80B", "1Pi", "lots", "-1G", "80\u212a", "\n80G"]),
    st.integers(-1, 2**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.none(),
)
flowmesh_blocks = st.one_of(
    st.fixed_dictionaries(
        {},
        optional={
            "count": st.one_of(st.integers(-2, 4), st.none()),
            "type": st.one_of(
                st.sampled_from(["H100", "a100-sxm4-80gb", "any", "AUTO", "", " * ", "--"]),
                st.none(),
            ),
            "memory": memories,
        },
    ),
    st.none(),
)


@DIFFERENTIAL
@given(flowmesh_blocks)
def test_flowmesh_generated(oracles: Callable[[str], Oracle], block: object) -> None:
    event(check(oracles, "flowmesh", block))


@DIFFERENTIAL
@given(
    gpu=st.one_of(st.none(), st.integers(-1, 8)),
    gpu_memory=st.one_of(st.none(), st.sampled_from(["40Gi", "80GB", "512Mi", "80G"])),
)
def test_flowmesh_cli_blocks_read_as_asked(
    oracles: Callable[[str], Oracle], gpu: int | None, gpu_memory: str | None
) -> None:
    """What ``flowmesh ssh --gpu N --gpu-memory M`` writes, vmsandbox reads as N GPUs of M."""
    block = oracles("flowmesh").ask("flowmesh_cli", {"gpu": gpu, "gpu_memory": gpu_memory})
    request = flowmesh.gpu_request(block["block"])
    if not gpu or gpu <= 0:
        assert request is None
        return
    assert request is not None and request.count == gpu
    expected = flowmesh.gpu_request({"memory": gpu_memory}) if gpu_memory else None
    assert request.min_memory_mib == (expected.min_memory_mib if expected else None)


# --- the compatibility page's examples -------------------------------------------------------


def describe_ours(adapter: Callable[[Any], GpuRequest | None], value: object) -> str:
    """vmsandbox's answer in the page's words."""
    try:
        request = adapter(value)
    except InvalidArgument as err:
        return f"refused ({err.details['field']})"
    return fields.describe(request)


def _gpus(count: int | None, vendor: str | None = None) -> str:
    vendor = f"{vendor} " if vendor else ""
    return f"{count} {vendor}GPU{'s' if count != 1 else ''}"


def describe_platform(handler: str, answer: dict[str, Any]) -> str:
    """A platform's answer in the page's words."""
    if handler == "openshell":
        if "refused" in answer:
            return f"refused ({answer['refused']}: {_openshell_why(answer['why'])})"
        if not answer["gpu"]:
            return "no GPU"
        text = _gpus(answer["count"] or 1)
        if answer["device_ids"]:
            text += ": " + ", ".join(answer["device_ids"])
        if answer["vm_driver_limit"]:
            text = f"{answer['count']} GPUs asked; the VM driver refuses more than one"
        return text
    if handler == "opensandbox":
        if answer["status"] == 422:
            return "422"
        docker, k8s = answer["docker"], answer["k8s"]
        if docker["status"] != 200:
            docker_says = str(docker["status"])
        elif docker["gpu"] is None:
            docker_says = "no GPU"
        else:
            docker_says = "every GPU" if docker["gpu"] == -1 else _gpus(docker["gpu"], "nvidia")
        if k8s["status"] != 200:
            k8s_says = str(k8s["status"])
        else:
            limits = {k: v for k, v in k8s["limits"].items() if k not in ("cpu", "memory")}
            k8s_says = ", ".join(f"{k}={v}" for k, v in limits.items()) or "no GPU"
            if set(limits) - {"nvidia.com/gpu", "amd.com/gpu"}:
                k8s_says += " (an unknown resource)"
        return f"Docker: {docker_says}; Kubernetes: {k8s_says}"
    if handler in ("tako", "tako_job"):
        return "; ".join(f"{name}: {_tako_says(reader)}" for name, reader in answer.items())
    if handler == "flowmesh":
        verdict = flowmesh_verdict(answer)
        if verdict == REFUSED:
            return "refused"
        if verdict.kind != "gpus":
            return "no GPU"
        if verdict.every:
            return "every GPU"
        text = _gpus(verdict.count)
        if answer["type"]:
            text += f", type {answer['type']}"
        if answer["min_memory_bytes"] is not None:
            minimum = answer["min_memory_bytes"]
            text += f", >= {minimum} byte{'s' if minimum != 1 else ''}"
        return text
    raise AssertionError(handler)


def _openshell_why(why: str) -> str:
    """The innermost reason of a refusal, without json_format's nesting and location."""
    if "has no field named" in why:
        return "no field named " + why.split('has no field named "')[1].split('"')[0]
    if "expected string" in why:
        return why.split("Failed to parse ")[1].split(" field")[0] + " must be a string"
    text = why.removeprefix("ParseError: ")
    while text.startswith("Failed to parse ") and "field: " in text:
        text = text.split("field: ", 1)[1]
    return text.split(" at ")[0].rstrip(".")


def _tako_says(reader: dict[str, Any]) -> str:
    if not reader["ok"]:
        if "only supported for gpu.vendor" in reader["why"]:
            return "refused (count is only supported for nvidia)"
        return "refused"
    verdict = tako_reading(reader)
    if verdict.kind == "none":
        return "no GPU"
    if reader["device_ids"]:
        return "GPUs " + ", ".join(reader["device_ids"])
    if reader["count"] is not None:
        return _gpus(reader["count"], reader["vendor"])
    return f"every {reader['vendor']} GPU"


@pytest.mark.parametrize(
    "example", [ex for row in fields.FIELDS for ex in row.examples], ids=lambda ex: repr(ex.given)
)
def test_compatibility_page_examples(
    oracles: Callable[[str], Oracle], example: fields.Example
) -> None:
    """Each example on the page reads there as both sides really answer it."""
    platform = PLATFORMS[example.platform]
    answer = oracles(platform.name).ask(platform.oracle, example.given)
    assert describe_platform(platform.oracle, answer) == example.platform_says
    assert describe_ours(platform.adapter, example.given) == example.vmsandbox_says
    judge(platform, example.given, answer)


def test_compatibility_page_lists_every_intended_difference() -> None:
    named = {row.differs for row in fields.FIELDS if row.differs}
    assert named == {difference.name for difference in INTENDED}


def test_compatibility_page_is_current() -> None:
    """docs/compatibility.md is what docs/gen_compat.py writes from vmsandbox.compat.fields."""
    generated = subprocess.run(
        [sys.executable, str(REPO / "docs" / "gen_compat.py"), "--stdout"],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    ).stdout
    page = (REPO / "docs" / "compatibility.md").read_text()
    assert page == generated, "docs/compatibility.md is stale: run python docs/gen_compat.py"
