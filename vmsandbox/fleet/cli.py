"""``vmsandbox fleet ...``: join a host, serve a gateway, and create, list, destroy and show
hosts through the fleet. The ``vmsandbox`` command adds these subcommands (``add_parser``) and
runs them (``run``); Ray is imported only when one runs.

Every command but ``join`` reaches the cluster at ``--address`` (default:
$VMSANDBOX_FLEET_ADDRESS) as gateway ``--gateway`` (default: ``default``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from collections.abc import Sequence
from typing import Any

from vmsandbox.errors import InvalidArgument


def _count(text: str, *, field: str, least: int = 0) -> int:
    if not text.isascii() or not text.isdigit() or int(text) < least:
        raise InvalidArgument(
            f"{field} {text!r} is not a whole number of at least {least}",
            details={"field": field, "value": text},
        )
    return int(text)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise InvalidArgument(
            f"--place-timeout {text!r} is not a number of seconds above 0",
            details={"field": "--place-timeout", "value": text},
        )
    return value


def add_parser(sub: Any, parents: Sequence[argparse.ArgumentParser]) -> None:
    """``fleet`` and its subcommands, on the ``vmsandbox`` parser's subcommands ``sub``."""
    fleet = sub.add_parser("fleet", parents=parents, help="many hosts as one, through Ray")
    commands = fleet.add_subparsers(dest="fleet_command", required=True, parser_class=type(fleet))

    def command(name: str, text: str, *, cluster: bool = True) -> argparse.ArgumentParser:
        parser = commands.add_parser(name, parents=parents, help=text)
        if cluster:
            parser.add_argument(
                "--address",
                default=os.environ.get("VMSANDBOX_FLEET_ADDRESS"),
                help="the Ray head, HOST:PORT (default: $VMSANDBOX_FLEET_ADDRESS)",
            )
            parser.add_argument("--gateway", default="default", help="the gateway's name")
        return parser

    join = command("join", "join this host to the fleet (foreground)", cluster=False)
    join.add_argument("address", help="the Ray head, HOST:PORT, on the fleet's private network")
    join.add_argument(
        "--openshell-socket", metavar="PATH", required=True, help="this host's `vmsandbox serve`"
    )
    join.add_argument("--name", help="the host's name in the fleet (default: the host name)")
    join.add_argument("--node-ip", help="this host's address on the fleet's private network")
    join.add_argument("--temp-dir", help="Ray's folder for this node (default: Ray's, /tmp/ray)")
    join.add_argument(
        "--machine-key",
        metavar="FILE",
        help="this machine's key, which the host's name is bound to (default: "
        "fleet/machine.key under the state directory; made at the first join)",
    )

    serve = command("serve", "serve the fleet as one OpenShell compute driver (foreground)")
    serve.add_argument("--openshell-socket", metavar="PATH", required=True)
    serve.add_argument("--metrics-address", metavar="HOST:PORT", help="export Prometheus metrics")
    serve.add_argument("--place-timeout", type=_seconds, default=5.0)

    create = command("create", "create a sandbox on the host Ray chooses")
    create.add_argument("--id", dest="sandbox_id", help="the sandbox id (default: a new UUID)")
    create.add_argument("--name", default="", help="the sandbox name")
    create.add_argument("--image", default="", help="base image (default: minimal)")
    create.add_argument("--cpus", type=lambda t: _count(t, field="--cpus", least=1), default=1)
    create.add_argument(
        "--memory-mib", type=lambda t: _count(t, field="--memory-mib", least=1), default=1024
    )
    create.add_argument("--gpus", type=lambda t: _count(t, field="--gpus"), default=0)
    create.add_argument("--gpu-model", help="e.g. H100 (whole words)")
    create.add_argument("--numa", choices=("any", "single"), default="any")
    create.add_argument("--place-timeout", type=_seconds, default=5.0)

    command("list", "list this gateway's sandboxes on every host")
    destroy = command("destroy", "delete sandboxes by id")
    destroy.add_argument("ids", nargs="+")
    command("hosts", "each host's state, capacity and use")
    release = command(
        "release", "a host's machine is gone for good: free its name, forget its sandboxes"
    )
    release.add_argument("host", help="the host's name in the fleet")


