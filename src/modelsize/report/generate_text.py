"""The generation part of the plain-text estimate report (``modelsize estimate --generate``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from modelsize.errors import printable
from modelsize.estimation.result import (
    CacheKind,
    Estimate,
    GenerationFit,
    GenerationInfo,
    MemoryCategory,
    PhaseSpan,
)
from modelsize.report.units import human_bytes

if TYPE_CHECKING:
    from modelsize.report.estimate_text import Section

_KIND_WORDS = {
    CacheKind.FULL_ATTENTION: "full attention",
    CacheKind.SLIDING_WINDOW: "sliding window",
    CacheKind.LATENT: "latent attention (MLA)",
    CacheKind.RECURRENT: "recurrent state",
    CacheKind.CROSS_ATTENTION: "cross attention",
}


def describe_program(gen: GenerationInfo) -> str:
    """``generate() of 64 new tokens (greedy, DynamicCache, 4 beams)``."""
    parts = ["greedy" if gen.beams == 1 else f"beam search, {gen.beams} beams"]
    if gen.cache_class:
        parts.append(gen.cache_class)
    if gen.prefill_chunks > 1:
        parts.append(f"prompt in {gen.prefill_chunks} chunks")
    extra = {k: v for k, v in gen.options.items() if k not in ("num_beams",)}
    if extra:
        parts.append(", ".join(f"{k}={v}" for k, v in extra.items()))
    return f"generate() of {gen.new_tokens} new tokens ({'; '.join(parts)})"


def describe_phase(phase: PhaseSpan, gen: GenerationInfo) -> str:
    """Where in the program a peak was: ``the prefill``, ``decode step 12 of 63``..."""
    if phase.name == "prefill":
        if gen.prefill_chunks > 1:
            return f"the prefill, chunk {phase.micro_batch} of {gen.prefill_chunks}"
        return "the prefill"
    if phase.name == "decode":
        return f"decode step {phase.step} of {max(gen.new_tokens - 1, 0)}"
    if phase.name == "encode":
        return "the encoder"
    return "generate()'s setup"


def generation_section(est: Estimate) -> Section:
    """The cache by layer kind, the cache's size at the prefill and at the end, and how the
    values the trace cannot know were chosen: one section of the report (text and HTML)."""
    from modelsize.report.estimate_text import Section

    gen = est.generation
    assert gen is not None
    rows: list[tuple[str, ...]] = [("cache by layer kind", "layers", "per token",
                                    "per sequence", "tokens held", "capacity", "at the end")]
    for g in gen.groups:
        per_token = human_bytes(g.bytes_per_token) if g.bytes_per_token else "-"
        if g.latent_bytes_per_token and g.latent_bytes_per_token != g.bytes_per_token:
            per_token += f" (latent form {human_bytes(g.latent_bytes_per_token)})"
        rows.append((_KIND_WORDS.get(g.kind, g.kind.value), str(g.layers), per_token,
                     human_bytes(g.bytes_per_sequence) if g.bytes_per_sequence else "-",
                     str(g.tokens) if g.bytes_per_token else "-",
                     str(g.capacity) if g.capacity is not None else "-",
                     human_bytes(g.nbytes)))
    row_count = f"{gen.rows} row{'s' if gen.rows != 1 else ''}"
    title = (f"Cache ({printable(gen.cache_class) or 'none'}, {row_count} = batch "
             f"{gen.batch} x {gen.beams} beam(s)): {human_bytes(gen.prefill_cache_bytes)} "
             f"after the prefill, {human_bytes(gen.final_cache_bytes)} at the end "
             f"({gen.final_cache_bytes:,} bytes)"
             + (f", and {human_bytes(gen.host_cache_bytes)} offloaded to host memory"
                if gen.host_cache_bytes else "")
             + f"; per row, one more token adds {gen.bytes_per_token:,} bytes.")
    lines = [f"tokens: {printable(gen.token_values, 400)}"]
    if gen.routing:
        lines.append(f"routing: {printable(gen.routing, 400)}")
    return Section("generation", title, tuple(rows) if len(rows) > 1 else (), "lrrrrrr",
                   header=True, lines=tuple(lines))


def render_generation_fit(found: GenerationFit) -> str:
    """The answer of ``--fit`` with ``--generate``, and the plan at it."""
    from modelsize.report.estimate_text import render_fit

    fit = found.fit
    lines = [render_fit(fit).rstrip("\n")]
    est = found.estimate
    if est is not None:
        what = (f"{found.context_tokens} tokens of context ({found.prompt_tokens} prompt + "
                f"{found.new_tokens} new)" if fit.dimension == "context"
                else f"{found.batch} sequences of {found.context_tokens} tokens")
        cache = est.categories[MemoryCategory.KV_CACHE]
        where = describe_phase(est.phase, est.generation) if est.generation else est.phase.name
        lines.append(f"plan at the answer: {what}; peak {human_bytes(est.peak_bytes)} in {where}, "
                     f"of which cache {human_bytes(cache)}; device total "
                     f"{human_bytes(est.device_estimate.total_bytes)} "
                     f"({est.device_estimate.total_bytes:,} bytes of {fit.budget_bytes:,}).")
    return "\n".join(lines) + "\n"
