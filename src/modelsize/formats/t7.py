"""Lua Torch (torch7) ``torch.save`` files, binary and ascii, read without Lua.

A file is one serialized object (``File.lua``: ``writeObject``): an int type tag, then

* NIL, NUMBER (double), BOOLEAN (int), STRING (int length + bytes);
* TABLE, TORCH, RECUR_FUNCTION: an int reference index; an index seen before is a reference
  to that object (shared objects are written once), else the object follows: a table is an
  int count of key/value object pairs; a torch object is a ``"V <n>"`` version string, its
  class name, then either the C ``read`` of tensors (int ndim, long sizes[ndim], long
  strides[ndim], long 1-based storage offset, storage object) and storages (long size, raw
  elements) or, for every other class (``nn.Linear``...), one table of its fields;
* FUNCTION (legacy, no index) and RECUR_FUNCTION: int length, Lua bytecode, upvalues table.
  Loading a file with a function runs that bytecode: it is recorded as unsafe.

Accounting: storages are data (counted once however many tensors view them); an ``nn``
module's ``weight``/``bias`` are weights, ``gradWeight``/``gradBias`` gradients,
``running_mean``/``running_var`` buffers and every other tensor field (``output``,
``gradInput``, ``finput``...) activations; a storage held directly (``nn.View.size``) is a
buffer; tensor and storage headers are metadata; everything else (tables, class names,
numbers, functions) is graph. Longs are 8 bytes (Linux/macOS); files from systems with
4-byte longs are retried that way (their ``LongStorage`` elements are 4 bytes too). Nesting is
walked with an explicit stack, not recursion.

Storages whose file bytes are not the raw little-endian elements are marked encoded: the
numbers of an ascii file (text; ``Byte`` and ``Char`` storages are raw bytes even there, as
``THDiskFile.c`` writes them) and the 4-byte ``LongStorage`` elements of a file with 4-byte
longs. :func:`storage_chunks` decodes them for ``slim``.
"""

from __future__ import annotations

import contextlib
import mmap
import re
import struct
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import TypeVar

from modelsize._records import field, record
from modelsize.categories import PRECEDENCE, Category
from modelsize.dtypes import DTYPES, numel
from modelsize.errors import CorruptFileError, printable
from modelsize.formats._protobuf import Buffer, FileBuffer
from modelsize.formats.base import Source
from modelsize.inventory import Inventory, InventoryBuilder, StorageRecord

TYPE_NIL, TYPE_NUMBER, TYPE_STRING, TYPE_TABLE, TYPE_TORCH = 0, 1, 2, 3, 4
TYPE_BOOLEAN, TYPE_FUNCTION, LEGACY_TYPE_RECUR_FUNCTION, TYPE_RECUR_FUNCTION = 5, 6, 7, 8
MAX_DEPTH = 10_000
MAX_DIMS = 64

#: Lua Torch tensor/storage type prefixes -> canonical dtype names.
ELEMENT_TYPES: dict[str, str] = {
    "Byte": "uint8", "Char": "int8", "Short": "int16", "Int": "int32", "Long": "int64",
    "Float": "float32", "Double": "float64", "Half": "float16", "Cuda": "float32",
    "CudaByte": "uint8", "CudaChar": "int8", "CudaShort": "int16", "CudaInt": "int32",
    "CudaLong": "int64", "CudaDouble": "float64", "CudaHalf": "float16",
}
_CLASS = re.compile(r"torch\.(\w+?)(Tensor|Storage)")
#: What Lua's ``tonumber`` reads as a number: File.lua takes ``"V <n>"`` for a class version
#: only when ``<n>`` is one; otherwise the string is the class name (no Torch class has it).
_LUA_NUMBER = re.compile(r"\s*[+-]?(0[xX][0-9a-fA-F]+|(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?)\s*")


def element_class(class_name: str) -> tuple[str, str] | None:
    """``torch.FloatTensor`` -> ``("float32", "Tensor")``; ``None`` for any other class."""
    m = _CLASS.fullmatch(class_name)
    if m and m.group(1) in ELEMENT_TYPES:
        return ELEMENT_TYPES[m.group(1)], m.group(2)
    return None

