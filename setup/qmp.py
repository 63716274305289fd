"""The few QMP commands setup/nested.sh needs to save and restore its L1 host, and that the
tests need to inject faults into it.

    qmp.py SOCKET save FILE       pause the VM and write its whole state to FILE
    qmp.py SOCKET resume SECONDS  wait until an incoming state is loaded, then run the VM
    qmp.py SOCKET hmp COMMAND     run a human-monitor command (e.g. "pcie_aer_inject_error gpu1
                                  DLP": an uncorrectable error at a card's root port); its
                                  output on stdout

QMP is QEMU's JSON monitor protocol: one greeting, ``qmp_capabilities``, then one JSON object
per command and per answer, with asynchronous events in between (skipped here).
"""

from __future__ import annotations

import json
import socket
import sys
import time
from typing import Any


class Monitor:
    """One QMP connection."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(60)
        self.sock.connect(path)
        self.file = self.sock.makefile("rw")
        json.loads(self.file.readline())  # the greeting
        self.call("qmp_capabilities")

    def call(self, command: str, **arguments: Any) -> Any:
        message = {"execute": command, **({"arguments": arguments} if arguments else {})}
        self.file.write(json.dumps(message) + "\n")
        self.file.flush()
        while True:
            answer = json.loads(self.file.readline())
            if "event" in answer:
                continue
            if "error" in answer:
                raise SystemExit(f"qmp {command}: {answer['error'].get('desc', answer)}")
            return answer["return"]


def save(monitor: Monitor, path: str) -> None:
    """Pause the VM and write its state (RAM and devices) to ``path``; the VM stays paused."""
    monitor.call("stop")
    monitor.call("migrate", uri=f"exec:cat > {path}")
    while True:
        status = monitor.call("query-migrate").get("status")
        if status == "completed":
            return
        if status in ("failed", "cancelled"):
            raise SystemExit(f"saving the VM's state failed: {status}")
        time.sleep(0.2)


def resume(monitor: Monitor, seconds: float) -> None:
    """Wait until QEMU, started with ``-incoming``, has loaded the saved state, then run it."""
    deadline = time.monotonic() + seconds
    while monitor.call("query-status")["status"] not in ("paused", "postmigrate"):
        if time.monotonic() > deadline:
            raise SystemExit(f"the saved state did not load within {seconds:.0f}s")
        time.sleep(0.1)
    monitor.call("cont")


def hmp(monitor: Monitor, command: str) -> str:
    """A human-monitor command through QMP (``pcie_aer_inject_error`` has no QMP form)."""
    return str(monitor.call("human-monitor-command", **{"command-line": command}))


def main(argv: list[str]) -> None:
    if len(argv) != 3 or argv[1] not in ("save", "resume", "hmp"):
        raise SystemExit(__doc__)
    monitor = Monitor(argv[0])
    if argv[1] == "save":
        save(monitor, argv[2])
    elif argv[1] == "hmp":
        print(hmp(monitor, argv[2]), end="")
    else:
        resume(monitor, float(argv[2]))


if __name__ == "__main__":
    main(sys.argv[1:])
