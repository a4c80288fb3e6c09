from __future__ import annotations

import pytest

from modelsize.report.units import human_bytes, human_mem, parse_size, percent


def test_human_units() -> None:
    assert human_bytes(999) == "999 B"
    assert human_bytes(2_600_000) == "2.6 MB"
    assert human_mem(3 * 2**30 // 2) == "1.5 GiB"
    assert percent(1, 3) == "33%"
    assert percent(1, 1000) == "<1%"


def test_parse_size() -> None:
    assert parse_size("80GiB") == 80 * 2**30
    assert parse_size("24 GB") == 24 * 10**9
    assert parse_size("1024") == 1024
    with pytest.raises(ValueError, match="not a size"):
        parse_size("lots")
