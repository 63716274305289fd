"""``vmsandbox.host.v1.HostInfo``: what this host has and holds, served on the driver socket
beside the OpenShell compute driver, for the fleet agent that runs on the host (vmsandbox.fleet).

One RPC, ``GetHostInfo``, answers one JSON document (``describe``), read from libvirt and the
host's devices at the moment of the call:

- ``gpus``: each GPU with its model, memory, NUMA node, whether it can be passed through, the
  domain holding it (any domain of the connection, ours or not) and its custody state and
  reason (only ``free`` GPUs are given: vmsandbox.gpu.custody);
- ``sanitize``: the seconds of the last sanitizes, per step (the metrics' histogram);
- ``capacity``: per GPU count, how many sandboxes of that many GPUs fit now and on the empty
  host, also counting only single-NUMA-node placements, and bindable GPUs per model, all and
  free (``vmsandbox.gpu.capacity``: the host's own allocation policy decides);
- ``fabric``: the NVSwitch model (none, full-passthrough, shared-nvswitch) and, in shared mode,
  Fabric Manager's partitions with their size and whether they are active;
- ``pool``: each ``[pool]`` shape with its count and how many guests are ready;
- ``sandboxes``: this state directory's sandboxes (not pooled guests) with state, labels and
  GPUs, so a fleet finds its own again after a restart and sees capacity taken outside it.

A gateway is an identity (openshell/caller.py): the document names only the caller's own
sandboxes (and, to a delegate that names no gateway, those of every gateway it speaks for).
Every other sandbox is still counted, with its size and GPUs, but without name, domain, image
or labels, and a GPU it holds shows ``(another owner's sandbox)`` as its holder.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import grpc

from vmsandbox.config import Config
from vmsandbox.errors import VmSandboxError
from vmsandbox.gpu.custody.store import CustodyStore
from vmsandbox.openshell.caller import Caller, Callers
from vmsandbox.openshell.proto import host_info_pb2 as pb
from vmsandbox.openshell.proto import host_info_pb2_grpc as pb_grpc
from vmsandbox.openshell.socket import Peers
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.sandbox.pool.shapes import is_pool_guest

log = logging.getLogger(__name__)
SANITIZES_KEPT = 200  # the last sanitizes the document carries
SCHEMA = 1  # the ``schema`` key of the document; raised when a key changes meaning


HIDDEN = "(another owner's sandbox)"


def describe(manager: SandboxManager, caller: Caller) -> dict[str, Any]:
    """The host document as ``caller`` may see it (see the module docstring)."""
    from vmsandbox.gpu import capacity
    from vmsandbox.gpu.fabric import state

    config = manager.config
    inventory = manager.gpus()
    fabric = state.read(config, inventory)
    measured = capacity.measure(inventory, fabric, config.max_gpus)
    store = manager.store
    sandboxes, hidden = [], set()
    for found in store.found():
        if is_pool_guest(found.record) or not store.local(found.record):
            continue
        shown = store.view(found.record, found.state, found.uuid)
        seen = caller.sees(shown)
        if not seen:
            hidden.add(shown.domain)
        sandboxes.append(
            {
                "name": shown.name if seen else "",
                "domain": shown.domain if seen else "",
                "state": shown.state,
                "image": shown.image if seen else "",
                "cpus": shown.cpus,
                "memory_mib": shown.memory_mib,
                "disk_gib": shown.disk_gib,
                "labels": dict(shown.labels) if seen else {},
                "gpus": [gpu["bdf"] for gpu in shown.gpus],
            }
        )
    table = fabric.table
    return {
        "schema": SCHEMA,
        "max_gpus": config.max_gpus,
        "gpus": [
            {
                "bdf": gpu.bdf,
                "model": gpu.name or "unknown",
                "memory_mib": gpu.memory_mib,
                "numa_node": gpu.numa_node,
                "bindable": gpu.bindable,
                "holder": HIDDEN if gpu.in_use_by in hidden else gpu.in_use_by,
                "custody": gpu.custody,
                "custody_reason": gpu.custody_reason,
            }
            for gpu in inventory.gpus
        ],
        "sanitize": [
            {"ok": entry.get("ok"), "steps": entry.get("steps", {})}
            for entry in CustodyStore(config).sanitizes()[-SANITIZES_KEPT:]
        ],
        "capacity": {
            "total": _keyed(measured.total),
            "free": _keyed(measured.free),
            "single_numa_total": _keyed(measured.single_numa_total),
            "single_numa_free": _keyed(measured.single_numa_free),
            "models_total": dict(measured.models_total),
            "models_free": dict(measured.models_free),
        },
        "fabric": {
            "mode": fabric.mode.kind,
            "partitions": [
                {"id": p.id, "size": p.size, "active": p.active}
                for p in (table.partitions if table is not None else ())
            ],
        },
        "pool": [
            {key: shape[key] for key in (*_SHAPE_KEYS, "count", "ready")}
            for shape in manager.pool.show()
        ],
        "sandboxes": sorted(sandboxes, key=lambda s: (s["name"], s["state"])),
    }


_SHAPE_KEYS = ("key", "image", "cpus", "memory_mib", "disk_gib", "gpus")


def _keyed(counts: dict[int, int] | Any) -> dict[str, int]:
    """Counts by GPU count with string keys, as JSON keeps them."""
    return {str(size): count for size, count in sorted(counts.items())}


class HostInfo(pb_grpc.HostInfoServicer):
    """The HostInfo service of one host; ``manager`` makes the SandboxManager of each call."""

    def __init__(
        self,
        config: Config,
        manager: Callable[[], SandboxManager] | None = None,
        *,
        peers: Peers,
    ) -> None:
        self._new_manager = manager or (lambda: SandboxManager(config, reconcile=False))
        self.callers = Callers(peers.uid_of, config.openshell_delegate_uids)

    def GetHostInfo(self, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            caller = self.callers.identify(context)
            with self._new_manager() as manager:
                document = describe(manager, caller)
        except VmSandboxError as exc:
            log.info("GetHostInfo: %s: %s", exc.code, exc.message)
            context.abort(getattr(grpc.StatusCode, exc.code, grpc.StatusCode.INTERNAL), exc.message)
        return pb.GetHostInfoResponse(json=json.dumps(document, sort_keys=True))
