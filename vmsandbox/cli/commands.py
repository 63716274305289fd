"""The ``vmsandbox`` command: a thin shell over SandboxManager.

Heavy modules (libvirt, lxml, paramiko, pyudev) are imported inside the commands that need them,
so ``vmsandbox --help`` starts fast. Every failure prints ``error: CODE: message`` (or a JSON
error object with ``--json``) and exits non-zero; never a traceback.

Handlers take the parsed arguments and an ``Output`` (text or JSON, chosen by ``--json``, which
every command accepts before or after its name). Only ``create`` and ``reconcile`` repair
half-made sandboxes: reading commands never delete anything.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from vmsandbox.cli.args import build_parser, glue_negative_values
from vmsandbox.errors import InvalidArgument, VmSandboxError

if TYPE_CHECKING:  # imported inside the commands that need them, so --help starts fast
    from vmsandbox.config import Config
    from vmsandbox.image.store import ImageStore

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


class Output:
    """Where a command's result goes: a text writer; ``JsonOutput`` writes JSON instead."""

    json = False

    def result(self, data: Any, text: str) -> None:
        """The command's result: ``text`` for people, ``data`` for programs."""
        print(text)

    def error(self, exc: VmSandboxError, **extra: Any) -> None:
        """A failure: ``error: CODE: message`` on stderr (a failed verification's table first);
        ``extra`` is what the command did before it failed (JSON output carries it)."""
        if isinstance(exc.details.get("verification"), dict):
            print(_report_table(exc.details["verification"]), file=sys.stderr)
        print(f"error: {exc.code}: {exc.message}", file=sys.stderr)


class JsonOutput(Output):
    """One JSON object on stdout, the result or ``{"error": {...}}`` beside what was done."""

    json = True

    def result(self, data: Any, text: str) -> None:
        print(json.dumps(data, indent=2))

    def error(self, exc: VmSandboxError, **extra: Any) -> None:
        print(json.dumps({**extra, "error": exc.to_dict()}, indent=2))


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    ours, guest_argv = _split_guest_command(args_list)
    ours = glue_negative_values(ours)
    # Until the arguments parse, --json anywhere in ours chooses how their error is shown.
    out: Output = JsonOutput() if "--json" in ours else Output()
    try:
        args = build_parser().parse_args(ours)
        out = JsonOutput() if args.json else Output()
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
        return 130
    except BrokenPipeError:
        # The reader left (``vmsandbox list | head``): nothing more can be said to it, and
        # Python's flush at exit must not fail again on the closed pipe.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as exc:
        if os.environ.get("VMSANDBOX_DEBUG"):
            raise
        out.error(VmSandboxError(f"{type(exc).__name__}: {exc}"))
        return 1


def _split_guest_command(args_list: list[str]) -> tuple[list[str], list[str] | None]:
    """For exec and ssh, what follows the first "--" is the guest's command line, never read
    by our parser (argparse's REMAINDER would also take our own options written after NAME).
    It is passed on whole: a guest command may itself start with "--"."""
    command = next((arg for arg in args_list if not arg.startswith("-")), None)
    if command in ("exec", "ssh") and "--" in args_list:
        cut = args_list.index("--")
        return args_list[:cut], args_list[cut + 1 :]
    return args_list, None


def _manager(*, progress: bool = False, reconcile: bool = False) -> Any:
    """A SandboxManager; ``reconcile`` only for the commands that repair (create, reconcile)."""
    from vmsandbox.progress import StderrProgress, silent
    from vmsandbox.sandbox.manager import SandboxManager

    return SandboxManager(progress=StderrProgress() if progress else silent, reconcile=reconcile)


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
        gpu_memory=args.gpu_memory,
    )
    spec = SandboxSpec(
        name=args.name,
        image=args.image,
        cpus=args.cpus,
        memory_mib=args.memory,
        disk_gib=args.disk,
        virt_type=args.virt_type,
        gpu=gpu_request,
    )
    if args.dry_run:
        with _manager() as manager:
            xml, chosen = manager.dry_run(spec)
        for gpu in chosen:
            print(
                f"gpu: {gpu.bdf} {gpu.name or gpu.device_id} (NUMA {gpu.numa_node})",
                file=sys.stderr,
            )
        sys.stdout.write(xml)
        return 0
    with _manager(progress=True, reconcile=True) as manager:
        sandbox = manager.create(
            spec,
            wait=not args.no_wait,
            verify=not args.no_verify,
            keep_on_failure=args.keep_on_failure,
            timeout=args.timeout,
            refill=not args.no_refill,
        )
    out.result(sandbox.to_dict(), _describe(sandbox.to_dict()))
    return 0


