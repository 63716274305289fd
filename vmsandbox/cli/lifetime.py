"""A sandbox's lifetime on the command line: ``create --ttl`` (its value type), ``extend``,
``reap``, and the time left as ``list`` and ``show`` print it (vmsandbox/sandbox/lifetime.py)."""

from __future__ import annotations

import argparse
from typing import Any

from vmsandbox.cli import common
from vmsandbox.cli.common import Out
from vmsandbox.validate import format_duration, parse_duration


def ttl(text: str) -> int:
    """``--ttl``'s value: seconds of a duration (30m, 2h, 1d, or plain seconds)."""
    return parse_duration(text, "--ttl")


def _extension(text: str) -> int:
    return parse_duration(text, "duration")


def time_left(data: dict[str, Any]) -> str:
    """A sandbox's time left as ``list`` shows it: ``1h59m``, ``expired``, or ``-``."""
    left = data.get("expires_in_seconds")
    if left is None:
        return "-"
    return "expired" if left <= 0 else format_duration(left)


def expiry_line(data: dict[str, Any]) -> str | None:
    """``show``'s line for the lifetime, when the sandbox has one."""
    if not data.get("expires_at"):
        return None
    return f"expires:   {data['expires_at']} ({time_left(data)} left)".replace(
        "(expired left)", "(expired: the next reap destroys it)"
    )


def cmd_extend(args: argparse.Namespace, out: Out) -> int:
    with common.manager() as sandboxes:
        data = sandboxes.extend(args.name, args.duration).to_dict()
    out.result(data, f"{args.name} now expires at {data['expires_at']} (in {time_left(data)})")
    return 0


def cmd_reap(_args: argparse.Namespace, out: Out) -> int:
    with common.manager() as sandboxes:
        reaped = sandboxes.reap()
    lines = [f"reaped {name}" for name in reaped.destroyed]
    lines += [f"could not reap {name}: {e['message']}" for name, e in reaped.failed.items()]
    out.result(reaped.to_dict(), "\n".join(lines) or "nothing to reap")
    return 1 if reaped.failed else 0


def add_parsers(sub: Any, common: list[argparse.ArgumentParser]) -> None:
    extend = sub.add_parser(
        "extend", parents=common, help="push a sandbox's expiry later (created with --ttl)"
    )
    extend.add_argument("name")
    extend.add_argument("duration", type=_extension, help="e.g. 30m, 1h, 1d, or seconds")
    sub.add_parser(
        "reap", parents=common, help="destroy the sandboxes whose lifetime (--ttl) has ended"
    )


HANDLERS = {"extend": cmd_extend, "reap": cmd_reap}
