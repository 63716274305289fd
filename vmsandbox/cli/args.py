"""The ``vmsandbox`` command line's grammar: every subcommand, its options and the value types
that check them (sizes, seconds, counts), each bad value an INVALID_ARGUMENT naming the flag.

``--json`` comes from a parent parser shared by every subcommand, so it is accepted before or
after the command's name.
"""

from __future__ import annotations

import argparse
import functools
import math
import re
from typing import NoReturn

from vmsandbox.errors import InvalidArgument


class _Parser(argparse.ArgumentParser):
    """argparse that raises INVALID_ARGUMENT instead of printing and exiting."""

    def error(self, message: str) -> NoReturn:
        # argparse quotes the offending arguments as typed: escape what is not printable, so
        # that no argument can add a line (or a terminal escape) to the one-line error.
        raise InvalidArgument(f"{self.prog}: {_printable(message)}")


def _printable(text: str) -> str:
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _size_mib(text: str, *, field: str = "--memory") -> int:
    from vmsandbox.cli.sizes import parse_size_mib

    example = "80Gi or 80GB" if field == "--gpu-memory" else ""
    return parse_size_mib(text, field=field, default_unit="MiB", example=example)


def _size_gib(text: str) -> int:
    from vmsandbox.cli.sizes import parse_size_gib

    return parse_size_gib(text, field="--disk")


def _seconds(text: str, *, field: str = "--timeout") -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise InvalidArgument(
            f"{field} {text!r} is not a number of seconds above 0",
            details={"field": field, "value": text},
        )
    return value


def _positive(text: str, *, field: str) -> int:
    if not text.isascii() or not text.isdigit() or int(text) < 1:
        raise InvalidArgument(
            f"{field} {text!r} is not a whole number of at least 1",
            details={"field": field, "value": text},
        )
    return int(text)


def _json_parent() -> _Parser:
    """``--json`` for every subcommand. SUPPRESS as default, so that a subcommand without it
    keeps the value the top-level parser read (``vmsandbox --json list``)."""
    parent = _Parser(add_help=False)
    parent.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output"
    )
    return parent


