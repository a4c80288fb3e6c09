"""CRC-32C (Castagnoli), the checksum of TensorFlow's bundles, fast enough for large checkpoints.

``zlib.crc32`` uses another polynomial, and a table-driven loop in Python runs at about
10 MB/s. In order of preference :func:`crc32c` uses:

1. an installed ``google_crc32c`` or ``crc32c`` module (hardware instructions, GB/s);
2. NumPy: the buffer is cut into many lanes of equal length whose CRC registers advance
   together, four bytes per step, through two 64 Ki-entry tables (slicing by four, sixteen
   bits at a time); the lanes' registers are then folded pairwise, ``crc(A + B) =
   shift(crc(A), len(B)) ^ crc(B)``, with ``shift`` a 32x32 matrix over GF(2) (advancing a
   register over ``len(B)`` zero bytes) applied through four byte tables;
3. the table loop of :mod:`modelsize.formats._sstable`, for small buffers or without NumPy.

Registers are handled raw (no final inversion) inside; :func:`crc32c` takes and returns the
standard value (initial and final XOR with ``0xFFFFFFFF``), so ``crc32c(b, crc32c(a)) ==
crc32c(a + b)``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from modelsize.formats._sstable import crc32c as _crc32c_py

__all__ = ["backend", "crc32c", "mask"]

_POLY = 0x82F63B78
_MASK_DELTA = 0xA282EAD8
#: Below this many bytes the Python loop beats NumPy's fixed costs.
_SMALL = 4096
#: Most lanes advanced together (a power of two); each lane takes at least ``_MIN_STEPS`` words.
_MAX_LANES = 1 << 16
_MIN_STEPS = 16

Buffer = bytes | bytearray | memoryview


def mask(crc: int) -> int:
    """The masked CRC TensorFlow stores (rotated right by 15 bits, plus a constant)."""
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def _native() -> tuple[str, Callable[[Buffer, int], int]] | None:
    """A compiled CRC-32C, when one is installed."""
    try:
        import google_crc32c  # type: ignore[import-not-found]

        if getattr(google_crc32c, "implementation", "c") == "c":
            return "google_crc32c", lambda data, crc: int(google_crc32c.extend(crc, bytes(data)))
    except ImportError:
        pass
    try:
        import crc32c as _mod  # type: ignore[import-not-found]

        return "crc32c", lambda data, crc: int(_mod.crc32c(data, crc))
    except (ImportError, TypeError):
        return None


@functools.cache
def _backend() -> tuple[str, Callable[[Buffer, int], int] | None]:
    native = _native()
    if native is not None:
        return native
    try:
        import numpy  # noqa: F401  (only its presence is checked here)
    except ImportError:
        return "python", None
    return "numpy", None


def backend() -> str:
    """Which implementation large buffers go through: ``google_crc32c``, ``crc32c``, ``numpy``
    or ``python``."""
    return _backend()[0]


def crc32c(data: Buffer, crc: int = 0) -> int:
    """CRC-32C of ``data``, continuing from ``crc`` (the CRC of what came before)."""
    name, native = _backend()
    if native is not None:
        return native(data, crc)
    if name == "numpy" and len(data) >= _SMALL:
        return _crc32c_numpy(memoryview(data).cast("B"), crc)
    return _crc32c_py(data, crc)


# -- the NumPy implementation ---------------------------------------------------------------

def _byte_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ _POLY if c & 1 else c >> 1
        table.append(c)
    return table


def _apply(matrix: tuple[int, ...], vector: int) -> int:
    out = 0
    bit = 0
    while vector:
        if vector & 1:
            out ^= matrix[bit]
        vector >>= 1
        bit += 1
    return out


@functools.cache
def _shift_matrix(nbytes: int) -> tuple[int, ...]:
    """Columns of the GF(2) matrix advancing a raw register over ``nbytes`` zero bytes."""
    if nbytes == 1:
        t0 = _byte_table()
        # One zero byte: r -> t0[r & 0xFF] ^ (r >> 8); column k is the image of bit k.
        return tuple(t0[(1 << k) & 0xFF] ^ ((1 << k) >> 8) for k in range(32))
    half = _shift_matrix(nbytes // 2)
    square = tuple(_apply(half, column) for column in half)
    if nbytes % 2 == 0:
        return square
    one = _shift_matrix(1)
    return tuple(_apply(one, column) for column in square)


@functools.cache
def _tables(nbytes: int, bits: int) -> Any:
    """``(32 // bits, 2 ** bits)`` tables of the shift over ``nbytes``: ``shift(r)`` is the
    XOR of ``T[k][(r >> bits * k) & (2 ** bits - 1)]`` over ``k``."""
    import numpy as np

    columns = np.array(_shift_matrix(nbytes), dtype=np.uint32)
    values = np.arange(1 << bits)
    out = np.zeros((32 // bits, 1 << bits), dtype=np.uint32)
    for part in range(32 // bits):
        for bit in range(bits):
            out[part][(values >> bit) & 1 == 1] ^= columns[bits * part + bit]
    return out


def _shift(reg: Any, nbytes: int) -> Any:
    """Registers ``reg`` (a uint32 array) advanced over ``nbytes`` zero bytes."""
    t = _tables(nbytes, 8)
    return t[0][reg & 0xFF] ^ t[1][(reg >> 8) & 0xFF] ^ t[2][(reg >> 16) & 0xFF] ^ t[3][reg >> 24]


def _crc32c_numpy(data: memoryview, crc: int) -> int:
    """Words are dealt to ``lanes`` registers in turn (row ``j`` of the ``(steps, lanes)`` view
    holds word ``j * lanes + i`` of lane ``i``): between two of its words a lane's register
    advances over one word and ``lanes - 1`` words of zeros, one linear map, applied by
    16-bit tables. After the last row the lanes are the words of a short message whose CRC
    is the CRC of the whole, folded pairwise."""
    import numpy as np

    words = len(data) // 4
    lanes = _MAX_LANES
    while lanes > 1 and words // lanes < _MIN_STEPS:
        lanes //= 2
    if lanes < 64:
        return _crc32c_py(data, crc)
    steps = words // lanes
    main = lanes * steps * 4
    rows = np.frombuffer(data[:main], dtype="<u4").reshape(steps, lanes)
    low, high = _tables(4 * lanes, 16)
    reg = np.zeros(lanes, dtype=np.uint32)
    reg[0] = crc ^ 0xFFFFFFFF  # the running register enters with the first word
    lo = np.empty(lanes, dtype=np.intp)
    hi = np.empty(lanes, dtype=np.intp)
    a = np.empty(lanes, dtype=np.uint32)
    for j in range(steps - 1):
        np.bitwise_xor(reg, rows[j], out=reg)
        np.bitwise_and(reg, 0xFFFF, out=lo, casting="unsafe")
        np.right_shift(reg, 16, out=hi, casting="unsafe")
        np.take(low, lo, out=a, mode="wrap")  # "wrap": in range anyway, and no bounds check
        np.take(high, hi, out=reg, mode="wrap")
        np.bitwise_xor(reg, a, out=reg)
    np.bitwise_xor(reg, rows[steps - 1], out=reg)
    span = 4
    while len(reg) > 1:
        reg = _shift(reg[0::2], span) ^ reg[1::2]
        span *= 2
    value = int(_shift(reg, 4)[0]) ^ 0xFFFFFFFF
    return crc32c(data[main:], value) if main < len(data) else value
