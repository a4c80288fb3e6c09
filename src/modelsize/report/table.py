"""Aligned plain-text tables, shared by every text renderer."""

from __future__ import annotations


def table(rows: list[list[str]], align: str) -> list[str]:
    """Rows of cells as indented lines; ``align`` has one ``l`` or ``r`` per column."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for row in rows:
        cells = [
            c.rjust(w) if a == "r" else c.ljust(w)
            for c, w, a in zip(row, widths, align, strict=True)
        ]
        out.append("  " + "  ".join(cells).rstrip())
    return out
