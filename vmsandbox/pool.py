"""The warm pool: booted guests kept ready so that a create only has to claim one.

The operator names shapes in the ``[pool]`` table of config.toml. A shape is an image plus
cpus, memory and disk; an entry names it two ways:

    [pool]
    minimal = 2                 # image "minimal", the default shape of a create (1 vCPU,
                                # 1024 MiB, 4 GiB), two guests kept ready
    [pool.big]                  # "big": a shape of its own
    image = "minimal"
    cpus = 2
    memory_mib = 4096
    disk_gib = 16
    count = 1
    gpus = 2                    # GPU-ready: 2 spare root ports, a create --gpu 1 or 2 claims
                                # a guest and has its GPUs attached live (hotplug.py)

A pooled guest is an ordinary sandbox domain named ``vmsbx-pool-<id>`` (its files carry
``pool-<id>`` too), in state ``pooled``; it holds no GPU. A create whose spec has the same
shape, no GPU and the same image build claims one: the record takes the sandbox's name and
keeps the guest's name in ``guest`` (libvirt cannot rename a running domain), so every command
finds the sandbox by the name in its record. A claimed guest never returns to the pool.

A shape with ``gpus`` (the largest GPU request it serves) boots its guests with that many
spare root ports when the host has bindable GPUs. A create asking for at most that many GPUs,
and for nothing else the shape differs in, then claims one: the GPUs are chosen as for a cold
create and attached to the running guest (warmpool.py). A request for more GPUs, for every
GPU (``all``), or one made on a host whose pooled guests have no spare ports, boots cold.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from vmsandbox.errors import InvalidArgument
from vmsandbox.spec import SandboxSpec, generate_name

POOL_PREFIX = "pool-"
_SHAPE_KEYS = ("image", "cpus", "memory_mib", "disk_gib", "count", "gpus")


class NoPooledGuest(Exception):
    """The claim step found no ready pooled guest of the shape: the create boots cold."""


class PoolFull(Exception):
    """The fill step found the shape's pool full (counting guests still booting)."""


@dataclass(frozen=True)
class PoolShape:
    """One ``[pool]`` entry: ``count`` guests of this image and size kept ready."""

    key: str
    image: str
    cpus: int
    memory_mib: int
    disk_gib: int
    count: int
    gpus: int = 0

    def spec(self) -> SandboxSpec:
        """The spec a pooled guest of this shape is created with."""
        return SandboxSpec(
            name=generate_name(POOL_PREFIX.rstrip("-")),
            image=self.image,
            cpus=self.cpus,
            memory_mib=self.memory_mib,
            disk_gib=self.disk_gib,
        )

    def fits(self, spec: SandboxSpec) -> bool:
        """Whether a guest of this shape can serve ``spec``: a GPU sandbox only when the shape
        is GPU-ready for that many GPUs (``wanted_gpus``); never a spec with guest setup (the
        pooled guest's first boot is over)."""
        return (
            wanted_gpus(spec) <= self.gpus
            and spec.guest is None
            and spec.image == self.image
            and (spec.cpus, spec.memory_mib, spec.disk_gib)
            == (self.cpus, self.memory_mib, self.disk_gib)
        )

    def holds(self, record: Any) -> bool:
        """Whether pooled guest ``record`` (a SandboxRecord) is of this shape."""
        return (record.image, record.cpus, record.memory_mib, record.disk_gib) == (
            self.image,
            self.cpus,
            self.memory_mib,
            self.disk_gib,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "image": self.image,
            "cpus": self.cpus,
            "memory_mib": self.memory_mib,
            "disk_gib": self.disk_gib,
            "count": self.count,
            "gpus": self.gpus,
        }


def wanted_gpus(spec: SandboxSpec) -> int:
    """How many GPUs ``spec`` asks for, as far as the spec tells: a request for every GPU
    counts as more than any shape serves (it is only known once the host is read)."""
    request = spec.gpu
    if request is None:
        return 0
    if request.all:
        return sys.maxsize
    return request.count or len(request.devices) or 1


def check_not_pooled_name(name: str | None) -> None:
    """INVALID_ARGUMENT for a sandbox name that only the pool's guests may have."""
    if name is not None and name.startswith(POOL_PREFIX):
        raise InvalidArgument(
            f"name {name!r} starts with {POOL_PREFIX!r}, which is kept for the warm pool's "
            "guests; choose another name",
            details={"field": "name", "value": name},
        )


def is_pool_guest(record: Any) -> bool:
    """A guest of the pool that no sandbox has claimed (being filled, or ready)."""
    return record.guest is None and record.name.startswith(POOL_PREFIX)


def parse_table(table: object) -> tuple[PoolShape, ...]:
    """The ``[pool]`` table as shapes; INVALID_ARGUMENT naming the entry's field otherwise."""
    if not isinstance(table, dict):
        raise InvalidArgument(
            f"config pool must be a table of shapes, got {table!r}",
            details={"field": "pool", "value": repr(table)},
        )
    shapes = [_shape(str(key), value) for key, value in table.items()]
    seen: dict[tuple[str, int, int, int], str] = {}
    for shape in shapes:
        size = (shape.image, shape.cpus, shape.memory_mib, shape.disk_gib)
        if size in seen:
            raise InvalidArgument(
                f"config pool.{shape.key} has the same shape as pool.{seen[size]}; "
                "give each shape one entry",
                details={"field": f"pool.{shape.key}", "value": repr(size)},
            )
        seen[size] = shape.key
    return tuple(shapes)


def _shape(key: str, value: object) -> PoolShape:
    field = f"pool.{key}"
    defaults = SandboxSpec()
    entry: dict[str, Any]
    if isinstance(value, int) and not isinstance(value, bool):
        entry = {"image": key, "count": value}
    elif isinstance(value, dict):
        unknown = sorted(set(value) - set(_SHAPE_KEYS))
        if unknown:
            raise InvalidArgument(
                f"config {field} has unknown keys {', '.join(unknown)}; "
                f"known: {', '.join(_SHAPE_KEYS)}",
                details={"field": f"{field}.{unknown[0]}", "value": repr(value[unknown[0]])},
            )
        entry = {"image": key, **value}
    else:
        raise InvalidArgument(
            f"config {field} must be a count (a whole number) or a table of "
            f"{', '.join(_SHAPE_KEYS)}, got {value!r}",
            details={"field": field, "value": repr(value)},
        )
    count = _whole(entry.get("count", 1), f"{field}.count", "guests")
    gpus = _whole(entry.get("gpus", 0), f"{field}.gpus", "spare GPU ports")
    try:
        spec = SandboxSpec(
            image=entry["image"],
            cpus=entry.get("cpus", defaults.cpus),
            memory_mib=entry.get("memory_mib", defaults.memory_mib),
            disk_gib=entry.get("disk_gib", defaults.disk_gib),
        )
    except InvalidArgument as exc:
        inner = exc.details.get("field", "")
        raise InvalidArgument(
            f"config {field}: {exc.message}",
            details={**exc.details, "field": f"{field}.{inner}" if inner else field},
        ) from exc
    return PoolShape(key, spec.image, spec.cpus, spec.memory_mib, spec.disk_gib, count, gpus)


def _whole(value: object, field: str, what: str) -> int:
    """``value`` as a count of ``what``, 0 or more; INVALID_ARGUMENT naming ``field``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgument(
            f"config {field} must be a whole number of {what}, 0 or more, got {value!r}",
            details={"field": field, "value": repr(value)},
        )
    return value
