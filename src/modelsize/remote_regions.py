"""Which bytes of a remote file its reader needs, per format: walkers over a range source.

A walker reads a remote file's structure through a :class:`~modelsize.remote.RangeSource`
(whose block cache and read-ahead turn many small reads into a few requests) and touches
every byte the format's reader will read locally: the headers, tables and pickles, never the
tensor payloads. The source hands each fetched byte to the sparse mirror, where the ordinary
reader then reads it. Where a reader's own parser reads through an indexable buffer or a
blob (ONNX's protobuf walk, HDF5), the walker *is* that parser, run on the remote source; the
others (GGUF, pickles, TFLite's buffer table, the TensorFlow index) are short walks written
here from the format's layout.

Each walker returns the names of the files beside the remote one that the reader also opens
and only sizes (an ONNX model's external data, a TensorFlow checkpoint's data shards): the
mirror creates them sparse, at their remote size, without fetching a byte of them.
"""

from __future__ import annotations

import contextlib
import pickletools
import struct
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, overload

if TYPE_CHECKING:
    from modelsize.remote import RangeSource

#: Ranges closer than this are fetched in one request (the gap costs less than a round trip).
MERGE_GAP = 64 * 1024
#: Concurrent requests for scattered ranges.
WORKERS = 8

GGUF_MAGIC = b"GGUF"
HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"
LEGACY_TORCH_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"


class RemoteBuffer:
    """``len(b)``, ``b[i]``, ``b[a:b]`` over a range source (the interface of
    :class:`modelsize.formats._protobuf.FileBuffer`)."""

    def __init__(self, src: RangeSource) -> None:
        self.src = src

    def __len__(self) -> int:
        return self.src.size

    @overload
    def __getitem__(self, key: int) -> int: ...

    @overload
    def __getitem__(self, key: slice) -> bytes: ...

    def __getitem__(self, key: int | slice) -> int | bytes:
        if isinstance(key, slice):
            start, stop, _ = key.indices(self.src.size)
            return self.src.read(start, stop)
        if not 0 <= key < self.src.size:
            raise IndexError(f"byte {key} outside a file of {self.src.size}")
        return self.src.read(key, key + 1)[0]

    def find(self, sub: bytes, start: int = 0, stop: int | None = None) -> int:
        """``bytes.find`` over the remote bytes (read in blocks)."""
        stop = self.src.size if stop is None else min(stop, self.src.size)
        pos = start
        while pos < stop:
            chunk = self.src.read(pos, min(stop, pos + 65536 + len(sub)))
            at = chunk.find(sub)
            if at >= 0:
                return pos + at
            pos += 65536
        return -1


class RemoteBlob:
    """:class:`modelsize.formats._hdf5.Blob` over ``size`` bytes at ``base`` of a source."""

    def __init__(self, src: RangeSource, base: int = 0, size: int | None = None) -> None:
        self.src = src
        self.base = base
        self.size = src.size - base if size is None else size

    def read(self, offset: int, nbytes: int) -> bytes:
        """Exactly the bytes ``offset..offset+nbytes`` of the blob."""
        start = self.base + offset
        return self.src.read(start, start + nbytes)


def fetch_ranges(src: RangeSource, ranges: Iterable[tuple[int, int]],
                 gap: int = MERGE_GAP) -> None:
    """Fetch byte ranges ``[start, stop)`` exactly (past the block cache: the sink keeps
    them): neighbours merged, a few requests at a time."""
    merged: list[list[int]] = []
    for start, stop in sorted((max(0, a), min(b, src.size)) for a, b in ranges):
        if stop <= start or src.cached(start, stop):
            continue
        if merged and start <= merged[-1][1] + gap:
            merged[-1][1] = max(merged[-1][1], stop)
        else:
            merged.append([start, stop])
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        list(pool.map(lambda r: src.fetch(r[0], r[1]), merged))


# -- GGUF: the contiguous header, key/value pairs and tensor infos -----------------------------

