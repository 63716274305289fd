"""Progress reporting for long operations (image builds, boot waits).

A progress sink is any callable taking one line of text. The CLI prints to stderr with the
elapsed time; the Python API defaults to silence.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

Progress = Callable[[str], None]


def silent(_message: str) -> None:
    """Discard progress."""


class StderrProgress:
    """Print ``[  12.3s] message`` lines to stderr, skipping immediate repeats."""

    def __init__(self) -> None:
        self._start = time.monotonic()
        self._last = ""

    def __call__(self, message: str) -> None:
        if message == self._last:
            return
        self._last = message
        print(f"[{time.monotonic() - self._start:6.1f}s] {message}", file=sys.stderr, flush=True)