def _cmd_list(_args: argparse.Namespace, out: Output) -> int:
    with _manager() as manager:
        sandboxes = [sandbox.to_dict() for sandbox in manager.list()]
    rows = [
        (
            s["name"],
            s["state"],
            s["image"],
            str(s["cpus"]),
            f"{s['memory_mib']}M",
            f"{s['ssh']['host']}:{s['ssh']['port']}" if s["ssh"] else "-",
            ",".join(g.get("bdf", "?") for g in s["gpus"]) or "-",
        )
        for s in sandboxes
    ]
    table = _table(("NAME", "STATE", "IMAGE", "CPUS", "MEMORY", "SSH", "GPUS"), rows)
    out.result({"sandboxes": sandboxes}, table if rows else "no sandboxes")
    return 0


def _cmd_show(args: argparse.Namespace, out: Output) -> int:
    with _manager() as manager:
        data = manager.get(args.name).to_dict()
    out.result(data, _describe(data))
    return 0


def _cmd_exec(args: argparse.Namespace, _out: Output) -> int:
    if not args.argv:
        raise InvalidArgument("exec needs a command: vmsandbox exec NAME -- CMD [ARGS...]")
    with _manager() as manager:
        result = manager.exec(
            args.name,
            list(args.argv),
            timeout=args.timeout,
            stdout=sys.stdout.buffer,
            stderr=sys.stderr.buffer,
        )
    return result.exit_status


def _cmd_ssh(args: argparse.Namespace, _out: Output) -> int:
    with _manager() as manager:
        command = manager.ssh_argv(args.name, list(args.argv))
    sys.stdout.flush()
    os.execvp(command[0], command)
    return 0  # not reached


def _cmd_destroy(args: argparse.Namespace, out: Output) -> int:
    """Destroy the names in order, stopping at the first failure; that failure's error says
    which were destroyed before it, which one failed and which were not tried."""
    from vmsandbox.validate import validate_name

    for name in args.names:
        validate_name(name)
    destroyed: list[str] = []
    with _manager() as manager:
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
    with _manager() as manager:
        data = manager.stop(args.name, grace=args.grace).to_dict()
    out.result(data, f"stopped {args.name}")
    return 0


def _cmd_start(args: argparse.Namespace, out: Output) -> int:
    with _manager(progress=not args.json) as manager:
        data = manager.start(
            args.name, wait=not args.no_wait, verify=not args.no_verify, timeout=args.timeout
        ).to_dict()
    out.result(data, f"started {args.name} ({data['state']})")
    return 0


def _cmd_serve(args: argparse.Namespace, _out: Output) -> int:
    from vmsandbox.openshell.server import serve

    return serve(args.openshell_socket, metrics_address=args.metrics_address)


def _cmd_fleet(args: argparse.Namespace, out: Output) -> int:
    from vmsandbox.fleet.cli import run  # Ray and the fleet extra are needed from here on

    return run(args, out)


def _cmd_verify(args: argparse.Namespace, out: Output) -> int:
    with _manager() as manager:
        report = manager.verify(args.name)
    out.result(report, _report_table(report))
    return 0 if report["ok"] else EXIT_CODES["FAILED_PRECONDITION"]


def _report_table(report: dict[str, Any]) -> str:
    from vmsandbox.guest.verify import VerificationReport, render_report

    return render_report(VerificationReport.from_dict(report))


def _cmd_gpus(args: argparse.Namespace, out: Output) -> int:
    from vmsandbox.cli import gpus

    return gpus.run(args, out)


def _cmd_reconcile(_args: argparse.Namespace, out: Output) -> int:
    with _manager() as manager:
        report = manager.reconcile()
    text = "\n".join(
        [f"removed {name}" for name in report["removed"]]
        + [f"released fabric partition {p}" for p in report["fabric_partitions"]]
        + [f"could not fix: {p}" for p in report["problems"]]
    )
    out.result(report, text or "nothing to reconcile")
    return 1 if report["problems"] else 0


def _cmd_pool(args: argparse.Namespace, out: Output) -> int:
    """``pool``: the shapes and their guests; ``pool fill`` blocks until every shape is full;
    ``pool drain`` removes the guests not claimed yet."""
    with _manager(progress=args.pool_command == "fill", reconcile=True) as manager:
        if args.pool_command == "fill":
            made = manager.pool.fill(if_idle=args.if_idle)
            out.result({"made": made}, "\n".join(f"made {name}" for name in made) or "full")
            return 0
        if args.pool_command == "drain":
            removed = manager.pool.drain()
            text = "\n".join(f"removed {name}" for name in removed) or "the pool was empty"
            out.result({"removed": removed}, text)
            return 0
        shapes = manager.pool.show()
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
    table = _table(("SHAPE", "IMAGE", "SIZE", "READY", "GUESTS"), rows)
    out.result({"pool": shapes}, table if rows else "no [pool] shapes configured")
    return 0


