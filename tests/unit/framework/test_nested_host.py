"""The nested host's watchdog and retries (tests/framework/nested_host.py), against a stand-in L1.

The stand-in is a small script with setup/nested.sh's commands: ``start``/``restart`` start a
``sleep`` as "L1's QEMU" and empty its console, ``exec`` runs the command here, ``kill`` and
``stop`` end the sleep. A test makes L1 sick the ways a real one gets sick (a panic on the
console, QEMU gone, no heartbeat, an L2 that crawls) and checks the step ran again in a fresh L1,
while a wrong answer from a healthy L1 fails at once.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from framework import nested_host
from framework.nested_host import SICK_CONSOLE, NestedHost

# Lines from the consoles of L1s lost on a fresh machine (shared/evidence), and healthy ones.
SICK_LINES = [
    "[   92.987670] BUG: TASK stack guard page was hit at 000000006682cb38",
    "[   93.002186] Kernel panic - not syncing: corrupted stack end detected inside scheduler",
    "[  262.1] systemd[1]: systemd-udevd.service: Watchdog timeout (limit 3min)!",
    "[  300.2] watchdog: BUG: soft lockup - CPU#1 stuck for 26s! [CPU 0/KVM:535]",
    "[  400.0] rcu: INFO: rcu_preempt detected stalls on CPUs/tasks:",
    "[  500.0] INFO: task journald:211 blocked for more than 120 seconds.",
]
HEALTHY_LINES = [
    "[   48.362023] kvm [491]: vcpu0, guest rIP: 0xffffffff92e73744 Unhandled WRMSR(0xc0010007)",
    "[  178.358429] radeon: wait for empty RBBM fifo failed! Bad things might happen.",
    "[   10.933323] systemd[1]: Mounting sys-kernel-debug.mount - Kernel Debug File System...",
]

STAND_IN = """\
#!/bin/bash
# A stand-in for setup/nested.sh: "L1" is a sleep; exec runs commands here.
state="$VMSANDBOX_NESTED_DIR"
alive() { [ -f "$state/qemu.pid" ] && kill -0 "$(cat "$state/qemu.pid")" 2>/dev/null; }
end() { alive && kill -9 "$(cat "$state/qemu.pid")"; rm -f "$state/qemu.pid"; }
case "$1" in
  start|restart)
    if [ "$1" = start ] && alive; then echo "reusing the running L1" >&2; exit 0; fi
    end; mkdir -p "$state"; : > "$state/console.log"
    [ -f "$state/snap" ] && echo "starting a pristine L1 from the snapshot" >&2
    touch "$state/snap"
    setsid sleep 600 </dev/null >/dev/null 2>&1 & echo $! > "$state/qemu.pid" ;;
  exec) shift; [ "$1" = -- ] && shift
    alive || { echo "no nested host runs" >&2; exit 1; }
    [ -f "$state/hang" ] && { sleep 600; exit 255; }
    exec "$@" ;;
  kill|stop) end ;;
