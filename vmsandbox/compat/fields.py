"""The compatibility facts, as data: per platform, each GPU field, what the platform does with
it and what vmsandbox does, with examples.

docs/gen_compat.py writes docs/compatibility.md from this table, and
tests/test_compat_platforms.py runs every example through the platform's own released code and
through the adapter, so each example on the page reads as both sides really answer it. A row
whose ``differs`` is set is one of the intended differences that test lists and asserts.
"""

from __future__ import annotations

from dataclasses import dataclass

from vmsandbox.spec import GpuRequest

# How the page names each platform key; "tako_job" is Tako's reader of a whole job type.
TITLES = {
    "openshell": (
        "OpenShell (`compat.openshell`, a `SandboxSpec` in proto3 JSON; `openshell` 0.1.5)"
    ),
    "opensandbox": (
        "OpenSandbox (`compat.opensandbox`, `resourceLimits`; `opensandbox-server` 1.1.1)"
    ),
    "tako": "Tako (`compat.tako`, a job type's `gpu`; `tako-vm` 0.3.0)",
    "tako_job": "Tako job types (`compat.tako.job_type_gpu_request`; `tako-vm` 0.3.0)",
    "flowmesh": (
        "FlowMesh (`compat.flowmesh`, `resources.hardware.gpu`; `flowmesh` 0.1.13 and the "
        "worker in mlsys-io/FlowMesh 7d2a77ac)"
    ),
}


@dataclass(frozen=True)
class Example:
    """One input (as decoded JSON) and each side's answer, in the page's words."""

    platform: str
    given: object
    platform_says: str
    vmsandbox_says: str


@dataclass(frozen=True)
class Row:
    """One field of one platform."""

    platform: str
    field: str
    platform_does: str
    vmsandbox_does: str
    examples: tuple[Example, ...]
    differs: str | None = None  # the intended difference's name in the test's table


def describe(request: GpuRequest | None) -> str:
    """A GpuRequest in the page's words: "no GPU", "2 nvidia GPUs", "1 GPU: 0000:41:00.0"."""
    if request is None:
        return "no GPU"
    vendor = f"{request.vendor} " if request.vendor else ""
    if request.all:
        text = f"every {vendor}GPU"
    else:
        count = request.count or len(request.devices) or 1
        text = f"{count} {vendor}GPU{'s' if count != 1 else ''}"
    if request.devices:
        text += ": " + ", ".join(request.devices)
    if request.model:
        text += f", model {request.model}"
    if request.min_memory_mib:
        text += f", >= {request.min_memory_mib} MiB"
    return text


def _examples(platform: str, *cases: tuple[object, str, str]) -> tuple[Example, ...]:
    return tuple(Example(platform, given, says, ours) for given, says, ours in cases)


_RR = "resource_requirements"
_IDS = "template.driver_config.vm.gpu_device_ids"
_A = "0000:41:00.0"


def _vm(ids: object, gpu: object = None) -> dict[str, object]:
    spec: dict[str, object] = {"template": {"driver_config": {"vm": {"gpu_device_ids": ids}}}}
    if gpu is not None:
        spec[_RR] = {"gpu": gpu}
    return spec


