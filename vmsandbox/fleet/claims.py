"""Claims: Ray placement groups of one bundle, detached (they outlive the process that made
them, so a fleet server restart keeps them) and named (model.py's names), in the fleet's Ray
namespace. Also Ray's nodes as hosts, and Ray's free amounts per host, computed from Ray's own
records: a node's totals less the bundles of every claim placed on it.

Also which Ray jobs still run (``live_jobs``): a placement record names the fleet process
whose create works on it, and a record or claim whose process is dead is nobody's.

Ray is imported here and in the other modules of this package that talk to the cluster; the
fleet's pure model (model.py) and the CLI never import it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import (
    get_placement_group,
    placement_group,
    placement_group_table,
    remove_placement_group,
)

from vmsandbox.errors import AlreadyExists, Unavailable
from vmsandbox.fleet import model

_LIVE = ("CREATED", "PENDING", "RESCHEDULING")  # states of a claim that still holds or waits


@dataclass(frozen=True)
class Claim:
    """One claim as Ray records it."""

    name: str
    state: str  # CREATED (placed) | PENDING | RESCHEDULING
    bundle: dict[str, float]
    node_id: str | None  # where its bundle is placed, when it is


@dataclass(frozen=True)
class Node:
    """A Ray node of a host (its ``vmsandbox.io/host`` label)."""

    node_id: str
    host: str
    alive: bool
    totals: dict[str, float]
    labels: dict[str, str]


def place(
    name: str,
    bundle: Mapping[str, float],
    timeout: float,
    selector: Mapping[str, str] | None = None,
) -> str | None:
    """Make claim ``name`` and wait up to ``timeout`` seconds for Ray to place it; the node id
    where it was placed, or None (the claim is removed then). ALREADY_EXISTS when a claim of
    that name exists."""
    try:
        group = placement_group(
            [dict(bundle)],
            name=name,
            lifetime="detached",
            bundle_label_selector=[dict(selector)] if selector else None,
        )
    except ray.exceptions.RaySystemError as exc:
        if "already exists" in str(exc):
            raise AlreadyExists(
                f"claim {name!r} exists: a create of this sandbox is under way or done",
                details={"claim": name},
            ) from exc
        raise Unavailable(f"Ray refused claim {name!r}: {exc}") from exc
    if group.wait(timeout_seconds=max(timeout, 0.001)):
        node = _node_of(group)
        if node is not None:
            return node
    remove(name)
    return None


def _node_of(group: Any) -> str | None:
    table = placement_group_table(group)
    nodes = table.get("bundles_to_node_id") or {}
    return nodes.get(0)


def remove(name: str) -> bool:
    """Remove claim ``name``; False when there was none."""
    try:
        group = get_placement_group(name)
    except ValueError:
        return False
    with contextlib.suppress(Exception):  # removed meanwhile by another fleet process
        remove_placement_group(group)
    return True


def claims() -> list[Claim]:
    """Every live claim of the fleet (placed, waiting or being placed again)."""
    found = []
    for entry in placement_group_table().values():
        name = entry.get("name") or ""
        if entry.get("state") not in _LIVE or not name.startswith(
            (model.CLAIM_PREFIX, model.PIN_PREFIX)
        ):
            continue
        bundles = entry.get("bundles") or {}
        nodes = entry.get("bundles_to_node_id") or {}
        placed = entry["state"] == "CREATED"
        found.append(
            Claim(
                name=name,
                state=entry["state"],
                bundle=dict(bundles.get(0, {})),
                node_id=nodes.get(0) if placed else None,
            )
        )
    return found


def nodes() -> list[Node]:
    """The Ray nodes of hosts, alive or dead (a host that rejoined has one of each)."""
    found = []
    for entry in ray.nodes():
        labels = dict(entry.get("Labels") or {})
        host = labels.get(model.LABEL_HOST)
        if host:
            found.append(
                Node(
                    node_id=entry["NodeID"],
                    host=host,
                    alive=bool(entry.get("Alive")),
                    totals={
                        k: float(v)
                        for k, v in entry.get("Resources", {}).items()
                        if k.startswith(model.PREFIX)
                    },
                    labels=labels,
                )
            )
    return found


def live_nodes() -> dict[str, Node]:
    """Host name -> its alive node."""
    return {node.host: node for node in nodes() if node.alive}


def ray_free(node: Node, placed: list[Claim], agents: int = 1) -> dict[str, float]:
    """Ray's free amounts on ``node``: totals less the bundles placed there and the agent
    actor's unit of the host resource."""
    free = dict(node.totals)
    for claim in placed:
        if claim.node_id == node.node_id:
            for key, amount in claim.bundle.items():
                if key in free:
                    free[key] -= amount
    host_key = model.HOST + node.host
    if host_key in free:
        free[host_key] -= agents
    return free


def find(name: str) -> Claim | None:
    """Live claim ``name``, or None."""
    return next((claim for claim in claims() if claim.name == name), None)


def this_job() -> str:
    """This process's Ray job id (hex): whose creates a placement record names."""
    return str(ray.get_runtime_context().get_job_id())


def live_jobs() -> set[str]:
    """The Ray jobs (fleet processes, agents' drivers) that still run. Ray marks a job dead
    as soon as its driver process's connection drops (a SIGKILL included)."""
    from ray._private import state

    return {job["JobID"] for job in state.jobs() if not job["IsDead"]}


def wait_gone(name: str, timeout: float) -> bool:
    """Until claim ``name`` is removed (True) or ``timeout`` seconds passed (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            get_placement_group(name)
        except ValueError:
            return True
        time.sleep(0.05)
    return False
