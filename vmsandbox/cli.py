"""The ``vmsandbox`` command: a thin shell over SandboxManager.

Heavy modules (libvirt, lxml, paramiko, pyudev) are imported inside the commands that need them,
so ``vmsandbox --help`` starts fast. Every failure prints ``error: CODE: message`` (or a JSON
error object with ``--json``) and exits non-zero; never a traceback.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from vmsandbox.errors import InvalidArgument, VmSandboxError

if TYPE_CHECKING:  # imported inside the commands that need them, so --help starts fast
    from vmsandbox.config import Config
    from vmsandbox.images import ImageStore

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


class _Parser(argparse.ArgumentParser):
    """argparse that raises INVALID_ARGUMENT instead of printing and exiting."""

    def error(self, message: str) -> NoReturn:
        # argparse quotes the offending arguments as typed: escape what is not printable, so
        # that no argument can add a line (or a terminal escape) to the one-line error.
        raise InvalidArgument(f"{self.prog}: {_printable(message)}")


def _printable(text: str) -> str:
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _size_mib(text: str) -> int:
    from vmsandbox.sizes import parse_size_mib

    return parse_size_mib(text, field="--memory", default_unit="MiB")


def _size_gib(text: str) -> int:
    from vmsandbox.sizes import parse_size_mib

    mib = parse_size_mib(text, field="--disk", default_unit="GiB")
    if mib % 1024:
        raise InvalidArgument(f"--disk {text!r} must be a whole number of GiB (e.g. 10G, 10GiB)")
    return mib // 1024


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise InvalidArgument(
            f"--timeout {text!r} is not a number of seconds above 0",
            details={"field": "--timeout", "value": text},
        )
    return value


def _positive(text: str, *, field: str) -> int:
    if not text.isascii() or not text.isdigit() or int(text) < 1:
        raise InvalidArgument(
            f"{field} {text!r} is not a whole number of at least 1",
            details={"field": field, "value": text},
        )
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="vmsandbox", description="libvirt VM sandboxes with GPU passthrough")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    create = sub.add_parser("create", help="create and boot a sandbox")
    create.add_argument("name", nargs="?", help="sandbox name (generated when omitted)")
    create.add_argument("--image", default="minimal", help="base image (default: minimal)")
    create.add_argument("--cpus", type=functools.partial(_positive, field="--cpus"), default=1)
    create.add_argument("--memory", type=_size_mib, default=1024, help="e.g. 2048, 2G (MiB)")
    create.add_argument("--disk", type=_size_gib, default=4, help="e.g. 10, 10G (GiB)")
    create.add_argument("--virt-type", choices=("auto", "kvm", "qemu"), default="auto")
    create.add_argument("--timeout", type=_seconds, help="seconds to wait for SSH")
    create.add_argument("--no-wait", action="store_true", help="return once the domain runs")
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
    create.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
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
    gpu.add_argument("--gpu-memory", metavar="SIZE", help="minimum memory per GPU, e.g. 80Gi")

    gpus = sub.add_parser("gpus", help="list this host's GPUs and whether they can be passed")
    gpus.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )

    sub.add_parser("list", help="list sandboxes").add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )
    show = sub.add_parser("show", help="show one sandbox")
    show.add_argument("name")
    show.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )

    exec_ = sub.add_parser("exec", help="run a command in a sandbox (exit status is its own)")
    exec_.add_argument("name")
    exec_.add_argument("argv", nargs="*", help="-- CMD [ARGS...]")
    exec_.add_argument("--timeout", type=_seconds)

    ssh = sub.add_parser("ssh", help="interactive OpenSSH session with the pinned host key")
    ssh.add_argument("name")
    ssh.add_argument("argv", nargs="*", help="[-- CMD [ARGS...]]")

    destroy = sub.add_parser("destroy", help="stop and remove sandboxes")
    destroy.add_argument("names", nargs="+")
    destroy.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )

    verify = sub.add_parser("verify", help="re-check a sandbox's GPUs from inside the guest")
    verify.add_argument("name")
    verify.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )

    reconcile = sub.add_parser("reconcile", help="remove half-made sandboxes")
    reconcile.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )

    images = sub.add_parser("images", help="build, import and list guest images")
    images_sub = images.add_subparsers(dest="images_command", required=True, parser_class=_Parser)
    build = images_sub.add_parser("build", help="build an image from its recipe in images/")
    build.add_argument("recipe")
    build.add_argument("--force", action="store_true", help="rebuild even when cached")
    build.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )
    images_sub.add_parser("list", help="list built images").add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )
    imp = images_sub.add_parser("import", help="import a qcow2 or raw disk image")
    imp.add_argument("path")
    imp.add_argument("name")
    imp.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )
    rm = images_sub.add_parser("rm", help="remove an image, all its builds (none may be in use)")
    rm.add_argument("name")
    rm.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )
    images_sub.add_parser(
        "prune", help="remove builds that are not current and that no sandbox uses"
    ).add_argument("--json", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    ours, guest_argv = _split_guest_command(args_list)
    ours = _glue_negative_values(ours)
    want_json = "--json" in ours
    try:
        args = build_parser().parse_args(ours)
        if guest_argv is not None:
            if args.argv:
                raise InvalidArgument(f"{args.command}: give the command once, after '--'")
            args.argv = guest_argv
        return _dispatch(args)
    except VmSandboxError as exc:
        _print_error(exc, want_json)
        return EXIT_CODES.get(exc.code, 1)
    except KeyboardInterrupt:
        print("error: CANCELLED: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if os.environ.get("VMSANDBOX_DEBUG"):
            raise
        _print_error(VmSandboxError(f"{type(exc).__name__}: {exc}"), want_json)
        return 1


# Options whose value may be typed negative: argparse would take "-1G" for an option and answer
# "expected one argument"; glued as "--memory=-1G", the value reaches its check and is named.
_NUMBER_OPTIONS = ("--memory", "--disk", "--cpus", "--timeout", "--gpu-count", "--gpu-memory")


def _glue_negative_values(args_list: list[str]) -> list[str]:
    glued: list[str] = []
    for arg in args_list:
        if glued and glued[-1] in _NUMBER_OPTIONS and re.match(r"-[0-9.]", arg):
            glued[-1] = f"{glued[-1]}={arg}"
        else:
            glued.append(arg)
    return glued


def _split_guest_command(args_list: list[str]) -> tuple[list[str], list[str] | None]:
    """For exec and ssh, what follows the first "--" is the guest's command line, never read
    by our parser (argparse's REMAINDER would also take our own options written after NAME)."""
    command = next((arg for arg in args_list if not arg.startswith("-")), None)
    if command in ("exec", "ssh") and "--" in args_list:
        cut = args_list.index("--")
        return args_list[:cut], args_list[cut + 1 :]
    return args_list, None


def _print_error(exc: VmSandboxError, want_json: bool) -> None:
    if want_json:
        print(json.dumps({"error": exc.to_dict()}, indent=2))
    else:
        if isinstance(exc.details.get("verification"), dict):
            print(_report_table(exc.details["verification"]), file=sys.stderr)
        print(f"error: {exc.code}: {exc.message}", file=sys.stderr)


def _emit(data: Any, text: str) -> None:
    print(json.dumps(data, indent=2) if _JSON else text)


_JSON = False


def _manager(progress: bool = True) -> Any:
    from vmsandbox.manager import SandboxManager
    from vmsandbox.progress import StderrProgress, silent

    return SandboxManager(progress=StderrProgress() if progress else silent)


def _dispatch(args: argparse.Namespace) -> int:
    global _JSON
    _JSON = bool(getattr(args, "json", False))
    handler = _HANDLERS[args.command]
    return handler(args)


def _cmd_create(args: argparse.Namespace) -> int:
    from vmsandbox.compat.cliflags import gpu_request_from_flags, parse_gpu_flag_value
    from vmsandbox.spec import SandboxSpec

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
        with _manager(progress=False) as manager:
            xml, chosen = manager.dry_run(spec)
        for gpu in chosen:
            print(
                f"gpu: {gpu.bdf} {gpu.name or gpu.device_id} (NUMA {gpu.numa_node})",
                file=sys.stderr,
            )
        sys.stdout.write(xml)
        return 0
    with _manager() as manager:
        sandbox = manager.create(
            spec,
            wait=not args.no_wait,
            verify=not args.no_verify,
            keep_on_failure=args.keep_on_failure,
            timeout=args.timeout,
        )
    _emit(sandbox.to_dict(), _describe(sandbox.to_dict()))
    return 0


def _cmd_list(_args: argparse.Namespace) -> int:
    with _manager(progress=False) as manager:
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
    _emit({"sandboxes": sandboxes}, table if rows else "no sandboxes")
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    with _manager(progress=False) as manager:
        data = manager.get(args.name).to_dict()
    _emit(data, _describe(data))
    return 0


def _cmd_exec(args: argparse.Namespace) -> int:
    argv = list(args.argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise InvalidArgument("exec needs a command: vmsandbox exec NAME -- CMD [ARGS...]")
    with _manager(progress=False) as manager:
        result = manager.exec(
            args.name,
            argv,
            timeout=args.timeout,
            stdout=sys.stdout.buffer,
            stderr=sys.stderr.buffer,
        )
    return result.exit_status


def _cmd_ssh(args: argparse.Namespace) -> int:
    argv = list(args.argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    with _manager(progress=False) as manager:
        command = manager.ssh_argv(args.name, argv)
    sys.stdout.flush()
    os.execvp(command[0], command)
    return 0  # not reached


def _cmd_destroy(args: argparse.Namespace) -> int:
    from vmsandbox.spec import validate_name

    for name in args.names:
        validate_name(name)
    with _manager(progress=False) as manager:
        for name in args.names:
            manager.destroy(name)
            if not _JSON:
                print(f"destroyed {name}")
    if _JSON:
        print(json.dumps({"destroyed": args.names}))
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    with _manager(progress=False) as manager:
        report = manager.verify(args.name)
    _emit(report, _report_table(report))
    return 0 if report["ok"] else EXIT_CODES["FAILED_PRECONDITION"]


def _report_table(report: dict[str, Any]) -> str:
    from vmsandbox.verify import VerificationReport, render_report

    return render_report(VerificationReport.from_dict(report))


def _cmd_gpus(_args: argparse.Namespace) -> int:
    from vmsandbox.host import render_table

    with _manager(progress=False) as manager:
        inventory = manager.gpus()
    if _JSON:
        print(json.dumps(inventory.to_dict(), indent=2))
    else:
        sys.stdout.write(render_table(inventory))
    return 0


def _cmd_reconcile(_args: argparse.Namespace) -> int:
    from vmsandbox.manager import SandboxManager

    with SandboxManager(reconcile=False) as manager:
        report = manager.reconcile()
    text = "\n".join(
        [f"removed {name}" for name in report["removed"]]
        + [f"could not fix: {p}" for p in report["problems"]]
    )
    _emit(report, text or "nothing to reconcile")
    return 1 if report["problems"] else 0


def _cmd_images(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vmsandbox.config import Config
    from vmsandbox.images import ImageStore
    from vmsandbox.progress import StderrProgress

    config = Config.load()
    store = ImageStore(config.images)
    if args.images_command in ("rm", "prune"):
        return _images_remove(args, config, store)
    if args.images_command == "build":
        image = store.build(args.recipe, force=args.force, progress=StderrProgress())
        _emit(image.to_dict(), f"built {image.name} ({image.id}) at {image.disk}")
    elif args.images_command == "import":
        image = store.import_image(
            Path(args.path),
            args.name,
            max_disk_gib=config.max_disk_gib,
            progress=StderrProgress(),
        )
        _emit(image.to_dict(), f"imported {image.name} ({image.id}) at {image.disk}")
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
        _emit({"images": images}, table if rows else "no images built")
    return 0


def _images_remove(args: argparse.Namespace, config: Config, store: ImageStore) -> int:
    """``images rm NAME`` and ``images prune``: what was removed and the disk space freed."""
    from vmsandbox.hypervisor import open_connection
    from vmsandbox.image_users import image_users

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
    _emit({"removed": [build.to_dict() for build in removed], "freed_bytes": freed}, text)
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
    for gpu in data.get("gpus", []):
        lines.append(f"gpu:       {gpu.get('bdf')} {gpu.get('name') or ''}".rstrip())
    if data.get("verification"):
        lines += ["verification:", _report_table(data["verification"])]
    return "\n".join(lines)


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows, strict=False)]
    return "\n".join(
        "  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=False)).rstrip()
        for row in (headers, *rows)
    )


_HANDLERS = {
    "create": _cmd_create,
    "list": _cmd_list,
    "show": _cmd_show,
    "exec": _cmd_exec,
    "ssh": _cmd_ssh,
    "destroy": _cmd_destroy,
    "reconcile": _cmd_reconcile,
    "gpus": _cmd_gpus,
    "verify": _cmd_verify,
    "images": _cmd_images,
}


if __name__ == "__main__":
    sys.exit(main())
