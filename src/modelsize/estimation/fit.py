"""``--fit``: the largest batch (or sequence length) whose exact traced peak fits a budget.

Each probe is a full trace, so the search spends few of them: peaks are close to affine in the
batch size, so the next probe is the value the last two predict (regula falsi), clamped inside
the bracket, with bisection as the fallback. The answer is always confirmed by tracing it and
the value above it.
"""

from __future__ import annotations

from collections.abc import Callable

from modelsize.estimation.result import FitResult

Measure = Callable[[int], int]


def fit(measure: Measure, budget: int, *, dimension: str = "batch", start: int = 1,
        limit: int = 1 << 20, measure_name: str = "peak_bytes") -> FitResult:
    """Largest ``n`` in ``[start, limit]`` with ``measure(n) <= budget`` (0 if none).

    ``measure`` must be non-decreasing in ``n``.
    """
    seen: dict[int, int] = {}

    def at(n: int) -> int:
        if n not in seen:
            seen[n] = measure(n)
        return seen[n]

    def result(best: int) -> FitResult:
        return FitResult(dimension, budget, measure_name, best, seen.get(best, 0), limit,
                         tuple(sorted(seen.items())))

    lo = start
    if at(lo) > budget:
        return result(0)
    hi = 0  # 0: no value known to be over the budget yet
    prev = 0
    while hi == 0:
        if lo >= limit:
            return result(limit)
        slope = (at(lo) - at(prev)) / (lo - prev) if prev else 0.0
        guess = lo * 2 if slope <= 0 else lo + int((budget - at(lo)) / slope)
        guess = min(max(guess, lo + 1), limit)
        if at(guess) <= budget:
            prev, lo = lo, guess
        else:
            hi = guess
    bisect = False
    while hi - lo > 1:
        width = hi - lo
        f_lo, f_hi = at(lo), at(hi)
        guess = lo + int((budget - f_lo) * (hi - lo) / (f_hi - f_lo)) if f_hi > f_lo else 0
        interpolated = not bisect and lo < guess < hi
        if not interpolated:
            guess = (lo + hi) // 2
        if at(guess) <= budget:
            lo = guess
            if interpolated and lo + 1 < hi and at(lo + 1) > budget:  # the guess was exact
                hi = lo + 1
        else:
            hi = guess
            if interpolated and hi - 1 > lo and at(hi - 1) <= budget:
                lo = hi - 1
        # regula falsi can creep along one side of a curved peak: then bisect once
        bisect = interpolated and hi - lo > width // 2
    return result(lo)