WEIGHT_FIELDS = frozenset({"weight", "bias"})
GRADIENT_FIELDS = frozenset({"gradWeight", "gradBias"})
BUFFER_FIELDS = frozenset({"running_mean", "running_var", "running_std"})
_OPTIMIZER_KEY = re.compile(r"optim", re.I)

_RANK = {c: i for i, c in enumerate(PRECEDENCE)}
_T = TypeVar("_T")


@record(frozen=True)
class _Ctx:
    """Where an object is being read: its path and the category tensors found there get."""

    path: str
    role: Category | None = None  # None: not decided by any key (a bare tensor: weights)
    module_fields: bool = False  # this table holds the fields of a torch object
    for_tensor: TensorObject | None = None  # reading the storage of this tensor


@record
class StorageObject:
    """A ``torch.*Storage``: its object index, elements and where they lie in the file."""

    index: int
    dtype: str
    size: int
    data_offset: int
    data_nbytes: int
    encoded: bool  # ascii text, or 4-byte longs: not the raw little-endian elements
    class_name: str = ""
    version: str | None = None  # "V 1"; None for files older than class versions


@record
class TensorObject:
    """A ``torch.*Tensor``: its object index, the name and category of its best path, its
    view (sizes, strides, 0-based offset) and its storage."""

    index: int
    name: str
    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int  # 0-based, elements
    category: Category
    storage: StorageObject | None = None
    class_name: str = ""
    version: str | None = None


@record
class DirectStorage:
    """A storage held as a value itself (not through a tensor)."""

    name: str
    category: Category
    storage: StorageObject


@record
class _Ref:
    index: int


@record
class Objects:
    """What a parse found: every indexed object, the tensors and the directly held storages
    (in the order the inventory declares them)."""

    by_index: dict[int, object] = field(default_factory=dict)
    tensors: list[TensorObject] = field(default_factory=list)
    direct: list[DirectStorage] = field(default_factory=list)


Frame = Generator[_Ctx, object, object]


class Cursor:
    """Binary scalars in native little-endian layout; ``long_size`` is 8 or 4."""

    ascii = False

    def __init__(self, buf: Buffer, builder: InventoryBuilder, long_size: int) -> None:
        self.buf = buf
        self.size = len(buf)
        self.pos = 0
        self.builder = builder
        self.long_fmt = "<q" if long_size == 8 else "<i"
        self.long_size = long_size

    def _need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.builder.corrupt(
                f"{what} needs {n} bytes but only {self.size - self.pos} are left "
                "(truncated file?)",
                self.pos,
            )

    def int_(self, what: str) -> int:
        self._need(4, what)
        (v,) = _INT.unpack(self.buf[self.pos : self.pos + 4])
        self.pos += 4
        return int(v)

    def long_(self, what: str) -> int:
        self._need(self.long_size, what)
        (v,) = struct.unpack(self.long_fmt, self.buf[self.pos : self.pos + self.long_size])
        self.pos += self.long_size
        return int(v)

    def longs(self, n: int, what: str) -> tuple[int, ...]:
        self._need(n * self.long_size, what)
        fmt = "<" + self.long_fmt[1] * n
        out = struct.unpack(fmt, self.buf[self.pos : self.pos + n * self.long_size])
        self.pos += n * self.long_size
        return tuple(int(v) for v in out)

    def double(self, what: str) -> float:
        self._need(8, what)
        (v,) = _DOUBLE.unpack(self.buf[self.pos : self.pos + 8])
        self.pos += 8
        return float(v)

    def chars(self, n: int, what: str) -> tuple[int, int]:
        """Skip ``n`` raw bytes; return their range."""
        self._need(n, what)
        start = self.pos
        self.pos += n
        return start, self.pos

    def elements(self, count: int, itemsize: int, what: str) -> tuple[int, int]:
        """Skip ``count`` stored elements; return their byte range."""
        return self.chars(count * itemsize, what)

    def min_bytes(self, count: int) -> int:
        """Fewest bytes ``count`` objects can take (a nil is one int)."""
        return 4 * count


_TOKEN = re.compile(rb"\s*(\S+)")
_INT = struct.Struct("<i")
_DOUBLE = struct.Struct("<d")


