from __future__ import annotations

import pytest

from modelsize.report.units import human_bytes, human_mem, parse_size, percent


def test_human_units() -> None:
    assert human_bytes(999) == "999 B"
    assert human_bytes(1023) == "1023 B"
    assert human_bytes(1024) == "1 KiB"
    assert human_bytes(2_600_000) == "2.48 MiB"  # 2,600,000 / 2**20 = 2.4796
    assert human_bytes(3 * 2**30 // 2) == "1.5 GiB"
    assert human_bytes(2**30 - 2**19) == "1 GiB"  # never "1024 MiB"
    assert human_mem(3 * 2**30 // 2) == "1.5 GiB"
    assert percent(1, 3) == "33%"
    assert percent(1, 1000) == "<1%"


def test_one_set_of_units_for_files_and_memory() -> None:
    """inspect printed kB/MB/GB and estimate KiB/MiB/GiB (issue 18, smaller ones)."""
    for n in (0, 1, 1000, 10**6, 2**20, 5 * 10**9, 2**45):
        assert human_bytes(n) == human_mem(n)
        assert human_bytes(n).split()[1] in ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def test_parse_size() -> None:
    assert parse_size("80GiB") == 80 * 2**30
    assert parse_size("24 GB") == 24 * 10**9
    assert parse_size("1024") == 1024
    assert parse_size("1.5e9") == 1_500_000_000
    for bad in ("lots", "-5MB", "1e999", "inf", "nan", "0x10", "MB"):
        with pytest.raises(ValueError, match="not a size"):
            parse_size(bad)
