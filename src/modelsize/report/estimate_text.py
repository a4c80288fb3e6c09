"""The estimate's report: its sections, and their plain-text rendering (and ``--fit``'s).

:func:`head_lines` and :func:`sections` hold every number the report shows, formatted once
(sizes through :func:`modelsize.report.units.human_bytes`); :func:`render_estimate` lays them
out as text and :func:`modelsize.report.html.render_estimate` as a page, so the two show the
same numbers in the same units.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from modelsize.errors import printable
from modelsize.estimation.result import (
    Estimate,
    FitResult,
    MemoryCategory,
    Source,
    Suggestion,
)
from modelsize.report.table import table
from modelsize.report.units import human_bytes, percent

#: The one size formatter of the estimate's report, text and HTML alike.
size = human_bytes

_PHASE_WORDS = {
    "forward": "the forward",
    "backward": "the backward",
    "optimizer": "the optimizer step",
    "zero_grad": "zero_grad",
    "setup": "setup",
}




_SOURCE_WORDS = {
    Source.GIVEN: "given",
    Source.DEFAULT: "the default",
    Source.CLI_DEFAULT: "the CLI's default",
    Source.CONFIG: "the config's",
    Source.MODEL: "the model's own",
}


def _shape(est: Estimate, batch: int | None, seq: int | None) -> str:
    if batch is None:
        shapes = [("x".join(str(d) for d in s) or "scalar") for _, s, _ in est.setup.inputs]
        return "inputs " + ", ".join(shapes)
    return f"batch {batch}" + (f" x seq {seq}" if seq else "")


def _source(est: Estimate, setting: str) -> str:
    src = est.setup.sources.get(setting)
    return f" ({_SOURCE_WORDS[Source(src)]})" if src else ""


def _title(est: Estimate, description: str) -> str:
    """The first line: the model, and the device with where it came from and how sure."""
    s = est.setup
    params = f"{est.parameter_count / 1e6:,.1f}M parameters"
    head = (f"{printable(s.model)}: {printable(description)}" if description
            else f"{printable(s.model)} ({params})")
    device = f"estimated for {s.device}{_source(est, 'device')}"
    if s.device == "cuda":
        device += (": checked on an H100 and an H200 within 0.07% of max_memory_allocated; "
                   "other GPUs are not")
    return f"{head}; {device}"


def _what(est: Estimate) -> str:
    s = est.setup
    if est.generation is not None:
        from modelsize.report.generate_text import describe_program

        what = describe_program(est.generation)
    elif s.mode == "infer":
        what = "inference (one forward, no_grad)"
    else:
        impl = s.implementation if s.implementation not in (None, "default") else ""
        impl = f" ({impl})" if impl else ""
        acc = f", {s.accumulate} micro-batches" if s.accumulate > 1 else ""
        ckpt = f", checkpointing {', '.join(s.checkpoint)}" if s.checkpoint else ""
        what = (f"training step with {s.optimizer}{impl}{_source(est, 'optimizer')}"
                f"{_frozen(est)}{acc}{ckpt}")
    weights = f", {s.dtype} weights{_source(est, 'dtype')}" if s.dtype else ""
    weights += f", weights: {s.quantization}" if s.quantization else ""
    amp = f", {s.amp} autocast" if s.amp else ""
    if s.amp and est.parallel is not None and est.parallel.mixed_precision == "policy":
        amp = f", {s.amp} parameters by FSDP2's MixedPrecisionPolicy"
    return what + weights + amp


def _frozen(est: Estimate) -> str:
    frozen = est.parameter_count - est.trainable_count
    if not frozen:
        return ""
    if est.setup.optimize_frozen:
        return (f" over all {_count(est.parameter_count)} parameters, the {_count(frozen)} "
                "frozen ones included")
    return (f" over the {_count(est.trainable_count)} trainable parameters (the "
            f"{_count(frozen)} frozen ones get no optimizer state)")


def _count(n: int) -> str:
    return f"{n / 1e6:,.1f}M" if n >= 100_000 else f"{n:,}"


def render_verification(est: Estimate) -> str:
    """One line: what the real run measured beside what was estimated for it."""
    v = est.verification
    if v is None:
        return ""
    if v.measured_bytes is None:
        return f"not verified: {printable(v.reason, 300)}"
    where = "on CPU"
    if est.setup.device != "cpu":
        where = "on CPU, through the same program's CPU estimate (the CUDA terms need a GPU)"
    size = ""
    if v.batch is not None:
        size = f" at batch {v.batch} ({printable(v.reason, 200)})"
    diff = v.difference or 0
    share = f" ({100.0 * diff / v.measured_bytes:+.3f}%)" if diff and v.measured_bytes else ""
    difference = f"{diff:+,} bytes{share}" if diff else "0 bytes"
    return (f"verified {where}{size}: measured {v.measured_bytes:,} bytes (the allocator's "
            f"peak), estimated {v.estimated_bytes:,}, difference {difference}; "
            f"{v.seconds:.1f} s")


def module_groups(modules: dict[str, int]) -> list[tuple[str, int]]:
    """Per-module activation bytes grouped at the first numbered level (one layer, one row)."""
    groups: dict[str, int] = {}
    for name, n in modules.items():
        m = re.match(r"^(.*?\.\d+)(\.|$)", name)
        key = m.group(1) if m else name
        groups[key] = groups.get(key, 0) + n
    return sorted(groups.items(), key=lambda kv: -kv[1])


@dataclass(frozen=True)
class Section:
    """One part of the estimate's report, as every renderer shows it (text and HTML).

    ``rows`` is a table (the first row its header when ``header``), ``align`` one ``l`` or
    ``r`` per column; ``lines`` are sentences after the table. Numbers are formatted here,
    once, so every renderer shows the same ones.
    """

    key: str
    title: str = ""
    rows: tuple[tuple[str, ...], ...] = ()
    align: str = ""
    header: bool = False
    lines: tuple[str, ...] = ()


def head_lines(est: Estimate, description: str = "", batch: int | None = None,
               seq: int | None = None) -> list[str]:
    """The report's first lines: the model and device, the program, the peak, and when
    present the verification and the ranks."""
    s = est.setup
    peak = est.peak_bytes
    lines = [_title(est, description), f"{_what(est)}, {_shape(est, batch, seq)}"]
    where = _PHASE_WORDS.get(est.phase.name, est.phase.name)
    step = f" of step {est.phase.step}" if s.mode == "train" else ""
    if est.generation is not None:
        from modelsize.report.generate_text import describe_phase

        where = describe_phase(est.phase, est.generation)
    lines.append(f"peak {size(peak)} ({peak:,} bytes) in {where}{step}, "
                 f"op {est.phase.start}..{est.phase.end} of {est.op_count:,}; "
                 f"traced in {est.trace_seconds:.1f} s")
    if est.verification is not None:
        lines.append(render_verification(est))
    if est.parallel is not None:
        lines.append(render_parallel_head(est))
    return lines


def sections(est: Estimate, *, suggestions: Sequence[Suggestion] = (),
             fit: FitResult | Sequence[FitResult] | None = None,
             modules: int = 6) -> list[Section]:
    """The report after its head: categories at the peak, what dominates, activations by
    module, what would shrink it, the CUDA terms, the formulas across GPUs, the fits, notes."""
    peak = est.peak_bytes
    out: list[Section] = []
    rows = [("at the peak", "bytes", "size", "share")]
    for cat in MemoryCategory:
        n = est.categories[cat]
        if cat is MemoryCategory.COMMUNICATION and est.parallel is None and not n:
            continue  # one device: no collectives
        if cat is MemoryCategory.KV_CACHE and est.generation is None and not n:
            continue  # no generation: no cache
        if est.generation is not None and not n and cat in (MemoryCategory.GRADIENTS,
                                                             MemoryCategory.OPTIMIZER_STATE):
            continue  # generation: no training state
        label = cat.value
        if cat is MemoryCategory.TEMPORARIES and est.scratch_bytes:
            label += f" (kernel scratch {size(est.scratch_bytes)})"
        rows.append((label, f"{n:,}", size(n), percent(n, peak) if n else "-"))
    rows.append(("total", f"{peak:,}", size(peak), "100%"))
    top_cat = max(MemoryCategory, key=lambda c: est.categories[c])
    out.append(Section("categories", "", tuple(rows), "lrrr", header=True))
    out.append(Section("dominant", lines=(
        f"Dominated by {top_cat.value} ({percent(est.categories[top_cat], peak)} of the "
        "peak).",)))
    if est.generation is not None:
        from modelsize.report.generate_text import generation_section

        out.append(generation_section(est))
    groups = module_groups(est.module_activations)
    if groups and modules:
        mrows = [(printable(n, 60), size(b)) for n, b in groups[:modules]]
        if len(groups) > modules:
            rest = sum(b for _, b in groups[modules:])
            mrows.append((f"({len(groups) - modules} more)", size(rest)))
        out.append(Section("modules", "Forward activations by module (alive when the forward "
                           "ends):", tuple(mrows), "lr"))
    saved = saved_section(est, rows=max(modules, 8) if modules else 0)
    if saved is not None:
        out.append(saved)
    if suggestions:
        srows = tuple((sg.change, sg.label, size(sg.peak_bytes),
                       f"{100.0 * (sg.peak_bytes - peak) / peak:+.0f}%") for sg in suggestions)
        out.append(Section("suggestions", "What would shrink it (each re-traced):", srows,
                           "llrr"))
    dev = est.device_estimate
    if dev.device == "cuda":
        drows = [(t.name, size(t.nbytes), t.note) for t in dev.terms]
        drows.append(("max_memory_allocated", size(dev.allocated_bytes), ""))
        drows.append(("total with context", size(dev.total_bytes), ""))
        out.append(Section("cuda", "CUDA device estimate (PyTorch 2.11's kernels and caching "
                           "allocator on sm90; terms named):", tuple(drows), "lrl"))
    if est.parallel is not None:
        crows, tail = comparison_rows(est)
        out.append(Section("formulas", "", tuple(crows), "lrrl", header=True,
                           lines=(tail,) if tail else ()))
    fits = [fit] if isinstance(fit, FitResult) else list(fit or ())
    if fits:
        out.append(Section("fit", lines=tuple(render_fit(f).rstrip("\n") for f in fits)))
    if est.notes:
        out.append(Section("notes", lines=tuple(f"note: {printable(note, 300)}"
                                               for note in est.notes)))
    return out


def saved_section(est: Estimate, rows: int = 8) -> Section | None:
    """What the training step keeps for the backward at the peak: the largest rows of
    :attr:`Estimate.saved_for_backward` and their total (the activations), then its
    findings; None where there is no table or nothing is kept."""
    saved = est.saved_for_backward
    if saved is None or not saved.nbytes:
        return None
    table_rows: list[tuple[str, ...]] = [("module", "op", "kept by", "tensor", "count",
                                          "size")]
    for r in saved.rows[:rows]:
        tensor = f"{r.dtype} {'x'.join(map(str, r.shape)) or 'scalar'}"
        by = ", ".join(r.saved_by) or "(no node)"
        if r.kept_in and r.kept_in != (r.module,):
            by += f" in {', '.join(r.kept_in)}"
        table_rows.append((printable(r.module, 40), r.op or "-", printable(by, 60), tensor,
                           f"{r.count:,}", size(r.nbytes)))
    if len(saved.rows) > rows:
        rest = saved.rows[rows:]
        table_rows.append((f"({len(rest)} more rows)", "", "", "",
                           f"{sum(r.count for r in rest):,}",
                           size(sum(r.nbytes for r in rest))))
    table_rows.append(("total (the activations)", "", "", "",
                       f"{sum(r.count for r in saved.rows):,}",
                       f"{size(saved.nbytes)} ({saved.nbytes:,} bytes)"))
    lines = tuple(f"finding: {printable(f.advice, 600)}; frees {size(f.nbytes)} at the peak"
                  for f in saved.findings)
    return Section("saved", "Saved for the backward at the peak (module and op that made "
                   "each tensor, the autograd node that keeps it):", tuple(table_rows),
                   "llllrr", header=True, lines=lines)


#: sections the text report runs on from the one before, without a blank line
_JOINED = ("modules", "notes")


def render_estimate(est: Estimate, *, description: str = "", batch: int | None = None,
                    seq: int | None = None, suggestions: Sequence[Suggestion] = (),
                    fit: FitResult | Sequence[FitResult] | None = None,
                    modules: int = 6) -> str:
    """The human report: peak, what it is made of, what dominates, what would shrink it."""
    lines = head_lines(est, description, batch, seq)
    for section in sections(est, suggestions=suggestions, fit=fit, modules=modules):
        if section.key not in _JOINED:
            lines.append("")
        if section.title:
            lines.append(section.title)
        if section.rows:
            lines += table([list(r) for r in section.rows], section.align)
        lines += section.lines
    return "\n".join(lines) + "\n"


def render_parallel_head(est: Estimate) -> str:
    """One line: which rank of how many GPUs, the strategy, and whether traced or accounted."""
    par = est.parallel
    assert par is not None
    engine = {"tp": "DTensor tensor parallelism",
              "fsdp+tp": "FSDP2 and DTensor tensor parallelism"}.get(par.strategy, "FSDP2")
    how = (f"traced with {engine} on a fake process group" if par.method == "traced"
           else "accounted from the single-GPU trace (" + "; ".join(par.accounted) + ")")
    if par.method == "traced" and par.accounted:
        how += " (" + "; ".join(par.accounted) + ")"
    if len(par.mesh) > 1:
        how += ", mesh " + " x ".join(f"{name} {size}" for name, size in par.mesh)
    if par.mixed_precision:
        how += (", mixed precision by FSDP2's MixedPrecisionPolicy"
                if par.mixed_precision == "policy" else ", mixed precision by torch.autocast")
    if par.cpu_offload:
        host = (f" (host {size(par.host_bytes)} at that moment, "
                f"{size(par.host_peak_bytes)} at most)"
                if par.host_bytes is not None and par.host_peak_bytes is not None else "")
        how += f", CPU offload: GPU memory{host}"
    ranks = ", ".join(f"rank {r.rank} {size(r.peak_bytes)}" for r in par.ranks)
    reshard = "" if par.method != "traced" or par.reshard_after_forward else (
        ", no reshard after forward")
    units = f", {len(par.units)} shard units" if par.units and par.strategy != "tp" else ""
    return (f"per rank of {par.world} GPUs, {par.strategy}{reshard}{units}: {how}; "
            f"worst rank {par.worst_rank} ({ranks})")


def comparison_rows(est: Estimate) -> tuple[list[tuple[str, ...]], str]:
    """What the ZeRO paper's formula and DeepSpeed's estimators say for the same rank: the
    table (header first) and the sentence on what they leave out."""
    par = est.parallel
    assert par is not None
    peak = est.peak_bytes
    rows: list[tuple[str, ...]] = [("formulas for the same rank", "size", "vs this estimate",
                                    "counts")]
    for c in par.comparisons:
        diff = f"{100.0 * (c.nbytes - peak) / peak:+.0f}%" if peak else "-"
        rows.append((c.name, size(c.nbytes), diff, c.counts))
    missing = [cat.value for cat in (MemoryCategory.ACTIVATIONS, MemoryCategory.TEMPORARIES,
                                     MemoryCategory.COMMUNICATION, MemoryCategory.BUFFERS,
                                     MemoryCategory.INPUTS) if est.categories[cat]]
    tail = (f"The formulas leave out what this estimate counts as {', '.join(missing)} "
            "(see the table above)." if missing else "")
    return rows, tail


def render_comparisons(est: Estimate) -> list[str]:
    """What the ZeRO paper's formula and DeepSpeed's estimators say for the same rank."""
    rows, tail = comparison_rows(est)
    return [*table([list(r) for r in rows], "lrrl"), *([tail] if tail else [])]


def render_fit(fit: FitResult, description: str = "") -> str:
    """One paragraph: the largest value that fits, and the traced value just above it."""
    head = f"{printable(description)}: " if description else ""
    if fit.label:
        head += f"{printable(fit.label)}: "
    traced = dict(fit.probes)
    if fit.smallest:
        return _render_fewest(fit, head, traced)
    if fit.best == 0:
        first = traced.get(1, 0)
        return (f"{head}nothing fits {size(fit.budget_bytes)}: {fit.dimension} 1 already "
                f"needs {size(first)} ({fit.measure}). {len(fit.probes)} trace(s).\n")
    above = traced.get(fit.best + 1)
    tail = (f"; {fit.best + 1} needs {_beside(above, fit.budget_bytes)}" if above is not None
            else f" (the search limit, {fit.limit})")
    return (f"{head}largest {fit.dimension} that fits {size(fit.budget_bytes)}: "
            f"{fit.best} ({size(fit.best_bytes)} {fit.measure}){tail}. "
            f"{len(fit.probes)} exact traces.\n")


def _render_fewest(fit: FitResult, head: str, traced: dict[int, int]) -> str:
    """The fewest GPUs that fit, and the traced count just below it."""
    many = "GPUs" if fit.dimension == "gpus" else fit.dimension

    def count(n: int) -> str:
        return f"{n} {'GPU' if n == 1 else 'GPUs'}" if fit.dimension == "gpus" else str(n)

    if fit.best == 0:
        last = traced.get(fit.limit, 0)
        return (f"{head}no number of {many} up to {fit.limit} fits "
                f"{size(fit.budget_bytes)}: {count(fit.limit)} still need "
                f"{size(last)} ({fit.measure}); what every rank holds whole does not "
                f"shrink with more {many}. {len(fit.probes)} exact traces.\n")
    below = max((n for n in traced if n < fit.best), default=None)
    tail = (f"; {count(below)} {'needs' if below == 1 else 'need'} "
            f"{_beside(traced[below], fit.budget_bytes)}" if below is not None else "")
    return (f"{head}fewest {many} that fit {size(fit.budget_bytes)}: {fit.best} "
            f"({size(fit.best_bytes)} {fit.measure}){tail}. "
            f"{len(fit.probes)} exact traces.\n")


def _beside(n: int, budget: int) -> str:
    """``n`` for a reader comparing it with ``budget``: exact bytes where both round alike."""
    return (f"{size(n)} ({n:,} bytes > {budget:,})" if size(n) == size(budget)
            else size(n))