def _cmd_images(args: argparse.Namespace, out: Output) -> int:
    from pathlib import Path

    from vmsandbox.config import Config
    from vmsandbox.image.store import ImageStore
    from vmsandbox.progress import StderrProgress

    config = Config.load()
    store = ImageStore(config.images)
    if args.images_command in ("rm", "prune"):
        return _images_remove(args, config, store, out)
    if args.images_command == "build":
        image = store.build(args.recipe, force=args.force, progress=StderrProgress())
        out.result(image.to_dict(), f"built {image.name} ({image.id}) at {image.disk}")
    elif args.images_command == "import":
        image = store.import_image(
            Path(args.path),
            args.name,
            max_disk_gib=config.max_disk_gib,
            progress=StderrProgress(),
        )
        out.result(image.to_dict(), f"imported {image.name} ({image.id}) at {image.disk}")
    else:
        images = [image.to_dict() for image in store.list()]
        rows = [
            (
                i["name"],
                i["id"],
                i.get("kind", "?"),
                i.get("kernel_version", "-"),
                f"{i.get('virtual_size', 0) / 2**30:.1f}G",
                i.get("built_at", "?"),
            )
            for i in images
        ]
        table = _table(("NAME", "ID", "KIND", "KERNEL", "SIZE", "BUILT"), rows)
        out.result({"images": images}, table if rows else "no images built")
    return 0


def _images_remove(args: argparse.Namespace, config: Config, store: ImageStore, out: Output) -> int:
    """``images rm NAME`` and ``images prune``: what was removed and the disk space freed."""
    from vmsandbox.image.users import image_users
    from vmsandbox.vm.hypervisor import open_connection

    conn = open_connection(config.uri)
    try:
        users = functools.partial(image_users, conn, store)
        if args.images_command == "rm":
            removed = store.remove(args.name, users)
        else:
            removed = store.prune(users)
    finally:
        conn.close()
    freed = sum(build.bytes for build in removed)
    lines = [f"removed {b.name} {b.id} ({_mib(b.bytes)})" for b in removed]
    text = "\n".join([*lines, f"freed {_mib(freed)}"]) if removed else "nothing to remove"
    out.result({"removed": [build.to_dict() for build in removed], "freed_bytes": freed}, text)
    return 0


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def _describe(data: dict[str, Any]) -> str:
    ssh = data.get("ssh")
    lines = [
        f"name:      {data['name']}",
        f"state:     {data['state']}",
        f"image:     {data['image']}",
        f"size:      {data['cpus']} vCPU, {data['memory_mib']} MiB, {data['disk_gib']} GiB disk",
        f"virt:      {data['virt_type']}",
        f"ssh:       {ssh['user']}@{ssh['host']}:{ssh['port']}" if ssh else "ssh:       -",
        f"connect:   vmsandbox ssh {data['name']}",
    ]
    if data.get("boot_seconds") is not None:
        lines.append(f"boot:      SSH ready after {data['boot_seconds']}s")
    if data.get("stage_seconds"):
        steps = ", ".join(f"{step} {secs:.3f}s" for step, secs in data["stage_seconds"].items())
        lines.append(f"claim:     {steps}")
    for gpu in data.get("gpus", []):
        lines.append(f"gpu:       {gpu.get('bdf')} {gpu.get('name') or ''}".rstrip())
    if data.get("verification"):
        lines += ["verification:", _report_table(data["verification"])]
    return "\n".join(lines)


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    from vmsandbox.tables import render_grid

    return "\n".join(render_grid(headers, rows))


_HANDLERS: dict[str, Callable[[argparse.Namespace, Output], int]] = {
    "create": _cmd_create,
    "list": _cmd_list,
    "show": _cmd_show,
    "exec": _cmd_exec,
    "ssh": _cmd_ssh,
    "destroy": _cmd_destroy,
    "stop": _cmd_stop,
    "start": _cmd_start,
    "serve": _cmd_serve,
    "reconcile": _cmd_reconcile,
    "gpus": _cmd_gpus,
    "verify": _cmd_verify,
    "images": _cmd_images,
    "pool": _cmd_pool,
    "fleet": _cmd_fleet,
}
