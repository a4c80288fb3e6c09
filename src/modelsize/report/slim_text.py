"""Plain-text rendering of a :class:`~modelsize.slimming.SlimReport`."""

from __future__ import annotations

import heapq
import textwrap
from typing import Any

from modelsize.categories import Category
from modelsize.errors import printable
from modelsize.report.table import table
from modelsize.report.units import human_bytes, percent
from modelsize.slimming.result import SlimReport


def render_slim(report: SlimReport, width: int = 100, names: int = 8) -> str:
    """Headline, before/after by category, what was dropped and cast, verification, notes."""
    src = report.source
    out_bytes = report.output_bytes
    verb = "would write" if report.dry_run else "wrote"
    lines = [f"{printable(str(src.path))} ({src.format}, {src.file_bytes:,} bytes) -> "
             f"{printable(str(report.target))} ({report.output_format}"
             + (f", {out_bytes:,} bytes)" if out_bytes is not None else ")")]
    if report.copied:
        lines.append(f"Nothing to slim: {'would copy' if report.dry_run else 'copied'} the "
                     f"input byte for byte ({human_bytes(src.file_bytes)}).")
    elif out_bytes is not None and src.file_bytes and out_bytes > src.file_bytes:
        grew = out_bytes - src.file_bytes
        lines.append(f"{'Would be' if report.dry_run else 'Larger by'} "
                     f"{human_bytes(grew)}{' larger' if report.dry_run else ''} "
                     f"(+{percent(grew, src.file_bytes)}): {verb} {human_bytes(out_bytes)} of "
                     f"{human_bytes(src.file_bytes)} (the notes say why).")
    elif out_bytes is not None and src.file_bytes:
        saved = src.file_bytes - out_bytes
        lines.append(f"{'Would save' if report.dry_run else 'Saved'} {human_bytes(saved)} "
                     f"({percent(saved, src.file_bytes)}): {verb} {human_bytes(out_bytes)} "
                     f"of {human_bytes(src.file_bytes)}.")
    elif report.dry_run:
        lines.append("The output's size is known only once written (compressed output).")
    lines.append("")
    after = report.output.bytes_by_category if report.output is not None else None
    rows = [["category", "before", "after" if after is not None else "", "dropped"]]
    by_cat = report.dropped_by_category()
    for cat in Category:
        before = src.bytes_by_category[cat]
        a = after[cat] if after is not None else None
        d = by_cat.get(cat)
        if not before and not a and not d:
            continue
        rows.append([cat.value, human_bytes(before), "" if a is None else human_bytes(a),
                     f"{d[0]} tensors" if d else ""])
    total_after = "" if after is None else human_bytes(report.output.file_bytes)  # type: ignore[union-attr]
    rows.append(["total", human_bytes(src.file_bytes), total_after, ""])
    lines += table(rows, "lrrr")
    n_stored, stored_bytes = report.stored()
    n_kept = len(report.kept)
    lines += ["", f"Kept {n_stored} tensor{'' if n_stored == 1 else 's'} "
              f"({human_bytes(stored_bytes)})"
              + (f" and {n_kept - n_stored} aliases" if n_stored < n_kept else "")
              + f"; dropped {len(report.dropped)}."]
    # The largest dropped, without sorting them all (nlargest keeps sorted()'s order of ties).
    for gone in heapq.nlargest(names, report.dropped, key=lambda g: g.stored_nbytes):
        lines.append(f"  - {printable(gone.name, 70)}  ({gone.reason}, "
                     f"{human_bytes(gone.stored_nbytes)})")
    if len(report.dropped) > names:
        lines.append(f"  - ... {len(report.dropped) - names} more (--json lists them all)")
    for name, original in report.aliases():
        lines.append(f"  = {printable(name, 60)} is stored once, as "
                     f"{printable(original, 60)}")
    cast = report.cast
    if cast:
        worst = report.worst_cast()
        lines.append(
            f"Cast {len(cast)} tensors {cast[0].source_dtype} -> {cast[0].dtype}; "
            + ("largest error" if not report.dry_run else "errors known once written")
            + (f": {worst.max_abs_error:.3g} absolute, {worst.max_rel_error:.3g} relative "
               f"({printable(worst.name, 60)})" if worst is not None
               and worst.max_rel_error is not None else "")
        )
    lines += _graph_lines(report)
    if report.dry_run:
        lines.append("Dry run: nothing was written.")
    elif getattr(report, "comparison", None) is not None:
        pass
    elif report.verified and report.copied:
        lines.append(f"Verified: {printable(str(report.target))} is the input byte for byte "
                     f"(CRC-32 of every file) and reads back with the same "
                     f"{len(report.kept)} tensors.")
    elif report.verified:
        lines.append(f"Verified: {printable(str(report.target))} read back by modelsize holds "
                     f"every kept tensor with the same name, dtype, shape and bytes (CRC-32).")
    for note in report.notes:
        lines += textwrap.wrap(f"note: {printable(note, 600)}", width, initial_indent="  ",
                               subsequent_indent="      ")
    return "\n".join(lines) + "\n"


def _graph_lines(report: SlimReport) -> list[str]:
    """The graph passes (applied, skipped, what each saved) and the outputs compared."""
    results: tuple[Any, ...] = getattr(report, "passes", ())
    if not results:
        return []
    lines = ["", "Graph passes" + (" that would apply:" if report.dry_run else ":")]
    rows = [["pass", "changes", "saves", ""]]
    for r in results:
        rows.append([r.name.value, str(r.changes) if r.changes else "",
                     human_bytes(r.saved_bytes) if r.applied else "",
                     "applied" if r.applied and not report.dry_run else
                     ("would apply" if r.applied else r.note)])
    lines += table(rows, "lrrl")
    cmp = getattr(report, "comparison", None)
    if cmp is not None:
        runner = getattr(cmp, "runner", "onnxruntime")
        how = getattr(cmp, "inputs", "")
        lines.append(f"Verified: {runner} ran {printable(str(report.source.path))} and the "
                     f"output on the same seeded inputs{f' ({how})' if how else ''}; largest "
                     f"relative difference {cmp.max_rel:.3g} (tolerance {cmp.tolerance:g}, "
                     f"{cmp.kind}):")
        for o in cmp.outputs[:8]:
            lines.append(f"  {printable(o.name, 60)}: max abs {o.max_abs:.3g}, "
                         f"max rel {o.max_rel:.3g}")
        if len(cmp.outputs) > 8:
            lines.append(f"  ... {len(cmp.outputs) - 8} more outputs (--json lists them all)")
    return lines
