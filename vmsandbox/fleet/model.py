"""The fleet's vocabulary, as pure functions: a host's capacity as Ray resources and labels, a
create's wish as the claim it reserves, and the pinned amounts that keep Ray's view of a host
equal to the host's own. Nothing here imports Ray, so it is tested without a cluster.

Resources of a host's Ray node (totals, fixed when it joins), each a count the host itself
computes (``vmsandbox.gpu.capacity`` through the host's HostInfo document):

- ``vmsandbox/host/<name>``: HOST_UNITS, only on that node: a bundle taking one unit stays
  there (the agent actor and the host's pinned claim);
- ``vmsandbox/sandbox``: SANDBOX_UNITS, one per sandbox, so a create without GPUs reserves too;
- ``vmsandbox/gpu``: bindable GPUs whose custody is not out (quarantined, failed, suspect);
  ``vmsandbox/model/<slug>``: bindable GPUs of one model;
- ``vmsandbox/gpus/<n>``: how many sandboxes of n GPUs fit the empty host one after another
  (Fabric Manager partitions of n GPUs in shared NVSwitch mode, 1 or all in full passthrough);
  ``vmsandbox/numa-gpus/<n>``: the same, counting placements on one NUMA node only;
- ``vmsandbox/pool/<shape>``: a ``[pool]`` shape's count plus POOL_HEADROOM (below).

A create of n GPUs reserves ``{sandbox: 1, gpu: n, gpus/<n>: 1}``, plus ``model/<slug>: n``
when it names a model, ``numa-gpus/<n>: 1`` when it wants one NUMA node, and
``pool/<shape>: 1`` when it prefers a host with a ready pooled guest of its shape.

Counts overlap (one GPU taken from a pair of a partition of two also blocks the partitions of
four and eight that contain it) and Ray cannot know that. So each host's agent holds a *pinned
claim* of ``total - host's free - held by the fleet's claims on the host`` for every resource
(never below 0): capacity taken outside the fleet (local creates, survivors adopted after a
restart) and capacity blocked by overlap. Once quiet, Ray's free amount of every resource
equals the host's own. A pooled create keeps its pool unit after the pool refilled; the
headroom lets the pinned claim shrink by that much, so Ray's free pool count still equals the
ready guests.

Each fleet sandbox has a *placement record* (``Record``, kept in Ray by records.py): the host
that holds it or may hold it, written before that host is asked and cleared only on the host's
own refusal, so a fleet process started at any time knows where every sandbox may be, lost
hosts included. Each host name is bound to one machine (``Binding``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from vmsandbox.errors import InvalidArgument
from vmsandbox.gpu.custody.state import OUT

NAMESPACE = "vmsandbox-fleet"  # the Ray namespace of agents and claims
HOST_UNITS = 1000.0
SANDBOX_UNITS = 1000.0
POOL_HEADROOM = 10000.0
PREFIX = "vmsandbox/"
HOST = PREFIX + "host/"
SANDBOX = PREFIX + "sandbox"
GPU = PREFIX + "gpu"
GPUS = PREFIX + "gpus/"
NUMA_GPUS = PREFIX + "numa-gpus/"
MODEL = PREFIX + "model/"
POOL = PREFIX + "pool/"
# Node labels (Kubernetes label syntax, which Ray's label selectors use).
LABEL_HOST = "vmsandbox.io/host"
LABEL_FABRIC = "vmsandbox.io/fabric"
LABEL_MODEL = "vmsandbox.io/gpu-model"
AGENT_PREFIX = "agent:"  # + host name: the agent actor's name
CLAIM_PREFIX = "claim:"  # + gateway + ":" + sandbox id: a create's claim
PIN_PREFIX = "pin:"  # + host name: the host's pinned claim
_SLUG_RE = re.compile(r"[^a-z0-9]+")
_HOST_RE = re.compile(r"[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?")
NUMA_WISHES = ("any", "single")


def slug(text: str) -> str:
    """``text`` as lowercase letters, digits and single dashes: a resource or label value."""
    return _SLUG_RE.sub("-", text.lower()).strip("-")[:63] or "unknown"


def check_host_name(name: str) -> str:
    """A host name usable as a Ray label value and resource name."""
    if not isinstance(name, str) or not _HOST_RE.fullmatch(name):
        raise InvalidArgument(
            f"host name {name!r} is not valid: use 1-63 lowercase letters, digits, '.' and '-', "
            "starting and ending with a letter or digit",
            details={"field": "name", "value": repr(name)},
        )
    return name


def agent_name(host: str) -> str:
    return AGENT_PREFIX + host


def claim_name(gateway: str, sandbox_id: str) -> str:
    return f"{CLAIM_PREFIX}{gateway}:{sandbox_id}"


def pin_name(host: str) -> str:
    return PIN_PREFIX + host


def claim_owner(name: str) -> tuple[str, str] | None:
    """(gateway, sandbox id) of a create's claim name; None for any other name."""
    if not name.startswith(CLAIM_PREFIX):
        return None
    gateway, _, sandbox_id = name[len(CLAIM_PREFIX) :].partition(":")
    return (gateway, sandbox_id) if sandbox_id else None


