"""Domain XML for tests: plans of small sandboxes and of GPU sandboxes on the fake hosts (the
golden cases in ``CASES``), libvirt's RelaxNG schema, and ``define_and_undefine``, which has
the real libvirtd take a document and gives back what it made of it. The fixtures ``hosts``,
``schema`` and ``conn`` are registered for every test by tests/conftest.py.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path

import libvirt
import pytest
from framework.fake_hosts import MIB
from framework.inventories import discover_hosts
from lxml import etree

from vmsandbox.gpu import hotplug, passthrough
from vmsandbox.gpu.allocator import Allocation, select
from vmsandbox.gpu.fabric.mode import FULL_PASSTHROUGH, FabricMode
from vmsandbox.gpu.fabric.policy import allocate
from vmsandbox.gpu.fabric.state import Fabric
from vmsandbox.gpu.request import GpuRequest
from vmsandbox.host.model import Bar, Gpu, Inventory
from vmsandbox.host.numa import parse_cpulist
from vmsandbox.vm.domain import QEMU_NS, DomainPlan, build_domain_xml

SCHEMA = Path("/usr/share/libvirt/schemas/domain.rng")


STATE = Path("/var/lib/vmsandbox/sandboxes/golden")


# Two Sapphire Rapids sockets, 56 cores each with hyper-threads, as sysfs lists them.
HGX_CPUS = {0: parse_cpulist("0-55,112-167"), 1: parse_cpulist("56-111,168-223")}


# name: fake host, request, virt type, vCPUs, memory in MiB
CASES = {
    "hgx_h100_1gpu": ("hgx_h100", GpuRequest(count=1), "kvm", 8, 32768),
    "hgx_h100_2gpu": ("hgx_h100", GpuRequest(count=2), "kvm", 16, 65536),
    "hgx_h100_8gpu": ("hgx_h100", GpuRequest(count=8), "qemu", 32, 262144),
    "workstation_rtx2080ti": ("workstation_rtx2080ti", GpuRequest(), "kvm", 4, 8192),
}


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Inventory]:
    case = {"use_nvml": False, "proc_root": str(tmp_path_factory.mktemp("proc"))}
    names = ["hgx_h100", "workstation_rtx2080ti", "mi300x"]
    return discover_hosts({name: (name, case) for name in names})


@pytest.fixture(scope="module")
def schema() -> etree.RelaxNG:
    return etree.RelaxNG(etree.parse(str(SCHEMA)))


@pytest.fixture(scope="module")
def conn() -> Iterator[libvirt.virConnect]:
    connection = libvirt.open("qemu:///system")
    yield connection
    connection.close()


def domain_plan(
    name: str, virt_type: str, cpus: int, memory_mib: int, **extra: object
) -> DomainPlan:
    """A DomainPlan with fixed names, paths and UUID, as the manager builds one for GPUs."""
    return DomainPlan(
        domain_name=f"vmsbx-{name.replace('_', '-')}",
        uuid="5f0c2a9e-41d3-4b7e-9c1a-0123456789ab",
        virt_type=virt_type,
        cpus=cpus,
        memory_mib=memory_mib,
        overlay=STATE / "disk.qcow2",
        seed=STATE / "seed.img",
        console_log=STATE / "console.log",
        record={"name": name, "image": "minimal", "state": "creating"},
        ssh_port=2222,
        uefi=True,
        nvram=STATE / "OVMF_VARS.fd",
        ovmf_code=Path("/usr/share/OVMF/OVMF_CODE_4M.fd"),
        ovmf_vars=Path("/usr/share/OVMF/OVMF_VARS_4M.fd"),
        **extra,
    )


def gpu_domain_xml(
    gpus: list[Gpu],
    name: str,
    virt_type: str,
    cpus: int,
    memory_mib: int,
    *,
    host_cpus: dict[int, list[int]] | None = HGX_CPUS,
    switches: tuple[str, ...] = (),
    **extra: object,
) -> str:
    plan = passthrough.plan(
        gpus,
        vcpus=cpus,
        memory_mib=memory_mib,
        virt_type=virt_type,
        host_cpus=host_cpus,
        switches=switches,
    )
    domain = domain_plan(name, virt_type, cpus, memory_mib, **extra)
    domain.extra.append(partial(passthrough.apply, plan=plan))
    return build_domain_xml(domain)


def define_and_undefine(conn: libvirt.virConnect, xml: str) -> etree._Element:
    """Define ``xml`` under a fresh test name and UUID; libvirt's own XML of it, undefined."""
    root = etree.fromstring(xml.encode())
    root.find("name").text = f"vmsbx-test-{uuid.uuid4().hex[:8]}"
    root.find("uuid").text = str(uuid.uuid4())
    domain = conn.defineXML(etree.tostring(root, encoding="unicode"))
    try:
        return etree.fromstring(domain.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE).encode())
    finally:
        domain.undefineFlags(libvirt.VIR_DOMAIN_UNDEFINE_NVRAM)


