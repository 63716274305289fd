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
TIMEOUT_S = 300.0
# Checkpointing a process copies its GPU memory to host memory, restoring copies it back: per
# GiB of the sandbox's GPU memory, three times what an H100 took (programs/gpu_quiesce.py).
CHECKPOINT_S_PER_GIB = 2.0
RESTORE_S_PER_GIB = 1.0
Run = Callable[..., ExecResult]


def program() -> bytes:
    """The guest program, as fed to ``python3 -``."""
    return resources.files("vmsandbox.guest.programs").joinpath("gpu_quiesce.py").read_bytes()


def quiesce(
    run: Run, ids: Sequence[str], *, force: bool, name: str, gpu_memory_mib: int = 0
) -> dict[str, Any]:
    """Let the GPU functions of ``ids`` (``vendor:device``) go in the guest of sandbox
    ``name`` (its GPUs' memory, ``gpu_memory_mib``, sets the time limit).
    FAILED_PRECONDITION naming the processes that hold a GPU, with why any of them was not
    checkpointed (unless ``force``, which ends them), or what else failed; the guest keeps
    its GPUs then."""
    argv = ["quiesce", *(["--force"] if force else []), *ids]
    result = _run(run, argv, TIMEOUT_S + CHECKPOINT_S_PER_GIB * gpu_memory_mib / 1024)
    if result.exit_status == EXIT_HELD:
        report = _report(result, name)
        held, why = report.get("held", {}), report.get("why", {})
        named = ", ".join(
            f"{pid} ({command}{': ' + why[pid] if pid in why else ''})"
            for pid, command in held.items()
        )
        raise FailedPrecondition(
            f"sandbox {name!r} cannot be suspended: processes in it use its GPUs: {named}; "
            "end them, or suspend with --force to have them ended",
            details={"name": name, "processes": held, "why": why},
        )
    return _checked(result, name, "letting its GPUs go")


def revive(run: Run, *, name: str, gpu_memory_mib: int = 0) -> dict[str, Any]:
    """Take up the GPUs attached to the resumed guest of sandbox ``name`` (its GPUs'
    memory, ``gpu_memory_mib``, sets the time limit); FAILED_PRECONDITION saying what
    failed."""
    timeout = TIMEOUT_S + RESTORE_S_PER_GIB * gpu_memory_mib / 1024
    return _checked(_run(run, ["revive"], timeout), name, "taking its GPUs up")


def _run(run: Run, argv: Sequence[str], timeout: float) -> ExecResult:
    """The program run as root with ``argv`` (words without spaces or quotes: verbs, flags
    and hex ids)."""
    return run("sudo -n python3 - " + " ".join(argv), stdin=program(), timeout=timeout)


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