_GGUF_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def walk_gguf(src: RangeSource) -> list[str]:
    """Read a GGUF header to the end of its tensor infos (the reader's every byte)."""
    head = src.read(0, 24)
    if len(head) < 24:
        return []
    endian = "<" if struct.unpack_from("<I", head, 4)[0] & 0xFFFF else ">"
    tensor_count, kv_count = struct.unpack_from(endian + "QQ", head, 8)
    pos = 24

    def u(fmt: str) -> int:
        nonlocal pos
        n = struct.calcsize(fmt)
        raw = src.read(pos, pos + n)
        if len(raw) < n:
            raise _Stop
        pos += n
        return int(struct.unpack(endian + fmt, raw)[0])

    def skip(vtype: int, depth: int) -> None:
        nonlocal pos
        if vtype in _GGUF_FIXED:
            pos += _GGUF_FIXED[vtype]
        elif vtype == _GGUF_STRING:
            n = u("Q")  # (``pos += u(...)`` would add to the position before the read)
            pos += n
        elif vtype == _GGUF_ARRAY and depth < 8:
            inner, count = u("I"), u("Q")
            if inner in _GGUF_FIXED:
                pos += count * _GGUF_FIXED[inner]
            elif count * 8 > src.size - pos:
                raise _Stop  # the reader refuses the count itself
            else:
                for _ in range(count):
                    skip(inner, depth + 1)
        else:
            raise _Stop
        if pos > src.size:
            raise _Stop

    try:
        if (kv_count + tensor_count) * 8 > src.size:
            raise _Stop
        for _ in range(kv_count):
            n = u("Q")  # key
            pos += n
            skip(u("I"), 0)
        for _ in range(tensor_count):
            n = u("Q")  # name
            pos += n
            dims = u("I")
            pos += 8 * dims + 4 + 8  # dims, type, offset
        pos += 64  # the padding before the data section
    except _Stop:
        pass
    # The reader reads every byte up to the data (the strings it skips here, the arrays of
    # numbers): the header whole, its runs of blocks not read yet in a request each.
    end = min(pos, src.size)
    for start in range(0, end, 64 * 2**20):
        src.read(start, min(end, start + 64 * 2**20))
    return []


class _Stop(Exception):
    """The walk cannot go on (a hostile or truncated file): the reader reports it."""


# -- pickles: opcodes walked, large byte payloads skipped ------------------------------------

_OPS = {op.code.encode("latin-1")[0]: op for op in pickletools.opcodes}
_SKIPPED = frozenset({"BINBYTES", "BINBYTES8", "BYTEARRAY8", "SHORT_BINBYTES"})


def walk_pickle(src: RangeSource, pos: int) -> int:
    """Walk one pickle from ``pos`` to after its ``STOP``; return that offset (``-1`` when
    the bytes stop being a pickle: the reader reports it). Payloads of the bytes opcodes
    (array data) are stepped over, never fetched."""
    size = src.size
    ops = 0
    while pos < size and ops < 50_000_000:
        ops += 1
        op = _OPS.get(src.read(pos, pos + 1)[0])
        if op is None:
            return -1
        pos += 1
        arg = op.arg
        if arg is None:
            pass
        elif arg.n >= 0:
            pos += arg.n
        elif arg.n == pickletools.UP_TO_NEWLINE:
            for _ in range(2 if op.name in ("GLOBAL", "INST") else 1):
                nl = RemoteBuffer(src).find(b"\n", pos, min(size, pos + (1 << 20)))
                if nl < 0:
                    return -1
                pos = nl + 1
        else:
            width = {pickletools.TAKEN_FROM_ARGUMENT1: 1, pickletools.TAKEN_FROM_ARGUMENT4: 4,
                     pickletools.TAKEN_FROM_ARGUMENT4U: 4,
                     pickletools.TAKEN_FROM_ARGUMENT8U: 8}[arg.n]
            raw = src.read(pos, pos + width)
            if len(raw) < width:
                return -1
            n = int.from_bytes(raw, "little", signed=arg.n == pickletools.TAKEN_FROM_ARGUMENT4)
            pos += width
            if op.name not in _SKIPPED:
                src.read(pos, pos + n)
            pos += n
        if op.name == "STOP":
            return pos
    return -1


def walk_pickles(src: RangeSource) -> list[str]:
    """A pickle file: its consecutive pickles (as the reader scans them)."""
    pos = 0
    while 0 <= pos < src.size:
        if pos and src.read(pos, pos + 1) not in (b"\x80", b"(", b"]", b"}", b"c"):
            break
        pos = walk_pickle(src, pos)
    return []


def walk_legacy_torch(src: RangeSource) -> list[str]:
    """A pre-zip ``torch.save`` file: its five pickles, then the 8-byte element count in
    front of each storage (placed from the storage sizes the object pickle declares)."""
    from modelsize.formats._pickle import PickleError, scan
    from modelsize.formats._torch_tree import StorageRef, storage_dtype

    ends = [0]
    for _ in range(5):
        end = walk_pickle(src, ends[-1])
        if end < 0:
            return []
        ends.append(end)
    prefix = src.read(0, ends[5])
    refs: dict[str, int] = {}

    def persistent(pid: object) -> object:
        if isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage":
            dtype = storage_dtype(pid[1])
            if dtype is not None and isinstance(pid[2], str) and type(pid[4]) is int:
                refs.setdefault(pid[2], StorageRef(pid[2], dtype, pid[4], "").nbytes)
        return pid

    try:
        scan(prefix, offset=ends[3], persistent_load=persistent)
        keys = scan(prefix, offset=ends[4]).value
    except PickleError:
        return []
    if not isinstance(keys, list):
        return []
    pos, heads = ends[5], []
    for key in keys:
        nbytes = refs.get(key) if isinstance(key, str) else None
        if nbytes is None:
            break
        heads.append((pos, pos + 8))
        pos += 8 + nbytes
    fetch_ranges(src, heads, gap=0)
    return []