def shape_slug(image: str, cpus: int, memory_mib: int, disk_gib: int, gpus: int) -> str:
    return slug(f"{image}-{cpus}c-{memory_mib}m-{disk_gib}g-{gpus}gpu")


def host_totals(name: str, info: Mapping[str, Any]) -> dict[str, float]:
    """The Ray resources of host ``name``'s node, from its HostInfo document (the empty host)."""
    capacity = info["capacity"]
    totals = {HOST + name: HOST_UNITS, SANDBOX: SANDBOX_UNITS}
    bindable = sum(1 for gpu in info["gpus"] if usable(gpu))
    if bindable:
        totals[GPU] = float(bindable)
    for size, count in capacity["total"].items():
        if count:
            totals[GPUS + size] = float(count)
    for size, count in capacity["single_numa_total"].items():
        if count:
            totals[NUMA_GPUS + size] = float(count)
    for model, count in capacity["models_total"].items():
        totals[MODEL + slug(model)] = totals.get(MODEL + slug(model), 0.0) + count
    for shape in info["pool"]:
        totals[POOL + _shape_of(shape)] = shape["count"] + POOL_HEADROOM
    return totals


def usable(gpu: Mapping[str, Any]) -> bool:
    """A GPU the host counts as capacity: bindable, and not out of custody (quarantined,
    failed, or suspect until its automatic reset): a sick GPU is no capacity of the fleet."""
    return bool(gpu["bindable"]) and gpu.get("custody", "free") not in OUT


def _free(gpu: Mapping[str, Any]) -> bool:
    return gpu.get("custody", "free") == "free"


def host_labels(name: str, info: Mapping[str, Any]) -> dict[str, str]:
    models = sorted({slug(gpu["model"]) for gpu in info["gpus"] if gpu["bindable"]})
    return {
        LABEL_HOST: name,
        LABEL_FABRIC: info["fabric"]["mode"],
        LABEL_MODEL: models[0] if len(models) == 1 else ("mixed" if models else "none"),
    }


def host_free(name: str, info: Mapping[str, Any]) -> dict[str, float]:
    """What the host itself says is free now, resource by resource (the totals' keys)."""
    capacity = info["capacity"]
    free = {HOST + name: HOST_UNITS, SANDBOX: SANDBOX_UNITS - len(info["sandboxes"])}
    free[GPU] = float(
        sum(1 for g in info["gpus"] if usable(g) and g["holder"] is None and _free(g))
    )
    for size, count in capacity["free"].items():
        free[GPUS + size] = float(count)
    for size, count in capacity["single_numa_free"].items():
        free[NUMA_GPUS + size] = float(count)
    for model in capacity["models_total"]:
        key = MODEL + slug(model)
        free[key] = free.get(key, 0.0) + capacity["models_free"].get(model, 0)
    for shape in info["pool"]:
        free[POOL + _shape_of(shape)] = float(shape["ready"])
    return free


def _shape_of(shape: Mapping[str, Any]) -> str:
    return shape_slug(
        shape["image"], shape["cpus"], shape["memory_mib"], shape["disk_gib"], shape["gpus"]
    )


def pinned(
    totals: Mapping[str, float], free: Mapping[str, float], held: Mapping[str, float]
) -> dict[str, float]:
    """The pinned claim that makes Ray's free amounts equal ``free``: per resource,
    ``total - free - held`` (``held``: the fleet's claims on the host), never below 0; the
    pool headroom is left in it. Zero amounts are left out."""
    amounts = {}
    for key, total in totals.items():
        if key.startswith(HOST):
            continue
        amount = total - free.get(key, 0.0) - held.get(key, 0.0)
        if amount > 0:
            amounts[key] = amount
    return amounts


