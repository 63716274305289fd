"""Suspend and resume on the command line: ``vmsandbox suspend NAME...`` (``--force`` ends
guest processes that hold a GPU) and ``vmsandbox resume NAME...`` (vmsandbox/sandbox/suspend.py,
resume.py), and the size of a saved sandbox as ``list`` shows it."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vmsandbox.cli import common
from vmsandbox.cli.common import Out
from vmsandbox.cli.output import EXIT_CODES, saved_size
from vmsandbox.errors import VmSandboxError

if TYPE_CHECKING:
    from vmsandbox.sandbox.handle import Sandbox
    from vmsandbox.sandbox.manager import SandboxManager


def saved_line(sandboxes: list[dict[str, Any]], max_saved_gib: int) -> str | None:
    """``list``'s line for the disk that saved memory takes, when any sandbox is saved."""
    used = sum(int(s.get("saved_bytes") or 0) for s in sandboxes)
    if not used:
        return None
    return f"saved memory: {used / 2**30:.2f} GiB of max_saved_gib {max_saved_gib} GiB"


def _each(
    args: argparse.Namespace, out: Out, act: Callable[[SandboxManager, str], Sandbox], did: str
) -> int:
    """``act`` on the names in order, stopping at the first failure, whose error says which
    were done before it, which one failed and which were not tried (as destroy's)."""
    from vmsandbox.validate import validate_name

    for name in args.names:
        validate_name(name)
    done: list[dict[str, Any]] = []
    with common.manager(progress=not args.json) as manager:
        for name in args.names:
            try:
                data = act(manager, name).to_dict()
            except VmSandboxError as exc:
                out.error(
                    exc,
                    **{did: [d["name"] for d in done]},
                    failed=name,
                    not_tried=args.names[len(done) + 1 :],
                )
                return EXIT_CODES.get(exc.code, 1)
            done.append(data)
            if not out.json:
                print(_line(data, did))
    if out.json:
        out.result({did: [d["name"] for d in done], "sandboxes": done}, "")
    return 0


def _line(data: dict[str, Any], did: str) -> str:
    if did == "suspended":
        return f"suspended {data['name']} ({saved_size(data)} saved)"
    waited = data.get("boot_seconds")
    after = f", SSH answered {waited:.2f} s after the restore" if waited else ""
    return f"resumed {data['name']} ({data['state']}{after})"


def cmd_suspend(args: argparse.Namespace, out: Out) -> int:
    return _each(args, out, lambda m, name: m.suspend(name, force=args.force), "suspended")


def cmd_resume(args: argparse.Namespace, out: Out) -> int:
    return _each(args, out, lambda m, name: m.resume(name, verify=not args.no_verify), "resumed")


def add_parsers(sub: Any, common: list[argparse.ArgumentParser]) -> None:
    suspend = sub.add_parser(
        "suspend",
        parents=common,
        help="save sandboxes' memory to disk and give their memory and GPUs back",
    )
    suspend.add_argument("names", nargs="+")
    suspend.add_argument("--force", action="store_true", help="end guest processes that hold a GPU")
    resume = sub.add_parser(
        "resume", parents=common, help="restore suspended sandboxes (GPUs of the same model)"
    )
    resume.add_argument("names", nargs="+")
    resume.add_argument("--no-verify", action="store_true", help="skip the in-guest GPU check")


HANDLERS = {"suspend": cmd_suspend, "resume": cmd_resume}
