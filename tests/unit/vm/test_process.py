"""Owner files (vm/process.py): a process gives its own up when it ends, and the ones that
killed processes left are swept, never one that a live process keeps or has just made
(issue 42, point 9: ``owners/`` kept a file per finished ``vmsandbox start`` for ever)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from vmsandbox.vm import process


def test_a_process_that_ends_gives_its_owner_file_up(tmp_path: Path) -> None:
    code = (
        "import sys; from pathlib import Path; from vmsandbox.vm.process import process_owner; "
        "print(process_owner(Path(sys.argv[1])).owner)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True
    )
    assert done.stdout.strip().startswith(str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_the_sweep_removes_only_old_files_nobody_locks(tmp_path: Path) -> None:
    live = process.Ownership(tmp_path)
    dead = tmp_path / "0123456789abcdef"
    dead.touch()
    young = tmp_path / "fedcba9876543210"
    young.touch()
    old = time.time() - process.SWEEP_AGE_S - 5
    for path in (live.path, dead):
        os.utime(path, (old, old))
    process.sweep_owner_files(tmp_path)
    assert sorted(tmp_path.iterdir()) == sorted([live.path, young])
    live.end()
    process.sweep_owner_files(tmp_path / "absent")  # no folder: nothing to do
