"""A pooled guest on the in-memory hypervisor: made by the pool's fill steps, without waiting for
SSH (there is no guest)."""

from __future__ import annotations

from vmsandbox.sandbox import runner
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.sandbox.pool.shapes import shape_spec
from vmsandbox.sandbox.pool.steps import FILL_STEPS


def pooled_guest(manager: SandboxManager) -> str:
    """A pooled guest made by the fill steps, without waiting for SSH (there is no guest)."""
    shape = manager.config.pool[0]
    spec = shape_spec(shape)
    assert spec.name is not None
    creation = manager.pool.creation(spec, spec.name, manager.images.get("tiny"), print)
    creation.wait = False
    creation.pool_key = shape.key
    runner.run(FILL_STEPS, creation, manager.locked, manager.checkpoint)
    return spec.name
