"""Running a transition's steps (create.py's ``Step``), and their undos when one fails.

Each step does its work under the host lock (``locked``) or outside it; consecutive locked
steps share one hold of the lock. When a step fails, the undos of the steps that ran (the
failing one included: it may have done half its work) run newest first: the unlocked ones,
then the locked ones under one more hold. A failing undo, and a lock that cannot be had for
the undos, are noted on the error that made the transition fail; that error is the one the
caller sees. GPUs whose reservation the undos dropped are sanitized last, outside the lock
(sandbox/custody.py).
Whatever an undo could not remove is left to reconcile: the transition gives its
owner file up (``vm.process.Ownership``) when it ends, however it ends, so its record and
reservation read as left over at once, also in a process that lives on (``vmsandbox serve``).
A cold create that fails keeps its guest's console log for the user to read (the error names
where: ``record.keep_console_log``) before its undos remove the sandbox's files.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vmsandbox.errors import VmSandboxError
from vmsandbox.sandbox import custody
from vmsandbox.sandbox.holds import own
from vmsandbox.sandbox.record import keep_console_log

if TYPE_CHECKING:
    from vmsandbox.progress import Progress
    from vmsandbox.sandbox.create import Creation, Remains, Step

Lock = Callable[[], contextlib.AbstractContextManager[None]]


def no_checkpoint(_stage: str) -> None:
    """The default crash checkpoint: nothing (tests install one that stops the create)."""


def run(
    steps: tuple[Step, ...], creation: Creation, lock: Lock, checkpoint: Callable[[str], None]
) -> None:
    """Run ``steps``; on any failure undo the ones that ran, newest first, and re-raise.

    ``checkpoint(stage)`` is called each time the lock is taken (``locked``) and after each
    step: the crash tests stop a transition there to kill it.
    """
    if creation.owner is None or not creation.owner.active:
        creation.owner = own(creation.config)
    creation.lock = lock
    done: list[Step] = []
    try:
        index = 0
        while index < len(steps):
            if not steps[index].locked:
                _run_one(steps[index], creation, checkpoint, done)
                index += 1
                continue
            with lock():
                checkpoint("locked")
                while index < len(steps) and steps[index].locked:
                    _run_one(steps[index], creation, checkpoint, done)
                    index += 1
    except BaseException as exc:
        kept = keep_console_log(creation.config, creation.files) if cold(creation) else None
        note(exc, undo(done, creation, lock), creation.progress)
        if kept is not None and isinstance(exc, VmSandboxError):
            exc.message += f"\n(the guest's console log is kept at {kept})"
            exc.details["console_log"] = str(kept)
        raise
    finally:
        creation.owner.end()


def cold(creation: Creation) -> bool:
    """Whether the transition is a cold create (not a pool fill or claim)."""
    return creation.doing == "create"


def _run_one(
    step: Step, creation: Creation, checkpoint: Callable[[str], None], done: list[Step]
) -> None:
    done.append(step)  # before it runs: a step that fails halfway is undone too
    step.do(creation)
    checkpoint(step.name)


def note(exc: BaseException, failures: list[str], progress: Progress) -> None:
    for failure in failures:
        exc.add_note(f"cleanup after the failed create also failed: {failure}")
        progress(f"cleanup failed: {failure}")


def undo(steps: list[Step] | tuple[Step, ...], remains: Remains, lock: Lock) -> list[str]:
    """Run the undos of ``steps`` newest first (unlocked ones before taking the lock, the rest
    under it) and every one even when one fails; return the failures' messages. A lock that
    cannot be had is one failure: the locked undos are then reconcile's."""
    failures: list[str] = []
    hold = remains.mine()  # its GPUs are sanitized once the undos have dropped it
    pending = [step for step in reversed(steps) if step.undo is not None]
    seen: set[Any] = set()

    def run_undo(step: Step) -> None:
        if step.undo in seen:
            return  # one undo serves several steps (the files)
        seen.add(step.undo)
        try:
            assert step.undo is not None
            step.undo(remains)
        except VmSandboxError as exc:
            failures.append(exc.message)
        except OSError as exc:
            failures.append(f"{step.name}: {exc}")

    for step in [step for step in pending if not step.undo_under_lock]:
        run_undo(step)
    locked = [step for step in pending if step.undo_under_lock]
    if locked:
        try:
            with lock():
                for step in locked:
                    run_undo(step)
        except VmSandboxError as exc:  # the lock itself: busy past its timeout
            failures.append(
                f"{exc.message}; sandbox {remains.name!r} is left for reconcile to remove "
                "(its reservation is marked left over)"
            )
    if hold is not None and remains.mine() is None:
        custody.sanitize(remains.config, lock, hold.gpus)
    return failures
