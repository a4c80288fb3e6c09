"""Casting floating-point tensors chunk by chunk, with the error the cast made.

NumPy does the arithmetic (it is needed only when a cast is asked for). ``bfloat16``, which
NumPy lacks, is the top half of a ``float32``: rounded to nearest-even like torch, NaN kept
quiet. For every cast tensor :class:`Cast` records the largest absolute and relative error
and how many finite values overflowed to infinity (``float16`` tops out at 65504).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from modelsize.dtypes import DTYPES
from modelsize.errors import MissingDependencyError
from modelsize.slimming.source import TensorSource

#: Bytes of input cast at a time (the error's float64 temporaries are a few times this).
_PIECE = 1 << 20
#: Floating dtypes modelsize casts between.
CASTABLE: tuple[str, ...] = ("float64", "float32", "float16", "bfloat16")


def _np() -> Any:
    try:
        import numpy
    except ImportError as exc:
        raise MissingDependencyError("numpy", "modelsize slim --cast", extra="slim") from exc
    return numpy


def should_cast(dtype: str, target: str) -> bool:
    """Whether ``--cast target`` changes a tensor of ``dtype``: floating and wider (never
    widened, never a quantized or 8-bit type)."""
    if dtype not in CASTABLE or target not in CASTABLE or dtype == target:
        return False
    return DTYPES[dtype].block_bytes > DTYPES[target].block_bytes


def _to_float(np: Any, data: bytes | memoryview, dtype: str) -> Any:
    """Elements of ``dtype`` as a float32/float64 array (bfloat16 widened exactly)."""
    if isinstance(data, np.ndarray):
        data = data.data
    if dtype == "bfloat16":
        u16 = np.frombuffer(data, dtype="<u2")
        return (u16.astype("<u4") << 16).view("<f4")
    return np.frombuffer(data, dtype={"float64": "<f8", "float32": "<f4", "float16": "<f2"}[dtype])


def _from_float(np: Any, values: Any, dtype: str) -> Any:
    """``values`` rounded to ``dtype``, as the array to write."""
    if dtype == "bfloat16":
        f32 = values.astype("<f4", copy=False)
        u32 = f32.view("<u4")
        rounded = ((u32 + 0x7FFF + ((u32 >> 16) & 1)) >> 16).astype("<u2")
        nan = np.isnan(f32)
        if nan.any():
            rounded[nan] = ((u32[nan] >> 16) | 0x40).astype("<u2")
        return rounded
    return values.astype({"float64": "<f8", "float32": "<f4", "float16": "<f2"}[dtype])


@dataclass
class CastError:
    """How far the cast values are from the source values, over a whole tensor."""

    max_abs: float = 0.0
    max_rel: float = 0.0
    overflow: int = 0


class Cast:
    """A source's elements converted from ``src`` to ``dst`` as they stream."""

    def __init__(self, source: TensorSource, src: str, dst: str) -> None:
        self.source = source
        self.src = src
        self.dst = dst
        self.nbytes = source.nbytes // DTYPES[src].block_bytes * DTYPES[dst].block_bytes
        self.error = CastError()
        self.np = _np()

    def chunks(self) -> Iterator[bytes]:
        """Cast chunks; :attr:`error` is complete once they are all consumed."""
        np = self.np
        size = DTYPES[self.src].block_bytes
        step = _PIECE - _PIECE % size
        for chunk in self.source.chunks():
            view = memoryview(chunk)
            with np.errstate(over="ignore", invalid="ignore"):
                # In pieces: the float64 temporaries of the error stay a few MiB.
                out = b"".join(self._cast(np, view[i : i + step])
                               for i in range(0, len(view), step))
            yield out

    def _cast(self, np: Any, chunk: bytes | memoryview) -> bytes:
        """One piece cast, its error folded into :attr:`error` (computed in float32, or
        float64 for float64 sources: wide enough to hold both sides exactly)."""
        values = _to_float(np, chunk, self.src)
        out = _from_float(np, values, self.dst)
        wide = "<f8" if self.src == "float64" else "<f4"
        exact = values.astype(wide, copy=False)
        back = _to_float(np, out, self.dst).astype(wide, copy=False)
        diff = np.abs(exact - back)
        bad = ~np.isfinite(diff)
        if bad.any():  # NaN/inf in the source, or values beyond the target's range
            over = np.isinf(back) & np.isfinite(exact)
            self.error.overflow += int(np.count_nonzero(over))
            diff[bad] = np.nan
        mag = np.abs(exact)
        rel = diff / mag  # 0/0 is NaN and ignored below; x/0 cannot occur (0 casts exactly)
        max_abs = float(np.fmax.reduce(diff)) if diff.size else 0.0
        max_rel = float(np.fmax.reduce(rel)) if rel.size else 0.0
        if max_abs == max_abs:  # not NaN
            self.error.max_abs = max(self.error.max_abs, max_abs)
        if max_rel == max_rel:
            self.error.max_rel = max(self.error.max_rel, max_rel)
        return bytes(out.data)
