"""Plain-text rendering of a :class:`~modelsize.loadcost.LoadCost`."""

from __future__ import annotations

import textwrap

from modelsize.errors import printable
from modelsize.loadcost import LoadCost, WayStatus
from modelsize.report.units import human_bytes

#: Said beside every way that unpickles without restrictions, wherever it appears.
UNSAFE = "UNSAFE: runs any code the file's pickle names; never on a file you did not make"


def _seconds(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"


def render_load_cost(c: LoadCost, width: int = 100) -> str:
    """One row per way (RAM and time beyond the framework's import), then the cheapest.

    An unsafe way (an unrestricted unpickler) says so on its row and is never the cheapest
    or the fastest: the summary reads as advice."""
    lines = ["What loading costs (each way in a fresh process; RAM and time beyond the "
             "framework's own import)"]
    for imp in c.imports:
        lines.append(f"  import {imp.framework}: {human_bytes(imp.peak_rss_bytes)} peak RSS, "
                     f"{_seconds(imp.seconds)}")
    rows = [["way", "peak RAM", "time", ""]]
    for w in c.ways:
        note = "; ".join(x for x in (UNSAFE if w.unsafe else "", printable(w.note, 300)) if x)
        if w.status is WayStatus.MEASURED:
            rows.append([w.way, human_bytes(w.peak_rss_bytes or 0), _seconds(w.seconds), note])
        else:
            rows.append([w.way, "-", "-", f"{w.status.value}: {note}"])
    if len(rows) > 1:
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        for row in rows:
            cells = [row[0].ljust(widths[0]), row[1].rjust(widths[1]), row[2].rjust(widths[2])]
            text = "  " + "  ".join(cells)
            lines.append((text + "  " + row[3]).rstrip() if row[3] else text.rstrip())
    cheapest = c.cheapest
    if cheapest is not None:
        summary = (f"Cheapest: {cheapest.way} ({human_bytes(cheapest.peak_rss_bytes or 0)} "
                   "beyond the import)")
        fastest = c.fastest
        if fastest is not None and fastest is not cheapest:
            summary += f"; fastest: {fastest.way} ({_seconds(fastest.seconds)})"
        lines += textwrap.wrap(summary, width, initial_indent="  ", subsequent_indent="    ")
    elif c.measured:
        lines.append("  No safe way could be measured here: the ways above unpickle without "
                     "restrictions.")
    elif c.ways:
        lines.append("  No way could be measured here.")
    for note in c.notes:
        lines += textwrap.wrap(f"note: {printable(note, 500)}", width, initial_indent="  ",
                               subsequent_indent="      ")
    return "\n".join(lines) + "\n"
