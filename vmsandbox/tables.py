"""The one fixed-width text table of the CLI, verification, the GPU inventory and the benchmarks."""

from __future__ import annotations

from collections.abc import Sequence


def render_grid(header: Sequence[object], rows: Sequence[Sequence[object]]) -> list[str]:
    """The header and rows as lines: left-aligned columns, each as wide as its widest cell, two
    spaces apart, no trailing blanks. Cells are shown with ``str``."""
    table = [[str(cell) for cell in row] for row in (header, *rows)]
    widths = [max(len(row[col]) for row in table) for col in range(len(table[0]))]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in table
    ]
