"""The bytes of one tensor, as the Inventory places them, read a chunk at a time.

A :class:`TensorSource` yields a tensor's elements in C order, little-endian, in chunks of at
most :data:`CHUNK` bytes (a multiple of the element size), so a writer holds one chunk, never
the model. Where they come from:

* :class:`FileRange`: a contiguous run of file bytes (a storage, or a slice of one);
* :class:`Strided`: a non-contiguous view; the storage span is read a block at a time and the
  elements gathered (a column slice of a huge table reads its rows, not the table at once);
* :class:`Decoded`: a storage whose file bytes are encoded (deflated ``.npz`` members, ONNX
  varints, ASCII ``.t7``...): the format's reader decodes it (``storage_chunks``);
* :class:`Concat`: pieces from several files (ZeRO partitions, DCP chunks), in order.

:func:`tensor_source` picks the right one for a :class:`~modelsize.inventory.TensorRecord`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Protocol

from modelsize.dtypes import DTYPES
from modelsize.errors import CorruptFileError, UsageError, printable
from modelsize.inputs import reading
from modelsize.inventory import Inventory, StorageRecord, TensorRecord
from modelsize.slimming.checksum import crc32, crc_file_range

#: Bytes read or written at a time: large enough for full disk speed, small enough to bound RSS.
CHUNK = 8 << 20
#: Bytes copied at a time through Python: read, checksummed and written while in cache.
_IN_HAND = 256 << 10

#: What a reader that can decode encoded storages provides.
StorageDecoder = Callable[[Inventory, StorageRecord], Iterator[bytes]]


class TensorSource(Protocol):
    """A tensor's bytes in C order, little-endian, ``nbytes`` in all."""

    nbytes: int

    def chunks(self) -> Iterator[bytes | memoryview]:
        """The bytes, at most :data:`CHUNK` at a time, each a whole number of elements."""
        ...


def _pread_exact(fd: int, n: int, offset: int, path: Path) -> bytes:
    data = os.pread(fd, n, offset)
    while len(data) < n:
        more = os.pread(fd, n - len(data), offset + len(data))
        if not more:
            raise CorruptFileError(path, "slim", f"file ends before byte {offset + n}", offset)
        data += more
    return data


