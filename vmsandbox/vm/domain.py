"""libvirt domain XML for one sandbox, built with lxml from ``templates/domain.xml``.

Every value that comes from a caller is set as an element text or attribute through lxml, never
pasted into markup, so names and paths cannot inject XML. The sandbox's record (spec, image,
SSH endpoint, state) rides along in a ``<metadata>`` element of our own namespace: libvirt is the
only database.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lxml import etree

from vmsandbox.resources import TEMPLATES

TEMPLATE = TEMPLATES / "domain.xml"
METADATA_NS = "https://vmsandbox.dev/xmlns/sandbox/1"
METADATA_KEY = "vmsandbox"
QEMU_NS = "http://libvirt.org/schemas/domain/qemu/1.0"
DOMAIN_PREFIX = "vmsbx-"
# Guest slot of the user-mode NIC on pcie.0, clear of libvirt's own placements.
USER_NET_SLOT = "0x10"
# The virtio-serial port that guest/programs/control.py serves in the project's own images.
CONTROL_PORT = "org.vmsandbox.control.0"
_HOSTFWD = re.compile(r"hostfwd=tcp:127\.0\.0\.1:\d+-:22")


@dataclass
class DomainPlan:
    """Everything the XML needs. Paths are host paths the hypervisor opens; none reach the guest."""

    domain_name: str
    uuid: str
    virt_type: str  # "kvm" | "qemu"
    cpus: int
    memory_mib: int
    overlay: Path
    seed: Path
    console_log: Path
    record: dict[str, Any]
    state: str = "creating"  # the lifecycle state stored beside the record
    kernel: Path | None = None
    initrd: Path | None = None
    cmdline: str | None = None
    network: str = "user"  # "user" or a libvirt network name
    mac: str = "52:54:00:00:00:01"  # the guest NIC's, matched by the seed's network config
    ssh_port: int | None = None  # user networking: host port forwarded to guest port 22
    guest_outbound: bool = False
    uefi: bool = False
    nvram: Path | None = None
    ovmf_code: Path | None = None
    ovmf_vars: Path | None = None
    # Host end of the control channel (a socket QEMU listens on), for images that serve it.
    control_socket: Path | None = None
    extra: list[Any] = field(default_factory=list)  # callables(tree) that add devices (GPUs)


def build_domain_xml(plan: DomainPlan) -> str:
    """Return the domain XML for ``plan`` as a string."""
    parser = etree.XMLParser(remove_blank_text=True, remove_comments=True, resolve_entities=False)
    root = etree.parse(str(TEMPLATE), parser).getroot()
    root.set("type", plan.virt_type)
    required(root, "name").text = plan.domain_name
    uuid = etree.Element("uuid")
    uuid.text = plan.uuid
    required(root, "name").addnext(uuid)
    title = etree.Element("title")  # the sandbox's name, also where the domain name is not it
    title.text = str(plan.record.get("name", plan.domain_name))
    uuid.addnext(title)
    _set_metadata(required(root, "metadata"), plan.record, state=plan.state)
    for tag in ("memory", "currentMemory"):
        required(root, tag).text = str(plan.memory_mib)
    required(root, "vcpu").text = str(plan.cpus)
    _set_os(required(root, "os"), plan)
    if plan.virt_type == "kvm":
        cpu = etree.Element("cpu", mode="host-passthrough", check="none", migratable="off")
        required(root, "features").addnext(cpu)
    devices = required(root, "devices")
    console = required(devices, "serial")
    _add_disks(devices, console, plan)
    log = etree.SubElement(console, "log", file=str(plan.console_log), append="off")
    console.insert(0, log)
    _add_network(root, devices, plan)
    if plan.control_socket is not None:
        _add_control(devices, plan.control_socket)
    for add in plan.extra:
        add(root)
    return etree.tostring(root, pretty_print=True, encoding="unicode")


def required(parent: etree._Element, path: str) -> etree._Element:
    """``parent.find(path)`` for an element that the template (or libvirt) always writes; a
    definition without it is malformed: ValueError."""
    found = parent.find(path)
    if found is None:
        raise ValueError(f"the domain XML has no {path!r} in its {parent.tag!r} element")
    return found


def attribute(element: etree._Element, name: str) -> str:
    """``element``'s attribute ``name``, which the template (or libvirt) always writes; an
    element without it is malformed: ValueError."""
    value = element.get(name)
    if value is None:
        raise ValueError(f"the domain XML's {element.tag!r} element has no {name!r} attribute")
    return value


def _set_os(os_el: etree._Element, plan: DomainPlan) -> None:
    if plan.uefi:
        loader = etree.SubElement(os_el, "loader", readonly="yes", type="pflash")
        loader.text = str(plan.ovmf_code)
        nvram = etree.SubElement(os_el, "nvram")
        if plan.ovmf_vars:
            nvram.set("template", str(plan.ovmf_vars))
        nvram.text = str(plan.nvram)
    if plan.kernel is not None:
        for tag, value in (("kernel", plan.kernel), ("initrd", plan.initrd)):
            if value is not None:
                etree.SubElement(os_el, tag).text = str(value)
        etree.SubElement(os_el, "cmdline").text = plan.cmdline or ""
    else:
        etree.SubElement(os_el, "boot", dev="hd")
    if not plan.uefi:
        # SeaBIOS writes to the serial console too ("No bootable device." must reach the log);
        # OVMF does so by itself.
        etree.SubElement(os_el, "bios", useserial="yes")


def _add_disks(devices: etree._Element, before: etree._Element, plan: DomainPlan) -> None:
    disk = etree.Element("disk", type="file", device="disk")
    etree.SubElement(disk, "driver", name="qemu", type="qcow2", discard="unmap")
    etree.SubElement(disk, "source", file=str(plan.overlay))
    etree.SubElement(disk, "target", dev="vda", bus="virtio")
    # The seed is a virtio disk, not a SATA CD-ROM: cloud kernels carry no AHCI driver.
    seed = etree.Element("disk", type="file", device="disk")
    etree.SubElement(seed, "driver", name="qemu", type="raw")
    etree.SubElement(seed, "source", file=str(plan.seed))
    etree.SubElement(seed, "target", dev="vdb", bus="virtio")
    etree.SubElement(seed, "readonly")
    before.addprevious(disk)
    before.addprevious(seed)


def _add_control(devices: etree._Element, path: Path) -> None:
    """The control channel: a virtio-serial port named CONTROL_PORT in the guest, a UNIX socket
    at ``path`` on the host (in the sandbox's private folder: only root reaches it)."""
    channel = etree.Element("channel", type="unix")
    etree.SubElement(channel, "source", mode="bind", path=str(path))
    etree.SubElement(channel, "target", type="virtio", name=CONTROL_PORT)
    required(devices, "rng").addprevious(channel)


def _add_network(root: etree._Element, devices: etree._Element, plan: DomainPlan) -> None:
    """The NIC, without an option ROM: sandboxes never boot from the network, and SeaBIOS
    starting iPXE's (its banner, its PCI setup) was part of every boot under TCG."""
    if plan.network != "user":
        iface = etree.SubElement(devices, "interface", type="network")
        etree.SubElement(iface, "mac", address=plan.mac)
        etree.SubElement(iface, "source", network=plan.network)
        etree.SubElement(iface, "model", type="virtio")
        etree.SubElement(iface, "rom", enabled="no")
        required(devices, "serial").addprevious(iface)
        return
    if plan.ssh_port is None:
        raise ValueError("user networking needs an ssh_port")
    netdev = f"user,id=vmsbxnet0,hostfwd=tcp:127.0.0.1:{int(plan.ssh_port)}-:22"
    if not plan.guest_outbound:
        netdev += ",restrict=on"
    device = f"virtio-net-pci,netdev=vmsbxnet0,bus=pcie.0,addr={USER_NET_SLOT},mac={plan.mac}"
    device += ",romfile="
    commandline = etree.SubElement(root, f"{{{QEMU_NS}}}commandline")
    for value in ("-netdev", netdev, "-device", device):
        etree.SubElement(commandline, f"{{{QEMU_NS}}}arg", value=value)


def _set_metadata(metadata: etree._Element, record: dict[str, Any], state: str) -> None:
    sandbox = etree.SubElement(
        metadata, f"{{{METADATA_NS}}}sandbox", nsmap={METADATA_KEY: METADATA_NS}
    )
    sandbox.set("state", state)
    sandbox.text = json.dumps(record, sort_keys=True)


def metadata_xml(record: dict[str, Any], state: str) -> str:
    """The metadata element alone, as ``virDomainSetMetadata`` wants it: libvirt puts it in our
    namespace itself, so the element is given without one."""
    sandbox = etree.Element("sandbox", state=state)
    sandbox.text = json.dumps(record, sort_keys=True)
    return etree.tostring(sandbox, encoding="unicode")


def read_metadata(domain_xml: str) -> tuple[dict[str, Any], str] | None:
    """Our record and state from a domain's XML, or None when the domain is not ours."""
    root = etree.fromstring(domain_xml.encode(), etree.XMLParser(resolve_entities=False))
    sandbox = root.find(f"metadata/{{{METADATA_NS}}}sandbox")
    if sandbox is None or not sandbox.text:
        return None
    try:
        record = json.loads(sandbox.text)
    except ValueError:
        return None
    if not isinstance(record, dict):
        return None
    return record, sandbox.get("state", "unknown")


def with_ssh_port(xml: str, port: int) -> str:
    """Domain XML ``xml`` (as libvirt keeps it) with its user network's SSH forward moved to
    loopback port ``port`` (QEMU could not bind the old one: another program took it)."""
    root = etree.fromstring(xml.encode(), etree.XMLParser(resolve_entities=False))
    for arg in root.iterfind(f"{{{QEMU_NS}}}commandline/{{{QEMU_NS}}}arg"):
        value = arg.get("value", "")
        if value.startswith("user,id=vmsbxnet0,"):
            arg.set("value", _HOSTFWD.sub(f"hostfwd=tcp:127.0.0.1:{int(port)}-:22", value))
    return etree.tostring(root, encoding="unicode")
