"""Lua Torch ``.t7`` output: the input's object stream, thinned as ``clearState()`` would.

Written without Lua or torch. The input's objects are re-emitted in order, with their classes,
versions, tables, fields and object indices (so every shared table, module and tensor stays
shared), except that:

* a dropped tensor (``output``, ``gradInput``, ``gradWeight``...) becomes an empty tensor of
  the same class, as ``self.output = self.output.new()`` leaves it: no dimensions, no storage.
  Lua code still finds the field; a tensor that was already empty and storage-less is kept
  as it was;
* a kept tensor keeps its sizes and strides and views its storage again. A storage is written
  once, at its first use in the output, and holds only the element runs the kept views reach
  (overlapping runs merged; the views' offsets moved accordingly), so bytes only dropped
  tensors used are not written and storages shared by kept tensors stay shared;
* a deduplicated copy (``--dedupe``) views its original's storage;
* a directly held storage that is dropped becomes an empty storage of its class;
* ``--cast`` changes the class of what it narrows (``torch.DoubleTensor`` ->
  ``torch.FloatTensor``, ``torch.CudaTensor`` -> ``torch.CudaHalfTensor``...).

The output is binary with 8-byte longs (what Linux and macOS Torch and ``torchfile`` read),
whatever the input: an ascii file or one written with 4-byte longs is written that way, its
numbers converted exactly (doubles round-trip through their 17 digits).

Storage bytes are streamed from the input a chunk at a time through
:func:`~modelsize.slimming.writers.base.stream`: a run a kept contiguous tensor covers exactly
is streamed as that tensor (its CRC is the one verification checks); other runs as a slice
of the storage; a kept tensor none of whose bytes were streamed as itself (a strided or
overlapping view) is streamed once more for its CRC alone. The exact output size is known
before writing: the object stream is walked once to count it (``--dry-run`` prints it).

Refused with a :class:`~modelsize.errors.UsageError`: inputs holding Lua functions (their
bytecode runs when the file is loaded; ``--to safetensors`` keeps the tensors without it),
``bfloat16`` (Lua Torch has no such tensor) and views with negative strides (``THTensor``
never makes them; such a file was not written by Torch).
"""

from __future__ import annotations

import bisect
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from modelsize import inputs
from modelsize.categories import Category
from modelsize.dtypes import DTYPES, numel
from modelsize.errors import CorruptFileError, UsageError, printable
from modelsize.formats import t7
from modelsize.inventory import InventoryBuilder, TensorRecord
from modelsize.slimming.output import Output
from modelsize.slimming.plan import Plan, PlannedTensor
from modelsize.slimming.source import CHUNK, tensor_source
from modelsize.slimming.writers.base import Meter, Written, slim_name, stream

#: canonical dtype -> the element type of CPU classes (``torch.<X>Tensor``).
CPU_TYPES: dict[str, str] = {
    "uint8": "Byte", "int8": "Char", "int16": "Short", "int32": "Int", "int64": "Long",
    "float32": "Float", "float64": "Double", "float16": "Half",
}
#: canonical dtype -> the element type of CUDA classes (``torch.Cuda<X>Tensor``).
CUDA_TYPES: dict[str, str] = {d: "Cuda" + ("" if d == "float32" else x)
                              for d, x in CPU_TYPES.items()}

_INT = struct.Struct("<i")
_LONG = struct.Struct("<q")
_DOUBLE = struct.Struct("<d")
#: Longest class name or version string read (longer ones are refused, never read whole).
_NAME_LIMIT = 4096


def class_for(class_name: str, dtype: str) -> str:
    """``torch.<X>Tensor``/``Storage`` of the same kind (CPU or CUDA) holding ``dtype``."""
    kind = "Storage" if class_name.endswith("Storage") else "Tensor"
    elem = class_name[len("torch."):-len(kind)]
    table = CUDA_TYPES if elem.startswith("Cuda") else CPU_TYPES
    if dtype not in table:
        raise UsageError(f"Lua Torch has no {dtype} tensors; use --to safetensors")
    return f"torch.{table[dtype]}{kind}"


@dataclass
class _View:
    """A kept tensor (or directly held storage) of the output and the elements it reaches."""

    tensor: PlannedTensor
    storage: int  # object index of the storage it views in the output
    start: int  # first element of that storage it reaches
    stop: int  # one past the last (== start: it reaches nothing)
    class_name: str = ""

    @property
    def tile(self) -> bool:
        """Whether its bytes, streamed as itself, are a run of its storage."""
        t = self.tensor
        return t.alias_of is None and t.record.strides is None and self.stop > self.start


