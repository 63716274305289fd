"""The compatibility facts, as data: per platform, each GPU field, what the platform does with
it and what vmsandbox does, with examples.

One module per platform, each with its ``ROWS``: ``openshell``, ``opensandbox``, ``tako`` and
``flowmesh``; ``model`` is the shape of a row (``Row``, ``Example``).

docs/gen_compat.py writes docs/compatibility.md from this table, and
tests/unit/compat/test_compat_platforms.py runs every example through the platform's own released
code and through the adapter, so each example on the page reads as both sides really answer it. A
row whose ``differs`` is set is one of the intended differences that test lists and asserts.
"""

from __future__ import annotations

from vmsandbox.compat.fields import flowmesh, opensandbox, openshell, tako
from vmsandbox.compat.fields.model import Example, Row, describe

__all__ = ["FIELDS", "TITLES", "Example", "Row", "describe"]

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

FIELDS: tuple[Row, ...] = (*openshell.ROWS, *opensandbox.ROWS, *tako.ROWS, *flowmesh.ROWS)
