"""Self-contained HTML reports: inline SVG charts, inline CSS and script, nothing fetched.

One file per report, viewable offline (no CDN, no font, no image requests): the charts are SVG
drawn here (stacked category bars, a squarified treemap, a memory timeline) and a few lines of
inline script give tooltips, category highlighting and sortable tables. No plotting
dependency: a Plotly or Bokeh page inlines 3-4 MB of script to draw what a few kB of SVG show.

Each ``render_*`` returns a whole page; each ``card_*`` a compact fragment for notebooks
(``_repr_html_``). Every number shown is one the text report shows too.
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from modelsize.categories import Category
from modelsize.report.units import human_bytes, percent

if TYPE_CHECKING:
    from modelsize.diff import Diff
    from modelsize.estimation.result import Estimate
    from modelsize.inspection import Report
    from modelsize.slimming.result import SlimReport

#: One colour per category (colour-blind-safe order of the Okabe-Ito palette, then greys).
COLORS: dict[str, str] = {
    "weights": "#0072B2", "buffers": "#56B4E9", "optimizer_state": "#E69F00",
    "gradients": "#D55E00", "activations": "#CC79A7", "unused_storage": "#F0E442",
    "duplicates": "#009E73", "graph": "#999999", "metadata": "#BBBBBB", "other": "#666666",
    # estimate categories
    "parameters": "#0072B2", "temporaries": "#882255", "inputs": "#009E73",
    "kv_cache": "#117733",
}

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;
max-width:1100px;color:#222;padding:0 16px}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:28px 0 8px;border-bottom:1px solid #ddd}
.sub{color:#555;margin:0 0 12px}.num{text-align:right;font-variant-numeric:tabular-nums}
table{border-collapse:collapse;width:100%;font-size:13px}th,td{padding:3px 8px;
border-bottom:1px solid #eee;text-align:left}th{cursor:pointer;background:#fafafa;
user-select:none}code{background:#f4f4f4;padding:1px 4px;border-radius:3px;font-size:12px}
.legend span{display:inline-block;margin:2px 12px 2px 0;cursor:pointer}
.legend i{display:inline-block;width:11px;height:11px;margin-right:5px;vertical-align:-1px}
.finding{border-left:4px solid #E69F00;padding:4px 10px;margin:8px 0;background:#fffaf0}
svg text{font:11px system-ui,sans-serif}.dim{opacity:.15}
.sel{font-weight:bold}
"""

_SCRIPT = """
(function(){document.querySelectorAll('.legend span').forEach(function(s){
s.addEventListener('click',function(){var c=s.getAttribute('data-cat'),on=s.classList.toggle('sel');
document.querySelectorAll('[data-cat]').forEach(function(el){if(el.closest('.legend'))return;
el.classList.toggle('dim',on&&el.getAttribute('data-cat')!==c)})})});
document.querySelectorAll('th').forEach(function(th,i){th.addEventListener('click',function(){
var tb=th.closest('table').tBodies[0],rows=[].slice.call(tb.rows),k=th.cellIndex,
d=th.dataset.d=th.dataset.d==='1'?'-1':'1';rows.sort(function(a,b){
var x=a.cells[k].dataset.v||a.cells[k].textContent,y=b.cells[k].dataset.v||b.cells[k].textContent;
var nx=parseFloat(x),ny=parseFloat(y);if(!isNaN(nx)&&!isNaN(ny))return d*(nx-ny);
return d*x.localeCompare(y)});rows.forEach(function(r){tb.appendChild(r)})})})})();
"""


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def page(title: str, body: str) -> str:
    """A whole HTML document: ``body`` plus the inline style and script."""
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta name=\"viewport\" content=\"width=device-width,initial-scale=1\">"
            f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>\n{body}\n"
            f"<script>{_SCRIPT}</script></body></html>\n")


def _color(cat: str) -> str:
    return COLORS.get(cat, "#888888")


def legend(cats: Iterable[str]) -> str:
    """Clickable category legend (click: highlight that category everywhere)."""
    items = "".join(f"<span data-cat=\"{_e(c)}\"><i style=\"background:{_color(c)}\"></i>"
                    f"{_e(c)}</span>" for c in cats)
    return f"<div class=\"legend\">{items}</div>"


