"""FlowMesh's ``resources.hardware.gpu``, as ``flowmesh`` 0.1.13 writes it and its worker
reads it."""

from __future__ import annotations

from vmsandbox.compat.fields.model import Row, examples

ROWS: tuple[Row, ...] = (
    Row(
        "flowmesh",
        "no block / a block with no constraint",
        "no block: no GPU; `{}` (or count, type and memory all empty): every GPU of the worker",
        "the same",
        examples(
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
        examples(
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
        examples(
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
        examples(
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
        examples(
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
        examples(
            "flowmesh",
            ({"memory": 1.5}, "1 GPU, >= 1 byte", "refused (resources.hardware.gpu.memory)"),
        ),
        differs="flowmesh-memory-number",
    ),
)