esac
"""


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[NestedHost]:
    script = tmp_path / "nested.sh"
    script.write_text(STAND_IN)
    state = tmp_path / "state"
    monkeypatch.setattr(nested_host, "HEARTBEAT_EVERY", 0.2)
    monkeypatch.setattr(nested_host, "HEARTBEAT_LOST", 2.0)
    monkeypatch.setattr(nested_host, "HEARTBEAT_TIMEOUT", 1.0)
    env = {"PATH": "/usr/bin:/bin", "VMSANDBOX_NESTED_DIR": str(state)}
    nested = NestedHost(script, env, state, tmp_path / "logs")
    yield nested
    nested.stop()


def test_the_sick_patterns_match_lost_l1s_and_not_healthy_ones() -> None:
    assert all(SICK_CONSOLE.search(line.encode()) for line in SICK_LINES)
    assert not any(SICK_CONSOLE.search(line.encode()) for line in HEALTHY_LINES)


def test_a_healthy_step_runs_once_and_steps_that_spare_l1_share_it(host: NestedHost) -> None:
    assert host.attempt("a", lambda: host.run("echo", "hi").stdout, spoils_l1=False) == "hi\n"
    assert host.attempt("b", lambda: host.run("true").returncode, spoils_l1=False) == 0
    assert host.attempt("c", lambda: host.run("true").returncode) == 0
    assert host.attempt("d", lambda: host.run("true").returncode) == 0
    assert host.attempt("e", lambda: host.run("true").returncode, pristine=False) == 0
    assert [(life.how, life.steps, life.lost) for life in host.lives] == [
        ("cold boot", ["a", "b", "c"], None),
        ("restored", ["d", "e"], None),  # "e" needs no pristine L1: the spoiled one serves
    ]


def panic_once(host: NestedHost, lines: list[str]) -> str:
    """The first try writes a panic on the console mid-command; the second succeeds."""
    if len(host.lives) == 1:
        (host.state_dir / "console.log").write_text("\n".join(lines) + "\n")
        host.run("sleep", "30")
    return "done"


def test_a_panic_on_the_console_is_caught_and_the_step_runs_in_a_fresh_l1(
    host: NestedHost,
) -> None:
    began = time.monotonic()
    assert host.attempt("boot", lambda: panic_once(host, SICK_LINES[:2])) == "done"
    assert time.monotonic() - began < 20  # caught well before the 30 s command ends
    first, second = host.lives
    assert first.lost == f"console: {SICK_LINES[0]}"
    assert second.how == "restored" and second.lost is None
    assert (host.log_dir / "l1-1-console.log").exists()


def test_a_dead_qemu_and_a_silent_l1_are_lost(host: NestedHost) -> None:
    def die_once() -> str:
        if len(host.lives) == 1:
            subprocess.run(["kill", "-9", (host.state_dir / "qemu.pid").read_text().strip()])
            host.run("sleep", "30")
        if len(host.lives) == 2:
            (host.state_dir / "hang").touch()  # exec (heartbeats too) hangs from now on
            try:
                host.run("true")
            finally:
                (host.state_dir / "hang").unlink()
        return "done"

    assert host.attempt("step", die_once) == "done"
    assert [life.lost for life in host.lives] == [
        "its QEMU exited",
        host.lives[1].lost,
        None,
    ]
    assert (host.lives[1].lost or "").startswith("no answer to a heartbeat for")


def test_a_crawling_l2_and_a_command_past_its_limit_are_lost(
    host: NestedHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(nested_host, "L2_STALL", 5)
    monkeypatch.setattr(nested_host, "L2_CRAWL", 20)
    progress = "echo '[ 1.0s] waiting for SSH ({}s, guest: {})' >&2"
    stalled = [progress.format(1, "booting"), progress.format(4, "initramfs")]
    stalled += [progress.format(10, "initramfs"), "sleep 30"]
    slow = [progress.format(n, f"stage {n}") for n in range(0, 25, 4)] + ["sleep 30"]
    moving = [progress.format(n, f"stage {n}") for n in range(0, 20, 4)]

    def slow_once() -> str:
        if len(host.lives) == 1:
            host.run("sh", "-c", "; ".join(stalled))
        if len(host.lives) == 2:
            host.run("sh", "-c", "; ".join(slow))
        if len(host.lives) == 3:
            host.run("sleep", "30", limit=1)
        return host.run("sh", "-c", "; ".join(moving)).stdout  # moves on: healthy

    monkeypatch.setattr(nested_host, "L1_TRIES", 4)
    assert host.attempt("step", slow_once) == ""
    assert [life.lost for life in host.lives] == [
        "its L2 crawled: in stage 'initramfs' for 6 s",
        "its L2 crawled: still waiting for SSH after 24 s",
        "'sleep 30' ran past its 1 s",
        None,
    ]
    # a crawl keeps the L2 consoles L1 had, for the lost L1's record
    kept = sorted(path.name for path in host.log_dir.glob("*-l2-consoles.log"))
    assert kept == ["l1-1-l2-consoles.log", "l1-2-l2-consoles.log"]


def test_a_wrong_answer_from_a_healthy_l1_is_not_retried(host: NestedHost) -> None:
    def wrong() -> None:
        assert host.run("false").returncode == 0, "vmsandbox said no"

    with pytest.raises(AssertionError, match="vmsandbox said no"):
        host.attempt("step", wrong)
    assert len(host.lives) == 1 and host.lives[0].lost is None


def test_a_step_that_loses_every_l1_fails_with_a_summary(host: NestedHost) -> None:
    def always_lost() -> None:
        host.lose("made up")

    with pytest.raises(AssertionError) as failed:
        host.attempt("doomed", always_lost)
    message = str(failed.value)
    tries = nested_host.L1_TRIES
    assert f"step 'doomed' lost {tries} L1s in a row" in message
    assert f"{tries} L1(s) started, {tries} lost" in message
    assert len(re.findall(r"LOST \(host load \d+\.\d\): made up", message)) == tries


def test_the_budget_ends_the_module_with_a_summary(host: NestedHost) -> None:
    host.deadline = time.monotonic() + 2
    with pytest.raises(AssertionError) as failed:
        host.attempt("long", lambda: host.run("sleep", "30"))
    assert "step 'long': the module's time budget is spent" in str(failed.value)
    assert "1 L1(s) started" in str(failed.value)
    with pytest.raises(AssertionError, match="no time left to restart L1"):
        host.attempt("next", lambda: None)
