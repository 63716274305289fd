"""The host lock (vmsandbox/lock.py): waiters are served in the order they came, a wait is
bounded and its error names the holder, a dead waiter or holder blocks nobody, and the holding
thread may take it again. Real processes and real ``flock``s; no libvirt."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from vmsandbox.errors import DeadlineExceeded
from vmsandbox.lock import held, host_lock

HOLDER = """
import sys, time
from pathlib import Path
from vmsandbox.lock import host_lock
with host_lock(Path(sys.argv[1]), purpose=sys.argv[2]):
    print("held", flush=True)
    time.sleep(float(sys.argv[3]))
"""


def hold_in_process(lock: Path, purpose: str, seconds: float) -> subprocess.Popen[str]:
    """Another process that takes the lock, says so, and keeps it ``seconds``."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(lock), purpose, str(seconds)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


def test_a_timed_out_wait_names_the_holder_and_its_purpose(tmp_path: Path) -> None:
    lock = tmp_path / "host.lock"
    proc = hold_in_process(lock, "create box: reserve", 30)
    try:
        with pytest.raises(DeadlineExceeded) as caught, host_lock(lock, timeout=0.5):
            pass
        message = caught.value.message
        assert f"pid {proc.pid} " in message and "for create box: reserve" in message
        assert "which holds it since " in message
        assert caught.value.details["holder"]["pid"] == proc.pid
    finally:
        proc.kill()
        proc.wait()


def test_waiters_are_served_in_the_order_they_came(tmp_path: Path) -> None:
    """Five threads queue while another process holds the lock; they get it first come,
    first served, each once the one before it has let go."""
    lock = tmp_path / "host.lock"
    proc = hold_in_process(lock, "slow", 1.0)
    served: list[int] = []
    threads = []
    for n in range(5):
        thread = threading.Thread(target=lambda n=n: _take(lock, served, n))
        thread.start()
        threads.append(thread)
        time.sleep(0.15)  # each in line before the next
    for thread in threads:
        thread.join(timeout=30)
    proc.wait()
    assert served == [0, 1, 2, 3, 4]


def _take(lock: Path, served: list[int], n: int) -> None:
    with host_lock(lock, timeout=30):
        served.append(n)
        time.sleep(0.05)


def test_a_killed_holder_or_waiter_blocks_nobody(tmp_path: Path) -> None:
    lock = tmp_path / "host.lock"
    holder = hold_in_process(lock, "killed while holding", 60)
    waiter = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock), "killed waiting", "60"])
    time.sleep(0.5)  # the waiter has its ticket
    os.kill(waiter.pid, signal.SIGKILL)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    waiter.wait()
    with host_lock(lock, timeout=2):
        assert held(lock)
    assert [p.name for p in (tmp_path / "host.lock.d").iterdir() if p.name != "counter"] == []


def test_the_holding_thread_may_take_it_again(tmp_path: Path) -> None:
    lock = tmp_path / "host.lock"
    with host_lock(lock, timeout=1):
        with host_lock(lock, timeout=1):
            assert held(lock)
        assert held(lock)
    assert not held(lock)