def build_parser() -> argparse.ArgumentParser:
    from vmsandbox import __version__

    parser = _Parser(prog="vmsandbox", description="libvirt VM sandboxes with GPU passthrough")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--version", action="version", version=f"vmsandbox {__version__}")
    common = [_json_parent()]
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    create = sub.add_parser("create", parents=common, help="create and boot a sandbox")
    create.add_argument("name", nargs="?", help="sandbox name (generated when omitted)")
    create.add_argument("--image", default="minimal", help="base image (default: minimal)")
    create.add_argument("--cpus", type=functools.partial(_positive, field="--cpus"), default=1)
    create.add_argument(
        "--memory", type=_size_mib, default=1024, help="e.g. 2048 (MiB), 2G (default 1024 MiB)"
    )
    create.add_argument("--disk", type=_size_gib, default=4, help="e.g. 20 (GiB), 20G (default 4)")
    create.add_argument("--virt-type", choices=("auto", "kvm", "qemu"), default="auto")
    create.add_argument("--timeout", type=_seconds, help="seconds to wait for SSH")
    from vmsandbox.cli.lifetime import ttl

    create.add_argument(
        "--ttl", type=ttl, metavar="DURATION", help="destroy it after this long (30m, 2h, 1d)"
    )
    create.add_argument("--no-wait", action="store_true", help="return once the domain runs")
    create.add_argument(
        "--no-refill",
        action="store_true",
        help="after claiming a pooled guest, leave the pool one short (no background fill)",
    )
    create.add_argument(
        "--no-verify", action="store_true", help="skip checking the GPUs from inside the guest"
    )
    create.add_argument(
        "--keep-on-failure",
        action="store_true",
        help="keep the sandbox when GPU verification fails (for inspection)",
    )
    create.add_argument(
        "--dry-run",
        action="store_true",
        help="choose GPUs and print the domain XML (stdout) and GPUs (stderr); define nothing",
    )
    gpu = create.add_argument_group("GPUs (OpenShell driver flags)")
    gpu.add_argument("--gpu", nargs="?", const="1", metavar="N", help="one free GPU, or N")
    gpu.add_argument(
        "--gpu-count",
        type=functools.partial(_positive, field="--gpu-count"),
        metavar="N",
        help="exactly N GPUs",
    )
    gpu.add_argument(
        "--gpu-device",
        action="append",
        default=[],
        metavar="ID",
        help="a GPU by PCI address, NVIDIA UUID or inventory index (repeatable)",
    )
    gpu.add_argument("--gpu-all", action="store_true", help="every free GPU")
    gpu.add_argument("--gpu-vendor", choices=("nvidia", "amd"))
    gpu.add_argument("--gpu-model", metavar="MODEL", help="e.g. H100 (whole words)")
    gpu.add_argument(
        "--gpu-memory",
        type=functools.partial(_size_mib, field="--gpu-memory"),
        metavar="SIZE",
        help="minimum memory per GPU, e.g. 80Gi (binary) or 80GB (decimal)",
    )

    gpus = sub.add_parser(
        "gpus",
        parents=common,
        help="list this host's GPUs, whether they can be passed and their custody state",
    )
    gpus.add_argument(
        "gpus_command",
        nargs="?",
        choices=("check", "release", "watch"),
        help="check BDF: reset, re-check and free a quarantined GPU; release BDF --force: "
        "free one without a reset (logged); watch: the health monitor, in the foreground",
    )
    gpus.add_argument("bdf", nargs="?", help="the GPU: PCI address, index or UUID")
    gpus.add_argument("--force", action="store_true", help="release: free it without a reset")
    sub.add_parser("list", parents=common, help="list sandboxes")
    sub.add_parser("show", parents=common, help="show one sandbox").add_argument("name")

    exec_ = sub.add_parser(
        "exec", parents=common, help="run a command in a sandbox (exit status is its own)"
    )
    exec_.add_argument("name")
    exec_.add_argument("argv", nargs="*", help="-- CMD [ARGS...] (after '--', whole)")
    exec_.add_argument("--timeout", type=_seconds)
    from vmsandbox.cli.access import add_exec_options, add_ssh_options

    add_exec_options(exec_)

    ssh = sub.add_parser(
        "ssh", parents=common, help="interactive OpenSSH session with the pinned host key"
    )
    ssh.add_argument("name")
    add_ssh_options(ssh)

    destroy = sub.add_parser("destroy", parents=common, help="stop and remove sandboxes")
    destroy.add_argument("names", nargs="+")

    stop = sub.add_parser("stop", parents=common, help="shut a sandbox down, disk and GPUs kept")
    stop.add_argument("name")
    stop.add_argument(
        "--grace",
        type=functools.partial(_seconds, field="--grace"),
        default=60.0,
        help="seconds before power-off (default 60)",
    )
    start = sub.add_parser("start", parents=common, help="start a stopped sandbox")
    start.add_argument("name")
    start.add_argument("--no-wait", action="store_true", help="return once the domain runs")
    start.add_argument("--no-verify", action="store_true", help="skip the in-guest GPU check")
    start.add_argument("--timeout", type=_seconds)

    serve = sub.add_parser(
        "serve", parents=common, help="serve the OpenShell compute-driver API (foreground)"
    )
    serve.add_argument(
        "--openshell-socket",
        metavar="PATH",
        required=True,
        help="Unix socket the OpenShell gateway dials (its folder is made 0700)",
    )
    serve.add_argument(
        "--metrics-address",
        metavar="HOST:PORT",
        help="export Prometheus metrics over HTTP there (needs the fleet extra)",
    )

    verify = sub.add_parser(
        "verify", parents=common, help="re-check a sandbox's GPUs from inside the guest"
    )
    verify.add_argument("name")

    sub.add_parser("reconcile", parents=common, help="remove half-made sandboxes")

    pool = sub.add_parser("pool", parents=common, help="show, fill or drain the warm pool")
    pool.add_argument(
        "pool_command",
        nargs="?",
        choices=("show", "fill", "drain"),
        default="show",
        help="show (default); fill: boot guests until every shape is full; drain: remove them",
    )
    pool.add_argument(
        "--if-idle",
        action="store_true",
        help="fill: return at once when another fill runs (background refills use it)",
    )

    images = sub.add_parser("images", parents=common, help="build, import and list guest images")
    images_sub = images.add_subparsers(dest="images_command", required=True, parser_class=_Parser)
    build = images_sub.add_parser(
        "build", parents=common, help="build an image from its recipe in images/"
    )
    build.add_argument("recipe")
    build.add_argument("--force", action="store_true", help="rebuild even when cached")
    images_sub.add_parser("list", parents=common, help="list built images")
    imp = images_sub.add_parser("import", parents=common, help="import a qcow2 or raw disk image")
    imp.add_argument("path")
    imp.add_argument("name")
    imp.add_argument(
        "--replace",
        action="store_true",
        help="replace the image NAME is now (a recipe's build or another import)",
    )
    rm = images_sub.add_parser(
        "rm", parents=common, help="remove an image, all its builds (none may be in use)"
    )
    rm.add_argument("name")
    images_sub.add_parser(
        "prune", parents=common, help="remove builds that are not current and that no sandbox uses"
    )
    from vmsandbox.fleet.cli import add_parser as add_fleet  # no Ray: that comes when one runs

    add_fleet(sub, common)
    from vmsandbox.cli import access, completion, files, lifetime, suspension

    for module in (files, access, lifetime, suspension, completion):
        module.add_parsers(sub, common)
    return parser


# Options whose value may be typed negative: argparse would take "-1G" for an option and answer
# "expected one argument"; glued as "--memory=-1G", the value reaches its check and is named.
_NUMBER_OPTIONS = (
    *("--memory", "--disk", "--cpus", "--timeout", "--grace", "--gpu-count", "--gpu-memory"),
    *("--ttl", "--lines"),
)


def glue_negative_values(args_list: list[str]) -> list[str]:
    """``--memory -1G`` as ``--memory=-1G``, so a negative size is named by its own check."""
    glued: list[str] = []
    for arg in args_list:
        if glued and glued[-1] in _NUMBER_OPTIONS and re.match(r"-[0-9.]", arg):
            glued[-1] = f"{glued[-1]}={arg}"
        else:
            glued.append(arg)
    return glued
