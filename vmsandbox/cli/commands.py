"""The ``vmsandbox`` command: a thin shell over SandboxManager.

Heavy modules (libvirt, lxml, paramiko, pyudev) are imported inside the commands that need them,
so ``vmsandbox --help`` starts fast. Every failure prints ``error: CODE: message`` (or a JSON
error object with ``--json``) and exits non-zero; never a traceback.

Handlers take the parsed arguments and an ``Output`` (output.py: text, or JSON with ``--json``,
which every command accepts before or after its name, and which the commands that cannot give
JSON refuse). Only ``create``, ``pool`` and ``reconcile`` repair half-made sandboxes: reading
commands never delete anything.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from vmsandbox.cli import access, common, completion, files, images, lifetime, suspension
from vmsandbox.cli.args import build_parser, glue_negative_values
from vmsandbox.cli.output import (
    EXIT_BROKEN_PIPE,
    EXIT_CANCELLED,
    EXIT_CODES,
    JsonOutput,
    Output,
    describe,
    report_table,
    saved_size,
    table,
)
from vmsandbox.errors import InvalidArgument, VmSandboxError

__all__ = ["EXIT_CODES", "main"]

# Commands that give no result to put in JSON: an interactive session, foreground servers.
NO_JSON = {
    ("ssh",): "it is an interactive session; 'vmsandbox exec NAME --json -- CMD' gives JSON",
    ("serve",): "it is a foreground server that logs to stderr",
    ("fleet", "join"): "it runs in the foreground until stopped",
    ("fleet", "serve"): "it is a foreground server that logs to stderr",
}


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    ours, guest_argv = split_guest_command(args_list)
    ours = glue_negative_values(ours)
    # Until the arguments parse, --json anywhere in ours chooses how their error is shown.
    out: Output = JsonOutput() if "--json" in ours else Output()
    try:
        parser = build_parser()  # tens of milliseconds: built once per process
        completion.complete(parser)  # the shell asking for completions: answered, exit
        if not [arg for arg in ours if arg != "--json"]:
            if not out.json:
                parser.print_help()
            raise InvalidArgument("vmsandbox: give a command ('vmsandbox --help' lists them)")
        args = _parse(parser, ours)
        wants_json = args.json or "--json" in getattr(args, "ssh_options", ())
        out = JsonOutput() if wants_json else Output()
        _refuse_json(args)
        if guest_argv is not None:
            if args.argv:
                raise InvalidArgument(f"{args.command}: give the command once, after '--'")
            args.argv = guest_argv
        return _HANDLERS[args.command](args, out)
    except VmSandboxError as exc:
        out.error(exc)
        return EXIT_CODES.get(exc.code, 1)
    except KeyboardInterrupt:
        print("error: CANCELLED: interrupted", file=sys.stderr)
        return EXIT_CANCELLED
    except BrokenPipeError:
        # The reader left (``vmsandbox list | head``): nothing more can be said to it, and
        # Python's flush at exit must not fail again on the closed pipe.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except Exception as exc:
        if os.environ.get("VMSANDBOX_DEBUG"):
            raise
        out.error(VmSandboxError(f"{type(exc).__name__}: {exc}"))
        return 1


def _parse(parser: argparse.ArgumentParser, ours: list[str]) -> argparse.Namespace:
    """The parsed arguments; an option of the guest's written without ``--`` in front of the
    guest's command (``exec NAME uname -r``) is named with the way to write it."""
    try:
        return parser.parse_args(ours)
    except InvalidArgument as exc:
        command = next((arg for arg in ours if not arg.startswith("-")), None)
        if command in ("exec", "ssh") and "unrecognized arguments" in exc.message:
            raise InvalidArgument(
                f"{exc.message}; put the guest's command after '--': "
                f"vmsandbox {command} NAME -- CMD [ARGS...]",
                details=exc.details,
            ) from exc
        raise


def _refuse_json(args: argparse.Namespace) -> None:
    # ssh hands what follows its name to OpenSSH, so its --json arrives among them
    if not (args.json or "--json" in getattr(args, "ssh_options", ())):
        return
    for command, why in NO_JSON.items():
        if (args.command, getattr(args, "fleet_command", None))[: len(command)] == command:
            raise InvalidArgument(
                f"{' '.join(command)} takes no --json: {why}",
                details={"field": "--json", "command": " ".join(command)},
            )


