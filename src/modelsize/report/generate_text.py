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
from modelsize.report.table import table
from modelsize.report.units import human_bytes

if TYPE_CHECKING:
    from modelsize.estimation.engine_vllm import VllmPlan
    from modelsize.estimation.model_source import HubFetch, WeightsPlan
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
    if gen.decode_trace:
        lines.append(f"decode steps: {printable(gen.decode_trace, 400)}")
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


def render_weights(plan: WeightsPlan, fetched: HubFetch | None = None) -> str:
    """Where the weights' dtype came from, the checkpoint's own dtypes, what loading casts,
    tensors held as stored, and what reading a Hub repository fetched."""
    held = ", ".join(f"{n} {printable(k)} tensors ({human_bytes(b)})"
                     for k, (n, b) in plan.checkpoint_dtypes.items())
    lines = [f"Weights: {plan.dtype} in memory ({printable(plan.dtype_from, 300)}); the "
             f"{'file' if plan.quant_method == 'gguf' else 'checkpoint'} holds {held}, "
             f"{plan.checkpoint_bytes:,} bytes."]
    if plan.cast:
        cast = ", ".join(f"{n} {printable(k)} tensors ({human_bytes(b)})"
                         for k, (n, b) in plan.cast.items())
        lines.append(f"  loading casts {cast} to {plan.dtype}.")
    if plan.kept_fp32:
        lines.append(f"  kept in float32 by the model class's rule: {len(plan.kept_fp32)} "
                     f"parameters ({printable(', '.join(plan.kept_fp32[:4]), 200)}"
                     f"{'...' if len(plan.kept_fp32) > 4 else ''}).")
    for note in plan.notes:
        lines.append(f"  {printable(note, 600)}")
    if fetched is not None:
        lines.append(fetched.line())
    return "\n".join(lines) + "\n"


def _gib(n: int) -> str:
    """vLLM's ``format_gib``: GiB rounded to 2 decimals."""
    return f"{round(n / 2**30, 2)}"


def render_vllm_plan(plan: VllmPlan, description: str) -> str:
    """vLLM's start-up memory plan: each term, the KV cache groups, and the lines vLLM logs."""
    from modelsize.estimation.engine_vllm import SOURCE

    gpu = plan.gpu
    lines = [printable(description, 400),
             f"vLLM {plan.version}'s start-up plan on {gpu.name or 'a GPU'} of "
             f"{gpu.total_bytes:,} bytes ({printable(gpu.source, 200)}); rules from {SOURCE}.",
             f"settings: dtype {plan.dtype}, kv_cache_dtype {plan.kv_cache_dtype}, "
             f"gpu_memory_utilization {plan.gpu_memory_utilization}, max_model_len "
             f"{plan.max_model_len:,}, max_num_seqs {plan.max_num_seqs:,}, "
             f"max_num_batched_tokens {plan.max_num_batched_tokens:,}, block_size "
             f"{plan.block_size}", ""]
    rows: list[tuple[str, ...]] = [("term", "bytes", "size", "how", "where")]
    rows.append(("requested (total x utilization)", f"{plan.requested_bytes:,}",
                 human_bytes(plan.requested_bytes), "rule",
                 "v1/worker/utils.py request_memory"))
    for t in plan.terms:
        rows.append((f"- {t.name}", f"{t.nbytes:,}", human_bytes(t.nbytes), t.how,
                     printable(t.where, 90)))
    rows.append(("= KV cache", f"{plan.available_bytes:,}", human_bytes(plan.available_bytes),
                 "rule", "v1/worker/gpu_worker.py determine_available_memory"))
    lines += table([list(r) for r in rows], "lrrll")
    notes = [f"  {t.name}: {printable(t.note, 300)}" for t in plan.terms if t.note]
    lines += notes
    lines.append("")
    lines.append(f"KV cache groups (v1/core/kv_cache_planning.py): {len(plan.groups)}; one block "
                 f"of every group's layers takes {plan.bytes_per_block:,} bytes")
    grows: list[tuple[str, ...]] = [("group", "layers", "block", "page", "per token",
                                     "blocks per request")]
    for g in plan.groups:
        kind = {"full": "full attention", "sliding": f"sliding window {g.window:,}",
                "mla": "MLA latent", "mamba": "Mamba state"}.get(g.kind, g.kind)
        grows.append((kind, str(g.layers), str(g.block_size), human_bytes(g.page_bytes),
                      human_bytes(g.per_token_bytes) if g.per_token_bytes else "-",
                      f"{g.blocks_per_request:,}"))
    lines += table([list(r) for r in grows], "lrrrrr")
    lines.append("")
    if not plan.fits:
        fit = (f"Based on the available memory, the estimated maximum model length is "
               f"{plan.longest_fitting_len}. " if plan.longest_fitting_len > 0 else "")
        need = plan.bytes_per_block * plan.blocks_per_request
        lines.append("vLLM would not start: "
                     + (f"To serve at least one request with the model's max seq len "
                        f"({plan.max_model_len}), ({_gib(need)} GiB KV cache is needed, which "
                        f"is larger than the available KV cache memory "
                        f"({_gib(plan.available_bytes - plan.bytes_per_block)} GiB). {fit}"
                        if plan.available_bytes > 0 else
                        "No available memory for the cache blocks. ")
                     + "Try increasing `gpu_memory_utilization` or decreasing `max_model_len`.")
    else:
        lines.append("As vLLM logs it at start-up:")
        lines.append(f"  Available KV cache memory: {_gib(plan.available_bytes)} GiB")
        lines.append(f"  GPU KV cache size: {plan.kv_cache_tokens:,} tokens")
        lines.append(f"  Maximum concurrency for {plan.max_model_len:,} tokens per request: "
                     f"{plan.max_concurrency:.2f}x")
        lines.append(f"  (num_gpu_blocks {plan.num_gpu_blocks:,}; a request of "
                     f"{plan.max_model_len:,} tokens takes {plan.blocks_per_request:,} blocks)")
        if plan.request_tokens and plan.request_concurrency is not None:
            lines.append(f"For {plan.request_tokens:,} tokens per request (--seq + --generate): "
                         f"maximum concurrency {plan.request_concurrency:.2f}x.")
    for note in plan.notes:
        lines.append(f"note: {printable(note, 300)}")
    return "\n".join(lines) + "\n"