def run(args: argparse.Namespace, out: Any) -> int:
    """Run ``vmsandbox fleet ARGS.fleet_command``; ``out`` is the CLI's Output."""
    if args.fleet_command == "join":
        from vmsandbox.fleet.join import join

        name = args.name or socket.gethostname().lower()
        return join(
            args.address,
            args.openshell_socket,
            name,
            node_ip=args.node_ip,
            temp_dir=args.temp_dir,
            key_path=args.machine_key,
        )
    if args.fleet_command == "serve":
        from vmsandbox.fleet.server import serve

        return serve(
            args.openshell_socket,
            address=args.address,
            gateway=args.gateway,
            metrics_address=args.metrics_address,
            place_timeout=args.place_timeout,
        )
    from vmsandbox.fleet.core import Fleet

    fleet = Fleet(
        args.address, gateway=args.gateway, place_timeout=getattr(args, "place_timeout", 5.0)
    )
    try:
        return _COMMANDS[args.fleet_command](fleet, args, out)
    finally:
        fleet.close()


def _create(fleet: Any, args: argparse.Namespace, out: Any) -> int:
    sandbox_id, placed = fleet.create_sandbox(
        sandbox_id=args.sandbox_id,
        name=args.name,
        image=args.image,
        cpus=args.cpus,
        memory_mib=args.memory_mib,
        gpus=args.gpus,
        model_name=args.gpu_model,
        numa=args.numa,
    )
    data = {
        "id": sandbox_id,
        "host": placed.host,
        "gpus": placed.gpus,
        "pooled": placed.pooled,
    }
    gpus = ", ".join(f"{gpu['bdf']} ({gpu['model']})" for gpu in placed.gpus) or "no GPUs"
    out.result(data, f"sandbox {sandbox_id} created on host {placed.host}: {gpus}")
    return 0


def _list(fleet: Any, _args: argparse.Namespace, out: Any) -> int:
    listed = [sandbox.to_dict() for sandbox in fleet.sandboxes()]
    rows = [
        [s["id"], s["name"], s["host"], s["ready"] + (f" ({s['reason']})" if s["reason"] else "")]
        for s in listed
    ]
    out.result(listed, _table(["ID", "NAME", "HOST", "READY"], rows))
    return 0


def _destroy(fleet: Any, args: argparse.Namespace, out: Any) -> int:
    deleted = {sandbox_id: fleet.delete(sandbox_id) for sandbox_id in args.ids}
    text = "\n".join(
        f"sandbox {sid} {'deleted' if done else 'did not exist'}" for sid, done in deleted.items()
    )
    out.result({"deleted": deleted}, text)
    return 0


def _hosts(fleet: Any, _args: argparse.Namespace, out: Any) -> int:
    hosts = [view.to_dict() for view in fleet.hosts()]
    rows = [
        [
            h["name"],
            h["state"],
            h["fabric"] or "-",
            f"{h['gpus_free']}/{h['gpus']}",
            ", ".join(f"{m} x{n}" for m, n in sorted(h["models"].items())) or "-",
            " ".join(f"{n}:{c}" for n, c in h["slots_free"].items()) or "-",
            ", ".join(f"{p['key']} {p['ready']}/{p['count']}" for p in h["pool"]) or "-",
            str(h["sandboxes"]),
            json.dumps(h["drift"]) if h["drift"] else "0",
            h["error"] or "-",
        ]
        for h in hosts
    ]
    headers = ["HOST", "STATE", "FABRIC", "GPUS FREE", "MODELS", "FREE BY SIZE", "POOL"]
    out.result(hosts, _table([*headers, "SANDBOXES", "DRIFT", "ERROR"], rows))
    return 0


def _release(_fleet: Any, args: argparse.Namespace, out: Any) -> int:
    from vmsandbox.fleet.join import release

    forgotten = release(args.host)
    data = {
        "host": args.host,
        "forgotten": [{"gateway": r.gateway, "id": r.sandbox_id} for r in forgotten],
    }
    text = f"host {args.host} released: its name is free" + "".join(
        f"\nforgot sandbox {r.sandbox_id} of gateway {r.gateway}" for r in forgotten
    )
    out.result(data, text)
    return 0


def _table(headers: list[str], rows: list[list[str]]) -> str:
    from vmsandbox.tables import render_grid

    return "\n".join(render_grid(headers, rows))


_COMMANDS = {
    "create": _create,
    "list": _list,
    "destroy": _destroy,
    "hosts": _hosts,
    "release": _release,
}
