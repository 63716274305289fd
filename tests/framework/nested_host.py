"""The nested GPU host as the tests drive it: L1 started and restored, watched while it works.

KVM inside a TCG guest is the nested host's weak point: now and then an L1 panics while an L2
guest starts (a vCPU thread's stack overflows in the exception entry), stops making progress
(watchdog timeouts, processes stuck past SIGKILL), or its L2 crawls. Those are faults of the test
host, not of vmsandbox, and none of them may cost the run more than about a minute. So every
command a test runs in L1 goes through ``NestedHost.run`` (or ``start``), which watches L1 while
the command runs:

- L1's console: a line of ``SICK_CONSOLE`` (panic, soft lockup, RCU stall, hung task, a unit's
  watchdog) means L1 is sick;
- a heartbeat: a trivial command over SSH every ``HEARTBEAT_EVERY`` seconds; no answer for
  ``HEARTBEAT_LOST`` seconds means L1 hangs;
- L1's QEMU still running;
- an L2 boot: vmsandbox's own progress lines ("waiting for SSH (Ns, guest: STAGE)") with one
  stage for ``L2_STALL`` seconds, or no SSH after ``L2_CRAWL``, mean the L2 crawls (a healthy
  one moves on every few seconds and answers SSH in about a minute here);
- the command's own limit, and the module's time budget.

A sick L1 is killed at once and ``L1Lost`` raised; ``NestedHost.attempt`` runs a step again in
a pristine L1 (restored from the snapshot setup/nested.sh saved at the first boot, about 20 s),
up to ``L1_TRIES`` times. A failure from a healthy L1 (vmsandbox answering wrong) is never
retried. The whole module has ``BUDGET`` seconds; past it, or when no try is left, the run fails
with a summary of every L1 started and why each was lost.
"""

from __future__ import annotations

import os
import re
import select
import shutil
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from framework.paths import REPO

T = TypeVar("T")

# A fault of L1's kernel or of its userspace stalling under it: never seen in a healthy L1.
SICK_CONSOLE = re.compile(
    rb"Kernel panic|stack guard page was hit|soft lockup|hard LOCKUP|rcu_\w+ self-detected stall"
    rb"|rcu: INFO: rcu_\w+ detected stalls|blocked for more than \d+ seconds|Watchdog timeout"
)
HEARTBEAT_EVERY = 5.0  # seconds between two heartbeats
HEARTBEAT_TIMEOUT = 15.0  # one heartbeat's own limit (a loaded machine answers in 1-3 s)
HEARTBEAT_LOST = 45.0  # no heartbeat answered for this long: L1 hangs
L2_STALL = 75.0  # an L2 whose boot stage has not moved for this long crawls (healthy: < 35 s)
L2_CRAWL = 240.0  # and one still without SSH after this long (healthy: 15-60 s here)
# L1s one step may use. A step that boots an L2 is lost now and then (about one L1 in six on a
# quiet machine, more on a busy one); the module's budget, not this count, bounds the time spent.
L1_TRIES = 5
BUDGET = float(os.environ.get("VMSANDBOX_NESTED_BUDGET", 15 * 60))  # the module's, retries included
START_LIMIT = 3600.0  # one start of L1, a cold boot on a loaded machine included
POLL = 0.5
# The last lines of every L2 console in L1 (vmsandbox's state folder there), for the log folder.
L2_CONSOLES = (
    'for f in /var/lib/vmsandbox/sandboxes/*.console.log; do [ -f "$f" ] || continue;'
    ' echo "== $f"; tail -n 40 "$f"; done'
)
# What setup/nested.sh says for each way it starts an L1 (else it booted one cold).
BOOTS = (("from the snapshot", "restored"), ("reusing the running L1", "reused"))
# vmsandbox's progress line while it waits for a guest: seconds waited and the guest's stage.
WAITING = re.compile(rb"waiting for SSH \((\d+)s, guest: ([^)]*)\)")

