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
mirror creates them sparse, at their remote size, without fetching a byte of them. A walker
whose reader reads parts of such a file (a TF2 checkpoint's object graph in a data shard, the
archive headers of a DCP checkpoint's items, a TF1 ``.meta``) opens it through
``src.beside`` (:class:`modelsize.remote.Beside`): sparse too, with those parts fetched.
"""

from __future__ import annotations

import bisect
import contextlib
import pickletools
import struct
import zipfile
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, cast, overload

from modelsize.formats.base import SeekableBytes

if TYPE_CHECKING:
    from modelsize.remote import RangeSource

#: The first bytes asked of a file beside a checkpoint that is read from its start.
BLOCK = 16 * 1024
#: Ranges closer than this are fetched in one request (the gap costs less than a round trip).
MERGE_GAP = 64 * 1024
#: Ranges of many (the headers of a checkpoint's tensors, the ends of its items) closer than
#: this are fetched in one request: gaps of small tensors between them add up, and a small
#: gap costs less than a round trip.
NEAR = 4096
#: Bytes of gaps between the local headers of one zip fetched at most to save requests:
#: 1,168 headers of a 4.26 GB training checkpoint took 2.1 MB where every gap under
#: :data:`NEAR` was fetched.
ZIP_GAPS = 256 * 1024
#: Bytes of a header parsed from the block cache at a time.
WINDOW = 4 * 2**20
#: Concurrent requests for scattered ranges.
WORKERS = 8
#: Concurrent requests for a zip's local headers: many small ones (a 4.26 GB checkpoint of
#: 1,168 tensors takes 813 within :data:`ZIP_GAPS`: 10.2 s at 50 ms a request 8 at a time,
#: 5.6 s 16 at a time).
HEADER_WORKERS = 16

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


def merge_ranges(ranges: Iterable[tuple[int, int]], gap: int,
                 waste: int | None = None) -> list[list[int]]:
    """Sorted ``[start, stop)`` ranges as the requests that fetch them: overlapping ones
    joined, and those at most ``gap`` bytes apart. With ``waste``, the gaps fetched (bytes no
    reader asked for) add up to at most that many, the smallest joined first: a file's many
    small ranges (the headers of its tensors) cost few requests where small tensors lie
    between them, and bounded bytes where many do."""
    merged: list[list[int]] = []
    for start, stop in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], stop)
        else:
            merged.append([start, stop])
    if len(merged) < 2:
        return merged
    gaps = [(merged[i + 1][0] - merged[i][1], i) for i in range(len(merged) - 1)]
    join = [False] * len(merged)
    left = waste
    for size, i in sorted(g for g in gaps if g[0] <= gap):
        if left is not None:
            if size > left:
                break
            left -= size
        join[i] = True
    out = [merged[0]]
    for i in range(1, len(merged)):
        if join[i - 1]:
            out[-1][1] = merged[i][1]
        else:
            out.append(merged[i])
    return out


def fetch_ranges(src: RangeSource, ranges: Iterable[tuple[int, int]],
                 gap: int = MERGE_GAP) -> None:
    """Fetch byte ranges ``[start, stop)`` exactly (past the block cache: the sink keeps
    them): neighbours merged, a few requests at a time."""
    clipped = ((max(0, a), min(b, src.size)) for a, b in ranges)
    merged = merge_ranges(((a, b) for a, b in clipped if b > a and not src.cached(a, b)), gap)
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
    # The fields are parsed from a window of the bytes fetched so far (a vocabulary is
    # hundreds of thousands of strings: a ``read`` each took seconds); past its end, a read
    # fetches on (reading ahead as it does) and the window takes what the cache then holds.
    window, base = b"", 0
    packs = {f: struct.Struct(endian + f) for f in ("Q", "I")}

    def u(fmt: str) -> int:
        nonlocal pos, window, base
        pack = packs[fmt]
        n = pack.size
        at = pos - base
        if not (at >= 0 and at + n <= len(window)):
            if len(src.read(pos, pos + n)) < n:
                raise _Stop
            window, base, at = src.cached_from(pos, WINDOW), pos, 0
            if len(window) < n:  # (the cache let the bytes go at once: read them alone)
                window = src.read(pos, pos + n)
        pos += n
        return int(pack.unpack_from(window, at)[0])

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
    names of the ``.data-*`` shards its header counts. Through ``src.beside``: the object
    graph a TF2 checkpoint keeps in a data shard (the reader reads it for the categories),
    and the TF1 ``.meta`` beside it, if there is one (sized; its ``trainable_variables``
    collection walked when there is no object graph)."""
    from modelsize.formats._sstable import SSTableError, iter_table
    from modelsize.formats.tensorflow import OBJECT_GRAPH_KEY, decode_entry

    data = src.read(0, src.size)
    shards = 1
    graph = None
    try:
        for key, start, end in iter_table(data, verify=False):
            if key == b"":
                shards = _bundle_shards(data[start:end])
            elif key == OBJECT_GRAPH_KEY:
                graph = decode_entry(key, data, start, end)
    except (SSTableError, ValueError, IndexError):
        return []
    prefix = name[: -len(".index")]
    names = [f"{prefix}.data-{i:05d}-of-{shards:05d}" for i in range(min(shards, 10_000))]
    if src.beside is None:
        return names
    if graph is not None and 0 <= graph.shard < len(names) and graph.size <= _MAX_GRAPH:
        shard = src.beside(names[graph.shard])
        if shard is not None and graph.offset + graph.size <= shard.size:
            shard.fetch(graph.offset, graph.offset + graph.size)
    if graph is None:  # a name-based (TF1 Saver) checkpoint: its .meta, if it wrote one
        meta = src.beside(prefix + ".meta", optional=True, first=BLOCK)
        if meta is not None:
            walk_tf_meta(meta)
    return names


#: The largest object graph fetched (the reader reads one up to its proto limit).
_MAX_GRAPH = 256 * 2**20


def walk_tf_meta(src: RangeSource) -> None:
    """A TF1 ``MetaGraphDef`` (``.meta``): its ``trainable_variables`` collection, walked by
    the reader's own parser (the graph and the other fields are stepped over by length)."""
    from modelsize.formats._protobuf import ProtobufError
    from modelsize.formats.tensorflow import trainable_from_meta

    with contextlib.suppress(ProtobufError, UnicodeDecodeError, ValueError, IndexError):
        trainable_from_meta(RemoteBuffer(src))  # type: ignore[arg-type]


def _bundle_shards(header: bytes) -> int:
    """``num_shards`` (field 1) of a ``BundleHeaderProto``; 1 when absent."""
    from modelsize.formats._protobuf import VARINT, iter_fields

    for f in iter_fields(header, 0, len(header)):
        if f.number == 1 and f.wire_type == VARINT:
            return max(1, f.value)
    return 1


# -- torch.distributed.checkpoint: .metadata whole; each item's archive headers ------------------

#: Bytes guessed at each end of a DCP item (a ``torch.save`` archive: its pickle and small
#: members at the start, its central directory and end records at the end), fetched first.
DCP_END = 2048
#: Rounds of fetching what the items' archives turned out to need beyond the guesses.
_DCP_ROUNDS = 8


class Missing(Exception):
    """A read of bytes ``[start, stop)`` of a remote file that were not fetched."""

    def __init__(self, start: int, stop: int) -> None:
        super().__init__(f"bytes {start}-{stop - 1} not fetched")
        self.start, self.stop = start, stop


class Pieces(SeekableBytes):
    """A file of ``size`` bytes known by the pieces fetched of it: a read of bytes not
    fetched raises :class:`Missing` (the range to fetch), so a reader's own code, run over
    it, says what it needs."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self._starts: list[int] = []
        self._data: list[bytes] = []

    def add(self, start: int, data: bytes) -> None:
        """Keep ``data``, fetched at ``start`` (merged with the pieces it touches)."""
        stop = start + len(data)
        i = bisect.bisect_left(self._starts, start)
        if i and self._starts[i - 1] + len(self._data[i - 1]) >= start:
            i -= 1
        j = i
        while j < len(self._starts) and self._starts[j] <= stop:
            j += 1
        if i == j:
            self._starts.insert(i, start)
            self._data.insert(i, data)
            return
        lo = min(start, self._starts[i])
        hi = max(stop, self._starts[j - 1] + len(self._data[j - 1]))
        buf = bytearray(hi - lo)
        for at, piece in zip(self._starts[i:j], self._data[i:j], strict=True):
            buf[at - lo:at - lo + len(piece)] = piece
        buf[start - lo:stop - lo] = data
        self._starts[i:j] = [lo]
        self._data[i:j] = [bytes(buf)]

    def has(self, start: int, stop: int) -> bool:
        """Whether bytes ``[start, stop)`` were all fetched."""
        i = bisect.bisect_right(self._starts, start) - 1
        return i >= 0 and self._starts[i] + len(self._data[i]) >= stop

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), self.size - self.pos))
        if n == 0:
            return 0
        if not self.has(self.pos, self.pos + n):
            raise Missing(self.pos, self.pos + n)
        i = bisect.bisect_right(self._starts, self.pos) - 1
        at = self.pos - self._starts[i]
        buffer[:n] = self._data[i][at:at + n]
        self.pos += n
        return n


def walk_dcp(src: RangeSource) -> list[str]:
    """A ``.metadata`` of ``torch.distributed.checkpoint`` (read whole: the reader unpickles
    it whole) and, through ``src.beside``, what the reader reads of each item of the
    ``.distcp`` files it names: each item's archive's end records, central directory, local
    headers and pickle. Both ends of every item are fetched first (neighbouring items' ends
    in one request); the reader's own archive code, run over what was fetched, asks for the
    rest, in rounds. Returns the data files' names."""
    from modelsize.formats._pickle import PickleError
    from modelsize.formats.torch_dcp import MAX_METADATA, read_item_pickle, storage_items

    if src.size > MAX_METADATA:
        return []
    try:
        items = storage_items(src.read(0, src.size))
    except (PickleError, ValueError, TypeError, AttributeError):
        return []  # the reader reports it
    names = sorted({file for file, *_ in items})
    if src.beside is None:
        return names
    views: dict[str, tuple[RangeSource, Pieces]] = {}
    wanted: dict[str, list[tuple[int, int]]] = {}
    pending: list[tuple[str, int, int]] = []
    for file, start, length, transformed in items:
        if transformed or not length:
            continue  # the reader reads none of it
        if file not in views:
            sib = src.beside(file, first=BLOCK)
            if sib is None:
                continue  # on this disk, or the reader reports it missing
            views[file] = (sib, Pieces(sib.size))
            if sib.cached(0, min(BLOCK, sib.size)):  # its first bytes came with its size
                views[file][1].add(0, sib.read(0, min(BLOCK, sib.size)))
        if start + length > views[file][0].size:
            continue  # the reader reports it
        pending.append((file, start, length))
        head = min(length, DCP_END)
        wanted.setdefault(file, []).extend([(start, start + head),
                                            (start + length - head, start + length)])
    for _round in range(_DCP_ROUNDS):
        _fetch_into(views, wanted)
        wanted, still = {}, []
        for file, start, length in pending:
            try:
                read_item_pickle(cast("IO[bytes]", views[file][1]), start, length)
            except Missing as gap:
                wanted.setdefault(file, []).append((gap.start, gap.stop))
                still.append((file, start, length))
            except (zipfile.BadZipFile, ValueError, EOFError, struct.error,
                    NotImplementedError, OSError):
                continue  # a broken archive: the reader says what is wrong
        pending = still
        if not pending:
            break
    return names


def _fetch_into(views: dict[str, tuple[RangeSource, Pieces]],
                wanted: dict[str, list[tuple[int, int]]]) -> None:
    """Fetch the ``wanted`` ranges of each file (those :data:`NEAR` merged), a few requests at a
    time, into its :class:`Pieces` (the source's sink writes them to its mirror too)."""
    jobs: list[tuple[str, int, int]] = []
    for file, ranges in wanted.items():
        merged = merge_ranges((r for r in ranges if not views[file][1].has(*r)), NEAR)
        jobs.extend((file, a, b) for a, b in merged)

    def fetch(job: tuple[str, int, int]) -> tuple[str, int, bytes]:
        file, start, stop = job
        return file, start, views[file][0].fetch(start, stop)

    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        for file, start, data in pool.map(fetch, jobs):
            views[file][1].add(start, data)


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