# -- ONNX: the reader's own protobuf walk over the remote bytes -------------------------------

def walk_onnx(src: RangeSource, name: str) -> list[str]:
    """The model proto, walked by the ONNX reader's parser (initializers' payloads are
    stepped over by their lengths); the external data files it names, to be sized."""
    from modelsize.formats._protobuf import ProtobufError
    from modelsize.formats.onnx import _Parser

    try:
        model = _Parser(RemoteBuffer(src), Path(name)).parse()  # type: ignore[arg-type]
    except ProtobufError:
        return []
    return sorted({t.location for t in model.tensors if t.location})


# -- HDF5 (Keras .h5, and the weights inside a .keras) -----------------------------------------

def walk_hdf5(src: RangeSource, base: int = 0, size: int | None = None) -> None:
    """The HDF5 metadata (superblock, object headers, B-trees, heaps), walked by the Keras
    reader's own HDF5 parser over the remote bytes; dataset payloads are never read."""
    from modelsize.formats._hdf5 import HDF5Error, read_hdf5

    with contextlib.suppress(HDF5Error, ValueError, IndexError, struct.error):
        read_hdf5(RemoteBlob(src, base, size))  # a broken file: the reader reports it


# -- TensorFlow checkpoints: the .index SSTable; data shards by size -----------------------------

def walk_tf_index(src: RangeSource, name: str) -> list[str]:
    """A checkpoint's ``.index`` (read whole: a table of a few entries per variable) and the
    names of the ``.data-*`` shards its header counts."""
    from modelsize.formats._sstable import SSTableError, iter_table

    data = src.read(0, src.size)
    shards = 1
    try:
        for key, start, end in iter_table(data, verify=False):
            if key == b"":
                shards = _bundle_shards(data[start:end])
                break
    except (SSTableError, ValueError, IndexError):
        return []
    prefix = name[: -len(".index")]
    return [f"{prefix}.data-{i:05d}-of-{shards:05d}" for i in range(min(shards, 10_000))]


def _bundle_shards(header: bytes) -> int:
    """``num_shards`` (field 1) of a ``BundleHeaderProto``; 1 when absent."""
    from modelsize.formats._protobuf import VARINT, iter_fields

    for f in iter_fields(header, 0, len(header)):
        if f.number == 1 and f.wire_type == VARINT:
            return max(1, f.value)
    return 1


# -- TFLite: everything but the payloads of its buffers ------------------------------------------

def walk_tflite(src: RangeSource) -> list[str]:
    """A TFLite flatbuffer: the ``buffers`` vector is walked to find each buffer's payload;
    every byte outside those payloads (tables, strings, small vectors) is fetched, in a few
    merged requests."""
    size = src.size

    def u32(pos: int) -> int:
        return int(struct.unpack("<I", src.read(pos, pos + 4))[0])

    def i32(pos: int) -> int:
        return int(struct.unpack("<i", src.read(pos, pos + 4))[0])

    def field(table: int, index: int) -> int | None:
        vtable = table - i32(table)
        vsize = int(struct.unpack("<H", src.read(vtable, vtable + 2))[0])
        if 4 + 2 * index + 2 > vsize:
            return None
        off = int(struct.unpack("<H", src.read(vtable + 4 + 2 * index,
                                               vtable + 6 + 2 * index))[0])
        return table + off if off else None

    payloads: list[tuple[int, int]] = []
    try:
        root = u32(0)
        buffers_at = field(root, 4)
        if buffers_at is not None:
            vec = buffers_at + u32(buffers_at)
            count = u32(vec)
            if count * 4 > size:
                return []
            src.read(vec, vec + 4 + 4 * count)
            for k in range(count):
                slot = vec + 4 + 4 * k
                table = slot + u32(slot)
                at, n_at = field(table, 1), field(table, 2)
                if at is not None and n_at is not None:  # a payload past the flatbuffer
                    start = int(struct.unpack("<Q", src.read(at, at + 8))[0])
                    n = int(struct.unpack("<Q", src.read(n_at, n_at + 8))[0])
                    payloads.append((start, start + n))
                    continue
                data_at = field(table, 0)
                if data_at is None:
                    continue
                data = data_at + u32(data_at)
                n = u32(data)
                if n > 4096:
                    payloads.append((data + 4, data + 4 + n))
    except (struct.error, IndexError):
        return []
    gaps, pos = [], 0
    for start, stop in sorted(payloads):
        if start > pos:
            gaps.append((pos, start))
        pos = max(pos, stop)
    gaps.append((pos, size))
    fetch_ranges(src, gaps)
    return []