POOL_CONFIG = "/etc/vmsandbox/config.toml"  # the nested image's; names its image store
# A GPU-ready pool shape the size of the module's creates: its guests boot with two spare ports.
POOL_TOML = '[pool.gpu]\nimage = "minimal"\nmemory_mib = 512\ncount = 1\ngpus = 2\n'


class L1Lost(Exception):
    """L1 failed under a step (the test host's fault): the step may run again in a fresh L1."""


class BudgetExhausted(Exception):
    """The module's time budget is spent."""


@dataclass
class L1Life:
    """One L1: how it started, what ran in it, how it ended."""

    number: int
    how: str  # "cold boot", "restored" or "reused"
    start_s: float
    steps: list[str] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)  # each step's time, once it ended
    lost: str | None = None
    load: float | None = None  # the host's 1-minute load average when L1 was lost

    def describe(self) -> str:
        took = zip(self.steps, self.seconds, strict=False)
        steps = ", ".join(f"{step} {secs:.0f} s" for step, secs in took) or "no step"
        end = f"LOST (host load {self.load or 0:.1f}): {self.lost}" if self.lost else "healthy"
        return f"L1 #{self.number} ({self.how}, ready in {self.start_s:.0f} s; {steps}): {end}"


class Heartbeat(threading.Thread):
    """Runs a trivial command in L1 every few seconds; remembers when one last succeeded."""

    def __init__(self, host: NestedHost) -> None:
        super().__init__(daemon=True, name="l1-heartbeat")
        self.host = host
        self.last_ok = time.monotonic()
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(HEARTBEAT_EVERY):
            try:
                done = self.host.exec_raw(["true"], timeout=HEARTBEAT_TIMEOUT)
                if done.returncode == 0:
                    self.last_ok = time.monotonic()
            except subprocess.TimeoutExpired:
                pass

    def silent_for(self) -> float:
        return time.monotonic() - self.last_ok