class _AsciiCursor(Cursor):
    """torch.save(..., 'ascii'): numbers as text, each batch ending in a newline."""

    ascii = True

    def _token(self, what: str) -> bytes:
        assert isinstance(self.buf, mmap.mmap)
        m = _TOKEN.match(self.buf, self.pos)
        if m is None:
            raise self.builder.corrupt(f"{what}: expected a number, found end of file", self.pos)
        self.pos = m.end()
        return m.group(1)

    def _eol(self) -> None:
        if self.pos < self.size and self.buf[self.pos] == 0x0A:
            self.pos += 1

    def _int(self, what: str) -> int:
        at = self.pos
        tok = self._token(what)
        try:
            return int(tok)
        except ValueError as exc:
            raise self.builder.corrupt(f"{what}: expected an integer, found {tok[:20]!r}",
                                       at) from exc

    def int_(self, what: str) -> int:
        v = self._int(what)
        self._eol()
        return v

    def long_(self, what: str) -> int:
        return self.int_(what)

    def longs(self, n: int, what: str) -> tuple[int, ...]:
        out = tuple(self._int(what) for _ in range(n))
        if n:
            self._eol()
        return out

    def double(self, what: str) -> float:
        at = self.pos
        tok = self._token(what)
        try:
            v = float(tok)
        except ValueError as exc:
            raise self.builder.corrupt(f"{what}: expected a number, found {tok[:20]!r}",
                                       at) from exc
        self._eol()
        return v

    def chars(self, n: int, what: str) -> tuple[int, int]:
        start, end = super().chars(n, what)
        if n:
            self._eol()
        return start, end

    def elements(self, count: int, itemsize: int, what: str) -> tuple[int, int]:
        start = self.pos
        for _ in range(count):
            self._token(what)
        end = self.pos
        if count:
            self._eol()
        return start, end

    def min_bytes(self, count: int) -> int:
        return 2 * count


# -- decoding storages for slim ----------------------------------------------------------------

#: canonical dtype -> struct code of one element (ascii numbers are packed this way).
_PACK = {"uint8": "B", "int8": "b", "int16": "h", "int32": "i", "int64": "q",
         "float16": "e", "float32": "f", "float64": "d"}
_TEXT_CHUNK = 1 << 20


def storage_chunks(inv: Inventory, storage: StorageRecord) -> Iterator[bytes]:
    """The little-endian elements of an encoded storage, a chunk at a time: ascii numbers
    parsed and packed, or the 4-byte elements of a ``LongStorage`` widened to 8."""
    path = inv.files[storage.file].path
    dtype = storage.dtype or ""
    code = _PACK.get(dtype)
    if code is None:
        raise ValueError(f"{path}: cannot decode a t7 {dtype or 'untyped'} storage")
    text = inv.facts.get("t7.mode") == "ascii"
    with open(path, "rb") as fh:
        fh.seek(storage.offset)
        left = storage.nbytes
        carry = b""
        while left:
            data = fh.read(min(left, _TEXT_CHUNK))
            if not data:
                raise ValueError(f"{path}: storage {storage.key} ends early")
            left -= len(data)
            if not text:  # 4-byte longs
                data = carry + data
                whole = len(data) - len(data) % 4
                carry = data[whole:]
                yield struct.pack(f"<{whole // 4}q", *struct.unpack(f"<{whole // 4}i",
                                                                    data[:whole]))
                continue
            tokens = (carry + data).split()
            carry = b""
            if left and tokens and not data[-1:].isspace():
                carry = tokens.pop()  # a number cut by the chunk's end
            yield _pack_tokens(tokens, code, path, storage.key)
        if carry:
            if text:
                yield _pack_tokens([carry], code, path, storage.key)
            else:
                raise ValueError(f"{path}: storage {storage.key} ends inside an element")


def _pack_tokens(tokens: list[bytes], code: str, path: Path, key: str) -> bytes:
    try:
        if code in "efd":
            return struct.pack(f"<{len(tokens)}{code}", *map(float, tokens))
        return struct.pack(f"<{len(tokens)}{code}", *map(int, tokens))
    except (ValueError, struct.error) as exc:
        raise CorruptFileError(path, "t7", f"storage {key}: {exc}") from exc


