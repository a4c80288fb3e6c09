"""Casting floating-point tensors chunk by chunk, with the error the cast made.

NumPy does the arithmetic (it is needed only when a cast is asked for). ``bfloat16``, which
NumPy lacks, is the top half of a ``float32``: rounded to nearest-even like torch, NaN kept
quiet. For every cast tensor :class:`Cast` records the largest absolute and relative error
and how many finite values overflowed to infinity (``float16`` tops out at 65504).

float32 to bfloat16 or float16, the casts most asked for, run in one pass of compiled code
where the optional extension ``modelsize._speedups`` is built (``pip install`` builds it where
a C compiler is at hand): the same bytes and the same errors as the NumPy passes, which take
about 5x (bfloat16) and 3.5x (float16) longer and remain the path everywhere else.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from modelsize._extensions import compiled
from modelsize.dtypes import DTYPES
from modelsize.errors import MissingDependencyError
from modelsize.inputs import reading
from modelsize.slimming.checksum import BUFFER, crc32, ordered, thread_buffer
from modelsize.slimming.source import FileRange, TensorSource, _pread_exact

#: The compiled casts' module; ``None``: NumPy does it all (the same results).
_speedups = compiled("_speedups")

#: Bytes of input cast at a time by one thread (its temporaries are a few times this).
_PIECE = BUFFER
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
        t = u32 >> 16  # in place from here: one temporary, not five
        t &= 1
        t += 0x7FFF
        t += u32
        t >>= 16
        rounded = t.astype("<u2")
        nan = np.isnan(f32)
        if nan.any():
            rounded[nan] = ((u32[nan] >> 16) | 0x40).astype("<u2")
        return rounded
    return values.astype({"float64": "<f8", "float32": "<f4", "float16": "<f2"}[dtype])


#: A cast piece: its bytes, their CRC-32, the largest absolute and relative error, overflows.
_Piece = tuple[bytes, int, float, float, int]
_SCRATCH = threading.local()


def _scratch(np: Any, n: int) -> tuple[Any, Any, Any]:
    """This thread's work arrays for ``n`` float32 elements: two of 4 bytes an element and
    one of 2 (allocated once: fresh arrays per piece cost more in page faults than the
    arithmetic)."""
    arrays = getattr(_SCRATCH, "arrays", None)
    if arrays is None or len(arrays[0]) < n:
        size = max(n, _PIECE // 4)
        arrays = _SCRATCH.arrays = (np.empty(size, "<u4"), np.empty(size, "<f4"),
                                    np.empty(size, "<u2"))
    a, b, c = arrays
    return a[:n], b[:n], c[:n]


def _cast_float32(np: Any, chunk: bytes | memoryview, dst: str,
                  ) -> tuple[bytes, float, float, int] | None:
    """float32 to bfloat16 or float16 in this thread's work arrays, with the error of
    :meth:`Cast._cast`; ``None`` where the piece holds NaN, infinity or an overflow (the
    general path then says which)."""
    x = np.frombuffer(chunk, "<f4")
    n = len(x)
    t, f, out = _scratch(np, n)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        if dst == "bfloat16":
            u = x.view("<u4")
            np.right_shift(u, 16, out=t)  # round to nearest even, as _from_float
            np.bitwise_and(t, 1, out=t)
            np.add(t, 0x7FFF, out=t)
            np.add(t, u, out=t)
            np.right_shift(t, 16, out=t)
            np.copyto(out, t, casting="unsafe")
            np.left_shift(t, 16, out=t)  # the values cast back (NaN never comes here)
            back = t.view("<f4")
        else:
            half = out.view("<f2")
            np.copyto(half, x, casting="same_kind")
            back = t.view("<f4")
            np.copyto(back, half)
        np.subtract(x, back, out=back)
        np.abs(back, out=back)
        max_abs = float(back.max()) if n else 0.0
        if max_abs != max_abs or max_abs == float("inf"):
            return None  # NaN or inf in the source or the result
        np.abs(x, out=f)
        np.divide(back, f, out=f)  # 0/0 is NaN and ignored by fmax
        max_rel = float(np.fmax.reduce(f)) if n else 0.0
        return bytes(out.data), max_abs, max_rel, 0


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
        #: The compiled cast (float32 to bfloat16 or float16) where it is built; NumPy is
        #: imported (a tenth of a second) only where it does not serve.
        self.compiled: Callable[[bytes | memoryview], tuple[bytes, float, float, int]] | None = (
            None if _speedups is None or src != "float32"
            else {"bfloat16": _speedups.cast_f32_bf16, "float16": _speedups.cast_f32_f16}.get(dst)
        )
        self.np: Any = None if self.compiled is not None else _np()

    def chunks(self) -> Iterator[bytes]:
        """Cast chunks; :attr:`error` is complete once they are all consumed."""
        for data, _ in self.chunks_with_crc():
            yield data

    def chunks_with_crc(self) -> Iterator[tuple[bytes, int]]:
        """Cast chunks and the CRC-32 of each. Pieces of :data:`_PIECE` bytes are cast and
        checksummed on every core (NumPy and zlib release the GIL), in order."""
        size = DTYPES[self.src].block_bytes
        step = _PIECE - _PIECE % size
        src = self.source
        if isinstance(src, FileRange):  # each thread reads its own pieces
            with reading(src.path) as fd:
                ranges = ((fd, pos, min(step, src.offset + src.nbytes - pos))
                          for pos in range(src.offset, src.offset + src.nbytes, step))
                yield from self._folded(ordered(self._read_cast, ranges))
            return

        def pieces() -> Iterator[memoryview]:
            for chunk in src.chunks():
                view = memoryview(chunk)
                for i in range(0, len(view), step):
                    yield view[i : i + step]

        yield from self._folded(ordered(self._cast_crc, pieces()))

    def _read_cast(self, piece: tuple[int, int, int]) -> _Piece:
        """:meth:`_cast_crc` of ``nbytes`` at ``offset`` of ``fd``, read into this thread's
        buffer."""
        fd, offset, nbytes = piece
        view = thread_buffer()[:nbytes]
        got = os.preadv(fd, [view], offset)
        if got < nbytes:
            src = self.source
            assert isinstance(src, FileRange)
            return self._cast_crc(_pread_exact(fd, nbytes, offset, src.path))
        return self._cast_crc(view)

    def _cast_crc(self, chunk: bytes | memoryview) -> _Piece:
        out, max_abs, max_rel, overflow = self._cast(chunk)
        return out, crc32(out), max_abs, max_rel, overflow

    def _folded(self, results: Iterator[_Piece]) -> Iterator[tuple[bytes, int]]:
        """The cast pieces and their CRCs, their errors folded into :attr:`error`."""
        for out, crc, max_abs, max_rel, overflow in results:
            err = self.error
            err.overflow += overflow
            if max_abs == max_abs:  # not NaN
                err.max_abs = max(err.max_abs, max_abs)
            if max_rel == max_rel:
                err.max_rel = max(err.max_rel, max_rel)
            yield out, crc

    def _cast(self, chunk: bytes | memoryview) -> tuple[bytes, float, float, int]:
        """One piece cast, with its largest absolute and relative error and its overflows
        (computed in float32, or float64 for float64 sources: wide enough to hold both sides
        exactly). Touches nothing shared: pieces are cast on several threads."""
        if self.compiled is not None:
            return self.compiled(chunk)
        np = self.np
        if self.src == "float32" and self.dst in ("bfloat16", "float16"):
            fast = _cast_float32(np, chunk, self.dst)
            if fast is not None:
                return fast
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            values = _to_float(np, chunk, self.src)
            out = _from_float(np, values, self.dst)
            wide = "<f8" if self.src == "float64" else "<f4"
            exact = values.astype(wide, copy=False)
            diff = np.subtract(exact, _to_float(np, out, self.dst), dtype=wide)
            np.abs(diff, out=diff)
            overflow = 0
            max_abs = float(diff.max()) if diff.size else 0.0
            if max_abs != max_abs or max_abs == float("inf"):
                # NaN/inf in the source, or values beyond the target's range.
                back = _to_float(np, out, self.dst)
                overflow = int(np.count_nonzero(np.isinf(back) & np.isfinite(exact)))
                diff[~np.isfinite(diff)] = np.nan
                max_abs = float(np.fmax.reduce(diff))
            # 0/0 is NaN and ignored by fmax; x/0 cannot occur (0 casts exactly).
            rel = np.abs(exact)
            np.divide(diff, rel, out=rel)
            max_rel = float(np.fmax.reduce(rel)) if rel.size else 0.0
        return bytes(out.data), max_abs, max_rel, overflow