def add(bundles: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """The sum of several bundles, resource by resource."""
    total: dict[str, float] = {}
    for bundle in bundles:
        for key, amount in bundle.items():
            total[key] = total.get(key, 0.0) + amount
    return total


@dataclass(frozen=True)
class Wish:
    """What one fleet create asks for, as far as choosing a host goes."""

    gpus: int = 0
    model: str | None = None
    numa: str = "any"  # "single": every GPU on one NUMA node
    image: str = "minimal"
    cpus: int = 1
    memory_mib: int = 1024
    disk_gib: int = 4
    plain: bool = False  # gives the guest nothing: a ready pooled guest of its shape serves it

    def __post_init__(self) -> None:
        if isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or self.gpus < 0:
            raise InvalidArgument(
                f"gpus {self.gpus!r} is not a number of GPUs: use a whole number, 0 or more",
                details={"field": "gpus", "value": repr(self.gpus)},
            )
        if self.numa not in NUMA_WISHES:
            raise InvalidArgument(
                f"numa {self.numa!r} is not a NUMA wish: use {' or '.join(NUMA_WISHES)}",
                details={"field": "numa", "value": repr(self.numa), "allowed": NUMA_WISHES},
            )
        if self.numa == "single" and not self.gpus:
            raise InvalidArgument(
                "numa 'single' needs GPUs: it asks for every GPU on one NUMA node",
                details={"field": "numa", "value": "single"},
            )

    def bundle(self, models: Iterable[str] = ()) -> dict[str, float]:
        """The claim's resources; ``models``: the fleet's model names the wish matches (one is
        chosen per attempt by the caller, so pass at most one)."""
        bundle = {SANDBOX: 1.0}
        if self.gpus:
            bundle[GPU] = float(self.gpus)
            bundle[GPUS + str(self.gpus)] = 1.0
            if self.numa == "single":
                bundle[NUMA_GPUS + str(self.gpus)] = 1.0
        for model in models:
            bundle[MODEL + slug(model)] = float(self.gpus)
        return bundle

    def pool_resources(self, shapes: Iterable[Mapping[str, Any]]) -> list[str]:
        """The pool resources of the shapes (HostInfo ``pool`` entries) that serve this wish."""
        if not self.plain:
            return []
        found = []
        for shape in shapes:
            if (shape["image"], shape["cpus"], shape["memory_mib"], shape["disk_gib"]) == (
                self.image,
                self.cpus,
                self.memory_mib,
                self.disk_gib,
            ) and self.gpus <= shape["gpus"]:
                found.append(POOL + _shape_of(shape))
        return sorted(set(found))


@dataclass
class HostView:
    """One host as the fleet sees it: its state, the HostInfo it last answered, and Ray's free
    amounts on its node (totals less every claim placed there)."""

    name: str
    state: str  # "ready" | "joining" | "lost"
    node_id: str | None = None
    info: dict[str, Any] | None = None
    ray_free: dict[str, float] = field(default_factory=dict)
    totals: dict[str, float] = field(default_factory=dict)
    lost_at: float | None = None
    error: str | None = None  # what its agent last said went wrong (its driver, Ray)

    def drift(self) -> dict[str, float]:
        """Resources whose free amount in Ray differs from the host's own (Ray minus host)."""
        if self.info is None:
            return {}
        own = host_free(self.name, self.info)
        return {
            key: self.ray_free.get(key, 0.0) - amount
            for key, amount in own.items()
            if key in self.totals
            and not key.startswith(HOST)
            and abs(self.ray_free.get(key, 0.0) - amount) > 1e-6
        }

    def to_dict(self) -> dict[str, Any]:
        info = self.info or {}
        gpus = info.get("gpus", [])
        return {
            "name": self.name,
            "state": self.state,
            "fabric": info.get("fabric", {}).get("mode"),
            "gpus": sum(1 for gpu in gpus if usable(gpu)),
            "gpus_free": sum(1 for g in gpus if usable(g) and g["holder"] is None and _free(g)),
            "models": info.get("capacity", {}).get("models_total", {}),
            "slots_free": info.get("capacity", {}).get("free", {}),
            "pool": [
                {"key": p["key"], "ready": p["ready"], "count": p["count"]}
                for p in info.get("pool", [])
            ],
            "sandboxes": len(info.get("sandboxes", [])),
            "ray_gpus_free": self.ray_free.get(GPU, 0.0),
            "drift": self.drift(),
            "error": self.error,
        }


# The states of a placement record: which host holds the sandbox, or may.
PLACING = "placing"  # its create waits for Ray to place its claim: no host was asked yet
CREATING = "creating"  # its create asks ``host`` now
UNKNOWN = "unknown"  # asking ``host`` ended without an answer: it may hold the sandbox
PLACED = "placed"  # ``host`` made it
RECORD_STATES = (PLACING, CREATING, UNKNOWN, PLACED)


@dataclass(frozen=True)
class Record:
    """Where the gateway's sandbox ``sandbox_id`` is, or may be: ``host`` (None while its
    create waits for placement), in ``state``; ``job``: the fleet process (Ray job id) whose
    create works on it, empty when none does; ``name``: the sandbox's name, to list it while
    its host is lost; ``suspended``: while the sandbox is suspended on ``host``, the shape of
    the claim it gave back (power.py), which its resume takes again there; else None."""

    gateway: str
    sandbox_id: str
    name: str = ""
    host: str | None = None
    state: str = PLACING
    job: str = ""
    suspended: dict[str, float] | None = None

    def __post_init__(self) -> None:
        if self.state not in RECORD_STATES or (self.host is None) != (self.state == PLACING):
            raise ValueError(f"a placement record in state {self.state!r} on host {self.host!r}")

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Record:
        return cls(**json.loads(data))

    def on(self, host: str | None, state: str, job: str | None = None) -> Record:
        """This record with ``host`` in ``state`` (and ``job`` when given)."""
        return replace(self, host=host, state=state, job=self.job if job is None else job)

    def busy(self, live_jobs: Iterable[str], me: str) -> bool:
        """Whether another live fleet process works on it now (it waits for placement, or
        for the host it asks)."""
        return (
            self.state in (PLACING, CREATING)
            and self.job not in ("", me)
            and (self.job in set(live_jobs))
        )


@dataclass(frozen=True)
class Binding:
    """Host name ``host`` belongs to the machine whose host key has digest ``key``; its
    latest Ray node is ``node_id``."""

    host: str
    key: str
    node_id: str = ""

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Binding:
        return cls(**json.loads(data))
