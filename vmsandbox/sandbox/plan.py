"""Planning a sandbox: spec + image + config + GPUs -> the record and the domain to define.

Pure: nothing here reads the host or libvirt (the caller hands in the GPUs, the port, the MAC,
the host CPUs per NUMA node), so ``create``, ``dry_run`` and the benchmarks build the very same
domain from the same inputs. A plan is never changed after it is made; a new port means a new
plan (``with_port``).
"""

from __future__ import annotations

import functools
import os
import socket
import uuid
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from vmsandbox.errors import InvalidArgument, ResourceExhausted
from vmsandbox.gpu.record import GpuRecord
from vmsandbox.image.build import KERNEL_CMDLINE, LATE_NIC_ARG
from vmsandbox.image.store import BaseImage
from vmsandbox.sandbox import expiry
from vmsandbox.sandbox.record import (
    STATE_CREATING,
    HotplugRecord,
    SandboxFiles,
    SandboxRecord,
    SshRecord,
)
from vmsandbox.vm import domain as domain_xml
from vmsandbox.vm.domain import DOMAIN_PREFIX
from vmsandbox.vm.process import ProcessIdentity

if TYPE_CHECKING:
    from vmsandbox.config import Config
    from vmsandbox.gpu.allocator import Allocation
    from vmsandbox.gpu.hotplug import HotplugPlan
    from vmsandbox.host.model import Gpu
    from vmsandbox.sandbox.spec import SandboxSpec

LOOPBACK = "127.0.0.1"
UNIX_PATH_MAX = 107  # bytes of a UNIX socket's path (sun_path less its final NUL)


@dataclass(frozen=True)
class SandboxPlan:
    """What ``create`` will make: the record, the files, and the domain to define."""

    record: SandboxRecord
    files: SandboxFiles
    domain: domain_xml.DomainPlan
    gpus: tuple[Gpu, ...]

    @property
    def domain_name(self) -> str:
        return self.domain.domain_name

    def xml(self) -> str:
        return domain_xml.build_domain_xml(self.domain)


def new_mac() -> str:
    """A random MAC in QEMU's locally administered 52:54:00 range."""
    return "52:54:00:" + ":".join(f"{b:02x}" for b in os.urandom(3))


def plan(
    spec: SandboxSpec,
    *,
    name: str,
    config: Config,
    image: BaseImage | None,
    virt_type: str,
    allocation: Allocation | None = None,
    port: int | None = None,
    mac: str = "52:54:00:00:00:01",
    host_cpus: dict[int, list[int]] | None = None,
    files: SandboxFiles | None = None,
    creator: ProcessIdentity | None = None,
    created_at: str | None = None,
    hotplug: HotplugPlan | None = None,
    domain_uuid: str | None = None,
) -> SandboxPlan:
    """The plan of sandbox ``name`` (``image`` None: where an unbuilt image will be).

    ``port`` is the loopback port forwarded to the guest's sshd (user networking only);
    ``host_cpus`` the host's CPUs per NUMA node, for pinning GPU sandboxes. ``allocation``
    (None: no GPUs) gives the GPUs and, on NVSwitch boards, the NVSwitches passed along (full
    passthrough) or the Fabric Manager partition that connects them (shared mode); the record
    names both. ``hotplug`` (a GPU-less pooled guest only): spare root ports for GPUs attached
    later, with the boot settings they need (gpu/hotplug.py). ``domain_uuid``: the UUID the
    create reserved (its identity from then on; a fresh one when None).
    """
    files = files or SandboxFiles.of(config, name)
    gpus = allocation.gpus if allocation else ()
    switches = [switch.bdf for switch in allocation.switches] if allocation else []
    partition = allocation.partition if allocation else None
    alias = DOMAIN_PREFIX + name
    record = SandboxRecord(
        name=name,
        image=spec.image,
        image_id=image.id if image else None,
        cpus=spec.cpus,
        memory_mib=spec.memory_mib,
        disk_gib=spec.disk_gib,
        virt_type=virt_type,
        network=config.network,
        ssh=SshRecord(host=LOOPBACK, port=port, user=config.ssh_user),
        mac=mac,
        keys=str(files.keys_dir),
        host_key_alias=alias,
        created_at=created_at or expiry.stamp(expiry.now()),
        creator=creator,
        labels=dict(spec.labels),
        credential=spec.credential,
        owner=spec.owner,
        gpus=tuple(GpuRecord.of(gpu) for gpu in gpus),
        fabric_partition=partition.id if partition else None,
        switches=tuple(switches),
        hotplug=_hotplug_record(hotplug),
        expires_at=expiry.ends_at(spec.ttl),
    )
    image_dir = image.path if image else config.images / spec.image / "current"
    domain = domain_xml.DomainPlan(
        domain_name=alias,
        uuid=domain_uuid or str(uuid.uuid4()),
        virt_type=virt_type,
        cpus=spec.cpus,
        memory_mib=spec.memory_mib,
        overlay=files.overlay,
        seed=files.seed,
        console_log=files.console_log,
        record=record.to_dict(),
        state=STATE_CREATING,
        kernel=image.kernel if image else image_dir / "vmlinuz",
        initrd=image.initrd if image else image_dir / "initrd.img",
        cmdline=(image.cmdline if image else KERNEL_CMDLINE) + (f" {LATE_NIC_ARG}" if gpus else ""),
        network=config.network,
        mac=mac,
        ssh_port=port,
        guest_outbound=config.guest_outbound,
        control_socket=files.control if _control_fits(image, files) else None,
    )
    firmware = None
    if hotplug is not None:
        from vmsandbox.gpu import hotplug as spare

        domain = replace(domain, extra=[functools.partial(spare.apply, plan=hotplug)])
        firmware = hotplug.firmware
    if gpus:
        from vmsandbox.gpu import passthrough

        devices = passthrough.plan(
            list(gpus),
            host_cpus=host_cpus,
            vcpus=spec.cpus,
            memory_mib=spec.memory_mib,
            virt_type=virt_type,
            pin=config.numa_pinning,
            switches=switches,
            firmware=config.gpu_firmware,
        )
        domain = replace(domain, extra=[functools.partial(passthrough.apply, plan=devices)])
        firmware = devices.firmware
    if firmware == "uefi":
        domain = replace(
            domain,
            uefi=True,
            nvram=files.nvram,
            ovmf_code=config.ovmf_code,
            ovmf_vars=config.ovmf_vars,
        )
    return SandboxPlan(record=record, files=files, domain=domain, gpus=gpus)


