"""GPU-ready pooled guests: spare PCIe root ports booted empty, and GPUs attached to them live.

A ``[pool]`` shape with ``gpus = N`` (sandbox/pool/shapes.py) boots its guests with N spare
``pcie-root-port`` controllers, so that a ``create --gpu`` can claim a booted guest and attach
the GPUs to it (sandbox/pool/gpu_steps.py) instead of booting one. ``plan`` sizes them from
the host's GPUs; ``apply`` writes them into a domain; ``hostdev_xml`` is what is attached to one.

The hotplug mode is QEMU's ACPI PCI hotplug, q35's default since QEMU 6.1: the guest kernel
hears of a new device through an ACPI notification and scans the port (about 1 s here, against
about 8 s for native pciehp and its 5 s attention-button delay). ACPI hotplug never resizes a
bridge window: a device whose BARs do not fit the port's windows stays unassigned. So each port
carries its reserves, set through ``<qemu:override>`` on the port's ``<alias name='ua-hp…'/>``
(libvirt 9.0 has no element for them; QEMU's ``pcie-root-port`` has the properties and passes
them to the firmware, SeaBIOS and OVMF alike, in its resource-reserve capability):

- ``pref64-reserve``: the host's largest 64-bit prefetchable window of one card (its GPU's
  64-bit prefetchable BARs laid out largest first), a power of two: a bridge window is
  aligned to its size.
- ``mem-reserve``: the card's other memory BARs (32-bit or not prefetchable: a 32-bit BAR
  cannot sit in the 64-bit prefetchable window), plus ``COMPANION_MEM`` per companion function
  (HDMI audio, USB, UCSI: BARs of 16 KiB to 256 KiB), a power of two and at least
  ``BRIDGE_MEM_GRANULE``.
- ``io-reserve`` is not set: GPU drivers drive the card through its memory BARs, and the
  firmware's default I/O window of a hotplug port (4 KiB) covers a legacy I/O BAR.

The rest of what a GPU domain needs at boot comes from passthrough.py, planned for N of the
host's largest GPUs: the 64-bit MMIO window, the guest's physical address bits, the firmware
(``choose_firmware``), the memory limit and no balloon. Every other PCI device of the domain
(disks, rng, USB, virtio-serial) is placed on ``pcie.0`` itself: libvirt puts a device without
an address on the first empty root port, which would take the spare ones.

The ports' guest addresses are fixed (``port_address``): the guest finds an attached GPU under
its port in sysfs whatever bus number the firmware gave the port.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from lxml import etree

from vmsandbox.gpu import passthrough
from vmsandbox.host.bdf import libvirt_address
from vmsandbox.host.model import Bar, Gpu
from vmsandbox.vm.domain import QEMU_NS, USER_NET_SLOT, attribute, required

MIB = 1 << 20
# A bridge's memory window has a 1 MiB granularity (PCI-to-PCI bridge spec).
BRIDGE_MEM_GRANULE = 1 * MIB
# Memory set aside per companion function (HDMI audio 16 KiB, USB 256 KiB, UCSI 4 KiB BARs).
COMPANION_MEM = 1 * MIB
# The spare ports sit on pcie.0 slot PORT_SLOT (functions 0-7) and the slots after it.
PORT_SLOT = 0x01
FUNCTIONS_PER_SLOT = 8
# Slots on pcie.0 for the domain's other PCI devices, after the user-mode NIC's.
FIRST_DEVICE_SLOT = int(USER_NET_SLOT, 16) + 1
# The spare ports' controller indexes start here (index 0 is pcie-root).
FIRST_PORT_INDEX = 1
ALIAS_PREFIX = "ua-hp"


@dataclass(frozen=True)
class HotplugPlan:
    """Spare root ports and the boot settings for ``ports`` GPUs attached later.

    ``devices``: passthrough.py's plan for that many of the host's largest GPUs, without
    their slots:
    window, address bits, firmware, memory limit. ``pref64_reserve`` and ``mem_reserve`` in
    bytes (0: not set).
    """

    ports: int
    pref64_reserve: int
    mem_reserve: int
    devices: passthrough.PassthroughPlan

    @property
    def firmware(self) -> str:
        return self.devices.firmware


def plan(
    gpus: Sequence[Gpu],
    ports: int,
    *,
    vcpus: int,
    memory_mib: int,
    virt_type: str,
    firmware: str = "auto",
) -> HotplugPlan | None:
    """The plan for ``ports`` spare ports that can take any of ``gpus`` (the host's bindable
    GPUs); None when there are none or no port is asked for."""
    if not gpus or ports < 1:
        return None
    largest = max(gpus, key=lambda gpu: (_card_bytes(gpu), gpu.bdf))
    sized = passthrough.plan(
        [largest] * ports,
        vcpus=vcpus,
        memory_mib=memory_mib,
        host_cpus=None,
        virt_type=virt_type,
        pin=False,
        firmware=firmware,
    )
    pref64 = max(_layout([b for b in gpu.bars if _pref64(b)]) for gpu in gpus)
    reserve = _power_of_two(pref64) if pref64 else 0
    # The aperture must hold every spare port's reserve as the firmware sets it aside (a
    # power of two, aligned to its size), not the GPUs' BARs as they are: 128 GiB + 32 MiB of
    # BARs take a 256 GiB reserve, and the virtio devices' BARs need room beside them.
    spare = [(reserve, reserve)] * ports if reserve else []
    window = max(sized.mmio64_bytes, passthrough.fit_window(spare))
    devices = replace(
        sized,
        slots=(),  # the boot settings only: no GPU is passed at boot
        mmio64_bytes=window,
        phys_bits=passthrough.phys_bits(memory_mib, window),
    )
    mem = max(
        _layout([b for b in gpu.bars if not _pref64(b)]) + COMPANION_MEM * len(gpu.companions)
        for gpu in gpus
    )
    return HotplugPlan(
        ports=ports,
        pref64_reserve=reserve,
        mem_reserve=_power_of_two(max(mem, BRIDGE_MEM_GRANULE)),
        devices=devices,
    )


def port_address(port: int) -> tuple[int, int]:
    """(slot, function) on pcie.0 of spare port ``port`` (0-based)."""
    return PORT_SLOT + port // FUNCTIONS_PER_SLOT, port % FUNCTIONS_PER_SLOT


def guest_port(port: int) -> str:
    """The guest's PCI address of spare port ``port``: its GPU shows up below it in sysfs."""
    slot, function = port_address(port)
    return f"0000:00:{slot:02x}.{function:x}"


