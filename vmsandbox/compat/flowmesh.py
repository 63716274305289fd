"""FlowMesh: a job's ``resources.hardware.gpu`` block, ``{count, type, memory}``.

- No block (None): no GPU. A block with no fields set: one GPU.
- ``count``: an integer. 0 means no GPU (``type`` and ``memory`` are still checked, then moot);
  negative is rejected; omitted or null means one GPU.
- ``type``: "", "any", "auto" or "*" (any case) accept any model; anything else is a model
  filter matched on whole words, so "A10" does not pick an A100 (FlowMesh's substring match
  does).
- ``memory``: a minimum per GPU, by FlowMesh's own rule: every unit is binary (80G = 80GB =
  80Gi = 80GiB = 80 x 2^30 bytes), integers and whole floats are bytes, and 0 means no
  constraint. Anything else is rejected with examples.
- Unknown keys are rejected, not dropped.
"""

from __future__ import annotations

from collections.abc import Mapping

from vmsandbox.compat._wire import optional_mapping, optional_str, reject_unknown_keys
from vmsandbox.gpuquery import bytes_to_mib, normalise_model, parse_memory_quantity, require_count
from vmsandbox.spec import GpuRequest

_FIELD = "resources.hardware.gpu"
_KNOWN = frozenset({"count", "type", "memory"})
_ANY_MODEL = ("", "any", "auto", "*")


def gpu_request(gpu: Mapping[str, object] | None) -> GpuRequest | None:
    """The GpuRequest of a FlowMesh GPU block; None when it asks for no GPU."""
    block = optional_mapping(gpu, _FIELD)
    if block is None:
        return None
    reject_unknown_keys(block, _KNOWN, _FIELD)
    raw_count = block.get("count")
    no_gpu = type(raw_count) is int and raw_count == 0
    count = None if raw_count is None or no_gpu else require_count(raw_count, f"{_FIELD}.count")
    model = _model(block.get("type"))
    min_memory_mib = _memory_mib(block.get("memory"))
    if no_gpu:
        return None
    return GpuRequest(count=count, model=model, min_memory_mib=min_memory_mib)


def _model(value: object) -> str | None:
    field = f"{_FIELD}.type"
    text = optional_str(value, field)
    if text is None or text.strip().casefold() in _ANY_MODEL:
        return None
    return normalise_model(text, field)


def _memory_mib(value: object) -> int | None:
    if value is None:
        return None
    size = parse_memory_quantity(value, f"{_FIELD}.memory", binary_units=True, allow_zero=True)
    return bytes_to_mib(size) if size else None
