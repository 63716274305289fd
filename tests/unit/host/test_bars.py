"""BARs from the sysfs resource attribute (vmsandbox.host.bars)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from vmsandbox.host.bars import parse_resource, prefetchable_64bit_total
from vmsandbox.host.model import Bar

MIB, GIB = 1 << 20, 1 << 30
ZERO = "0x0000000000000000 0x0000000000000000 0x0000000000000000"
# An H100 SXM5 as the kernel prints it: BAR0 32-bit, BAR1 and BAR3 64-bit prefetchable (each
# taking the next slot), the ROM on line 6, then the SR-IOV lines.
H100_RESOURCE = "\n".join(
    [
        "0x00000000a2000000 0x00000000a2ffffff 0x0000000000040200",
        "0x0000220000000000 0x0000221fffffffff 0x000000000014220c",
        ZERO,
        "0x0000222000000000 0x0000222001ffffff 0x000000000014220c",
        ZERO,
        ZERO,
        "0x00000000a3000000 0x00000000a307ffff 0x0000000000046200",
        *[ZERO] * 6,
    ]
)


def test_h100_bars() -> None:
    bars = parse_resource(H100_RESOURCE)
    assert bars == (
        Bar(index=0, size=16 * MIB, is_64bit=False, prefetchable=False),
        Bar(index=1, size=128 * GIB, is_64bit=True, prefetchable=True),
        Bar(index=3, size=32 * MIB, is_64bit=True, prefetchable=True),
    )
    assert prefetchable_64bit_total(bars) == 128 * GIB + 32 * MIB


def test_io_bars_rom_and_empty_input_are_left_out() -> None:
    io_and_rom = "\n".join(
        [
            "0x000000000000e000 0x000000000000e07f 0x0000000000040101",  # I/O port BAR
            "0x00000000c0000000 0x00000000c003ffff 0x0000000000042208",  # 32-bit prefetchable
            *[ZERO] * 4,
            "0x00000000c1000000 0x00000000c107ffff 0x0000000000046200",  # ROM
        ]
    )
    bars = parse_resource(io_and_rom)
    assert bars == (Bar(index=1, size=256 * 1024, is_64bit=False, prefetchable=True),)
    assert prefetchable_64bit_total(bars) == 0
    assert parse_resource(None) == ()
    assert parse_resource("") == ()


BAR_FLAGS = st.sampled_from([0x40200, 0x140204, 0x14220C, 0x42208, 0x40101])


@given(st.lists(st.tuples(st.integers(12, 40), BAR_FLAGS), min_size=6, max_size=6))
def test_parse_matches_what_was_written(bars: list[tuple[int, int]]) -> None:
    lines, start = [], 1 << 44
    for size_log2, flags in bars:
        size = 1 << size_log2
        lines.append(f"0x{start:016x} 0x{start + size - 1:016x} 0x{flags:016x}")
        start += size
    lines.append("0x00000000c0000000 0x00000000c007ffff 0x0000000000046200")
    parsed = parse_resource("\n".join(lines))
    memory = [(i, 1 << log2, flags) for i, (log2, flags) in enumerate(bars) if flags & 0x200]
    assert [(bar.index, bar.size) for bar in parsed] == [(i, size) for i, size, _ in memory]
    assert [bar.is_64bit for bar in parsed] == [bool(f & 0x100000) for _, _, f in memory]
    assert [bar.prefetchable for bar in parsed] == [bool(f & 0x2000) for _, _, f in memory]