def port_indexes(ports: int) -> tuple[int, ...]:
    """The controller indexes of ``ports`` spare ports: the ``bus`` of a hostdev attached to
    each, in port order."""
    return tuple(range(FIRST_PORT_INDEX, FIRST_PORT_INDEX + ports))


def apply(root: etree._Element, plan: HotplugPlan) -> None:
    """Write ``plan`` into the ``<domain>`` ``root`` (see the module docstring); ValueError
    when the domain already has a PCI controller at a spare port's index."""
    devices = required(root, "devices")
    taken = {int(attribute(c, "index")) for c in devices.iterfind("controller[@type='pci']")}
    if taken & set(port_indexes(plan.ports)):
        raise ValueError(f"PCI controller indexes {sorted(taken)} overlap the spare ports'")
    passthrough.apply(root, plan.devices)
    _place_on_root_bus(devices)
    controllers = devices.findall("controller")
    override = etree.SubElement(root, f"{{{QEMU_NS}}}override")
    for port, index in enumerate(port_indexes(plan.ports)):
        controller = etree.Element("controller", type="pci", index=str(index))
        controller.set("model", "pcie-root-port")
        alias = f"{ALIAS_PREFIX}{port + 1}"
        etree.SubElement(controller, "alias", name=alias)
        slot, function = port_address(port)
        address = etree.SubElement(
            controller,
            "address",
            type="pci",
            domain="0x0000",
            bus="0x00",
            slot=f"0x{slot:02x}",
            function=f"0x{function:x}",
        )
        if function == 0:
            address.set("multifunction", "on")
        controllers[-1].addnext(controller)
        controllers.append(controller)
        frontend = etree.SubElement(
            etree.SubElement(override, f"{{{QEMU_NS}}}device", alias=alias),
            f"{{{QEMU_NS}}}frontend",
        )
        for name, value in (
            ("pref64-reserve", plan.pref64_reserve),
            ("mem-reserve", plan.mem_reserve),
        ):
            if value:
                etree.SubElement(
                    frontend, f"{{{QEMU_NS}}}property", name=name, type="unsigned", value=str(value)
                )


def hostdev_xml(bdf: str, bus: int, *, multifunction: bool, firmware: str) -> str:
    """The managed ``<hostdev>`` of host function ``bdf`` for the spare port of controller
    index ``bus`` (guest slot 0, the host's function number), as attachDeviceFlags takes it;
    ``multifunction`` on function 0 of a card with companions, no option ROM under SeaBIOS
    (as passthrough.py does at boot)."""
    element = passthrough.hostdev(bdf, bus, multifunction=multifunction, rom=firmware == "uefi")
    return etree.tostring(element, encoding="unicode")


