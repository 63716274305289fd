"""The host's end of the GPU hand-over in a guest: ``programs/gpu_quiesce.py`` fed to ``sudo
python3 -`` over SSH, its JSON answer read, its refusals as vmsandbox errors.

``quiesce`` lets the guest's GPUs go before a suspend detaches them (CUDA processes
checkpointed where the image has cuda-checkpoint, the processes still holding a GPU ended
when forced, the driver unloaded); ``revive`` takes up the GPUs a resume attached at the same
guest addresses (driver loaded, checkpointed processes restored onto the new GPUs). Each
returns the program's report (the processes checkpointed, ended and restored, the modules
unloaded and loaded, the map of old GPU UUIDs to new ones).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any

from vmsandbox.errors import FailedPrecondition, Internal
from vmsandbox.guest.ssh import ExecResult

# The program's exit statuses (programs/gpu_quiesce.py).
EXIT_HELD = 3
EXIT_FAILED = 4
TIMEOUT_S = 300.0  # checkpointing a process copies its GPU memory to host memory
Run = Callable[..., ExecResult]


def program() -> bytes:
    """The guest program, as fed to ``python3 -``."""
    return resources.files("vmsandbox.guest.programs").joinpath("gpu_quiesce.py").read_bytes()


def quiesce(run: Run, ids: Sequence[str], *, force: bool, name: str) -> dict[str, Any]:
    """Let the GPU functions of ``ids`` (``vendor:device``) go in the guest of sandbox
    ``name``. FAILED_PRECONDITION naming the processes that hold a GPU (unless ``force``,
    which ends them), or what else failed; the guest keeps its GPUs then."""
    argv = ["quiesce", *(["--force"] if force else []), *ids]
    result = _run(run, argv)
    if result.exit_status == EXIT_HELD:
        held = _report(result, name).get("held", {})
        named = ", ".join(f"{pid} ({command})" for pid, command in held.items())
        raise FailedPrecondition(
            f"sandbox {name!r} cannot be suspended: processes in it use its GPUs: {named}; "
            "end them, or suspend with --force to have them ended",
            details={"name": name, "processes": held},
        )
    return _checked(result, name, "letting its GPUs go")


def revive(run: Run, *, name: str) -> dict[str, Any]:
    """Take up the GPUs attached to the resumed guest of sandbox ``name``;
    FAILED_PRECONDITION saying what failed."""
    return _checked(_run(run, ["revive"]), name, "taking its GPUs up")


def _run(run: Run, argv: Sequence[str]) -> ExecResult:
    """The program run as root with ``argv`` (words without spaces or quotes: verbs, flags
    and hex ids)."""
    return run("sudo -n python3 - " + " ".join(argv), stdin=program(), timeout=TIMEOUT_S)


def _checked(result: ExecResult, name: str, doing: str) -> dict[str, Any]:
    report = _report(result, name)
    if result.exit_status != 0:
        lines = result.stderr.strip().splitlines()
        why = report.get("error") or (lines[-1] if lines else "no reason given")
        raise FailedPrecondition(
            f"sandbox {name!r}: {doing} failed in the guest (exit {result.exit_status}): {why}",
            details={"name": name, "exit_status": result.exit_status},
        )
    return report


def _report(result: ExecResult, name: str) -> dict[str, Any]:
    """The program's JSON answer ({} when it printed none: python3 or sudo failed first)."""
    text = result.stdout.strip()
    if not text:
        return {}
    try:
        report = json.loads(text.splitlines()[-1])
    except ValueError as exc:
        raise Internal(
            f"sandbox {name!r}: the guest's GPU program answered {text[:200]!r}",
            details={"name": name},
        ) from exc
    return report if isinstance(report, dict) else {}
