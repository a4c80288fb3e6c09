"""Plain-text rendering of an inspect :class:`~modelsize.inspection.Report`."""

from __future__ import annotations

import textwrap

from modelsize.categories import Category
from modelsize.errors import printable
from modelsize.inspection import Report
from modelsize.quantization import count
from modelsize.report.table import table
from modelsize.report.units import human_bytes, percent


def render_inspect(report: Report, top: int = 10, width: int = 100) -> str:
    """The human report: explanation, table by category, largest tensors, findings."""
    inv = report.inventory
    total = inv.file_bytes
    lines = [f"{printable(str(inv.path))}  ({inv.format}, {total:,} bytes)"]
    quant = report.quantization
    if quant.parameters:
        lines.append(printable(quant.headline(), 300))
    lines.append("")
    lines += textwrap.wrap(printable(report.summary, 4000), width, break_on_hyphens=False)
    lines.append("")
    rows = [["category", "bytes", "size", "share"]]
    for cat in Category:
        n = inv.bytes_by_category[cat]
        rows.append([cat.value, f"{n:,}", human_bytes(n), percent(n, total) if n else "-"])
    rows.append(["total", f"{total:,}", human_bytes(total), "100%"])
    lines += table(rows, "lrrr")
    if inv.tensors and top:
        lines += ["", f"Largest tensors ({min(top, len(inv.tensors))} of {len(inv.tensors)})"]
        trows = [["name", "dtype", "shape", "stored", "category"]]
        for t in report.largest(top):
            shape = "x".join(str(d) for d in t.shape) or "scalar"
            trows.append([printable(t.name, 60), t.dtype, shape, human_bytes(t.stored_nbytes),
                          t.category.value])
        lines += table(trows, "lllrl")
    if len(quant.groups) > 1 or quant.quantized:
        lines += ["", "Weights by storage"]
        grows = [["stored as", "weights", "parameters", "bits/weight", "bytes"]]
        for g in quant.groups[:12]:
            grows.append([printable(g.label, 60), f"{g.weights:,}", count(g.parameters),
                          f"{g.bits_per_weight:.3f}", human_bytes(g.counted_bytes)])
        if len(quant.groups) > 12:
            grows.append([f"({len(quant.groups) - 12} more)", "", "", "", ""])
        lines += table(grows, "lrrrr")
    if report.findings:
        lines += ["", "Findings"]
        for f in report.findings:
            saves = f"saves {human_bytes(f.bytes)}" if f.bytes else "security"
            lines += textwrap.wrap(f"[{f.kind.value}] {saves}: {printable(f.message, 2000)}", width,
                                   initial_indent="  ", subsequent_indent="      ")
            lines += textwrap.wrap(f"fix: {f.action}", width, initial_indent="      ",
                                   subsequent_indent="        ", break_on_hyphens=False)
    for note in inv.notes[:10]:
        lines += textwrap.wrap(f"note: {printable(note, 500)}", width, initial_indent="  ",
                               subsequent_indent="      ")
    return "\n".join(lines) + "\n"