class FileRange:
    """``nbytes`` contiguous bytes at ``offset`` of ``path``."""

    __slots__ = ("itemsize", "nbytes", "offset", "path")

    def __init__(self, path: Path, offset: int, nbytes: int, itemsize: int = 1) -> None:
        self.path = path
        self.offset = offset
        self.nbytes = nbytes
        self.itemsize = max(itemsize, 1)

    @property
    def step(self) -> int:
        """Bytes read at a time: a whole number of elements, about :data:`CHUNK`."""
        return max(1, CHUNK // self.itemsize) * self.itemsize

    def copy_to(self, out_fd: int, advance: Callable[[int], None] | None = None) -> int:
        """Write the bytes at ``out_fd``'s current position and return their CRC-32, taken
        while they are in hand: each piece is read into a small reused buffer, checksummed
        while it is in the CPU's cache, and written from it (one read of the input, where
        ``copy_file_range`` and a separate checksum read it twice: a rewrite's offsets never
        let the filesystem share blocks anyway)."""
        view = memoryview(bytearray(_IN_HAND))
        preadv, write = os.preadv, os.write
        crc = 0
        with reading(self.path) as fd:
            pos, end = self.offset, self.offset + self.nbytes
            while pos < end:
                got = preadv(fd, [view[: min(_IN_HAND, end - pos)]], pos)
                if got <= 0:
                    raise CorruptFileError(self.path, "slim", f"file ends before byte {end}",
                                           pos)
                piece = view[:got]
                crc = crc32(piece, crc)
                done = 0
                while done < got:
                    done += write(out_fd, piece[done:])
                pos += got
                if advance is not None:
                    advance(got)
        return crc

    def crc(self) -> int:
        """CRC-32 of the bytes, read into reused buffers on every core (nothing handed out)."""
        with reading(self.path) as fd:
            return crc_file_range(fd, self.offset, self.nbytes, self.path)

    def chunks(self) -> Iterator[bytes]:
        """Read with ``pread``: no shared file position; an input file through the
        descriptor its :mod:`~modelsize.inputs` table holds."""
        if not self.nbytes:
            return
        with reading(self.path) as fd:
            pos, end = self.offset, self.offset + self.nbytes
            while pos < end:
                n = min(self.step, end - pos)
                yield _pread_exact(fd, n, pos, self.path)
                pos += n


def _gather(buf: bytes | bytearray, base: int, shape: Sequence[int], strides: Sequence[int],
            itemsize: int) -> bytes:
    """Elements of a strided view of ``buf`` (byte ``base`` is element 0), in C order."""
    try:
        import numpy as np
    except ImportError:
        return _gather_py(buf, base, shape, strides, itemsize)
    arr = np.frombuffer(buf, dtype=np.uint8)
    view = np.lib.stride_tricks.as_strided(
        arr[base:], shape=(*shape, itemsize), strides=(*(s * itemsize for s in strides), 1),
        writeable=False,
    )
    return np.ascontiguousarray(view).tobytes()


_FORMATS = {1: "B", 2: "H", 4: "I", 8: "Q"}


def _gather_py(buf: bytes | bytearray, base: int, shape: Sequence[int],
               strides: Sequence[int], itemsize: int) -> bytes:
    """:func:`_gather` without NumPy: the last dimension by slicing, the others by loops."""
    if not shape:
        return bytes(buf[base : base + itemsize])
    *outer, last = shape
    *outer_strides, last_stride = strides
    out = bytearray()
    fmt = _FORMATS.get(itemsize)
    mv = memoryview(buf)
    flat = mv[: len(buf) - len(buf) % itemsize].cast(fmt) if fmt else None  # type: ignore[call-overload]
    for index in _indices(outer):
        start = base + sum(i * s for i, s in zip(index, outer_strides, strict=True)) * itemsize
        if last_stride == 1:
            out += mv[start : start + last * itemsize]
        elif flat is not None and start % itemsize == 0 and last_stride > 0:
            first = start // itemsize
            out += flat[first : first + (last - 1) * last_stride + 1 : last_stride].tobytes()
        else:
            for j in range(last):
                at = start + j * last_stride * itemsize
                out += mv[at : at + itemsize]
    return bytes(out)


def _indices(shape: Sequence[int]) -> Iterator[tuple[int, ...]]:
    if not shape:
        yield ()
        return
    if any(d == 0 for d in shape):
        return
    index = [0] * len(shape)
    while True:
        yield tuple(index)
        for k in range(len(shape) - 1, -1, -1):
            index[k] += 1
            if index[k] < shape[k]:
                break
            index[k] = 0
        else:
            return


class Strided:
    """A non-contiguous view: ``shape``/``strides`` in elements from byte ``offset`` of a
    storage whose bytes come from ``read(start, stop)`` (storage-relative byte offsets).

    A dense view (a transpose: its span is little more than its bytes) is read in one piece
    and gathered in memory: bounded by the tensor's own size. A sparse one (a column slice of
    a big table) is cut along its leading dimension into blocks whose span is at most
    :data:`CHUNK`, or read row by row where rows are far apart, so the bytes read stay near the
    bytes wanted and memory stays at a chunk. Strides are never negative (torch and NumPy
    files hold none).
    """

    def __init__(self, read: Callable[[int, int], bytes], offset: int, shape: tuple[int, ...],
                 strides: tuple[int, ...], itemsize: int) -> None:
        self.read = read
        self.offset = offset
        self.shape = shape
        self.strides = strides
        self.itemsize = itemsize
        self.nbytes = math.prod(shape) * itemsize

    def chunks(self) -> Iterator[bytes]:
        """Gathered blocks, in C order."""
        if not self.nbytes:
            return
        yield from self._blocks(self.offset, self.shape, self.strides)

    def _span(self, shape: Sequence[int], strides: Sequence[int]) -> int:
        return (sum((d - 1) * s for d, s in zip(shape, strides, strict=True)) + 1) * self.itemsize

    def _read_gather(self, offset: int, shape: tuple[int, ...],
                     strides: tuple[int, ...]) -> bytes:
        data = self.read(offset, offset + self._span(shape, strides))
        return _gather(data, 0, shape, strides, self.itemsize)

    def _blocks(self, offset: int, shape: tuple[int, ...],
                strides: tuple[int, ...]) -> Iterator[bytes]:
        span = self._span(shape, strides)
        wanted = math.prod(shape) * self.itemsize
        if span <= CHUNK or span <= 2 * wanted + CHUNK:
            yield self._read_gather(offset, shape, strides)
            return
        row_shape, row_strides = shape[1:], strides[1:]
        row_span = self._span(row_shape, row_strides)
        step = strides[0] * self.itemsize
        if row_span > CHUNK:
            for i in range(shape[0]):
                yield from self._blocks(offset + i * step, row_shape, row_strides)
            return
        if step >= 1 << 16 and row_span * 4 <= step:
            # Rows far apart: read each on its own, a chunk's worth at a time.
            per = max(1, CHUNK // max(1, math.prod(row_shape) * self.itemsize))
            for start in range(0, shape[0], per):
                parts = [
                    self._read_gather(offset + i * step, row_shape, row_strides)
                    for i in range(start, min(shape[0], start + per))
                ]
                yield b"".join(parts)
            return
        per = max(1, (CHUNK - row_span) // max(1, step) + 1)
        for start in range(0, shape[0], per):
            n = min(per, shape[0] - start)
            yield self._read_gather(offset + start * step, (n, *row_shape), strides)


class Decoded:
    """``nbytes`` at byte ``offset`` of a storage decoded by its format's reader."""

    def __init__(self, stream: Callable[[], Iterator[bytes]], offset: int, nbytes: int,
                 itemsize: int = 1, path: Path | None = None) -> None:
        self.stream = stream
        self.offset = offset
        self.nbytes = nbytes
        self.itemsize = max(1, itemsize)
        self.path = path  # the file the storage is in, for the message when it is short

    def chunks(self) -> Iterator[bytes]:
        """Skip to ``offset``, then re-cut the decoder's pieces into whole elements."""
        if not self.nbytes:
            return
        skip, left = self.offset, self.nbytes
        carry = b""
        for piece in self.stream():
            if skip:
                if len(piece) <= skip:
                    skip -= len(piece)
                    continue
                piece, skip = piece[skip:], 0
            piece = carry + bytes(piece[:left]) if carry else bytes(piece[:left])
            left -= len(piece) - len(carry)
            cut = len(piece) - len(piece) % self.itemsize
            for pos in range(0, cut, CHUNK):
                yield piece[pos : min(cut, pos + CHUNK)]
            carry = piece[cut:]
            if left <= 0:
                break
        if carry or left > 0:
            raise CorruptFileError(self.path or Path("?"), "slim",
                                   f"decoded storage ended {left} bytes early")


class Concat:
    """Several sources one after the other."""

    def __init__(self, parts: Sequence[TensorSource]) -> None:
        self.parts = list(parts)
        self.nbytes = sum(p.nbytes for p in self.parts)

    def chunks(self) -> Iterator[bytes | memoryview]:
        """Each part's chunks in turn."""
        for p in self.parts:
            yield from p.chunks()


class Constant:
    """Bytes already in memory (tiny tensors a writer synthesises)."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.nbytes = len(data)

    def chunks(self) -> Iterator[bytes]:
        """The bytes, in :data:`CHUNK` pieces."""
        for pos in range(0, len(self.data), CHUNK):
            yield self.data[pos : pos + CHUNK]


def itemsize_of(dtype: str) -> int:
    """Bytes per element for reading (packed sub-byte and block types read as bytes)."""
    dt = DTYPES.get(dtype)
    if dt is None or dt.block != 1:
        return 1
    return dt.block_bytes


class NoDataError(ValueError):
    """The tensor holds no bytes in the file (a meta tensor, an object array)."""


def tensor_source(inv: Inventory, t: TensorRecord,
                  decoder: StorageDecoder | None = None,
                  storage: StorageRecord | None = None) -> TensorSource:
    """Where ``t``'s bytes are: the right :class:`TensorSource` for its storage and strides.

    ``decoder`` decodes encoded (``compressed``) storages: the reader's ``storage_chunks``;
    ``storage`` is ``t``'s storage record where the caller has it at hand.
    """
    if t.storage is None:
        raise NoDataError(f"{t.name} holds no data in the file")
    st = storage if storage is not None else _storages(inv)[t.storage]
    path = inv.files[st.file].path
    itemsize = itemsize_of(t.dtype)
    if t.strides is not None:
        _check_expansion(path, t, itemsize)
    if st.compressed:
        if decoder is None:
            raise UsageError(
                f"{printable(str(path))}: {printable(t.name)} is stored chunked or compressed "
                f"in a way modelsize cannot decode ({inv.format}); nothing was written")
        dec = decoder

        def stream() -> Iterator[bytes]:
            return dec(inv, st)

        if t.strides is None:
            return Decoded(stream, t.storage_offset, t.nbytes, itemsize, path)

        def read_decoded(start: int, stop: int) -> bytes:
            return b"".join(bytes(c) for c in Decoded(stream, start, stop - start).chunks())

        return Strided(read_decoded, t.storage_offset, t.shape, t.strides, itemsize)
    if t.strides is None:
        return FileRange(path, st.offset + t.storage_offset, t.nbytes, itemsize)
    base = st.offset

    def read(start: int, stop: int) -> bytes:
        with reading(path) as fd:
            return _pread_exact(fd, stop - start, base + start, path)

    return Strided(read, t.storage_offset, t.shape, t.strides, itemsize)


def _check_expansion(path: Path, t: TensorRecord, itemsize: int) -> None:
    """Refuse a view whose elements repeat its storage's bytes past the inflate limit (a zero
    stride: ``expand``): writing or verifying it streams every element, so a header could claim
    petabytes over a few bytes, like a deflate bomb."""
    from modelsize.formats._limits import INFLATE_BYTES, PLAUSIBLE_RATIO, inflate_allowance

    if not t.nbytes or not t.shape:
        return
    span = (sum((d - 1) * s for d, s in zip(t.shape, t.strides or (), strict=False)) + 1) \
        * itemsize
    if t.nbytes > inflate_allowance(span):
        raise INFLATE_BYTES.refuse(
            path, f"{printable(t.name)} is a view of {math.prod(t.shape):,} elements over {span:,} "
            f"bytes of storage (strides {list(t.strides or ())}): slim would expand it to "
            f"{t.nbytes:,} bytes to write or verify it; modelsize expands a view more than "
            f"{PLAUSIBLE_RATIO}:1 up to a limit")


class Sources:
    """The sources of an inventory's own tensors (:func:`tensor_source`), made when asked
    for: a plan of a million tensors holds this one object, not a source per tensor.

    :meth:`check` raises now what making the source would (a tensor with no data, a storage
    no decoder reads) without making it; :meth:`nbytes` is the source's size; :meth:`plain`
    says where a contiguous, unencoded tensor's bytes lie, for writers that copy many small
    tensors a window of the input at a time.
    """

    __slots__ = ("_by_key", "_compressed", "decoder", "inventory")

    def __init__(self, inventory: Inventory, decoder: StorageDecoder | None = None) -> None:
        self.inventory = inventory
        self.decoder = decoder
        self._by_key: dict[str, StorageRecord] | None = None
        self._compressed: frozenset[str] | None = None

    def storage_map(self) -> dict[str, StorageRecord]:
        """Storage key -> record (made on first use)."""
        by_key = self._by_key
        if by_key is None:
            by_key = self._by_key = {s.key: s for s in self.inventory.storages}
        return by_key

    def storage(self, key: str) -> StorageRecord:
        """The storage record called ``key``."""
        return self.storage_map()[key]

    def __eq__(self, other: object) -> bool:
        """The same sources: the same inventory's, decoded the same way."""
        if not isinstance(other, Sources):
            return NotImplemented
        return self.inventory is other.inventory and self.decoder == other.decoder

    def __hash__(self) -> int:
        return hash((id(self.inventory), self.decoder))

    def forget(self) -> None:
        """Drop the map of storages (made again if asked for)."""
        self._by_key = None

    def __call__(self, t: TensorRecord) -> TensorSource:
        if t.storage is None:
            raise NoDataError(f"{t.name} holds no data in the file")
        return tensor_source(self.inventory, t, self.decoder, self.storage(t.storage))

    def check(self, t: TensorRecord) -> None:
        """Raise what :meth:`__call__` would raise for ``t`` (``NoDataError``, the
        ``UsageError`` of an encoded storage without a decoder, the refusal of a view expanded
        past the inflate limit), making nothing."""
        if t.storage is None:
            raise NoDataError(f"{t.name} holds no data in the file")
        if t.strides is not None:
            st = self.storage(t.storage)
            _check_expansion(self.inventory.files[st.file].path, t, itemsize_of(t.dtype))
        if self.decoder is None:
            compressed = self._compressed
            if compressed is None:
                compressed = self._compressed = frozenset(
                    s.key for s in self.inventory.storages if s.compressed)
            if compressed and t.storage in compressed:
                self(t)

    def nbytes(self, t: TensorRecord) -> int:
        """Bytes of ``t``'s source (what :meth:`__call__` would make holds)."""
        if t.strides is None:
            return t.nbytes
        return math.prod(t.shape) * itemsize_of(t.dtype)

    def plain(self, t: TensorRecord) -> tuple[int, int] | None:
        """``(file index, byte offset)`` of a tensor whose bytes lie contiguous and as they
        are in a file (a :class:`FileRange`), else ``None``."""
        if t.storage is None or t.strides is not None:
            return None
        st = self.storage(t.storage)
        if st.compressed:
            return None
        return st.file, st.offset + t.storage_offset


_CACHE: dict[int, tuple[Inventory, dict[str, StorageRecord]]] = {}


def _storages(inv: Inventory) -> dict[str, StorageRecord]:
    hit = _CACHE.get(id(inv))
    if hit is None or hit[0] is not inv:
        if len(_CACHE) > 8:
            _CACHE.clear()
        hit = _CACHE[id(inv)] = (inv, {s.key: s for s in inv.storages})
    return hit[1]