@dataclass
class _Run:
    """Bytes of a storage streamed as one planned tensor: a kept view, or a slice."""

    tensor: PlannedTensor
    own: bool  # a kept tensor of the plan (its CRC is recorded), not a slice


@dataclass
class _Layout:
    """One storage of the output: the input storage's runs it keeps, and their new places."""

    index: int
    class_name: str
    version: str | None
    dtype: str
    pieces: list[tuple[int, int, int]] = field(default_factory=list)  # (start, stop, new start)
    runs: list[_Run] = field(default_factory=list)
    size: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes of its elements in the output."""
        return DTYPES[self.dtype].nbytes(self.size)

    def moved(self, start: int) -> int:
        """The output offset of input element ``start`` (the first of a kept view)."""
        i = bisect.bisect_right(self.pieces, (start, math.inf)) - 1
        if i >= 0 and start < self.pieces[i][1]:
            a, _, new = self.pieces[i]
            return new + start - a
        return 0  # a view that reaches nothing


@dataclass
class _StorageClass:
    """An input storage as the emitter needs it: its class and version."""

    class_name: str
    version: str | None


class _Sink:
    """Where the emitted stream goes; this one only counts bytes (the exact output size)."""

    def __init__(self) -> None:
        self.nbytes = 0

    def raw(self, data: bytes) -> None:
        self.nbytes += len(data)

    def int_(self, value: int) -> None:
        self.raw(_INT.pack(value))

    def long_(self, value: int) -> None:
        self.raw(_LONG.pack(value))

    def double(self, value: float) -> None:
        self.raw(_DOUBLE.pack(value))

    def string(self, data: bytes) -> None:
        self.int_(len(data))
        self.raw(data)

    def copy(self, cur: t7.Cursor, start: int, stop: int) -> None:
        """Input bytes ``start..stop`` (a long string), a chunk at a time."""
        self.nbytes += stop - start

    def data(self, layout: _Layout) -> None:
        """The elements of one output storage."""
        self.nbytes += layout.nbytes


class _FileSink(_Sink):
    """Writes the stream to the output file, buffered; storage data through :func:`stream`."""

    def __init__(self, fh: BinaryIO, meter: Meter, written: dict[str, Written]) -> None:
        super().__init__()
        self.fh = fh
        self.meter = meter
        self.written = written
        self.buf = bytearray()

    def raw(self, data: bytes | memoryview) -> None:
        self.nbytes += len(data)
        self.buf += data
        if len(self.buf) >= 1 << 20:
            self.flush()

    def flush(self) -> None:
        self.fh.write(self.buf)
        self.buf.clear()

    def copy(self, cur: t7.Cursor, start: int, stop: int) -> None:
        for pos in range(start, stop, CHUNK):
            self.raw(bytes(cur.buf[pos : min(stop, pos + CHUNK)]))

    def data(self, layout: _Layout) -> None:
        self.flush()
        n = 0
        for run in layout.runs:
            s = stream(run.tensor, self.meter if run.own else None)
            for chunk in s.chunks():
                self.fh.write(chunk)
                n += len(chunk)
            if run.own:
                self.written[run.tensor.name] = s.written
        if n != layout.nbytes:
            raise ValueError(f"storage {layout.index}: wrote {n} bytes, planned {layout.nbytes}")
        self.nbytes += n


class _Emitter:
    """Walks the input's object stream once and emits the output's (explicit stack, no
    recursion), mirroring :class:`modelsize.formats.t7` object by object."""

    def __init__(self, job: T7Job, cur: t7.Cursor, sink: _Sink) -> None:
        self.job = job
        self.cur = cur
        self.out = sink
        self.seen: set[int] = set()  # object indices met in the input
        self.emitted: set[int] = set()  # storages written in the output

    def run(self) -> None:
        left = [1]
        while left:
            if not left[-1]:
                left.pop()
                continue
            left[-1] -= 1
            children = self.object()
            if children:
                if len(left) >= t7.MAX_DEPTH:
                    raise self.corrupt(f"objects nested deeper than {t7.MAX_DEPTH}")
                left.append(children)
        if self.cur.pos != self.cur.size:
            raise self.corrupt("bytes follow the serialized object")

    def corrupt(self, reason: str) -> CorruptFileError:
        return self.cur.builder.corrupt(f"{reason} (did the file change while slimming?)",
                                        self.cur.pos)

    def object(self) -> int:
        """Emit one object's head; return how many child objects follow it."""
        cur, out = self.cur, self.out
        tag = cur.int_("object type")
        if tag == t7.TYPE_NIL:
            out.int_(tag)
        elif tag == t7.TYPE_NUMBER:
            out.int_(tag)
            out.double(cur.double("number"))
        elif tag == t7.TYPE_BOOLEAN:
            out.int_(tag)
            out.int_(cur.int_("boolean"))
        elif tag == t7.TYPE_STRING:
            out.int_(tag)
            self.string()
        elif tag in (t7.TYPE_TABLE, t7.TYPE_TORCH):
            index = cur.int_("object index")
            if index in self.seen:
                if index in self.job.storages:
                    self.storage(index)
                else:
                    out.int_(tag)
                    out.int_(index)
                return 0
            self.seen.add(index)
            if tag == t7.TYPE_TABLE:
                size = cur.int_("table size")
                out.int_(tag)
                out.int_(index)
                out.int_(size)
                return 2 * size
            return self.torch_object(index)
        elif tag in (t7.TYPE_FUNCTION, t7.TYPE_RECUR_FUNCTION, t7.LEGACY_TYPE_RECUR_FUNCTION):
            raise UsageError(f"{printable(str(self.job.path))}: holds a Lua function; slim "
                             "does not copy Lua bytecode (use --to safetensors)")
        else:
            raise self.corrupt(f"unknown object type {tag}")
        return 0

    def string(self) -> None:
        n = self.cur.int_("string length")
        start, stop = self.cur.chars(n, "string")
        self.out.int_(n)
        self.out.copy(self.cur, start, stop)

    def name(self) -> bytes:
        n = self.cur.int_("class name length")
        if not 0 <= n <= _NAME_LIMIT:
            raise UsageError(f"{printable(str(self.job.path))}: a class name of {n} bytes; "
                             "slim cannot rewrite this file (use --to safetensors)")
        start, stop = self.cur.chars(n, "class name")
        return bytes(self.cur.buf[start:stop])

    def torch_object(self, index: int) -> int:
        out = self.out
        version: bytes | None = self.name()
        class_name = version or b""
        if class_name.startswith(b"V "):
            class_name = self.name()
        else:
            version = None
        cls = class_name.decode("utf-8", "replace")
        kind = t7.element_class(cls)
        if kind is not None:
            dtype = kind[0]
            if kind[1] == "Storage":
                self.skip_storage(dtype)
                self.storage(index)
            else:
                self.tensor(index, version, class_name, dtype)
            return 0
        out.int_(t7.TYPE_TORCH)
        out.int_(index)
        if version is not None:
            out.string(version)
        out.string(class_name)
        if cls in ("tds.Vec", "tds.Hash"):
            size = self.cur.int_("tds size")
            out.int_(size)
            return 1 + size * (2 if cls == "tds.Hash" else 1)
        return 1

    def skip_storage(self, dtype: str) -> None:
        at = self.cur.pos
        size = self.cur.long_("storage size")
        t7.skip_elements(self.cur, dtype, size, at)

    def storage(self, index: int) -> None:
        """A storage where the output meets it: a reference once written, else the object."""
        out = self.out
        out.int_(t7.TYPE_TORCH)
        out.int_(index)
        if index in self.emitted:
            return
        self.emitted.add(index)
        layout = self.job.layouts.get(index)
        info = self.job.storages[index]
        version, class_name = (info.version, info.class_name) if layout is None else (
            layout.version, layout.class_name)
        if version is not None:
            out.string(version.encode())
        out.string(class_name.encode())
        if layout is None:  # dropped: an empty storage of its class
            out.long_(0)
            return
        out.long_(layout.size)
        out.data(layout)

    def tensor(self, index: int, version: bytes | None, class_name: bytes, dtype: str) -> None:
        cur, out = self.cur, self.out
        ndim = cur.int_("tensor dimension count")
        if not 0 <= ndim <= t7.MAX_DIMS:
            raise self.corrupt(f"tensor declares {ndim} dimensions")
        sizes = cur.longs(ndim, "tensor sizes")
        strides = cur.longs(ndim, "tensor strides")
        offset = cur.long_("tensor storage offset")
        tag = cur.int_("object type")
        storage: int | None = None
        if tag == t7.TYPE_TORCH:
            storage = cur.int_("object index")
            if storage not in self.seen:
                self.seen.add(storage)
                self.name_pair()
                self.skip_storage(dtype)
        elif tag != t7.TYPE_NIL:
            raise self.corrupt("a tensor's storage is neither nil nor a storage")
        view = self.job.tensors.get(index)
        out.int_(t7.TYPE_TORCH)
        out.int_(index)
        if version is not None:
            out.string(version)
        out.string(view.class_name.encode() if view is not None else class_name)
        if view is None and (storage is not None or numel(sizes)):
            out.int_(0)  # dropped: tensor.new(), no dimensions, no storage
            out.long_(1)
            out.int_(t7.TYPE_NIL)
            return
        out.int_(ndim)
        for v in (*sizes, *strides):
            out.long_(v)
        if view is None:  # already empty, without storage: as it was
            out.long_(offset)
            out.int_(t7.TYPE_NIL)
            return
        out.long_(self.job.layouts[view.storage].moved(view.start) + 1)
        self.storage(view.storage)

    def name_pair(self) -> None:
        """Pass a storage's version string and class name (already known from the parse)."""
        version = self.name()
        if version.startswith(b"V "):
            self.name()


