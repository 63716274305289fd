"""OpenShell's GPU fields: a ``SandboxSpec`` in proto3 JSON, as ``openshell`` 0.1.5 reads it."""

from __future__ import annotations

from vmsandbox.compat.fields.model import A, Row, examples

_RR = "resource_requirements"
_IDS = "template.driver_config.vm.gpu_device_ids"


def _vm(ids: object, gpu: object = None) -> dict[str, object]:
    spec: dict[str, object] = {"template": {"driver_config": {"vm": {"gpu_device_ids": ids}}}}
    if gpu is not None:
        spec[_RR] = {"gpu": gpu}
    return spec


ROWS: tuple[Row, ...] = (
    Row(
        "openshell",
        "field names",
        "json_format takes each field by its proto name or its proto3 JSON name; a key that is "
        "neither is refused",
        "the same, at every level of the spec",
        examples(
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
        examples(
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
        examples(
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
        examples(
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
        examples(
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
        examples(
            "openshell",
            (_vm(["41:00.0"], {}), "1 GPU: 41:00.0", f"1 GPU: {A}"),
            (
                _vm(None, {}),
                "refused (vm driver: invalid vm driver_config: expected a sequence)",
                f"refused ({_IDS})",
            ),
            (
                _vm([A]),
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
        examples(
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
        examples(
            "openshell",
            (
                {"gpu": True, "gpu_device": "41:00.0"},
                "refused (json_format: no field named gpu)",
                f"1 GPU: {A}",
            ),
        ),
        differs="openshell-earlier-spec",
    ),
    Row(
        "openshell",
        "other fields (`log_level`, `environment`, `policy`, ...)",
        "json_format checks their values",
        "names checked, values left to their own readers",
        examples(
            "openshell",
            (
                {"log_level": 5, _RR: {"gpu": {}}},
                "refused (json_format: log_level must be a string)",
                "1 GPU",
            ),
        ),
        differs="openshell-other-fields-not-read",
    ),
)
