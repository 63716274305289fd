"""Spare root ports of GPU-ready pooled guests (vmsandbox.gpu.hotplug), in the domain XML.

The reserves are sized from GPUs the allocator's fake hosts discover (umockdev); every domain
validates against libvirt's RelaxNG schema and is defined on the real libvirtd, where no
device of the domain may end up on a spare port (libvirt puts a device without an address on
the first empty root port).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from lxml import etree

from vmsandbox.gpu import hotplug, passthrough
from vmsandbox.host.model import Inventory

MIB, GIB = 1 << 20, 1 << 30


def test_h100_ports_reserve_a_whole_bar1_and_boot_with_the_window_of_two(
    hosts: dict[str, Inventory],
) -> None:
    h100s = [gpu for gpu in hosts["hgx_h100"].gpus if gpu.bindable]
    plan = hotplug.plan(h100s, 2, vcpus=4, memory_mib=8192, virt_type="kvm")
    assert plan is not None
    # BAR1 128 GiB + BAR3 32 MiB, aligned largest first: the next power of two is 256 GiB
    assert plan.pref64_reserve == 256 * GIB
    assert plan.mem_reserve == 16 * MIB  # BAR0, 16 MiB, 32-bit
    two = passthrough.plan(
        [h100s[0]] * 2, vcpus=4, memory_mib=8192, host_cpus=None, virt_type="kvm", pin=False
    )
    # the aperture holds two 256 GiB reserves, not two cards' 128 GiB + 32 MiB: 1 TiB
    window = 1024 * GIB
    assert plan.devices == replace(
        two, slots=(), mmio64_bytes=window, phys_bits=passthrough.phys_bits(8192, window)
    )
    assert plan.firmware == "uefi"


@pytest.mark.parametrize("ports", [1, 2, 4, 8])
def test_the_aperture_holds_every_spare_ports_reserve_and_room_beside_them(
    hosts: dict[str, Inventory], ports: int
) -> None:
    """Each spare port's 64-bit reserve is a power of two (128 GiB + 32 MiB of BARs take
    256 GiB); the aperture must hold all of them, and still leave the headroom and the padded
    windows of the other root ports (virtio disks, NIC, rng, USB) beside them."""
    h100s = [gpu for gpu in hosts["hgx_h100"].gpus if gpu.bindable]
    plan = hotplug.plan(h100s, ports, vcpus=2, memory_mib=4096, virt_type="kvm")
    assert plan is not None
    window = plan.devices.mmio64_bytes
    others = passthrough.OTHER_ROOT_PORTS * (window >> passthrough.OVMF_PORT_PADDING_SHIFT)
    assert ports * plan.pref64_reserve + passthrough.MMIO64_HEADROOM + others <= window
    assert window & (window - 1) == 0  # a power of two
    assert plan.devices.phys_bits >= passthrough.phys_bits(4096, window)


def test_no_bindable_gpu_or_no_port_plans_nothing(hosts: dict[str, Inventory]) -> None:
    gpus = list(hosts["hgx_h100"].gpus)
    assert hotplug.plan([], 2, vcpus=1, memory_mib=512, virt_type="qemu") is None
    assert hotplug.plan(gpus, 0, vcpus=1, memory_mib=512, virt_type="qemu") is None


def test_companions_and_32_bit_bars_go_to_mem_reserve(hosts: dict[str, Inventory]) -> None:
    card = hosts["workstation_rtx2080ti"].gpus[0]
    assert len(card.companions) == 3  # HDMI audio, USB, UCSI
    plan = hotplug.plan([card], 1, vcpus=1, memory_mib=512, virt_type="kvm")
    assert plan is not None
    # BAR0 16 MiB (32-bit) + 1 MiB per companion = 19 MiB: 32 MiB
    assert plan.mem_reserve == 32 * MIB
    assert plan.pref64_reserve == 512 * MIB  # BAR1 256 MiB + BAR3 32 MiB


def test_apply_refuses_a_domain_whose_controllers_take_the_port_indexes(
    hosts: dict[str, Inventory],
) -> None:
    plan = hotplug.plan(list(hosts["mi300x"].gpus), 1, vcpus=1, memory_mib=512, virt_type="kvm")
    assert plan is not None
    root = etree.fromstring(
        b"<domain><devices><controller type='pci' index='0' model='pcie-root'/>"
        b"<controller type='pci' index='1' model='pcie-root-port'/></devices></domain>"
    )
    with pytest.raises(ValueError, match="overlap the spare ports"):
        hotplug.apply(root, plan)


def test_guest_port_addresses() -> None:
    assert [hotplug.guest_port(i) for i in (0, 1, 7, 8)] == [
        "0000:00:01.0",
        "0000:00:01.1",
        "0000:00:01.7",
        "0000:00:02.0",
    ]