def skip_elements(cur: Cursor, dtype: str, size: int, at: int) -> tuple[int, int, bool]:
    """Pass the ``size`` elements of a storage; return their byte range and whether the file
    holds them encoded (ascii numbers, 4-byte longs) rather than raw."""
    itemsize = int(DTYPES[dtype].itemsize)
    raw = itemsize == 1 or not cur.ascii  # bytes and chars are raw even in ascii files
    encoded = not raw
    if dtype == "int64" and not cur.ascii and cur.long_size != 8:
        itemsize, encoded = cur.long_size, True
    if size < 0 or size * (itemsize if raw else 1) > cur.size - cur.pos:
        raise cur.builder.corrupt(
            f"{dtype} storage declares {size} elements, more than the "
            f"{cur.size - cur.pos} bytes left",
            at,
        )
    what = f"{dtype} storage data"
    start, end = cur.chars(size * itemsize, what) if raw else cur.elements(size, itemsize, what)
    return start, end, encoded


def _parse_all(cur: Cursor) -> Objects:
    objects = _Parser(cur).parse()
    if cur.pos != cur.size:
        raise cur.builder.corrupt(f"{cur.size - cur.pos} bytes follow the serialized object",
                                  cur.pos)
    return objects


@record
class Parsed:
    """A file's object graph as the reader found it, and how its scalars are written."""

    objects: Objects
    long_size: int
    ascii: bool


def open_cursor(fd: int, builder: InventoryBuilder, long_size: int,
                ascii_mode: bool) -> contextlib.AbstractContextManager[Cursor]:
    """A cursor over the file open as ``fd`` (blocks for binary files, a map for ascii)."""
    size = builder.files[0].nbytes
    if ascii_mode:
        return _mapped(fd, builder, long_size)
    return contextlib.nullcontext(Cursor(FileBuffer(fd, size), builder, long_size))


@contextlib.contextmanager
def _mapped(fd: int, builder: InventoryBuilder, long_size: int) -> Iterator[Cursor]:
    with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as buf:
        yield _AsciiCursor(buf, builder, long_size)


def parse(path: Path, name: str = "t7") -> tuple[Parsed, InventoryBuilder]:
    """Read the object graph of ``path`` (8-byte longs, then 4; ascii detected)."""
    return _with_long_sizes(path, name, lambda parsed, builder: (parsed, builder))


def _with_long_sizes(path: Path, name: str,
                     finish: Callable[[Parsed, InventoryBuilder], _T]) -> _T:
    """Parse with 8-byte longs, then 4, until ``finish`` accepts what was found."""
    with open(path, "rb") as fh:
        ascii_mode = _is_ascii(fh.read(16))
        first_error: CorruptFileError | None = None
        for long_size in [8] if ascii_mode else [8, 4]:
            builder = InventoryBuilder(name, [path])
            try:
                with open_cursor(fh.fileno(), builder, long_size, ascii_mode) as cur:
                    objects = _parse_all(cur)
                return finish(Parsed(objects, long_size, ascii_mode), builder)
            except CorruptFileError as exc:
                first_error = first_error or exc
    assert first_error is not None
    raise first_error


class T7Reader:
    """Reads Lua Torch ``.t7`` files (binary and ascii) without Lua or torchfile."""

    name: str = "t7"
    extensions: tuple[str, ...] = (".t7",)

    def sniff(self, source: Source) -> bool:
        """A ``.t7`` file, or a head that starts like a serialized table or torch object."""
        if source.kind != "file" or source.size == 0:
            return False
        head = source.head
        if source.suffix in self.extensions:
            # PyTorch checkpoints are often named .t7 too: only claim a leading type tag.
            return (len(head) < 4 or (head[0] <= 8 and head[1:4] == b"\0\0\0")
                    or _is_ascii(head))
        if len(head) >= 16 and head[4:8] == b"\x01\x00\x00\x00":  # object index 1
            if head[:4] == b"\x04\x00\x00\x00":  # a torch object: "V 1" or a class name
                return head[12:14] == b"V " or head[12:18] == b"torch." or head[12:15] == b"nn."
            if head[:4] == b"\x03\x00\x00\x00":  # a table: size, then a key's type tag
                size, key_type = struct.unpack_from("<ii", head, 8)
                return 0 <= size < 1 << 24 and 0 <= key_type <= 8
        return head.startswith((b"4\n1\n3\nV 1\n", b"3\n1\n"))

    def read(self, source: Source) -> Inventory:
        """Walk the object graph; storages are data, tensors views of them.

        Binary files are read by blocks (headers sit between storages), ascii ones mapped
        (every number is text that must be scanned).
        """
        return _with_long_sizes(source.path, self.name, _inventory)

    storage_chunks = staticmethod(storage_chunks)


