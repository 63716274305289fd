"""The warm pool's shapes: what each keeps ready, and which creates claim its guests.

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
                                # a guest and has its GPUs attached live (gpu/hotplug.py)

A pooled guest is an ordinary sandbox domain named ``vmsbx-pool-<id>`` (its files carry
``pool-<id>`` too), in state ``pooled``; it holds no GPU. A create whose spec has the same
shape, no GPU and the same image build claims one: the record takes the sandbox's name and
keeps the guest's name in ``guest`` (libvirt cannot rename a running domain), so every command
finds the sandbox by the name in its record. A claimed guest never returns to the pool.

A shape with ``gpus`` (the largest GPU request it serves) boots its guests with that many
spare root ports when the host has bindable GPUs. A create asking for at most that many GPUs,
and for nothing else the shape differs in, then claims one: the GPUs are chosen as for a cold
create and attached to the running guest (gpu_steps.py). A request for more GPUs, for every
GPU (``all``), or one made on a host whose pooled guests have no spare ports, boots cold.
"""

from __future__ import annotations

import sys
from typing import Any

from vmsandbox.config import PoolShape
from vmsandbox.errors import InvalidArgument
from vmsandbox.sandbox.spec import SandboxSpec, generate_name

POOL_PREFIX = "pool-"


class NoPooledGuest(Exception):
    """The claim step found no ready pooled guest of the shape: the create boots cold."""


class PoolFull(Exception):
    """The fill step found the shape's pool full (counting guests still booting)."""


def shape_spec(shape: PoolShape) -> SandboxSpec:
    """The spec a pooled guest of ``shape`` is created with."""
    return SandboxSpec(
        name=generate_name(POOL_PREFIX.rstrip("-")),
        image=shape.image,
        cpus=shape.cpus,
        memory_mib=shape.memory_mib,
        disk_gib=shape.disk_gib,
    )


def fits(shape: PoolShape, spec: SandboxSpec) -> bool:
    """Whether a guest of ``shape`` can serve ``spec``: a GPU sandbox only when the shape is
    GPU-ready for that many GPUs (``wanted_gpus``); never a spec with guest setup (the pooled
    guest's first boot is over)."""
    return (
        wanted_gpus(spec) <= shape.gpus
        and spec.guest is None
        and spec.image == shape.image
        and (spec.cpus, spec.memory_mib, spec.disk_gib)
        == (shape.cpus, shape.memory_mib, shape.disk_gib)
    )


def holds(shape: PoolShape, record: Any) -> bool:
    """Whether pooled guest ``record`` (a SandboxRecord) is of ``shape``."""
    return (record.image, record.cpus, record.memory_mib, record.disk_gib) == (
        shape.image,
        shape.cpus,
        shape.memory_mib,
        shape.disk_gib,
    )


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
