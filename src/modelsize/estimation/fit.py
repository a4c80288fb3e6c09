"""``--fit``: the largest batch (or sequence length) whose exact traced peak fits a budget, or
the fewest GPUs whose per-rank peak does.

Each probe is a full trace, so the search spends few of them: peaks are close to affine in the
batch size, so the next probe is the value the last two predict (regula falsi), clamped inside
the bracket, with bisection as the fallback. The answer is always confirmed by tracing it and
the value above it.

Across GPUs (:func:`fewest`) a rank's peak is close to ``a + b / world``: what every rank holds
whole (activations of its own batch, the unsharded root, one gathered block) plus the shards.
The same search runs in ``1 / world``, where that curve is a line, and the answer is confirmed
by tracing it and the count below it.
"""

from __future__ import annotations

import bisect
import math
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


def fewest(measure: Measure, budget: int, *, limit: int = 4096, dimension: str = "gpus",
           allowed: Callable[[int], bool] | None = None,
           measure_name: str = "peak_bytes") -> FitResult:
    """Smallest ``n`` in ``[1, limit]`` (and ``allowed(n)``) with ``measure(n) <= budget``.

    ``measure`` must be non-increasing in ``n`` over the allowed values. ``best`` is 0 when not
    even ``limit`` (the largest allowed value up to it) fits.
    """
    values = [n for n in range(1, limit + 1) if allowed is None or allowed(n)]
    if not values:
        raise ValueError("no allowed value to search")
    seen: dict[int, int] = {}

    def at(i: int) -> int:
        n = values[i]
        if n not in seen:
            seen[n] = measure(n)
        return seen[n]

    def result(i: int | None) -> FitResult:
        best = values[i] if i is not None else 0
        return FitResult(dimension, budget, measure_name, best, seen.get(best, 0), values[-1],
                         tuple(sorted(seen.items())), smallest=True)

    def index(n: float) -> int:  # the first allowed value >= n
        return bisect.bisect_left(values, math.ceil(n))

    if at(0) <= budget:
        return result(0)
    # hi: an index known to fit; lo: one known not to. Probe a second point to get a slope.
    lo, hi = 0, None
    probe = min(index(values[0] * 2), len(values) - 1)
    while hi is None:
        if at(probe) <= budget:
            hi = probe
            break
        if probe == len(values) - 1:
            return result(None)
        n0, n1 = values[lo], values[probe]
        f0, f1 = at(lo), at(probe)
        lo = probe
        # a + b / n through both points; b > 0 when sharding helps
        b = (f0 - f1) / (1 / n0 - 1 / n1) if f0 > f1 else 0.0
        a = f1 - b / n1
        if b <= 0 or a >= budget:  # does not shrink (enough) with more GPUs: try the limit
            probe = len(values) - 1
        else:
            probe = min(max(index(b / (budget - a)), lo + 1), len(values) - 1)
    bisect_next = False
    while hi - lo > 1:
        width = hi - lo
        n0, n1 = values[lo], values[hi]
        f0, f1 = at(lo), at(hi)
        guess = -1
        if not bisect_next and f0 > f1:
            b = (f0 - f1) / (1 / n0 - 1 / n1)
            a = f1 - b / n1
            if a < budget:
                guess = index(b / (budget - a))
        interpolated = guess >= 0
        guess = min(max(guess, lo + 1), hi - 1) if interpolated else (lo + hi) // 2
        if at(guess) <= budget:
            hi = guess
            if interpolated and guess - 1 > lo and at(guess - 1) > budget:  # the guess was exact
                lo = guess - 1
        else:
            lo = guess
            if interpolated and guess + 1 < hi and at(guess + 1) <= budget:
                hi = guess + 1
        bisect_next = interpolated and hi - lo > width // 2
    return result(hi)
