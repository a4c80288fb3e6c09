"""The compiled float32 -> bfloat16 cast (``modelsize._speedups``) gives the bytes and the
errors of the NumPy passes it replaces, on the values where casts go wrong: ties, subnormals,
signed zeros, NaN of both signs (a negative NaN's rounding wraps around to zero), infinities,
finite values that round to infinity, empty and unaligned sources."""

from __future__ import annotations

import math

import numpy as np
import pytest

from modelsize.slimming import cast

speedups = pytest.importorskip("modelsize._speedups", reason="the C extension is not built")


def _numpy(chunk: bytes) -> tuple[bytes, float, float, int]:
    """The NumPy path of :meth:`Cast._cast` (its fast path first, as slim runs it)."""
    c = cast.Cast.__new__(cast.Cast)
    c.src, c.dst, c.np = "float32", "bfloat16", np
    saved, cast._speedups = cast._speedups, None
    try:
        return c._cast(chunk)
    finally:
        cast._speedups = saved


def _same(a: tuple[bytes, float, float, int], b: tuple[bytes, float, float, int]) -> bool:
    return a[0] == b[0] and a[3] == b[3] and all(
        x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a[1:3], b[1:3], strict=True)
    )


def _cases() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    ties = ((np.arange(1 << 16, dtype=np.uint32) << 16) | 0x8000).view(np.float32)
    bits = rng.integers(0, 1 << 32, 50_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    edge = np.array([0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFFFFFFF,
                     0x7F800001, 0xFF800001, 0x7FFFFFFF, 0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF,
                     0xFF7FFFFF, 0x00000001, 0x80000001, 0x007FFFFF, 0x00008000, 0x00018000],
                    dtype=np.uint32).view(np.float32)
    cases = [rng.standard_normal(10_007).astype(np.float32), ties, bits, edge,
             np.array([], np.float32), np.full(5, np.nan, np.float32), np.zeros(9, np.float32),
             np.array([np.inf, -np.inf], np.float32)]
    for i in range(40):  # NaN, inf or an overflow somewhere in a long run of normal values
        with np.errstate(over="ignore", under="ignore"):
            x = (rng.standard_normal(9_000) * 10.0 ** float(rng.integers(-44, 39))
                 ).astype(np.float32)
        x[rng.integers(0, len(x))] = [np.nan, np.inf, 3.3961e38, -np.nan][i % 4]
        cases.append(x)
    return cases


@pytest.mark.parametrize("i", range(len(_cases())))
def test_compiled_cast_gives_the_numpy_bytes_and_errors(i: int) -> None:
    x = _cases()[i]
    chunk = x.tobytes()
    assert _same(speedups.cast_f32_bf16(chunk), _numpy(chunk))


def test_compiled_cast_reads_an_unaligned_memoryview() -> None:
    x = np.random.default_rng(1).standard_normal(3_000).astype(np.float32)
    buf = bytearray(1 + x.nbytes)
    view = memoryview(buf)[1:]
    view[:] = x.tobytes()
    assert _same(speedups.cast_f32_bf16(view), _numpy(x.tobytes()))


def test_compiled_cast_refuses_a_partial_float() -> None:
    with pytest.raises(ValueError, match="not whole float32s"):
        speedups.cast_f32_bf16(b"\x00\x00\x80")