class Running:
    """A command running in L1, watched (see the module docstring)."""

    def __init__(self, host: NestedHost, argv: list[str], limit: float, stdin: str | None) -> None:
        self.host, self.argv = host, argv
        self.deadline = time.monotonic() + limit
        self.limit = limit
        self.proc = subprocess.Popen(
            ["bash", str(host.script), "exec", "--", *argv],
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=host.env,
        )
        if stdin is not None:
            assert self.proc.stdin is not None
            self.proc.stdin.write(stdin.encode())
            self.proc.stdin.close()
        self.out = bytearray()
        self.err = bytearray()
        self.stage = (b"", 0)  # the L2's boot stage last seen, and when it was first seen
        self.scanned = 0  # how much of stderr _l2_crawls has read

    def _l2_crawls(self) -> str | None:
        """Why the L2 this command waits for crawls, if it does (from vmsandbox's progress)."""
        end = self.err.rfind(b"\n") + 1
        fresh, self.scanned = bytes(self.err[self.scanned : end]), max(self.scanned, end)
        why = None
        for seconds, stage in WAITING.findall(fresh):
            waited = int(seconds)
            if stage != self.stage[0]:
                self.stage = (stage, waited)
            if waited - self.stage[1] > L2_STALL:
                why = f"its L2 crawled: in stage '{stage.decode()}' for {waited - self.stage[1]} s"
            elif waited > L2_CRAWL:
                why = f"its L2 crawled: still waiting for SSH after {waited} s"
        return why

    def _pump(self, wait: float) -> None:
        streams = [s for s in (self.proc.stdout, self.proc.stderr) if s and not s.closed]
        if not streams:
            time.sleep(wait)
            return
        ready, _, _ = select.select(streams, [], [], wait)
        for stream in ready:
            chunk = os.read(stream.fileno(), 65536)
            if not chunk:
                stream.close()
            (self.out if stream is self.proc.stdout else self.err).extend(chunk)

    def _check(self) -> None:
        """Raise L1Lost when L1 is sick, the command is past its limit or the budget is out."""
        self.host.check()
        crawl = self._l2_crawls()
        if crawl:
            self.host.keep_l2_consoles()
            self.host.lose(crawl)
        if time.monotonic() > self.deadline:
            self.host.lose(f"'{' '.join(self.argv)[:80]}' ran past its {self.limit:.0f} s")

    def wait_for_text(self, text: str) -> None:
        """Read until ``text`` shows on stderr; the command may go on running."""
        marker = text.encode()
        while marker not in self.err:
            if self.proc.poll() is not None and self._drained():
                raise AssertionError(
                    f"'{' '.join(self.argv)}' exited ({self.proc.returncode}) before "
                    f"{text!r}:\n{self.err.decode(errors='replace')}"
                )
            self._pump(POLL)
            self._check()

    def _drained(self) -> bool:
        return all(s is None or s.closed for s in (self.proc.stdout, self.proc.stderr))

    def wait(self) -> subprocess.CompletedProcess[str]:
        while not (self.proc.poll() is not None and self._drained()):
            self._pump(POLL)
            if self.proc.poll() is None:
                self._check()
            elif not self._drained():
                self._pump(0)
        done = subprocess.CompletedProcess(
            self.argv,
            self.proc.returncode,
            self.out.decode(errors="replace"),
            self.err.decode(errors="replace"),
        )
        if done.returncode == 255:  # ssh itself failed: was L1 to blame?
            self.host.confirm_healthy()
        return done

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class NestedHost:
    """The nested host of one test module (see the module docstring)."""

    def __init__(
        self,
        script: Path,
        env: dict[str, str],
        state_dir: Path,
        log_dir: Path,
        budget: float = BUDGET,
    ) -> None:
        self.script, self.env = script, env
        self.state_dir, self.log_dir = state_dir, log_dir
        self.budget = budget
        self.lives: list[L1Life] = []
        self.deadline = time.monotonic() + budget
        self.began = time.monotonic()
        self.console_seen = 0
        self.heartbeat: Heartbeat | None = None
        self.used = False  # whether a step left the running L1 unfit for another

    # -- L1's life -----------------------------------------------------------------------------

    def boot(self, command: str = "restart") -> None:
        """``setup/nested.sh start`` (reuse or cold boot) or ``restart`` (a pristine L1)."""
        self._stop_heartbeat()
        began = time.monotonic()
        left = self.left()
        if left <= 0:
            raise BudgetExhausted(f"no time left to {command} L1")
        try:
            done = subprocess.run(
                ["bash", str(self.script), command],
                capture_output=True,
                text=True,
                env=self.env,
                timeout=min(left, START_LIMIT),
                check=False,
            )
        except subprocess.TimeoutExpired:
            self.kill()
            raise BudgetExhausted(f"nested.sh {command} ran into the budget") from None
        how = next((how for said, how in BOOTS if said in done.stderr), "cold boot")
        life = L1Life(len(self.lives) + 1, how, time.monotonic() - began)
        self.lives.append(life)
        if done.returncode != 0:
            life.lost = f"did not start: {done.stderr.strip().splitlines()[-1:]}"
            life.load = os.getloadavg()[0]
            raise L1Lost(f"nested host did not {command}:\n{done.stderr[-4000:]}")
        self.console_seen = 0
        self.used = False
        self.heartbeat = Heartbeat(self)
        self.heartbeat.start()

    def kill(self) -> None:
        self._stop_heartbeat()
        subprocess.run(["bash", str(self.script), "kill"], env=self.env, timeout=60, check=False)

    def stop(self) -> None:
        self._stop_heartbeat()
        subprocess.run(["bash", str(self.script), "stop"], env=self.env, timeout=120, check=True)

    def _stop_heartbeat(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stopped.set()
            self.heartbeat.join(timeout=HEARTBEAT_TIMEOUT + 5)
            self.heartbeat = None

    @property
    def console(self) -> Path:
        return self.state_dir / "console.log"

    def lose(self, why: str) -> None:
        """L1 is sick: keep its console, kill it, raise L1Lost."""
        life = self.lives[-1] if self.lives else None
        if life is not None and life.lost is None:
            life.lost, life.load = why, os.getloadavg()[0]
            self.log_dir.mkdir(parents=True, exist_ok=True)
            with (self.log_dir / "events.log").open("a") as events:
                events.write(
                    f"{time.strftime('%H:%M:%S')} L1 #{life.number} lost"
                    f" (host load {life.load:.1f}): {why}\n"
                )
            if self.console.exists():
                shutil.copy(self.console, self.log_dir / f"l1-{life.number}-console.log")
        self.kill()
        raise L1Lost(why)

    def keep_l2_consoles(self) -> None:
        """Copy the tails of L1's L2 consoles to the log folder (L1 is about to be killed)."""
        life = self.lives[-1] if self.lives else None
        if life is None:
            return
        try:
            shown = self.exec_raw(["sh", "-c", L2_CONSOLES], timeout=HEARTBEAT_TIMEOUT)
        except subprocess.TimeoutExpired:
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        (self.log_dir / f"l1-{life.number}-l2-consoles.log").write_text(shown.stdout)

    def check(self) -> None:
        """Raise L1Lost if L1 is sick now, BudgetExhausted if the module's time is out."""
        if self.left() <= 0:
            self.kill()
            raise BudgetExhausted("the module's time budget is spent")
        if self.console.exists():
            with self.console.open("rb") as console:
                start = max(0, self.console_seen - 200)  # again: a line cut at the last read
                console.seek(start)
                fresh = console.read()
            self.console_seen = start + len(fresh)
            sick = SICK_CONSOLE.search(fresh)
            if sick:
                line = fresh[fresh.rfind(b"\n", 0, sick.start()) + 1 :].split(b"\n", 1)[0]
                self.lose(f"console: {line.decode(errors='replace').strip()}")
        pid_file = self.state_dir / "qemu.pid"
        try:
            os.kill(int(pid_file.read_text()), 0)
        except (OSError, ValueError):
            self.lose("its QEMU exited")
        if self.heartbeat is not None and self.heartbeat.silent_for() > HEARTBEAT_LOST:
            self.lose(f"no answer to a heartbeat for {self.heartbeat.silent_for():.0f} s")

    def confirm_healthy(self) -> None:
        """Return once a heartbeat newer than now succeeds; raise L1Lost if L1 is sick first."""
        since = time.monotonic()
        while self.heartbeat is not None and self.heartbeat.last_ok <= since:
            self.check()
            time.sleep(POLL)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    # -- commands ------------------------------------------------------------------------------

    def exec_raw(self, argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in L1, unwatched (the heartbeat's own command)."""
        return subprocess.run(
            ["bash", str(self.script), "exec", "--", *argv],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            env=self.env,
            timeout=timeout,
            check=False,
        )

    def start(self, *argv: str, limit: float = 300, stdin: str | None = None) -> Running:
        """Start ``argv`` as root in L1, watched; see ``Running``."""
        return Running(self, list(argv), min(limit, max(self.left(), 1)), stdin)

    def run(
        self, *argv: str, limit: float = 300, stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` as root in L1, watched: its exit status, stdout and stderr."""
        running = self.start(*argv, limit=limit, stdin=stdin)
        began = time.monotonic()
        try:
            return running.wait()
        finally:
            running.kill()
            self.note(f"{time.monotonic() - began:6.1f} s  {' '.join(argv)[:120]}")

    def note(self, line: str) -> None:
        """Add ``line`` to commands.log in the log folder, marked with the L1 it ran in."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        number = self.lives[-1].number if self.lives else 0
        with (self.log_dir / "commands.log").open("a") as log:
            log.write(f"{time.strftime('%H:%M:%S')} L1 #{number} {line}\n")

    # -- steps ---------------------------------------------------------------------------------

    def attempt(
        self, name: str, step: Callable[[], T], *, spoils_l1: bool = True, pristine: bool = True
    ) -> T:
        """Run ``step`` in an L1 that no earlier step spoiled (a pristine one when the running
        L1 is); when L1 is lost under it, run it again in another, up to ``L1_TRIES`` L1s.
        ``spoils_l1``: the step leaves L1 unfit for another (it starts KVM guests, which wear a
        TCG L1 out, or breaks a card's host driver). ``pristine`` False: the step starts no KVM
        guest and may run in a spoiled L1 that is still healthy (a fresh one if it was lost)."""
        for tries_left in range(L1_TRIES - 1, -1, -1):
            try:
                if (self.used and pristine) or not self.lives or self.lives[-1].lost:
                    self.boot("restart" if self.lives else "start")
                life = self.lives[-1]
                life.steps.append(name)
                self.used = self.used or spoils_l1
                began = time.monotonic()
                try:
                    return step()
                finally:
                    life.seconds.append(time.monotonic() - began)
            except L1Lost as lost:
                if not tries_left:
                    raise AssertionError(
                        f"step '{name}' lost {L1_TRIES} L1s in a row (last: {lost})\n"
                        + self.summary()
                    ) from None
            except BudgetExhausted as out:
                raise AssertionError(f"step '{name}': {out}\n{self.summary()}") from None
        raise AssertionError("unreachable: the last try returns or raises")

    def summary(self) -> str:
        spent = time.monotonic() - self.began
        lost = sum(1 for life in self.lives if life.lost)
        head = (
            f"nested host: {len(self.lives)} L1(s) started, {lost} lost, {spent:.0f} s of the"
            f" {self.budget:.0f} s budget spent (consoles of lost L1s in {self.log_dir})"
        )
        return "\n".join([head, *(f"  {life.describe()}" for life in self.lives)])


def nested_env(**extra: str) -> dict[str, str]:
    """The environment setup/nested.sh runs in: vmsandbox on this host with this interpreter
    and this checkout, plus ``extra`` (VMSANDBOX_NESTED_DIR, VMSANDBOX_NESTED_CARDS...)."""
    return {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(REPO), **extra}


def module_host(
    script: Path, env: dict[str, str], state_dir: Path, log_dir: Path, budget: float = BUDGET
) -> Iterator[NestedHost]:
    """A test module's nested host (use with ``yield from`` in a module fixture). Its budget
    starts once the images are built and L1's pristine snapshot saved (``nested.sh prepare``:
    a cold boot of L1 when there is no current one), each when needed; the snapshot is kept for
    the next run, the summary written to ``log_dir``/summary.txt."""
    for image in ("minimal", "nested"):
        subprocess.run(
            [env["PYTHON"], "-m", "vmsandbox.cli", "images", "build", image],
            env=env,
            check=True,
            timeout=3600,
        )
    prepared = subprocess.run(
        ["bash", str(script), "prepare"],
        env=env,
        capture_output=True,
        text=True,
        timeout=START_LIMIT,
        check=False,
    )
    assert prepared.returncode == 0, f"setup/nested.sh prepare failed:\n{prepared.stderr[-4000:]}"
    nested = NestedHost(script, env, state_dir, log_dir, budget)
    try:
        yield nested
    finally:
        summary = nested.summary()
        log_dir.mkdir(parents=True, exist_ok=True)
        (log_dir / "summary.txt").write_text(summary + "\n")
        if any(life.lost for life in nested.lives):
            warnings.warn(f"the test host lost L1s (steps ran again):\n{summary}", stacklevel=1)
        nested.kill()  # the snapshot stays: the next run starts from it