def _inventory(parsed: Parsed, builder: InventoryBuilder) -> Inventory:
    _declare(builder, parsed.objects)
    if parsed.long_size != 8:
        builder.notes.append("written with 4-byte longs (Windows or 32-bit Torch)")
        builder.facts["t7.long_size"] = str(parsed.long_size)
    if parsed.ascii:
        builder.facts["t7.mode"] = "ascii"
    return builder.build(Category.GRAPH)


def _is_ascii(head: bytes) -> bool:
    return bool(re.match(rb"\d+\n", head[:16]))


class _Parser:
    """Reads one object graph with an explicit stack of generator frames (no recursion)."""

    def __init__(self, cur: Cursor) -> None:
        self.cur = cur
        self.builder = cur.builder
        self.objects = Objects()

    def parse(self) -> Objects:
        stack: list[Frame] = []
        value, frame = self.start(_Ctx(""))
        if frame is not None:
            stack.append(frame)
            value = None
        while stack:
            try:
                ctx = stack[-1].send(value)
            except StopIteration as stop:
                stack.pop()
                value = stop.value
                continue
            value, frame = self.start(ctx)
            if frame is not None:
                if len(stack) >= MAX_DEPTH:
                    raise self.builder.corrupt(
                        f"objects nested deeper than {MAX_DEPTH}", self.cur.pos
                    )
                stack.append(frame)
                value = None
        return self.objects

    def start(self, ctx: _Ctx) -> tuple[object, Frame | None]:
        """Read the head of one object: its value, or a frame that reads its children."""
        cur = self.cur
        at = cur.pos
        typeidx = cur.int_("object type")
        if typeidx == TYPE_NIL:
            return None, None
        if typeidx == TYPE_NUMBER:
            return cur.double("number"), None
        if typeidx == TYPE_BOOLEAN:
            return cur.int_("boolean") == 1, None
        if typeidx == TYPE_STRING:
            return self.string("string"), None
        if typeidx == TYPE_FUNCTION:
            return None, self.function(at)
        if typeidx not in (TYPE_TABLE, TYPE_TORCH, TYPE_RECUR_FUNCTION, LEGACY_TYPE_RECUR_FUNCTION):
            raise self.builder.corrupt(f"unknown object type {typeidx} (expected 0..8)", at)
        index = cur.int_("object index")
        known = self.objects.by_index.get(index)
        if known is not None:
            self.revisit(known, ctx)
            return _Ref(index), None
        if typeidx == TYPE_TABLE:
            self.objects.by_index[index] = "table"
            return _Ref(index), self.table(ctx, index)
        if typeidx == TYPE_TORCH:
            return self.torch_object(ctx, index, at)
        self.objects.by_index[index] = "function"
        return _Ref(index), self.function(at)

    def string(self, what: str) -> str | None:
        length = self.cur.int_(f"length of {what}")
        start, end = self.cur.chars(length, what)
        if length > 256:
            return None
        return bytes(self.cur.buf[start:end]).decode("utf-8", "replace")

    def function(self, at: int) -> Frame:
        self.builder.add_unsafe_global("lua function")
        size = self.cur.int_("function bytecode length")
        self.cur.chars(size, "function bytecode")
        yield _Ctx("<upvalues>")
        return None

    def table(self, ctx: _Ctx, index: int) -> Frame:
        at = self.cur.pos
        size = self.cur.int_("table size")
        if size < 0 or self.cur.min_bytes(2 * size) > self.cur.size - self.cur.pos:
            raise self.builder.corrupt(
                f"table declares {size} entries, more than the bytes left can hold", at
            )
        for _ in range(size):
            key = yield _Ctx(ctx.path + "<key>")
            yield _child(ctx, key)
        return _Ref(index)

    def torch_object(self, ctx: _Ctx, index: int, at: int) -> tuple[object, Frame | None]:
        version: str | None = self.string("class version") or ""
        class_name = version or ""
        if class_name.startswith("V "):
            if not _LUA_NUMBER.fullmatch(class_name[2:]):
                raise self.builder.corrupt(
                    f"unknown Torch class '{printable(class_name, 60)}' (a class version 'V n' "
                    "needs a number n)", at)
            class_name = self.string("class name") or ""
        else:
            version = None
        kind = element_class(class_name)
        if kind is not None:
            dtype = kind[0]
            if kind[1] == "Storage":
                storage = self.storage(index, dtype, at)
                storage.class_name, storage.version = class_name, version
                if ctx.for_tensor is None:
                    self.objects.direct.append(
                        DirectStorage(ctx.path or "storage", _direct_category(ctx), storage)
                    )
                return storage, None
            return _Ref(index), self.tensor(ctx, index, dtype, at, (class_name, version))
        if class_name in ("tds.Vec", "tds.Hash"):
            self.objects.by_index[index] = class_name
            return _Ref(index), self.tds(ctx, index, class_name == "tds.Hash")
        if not class_name:
            raise self.builder.corrupt("torch object without a class name", at)
        self.objects.by_index[index] = class_name
        return _Ref(index), self.fields(ctx, index)

    def fields(self, ctx: _Ctx, index: int) -> Frame:
        yield _Ctx(ctx.path, None, module_fields=True)
        return _Ref(index)

    def tds(self, ctx: _Ctx, index: int, is_hash: bool) -> Frame:
        at = self.cur.pos
        size = self.cur.int_("tds size")
        per = 2 if is_hash else 1
        if size < 0 or self.cur.min_bytes(per * size + 1) > self.cur.size - self.cur.pos:
            raise self.builder.corrupt(f"tds container declares {size} entries", at)
        yield _Ctx(ctx.path + "<meta>")
        for i in range(size):
            if is_hash:
                key = yield _Ctx(ctx.path + "<key>")
                yield _child(ctx, key)
            else:
                yield _child(ctx, i + 1)
        return _Ref(index)

    def storage(self, index: int, dtype: str, at: int) -> StorageObject:
        cur = self.cur
        size = cur.long_("storage size")
        self.builder.add_region(at, cur.pos - at, Category.METADATA, "storage header")
        start, end, encoded = skip_elements(cur, dtype, size, at)
        storage = StorageObject(index, dtype, size, start, end - start, encoded)
        self.objects.by_index[index] = storage
        return storage

    def tensor(self, ctx: _Ctx, index: int, dtype: str, at: int,
               cls: tuple[str, str | None]) -> Frame:
        cur = self.cur
        ndim = cur.int_("tensor dimension count")
        if not 0 <= ndim <= MAX_DIMS:
            raise self.builder.corrupt(f"tensor declares {ndim} dimensions", at)
        sizes = cur.longs(ndim, "tensor sizes")
        strides = cur.longs(ndim, "tensor strides")
        offset = cur.long_("tensor storage offset") - 1
        if any(s < 0 for s in sizes) or offset < -1:
            raise self.builder.corrupt(
                f"tensor has negative sizes {list(sizes)} or offset {offset + 1}", at
            )
        self.builder.add_region(at, cur.pos - at, Category.METADATA, "tensor header")
        tensor = TensorObject(index, ctx.path or "tensor", dtype, sizes if ndim else (0,),
                         strides, max(offset, 0), _tensor_category(ctx), None, *cls)
        self.objects.by_index[index] = tensor
        ref_at = cur.pos
        value = yield _Ctx(ctx.path + "<storage>", ctx.role, for_tensor=tensor)
        if isinstance(value, _Ref):
            value = self.objects.by_index.get(value.index)
        if value is not None and not isinstance(value, StorageObject):
            raise self.builder.corrupt(f"tensor {printable(tensor.name)!r} has no storage", ref_at)
        if value is None:
            if numel(tensor.shape):
                raise self.builder.corrupt(
                    f"tensor {printable(tensor.name)!r} of shape {list(sizes)} has no storage",
                    ref_at,
                )
        else:
            if value.dtype != dtype:
                raise self.builder.corrupt(
                    f"{dtype} tensor {printable(tensor.name)!r} views a {value.dtype} storage",
                    ref_at,
                )
            if numel(tensor.shape):
                steps = [(d - 1) * s for d, s in zip(sizes, strides, strict=True)]
                first = tensor.offset + sum(n for n in steps if n < 0)
                last = tensor.offset + sum(n for n in steps if n > 0)
                if first < 0 or last >= value.size:
                    raise self.builder.corrupt(
                        f"tensor {printable(tensor.name)!r} reaches element "
                        f"{first if first < 0 else last} of a storage of {value.size}",
                        at,
                    )
            tensor.storage = value
        read_here = isinstance(value, StorageObject) and value.data_offset > ref_at
        if cur.pos > ref_at and not read_here:
            # The storage was a reference or nil: its few bytes belong to the tensor header.
            self.builder.add_region(ref_at, cur.pos - ref_at, Category.METADATA, "tensor header")
        self.objects.tensors.append(tensor)
        return _Ref(index)

    def revisit(self, known: object, ctx: _Ctx) -> None:
        """A shared object met again: the better category (weights over activations) wins."""
        if isinstance(known, TensorObject):
            cat = _tensor_category(ctx)
            if _RANK[cat] < _RANK[known.category]:
                known.category = cat
                known.name = ctx.path or known.name