def stacked_bar(parts: Sequence[tuple[str, int]], total: int | None = None, width: int = 1000,
                height: int = 28, label: str = "") -> str:
    """One horizontal bar split by category (``parts``: (category, bytes))."""
    parts = [(c, n) for c, n in parts if n > 0]
    whole = total if total is not None else sum(n for _, n in parts)
    x = 0.0
    rects = []
    for cat, n in parts:
        w = width * n / whole if whole else 0
        rects.append(f"<rect x=\"{x:.2f}\" y=\"0\" width=\"{max(w, 0.5):.2f}\" "
                     f"height=\"{height}\" fill=\"{_color(cat)}\" data-cat=\"{_e(cat)}\">"
                     f"<title>{_e(cat)}: {n:,} bytes ({human_bytes(n)}, {percent(n, whole)})"
                     f"</title></rect>")
        x += w
    cap = f"<text x=\"0\" y=\"{height + 14}\">{_e(label)}</text>" if label else ""
    return (f"<svg viewBox=\"0 0 {width} {height + (18 if label else 2)}\" width=\"100%\" "
            f"role=\"img\">{''.join(rects)}{cap}</svg>")


def _worst(row: list[float], short: float) -> float:
    """The worst aspect ratio of a treemap row laid along a side of length ``short``."""
    s = sum(row)
    return max(max(short * short * a / (s * s), (s * s) / (short * short * a))
               if a > 0 else math.inf for a in row)


def squarify(values: Sequence[float], x: float, y: float, w: float,
             h: float) -> list[tuple[float, float, float, float]]:
    """Squarified treemap layout (Bruls, Huizing, van Wijk): one rectangle per value, in order
    of ``values`` (which must be sorted largest first), filling ``(x, y, w, h)`` exactly."""
    total = sum(values)
    if total <= 0 or not values:
        return [(x, y, 0.0, 0.0) for _ in values]
    scale = w * h / total
    areas = [v * scale for v in values]
    out: list[tuple[float, float, float, float]] = []
    i = 0
    while i < len(areas):
        short = min(w, h)
        row = [areas[i]]
        j = i + 1

        while j < len(areas) and _worst([*row, areas[j]], short) <= _worst(row, short):
            row.append(areas[j])
            j += 1
        s = sum(row)
        if w >= h:  # a column on the left
            cw = s / h if h else 0
            cy = y
            for a in row:
                ah = a / cw if cw else 0
                out.append((x, cy, cw, ah))
                cy += ah
            x += cw
            w -= cw
        else:  # a row on top
            rh = s / w if w else 0
            cx = x
            for a in row:
                aw = a / rh if rh else 0
                out.append((cx, y, aw, rh))
                cx += aw
            y += rh
            h -= rh
        i = j
    return out


