"""Memory BARs of a PCI function, parsed from its sysfs ``resource`` attribute.

Each line of ``resource`` is ``start end flags`` in hex. The first six lines are BAR0..BAR5,
line 6 is the expansion ROM, later lines are SR-IOV BARs or bridge windows; only BARs count.
A 64-bit BAR takes two slots, so the line after it reads all zeros.
"""

from __future__ import annotations

from .model import Bar

IORESOURCE_MEM = 0x200
IORESOURCE_PREFETCH = 0x2000
IORESOURCE_MEM_64 = 0x00100000
BAR_COUNT = 6


def parse_resource(text: str | None) -> tuple[Bar, ...]:
    """Memory BARs (I/O port and empty BARs left out) of one ``resource`` attribute."""
    if not text:
        return ()
    bars: list[Bar] = []
    for index, line in enumerate(text.splitlines()[:BAR_COUNT]):
        fields = line.split()
        if len(fields) != 3:
            continue
        start, end, flags = (int(field, 16) for field in fields)
        if not flags & IORESOURCE_MEM or end == 0:
            continue
        bars.append(
            Bar(
                index=index,
                size=end - start + 1,
                is_64bit=bool(flags & IORESOURCE_MEM_64),
                prefetchable=bool(flags & IORESOURCE_PREFETCH),
            )
        )
    return tuple(bars)


def prefetchable_64bit_total(bars: tuple[Bar, ...]) -> int:
    """Bytes the guest's 64-bit MMIO window must hold: the 64-bit prefetchable BARs."""
    return sum(bar.size for bar in bars if bar.is_64bit and bar.prefetchable)
