"""What the command modules beside commands.py share: a manager for one command, and the shape
of the output object each handler is given (commands.Output)."""

from __future__ import annotations

from typing import Any, Protocol


class Out(Protocol):
    """A command's output: text for people, or JSON with ``--json`` (commands.Output)."""

    json: bool

    def result(self, data: Any, text: str) -> None: ...

    def error(self, exc: Any, **extra: Any) -> None: ...


def manager(*, progress: bool = False, reconcile: bool = False) -> Any:
    """A SandboxManager for one command; ``reconcile`` only for the commands that repair
    (create, pool, reconcile): reading and using commands never delete."""
    from vmsandbox.progress import StderrProgress, silent
    from vmsandbox.sandbox.manager import SandboxManager

    return SandboxManager(progress=StderrProgress() if progress else silent, reconcile=reconcile)