def treemap(items: Sequence[tuple[str, int, str, str]], width: int = 1000,
            height: int = 520) -> str:
    """Items ``(label, bytes, category, tooltip)``, largest first, as an SVG treemap."""
    items = [it for it in items if it[1] > 0]
    rects = squarify([float(it[1]) for it in items], 0, 0, width, height)
    out = []
    for (label, _n, cat, tip), (x, y, w, h) in zip(items, rects, strict=True):
        out.append(f"<g data-cat=\"{_e(cat)}\"><title>{_e(tip)}</title><rect x=\"{x:.1f}\" "
                   f"y=\"{y:.1f}\" width=\"{w:.1f}\" height=\"{h:.1f}\" fill=\"{_color(cat)}\" "
                   f"stroke=\"#fff\" stroke-width=\"1\"/>")
        if w > 60 and h > 16:
            fit = max(int(w / 6.2), 4)
            text = label if len(label) <= fit else "…" + label[-(fit - 1):]
            out.append(f"<text x=\"{x + 4:.1f}\" y=\"{y + 13:.1f}\" fill=\"#fff\">"
                       f"{_e(text)}</text>")
        out.append("</g>")
    return (f"<svg viewBox=\"0 0 {width} {height}\" width=\"100%\" role=\"img\">"
            f"{''.join(out)}</svg>")


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]],
          numeric: Sequence[bool] = ()) -> str:
    """A sortable table; a cell given as ``(text, sort_value)`` sorts by the value."""
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = []
    for row in rows:
        cells = []
        for i, cell in enumerate(row):
            cls = " class=\"num\"" if i < len(numeric) and numeric[i] else ""
            if isinstance(cell, tuple):
                text, value = cell
                cells.append(f"<td{cls} data-v=\"{_e(value)}\">{_e(text)}</td>")
            else:
                cells.append(f"<td{cls}>{_e(cell)}</td>")
        body.append(f"<tr>{''.join(cells)}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _bytes_cell(n: int) -> tuple[str, int]:
    return (f"{n:,} ({human_bytes(n)})", n)


# -- inspect -----------------------------------------------------------------------------------

def _groups(report: Report, limit: int = 150) -> list[tuple[str, int, str, str]]:
    """Treemap items: tensors grouped by module (name without its last part), plus the bytes
    of each category that no tensor holds (headers, unused storage...)."""
    inv = report.inventory
    groups: dict[tuple[str, str], int] = {}
    held: dict[str, int] = {}
    for t in inv.tensors:
        cat = t.category.value
        module = t.name.rsplit(".", 1)[0] if "." in t.name else t.name
        groups[module, cat] = groups.get((module, cat), 0) + t.stored_nbytes
        held[cat] = held.get(cat, 0) + t.stored_nbytes
    items = sorted(groups.items(), key=lambda kv: -kv[1])
    out = [(m, n, c, f"{m} ({c})\n{n:,} bytes, {human_bytes(n)}, {percent(n, inv.file_bytes)}")
           for (m, c), n in items[:limit]]
    rest: dict[str, int] = {}
    for (_m, c), n in items[limit:]:
        rest[c] = rest.get(c, 0) + n
    for c, n in rest.items():
        out.append((f"({c}: smaller modules)", n, c,
                    f"{len(items) - limit} smaller groups ({c})\n{n:,} bytes"))
    for cat, total in inv.bytes_by_category.items():
        free = total - held.get(cat.value, 0)
        if free > 0:
            out.append((f"({cat.value})", free, cat.value,
                        f"{cat.value} held by no tensor\n{free:,} bytes, {human_bytes(free)}"))
    out.sort(key=lambda it: -it[1])
    return out


def _category_parts(by_cat: dict[Category, int]) -> list[tuple[str, int]]:
    return [(c.value, n) for c, n in by_cat.items() if n]


def _findings(report: Report) -> str:
    if not report.findings:
        return "<p>No findings: nothing to remove.</p>"
    return "".join(f"<div class=\"finding\"><b>{_e(f.kind.value)}</b> "
                   f"({_e(human_bytes(f.bytes))}): {_e(f.message)}<br>"
                   f"<code>{_e(f.action)}</code></div>" for f in report.findings)


def render_inspect(report: Report, top: int = 25) -> str:
    """The page for ``modelsize inspect --html``."""
    inv = report.inventory
    quant = report.quantization
    parts = _category_parts(inv.bytes_by_category)
    cats = [c for c, _ in parts]
    rows = [(t.name, t.category.value, t.dtype, "x".join(map(str, t.shape)) or "scalar",
             _bytes_cell(t.stored_nbytes)) for t in report.largest(top)]
    body = (
        f"<h1>{_e(inv.path)}</h1><p class=\"sub\">{_e(inv.format)}, "
        f"{inv.file_bytes:,} bytes ({human_bytes(inv.file_bytes)}), {len(inv.tensors):,} "
        f"tensors</p><p><b>{_e(quant.headline())}</b></p><p>{_e(report.summary)}</p>"
        f"<h2>Bytes by category</h2>{stacked_bar(parts, inv.file_bytes)}{legend(cats)}"
        + table(("category", "bytes", "share"),
                [(c, _bytes_cell(n), percent(n, inv.file_bytes)) for c, n in parts],
                (False, True, True))
        + "<h2>Weights by storage</h2>"
        + table(("stored as", "weights", "parameters", "bits per weight", "bytes"),
                [(g.label, f"{g.weights:,}", f"{g.parameters:,}", f"{g.bits_per_weight:.3f}",
                  _bytes_cell(g.counted_bytes)) for g in quant.groups],
                (False, True, True, True, True))
        + f"<h2>Findings</h2>{_findings(report)}"
        f"<h2>Where the bytes are (by module)</h2>{treemap(_groups(report))}"
        f"<h2>Largest tensors</h2>"
        + table(("tensor", "category", "dtype", "shape", "bytes"), rows,
                (False, False, False, False, True))
    )
    return page(f"modelsize inspect {inv.path.name}", body)


#: The cards' style, scoped to ``.msz`` so that it never restyles the notebook around it.
_CARD_CSS = (".msz{font:13px system-ui,sans-serif;border:1px solid #ddd;border-radius:6px;"
             "padding:10px 14px;max-width:760px}.msz b{font-size:14px}"
             ".msz .legend span{display:inline-block;margin:2px 10px 2px 0}"
             ".msz .legend i{display:inline-block;width:10px;height:10px;margin-right:4px}"
             ".msz table{border-collapse:collapse;font-size:12px}.msz td,.msz th{padding:2px 6px;"
             "border-bottom:1px solid #eee;text-align:left}.msz .num{text-align:right}"
             ".msz code{font-size:11px}")


def _card(inner: str) -> str:
    return f"<div class=\"msz\"><style>{_CARD_CSS}</style>{inner}</div>"


def card_inspect(report: Report) -> str:
    """A compact notebook card: headline, the category bar, the findings."""
    inv = report.inventory
    parts = _category_parts(inv.bytes_by_category)
    finds = "".join(f"<li>{_e(f.kind.value)} {_e(human_bytes(f.bytes))}: "
                    f"<code>{_e(f.action)}</code></li>" for f in report.findings)
    return _card(f"<b>{_e(inv.path.name)}</b> "
            f"{_e(inv.format)}, {_e(human_bytes(inv.file_bytes))}, {len(inv.tensors):,} "
            f"tensors<div>{_e(report.quantization.headline())}</div>"
            f"{stacked_bar(parts, inv.file_bytes, height=18)}"
            f"{legend(c for c, _ in parts)}<div>{_e(report.summary)}</div>"
            + (f"<ul>{finds}</ul>" if finds else ""))


# -- estimate ----------------------------------------------------------------------------------

def timeline_chart(est: Estimate, width: int = 1000, height: int = 300) -> str:
    """Live bytes per op of the traced program, phases shaded, the peak marked."""
    points = est.timeline
    if not points:
        return "<p>No timeline.</p>"
    last = max(est.op_count, points[-1][0], 1)
    top = max(max(n for _, n in points), est.peak_bytes, 1)
    pad_l, pad_b = 70, 22
    w, h = width - pad_l, height - pad_b

    def px(op: int) -> float:
        return pad_l + w * op / last

    def py(n: int) -> float:
        return h - h * n / top * 0.92

    shades = []
    for i, ph in enumerate(est.phases):
        x0, x1 = px(ph.start), px(max(ph.end, ph.start + 1))
        fill = "#f2f2f2" if i % 2 else "#e8eef6"
        shades.append(f"<rect x=\"{x0:.1f}\" y=\"0\" width=\"{max(x1 - x0, 0.5):.1f}\" "
                      f"height=\"{h}\" fill=\"{fill}\"><title>{_e(ph.name)} (step "
                      f"{ph.step}), ops {ph.start}..{ph.end}</title></rect>")
        if x1 - x0 > 50:
            shades.append(f"<text x=\"{x0 + 3:.1f}\" y=\"12\" fill=\"#555\">{_e(ph.name)}"
                          f"</text>")
    pts = " ".join(f"{px(op):.1f},{py(n):.1f}" for op, n in points)
    tick = est.phase.start
    peak_op = next((op for op, n in points if n == est.peak_bytes), tick)
    axis = []
    for k in range(5):
        n = top * k // 4
        axis.append(f"<text x=\"{pad_l - 4}\" y=\"{py(n) + 4:.1f}\" text-anchor=\"end\">"
                    f"{_e(human_bytes(n))}</text><line x1=\"{pad_l}\" x2=\"{width}\" "
                    f"y1=\"{py(n):.1f}\" y2=\"{py(n):.1f}\" stroke=\"#ddd\"/>")
    marker = (f"<circle cx=\"{px(peak_op):.1f}\" cy=\"{py(est.peak_bytes):.1f}\" r=\"5\" "
              f"fill=\"#D55E00\"><title>peak {est.peak_bytes:,} bytes in "
              f"{_e(est.phase.name)} of step {est.phase.step}</title></circle>"
              f"<text x=\"{px(peak_op) + 8:.1f}\" "
              f"y=\"{py(est.peak_bytes) + 4:.1f}\" fill=\"#D55E00\">peak "
              f"{_e(human_bytes(est.peak_bytes))} ({_e(est.phase.name)})</text>")
    return (f"<svg viewBox=\"0 0 {width} {height}\" width=\"100%\" role=\"img\">"
            f"{''.join(shades)}{''.join(axis)}<polyline points=\"{pts}\" fill=\"none\" "
            f"stroke=\"#0072B2\" stroke-width=\"1.5\"/>{marker}<text x=\"{pad_l}\" "
            f"y=\"{height - 6}\">op 0</text><text x=\"{width}\" y=\"{height - 6}\" "
            f"text-anchor=\"end\">op {last:,}</text></svg>")


def _estimate_parts(est: Estimate) -> list[tuple[str, int]]:
    return [(getattr(c, "value", str(c)), n) for c, n in est.categories.items() if n]


def _program_word(mode: str) -> str:
    return {"train": "training step", "generate": "generation"}.get(mode, "inference")


def _parallel_section(est: Estimate) -> str:
    """With ``--gpus``: the ranks traced (worst first) and the formulas beside, on one scale."""
    par = getattr(est, "parallel", None)
    if par is None:
        return ""
    bars = [(f"rank {r.rank}" + (" (worst)" if r.rank == par.worst_rank else ""), r.peak_bytes,
             f"{r.phase}, step {r.step}") for r in sorted(par.ranks, key=lambda r: -r.peak_bytes)]
    bars += [(c.name, c.nbytes, f"counts {c.counts}") for c in par.comparisons]
    top = max([n for _, n, _ in bars] + [1])
    rows = []
    for i, (label, n, tip) in enumerate(bars):
        w = 700 * n / top
        fill = "#0072B2" if label.startswith("rank") else "#999999"
        rows.append(f"<text x=\"0\" y=\"{i * 24 + 15}\">{_e(label)}</text><rect x=\"230\" "
                    f"y=\"{i * 24 + 3}\" width=\"{max(w, 0.5):.1f}\" height=\"16\" "
                    f"fill=\"{fill}\"><title>{_e(label)}: {n:,} bytes ({_e(tip)})</title>"
                    f"</rect><text x=\"{236 + w:.1f}\" y=\"{i * 24 + 15}\">"
                    f"{_e(human_bytes(n))}</text>")
    method = ("traced on the real engine (fake process group)" if par.method == "traced"
              else "accounted from the single-GPU trace: " + ", ".join(par.accounted))
    mesh = getattr(par, "mesh", ())
    if len(mesh) > 1:
        method += "; mesh " + " x ".join(f"{name} {size}" for name, size in mesh)
    if getattr(par, "mixed_precision", ""):
        method += ("; mixed precision by FSDP2's MixedPrecisionPolicy"
                   if par.mixed_precision == "policy" else "; mixed precision by torch.autocast")
    if getattr(par, "cpu_offload", False):
        method += "; CPU offload (accounted): the bars are GPU memory"
        if par.host_peak_bytes is not None:
            method += f", the host holds up to {human_bytes(par.host_peak_bytes)}"
    return (f"<h2>Per rank: {par.world} GPUs, {_e(par.strategy)}</h2><p>{_e(method)}</p>"
            f"<svg viewBox=\"0 0 1000 {len(bars) * 24 + 6}\" width=\"100%\" role=\"img\">"
            f"{''.join(rows)}</svg>")


#: Column headers of the report's sections that have none in the text report.
_SECTION_HEADERS = {
    "modules": ("module", "activations"),
    "suggestions": ("change", "what it does", "peak", "vs now"),
    "cuda": ("term", "size", "note"),
}


def _section(section: Any) -> str:
    """One section of the estimate's report (:class:`modelsize.report.estimate_text.Section`)
    as HTML: its title, its table, its sentences; the cells are the text report's."""
    out = f"<h2>{_e(section.title.rstrip(':'))}</h2>" if section.title else ""
    if section.rows:
        rows = [list(r) for r in section.rows]
        headers = rows.pop(0) if section.header else list(
            _SECTION_HEADERS.get(section.key, ("",) * len(rows[0])))
        out += table(headers, rows, [a == "r" for a in section.align])
    out += "".join(f"<p>{_e(line)}</p>" for line in section.lines)
    return out


def render_estimate(est: Estimate, *, description: str = "", batch: int | None = None,
                    seq: int | None = None, suggestions: Sequence[Any] = (),
                    fit: Any = None) -> str:
    """The page for ``modelsize estimate --html``: the text report's head and sections (the
    same numbers, formatted by the same functions), with the category bar, the memory
    timeline and the activations treemap drawn beside them."""
    from modelsize.report.estimate_text import head_lines, sections

    s = est.setup
    parts = _estimate_parts(est)
    acts = sorted(est.module_activations.items(), key=lambda kv: -kv[1])
    body = [f"<h1>{_e(s.model)}</h1>"]
    body += [f"<p class=\"sub\">{_e(line)}</p>" for line in head_lines(est, description,
                                                                          batch, seq)]
    for section in sections(est, suggestions=suggestions, fit=fit):
        if section.key == "categories":
            body.append(f"<h2>At the peak</h2>{stacked_bar(parts, est.peak_bytes)}"
                        f"{legend(c for c, _ in parts)}")
        body.append(_section(section))
        if section.key == "dominant":
            body.append(_parallel_section(est))
            body.append(f"<h2>Memory over the program</h2>{timeline_chart(est)}")
        elif section.key == "modules":
            body.append(treemap([(m, n, "activations", f"{m}\n{n:,} bytes ({human_bytes(n)})")
                                 for m, n in acts[:150]], height=360))
    return page(f"modelsize estimate {s.model}", "".join(body))


def card_estimate(est: Estimate) -> str:
    """A compact notebook card for an :class:`Estimate`."""
    from modelsize.report.estimate_text import saved_section

    parts = _estimate_parts(est)
    s = est.setup
    saved = saved_section(est, rows=5) if getattr(est, "saved_for_backward", None) else None
    return _card(f"<b>{_e(s.model)}</b> "
            f"{_program_word(s.mode)} on {_e(s.device)}: peak "
            f"<b>{_e(human_bytes(est.peak_bytes))}</b> in {_e(est.phase.name)}"
            f"{stacked_bar(parts, est.peak_bytes, height=18)}{legend(c for c, _ in parts)}"
            f"{_section(saved) if saved is not None else ''}")


# -- slim and diff -----------------------------------------------------------------------------

def before_after(before: dict[Category, int], after: dict[Category, int] | None,
                 before_label: str, after_label: str) -> str:
    """Two bars on one scale and the table of the change by category."""
    b_total = sum(before.values())
    a_total = sum(after.values()) if after is not None else 0
    scale = max(b_total, a_total, 1)
    width_a = max(int(1000 * a_total / scale), 1)
    bars = (stacked_bar(_category_parts(before), scale,
                        label=f"{before_label}: {human_bytes(b_total)}")
            + (stacked_bar(_category_parts(after), scale,
                           label=f"{after_label}: {human_bytes(a_total)}")
               if after is not None and width_a else ""))
    cats = [c for c in Category if before.get(c) or (after or {}).get(c)]
    rows = [(c.value, _bytes_cell(before.get(c, 0)),
             _bytes_cell((after or {}).get(c, 0)) if after is not None else "-",
             ((f"{(after or {}).get(c, 0) - before.get(c, 0):+,}",
               (after or {}).get(c, 0) - before.get(c, 0)) if after is not None else "-"))
            for c in cats]
    return (bars + legend(c.value for c in cats)
            + table(("category", before_label, after_label, "change"), rows,
                    (False, True, True, True)))


def render_slim(report: SlimReport) -> str:
    """The page for ``modelsize slim --html``: before and after by category."""
    src = report.source
    after = report.output.bytes_by_category if report.output is not None else None
    state = ("dry run: nothing written" if report.dry_run else
             f"written to {report.target}" + (", verified" if report.verified else ""))
    dropped = sorted(report.dropped, key=lambda d: -d.stored_nbytes)
    body = (
        f"<h1>{_e(src.path)} → {_e(report.target)}</h1><p class=\"sub\">{_e(state)}; "
        f"{src.file_bytes:,} → {report.output_bytes if report.output_bytes is not None else '?'}"
        f" bytes</p><h2>Before and after</h2>"
        + before_after(src.bytes_by_category, after, "before", "after")
        + "<h2>Dropped</h2>"
        + (table(("tensor", "category", "bytes", "why"),
                 [(d.name, d.category.value, _bytes_cell(d.stored_nbytes), d.reason)
                  for d in dropped[:500]], (False, False, True, False))
           if dropped else "<p>Nothing dropped.</p>")
        + "".join(f"<p>{_e(n)}</p>" for n in report.notes)
    )
    return page(f"modelsize slim {src.path.name}", body)


def card_slim(report: SlimReport) -> str:
    """A compact notebook card for a :class:`SlimReport`."""
    src = report.source
    out = report.output_bytes
    head = (f"{_e(human_bytes(src.file_bytes))} → {_e(human_bytes(out))}" if out is not None
            else f"{_e(human_bytes(src.file_bytes))} (dry run)")
    after = report.output.bytes_by_category if report.output is not None else None
    return _card(f"<b>{_e(src.path.name)}</b> {head}"
            f"{before_after(src.bytes_by_category, after, 'before', 'after')}")


def render_diff(d: Diff) -> str:
    """The page for ``modelsize diff --html``."""
    rows: list[tuple[Any, ...]] = []
    for t in d.added:
        rows.append(("added", t.name, t.category.value, _bytes_cell(t.stored_nbytes)))
    for t in d.removed:
        rows.append(("removed", t.name, t.category.value, _bytes_cell(t.stored_nbytes)))
    for c in d.changed:
        rows.append((", ".join(c.changes), c.name, c.b.category.value,
                     _bytes_cell(c.b.stored_nbytes)))
    body = (
        f"<h1>{_e(d.a.path)} vs {_e(d.b.path)}</h1><p class=\"sub\">{len(d.added)} added, "
        f"{len(d.removed)} removed, {len(d.changed)} changed, {d.unchanged} unchanged</p>"
        "<h2>By category</h2>"
        + before_after(d.a.bytes_by_category, d.b.bytes_by_category, "A", "B")
        + "<h2>Tensors</h2>"
        + (table(("change", "tensor", "category", "bytes"), rows[:2000],
                 (False, False, False, True)) if rows else "<p>Same tensors.</p>")
    )
    return page("modelsize diff", body)


def card_diff(d: Diff) -> str:
    """A compact notebook card for a :class:`Diff`."""
    return _card(f"<b>{_e(d.a.path.name)} vs "
            f"{_e(d.b.path.name)}</b>: {len(d.added)} added, {len(d.removed)} removed, "
            f"{len(d.changed)} changed"
            f"{before_after(d.a.bytes_by_category, d.b.bytes_by_category, 'A', 'B')}")


def write(path: str, text: str) -> None:
    """Write a page (UTF-8), whole or not at all; a failure is one line (report.files)."""
    from modelsize.report.files import write_text

    write_text(path, text)
