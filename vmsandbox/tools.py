"""Running the host tools vmsandbox drives (qemu-img, genisoimage, mkfs.ext4, mmdebstrap).

One way to run a tool and turn its failure into a clear error, and one way to have a tool
write a file: into ``<file>.partial`` (created with the final mode before the tool writes, so a
private file is never readable by others, not even half-written), then renamed over the file,
so a reader never sees half a file and a crash leaves only a ``.partial`` that cleanup knows.
vmsandbox's own small records go the same way (``write_json``).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from vmsandbox.errors import FailedPrecondition, VmSandboxError
from vmsandbox.progress import Progress

STDERR_TAIL = 2000
STREAM_TAIL = 25


def run_tool(
    command: Sequence[str], *, error: type[VmSandboxError] = VmSandboxError, what: str = ""
) -> str:
    """``command``'s stdout. A tool that cannot be started is FAILED_PRECONDITION; one that
    fails raises ``error`` with ``what`` (or the tool's name), its exit status and stderr."""
    try:
        done = subprocess.run(list(command), capture_output=True, text=True, check=False)
    except OSError as exc:
        raise FailedPrecondition(f"cannot run {command[0]}: {exc}") from exc
    if done.returncode != 0:
        raise error(
            f"{what or command[0] + ' failed'} (exit {done.returncode}): "
            f"{done.stderr.strip()[-STDERR_TAIL:]}"
        )
    return done.stdout


def write_with_tool(
    path: Path,
    command: Callable[[Path], Sequence[str]],
    *,
    mode: int = 0o600,
    error: type[VmSandboxError] = FailedPrecondition,
    what: str = "",
) -> None:
    """Have the tool ``command(partial)`` write ``path`` through ``path.partial`` (see above)."""
    partial = path.with_name(path.name + ".partial")
    try:
        os.close(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode))
        os.chmod(partial, mode)  # O_CREAT's mode is masked by the umask; the file is still empty
        run_tool(command(partial), error=error, what=what or f"cannot write {path}")
        os.chmod(partial, mode)  # in case the tool made the file anew
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def run_streaming(
    command: Sequence[str], progress: Progress, *, message: Callable[[str], str | None]
) -> None:
    """Run ``command``, passing ``message(line)`` of each output line to ``progress`` unless it
    is None; on failure raise with the last lines of its output."""
    tail: list[str] = []
    try:
        proc = subprocess.Popen(
            list(command),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )
    except OSError as exc:
        raise FailedPrecondition(f"cannot run {command[0]}: {exc}") from exc
    with proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip()
            if not line:
                continue
            tail = [*tail[-STREAM_TAIL * 2 :], line]
            if (text := message(line)) is not None:
                progress(text)
    if proc.returncode != 0:
        raise VmSandboxError(
            f"{command[0]} failed (exit {proc.returncode}):\n" + "\n".join(tail[-STREAM_TAIL:])
        )


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as one line of JSON to ``path`` (0600, its folder made 0700) through
    ``<stem>.partial``: readers see the old record or the new one. An OSError is the caller's
    to word; the partial file is gone by then."""
    partial = path.with_suffix(".partial")
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(json.dumps(data) + "\n")
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
