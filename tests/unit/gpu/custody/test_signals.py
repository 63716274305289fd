"""Health signals as what they do to a GPU (gpu/custody/signals.py): AER lines of the GPU or its
port, config space on a fake sysfs, a domain paused on an error, Xids."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from framework import fake_sysfs

from vmsandbox.gpu.custody import signals
from vmsandbox.host import aer
from vmsandbox.host.model import Gpu

GPU = "0000:02:00.0"
PORT = "0000:00:06.0"


def gpu(bdf: str = GPU) -> Gpu:
    return Gpu(
        bdf=bdf, vendor="amd", vendor_id="0x1002", device_id="0x5046", class_id="0x030000",
        name=None, driver=None, numa_node=None, iommu_group=3, group_members=(),
        companions=(), companion_ids=(), bars=(), bar_64bit_prefetchable_total=0,
        memory_mib=None, memory_source="unknown", uuid=None, bindable=True, reasons=(),
        in_use_by=None, index=0,
    )  # fmt: skip


def test_a_fatal_error_at_the_gpus_port_quarantines_it_and_a_reset_cures_it() -> None:
    line = f"pcieport {PORT}: AER: Uncorrected (Fatal) error received: {PORT}"
    found = signals.from_aer(aer.parse([line]), [gpu(), gpu("0000:03:00.0")], {GPU: PORT})
    assert [(s.bdf, s.kind, s.quarantines, s.reset_cures) for s in found] == [
        (GPU, "aer", True, True)
    ]
    assert f"its port {PORT}" in found[0].words


def test_a_corrected_error_is_reported_not_quarantined() -> None:
    line = f"pcieport {PORT}: AER: Corrected error received: {GPU}"
    (found,) = signals.from_aer(aer.parse([line]), [gpu()], {GPU: PORT})
    assert not found.quarantines


def test_a_failed_recovery_is_not_cured_by_a_reset() -> None:
    line = f"pcieport {PORT}: AER: device recovery failed"
    (found,) = signals.from_aer(aer.parse([line]), [gpu()], {GPU: PORT})
    assert found.quarantines and not found.reset_cures


def test_config_space_all_ones_twice_is_a_signal(tmp_path: Path) -> None:
    fake_sysfs.gpu(tmp_path, GPU, all_ones=True)
    found = signals.from_config_space(gpu(), str(tmp_path), sleep=lambda _s: None)
    assert found is not None and "all ones" in found.words


def test_config_space_all_ones_once_is_not(tmp_path: Path) -> None:
    folder = fake_sysfs.gpu(tmp_path, GPU, all_ones=True)

    def recover(_seconds: float) -> None:
        (folder / "config").write_bytes(fake_sysfs.config_space(0x1002, 0x5046))

    assert signals.from_config_space(gpu(), str(tmp_path), sleep=recover) is None


def test_d3cold_is_a_signal_and_a_guests_d3hot_is_not(tmp_path: Path) -> None:
    folder = fake_sysfs.gpu(tmp_path, GPU, power_state="D3cold")
    assert signals.from_config_space(gpu(), str(tmp_path), sleep=lambda _s: None) is not None
    for state in ("D3hot", "unknown"):  # a guest's; vfio-pci's while it takes the device
        (folder / "power_state").write_text(f"{state}\n")
        assert signals.from_config_space(gpu(), str(tmp_path), sleep=lambda _s: None) is None


def test_a_domain_paused_on_an_error_signals_its_gpus() -> None:
    (found,) = signals.from_pause([GPU], "vmsbx-a", "ioerror")
    assert found.kind == "vfio" and found.reset_cures
    assert signals.from_pause([GPU], "vmsbx-a", "user") == []


def test_xids_by_the_catalogue() -> None:
    app = signals.from_xid(GPU, 13, "NVRM: Xid (PCI:0000:01:00): 13, Graphics Exception")
    bus = signals.from_xid(GPU, 79, "NVRM: Xid (PCI:0000:01:00): 79, GPU has fallen off the bus")
    assert not app.quarantines
    assert bus.quarantines and not bus.reset_cures
    assert replace(bus, words="") == signals.Signal(GPU, "xid", "", True, False)
