"""What the ``vmsandbox`` command prints: a result as text for people or as one JSON object for
programs (``--json``), errors as ``error: CODE: message`` or ``{"error": {...}}``, and the exit
status of each error code.

One JSON shape per command (docs/usage.md lists them); a command that cannot give one (the
interactive ``ssh``, the foreground servers) refuses ``--json`` instead of ignoring it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

from vmsandbox.errors import VmSandboxError

EXIT_CODES = {
    "INTERNAL": 1,
    "INVALID_ARGUMENT": 2,
    "NOT_FOUND": 3,
    "ALREADY_EXISTS": 4,
    "FAILED_PRECONDITION": 5,
    "RESOURCE_EXHAUSTED": 6,
    "UNAVAILABLE": 7,
    "DEADLINE_EXCEEDED": 8,
}
EXIT_CANCELLED = 130  # Ctrl-C (SIGINT): ``error: CANCELLED: interrupted``
EXIT_BROKEN_PIPE = 141  # the reader went away (``vmsandbox list | head``)


class Output:
    """Where a command's result goes: a text writer; ``JsonOutput`` writes JSON instead."""

    json = False

    def result(self, data: Any, text: str) -> None:
        """The command's result: ``text`` for people, ``data`` for programs."""
        print(text)

    def error(self, exc: VmSandboxError, **extra: Any) -> None:
        """A failure: ``error: CODE: message`` on stderr (a failed verification's table first);
        ``extra`` is what the command did before it failed (JSON carries it; in text it ends
        the error line, so one line still says it all)."""
        if isinstance(exc.details.get("verification"), dict):
            print(report_table(exc.details["verification"]), file=sys.stderr)
        done = "; ".join(
            f"{key.replace('_', ' ')}: {' '.join(value) if isinstance(value, list) else value}"
            for key, value in extra.items()
            if value
        )
        print(f"error: {exc.code}: {exc.message}" + (f" ({done})" if done else ""), file=sys.stderr)


class JsonOutput(Output):
    """One JSON object on stdout, the result or ``{"error": {...}}`` beside what was done."""

    json = True

    def result(self, data: Any, text: str) -> None:
        print(json.dumps(data, indent=2))

    def error(self, exc: VmSandboxError, **extra: Any) -> None:
        print(json.dumps({**extra, "error": exc.to_dict()}, indent=2))


def report_table(report: dict[str, Any]) -> str:
    from vmsandbox.guest.verify import VerificationReport, render_report

    return render_report(VerificationReport.from_dict(report))


def describe(data: dict[str, Any]) -> str:
    """A sandbox as ``create``, ``show`` and ``start`` print it: its state with what that
    means (and why it failed), size, SSH, where its domain and console log are, how long its
    boot (or claim) took, its GPUs and their verification."""
    from vmsandbox.cli.lifetime import expiry_line
    from vmsandbox.sandbox.record import STATE_MEANINGS

    ssh = data.get("ssh")
    state = data["state"]
    lines = [
        f"name:      {data['name']}",
        f"state:     {state} ({STATE_MEANINGS.get(state, 'unknown')})",
    ]
    failure = data.get("failure")
    if failure and state == "failed":
        lines.append(f"failure:   {failure.get('code')}: {failure.get('message')}")
    lines += [
        f"image:     {data['image']}",
        f"size:      {data['cpus']} vCPU, {data['memory_mib']} MiB, {data['disk_gib']} GiB disk",
        f"virt:      {data['virt_type']}",
        f"ssh:       {ssh['user']}@{ssh['host']}:{ssh['port']}" if ssh else "ssh:       -",
        f"connect:   vmsandbox ssh {data['name']}",
        f"domain:    {data['domain']}",
    ]
    if data.get("console_log"):
        lines.append(f"console:   {data['console_log']}")
    if expires := expiry_line(data):
        lines.append(expires)
    if saved := suspended_line(data):
        lines.append(saved)
    if data.get("stage_seconds"):
        seconds = sum(data["stage_seconds"].values())
        steps = ", ".join(f"{step} {secs:.3f}s" for step, secs in data["stage_seconds"].items())
        lines.append(f"claimed:   a pooled guest, in {seconds:.2f}s ({steps})")
    elif data.get("boot_seconds") is not None:
        lines.append(f"boot:      SSH answered {data['boot_seconds']}s after the guest started")
    for gpu in data.get("gpus", []):
        lines.append(f"gpu:       {gpu.get('bdf')} {gpu.get('name') or ''}".rstrip())
    report = data.get("verification")
    if report and (report.get("gpus") or not report.get("ok")):
        lines.append(report_table(report).rstrip("\n"))
    elif report:
        lines.append("verification: ok (no GPUs to check)")
    return "\n".join(lines)


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    from vmsandbox.tables import render_grid

    return "\n".join(render_grid(headers, rows))


def mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def saved_size(data: dict[str, Any]) -> str:
    """The disk a sandbox's saved memory takes, as ``list`` shows it: ``412M``, or ``-``."""
    size = int(data.get("saved_bytes") or 0)
    return f"{size / 2**20:.0f}M" if size else "-"


def suspended_line(data: dict[str, Any]) -> str | None:
    """``show``'s line for a suspended sandbox: since when, its save, the GPUs it will take."""
    held = data.get("suspended")
    if not held:
        return None
    gpus = held.get("gpus") or []
    models = ", ".join(sorted({str(g.get("name") or g.get("device_id")) for g in gpus}))
    taking = f"; takes {len(gpus)} free GPU(s) of model {models} on resume" if gpus else ""
    return f"suspended: since {held.get('at')}, {saved_size(data)} saved{taking}"