FIELDS: tuple[Row, ...] = (
    # --- OpenShell ---
    Row(
        "openshell",
        "field names",
        "json_format takes each field by its proto name or its proto3 JSON name; a key that is "
        "neither is refused",
        "the same, at every level of the spec",
        _examples(
            "openshell",
            (
                {"resourceRequirements": {"gpu": {"count": 2}}},
                "2 GPUs asked; the VM driver refuses more than one",
                "2 GPUs",
            ),
            (
                {_RR: {"gpus": {"count": 2}}},
                "refused (json_format: no field named gpus)",
                f"refused ({_RR})",
            ),
        ),
    ),
    Row(
        "openshell",
        f"`{_RR}.gpu`",
        "present, even `{}`, asks for GPUs; `null` or absent: no GPU",
        "the same",
        _examples(
            "openshell",
            ({_RR: {"gpu": {}}}, "1 GPU", "1 GPU"),
            ({_RR: {"gpu": None}}, "no GPU", "no GPU"),
        ),
    ),
    Row(
        "openshell",
        f"`{_RR}.gpu.count`",
        "a uint32 as json_format reads it (a number with no fraction, or a string such as "
        '`"2"`, `"1e2"`); omitted: 1; 0 refused by the gateway',
        "the same",
        _examples(
            "openshell",
            (
                {_RR: {"gpu": {"count": 1e2}}},
                "100 GPUs asked; the VM driver refuses more than one",
                "100 GPUs",
            ),
            ({_RR: {"gpu": {"count": "1"}}}, "1 GPU", "1 GPU"),
            (
                {_RR: {"gpu": {"count": 0}}},
                "refused (gateway: gpu count must be greater than 0)",
                f"refused ({_RR}.gpu.count)",
            ),
            (
                {_RR: {"gpu": {"count": " 1"}}},
                'refused (json_format: Couldn\'t parse integer: " 1")',
                f"refused ({_RR}.gpu.count)",
            ),
        ),
    ),
    Row(
        "openshell",
        "more than one GPU",
        "the gateway passes the count on; OpenShell's VM driver refuses more than one",
        "as many GPUs as asked for",
        _examples(
            "openshell",
            (
                {_RR: {"gpu": {"count": 4}}},
                "4 GPUs asked; the VM driver refuses more than one",
                "4 GPUs",
            ),
        ),
        differs="openshell-more-than-one-gpu",
    ),
    Row(
        "openshell",
        "`template.driver_config.vm`",
        "the gateway passes the `vm` block to the VM driver; it must be an object and holds "
        "only `gpu_device_ids`",
        "the same",
        _examples(
            "openshell",
            (
                {"template": {"driver_config": {"vm": None}}},
                "refused (gateway: template.driver_config.vm must be an object)",
                "refused (template.driver_config.vm)",
            ),
        ),
    ),
    Row(
        "openshell",
        f"`{_IDS}`",
        "a non-empty list of non-blank strings, no repeats; needs a GPU request whose count "
        "(1 when omitted) equals their number",
        "the same",
        _examples(
            "openshell",
            (_vm(["41:00.0"], {}), "1 GPU: 41:00.0", f"1 GPU: {_A}"),
            (
                _vm(None, {}),
                "refused (vm driver: invalid vm driver_config: expected a sequence)",
                f"refused ({_IDS})",
            ),
            (
                _vm([_A]),
                "refused (vm driver: driver_config.gpu_device_ids requires a gpu request)",
                f"refused ({_IDS})",
            ),
        ),
    ),
    Row(
        "openshell",
        "device ids vmsandbox cannot resolve",
        "passed to the VM driver, which fails to start the sandbox",
        "refused: an id must be a PCI address, an NVIDIA or ROCm UUID, a DRM card name or an "
        "inventory index, and name a GPU once",
        _examples(
            "openshell",
            (_vm(["gpu0"], {}), "1 GPU: gpu0", f"refused ({_IDS})"),
        ),
        differs="openshell-device-ids-resolve",
    ),
    Row(
        "openshell",
        "`gpu`, `gpu_device` (the spec before 2c545893 and 1dc59853)",
        "not fields of the spec: refused",
        "read: `gpu: true` asks for one GPU, `gpu_device` (with `gpu: true`) names it",
        _examples(
            "openshell",
            (
                {"gpu": True, "gpu_device": "41:00.0"},
                "refused (json_format: no field named gpu)",
                f"1 GPU: {_A}",
            ),
        ),
        differs="openshell-earlier-spec",
    ),
    Row(
        "openshell",
        "other fields (`log_level`, `environment`, `policy`, ...)",
        "json_format checks their values",
        "names checked, values left to their own readers",
        _examples(
            "openshell",
            (
                {"log_level": 5, _RR: {"gpu": {}}},
                "refused (json_format: log_level must be a string)",
                "1 GPU",
            ),
        ),
        differs="openshell-other-fields-not-read",
    ),
    # --- OpenSandbox ---
    Row(
        "opensandbox",
        "`resourceLimits` values",
        "strings only: anything else, `null` included, is the request model's 422",
        "refused",
        _examples(
            "opensandbox",
            ({"gpu": None}, "422", 'refused (resourceLimits["gpu"])'),
            ({"cpu": 2, "gpu": "1"}, "422", 'refused (resourceLimits["cpu"])'),
        ),
    ),
    Row(
        "opensandbox",
        "`gpu`",
        'Docker: `"N"` (as Python\'s `int()` reads it) asks for N NVIDIA GPUs, `"all"` for '
        'every GPU, anything else (`""`, `"0"`, `"1.5"`) is a 400; Kubernetes: N goes on as '
        '`nvidia.com/gpu`, `"all"` is a 400, anything else is dropped',
        "as Docker reads it",
        _examples(
            "opensandbox",
            (
                {"gpu": " 2 "},
                "Docker: 2 nvidia GPUs; Kubernetes: nvidia.com/gpu=2",
                "2 nvidia GPUs",
            ),
            ({"gpu": "all"}, "Docker: every GPU; Kubernetes: 400", "every nvidia GPU"),
            ({"gpu": ""}, "Docker: 400; Kubernetes: no GPU", 'refused (resourceLimits["gpu"])'),
            ({"gpu": "0"}, "Docker: 400; Kubernetes: no GPU", 'refused (resourceLimits["gpu"])'),
        ),
    ),
    Row(
        "opensandbox",
        "`nvidia.com/gpu`, `amd.com/gpu`",
        "Docker ignores them; Kubernetes passes the string on as an extended resource",
        "that vendor's GPUs; the value must be a whole number, as Kubernetes requires",
        _examples(
            "opensandbox",
            (
                {"nvidia.com/gpu": "2"},
                "Docker: no GPU; Kubernetes: nvidia.com/gpu=2",
                "2 nvidia GPUs",
            ),
            (
                {"amd.com/gpu": "all"},
                "Docker: no GPU; Kubernetes: amd.com/gpu=all",
                'refused (resourceLimits["amd.com/gpu"])',
            ),
        ),
        differs="opensandbox-vendor-keys",
    ),
    Row(
        "opensandbox",
        "`gpu` with a vendor key",
        "Docker reads `gpu` only; Kubernetes writes `gpu`'s count over `nvidia.com/gpu`",
        "accepted when both ask for the same NVIDIA GPUs, else refused",
        _examples(
            "opensandbox",
            (
                {"gpu": "2", "nvidia.com/gpu": "2"},
                "Docker: 2 nvidia GPUs; Kubernetes: nvidia.com/gpu=2",
                "2 nvidia GPUs",
            ),
            (
                {"gpu": "1", "nvidia.com/gpu": "2"},
                "Docker: 1 nvidia GPU; Kubernetes: nvidia.com/gpu=1",
                'refused (resourceLimits["gpu"])',
            ),
        ),
        differs="opensandbox-gpu-and-vendor-key",
    ),
    Row(
        "opensandbox",
        "keys that differ from a GPU key in case or spaces",
        "Docker ignores them; Kubernetes takes them as unknown resources",
        "refused as a likely typo",
        _examples(
            "opensandbox",
            (
                {"GPU": "1"},
                "Docker: no GPU; Kubernetes: GPU=1 (an unknown resource)",
                'refused (resourceLimits["GPU"])',
            ),
        ),
        differs="opensandbox-typo-key",
    ),
    # --- Tako: both readers ---
    Row(
        "tako",
        "`enabled`",
        'the config model reads a bool (also 0/1 and words such as "yes", "false"); '
        '`from_dict` reads `bool(value)`, so "false" is true there',
        'taken where both readers agree; `null` and "false"-like strings refused',
        _examples(
            "tako",
            (
                {"enabled": "yes", "vendor": "nvidia"},
                "config: every nvidia GPU; from_dict: every nvidia GPU",
                "every nvidia GPU",
            ),
            (
                {"enabled": "false", "vendor": "nvidia"},
                "config: refused; from_dict: every nvidia GPU",
                "refused (gpu.enabled)",
            ),
        ),
    ),
    Row(
        "tako",
        "`vendor`",
        'required when enabled: "nvidia" or "amd" after trimming and lower-casing',
        "the same",
        _examples(
            "tako",
            (
                {"enabled": True, "vendor": " AMD "},
                "config: every amd GPU; from_dict: every amd GPU",
                "every amd GPU",
            ),
            ({"enabled": True}, "config: refused; from_dict: refused", "refused (gpu.vendor)"),
        ),
    ),
    Row(
        "tako",
        "`count`",
        'an integer as pydantic reads it (`2`, `"2"`, `2.0`), 1 to 16, NVIDIA only',
        "the same, also for AMD",
        _examples(
            "tako",
            (
                {"enabled": True, "vendor": "nvidia", "count": "2"},
                "config: 2 nvidia GPUs; from_dict: 2 nvidia GPUs",
                "2 nvidia GPUs",
            ),
            (
                {"enabled": True, "vendor": "nvidia", "count": 17},
                "config: refused; from_dict: refused",
                "refused (gpu.count)",
            ),
        ),
    ),
    Row(
        "tako",
        "`count` with vendor amd",
        "refused: only NVIDIA takes a count",
        "N AMD GPUs: a VM passes them through",
        _examples(
            "tako",
            (
                {"enabled": True, "vendor": "amd", "count": 2},
                "config: refused (count is only "
                "supported for nvidia); from_dict: refused (count is only supported for nvidia)",
                "2 amd GPUs",
            ),
        ),
        differs="tako-amd-count",
    ),
    Row(
        "tako",
        "`device_ids`",
        "a list of up to 16 strings, none empty or with a comma, no repeats; `[]` means not "
        "set; `null` is refused by both readers",
        "the same",
        _examples(
            "tako",
            (
                {"enabled": True, "vendor": "nvidia", "device_ids": ["41:00.0"]},
                "config: GPUs 41:00.0; from_dict: GPUs 41:00.0",
                f"1 nvidia GPU: {_A}",
            ),
            (
                {"enabled": True, "vendor": "nvidia", "device_ids": None},
                "config: refused; from_dict: refused",
                "refused (gpu.device_ids)",
            ),
        ),
    ),
    Row(
        "tako",
        "device ids vmsandbox cannot resolve",
        "passed to the container runtime, which fails to start the job",
        "refused before anything is allocated",
        _examples(
            "tako",
            (
                {"enabled": True, "vendor": "nvidia", "device_ids": ["gpu0"]},
                "config: GPUs gpu0; from_dict: GPUs gpu0",
                "refused (gpu.device_ids)",
            ),
        ),
        differs="tako-device-ids-resolve",
    ),
    Row(
        "tako",
        "the shipped default block",
        "no GPU",
        "no GPU",
        _examples(
            "tako",
            (
                {"enabled": False, "vendor": None, "count": None, "device_ids": []},
                "config: no GPU; from_dict: no GPU",
                "no GPU",
            ),
        ),
    ),
    # --- Tako job types: from_dict ---
    Row(
        "tako_job",
        "legacy `gpu_enabled`, `gpu_vendor`, `gpu_count`, `gpu_device_ids`",
        "stand for the keys of `gpu` and win over them",
        "read the same; one that disagrees with the same key in `gpu` is refused",
        _examples(
            "tako_job",
            (
                {"name": "job", "gpu_enabled": True, "gpu_vendor": "nvidia", "gpu_count": 2},
                "from_dict: 2 nvidia GPUs",
                "2 nvidia GPUs",
            ),
            (
                {
                    "name": "job",
                    "gpu_count": 1,
                    "gpu": {"enabled": True, "vendor": "nvidia", "count": 2},
                },
                "from_dict: 1 nvidia GPU",
                "refused (gpu_count)",
            ),
        ),
        differs="tako-job-flat-and-nested",
    ),
    Row(
        "tako_job",
        "`gpu_count` with vendor amd",
        "refused: only NVIDIA takes a count",
        "N AMD GPUs",
        _examples(
            "tako_job",
            (
                {"name": "job", "gpu_enabled": True, "gpu_vendor": "amd", "gpu_count": 2},
                "from_dict: refused (count is only supported for nvidia)",
                "2 amd GPUs",
            ),
        ),
        differs="tako-job-amd-count",
    ),
    Row(
        "tako_job",
        "device ids vmsandbox cannot resolve",
        "passed to the container runtime",
        "refused",
        _examples(
            "tako_job",
            (
                {
                    "name": "job",
                    "gpu": {"enabled": True, "vendor": "nvidia", "device_ids": ["gpu0"]},
                },
                "from_dict: GPUs gpu0",
                "refused (gpu.device_ids)",
            ),
        ),
        differs="tako-job-device-ids-resolve",
    ),
    # --- FlowMesh ---
    Row(
        "flowmesh",
        "no block / a block with no constraint",
        "no block: no GPU; `{}` (or count, type and memory all empty): every GPU of the worker",
        "the same",
        _examples(
            "flowmesh",
            (None, "no GPU", "no GPU"),
            ({}, "every GPU", "every GPU"),
        ),
    ),
    Row(
        "flowmesh",
        "`count`",
        "that many GPUs; 0 means none; omitted with a type or memory: one",
        "the same",
        _examples(
            "flowmesh",
            ({"count": 2}, "2 GPUs", "2 GPUs"),
            ({"count": 0, "type": "H100"}, "no GPU", "no GPU"),
        ),
    ),
    Row(
        "flowmesh",
        "negative `count`",
        "the worker reads it as no GPU",
        "refused",
        _examples(
            "flowmesh",
            ({"count": -1}, "no GPU", "refused (resources.hardware.gpu.count)"),
        ),
        differs="flowmesh-negative-count",
    ),
    Row(
        "flowmesh",
        "`type`",
        'a case-insensitive substring of the GPU name; "", "any", "auto", "*" mean any',
        "a model matched by whole words, so A10 does not pick an A100",
        _examples(
            "flowmesh",
            ({"type": "H100"}, "1 GPU, type h100", "1 GPU, model H100"),
            ({"type": "--"}, "1 GPU, type --", "refused (resources.hardware.gpu.type)"),
        ),
        differs="flowmesh-type-words",
    ),
    Row(
        "flowmesh",
        "`memory`",
        "a minimum per GPU: a whole number and K, M, G or T (optional i and B, any case, all "
        "binary), or a number of bytes; an unreadable string fails the task",
        "the same, rounded up to whole MiB",
        _examples(
            "flowmesh",
            ({"memory": "80 gib"}, "1 GPU, >= 85899345920 bytes", "1 GPU, >= 81920 MiB"),
            ({"memory": "1.5Gi"}, "refused", "refused (resources.hardware.gpu.memory)"),
        ),
    ),
    Row(
        "flowmesh",
        "fractional or negative `memory` numbers",
        "truncated, or a negative minimum that every GPU meets",
        "refused",
        _examples(
            "flowmesh",
            ({"memory": 1.5}, "1 GPU, >= 1 byte", "refused (resources.hardware.gpu.memory)"),
        ),
        differs="flowmesh-memory-number",
    ),
)