def _hotplug_record(hotplug: HotplugPlan | None) -> HotplugRecord | None:
    if hotplug is None:
        return None
    from vmsandbox.gpu.hotplug import port_indexes

    return HotplugRecord(buses=port_indexes(hotplug.ports), firmware=hotplug.firmware)


def _control_fits(image: BaseImage | None, files: SandboxFiles) -> bool:
    """A control channel for images whose guest serves one, where its socket's path fits a
    UNIX socket address (107 bytes); without it a pool claim sets the hostname over SSH."""
    return image is not None and image.has_control and len(bytes(files.control)) <= UNIX_PATH_MAX


def with_port(planned: SandboxPlan, port: int) -> SandboxPlan:
    """The same plan with another forwarded SSH port (the first one was taken meanwhile)."""
    record = replace(planned.record, ssh=replace(planned.record.ssh, port=port))
    domain = replace(planned.domain, ssh_port=port, record=record.to_dict())
    return replace(planned, record=record, domain=domain)


def check_caps(spec: SandboxSpec, config: Config) -> None:
    """INVALID_ARGUMENT when the spec asks for more than this host allows one sandbox: vCPUs,
    memory, disk, and a number of GPUs (counted or named) over ``max_gpus``."""
    gpus = (spec.gpu.count or len(spec.gpu.devices)) if spec.gpu else 0
    for what, value, cap in (
        ("cpus", spec.cpus, config.max_cpus),
        ("memory_mib", spec.memory_mib, config.max_memory_mib),
        ("disk_gib", spec.disk_gib, config.max_disk_gib),
        ("gpus", gpus, config.max_gpus),
    ):
        if value > cap:
            raise InvalidArgument(
                f"{what} {value} is over this host's cap of {cap} per sandbox",
                details={"field": what, "value": value, "max": cap},
            )


def check_disk(spec: SandboxSpec, image: BaseImage) -> None:
    """INVALID_ARGUMENT when the disk is smaller than the image it is made from."""
    if spec.disk_gib * 2**30 < image.virtual_size:
        raise InvalidArgument(
            f"disk_gib {spec.disk_gib} is smaller than image {image.name!r} "
            f"({image.virtual_size / 2**30:.1f} GiB)",
            details={"field": "disk_gib", "value": spec.disk_gib},
        )


def free_port(taken: set[int | None]) -> int:
    """A loopback port not in ``taken`` that nothing listens on right now. QEMU binds it only
    at start, so it can still be taken meanwhile: the create's start step then plans another."""
    for _ in range(64):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((LOOPBACK, 0))
            port = int(probe.getsockname()[1])
        if port not in taken:
            return port
    raise ResourceExhausted("no free loopback port found for SSH forwarding")