def _child(ctx: _Ctx, key: object) -> _Ctx:
    """The context of the value stored under ``key`` in the table read in ``ctx``."""
    if isinstance(key, float) and key.is_integer():
        key = int(key)
    if isinstance(key, str):
        path = f"{ctx.path}.{key}" if ctx.path else key
    else:
        path = f"{ctx.path}[{key}]"
    if ctx.module_fields and isinstance(key, str):
        if key in WEIGHT_FIELDS:
            return _Ctx(path, Category.WEIGHTS)
        if key in GRADIENT_FIELDS:
            return _Ctx(path, Category.GRADIENTS)
        if key in BUFFER_FIELDS:
            return _Ctx(path, Category.BUFFERS)
        if _OPTIMIZER_KEY.search(key):
            return _Ctx(path, Category.OPTIMIZER_STATE)
        return _Ctx(path, Category.ACTIVATIONS)
    if isinstance(key, str) and _OPTIMIZER_KEY.search(key):
        return _Ctx(path, Category.OPTIMIZER_STATE)
    return _Ctx(path, ctx.role)


def _tensor_category(ctx: _Ctx) -> Category:
    return ctx.role or Category.WEIGHTS


def _direct_category(ctx: _Ctx) -> Category:
    """A storage held directly (``nn.View.size``): state, not a per-batch cache."""
    if ctx.role in (None, Category.ACTIVATIONS):
        return Category.WEIGHTS if ctx.role is None else Category.BUFFERS
    return ctx.role


def _declare(builder: InventoryBuilder, objects: Objects) -> None:
    declared: set[int] = set()

    def storage_key(st: StorageObject) -> str:
        key = f"storage#{st.index}"
        if st.index not in declared:
            declared.add(st.index)
            builder.add_storage(
                key, st.data_offset, st.data_nbytes, compressed=st.encoded, dtype=st.dtype,
                logical_nbytes=DTYPES[st.dtype].nbytes(st.size) if st.encoded else None,
            )
        return key

    for t in objects.tensors:
        if t.storage is None:
            builder.add_tensor(t.name, t.dtype, t.shape, t.category)
            continue
        builder.add_tensor(
            t.name, t.dtype, t.shape, t.category, storage=storage_key(t.storage),
            storage_offset=t.offset, strides=t.strides if t.strides else None,
        )
    for d in objects.direct:
        builder.add_tensor(d.name, d.storage.dtype, (d.storage.size,), d.category,
                           storage=storage_key(d.storage), tags=("storage",))
    # Storages no tensor reached (a tensor's storage read in another context) still count.
    for obj in objects.by_index.values():
        if isinstance(obj, StorageObject):
            storage_key(obj)