def split_guest_command(args_list: list[str]) -> tuple[list[str], list[str] | None]:
    """For exec and ssh, what follows the first "--" is the guest's command line, never read
    by our parser (argparse's REMAINDER would also take our own options written after NAME).
    It is passed on whole: a guest command may itself start with "--"."""
    command = next((arg for arg in args_list if not arg.startswith("-")), None)
    if command in ("exec", "ssh") and "--" in args_list:
        cut = args_list.index("--")
        return args_list[:cut], args_list[cut + 1 :]
    return args_list, None


def _cmd_create(args: argparse.Namespace, out: Output) -> int:
    from vmsandbox.compat.cliflags import gpu_request_from_flags, parse_gpu_flag_value
    from vmsandbox.sandbox.spec import SandboxSpec

    gpu_request = gpu_request_from_flags(
        gpu=None if args.gpu is None else parse_gpu_flag_value(args.gpu),
        gpu_count=args.gpu_count,
        gpu_devices=args.gpu_device,
        gpu_all=args.gpu_all,
        gpu_vendor=args.gpu_vendor,
        gpu_model=args.gpu_model,
        gpu_memory=None if args.gpu_memory is None else f"{args.gpu_memory}Mi",
    )
    spec = SandboxSpec(
        name=args.name,
        image=args.image,
        cpus=args.cpus,
        memory_mib=args.memory,
        disk_gib=args.disk,
        virt_type=args.virt_type,
        gpu=gpu_request,
        ttl=args.ttl,
    )
    if args.dry_run:
        return _dry_run(spec, out)
    with common.manager(progress=True, reconcile=True) as manager:
        sandbox = manager.create(
            spec,
            wait=not args.no_wait,
            verify=not args.no_verify,
            keep_on_failure=args.keep_on_failure,
            timeout=args.timeout,
            refill=not args.no_refill,
        )
    out.result(sandbox.to_dict(), describe(sandbox.to_dict()))
    return 0


def _dry_run(spec: Any, out: Output) -> int:
    """``create --dry-run``: the chosen GPUs on stderr and the domain XML on stdout; with
    ``--json`` one object: the record create would write (``plan``), the GPUs and the XML."""
    from vmsandbox.sandbox.dryrun import dry_run

    with common.manager() as manager:
        planned = dry_run(manager, spec)
    xml = planned.xml()
    if out.json:
        gpus = [gpu.to_dict() for gpu in planned.record.gpus]
        out.result({"plan": planned.record.to_dict(), "gpus": gpus, "xml": xml}, "")
        return 0
    for gpu in planned.gpus:
        print(f"gpu: {gpu.bdf} {gpu.name or gpu.device_id} (NUMA {gpu.numa_node})", file=sys.stderr)
    sys.stdout.write(xml)
    return 0


def _cmd_list(_args: argparse.Namespace, out: Output) -> int:
    with common.manager() as manager:
        sandboxes = [sandbox.to_dict() for sandbox in manager.list()]
        limit = manager.config.max_saved_gib
    rows = [
        (
            s["name"],
            s["state"],
            s["image"],
            str(s["cpus"]),
            f"{s['memory_mib']}M",
            f"{s['ssh']['host']}:{s['ssh']['port']}" if s["ssh"] else "-",
            ",".join(g.get("bdf", "?") for g in s["gpus"]) or "-",
            lifetime.time_left(s),
            saved_size(s),
        )
        for s in sandboxes
    ]
    headers = ("NAME", "STATE", "IMAGE", "CPUS", "MEMORY", "SSH", "GPUS", "EXPIRES", "SAVED")
    shown = table(headers, rows)
    saved = suspension.saved_line(sandboxes, limit)
    if saved:
        shown += "\n" + saved
    data = {
        "sandboxes": sandboxes,
        "saved_bytes": sum(s["saved_bytes"] for s in sandboxes),
        "max_saved_bytes": limit * 2**30,
    }
    out.result(data, shown if rows else "no sandboxes")
    return 0


def _cmd_show(args: argparse.Namespace, out: Output) -> int:
    with common.manager() as manager:
        data = manager.get(args.name).to_dict()
    out.result(data, describe(data))
    return 0


def _cmd_destroy(args: argparse.Namespace, out: Output) -> int:
    """Destroy the names in order, stopping at the first failure; that failure's error says
    which were destroyed before it, which one failed and which were not tried."""
    from vmsandbox.validate import validate_name

    for name in args.names:
        validate_name(name)
    destroyed: list[str] = []
    with common.manager() as manager:
        for name in args.names:
            try:
                manager.destroy(name)
            except VmSandboxError as exc:
                out.error(
                    exc,
                    destroyed=destroyed,
                    failed=name,
                    not_tried=args.names[len(destroyed) + 1 :],
                )
                return EXIT_CODES.get(exc.code, 1)
            destroyed.append(name)
            if not out.json:
                print(f"destroyed {name}")
    if out.json:
        out.result({"destroyed": destroyed}, "")
    return 0


