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

A pooled guest is an ordinary sandbox domain named ``vmsbx-pool-<id>`` (its files carry
``pool-<id>`` too), in state ``pooled``; it holds no GPU. A create whose spec has the same
shape, no GPU and the same image build claims one: the record takes the sandbox's name and
keeps the guest's name in ``guest`` (libvirt cannot rename a running domain), so every command
finds the sandbox by the name in its record. A claimed guest never returns to the pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vmsandbox.errors import InvalidArgument
from vmsandbox.spec import SandboxSpec, generate_name

POOL_PREFIX = "pool-"
_SHAPE_KEYS = ("image", "cpus", "memory_mib", "disk_gib", "count")


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
        """Whether a guest of this shape can serve ``spec``: GPU sandboxes never can, nor
        can specs with guest setup (the pooled guest's first boot is over)."""
        return (
            spec.gpu is None
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
        }


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
    count = entry.get("count", 1)
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise InvalidArgument(
            f"config {field}.count must be a whole number of guests, 0 or more, got {count!r}",
            details={"field": f"{field}.count", "value": repr(count)},
        )
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
    return PoolShape(key, spec.image, spec.cpus, spec.memory_mib, spec.disk_gib, count)
