"""Everything a domain needs to take whole GPUs by PCI passthrough (VFIO), as libvirt XML.

``plan`` works out the numbers from the chosen GPUs; ``apply`` writes them into a domain built
by ``vmsandbox.vm.domain.build_domain_xml`` (use ``functools.partial(apply, plan=p)`` as a
``DomainPlan.extra`` callable). The domain must be q35 (it has a ``pcie-root``); with OVMF
(``DomainPlan.uefi``) the large-BAR settings below are what let the guest map the GPUs.

What ``apply`` adds, and why:

- Per GPU a ``pcie-root-port`` of its own (explicit index, after the domain's last PCI
  controller) and one ``<hostdev managed='yes'>`` per function of the card: the GPU and its
  companions (HDMI audio, USB, UCSI) share guest slot 0 of that port's bus and keep their host
  function numbers, function 0 with ``multifunction='on'`` when there is more than one. On
  ``pcie-root`` itself a GPU would be an integrated endpoint with no PCIe link above it, which
  GPU drivers do not expect; behind a port of its own it also gets its own bridge window.
- In full passthrough on an NVSwitch board (a guest with every GPU, which runs Fabric Manager
  itself), each NVSwitch is one more ``<hostdev>`` behind a root port of its own, after the
  GPUs': FM inside the guest finds them as PCI endpoints, as on bare metal. Their BARs are
  small (32 MiB, not prefetchable) and sit in the 32-bit window, so they change neither the
  64-bit window nor the memory limit (``QEMU_OVERHEAD`` covers them).
- A 64-bit MMIO window big enough for the GPUs' 64-bit prefetchable BARs and the padding
  OVMF gives the other root ports (``mmio64_window``). OVMF reserves 32 GiB for 64-bit BARs
  unless told otherwise, far too little for an H100's 128 GiB BAR1: it is told through the
  fw_cfg file ``opt/ovmf/X-PciMmio64Mb``. libvirt 9.0 refuses ``opt/ovmf/`` names in
  ``<sysinfo type='fwcfg'>`` ("That firmware name is reserved"), so the file goes on a
  ``<qemu:commandline>`` as ``-fw_cfg``. The same size goes into ``<pcihole64>`` of the
  ``pcie-root``, so the ACPI 64-bit window QEMU describes to the guest kernel is as large as
  the firmware's, and the kernel can reassign BARs inside it.
- Guest physical address bits that reach past that window (``<cpu><maxphysaddr>``): QEMU
  refuses to start when RAM plus the 64-bit hole does not fit, and a guest cannot use a BAR
  above its address width. With ``host-passthrough`` (KVM) the guest takes the host's width
  (``mode='passthrough'``); any other CPU gets ``mode='emulate'`` with ``bits`` =
  ``phys_bits``. A domain without ``<cpu>`` (TCG) runs QEMU's ``qemu64`` (40 bits); it gets
  that model named, plus 1 GiB pages (``pdpe1gb``): without them OVMF left every BAR
  unassigned once the aperture reached 1 TiB (seen with edk2 2022.11 under TCG), with them a
  2 TiB aperture works.
- Firmware (``firmware``): OVMF for GPUs with large BARs, because it is what the 64-bit
  window settings above size; SeaBIOS, which GPU-less sandboxes boot too, for GPUs whose BARs
  together take at most ``SEABIOS_MAX_BAR_BYTES``: SeaBIOS places those in the 32-bit window
  below 4 GiB whatever the guest's RAM, boots faster, and keeps nested guests off an OVMF path
  that crashes QEMU 7.2-10.0 under TCG with nested SVM (docs/nested-gpu-host.md).
  Real data-center GPUs have a 256 MiB BAR1 at the least, so ``auto`` gives them OVMF.
- A ``<memtune><hard_limit>`` (``hard_limit_kib``) and no ``<memoryBacking><locked/>``: VFIO
  pins all guest RAM for device DMA anyway, and ``<locked/>`` makes QEMU mlockall, which locks
  every later mapping too (thread stacks, malloc arenas) and counts guest RAM a second time:
  on real VFIO (the nested host) QEMU then failed to create a thread ("Resource temporarily
  unavailable") half a minute into the boot and crashed, its locked memory at the limit.
- ``<memballoon model='none'>``: a balloon cannot take back pinned memory.
- vCPUs and guest memory bound to the GPUs' NUMA node (see ``plan``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lxml import etree

from vmsandbox.host.bdf import libvirt_address
from vmsandbox.host.model import Gpu
from vmsandbox.host.numa import format_cpuset
from vmsandbox.host.numa import host_cpus_by_node as host_cpus_by_node
from vmsandbox.vm.domain import QEMU_NS, attribute, required

KIB, MIB, GIB, TIB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
# OVMF's 64-bit aperture when fw_cfg does not size it: never go below it.
OVMF_DEFAULT_MMIO64 = 32 * GIB
# On top of the GPUs' BARs: companion functions' 64-bit BARs, bridge window granularity.
MMIO64_HEADROOM = 1 * GIB
# OVMF pads the prefetchable window of every hot-pluggable root port to 1/256 of the aperture
# (2 GiB of 512 GiB, 8 GiB of 2 TiB); the ports libvirt adds for disks, rng and USB (four
# today) get that much each. The window leaves room for this many such ports.
OTHER_ROOT_PORTS = 8
OVMF_PORT_PADDING_SHIFT = 8
# libvirt's allowance for QEMU itself under VFIO (qemuDomainGetMemLockLimitBytes).
QEMU_OVERHEAD = 1 * GIB
# TCG's translation cache (QEMU's default tb-size), charged to the domain's memory cgroup.
TCG_CODE_BUFFER = 1 * GIB
# What QEMU gives a guest CPU that is not host-passthrough: never ask for less.
DEFAULT_PHYS_BITS = 40
# QEMU's CPU model when the domain names none (TCG here).
DEFAULT_CPU_MODEL = "qemu64"
# Where q35 puts guest RAM above 4 GiB: at 4 GiB, or at 1 TiB when QEMU moves it past the
# HyperTransport hole below 1 TiB (AMD CPU models, QEMU's TCG default qemu64 among them).
RAM_ABOVE_4G = 4 * GIB
RAM_ABOVE_1T = 1 * TIB
AMD_HT_START = RAM_ABOVE_1T - 12 * GIB
FW_CFG_MMIO64 = "opt/ovmf/X-PciMmio64Mb"
# ``auto`` firmware: SeaBIOS when the GPUs' BARs add up to no more than this.
SEABIOS_MAX_BAR_BYTES = 256 * MIB


@dataclass(frozen=True)
class PassthroughPlan:
    """The numbers ``apply`` writes; see ``plan`` for how each is chosen.

    ``slots``: per GPU, the host BDFs of its functions by function number (one guest slot
    each), then one slot per NVSwitch passed along. ``phys_bits``: the guest address width
    the window needs; written for an emulated CPU, and the least a host must have for
    ``host-passthrough``. ``firmware``: "uefi" or "bios". ``numa_node`` and
    ``cpuset`` are None when the domain is not pinned, and ``unpinned_reason`` then says why.
    """

    slots: tuple[tuple[str, ...], ...]
    firmware: str
    mmio64_bytes: int
    phys_bits: int
    hard_limit_kib: int
    vcpus: int
    numa_node: int | None
    cpuset: str | None
    unpinned_reason: str | None


def plan(
    gpus: Sequence[Gpu],
    *,
    vcpus: int,
    memory_mib: int,
    host_cpus: Mapping[int, Sequence[int]] | None,
    virt_type: str = "kvm",
    pin: bool = True,
    switches: Sequence[str] = (),
    firmware: str = "auto",
) -> PassthroughPlan:
    """What a domain with ``gpus`` needs; ``vcpus``, ``memory_mib`` and ``virt_type`` are the
    DomainPlan's ``cpus``, ``memory_mib`` and ``virt_type``; ``host_cpus`` is
    ``host_cpus_by_node()``; ``switches`` the BDFs of NVSwitches that go along (full
    passthrough of a whole board); ``firmware`` the operator's ``gpu_firmware``.

    Memory limit (``hard_limit_kib``): guest memory, which VFIO pins whole for device DMA, plus
    ``QEMU_OVERHEAD`` (libvirt's own rule for VFIO domains, guest memory + 1 GiB; it also covers
    the companions' small BARs) and ``TCG_CODE_BUFFER`` for a TCG domain. libvirt makes it both
    QEMU's locked-memory limit, which VFIO's pinning counts against, and the domain's cgroup
    memory limit, which charges RAM and not BAR mappings: it bounds a runaway QEMU and leaves a
    healthy guest room to spare. The BARs stay out of it: VFIO maps them as device memory,
    neither pinned nor counted.

    Pinning, when ``pin``: every vCPU (and QEMU's emulator threads) may run on any CPU of the
    GPUs' NUMA node, and guest memory comes strictly from that node, so DMA and the CPUs that
    drive it stay local. vCPUs are not pinned one to one, so sandboxes on one node share its
    CPUs. Skipped, with ``unpinned_reason``, when the GPUs span nodes (no node is right for
    all), when their node is unknown (``numa_node`` -1), or when ``host_cpus`` (from
    ``numa.host_cpus_by_node``) lists no CPUs for it.
    """
    if not gpus:
        raise ValueError("a passthrough plan needs at least one GPU")
    window = mmio64_window(gpus)
    overhead = QEMU_OVERHEAD + (TCG_CODE_BUFFER if virt_type == "qemu" else 0)
    hard_limit = memory_mib * MIB + overhead
    node, unpinned = _pin_node(gpus, host_cpus, pin)
    return PassthroughPlan(
        slots=(*(_functions(gpu) for gpu in gpus), *((bdf,) for bdf in switches)),
        firmware=choose_firmware(gpus, firmware),
        mmio64_bytes=window,
        phys_bits=phys_bits(memory_mib, window),
        hard_limit_kib=-(-hard_limit // KIB),
        vcpus=vcpus,
        numa_node=node,
        cpuset=format_cpuset(host_cpus[node]) if node is not None and host_cpus else None,
        unpinned_reason=unpinned,
    )


def choose_firmware(gpus: Sequence[Gpu], choice: str = "auto") -> str:
    """ "uefi" or "bios" for a domain with ``gpus``: ``choice`` unless it is "auto", which is
    "bios" when every BAR of the GPUs together fits ``SEABIOS_MAX_BAR_BYTES``, else "uefi"."""
    if choice != "auto":
        return choice
    total = sum(bar.size for gpu in gpus for bar in gpu.bars)
    return "bios" if total <= SEABIOS_MAX_BAR_BYTES else "uefi"


def mmio64_window(gpus: Sequence[Gpu]) -> int:
    """Bytes of 64-bit MMIO space the firmware must set aside for ``gpus``: a power of two.

    Firmware gives each root port one prefetchable window holding its GPU's 64-bit
    prefetchable BARs, aligned to the largest of them, and lays the windows out largest
    alignment first; after them come the padded windows of the other root ports. The window
    is the smallest power of two (the aperture is aligned to its size), and never less than
    OVMF's default 32 GiB, that holds the GPUs' windows, MMIO64_HEADROOM and OTHER_ROOT_PORTS
    padded ports. One H100 (128 GiB + 32 MiB) needs 256 GiB; eight need 2 TiB.
    """
    ordered = sorted(gpus, key=lambda gpu: (-_largest_bar(gpu), gpu.bdf))
    return fit_window([(_largest_bar(gpu), gpu.bar_64bit_prefetchable_total) for gpu in ordered])


def fit_window(windows: Sequence[tuple[int, int]]) -> int:
    """The aperture (a power of two, at least OVMF's 32 GiB) for root ports whose 64-bit
    prefetchable windows are ``windows`` (alignment, size) in bytes, laid out largest alignment
    first, plus MMIO64_HEADROOM and OTHER_ROOT_PORTS padded ports (``mmio64_window``). A
    GPU-ready pooled guest's spare ports pass their reserves here (gpu/hotplug.py)."""
    end = 0
    for alignment, size in sorted(windows, key=lambda window: -window[0]):
        end = _align_up(end, alignment) + size
    window = OVMF_DEFAULT_MMIO64
    while end + MMIO64_HEADROOM + OTHER_ROOT_PORTS * (window >> OVMF_PORT_PADDING_SHIFT) > window:
        window *= 2
    return window


def phys_bits(memory_mib: int, window: int) -> int:
    """Guest physical address bits that reach the end of the 64-bit MMIO window.

    OVMF puts the window after the end of RAM, aligned to its size, and QEMU's 64-bit hole
    (``pcihole64``) starts there too; QEMU refuses to start a guest whose hole ends above its
    address width. RAM ends below 4 GiB + guest memory, or below 1 TiB + guest memory when
    QEMU moves it above 1 TiB (it does so for AMD CPU models when RAM and hole would reach
    the HyperTransport range). Never below QEMU's default of 40 bits.
    """
    ram_top = RAM_ABOVE_4G + memory_mib * MIB
    if ram_top + window > AMD_HT_START:
        ram_top = RAM_ABOVE_1T + memory_mib * MIB
    top = _align_up(ram_top, window) + window
    return max(DEFAULT_PHYS_BITS, (top - 1).bit_length())


def apply(root: etree._Element, plan: PassthroughPlan) -> None:
    """Write ``plan`` into the ``<domain>`` element ``root`` (see the module docstring)."""
    devices = required(root, "devices")
    pcie_root = devices.find("controller[@type='pci'][@model='pcie-root']")
    if pcie_root is None:
        raise ValueError("GPU passthrough needs a q35 domain with a pcie-root controller")
    etree.SubElement(pcie_root, "pcihole64", unit="KiB").text = str(plan.mmio64_bytes // KIB)
    memtune = _child(root, "memtune", after="currentMemory")
    etree.SubElement(memtune, "hard_limit", unit="KiB").text = str(plan.hard_limit_kib)
    _set_phys_bits(root, plan.phys_bits)
    if plan.cpuset is not None:
        cputune = _child(root, "cputune", after="vcpu")
        for vcpu in range(plan.vcpus):
            etree.SubElement(cputune, "vcpupin", vcpu=str(vcpu), cpuset=plan.cpuset)
        etree.SubElement(cputune, "emulatorpin", cpuset=plan.cpuset)
        numatune = _child(root, "numatune", after="cputune")
        etree.SubElement(numatune, "memory", mode="strict", nodeset=str(plan.numa_node))
    _add_gpus(devices, plan.slots, rom=plan.firmware == "uefi")
    if plan.firmware != "uefi":
        return  # the fw_cfg file below is OVMF's
    commandline = root.find(f"{{{QEMU_NS}}}commandline")
    if commandline is None:
        commandline = etree.SubElement(root, f"{{{QEMU_NS}}}commandline")
    for value in ("-fw_cfg", f"name={FW_CFG_MMIO64},string={plan.mmio64_bytes // MIB}"):
        etree.SubElement(commandline, f"{{{QEMU_NS}}}arg", value=value)


def _add_gpus(devices: etree._Element, slots: Sequence[Sequence[str]], *, rom: bool) -> None:
    controllers = devices.findall("controller")
    index = 1 + max(int(attribute(c, "index")) for c in controllers if c.get("type") == "pci")
    balloon = devices.find("memballoon")
    if balloon is None:
        balloon = etree.SubElement(devices, "memballoon")
    balloon.set("model", "none")
    for bus, functions in enumerate(slots, start=index):
        port = etree.Element("controller", type="pci", index=str(bus), model="pcie-root-port")
        controllers[-1].addnext(port)
        controllers.append(port)
        for bdf in functions:
            balloon.addprevious(hostdev(bdf, bus, multifunction=len(functions) > 1, rom=rom))


def hostdev(bdf: str, bus: int, *, multifunction: bool, rom: bool) -> etree._Element:
    """The managed ``<hostdev>`` of host function ``bdf`` on guest bus ``bus``, slot 0, with the
    host's function number; ``multifunction`` on function 0 of a card with companions; no
    option ROM unless ``rom`` (SeaBIOS would run a VGA card's)."""
    element = etree.Element("hostdev", mode="subsystem", type="pci", managed="yes")
    source = libvirt_address(bdf)
    etree.SubElement(etree.SubElement(element, "source"), "address", attrib=source)
    guest = etree.SubElement(
        element,
        "address",
        type="pci",
        domain="0x0000",
        bus=f"0x{bus:02x}",
        slot="0x00",
        function=source["function"],
    )
    if multifunction and source["function"] == "0x0":
        guest.set("multifunction", "on")
    if not rom:
        etree.SubElement(element, "rom", bar="off")
    return element


def _set_phys_bits(root: etree._Element, bits: int) -> None:
    cpu = root.find("cpu")
    if cpu is None:
        cpu = etree.Element("cpu", mode="custom", match="exact", check="none")
        etree.SubElement(cpu, "model", fallback="forbid").text = DEFAULT_CPU_MODEL
        etree.SubElement(cpu, "feature", policy="require", name="pdpe1gb")
        required(root, "features").addnext(cpu)
    if cpu.get("mode") == "host-passthrough":
        etree.SubElement(cpu, "maxphysaddr", mode="passthrough")
    else:
        etree.SubElement(cpu, "maxphysaddr", mode="emulate", bits=str(bits))


def _pin_node(
    gpus: Sequence[Gpu], host_cpus: Mapping[int, Sequence[int]] | None, pin: bool
) -> tuple[int | None, str | None]:
    """The NUMA node to pin to, or None and why not."""
    if not pin:
        return None, "pinning was not asked for"
    nodes = sorted({gpu.numa_node for gpu in gpus}, key=lambda node: (node is None, node))
    if len(nodes) > 1:
        shown = ", ".join("unknown" if node is None else str(node) for node in nodes)
        return None, f"the GPUs sit on different NUMA nodes ({shown})"
    node = nodes[0]
    if node is None:
        return None, "the GPUs' NUMA node is unknown"
    if not host_cpus or not host_cpus.get(node):
        return None, f"no host CPUs are known for NUMA node {node}"
    return node, None


def _functions(gpu: Gpu) -> tuple[str, ...]:
    """The card's functions (GPU and companions), by function number."""
    return tuple(
        sorted((gpu.bdf, *gpu.companions), key=lambda bdf: libvirt_address(bdf)["function"])
    )


def _largest_bar(gpu: Gpu) -> int:
    """Alignment of the GPU's prefetchable window: its largest 64-bit prefetchable BAR."""
    return max((bar.size for bar in gpu.bars if bar.is_64bit and bar.prefetchable), default=1)


def _align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def _child(parent: etree._Element, tag: str, *, after: str) -> etree._Element:
    """``parent``'s child ``tag``, created right after its child ``after`` when missing."""
    found = parent.find(tag)
    if found is None:
        found = etree.Element(tag)
        required(parent, after).addnext(found)
    return found
