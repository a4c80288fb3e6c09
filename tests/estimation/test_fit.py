"""The ``--fit`` search: exact answers with few probes."""

from __future__ import annotations

import pytest

from modelsize.estimation.fit import fit


@pytest.mark.parametrize("slope, base, budget", [(10, 100, 1000), (3, 1000, 1192), (7, 5, 10**6)])
def test_affine_peaks_take_four_traces(slope: int, base: int, budget: int) -> None:
    result = fit(lambda n: base + slope * n, budget)
    assert result.best == (budget - base) // slope
    assert len(result.probes) <= 4
    probes = dict(result.probes)
    assert probes[result.best] <= budget < probes[result.best + 1]


def test_nothing_fits() -> None:
    result = fit(lambda n: 100 + n, 50)
    assert result.best == 0 and result.probes == ((1, 101),)


def test_curved_and_stepped_peaks_are_still_exact() -> None:
    for measure, budget in [(lambda n: n * n, 10**6),
                            (lambda n: 100 + 7 * n + (n > 40) * 300, 700),
                            (lambda n: int(n**1.3), 5000)]:
        result = fit(measure, budget)
        assert measure(result.best) <= budget < measure(result.best + 1)
        assert len(result.probes) < 50


def test_limit() -> None:
    result = fit(lambda n: 5, 10, limit=1000)
    assert result.best == 1000
