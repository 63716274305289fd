"""Canonical PCI addresses (vmsandbox.host.bdf)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vmsandbox.host.bdf import (
    Bdf,
    canonical_bdf,
    canonical_slot,
    format_bdf,
    libvirt_address,
    parse_bdf,
    slot_of,
)


@pytest.mark.parametrize(
    ("text", "bdf"),
    [
        ("0000:41:00.0", "0000:41:00.0"),
        ("41:00.0", "0000:41:00.0"),
        ("00000000:C2:00.0", "0000:c2:00.0"),  # NVML's spelling
        ("0001:9B:1f.7", "0001:9b:1f.7"),
        (" 0000:03:00.1\n", "0000:03:00.1"),
    ],
)
def test_canonical_bdf(text: str, bdf: str) -> None:
    assert canonical_bdf(text) == bdf


@pytest.mark.parametrize("text", ["", "0000:41:00", "0000:41:00.8", "pci_0000_41_00_0", "g:00.0"])
def test_canonical_bdf_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="not a PCI address"):
        canonical_bdf(text)


@given(st.integers(0, 0xFFFF), st.integers(0, 0xFF), st.integers(0, 0x1F), st.integers(0, 7))
def test_format_then_parse_round_trips(domain: int, bus: int, slot: int, function: int) -> None:
    bdf = format_bdf(domain, bus, slot, function)
    assert canonical_bdf(bdf.upper()) == bdf
    assert slot_of(bdf) == f"{domain:04x}:{bus:02x}:{slot:02x}"


@pytest.mark.parametrize(
    "text", ["0000:41:20.0", "1:00.0", "41:0.0", "000:41:00.0", "pci_0000_41_00_0"]
)
def test_canonical_bdf_rejects_what_no_tool_prints(text: str) -> None:
    """Device numbers stop at 1f; bus and device are two digits, a domain four to eight."""
    with pytest.raises(ValueError, match="not a PCI address"):
        canonical_bdf(text)


def test_parse_bdf_reads_libvirt_node_device_names_on_request() -> None:
    assert parse_bdf("pci_0000_41_00_1") is None
    assert parse_bdf("PCI_0000_C1_00_1", libvirt=True) == Bdf(0, 0xC1, 0, 1)
    assert str(parse_bdf("00000000:C1:00.1")) == "0000:c1:00.1"
    assert parse_bdf("0000:41:20.0") == Bdf(0, 0x41, 0x20, 0)  # shape only: callers range-check
    assert Bdf(1, 0x9B, 0x1F, 7).slot_address == "0001:9b:1f"


@pytest.mark.parametrize(
    ("text", "slot"),
    [("0000:41:00", "0000:41:00"), ("00000000:C1:00", "0000:c1:00"), ("41:00", None)],
)
def test_canonical_slot(text: str, slot: str | None) -> None:
    assert canonical_slot(text) == slot


def test_libvirt_address_attributes() -> None:
    assert libvirt_address("41:00.1") == {
        "domain": "0x0000",
        "bus": "0x41",
        "slot": "0x00",
        "function": "0x1",
    }
    with pytest.raises(ValueError, match="not a PCI address"):
        libvirt_address("0000:41:20.0")