def placed(xml: str, bdfs: Sequence[str]) -> tuple[tuple[int, ...], str]:
    """Where the GPUs ``bdfs`` (host addresses of their function 0) sit in domain XML ``xml``
    (a cold-made sandbox's root ports of its own, or a claimed guest's spare ports): the guest
    bus of each, in the order given, and the firmware their hostdevs were written for
    ("uefi" when they keep their option ROM, as ``hostdev_xml`` writes them). ValueError for
    a GPU the domain does not hold."""
    root = etree.fromstring(xml.encode(), etree.XMLParser(resolve_entities=False))
    buses: list[int] = []
    rom = True
    for bdf in bdfs:
        wanted = _numbers(libvirt_address(bdf))
        found = next(
            (
                hostdev
                for hostdev in root.iterfind("devices/hostdev")
                if (source := hostdev.find("source/address")) is not None
                and _numbers(source.attrib) == wanted
            ),
            None,
        )
        address = found.find("address") if found is not None else None
        if found is None or address is None:
            raise ValueError(f"the domain holds no GPU {bdf} at a guest address")
        buses.append(int(attribute(address, "bus"), 16))
        rom = rom and found.find("rom[@bar='off']") is None
    return tuple(buses), "uefi" if rom else "bios"


def port_of(xml: str, bus: int) -> str | None:
    """The guest PCI address of the root port whose controller index is ``bus`` in domain XML
    ``xml`` (a GPU attached to it shows up below it in the guest's sysfs); None when the
    definition gives the port no address."""
    root = etree.fromstring(xml.encode(), etree.XMLParser(resolve_entities=False))
    port = root.find(f"devices/controller[@type='pci'][@index='{int(bus)}']")
    address = port.find("address") if port is not None else None
    if address is None:
        return None
    domain, on, slot, function = (
        int(address.get(key, "0"), 16) for key in ("domain", "bus", "slot", "function")
    )
    return f"{domain:04x}:{on:02x}:{slot:02x}.{function:x}"


def _numbers(address: dict[str, str] | etree._Attrib) -> tuple[int, ...]:
    return tuple(
        int(str(address.get(key, "0")), 16) for key in ("domain", "bus", "slot", "function")
    )


def _place_on_root_bus(devices: etree._Element) -> None:
    """Give every PCI device without an address one on pcie.0, and add the controllers
    libvirt would add (USB; virtio-serial for a channel such as the control channel), so that
    none takes a spare port."""
    if devices.find("controller[@type='usb']") is None:
        usb = etree.Element("controller", type="usb", index="0", model="qemu-xhci")
        required(devices, "controller").addnext(usb)
    has_serial = devices.find("controller[@type='virtio-serial']") is not None
    if devices.find("channel/target[@type='virtio']") is not None and not has_serial:
        serial = etree.Element("controller", type="virtio-serial", index="0")
        required(devices, "controller[@type='usb']").addnext(serial)
    slot = FIRST_DEVICE_SLOT
    for device in devices:
        if device.find("address") is not None or not _on_pci(device):
            continue
        etree.SubElement(
            device,
            "address",
            type="pci",
            domain="0x0000",
            bus="0x00",
            slot=f"0x{slot:02x}",
            function="0x0",
        )
        slot += 1


def _on_pci(device: etree._Element) -> bool:
    """Whether libvirt gives ``device`` a PCI address: virtio disks, rng, NICs, USB and
    virtio-serial controllers."""
    if device.tag == "disk":
        return required(device, "target").get("bus") == "virtio"
    if device.tag == "controller":
        return device.get("type") in ("usb", "virtio-serial")
    return device.tag in ("rng", "interface")


def _pref64(bar: Bar) -> bool:
    return bar.is_64bit and bar.prefetchable


def _layout(bars: Sequence[Bar]) -> int:
    """Bytes a window needs for ``bars``, each aligned to its size, largest first."""
    end = 0
    for bar in sorted(bars, key=lambda bar: -bar.size):
        end = -(-end // bar.size) * bar.size + bar.size
    return end


def _card_bytes(gpu: Gpu) -> int:
    return sum(bar.size for bar in gpu.bars)


def _power_of_two(value: int) -> int:
    return 1 << (value - 1).bit_length()
