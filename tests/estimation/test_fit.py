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


# -- fewest GPUs ------------------------------------------------------------------------------


@pytest.mark.parametrize("whole, sharded, budget", [(10**9, 64 * 10**9, 9 * 10**9),
                                                    (5, 1000, 6), (0, 10**6, 10**6 - 1),
                                                    (3 * 10**9, 10**12, 80 * 2**30)])
def test_fewest_gpus_for_a_plus_b_over_n(whole: int, sharded: int, budget: int) -> None:
    from modelsize.estimation.fit import fewest

    def measure(n: int) -> int:
        return whole + -(-sharded // n)

    result = fewest(measure, budget)
    expected = next(n for n in range(1, 5000) if measure(n) <= budget)
    assert result.best == expected and result.smallest
    probes = dict(result.probes)
    assert probes[result.best] <= budget < probes[result.best - 1]
    assert len(result.probes) <= 5


def test_fewest_when_one_fits_or_none_does() -> None:
    from modelsize.estimation.fit import fewest

    assert fewest(lambda n: 10 + 100 // n, 200).best == 1
    none = fewest(lambda n: 1000 + 100 // n, 500, limit=64)
    assert none.best == 0 and 64 in dict(none.probes)
    assert len(none.probes) <= 3


def test_fewest_over_allowed_counts_and_steps() -> None:
    from modelsize.estimation.fit import fewest

    def measure(n: int) -> int:
        return 100 + 6400 // n + (n < 24) * 50

    result = fewest(measure, 400, allowed=lambda n: n % 8 == 0 or n in (1, 2, 4))
    assert result.best == 24
    result = fewest(measure, 300, allowed=lambda n: 32 % n == 0, limit=32)
    assert result.best == 32
    probes = dict(result.probes)
    assert probes[16] > 300
