"""FlowMesh: a task's ``resources.hardware.gpu`` block, ``{count, type, memory}``.

Rules read in mlsys-io/FlowMesh: ``src/shared/tasks/components/resources.py`` (the block, extra
keys forbidden), ``src/shared/utils/parsing.py`` (``parse_mem_to_bytes``, at 202106ee),
``src/shared/utils/hardware.py`` (at 6f1ac4c2) and ``src/worker/executors/ssh_session/config.py``
(``_resolve_gpu_devices``, at 7d2a77ac), with tests ``tests/shared/utils/test_hardware.py`` and
``tests/shared/test_spec_uses_gpu.py``. The released ``flowmesh`` package has the CLI that
writes the block but no reader of it: tests/unit/compat/test_compat_platforms.py restates the
worker's rule from those files and checks the adapter against it, and reads back what the CLI
writes.

FlowMesh's verdict, kept:

- No block (None): no GPU. A block with no count, no type and no memory (``{}``, or those
  fields null, ``""`` or 0) takes every GPU of the worker: ``all=True`` here.
- ``count``: that many GPUs; 0 means no GPU (the worker reads no further: ``type`` and
  ``memory`` need only be a string and a string or number). Omitted or null with a type or
  memory given: one GPU.
- ``type``: "", "any", "auto" or "*" (any case, trimmed) accept any model; anything else is a
  model filter.
- ``memory``: a minimum per GPU. A string is a whole number, optional spaces, and an optional
  unit K, M, G or T with optional ``i`` and ``B``, in any case, every unit binary: "80G",
  "80 gib", "80gb" and "80GiB" are all 80 x 2^30 bytes; no unit means bytes. A JSON integer,
  or a float with no fraction, is bytes. "" and 0 mean no minimum, as does "0".
- Unknown keys are rejected (the block forbids extra keys).

Rejected with INVALID_ARGUMENT where FlowMesh silently does something wrong:

- A memory string its parser cannot read ("1.5Gi", "80B", "1Pi", "lots"): FlowMesh's
  dispatcher drops the minimum and places the task anywhere, then the worker fails it.
- A negative or fractional memory number (FlowMesh truncates 1.5 to 1 byte, and -1 drops the
  minimum), NaN and infinities (FlowMesh raises).
- A negative count: the worker reads it as no GPU, the binding executor as every GPU.
- A count that is not a JSON integer ("2", 2.0, true): the two readers above disagree on them.

Deliberately different: ``type`` matches whole words where FlowMesh matches substrings, so
"A10" does not pick an A100.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

from vmsandbox.compat._wire import optional_mapping, optional_str, reject_unknown_keys
from vmsandbox.gpu.request import (
    GpuRequest,
    bytes_to_mib,
    invalid,
    normalise_model,
    require_count,
    shown,
)

_FIELD = "resources.hardware.gpu"
_KNOWN = frozenset({"count", "type", "memory"})
_ANY_MODEL = ("", "any", "auto", "*")
# parse_mem_to_bytes: ASCII digits; \s is any whitespace, as in FlowMesh's (str) pattern. At
# most 4000 digits: int() refuses longer strings (FlowMesh would raise on them).
_MEMORY_RE = re.compile(r"\s*([0-9]{1,4000})\s*(?:([KkMmGgTt])[Ii]?[Bb]?)?\s*")
_UNIT_POWER = {"K": 1, "M": 2, "G": 3, "T": 4}
_MEMORY_ALLOWED = (
    "use a whole number and a unit K, M, G or T (any case, each optionally followed by i and "
    "B; every unit is binary: 80G = 80GB = 80Gi = 80GiB = 80 x 2^30 bytes), such as '40Gi' "
    "or '80GB', or a whole number of bytes"
)


def gpu_request(gpu: Mapping[str, object] | None) -> GpuRequest | None:
    """The GpuRequest of a FlowMesh GPU block; None when it asks for no GPU."""
    block = optional_mapping(gpu, _FIELD)
    if block is None:
        return None
    reject_unknown_keys(block, _KNOWN, _FIELD)
    raw_count = block.get("count")
    no_gpu = type(raw_count) is int and raw_count == 0
    count = None if raw_count is None or no_gpu else require_count(raw_count, f"{_FIELD}.count")
    raw_type = optional_str(block.get("type"), f"{_FIELD}.type")
    raw_memory = block.get("memory")
    if no_gpu:  # the worker stops here: type and memory only need the model's types
        if raw_memory is not None and (
            isinstance(raw_memory, bool) or not isinstance(raw_memory, str | int | float)
        ):
            raise invalid(
                f"{_FIELD}.memory",
                raw_memory,
                f"{_FIELD}.memory {shown(raw_memory)} is not a memory size: {_MEMORY_ALLOWED}",
            )
        return None
    model = _model(raw_type)
    min_memory_mib = _memory_mib(raw_memory)
    if count is None and not raw_type and not _given(raw_memory):
        return GpuRequest(all=True)  # FlowMesh: no constraint at all -> every GPU it has
    return GpuRequest(count=count, model=model, min_memory_mib=min_memory_mib)


def _given(memory: object) -> bool:
    """Whether FlowMesh counts ``memory`` as a constraint: it tests the value's truth."""
    return memory is not None and memory != "" and memory != 0


def _model(text: str | None) -> str | None:
    if text is None or text.strip().casefold() in _ANY_MODEL:
        return None
    return normalise_model(text, f"{_FIELD}.type")


def _memory_bytes(value: object, field: str) -> int:
    """A FlowMesh memory size in bytes (0: no minimum), by ``parse_mem_to_bytes``'s rule."""
    if isinstance(value, str):
        match = _MEMORY_RE.fullmatch(value)
        if match is None:
            raise invalid(
                field, value, f"{field} {shown(value)} is not a memory size: {_MEMORY_ALLOWED}"
            )
        number, unit = match.groups()
        return int(number) * 1024 ** _UNIT_POWER[unit.upper()] if unit else int(number)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise invalid(
            field,
            value,
            f"{field} {shown(value)} is not a memory size: {_MEMORY_ALLOWED}; FlowMesh would "
            "truncate a fraction and ignore a negative size",
        )
    return value


def _memory_mib(value: object) -> int | None:
    if value is None or value == "":
        return None
    size = _memory_bytes(value, f"{_FIELD}.memory")
    return bytes_to_mib(size) if size else None