def _cmd_stop(args: argparse.Namespace, out: Output) -> int:
    with common.manager(progress=not args.json) as manager:
        data = manager.stop(args.name, grace=args.grace).to_dict()
    out.result(data, f"stopped {args.name}")
    return 0


def _cmd_start(args: argparse.Namespace, out: Output) -> int:
    with common.manager(progress=not args.json) as manager:
        data = manager.start(
            args.name, wait=not args.no_wait, verify=not args.no_verify, timeout=args.timeout
        ).to_dict()
    out.result(data, f"{args.name} is {data['state']}")
    return 0


def _cmd_serve(args: argparse.Namespace, _out: Output) -> int:
    from vmsandbox.openshell.server import serve

    return serve(args.openshell_socket, metrics_address=args.metrics_address)


def _cmd_fleet(args: argparse.Namespace, out: Output) -> int:
    from vmsandbox.fleet.cli import run  # Ray and the fleet extra are needed from here on

    return run(args, out)


def _cmd_verify(args: argparse.Namespace, out: Output) -> int:
    with common.manager() as manager:
        report = manager.verify(args.name)
    out.result(report, report_table(report).rstrip("\n"))
    return 0 if report["ok"] else EXIT_CODES["FAILED_PRECONDITION"]


def _cmd_gpus(args: argparse.Namespace, out: Output) -> int:
    from vmsandbox.cli import gpus

    return gpus.run(args, out)


def _cmd_reconcile(_args: argparse.Namespace, out: Output) -> int:
    with common.manager() as manager:
        report = manager.reconcile()
    text = "\n".join(
        [f"removed {name}" for name in report["removed"]]
        + [f"released fabric partition {p}" for p in report["fabric_partitions"]]
        + [f"settled {s}" for s in report.get("settled", [])]
        + [f"could not fix: {p}" for p in report["problems"]]
    )
    out.result(report, text or "nothing to reconcile")
    return 1 if report["problems"] else 0


def _cmd_pool(args: argparse.Namespace, out: Output) -> int:
    """``pool``: the shapes and their guests, and pooled guests of no shape; ``pool fill``
    blocks until every shape is full; ``pool drain`` removes the guests not claimed yet."""
    with common.manager(progress=args.pool_command == "fill", reconcile=True) as manager:
        if args.pool_command == "fill":
            made = manager.pool.fill(if_idle=args.if_idle)
            full = "full" if manager.config.pool else "no [pool] shapes configured: nothing to fill"
            out.result({"made": made}, "\n".join(f"made {name}" for name in made) or full)
            return 0
        if args.pool_command == "drain":
            removed = manager.pool.drain()
            text = "\n".join(f"removed {name}" for name in removed) or "the pool was empty"
            out.result({"removed": removed}, text)
            return 0
        shapes = manager.pool.show()
        unshaped = manager.pool.unshaped()
    rows = [
        (
            s["key"],
            s["image"],
            f"{s['cpus']} vCPU, {s['memory_mib']} MiB, {s['disk_gib']} GiB",
            f"{s['ready']}/{s['count']}",
            ", ".join(f"{g['name']} ({g['state']})" for g in s["guests"]) or "-",
        )
        for s in shapes
    ]
    lines = [table(("SHAPE", "IMAGE", "SIZE", "READY", "GUESTS"), rows)] if rows else []
    if not shapes:
        lines.append("no [pool] shapes configured")
    if unshaped:
        guests = ", ".join(f"{g['name']} ({g['state']}, {g['memory_mib']} MiB)" for g in unshaped)
        lines.append(
            f"pooled guests of no configured shape, still running: {guests}; "
            "'vmsandbox pool drain' removes them"
        )
    out.result({"pool": shapes, "unshaped": unshaped}, "\n".join(lines))
    return 0


_HANDLERS: dict[str, Callable[[argparse.Namespace, Output], int]] = {
    "create": _cmd_create,
    "list": _cmd_list,
    "show": _cmd_show,
    "destroy": _cmd_destroy,
    "stop": _cmd_stop,
    "start": _cmd_start,
    "serve": _cmd_serve,
    "reconcile": _cmd_reconcile,
    "gpus": _cmd_gpus,
    "verify": _cmd_verify,
    "images": images.run,
    "pool": _cmd_pool,
    "fleet": _cmd_fleet,
    **files.HANDLERS,
    **access.HANDLERS,
    **lifetime.HANDLERS,
    **suspension.HANDLERS,
    **completion.HANDLERS,
}
