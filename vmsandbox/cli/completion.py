"""Shell completion of the ``vmsandbox`` command for bash and zsh, by argcomplete: commands,
options and sandbox names. ``vmsandbox completion bash`` (or ``zsh``) prints the script to
source; the shell then runs ``vmsandbox`` with argcomplete's variables set, and ``complete``
answers before anything else runs.

Sandbox names come from libvirt's read-only socket (which any user may open), or from the
state directory when libvirt cannot be asked; any error completes nothing, silently: a
completion never prints an error or a traceback into the user's command line.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from typing import Any

from vmsandbox.cli.common import Out

SHELLS = ("bash", "zsh")
_NAME_DESTS = ("name", "names")


def sandbox_names(prefix: str = "", **_kwargs: Any) -> list[str]:
    """The sandboxes' names that start with ``prefix``; empty on any error."""
    names: set[str] = set()
    with contextlib.suppress(Exception):
        from vmsandbox.config import Config

        config = Config.load()
        try:
            names = _libvirt_names(config.uri)
        except Exception:
            names = {
                entry.name
                for entry in os.scandir(config.sandboxes)
                if entry.is_dir() and not entry.name.startswith("pool-")
            }
    return sorted(name for name in names if name.startswith(prefix))


def _libvirt_names(uri: str) -> set[str]:
    import libvirt

    from vmsandbox.sandbox.pool.shapes import POOL_PREFIX
    from vmsandbox.vm.domain import DOMAIN_PREFIX, read_metadata

    libvirt.registerErrorHandler(lambda _ctx, _err: None, None)  # libvirt prints otherwise
    conn = libvirt.openReadOnly(uri)
    try:
        names = set()
        for dom in conn.listAllDomains(0):
            if not dom.name().startswith(DOMAIN_PREFIX):
                continue
            parsed = read_metadata(dom.XMLDesc(0))
            name = parsed[0].get("name") if parsed else None
            pooled = parsed is not None and parsed[0].get("guest") is None
            if isinstance(name, str) and not (pooled and name.startswith(POOL_PREFIX)):
                names.add(name)
        return names
    finally:
        conn.close()


def complete(parser: argparse.ArgumentParser) -> None:
    """When the shell asks for completions, print them and exit; else return at once."""
    if "_ARGCOMPLETE" not in os.environ:
        return
    import argcomplete

    _name_completers(parser)
    argcomplete.autocomplete(parser)


def _name_completers(parser: argparse.ArgumentParser) -> None:
    """Every positional that names sandboxes completes sandbox names."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _name_completers(sub)
        elif not action.option_strings and action.dest in _NAME_DESTS:
            action.completer = sandbox_names  # type: ignore[attr-defined]


def script(shell: str) -> str:
    """The shell code that makes ``shell`` complete ``vmsandbox``."""
    import argcomplete

    return argcomplete.shellcode(["vmsandbox"], shell=shell)


def cmd_completion(args: argparse.Namespace, out: Out) -> int:
    code = script(args.shell)
    out.result({"shell": args.shell, "script": code}, code.rstrip("\n"))
    return 0


def add_parsers(sub: Any, common: list[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "completion",
        parents=common,
        help="print the shell code that completes vmsandbox (source it: see docs)",
    )
    parser.add_argument("shell", choices=SHELLS)


HANDLERS = {"completion": cmd_completion}
