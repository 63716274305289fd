"""Where the time of a create's steps went, for the caller to see (a pool claim reports it)."""

from __future__ import annotations

import time
from collections.abc import Callable


class StepTimes:
    """A crash checkpoint that also times the steps: runner.run calls it once the host lock
    is taken ("locked") and after each step, so the time since the last call is the lock's
    wait or that step's."""

    def __init__(self, checkpoint: Callable[[str], None]) -> None:
        self.checkpoint = checkpoint
        self.seconds: dict[str, float] = {}
        self._last = time.monotonic()

    def __call__(self, stage: str) -> None:
        now = time.monotonic()
        step = "host lock wait" if stage == "locked" else stage
        self.seconds[step] = round(self.seconds.get(step, 0.0) + now - self._last, 4)
        self._last = now
        self.checkpoint(stage)