@dataclass
class T7Job:
    """One ``.t7`` file: the input walked again, thinned, as laid out by :class:`T7Writer`."""

    files: list[str]
    main: str
    directory: bool
    predicted_bytes: int | None
    path: Path
    long_size: int
    ascii: bool
    tensors: dict[int, _View]
    layouts: dict[int, _Layout]
    storages: dict[int, _StorageClass]
    extra: list[PlannedTensor]  # kept tensors streamed for their CRC only

    def walk(self, sink: _Sink) -> None:
        """Emit the output's object stream into ``sink``."""
        builder = InventoryBuilder("t7", [self.path])
        with inputs.open_input(self.path) as fh, t7.open_cursor(
                fh.fileno(), builder, self.long_size, self.ascii) as cur:
            _Emitter(self, cur, sink).run()

    def write(self, out: Output, meter: Meter) -> dict[str, Written]:
        """The stream, then the CRC of the kept views no run streamed as themselves."""
        written: dict[str, Written] = {}
        sink = _FileSink(out.open(self.main), meter, written)
        self.walk(sink)
        sink.flush()
        if self.predicted_bytes is not None and sink.nbytes != self.predicted_bytes:
            raise ValueError(f"wrote {sink.nbytes} bytes, planned {self.predicted_bytes}")
        for t in self.extra:
            s = stream(t, meter)
            for _ in s.chunks():
                pass
            written[t.name] = s.written
        return written

    def output_name(self, name: str) -> str:
        """The output has the input's paths, so its tensors the input's names."""
        return name


