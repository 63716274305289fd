"""The commands that use a running sandbox beside ``cp`` (files.py): ``exec`` with its
environment, folder, user and standard input; ``ssh`` with OpenSSH's own options;
``ssh-config``; ``forward``; ``logs``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from typing import Any

from vmsandbox.cli import common
from vmsandbox.cli.common import Out
from vmsandbox.errors import InvalidArgument

_OUR_SSH_FLAGS = ("--allow-agent-forwarding", "--json")


def cmd_exec(args: argparse.Namespace, out: Out) -> int:
    """The guest command's exit status is the command's own. Output as it comes, or with
    ``--json`` collected into one object (exit_status, signal, stdout, stderr); standard input
    passed on when it is not a terminal (``-n``: none)."""
    from vmsandbox.guest.execute import parse_env

    if not args.argv:
        raise InvalidArgument("exec needs a command: vmsandbox exec NAME -- CMD [ARGS...]")
    env = parse_env(args.env)
    stdin = None if args.no_stdin or sys.stdin is None or sys.stdin.isatty() else sys.stdin.buffer
    where = {"timeout": args.timeout, "env": env, "cwd": args.cwd, "user": args.user}
    if out.json:
        with common.manager() as sandboxes:
            data = stdin.read() if stdin is not None else None
            result = sandboxes.exec(args.name, list(args.argv), stdin=data, **where)
        out.result(result.to_dict(), "")
        return result.exit_status
    sinks = {"stdout": sys.stdout.buffer, "stderr": sys.stderr.buffer}
    with common.manager() as sandboxes:
        running = sandboxes.stream(args.name, list(args.argv), stdin=stdin, **where)
        with running:
            for piece in running:
                sinks[piece.stream].write(piece.data)
                sinks[piece.stream].flush()
    status = int(running.exit_status or 0)
    if running.signal is not None:
        print(
            f"vmsandbox: the guest command was killed by signal {running.signal} "
            f"(exit status {status})",
            file=sys.stderr,
        )
    return status


def cmd_ssh(args: argparse.Namespace, _out: Out) -> int:
    from vmsandbox.guest.openssh import check_options, split_options

    words = [word for word in args.ssh_options if word not in _OUR_SSH_FLAGS]
    agent = args.allow_agent_forwarding or "--allow-agent-forwarding" in args.ssh_options
    options, command = split_options(words)
    check_options(options, allow_agent=agent)  # refused before any sandbox is looked up
    if command and args.argv:
        raise InvalidArgument("ssh: give the command once, after '--'")
    with common.manager() as sandboxes:
        argv = sandboxes.ssh_argv(
            args.name, list(args.argv) or command, options=options, forward_agent=agent
        )
    sys.stdout.flush()
    os.execvp(argv[0], argv)
    return 0  # not reached


def cmd_ssh_config(args: argparse.Namespace, out: Out) -> int:
    with common.manager() as sandboxes:
        text = sandboxes.ssh_config(args.names, prefix=args.prefix)
    hosts = [line.split(None, 1)[1] for line in text.splitlines() if line.startswith("Host ")]
    out.result({"hosts": hosts, "config": text}, text.rstrip("\n") or "# no sandboxes")
    return 0


def cmd_forward(args: argparse.Namespace, out: Out) -> int:
    """Listen until interrupted (Ctrl-C, SIGTERM); print where each forward listens first."""
    import signal

    from vmsandbox.guest.forward import parse_forward

    specs = [parse_forward(spec) for spec in args.forwards]

    def event(line: str) -> None:
        print(f"{args.name}: {line}", file=sys.stderr, flush=True)

    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        with (
            common.manager() as sandboxes,
            sandboxes.forward(args.name, *specs, on_event=event) as fwd,
        ):
            listening = [forward.to_dict() for forward in fwd.listening]
            text = "\n".join(f"forwarding {forward} of {args.name}" for forward in fwd.listening)
            out.result({"name": args.name, "forwards": listening}, text)
            sys.stdout.flush()
            if not out.json:
                print("press Ctrl-C to stop", file=sys.stderr, flush=True)
            while not stop.wait(0.5):
                pass
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


def cmd_logs(args: argparse.Namespace, out: Out) -> int:
    with common.manager() as sandboxes:
        if not args.follow:
            text = sandboxes.logs(args.name, args.lines)
            out.result({"name": args.name, "lines": text.splitlines()}, text)
            return 0
        lines = sandboxes.follow_logs(args.name, 10 if args.lines is None else args.lines)
    try:
        for line in lines:
            print(json.dumps({"line": line}) if out.json else line, flush=True)
    except KeyboardInterrupt:
        pass
    return 0


def _lines(text: str) -> int:
    if not text.isascii() or not text.isdigit():
        raise InvalidArgument(
            f"--lines {text!r} is not a whole number of 0 or more",
            details={"field": "--lines", "value": text},
        )
    return int(text)


def add_exec_options(exec_: argparse.ArgumentParser) -> None:
    exec_.add_argument(
        "--env", "-e", action="append", default=[], metavar="NAME=VALUE", help="set a variable"
    )
    exec_.add_argument("--cwd", "-w", metavar="DIR", help="run in this guest folder")
    exec_.add_argument(
        "--user", "-u", metavar="USER", help="run as USER through sudo in the guest (e.g. root)"
    )
    exec_.add_argument(
        "--no-stdin",
        "-n",
        action="store_true",
        help="give the command no input (by default a pipe or file on stdin is passed on)",
    )


def add_ssh_options(ssh: argparse.ArgumentParser) -> None:
    ssh.add_argument(
        "--allow-agent-forwarding",
        action="store_true",
        help="let -A (or -o ForwardAgent) hand the guest your SSH agent",
    )
    ssh.add_argument(
        "ssh_options",
        nargs=argparse.REMAINDER,
        metavar="SSH_OPTION",
        help="OpenSSH options such as -L 8080:localhost:80 -N, then [-- CMD [ARGS...]]",
    )
    ssh.set_defaults(argv=[])


def add_parsers(sub: Any, common: list[argparse.ArgumentParser]) -> None:
    config = sub.add_parser(
        "ssh-config",
        parents=common,
        help="print OpenSSH Host stanzas for sandboxes (for ssh -F, scp, rsync, IDEs)",
    )
    config.add_argument("names", nargs="*", metavar="NAME", help="default: every sandbox")
    config.add_argument("--prefix", default="", help="put this before each Host name")

    forward = sub.add_parser(
        "forward", parents=common, help="forward guest TCP ports to this host until interrupted"
    )
    forward.add_argument("name")
    forward.add_argument(
        "forwards",
        nargs="+",
        metavar="[ADDRESS:][LOCAL:]REMOTE",
        help="guest port REMOTE on LOCAL (default: the same number) of ADDRESS (127.0.0.1)",
    )

    logs = sub.add_parser("logs", parents=common, help="print a sandbox's serial console log")
    logs.add_argument("name")
    logs.add_argument("--follow", "-f", action="store_true", help="go on printing new lines")
    logs.add_argument("--lines", "-n", type=_lines, metavar="N", help="only the last N lines")


HANDLERS = {
    "exec": cmd_exec,
    "ssh": cmd_ssh,
    "ssh-config": cmd_ssh_config,
    "forward": cmd_forward,
    "logs": cmd_logs,
}
