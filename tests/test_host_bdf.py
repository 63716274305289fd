"""Canonical PCI addresses (vmsandbox.host.bdf)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vmsandbox.host.bdf import canonical_bdf, format_bdf, slot_of


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
