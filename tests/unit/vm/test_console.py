"""Reading and following a console log: cleaned of terminal escapes, last lines from the end,
a restarted log followed from its top, the end when the log goes."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from vmsandbox.errors import NotFound
from vmsandbox.vm.console import follow, read_lines


def test_the_last_lines_of_a_long_log_without_escapes(tmp_path: Path) -> None:
    log = tmp_path / "console.log"
    log.write_bytes(b"".join(f"line {i} \x1b[32mok\x1b[0m\r\n".encode() for i in range(50_000)))
    assert read_lines(log, 2) == "line 49998 ok\nline 49999 ok"
    assert read_lines(log, 0) == ""
    assert read_lines(log).count("\n") == 50_000
    with pytest.raises(NotFound):
        read_lines(tmp_path / "none.log")


def test_follow_hands_over_new_lines_and_ends_when_the_log_is_removed(tmp_path: Path) -> None:
    log = tmp_path / "console.log"
    log.write_text("old 1\nold 2\n")
    lines = follow(log, 1, poll=0.01)
    assert next(lines) == "old 2"

    def guest_writes() -> None:
        time.sleep(0.1)
        with log.open("ab") as handle:
            handle.write(b"new \xc3")  # a character split across two writes
            handle.flush()
            time.sleep(0.1)
            handle.write(b"\xa9 done\n")
        time.sleep(0.1)
        log.write_text("restarted\n")  # QEMU starts the log again
        time.sleep(0.1)
        log.unlink()

    writer = threading.Thread(target=guest_writes)
    writer.start()
    assert list(lines) == ["new é done", "restarted"]
    writer.join()
