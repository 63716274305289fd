"""``vmsandbox cp SRC DST``: files and folders in and out of a sandbox, one side written
``NAME:PATH`` (the other a path on this host), over SFTP on the sandbox's own key and pinned
host key (vmsandbox/guest/transfer.py). Large copies show their progress on a terminal."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from vmsandbox.cli import common
from vmsandbox.cli.common import Out
from vmsandbox.errors import InvalidArgument
from vmsandbox.validate import validate_name

METER_AFTER_S = 0.5  # a copy shorter than this shows no progress line
METER_EVERY_S = 0.25


def parse_location(text: str, field: str) -> tuple[str | None, str]:
    """``NAME:PATH`` as (NAME, PATH), anything else as (None, a path on this host). As scp
    reads it: a colon before any slash makes a sandbox's path; a path that starts with ``/``,
    ``./``, ``../`` or ``~`` is this host's whatever follows (``./a:b``). INVALID_ARGUMENT for
    an empty location, and for a NAME that is not a sandbox name."""
    if not text:
        raise InvalidArgument(
            f"{field} is empty: give a path, or NAME:PATH for a sandbox's",
            details={"field": field, "value": repr(text)},
        )
    name, colon, path = text.partition(":")
    if not colon or "/" in name or text.startswith(("/", "./", "../", "~")):
        return None, text
    try:
        validate_name(name, field)
    except InvalidArgument as exc:
        raise InvalidArgument(
            f"{field} {text!r}: {name!r} is not a sandbox name (for a path on this host with a "
            f"colon, write ./{text})",
            details={"field": field, "value": repr(text)},
        ) from exc
    return name, path


class Meter:
    """One progress line on stderr, rewritten in place, for a copy that takes a while."""

    def __init__(self, label: str) -> None:
        self.label = printable(label)
        self.started = time.monotonic()
        self.shown = 0.0
        self.drawn = False

    def __call__(self, done: int, total: int | None) -> None:
        now = time.monotonic()
        if now - self.started < METER_AFTER_S or now - self.shown < METER_EVERY_S:
            return
        self.shown = now
        rate = done / (now - self.started)
        part = f"{_size(done)}" + (f" of {_size(total)} ({100 * done // total}%)" if total else "")
        sys.stderr.write(f"\r{self.label}: {part}, {_size(rate)}/s\x1b[K")
        sys.stderr.flush()
        self.drawn = True

    def end(self) -> None:
        if self.drawn:
            sys.stderr.write("\n")
            sys.stderr.flush()


def printable(text: str) -> str:
    """``text`` with what is not printable (a line break in a file name) escaped."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _size(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.1f} {unit}" if unit != "B" else f"{count:.0f} B"
        count /= 1024
    return f"{count:.1f} GiB"  # not reached


def cmd_cp(args: argparse.Namespace, out: Out) -> int:
    source_name, source = parse_location(args.source, "source")
    target_name, target = parse_location(args.destination, "destination")
    if (source_name is None) == (target_name is None):
        raise InvalidArgument(
            "cp copies between this host and a sandbox: write exactly one side as NAME:PATH "
            f"(got {args.source!r} and {args.destination!r})",
            details={"field": "source", "value": args.source},
        )
    meter = Meter(f"{args.source} -> {args.destination}")
    progress = meter if sys.stderr.isatty() and not out.json else None
    try:
        with common.manager() as sandboxes:
            if source_name is not None:
                summary = sandboxes.download(source_name, source, target, progress=progress)
            else:
                assert target_name is not None
                summary = sandboxes.upload(target_name, source, target, progress=progress)
    finally:
        meter.end()
    data = summary.to_dict()
    out.result(data, _describe(data))
    return 0


def _describe(data: dict[str, Any]) -> str:
    seconds = data["seconds"] or 0.0
    rate = f", {_size(data['bytes'] / seconds)}/s" if seconds > 0 else ""
    counts = [f"{data['files']} file{'s' if data['files'] != 1 else ''}"]
    if data["directories"]:
        counts.append(f"{data['directories']} folder{'s' if data['directories'] != 1 else ''}")
    if data["symlinks"]:
        counts.append(f"{data['symlinks']} link{'s' if data['symlinks'] != 1 else ''}")
    lines = [
        f"copied {', '.join(counts)} ({_size(data['bytes'])}) from {printable(data['source'])} "
        f"to {printable(data['destination'])} in {seconds:.1f}s{rate}"
    ]
    lines += [f"skipped {item['path']!r}: {item['reason']}" for item in data["skipped"]]
    return "\n".join(lines)


def add_parsers(sub: Any, common: list[argparse.ArgumentParser]) -> None:
    cp = sub.add_parser(
        "cp",
        parents=common,
        help="copy files and folders between this host and a sandbox (NAME:PATH)",
    )
    cp.add_argument("source", help="PATH on this host, or NAME:PATH in a sandbox")
    cp.add_argument("destination", help="NAME:PATH in a sandbox, or PATH on this host")


HANDLERS = {"cp": cmd_cp}
