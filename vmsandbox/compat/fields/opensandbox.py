"""OpenSandbox's ``resourceLimits``, as ``opensandbox-server`` 1.1.1 and its runtimes read them."""

from __future__ import annotations

from vmsandbox.compat.fields.model import Row, examples

ROWS: tuple[Row, ...] = (
    Row(
        "opensandbox",
        "`resourceLimits` values",
        "strings only: anything else, `null` included, is the request model's 422",
        "refused",
        examples(
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
        examples(
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
        examples(
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
        examples(
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
        examples(
            "opensandbox",
            (
                {"GPU": "1"},
                "Docker: no GPU; Kubernetes: GPU=1 (an unknown resource)",
                'refused (resourceLimits["GPU"])',
            ),
        ),
        differs="opensandbox-typo-key",
    ),
)