def golden_case(name: str, hosts: dict[str, Inventory]) -> tuple[list[Gpu], str]:
    """The GPUs the allocator picks for case ``name``, and the domain XML for them."""
    host, request, virt_type, cpus, memory_mib = CASES[name]
    gpus = select(request, hosts[host])
    return gpus, gpu_domain_xml(gpus, name, virt_type, cpus, memory_mib)


def full_passthrough_board(hosts: dict[str, Inventory]) -> tuple[Allocation, str]:
    """All 8 GPUs and the 4 NVSwitches of the HGX host, as full passthrough allocates them."""
    fabric = Fabric(FabricMode(FULL_PASSTHROUGH, ("nvswitch",)))
    got = allocate(GpuRequest(count=8), hosts["hgx_h100"], fabric=fabric)
    switches = tuple(device.bdf for device in got.switches)
    return got, gpu_domain_xml(
        list(got.gpus), "hgx_h100_8gpu_nvswitch", "qemu", 32, 262144, switches=switches
    )


def small_bar_gpu(gpu: Gpu) -> Gpu:
    """``gpu`` with the BARs of QEMU's ati-vga (16 MiB framebuffer, 16 KiB registers)."""
    bars = (Bar(0, 16 * MIB, False, True), Bar(2, 16 << 10, False, False))
    return replace(gpu, bars=bars, bar_64bit_prefetchable_total=0)


Q = f"{{{QEMU_NS}}}"


def domain_xml(plan: hotplug.HotplugPlan, name: str, **extra: object) -> str:
    domain = domain_plan(name, "qemu", 1, 512, **extra)
    if plan.firmware != "uefi":
        domain = replace(domain, uefi=False, nvram=None, ovmf_code=None, ovmf_vars=None)
    domain.extra.append(lambda root: hotplug.apply(root, plan))
    return build_domain_xml(domain)


def reserves(root: etree._Element) -> dict[str, dict[str, str]]:
    """Per aliased port: its qemu:override properties."""
    return {
        device.get("alias"): {
            prop.get("name"): prop.get("value") for prop in device.iterfind(f"{Q}frontend/*")
        }
        for device in root.iterfind(f"{Q}override/{Q}device")
    }


def unit_plan(**changes: object) -> DomainPlan:
    """A small sandbox's domain plan, with ``changes`` applied: no host is read."""
    base = {
        "domain_name": "vmsbx-unit",
        "uuid": "8a1e1c9e-2b8f-4a57-9d4e-4c3b9f1e0a11",
        "virt_type": "qemu",
        "cpus": 2,
        "memory_mib": 2048,
        "overlay": Path("/var/lib/vmsandbox/disks/unit.qcow2"),
        "seed": Path("/var/lib/vmsandbox/disks/unit-seed.iso"),
        "console_log": Path("/var/lib/vmsandbox/sandboxes/unit.console.log"),
        "record": {"name": "unit", "state": "creating"},
        "kernel": Path("/var/lib/vmsandbox/images/minimal/x/vmlinuz"),
        "initrd": Path("/var/lib/vmsandbox/images/minimal/x/initrd.img"),
        "cmdline": "root=/dev/vda rw console=ttyS0",
        "ssh_port": 40022,
    }
    base.update(changes)
    return DomainPlan(**base)  # type: ignore[arg-type]


CONTROL = Path("/var/lib/vmsandbox/sandboxes/unit/control.sock")
