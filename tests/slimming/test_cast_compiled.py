"""The compiled float32 -> bfloat16 and float16 casts (``modelsize._speedups``) give the bytes
and the errors of the NumPy passes they replace, on the values where casts go wrong: ties,
subnormals (float16's, reached by rounding), signed zeros, NaN of both signs (a negative NaN's
bfloat16 rounding wraps around to zero; float16 keeps NumPy's NaN payloads), infinities,
finite values that round to infinity, empty and unaligned sources. (All 2**32 float32 bit
patterns: ``scripts/check_casts_exhaustive.py``, too long for the suite.)"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np
import pytest

import modelsize
from modelsize.errors import MissingDependencyError
from modelsize.slimming import cast

speedups = pytest.importorskip("modelsize._speedups", reason="the C extension is not built")


KINDS = {"bfloat16": speedups.cast_f32_bf16, "float16": speedups.cast_f32_f16}


def _numpy(chunk: bytes, dst: str = "bfloat16") -> tuple[bytes, float, float, int]:
    """The NumPy path of :meth:`Cast._cast` (its fast path first, as slim runs it)."""
    c = cast.Cast.__new__(cast.Cast)
    c.src, c.dst, c.np, c.compiled = "float32", dst, np, None
    with np.errstate(over="ignore", invalid="ignore"):
        return c._cast(chunk)


def _same(a: tuple[bytes, float, float, int], b: tuple[bytes, float, float, int]) -> bool:
    return a[0] == b[0] and a[3] == b[3] and all(
        x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a[1:3], b[1:3], strict=True)
    )


@functools.cache
def _cases() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    ties = ((np.arange(1 << 16, dtype=np.uint32) << 16) | 0x8000).view(np.float32)
    # float16's ties, near-ties and subnormal range: every pattern of the 13 rounded-off bits
    # around 1.0, and values from 2**-26 to 2**-13
    half_ties = (0x3F800000 + np.arange(1 << 14, dtype=np.uint32)).view(np.float32)
    tiny = (0x32800000 + np.arange(0, 0x06000000, 1009, dtype=np.uint32)).view(np.float32)
    bits = rng.integers(0, 1 << 32, 50_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    edge = np.array([0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFFFFFFF,
                     0x7F800001, 0xFF800001, 0x7FFFFFFF, 0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF,
                     0xFF7FFFFF, 0x00000001, 0x80000001, 0x007FFFFF, 0x00008000, 0x00018000,
                     0x477FEFFF, 0x477FF000, 0x477FF001, 0x47800000, 0xC77FF000, 0x33000000,
                     0x33000001, 0xB3000001, 0x387FC000, 0x387FE000, 0x38800000, 0x7F802000,
                     0x7FA00000, 0xFF802000],
                    dtype=np.uint32).view(np.float32)
    cases = [rng.standard_normal(10_007).astype(np.float32), ties, half_ties, tiny, bits, edge,
             np.array([], np.float32), np.full(5, np.nan, np.float32), np.zeros(9, np.float32),
             np.array([np.inf, -np.inf], np.float32)]
    for i in range(40):  # NaN, inf or an overflow somewhere in a long run of normal values
        with np.errstate(over="ignore", under="ignore"):
            x = (rng.standard_normal(9_000) * 10.0 ** float(rng.integers(-44, 39))
                 ).astype(np.float32)
        x[rng.integers(0, len(x))] = [np.nan, np.inf, 3.3961e38, -np.nan, 65520.0][i % 5]
        cases.append(x)
    return cases


@pytest.mark.parametrize("dst", sorted(KINDS))
@pytest.mark.parametrize("i", range(len(_cases())))
def test_compiled_cast_gives_the_numpy_bytes_and_errors(i: int, dst: str) -> None:
    x = _cases()[i]
    chunk = x.tobytes()
    assert _same(KINDS[dst](chunk), _numpy(chunk, dst))


@pytest.mark.parametrize("dst", sorted(KINDS))
def test_compiled_cast_reads_an_unaligned_memoryview(dst: str) -> None:
    x = np.random.default_rng(1).standard_normal(3_000).astype(np.float32)
    buf = bytearray(1 + x.nbytes)
    view = memoryview(buf)[1:]
    view[:] = x.tobytes()
    assert _same(KINDS[dst](view), _numpy(x.tobytes(), dst))


@pytest.mark.parametrize("dst", sorted(KINDS))
def test_compiled_cast_refuses_a_partial_float(dst: str) -> None:
    with pytest.raises(ValueError, match="not whole float32s"):
        KINDS[dst](b"\x00\x00\x80")


def test_compiled_casts_need_no_numpy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the extension is built, float32 to bfloat16 or float16 never imports NumPy; a
    float64 source still asks for it, in one line."""
    torch = pytest.importorskip("torch")
    f32, f64 = tmp_path / "f32.pt", tmp_path / "f64.pt"
    torch.save({"w": torch.randn(64, 64), "b": torch.randn(64)}, f32)
    torch.save({"w": torch.randn(8, dtype=torch.float64)}, f64)

    def no_numpy() -> None:
        raise MissingDependencyError("numpy", "modelsize slim --cast", extra="slim")

    monkeypatch.setattr(cast, "_np", no_numpy)
    for dst in ("bfloat16", "float16"):
        assert modelsize.slim(f32, tmp_path / f"{dst}.pt", cast=dst).verified
    with pytest.raises(MissingDependencyError, match="numpy"):
        modelsize.slim(f64, tmp_path / "narrowed.pt", cast="float32")


def test_portable_float16_loops_give_the_numpy_bytes_and_errors(tmp_path: Path) -> None:
    """Where the CPU has F16C the float16 cast runs on it; ``MODELSIZE_NO_F16C`` makes the
    extension use its portable loops (the path of every other CPU): the same bytes and errors
    as NumPy on every case, in a process of its own."""
    import pickle
    import subprocess
    import sys

    src = tmp_path / "cases.pkl"
    src.write_bytes(pickle.dumps([c.tobytes() for c in _cases()]))
    code = ("import pickle, sys\nfrom modelsize import _speedups\n"
            "cases = pickle.loads(open(sys.argv[1], 'rb').read())\n"
            "out = [_speedups.cast_f32_f16(c) for c in cases]\n"
            "out.append(_speedups.cast_f32_f16(memoryview(cases[0])[4:4 + 4 * 1001]))\n"
            "open(sys.argv[2], 'wb').write(pickle.dumps(out))\n")
    import os

    env = dict(os.environ, MODELSIZE_NO_F16C="1")
    subprocess.run([sys.executable, "-c", code, str(src), str(tmp_path / "out.pkl")],
                   check=True, env=env)
    got = pickle.loads((tmp_path / "out.pkl").read_bytes())
    chunks = [c.tobytes() for c in _cases()]
    chunks.append(chunks[0][4:4 + 4 * 1001])
    for chunk, result in zip(chunks, got, strict=True):
        assert _same(result, _numpy(chunk, "float16"))
