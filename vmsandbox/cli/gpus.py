"""``vmsandbox gpus``: the host's GPUs, each with whether it can be passed and its custody state
and reason, and what an operator does with a GPU that is out (vmsandbox/gpu/custody):

- ``vmsandbox gpus``: the inventory (``--json``: the inventory's document, with each GPU's
  ``custody``, ``custody_reason`` and ``custody_since``, and the NVSwitch fabric);
- ``vmsandbox gpus check BDF``: reset, re-check and (with the scrub hook) scrub a GPU that is
  quarantined, suspect or failed, and free it when every step passes; refused while a sandbox
  or domain holds it (destroying that sandbox resets it);
- ``vmsandbox gpus release BDF --force``: free a quarantined or failed GPU without a reset, when
  the operator knows it is well (the host was power-cycled, the GPU replaced); logged, with who;
- ``vmsandbox gpus watch``: the health monitor in the foreground (``vmsandbox serve`` runs it in
  a thread): one line per signal it applies, until Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import signal
import threading
from typing import Any

from vmsandbox.cli import common
from vmsandbox.cli.common import Out as Output
from vmsandbox.errors import InvalidArgument


def run(args: argparse.Namespace, out: Output) -> int:
    command = args.gpus_command or "list"
    if command != "list" and command != "watch" and not args.bdf:
        raise InvalidArgument(
            f"gpus {command} needs a GPU's PCI address: vmsandbox gpus {command} BDF"
        )
    if command == "release" and not args.force:
        raise InvalidArgument(
            "gpus release frees a GPU without a reset: say --force to do it "
            "('vmsandbox gpus check BDF' resets and re-checks it instead)"
        )
    with common.manager() as manager:
        if command == "list":
            return _list(manager, out)
        if command == "watch":
            return _watch(manager, out)
        bdf = _bdf(manager, args.bdf)
        if command == "check":
            return _check(manager, bdf, out)
        return _release(manager, bdf, out)


def _bdf(manager: Any, given: str) -> str:
    """The BDF of the GPU ``given`` names: a PCI address as it is (a GPU gone from the host
    still has its record), an index or a UUID through the inventory."""
    from vmsandbox.gpu.allocator import resolve_devices
    from vmsandbox.host.bdf import canonical_bdf

    try:
        return canonical_bdf(given)
    except ValueError:
        (gpu,) = resolve_devices([given], manager.gpus())
        return str(gpu.bdf)


def _list(manager: Any, out: Output) -> int:
    from vmsandbox.gpu.fabric.render import report
    from vmsandbox.host import render_table

    inventory = manager.gpus()
    fabric_text, fabric = report(manager.config, inventory)
    out.result(
        {**inventory.to_dict(), "nvswitch_fabric": fabric},
        (render_table(inventory) + fabric_text).rstrip("\n"),
    )
    return 0


def _check(manager: Any, bdf: str, out: Output) -> int:
    from vmsandbox.gpu.custody import work
    from vmsandbox.sandbox import custody

    result = work.check(
        manager.config,
        manager.locked,
        bdf,
        lambda: custody.held_by(manager.config, manager.hypervisor, bdf),
    )
    record = result.record
    steps = result.outcome.steps if result.outcome else {}
    shown = ", ".join(f"{step} {secs:.2f}s" for step, secs in steps.items())
    text = f"GPU {bdf} is {record.state}" + (f": {record.reason}" if record.reason else "")
    data = {"bdf": bdf, "state": record.state, "reason": record.reason, "steps": steps}
    if result.waiting:
        data["waiting"] = result.waiting
        text += f" (waits: {result.waiting})"
    out.result(data, f"{text}\nsteps: {shown or '-'}")
    return 0 if record.state == "free" else 5


def _release(manager: Any, bdf: str, out: Output) -> int:
    from vmsandbox.gpu.custody import work

    record = work.force_release(manager.config, manager.locked, bdf, _who())
    out.result(
        {"bdf": bdf, "state": record.state},
        f"GPU {bdf} released by force (no reset); logged in "
        f"{manager.config.state_dir / 'custody' / 'events.jsonl'}",
    )
    return 0


def _who() -> str:
    """Who runs this: uid and name, and the user sudo was run by."""
    uid = os.getuid()
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        name = "?"
    sudo = os.environ.get("SUDO_USER")
    return (
        f"uid {uid} ({name})" + (f" via sudo from {sudo}" if sudo else "") + f", pid {os.getpid()}"
    )


def _watch(manager: Any, out: Output) -> int:
    from vmsandbox.sandbox.health import Monitor, Seen

    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())

    def report(seen: Seen) -> None:
        if out.json:
            print(json.dumps(seen.to_dict()), flush=True)
            return
        state = seen.record.state if seen.record else "reported"
        where = f", sandbox {seen.sandbox} failed" if seen.sandbox else ""
        print(f"{seen.signal.bdf}: {state}{where}: {seen.signal.words}", flush=True)

    Monitor(manager).run(stop, report)
    return 0
