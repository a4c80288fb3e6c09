"""``--fit BUDGET`` with ``--generate N``: the longest context or the largest batch that fits.

The cache grows linearly in tokens and in sequences, so :func:`modelsize.estimation.fit.fit`
needs few traces: two small ones give a line, the line's answer is traced with the value
above it, and regula falsi (bisection where the peak bends, e.g. where it moves from the
last decode step to the prefill) closes the bracket. Every number is a full trace; the
answer fits and the value above it was traced and does not.

``context`` counts the prompt plus the ``N`` new tokens (the prompt is at least 1 token);
``batch`` counts concurrent sequences (each with ``--beams`` beams).
"""

from __future__ import annotations

from collections.abc import Callable

from modelsize.errors import UsageError
from modelsize.estimation.fit import fit
from modelsize.estimation.result import Estimate, GenerationFit

#: A context search stops here when the model names no longer one.
CONTEXT_LIMIT = 1 << 22
BATCH_LIMIT = 1 << 16


def measured(est: Estimate) -> int:
    """What a fit compares with the budget: the device total (on CPU, the peak)."""
    return est.device_estimate.total_bytes


def fit_generation(estimate_at: Callable[[int, int], Estimate], budget: int, dimension: str,
                   *, batch: int, prompt: int, new_tokens: int,
                   context_limit: int | None = None) -> GenerationFit:
    """The largest ``dimension`` (``context`` or ``batch``) whose estimate fits ``budget``.

    ``estimate_at(batch, prompt)`` traces one generation. ``context_limit``: the longest
    context the model takes (``max_position_embeddings``), if any.
    """
    traced: dict[tuple[int, int], Estimate] = {}

    def at(b: int, p: int) -> Estimate:
        if (b, p) not in traced:
            traced[(b, p)] = estimate_at(b, p)
        return traced[(b, p)]

    if dimension == "batch":
        found = fit(lambda n: measured(at(n, prompt)), budget, dimension="batch",
                    limit=BATCH_LIMIT, measure_name=_name(at, 1, prompt))
        best_batch, best_prompt = found.best, prompt
    elif dimension == "context":
        limit = context_limit or CONTEXT_LIMIT
        if limit <= new_tokens:
            raise UsageError(f"--fit-dim context: the model takes {limit} positions, no more "
                             f"than the {new_tokens} new tokens")
        found = fit(lambda n: measured(at(batch, n - new_tokens)), budget,
                    dimension="context", start=new_tokens + 1, limit=limit,
                    measure_name=_name(at, batch, 1))
        best_batch, best_prompt = batch, found.best - new_tokens
    else:
        raise UsageError(f"--fit-dim {dimension} with --generate: use context or batch")
    est = traced.get((best_batch, best_prompt)) if found.best else None
    return GenerationFit(found, best_batch, best_prompt, new_tokens, est)


def _name(at: Callable[[int, int], Estimate], batch: int, prompt: int) -> str:
    """``device total`` for a CUDA estimate, ``peak`` on CPU (the search's first trace)."""
    return "device total" if at(batch, prompt).setup.device == "cuda" else "peak"