class T7Writer:
    """``.t7`` (Lua Torch ``torch.save``), thinned in place of ``clearState()``."""

    name = "t7"

    def default_target(self, plan: Plan, source: Path) -> Path:
        """``x.slim.t7``."""
        return slim_name(source)

    def prepare(self, plan: Plan, target: Path) -> T7Job:
        """Decide every kept view's storage run and every storage's layout, then count."""
        inv = plan.inventory
        path = inv.files[0].path
        if inv.format != "t7":
            raise UsageError(f"the t7 writer needs a .t7 input, not {inv.format}")
        if inv.unsafe_globals:
            raise UsageError(
                f"{printable(str(path))}: holds Lua functions, whose bytecode runs when the file "
                "is loaded; slim does not copy them: use --to safetensors for the tensors"
            )
        narrowed = sorted({t.dtype for t in plan.tensors} - set(CPU_TYPES))
        if narrowed:
            hint = "--cast float16, or --to safetensors" if narrowed == ["bfloat16"] else (
                "--to safetensors")
            raise UsageError(f"{printable(str(path))}: Lua Torch has no "
                             f"{', '.join(narrowed)} tensors; use {hint}")
        parsed, _ = t7.parse(path)
        objects = parsed.objects
        found: list[t7.TensorObject | t7.DirectStorage] = [*objects.tensors, *objects.direct]
        if [o.name for o in found] != [t.name for t in inv.tensors]:
            raise CorruptFileError(path, "t7", "the file changed since it was read")
        position = {id(r): i for i, r in enumerate(inv.tensors)}
        planned = {t.name: t for t in plan.tensors}

        def located(t: PlannedTensor) -> t7.TensorObject | t7.DirectStorage:
            i = position.get(id(t.record))
            if i is None:
                raise UsageError(f"{printable(t.name)}: not a tensor of {printable(str(path))}")
            return found[i]

        views: dict[int, list[_View]] = {}
        tensors: dict[int, _View] = {}
        for t in plan.tensors:
            obj = located(t)
            holder = located(planned[t.alias_of]) if t.alias_of is not None else obj
            st = holder.storage
            if st is None:
                raise UsageError(f"{printable(t.name)} holds no data to keep")
            view = _view(t, obj, st.index)
            views.setdefault(st.index, []).append(view)
            if isinstance(obj, t7.TensorObject):
                tensors[obj.index] = view
        storages = {i: _StorageClass(o.class_name, o.version) for i, o in objects.by_index.items()
                    if isinstance(o, t7.StorageObject)}
        layouts: dict[int, _Layout] = {}
        tiled: set[int] = set()
        for index, kept in views.items():
            st_obj = objects.by_index[index]
            assert isinstance(st_obj, t7.StorageObject)
            key = f"storage#{index}"
            layouts[index] = _layout(plan, st_obj, key, kept, tiled)
        extra = [v.tensor for vs in views.values() for v in vs
                 if v.tensor.alias_of is None and id(v) not in tiled]
        if any("Half" in layout.class_name for layout in layouts.values()):
            plan.notes.append("the output holds HalfTensors: Lua Torch loads them, the "
                              "torchfile package cannot")
        if parsed.ascii:
            plan.notes.append("the ascii input is written as a binary .t7 (8-byte longs)")
        elif parsed.long_size != 8:
            plan.notes.append("written with 8-byte longs (the input had 4-byte longs)")
        job = T7Job([target.name], target.name, False, None, path, parsed.long_size,
                    parsed.ascii, tensors, layouts, storages, extra)
        counter = _Sink()
        job.walk(counter)
        job.predicted_bytes = counter.nbytes
        return job


def _view(t: PlannedTensor, obj: t7.TensorObject | t7.DirectStorage, storage: int) -> _View:
    """The elements of its storage a kept tensor reaches."""
    if isinstance(obj, t7.DirectStorage):
        cls = class_for(obj.storage.class_name, t.dtype) if t.cast else obj.storage.class_name
        return _View(t, storage, 0, obj.storage.size, cls)
    cls = class_for(obj.class_name, t.dtype) if t.cast else obj.class_name
    if any(s < 0 for s in obj.strides):
        raise UsageError(f"{printable(obj.name)}: a view with negative strides "
                         f"{list(obj.strides)}, which Lua Torch never writes; slim cannot "
                         "rewrite it")
    if not numel(obj.shape):
        return _View(t, storage, 0, 0, cls)
    last = obj.offset + sum((d - 1) * s for d, s in zip(obj.shape, obj.strides, strict=True))
    return _View(t, storage, obj.offset, last + 1, cls)


def _layout(plan: Plan, st: t7.StorageObject, key: str, kept: list[_View],
            tiled: set[int]) -> _Layout:
    """Merge the runs the kept views reach and say how each run's bytes are streamed."""
    dtypes = {v.tensor.dtype for v in kept}
    if len(dtypes) != 1:
        raise UsageError(f"storage {st.index} would hold {', '.join(sorted(dtypes))} at once")
    dtype = dtypes.pop()
    cls = class_for(st.class_name, dtype) if dtype != st.dtype else st.class_name
    layout = _Layout(st.index, cls, st.version, dtype)
    for v in sorted((v for v in kept if v.stop > v.start), key=lambda v: v.start):
        if layout.pieces and v.start <= layout.pieces[-1][1]:
            a, b, new = layout.pieces[-1]
            layout.pieces[-1] = (a, max(b, v.stop), new)
        else:
            layout.pieces.append((v.start, v.stop, 0))
    size = 0
    for i, (a, b, _) in enumerate(layout.pieces):
        layout.pieces[i] = (a, b, size)
        size += b - a
    layout.size = size
    tiles: dict[int, _View] = {}
    for v in kept:
        if v.tile and (v.start not in tiles or v.stop > tiles[v.start].stop):
            tiles[v.start] = v
    starts = sorted(tiles)
    for a, b, _ in layout.pieces:
        pos = a
        while pos < b:
            tile = tiles.get(pos)
            if tile is not None:
                layout.runs.append(_Run(tile.tensor, True))
                tiled.add(id(tile))
                pos = tile.stop
                continue
            stop = next((s for s in starts if pos < s < b), b)
            layout.runs.append(_Run(_slice(plan, st, key, dtype, pos, stop), False))
            pos = stop
    return layout


def _slice(plan: Plan, st: t7.StorageObject, key: str, dtype: str, start: int,
           stop: int) -> PlannedTensor:
    """Elements ``start..stop`` of an input storage, as a tensor to stream (cast if need be)."""
    itemsize = int(DTYPES[st.dtype].itemsize)
    record = TensorRecord(f"{key}[{start}:{stop}]", st.dtype, (stop - start,),
                          Category.WEIGHTS, (stop - start) * itemsize, storage=key,
                          storage_offset=start * itemsize)
    source = tensor_source(plan.inventory, record, t7.storage_chunks)
    return PlannedTensor(record, record.name, dtype, source)
