"""GGUF files (llama.cpp, ggml): header, key/value metadata, tensor infos, aligned data.

Layout (v2/v3; v1 is obsolete and refused)::

    "GGUF" u32 version, u64 tensor_count, u64 kv_count
    kv_count x (string key, u32 value_type, value)        -> metadata (tokenizer vocab too)
    tensor_count x (string name, u32 n_dims, u64 dims[n_dims], u32 ggml_type, u64 offset)
    padding to ``general.alignment`` (default 32)          -> metadata
    data section: each tensor at data_start + offset       -> weights
                  (padding between tensors                 -> metadata)

Strings are a u64 length and UTF-8 bytes. The byte order is the writer's: a version whose
low 16 bits are zero is a big-endian file read on a little-endian host (as gguf-py decides).
Every count and length is checked against the bytes left in the file before it is trusted,
and nothing is allocated from a declared size.

A model split by llama.cpp's ``gguf-split`` (``PREFIX-00001-of-00003.gguf`` ...: each shard a
GGUF file of its own, with some of the tensors) is one model: its first shard with every
other shard beside it, or a folder whose ``.gguf`` files are exactly one such set, is read
as one inventory over all its files.

Plain multi-byte tensors of a big-endian file (F32, F16, BF16, F64, I16, I32, I64) are
*encoded* storages: :func:`storage_chunks` gives their bytes little-endian. Quantized blocks
are kept as stored (their fields' byte order is the converter's business). :func:`read_layout`
gives the header, the byte range of every key/value pair and the tensor infos, for the writer.
"""

from __future__ import annotations

import array
import itertools
import mmap
import os
import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from modelsize._records import field, record
from modelsize.categories import Category
from modelsize.dtypes import DTYPES, numel
from modelsize.errors import CorruptFileError, printable
from modelsize.formats.base import Source
from modelsize.inventory import Inventory, InventoryBuilder, StorageRecord

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
SUPPORTED_VERSIONS = (2, 3)
#: llama.cpp's GGML_MAX_DIMS is 4; leave room, but refuse absurd dimension counts.
MAX_DIMS = 8
MAX_ARRAY_NESTING = 8

#: GGML tensor type ids (ggml.h ``enum ggml_type``) -> canonical names in :mod:`modelsize.dtypes`.
#: Ids 4, 5 (q4_2, q4_3) and 31-33, 36-38 (repacked q4_0/iq4_nl) were removed from ggml.
GGML_TYPES: dict[int, str] = {
    0: "float32",
    1: "float16",
    2: "q4_0",
    3: "q4_1",
    6: "q5_0",
    7: "q5_1",
    8: "q8_0",
    9: "q8_1",
    10: "q2_K",
    11: "q3_K",
    12: "q4_K",
    13: "q5_K",
    14: "q6_K",
    15: "q8_K",
    16: "iq2_xxs",
    17: "iq2_xs",
    18: "iq3_xxs",
    19: "iq1_s",
    20: "iq4_nl",
    21: "iq3_s",
    22: "iq2_s",
    23: "iq4_xs",
    24: "int8",
    25: "int16",
    26: "int32",
    27: "int64",
    28: "float64",
    29: "iq1_m",
    30: "bfloat16",
    34: "tq1_0",
    35: "tq2_0",
    39: "mxfp4",
    40: "nvfp4",
    41: "q1_0",
}

# GGUF metadata value types -> (name, fixed size in bytes or None for string/array).
_UINT32 = 4
_STRING = 8
_ARRAY = 9
_VALUE_SIZES: dict[int, int | None] = {
    0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 8: None, 9: None, 10: 8, 11: 8, 12: 8,
}
_VALUE_NAMES = {
    0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32", 6: "float32",
    7: "bool", 8: "string", 9: "array", 10: "uint64", 11: "int64", 12: "float64",
}
_INT_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 7: "?", 10: "Q", 11: "q"}
# Smallest possible encodings, used to bound declared counts by the bytes left.
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8
_FACT_KEYS = ("general.architecture", "general.name", "general.file_type")


@record(frozen=True)
class TensorInfo:
    """One tensor info: ``dims`` in ggml order (fastest first), ``offset`` from the data start."""

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int
    info_offset: int


@record(frozen=True)
class KeyValue:
    """One metadata pair: its bytes are ``start..end``, its value's ``value_start..end``."""

    key: str
    value_type: int
    start: int
    value_start: int
    end: int
    value: object


@record
class Layout:
    """Everything before the tensor data, as found in the file."""

    version: int
    endian: str
    tensor_count: int
    kv_count: int
    alignment: int = DEFAULT_ALIGNMENT
    kvs: list[KeyValue] = field(default_factory=list)
    infos: list[TensorInfo] = field(default_factory=list)
    data_start: int = 0

    @property
    def kv_start(self) -> int:
        """First byte of the key/value pairs (right after the 24-byte header)."""
        return 24

    @property
    def kv_end(self) -> int:
        """Byte after the last key/value pair: where the tensor infos start."""
        return self.kvs[-1].end if self.kvs else self.kv_start


class _Cursor:
    """Reads little- or big-endian scalars from a buffer, refusing to run past its end."""

    def __init__(self, buf: mmap.mmap, builder: InventoryBuilder | _Shard, endian: str) -> None:
        self.buf = buf
        self.size = len(buf)
        self.pos = 0
        self.builder = builder
        self.endian = endian

    def need(self, nbytes: int, what: str) -> None:
        if nbytes < 0 or self.pos + nbytes > self.size:
            raise self.builder.corrupt(
                f"{what} needs {nbytes} bytes but only {self.size - self.pos} are left "
                "(truncated file?)",
                self.pos,
            )

    def scalar(self, fmt: str, what: str) -> int:
        size = struct.calcsize(fmt)
        self.need(size, what)
        (value,) = struct.unpack_from(self.endian + fmt, self.buf, self.pos)
        self.pos += size
        return int(value)

    def u32(self, what: str) -> int:
        return self.scalar("I", what)

    def u64(self, what: str) -> int:
        return self.scalar("Q", what)

    def skip_string(self, what: str) -> None:
        length = self.u64(f"length of {what}")
        self.need(length, f"{what} ({length} bytes)")
        self.pos += length

    def string(self, what: str) -> str:
        start = self.pos
        length = self.u64(f"length of {what}")
        self.need(length, f"{what} ({length} bytes)")
        raw = bytes(self.buf[self.pos : self.pos + length])
        self.pos += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.builder.corrupt(f"{what} is not valid UTF-8 ({exc.reason})", start) from exc


class GgufReader:
    """Reads GGUF v2/v3 files without ggml or gguf-py."""

    name: str = "gguf"
    extensions: tuple[str, ...] = (".gguf",)

    def sniff(self, source: Source) -> bool:
        """GGUF files start with the magic ``GGUF``; a folder holding one split model's
        shards (and no other GGUF file) is that model."""
        if source.kind == "dir":
            return split_in(source.path) is not None
        return source.kind == "file" and source.head[:4] == MAGIC

    def read(self, source: Source) -> Inventory:
        """Account for every byte: header, metadata, tensor infos, padding, tensor data
        (of every shard of a split model)."""
        if source.kind == "dir":
            paths = split_in(source.path) or [source.path]
        else:
            paths = split_shards(source.path) or [source.path]
        builder = InventoryBuilder(self.name, paths)
        for i, path in enumerate(paths):
            size = builder.files[i].nbytes
            if size < 24:
                raise builder.corrupt(f"file has {size} bytes, a GGUF header needs 24", 0, i)
            with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                _parse(buf, builder if len(paths) == 1 else _Shard(builder, i))
        if len(paths) > 1:
            builder.facts["gguf.split"] = f"{len(paths)} files"
        else:
            missing = _missing_shards(paths[0])
            if missing:
                builder.notes.append(
                    f"{paths[0].name} is the first shard of a split model; "
                    f"{printable(missing[0], 80)}{' and others' if len(missing) > 1 else ''} "
                    "not beside it: this report is of this shard alone")
        return builder.build(Category.METADATA)

    @staticmethod
    def storage_chunks(inv: Inventory, storage: StorageRecord) -> Iterator[bytes]:
        """Little-endian bytes of a big-endian file's plain tensor (see :func:`storage_chunks`)."""
        return storage_chunks(inv, storage)


#: The shard names llama.cpp's gguf-split writes (``llama_split_path``: ``%s-%05d-of-%05d.gguf``).
_SPLIT_NAME = re.compile(r"(.+)-(\d{5})-of-(\d{5})\.gguf")
#: Entries of a folder looked at for a split model's shards.
_SCAN_ENTRIES = 10_000


def shard_names(path: Path) -> list[Path]:
    """The names of every shard of the split model whose first shard is ``path`` (gguf-split
    names), or [] when ``path`` is not named as a first shard."""
    m = _SPLIT_NAME.fullmatch(path.name)
    if m is None or int(m.group(2)) != 1 or int(m.group(3)) < 2:
        return []
    return [path.with_name(f"{m.group(1)}-{i:05d}-of-{m.group(3)}.gguf")
            for i in range(1, int(m.group(3)) + 1)]


def split_shards(path: Path) -> list[Path] | None:
    """Every shard of the split model whose first shard is ``path``, when all are files
    beside it; else None."""
    shards = shard_names(path)
    return shards if shards and all(p.is_file() for p in shards) else None


def _missing_shards(path: Path) -> list[str]:
    return [p.name for p in shard_names(path) if not p.is_file()]


def split_in(folder: Path) -> list[Path] | None:
    """The shards of the split model a folder holds, when its ``.gguf`` files are exactly
    them; else None."""
    try:
        with os.scandir(folder) as entries:
            names = sorted(e.name for e in itertools.islice(entries, _SCAN_ENTRIES)
                           if e.name.endswith(".gguf") and e.is_file())
    except OSError:
        return None
    if len(names) < 2:
        return None
    shards = split_shards(folder / names[0])
    return shards if shards is not None and [p.name for p in shards] == names else None


class _Shard:
    """The builder of a split model as the parser of one shard sees it: every range it
    declares is in that shard's file; the model's facts are its first shard's."""

    def __init__(self, builder: InventoryBuilder, index: int) -> None:
        self._builder, self._index = builder, index
        self.files = [builder.files[index]]
        self.notes = builder.notes
        self.facts: dict[str, str] = builder.facts if index == 0 else {}

    def corrupt(self, reason: str, offset: int | None = None, file: int = 0
                ) -> CorruptFileError:
        return self._builder.corrupt(reason, offset, self._index)

    def check_range(self, offset: int, nbytes: int, what: str, file: int = 0) -> None:
        self._builder.check_range(offset, nbytes, what, self._index)

    def add_region(self, offset: int, nbytes: int, category: Category, label: str,
                   file: int = 0) -> None:
        self._builder.add_region(offset, nbytes, category, label, self._index)

    def add_storage(self, key: str, offset: int, nbytes: int, **kw: Any) -> None:
        self._builder.add_storage(key, offset, nbytes, **{**kw, "file": self._index})

    def add_tensor(self, *args: Any, **kw: Any) -> None:
        self._builder.add_tensor(*args, **kw)


def read_layout(path: Path) -> Layout:
    """Header, key/value pairs and tensor infos of a GGUF file (checked as :meth:`read` does)."""
    builder = InventoryBuilder(GgufReader.name, [path])
    size = builder.files[0].nbytes
    if size < 24:
        raise builder.corrupt(f"file has {size} bytes, a GGUF header needs 24", 0)
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        return _parse(buf, builder)


def _parse(buf: mmap.mmap, builder: InventoryBuilder | _Shard) -> Layout:
    if buf[:4] != MAGIC:
        raise builder.corrupt(f"expected magic b'GGUF', found {bytes(buf[:4])!r}", 0)
    (version,) = struct.unpack_from("<I", buf, 4)
    endian = "<"
    if version & 0xFFFF == 0:
        endian = ">"
        (version,) = struct.unpack_from(">I", buf, 4)
    if version not in SUPPORTED_VERSIONS:
        raise builder.corrupt(
            f"GGUF version {version} is not supported (modelsize reads versions 2 and 3)", 4
        )
    cur = _Cursor(buf, builder, endian)
    cur.pos = 8
    tensor_count = cur.u64("tensor count")
    kv_count = cur.u64("metadata key/value count")
    layout = Layout(version, endian, tensor_count, kv_count)
    builder.add_region(0, cur.pos, Category.METADATA, "GGUF header")
    builder.facts["gguf.version"] = str(version)
    if endian == ">":
        builder.facts["gguf.byte_order"] = "big-endian"
    if kv_count * _MIN_KV_BYTES > cur.size - cur.pos:
        raise builder.corrupt(
            f"header declares {kv_count} metadata entries, more than the "
            f"{cur.size - cur.pos} bytes left can hold",
            16,
        )

    alignment = DEFAULT_ALIGNMENT
    for _ in range(kv_count):
        start = cur.pos
        key = cur.string("metadata key")
        vtype = cur.u32(f"value type of {key!r}")
        value_start = cur.pos
        value = _read_value(cur, vtype, key, 0)
        layout.kvs.append(KeyValue(key, vtype, start, value_start, cur.pos, value))
        label = "tokenizer" if key.startswith("tokenizer.") else f"metadata {printable(key, 80)}"
        builder.add_region(start, cur.pos - start, Category.METADATA, label)
        if key == "general.alignment":
            if vtype != _UINT32 or not isinstance(value, int) or value <= 0 or value & (value - 1):
                raise builder.corrupt(
                    f"general.alignment must be a power-of-two uint32, found "
                    f"{_VALUE_NAMES.get(vtype, vtype)} {value!r}",
                    start,
                )
            alignment = layout.alignment = value
        elif key in _FACT_KEYS and value is not None:
            builder.facts[f"gguf.{key.removeprefix('general.')}"] = printable(str(value), 120)

    if tensor_count * _MIN_TENSOR_INFO_BYTES > cur.size - cur.pos:
        raise builder.corrupt(
            f"header declares {tensor_count} tensors, more than the {cur.size - cur.pos} "
            "bytes left can describe",
            8,
        )
    infos: list[TensorInfo] = []
    seen: set[str] = set()
    infos_start = cur.pos
    for _ in range(tensor_count):
        info_offset = cur.pos
        name = cur.string("tensor name")
        if name in seen:
            raise builder.corrupt(f"tensor name {printable(name)!r} appears twice", info_offset)
        seen.add(name)
        n_dims = cur.u32(f"dimension count of {name!r}")
        if n_dims > MAX_DIMS:
            raise builder.corrupt(
                f"tensor {printable(name)!r} declares {n_dims} dimensions (at most {MAX_DIMS})",
                info_offset,
            )
        dims = tuple(cur.u64(f"dimension of {name!r}") for _ in range(n_dims))
        ggml_type = cur.u32(f"type of {name!r}")
        offset = cur.u64(f"data offset of {name!r}")
        if offset % alignment:
            raise builder.corrupt(
                f"tensor {printable(name)!r} data offset {offset} is not a multiple of the "
                f"alignment {alignment}",
                info_offset,
            )
        infos.append(TensorInfo(name, dims, ggml_type, offset, info_offset))
    builder.add_region(infos_start, cur.pos - infos_start, Category.METADATA, "tensor infos")

    data_start = -(-cur.pos // alignment) * alignment
    layout.infos, layout.data_start = infos, data_start
    if not infos:
        return layout
    if data_start > cur.size:
        raise builder.corrupt(
            f"data section should start at byte {data_start} but the file has {cur.size}",
            cur.pos,
        )
    _declare_tensors(infos, data_start, builder, endian)
    return layout


def _read_value(cur: _Cursor, vtype: int, key: str, depth: int) -> object:
    """Read (or skip) one metadata value; return scalars and short strings, else ``None``."""
    fixed = _VALUE_SIZES.get(vtype, -1)
    if fixed == -1:
        raise cur.builder.corrupt(
            f"metadata {printable(key)!r} has unknown value type {vtype}", cur.pos - 4
        )
    if fixed is not None:
        if vtype in _INT_FORMATS:
            return cur.scalar(_INT_FORMATS[vtype], f"value of {key!r}")
        cur.need(fixed, f"value of {key!r}")
        cur.pos += fixed
        return None
    if vtype == _STRING:
        length_at = cur.pos
        length = cur.u64(f"length of {key!r}")
        cur.pos = length_at
        if length <= 256:
            return cur.string(f"value of {key!r}")
        cur.skip_string(f"value of {key!r}")
        return None
    if depth >= MAX_ARRAY_NESTING:
        raise cur.builder.corrupt(f"metadata {printable(key)!r} nests arrays too deep", cur.pos)
    item_type = cur.u32(f"array item type of {key!r}")
    count = cur.u64(f"array length of {key!r}")
    item_size = _VALUE_SIZES.get(item_type, -1)
    if item_size == -1:
        raise cur.builder.corrupt(
            f"array {printable(key)!r} has unknown item type {item_type}", cur.pos - 12
        )
    # Strings take at least their 8-byte length, nested arrays at least 12 bytes.
    min_item = item_size if item_size is not None else (8 if item_type == _STRING else 12)
    if count * min_item > cur.size - cur.pos:
        raise cur.builder.corrupt(
            f"array {printable(key)!r} declares {count} items, more than the "
            f"{cur.size - cur.pos} bytes left can hold",
            cur.pos - 8,
        )
    if item_size is not None:
        cur.pos += count * item_size
    elif item_type == _STRING:
        _skip_strings(cur, count, key)
    else:
        for _ in range(count):
            _read_value(cur, _ARRAY, key, depth + 1)
    return None


def _skip_strings(cur: _Cursor, count: int, key: str) -> None:
    """Skip ``count`` strings (a tokenizer vocabulary: often 100k+ of them) in a tight loop."""
    length_of = struct.Struct(cur.endian + "Q").unpack_from
    buf, pos, size = cur.buf, cur.pos, cur.size
    for _ in range(count):
        if pos + 8 > size:
            break
        pos += 8 + length_of(buf, pos)[0]
        if pos > size:
            break
    else:
        cur.pos = pos
        return
    raise cur.builder.corrupt(
        f"array {printable(key)!r} of {count} strings runs past the end of the file", cur.pos
    )


def _declare_tensors(infos: list[TensorInfo], data_start: int, builder: InventoryBuilder | _Shard,
                     endian: str) -> None:
    file_size = builder.files[0].nbytes
    by_offset = sorted(infos, key=lambda t: t.offset)
    next_start: dict[str, int] = {}
    for cur_info, nxt in zip(by_offset, [*by_offset[1:], None], strict=True):
        next_start[cur_info.name] = data_start + nxt.offset if nxt else file_size
    declared: dict[tuple[int, int], str] = {}
    for info in infos:
        start = data_start + info.offset
        dtype = GGML_TYPES.get(info.ggml_type)
        known = dtype is not None and dtype in DTYPES
        shape = tuple(reversed(info.dims))  # ggml lists the fastest dimension first
        if known:
            assert dtype is not None
            dt = DTYPES[dtype]
            if info.dims and info.dims[0] % dt.block:
                raise builder.corrupt(
                    f"tensor {printable(info.name)!r} rows of {info.dims[0]} elements are not "
                    f"whole {dtype} blocks of {dt.block}",
                    info.info_offset,
                )
            nbytes = dt.nbytes(numel(shape))
        else:
            # A type newer than this table: its bytes run up to the next tensor.
            nbytes = max(0, next_start[info.name] - start)
            builder.notes.append(
                f"ggml type {info.ggml_type} of {info.name} is unknown to modelsize: "
                "its size is taken up to the next tensor"
            )
        builder.check_range(start, nbytes, f"tensor {printable(info.name)!r}")
        key = declared.get((start, nbytes))
        if key is None:
            key = info.name
            declared[(start, nbytes)] = key
            swapped = endian == ">" and known and _swap_size(dtype) > 1
            builder.add_storage(key, start, nbytes, dtype=dtype if known else None,
                                compressed=swapped)
            if endian == ">" and not swapped and known and DTYPES[dtype or ""].block > 1:
                builder.notes.append(
                    f"{info.name} is {dtype} in a big-endian file: its blocks are kept as stored"
                )
        category = Category.BUFFERS if "rope_freqs" in info.name else Category.WEIGHTS
        if known:
            assert dtype is not None
            builder.add_tensor(info.name, dtype, shape, category, storage=key)
        else:
            builder.add_tensor(
                info.name, "uint8", (nbytes,), category, storage=key,
                tags=(f"ggml_type_{info.ggml_type}",),
            )


# -- decoding big-endian storages for slim ---------------------------------------------------

_DECODE_CHUNK = 8 << 20


def _swap_size(dtype: str | None) -> int:
    """Bytes per element to swap for a plain dtype (1 for bytes and quantized blocks)."""
    dt = DTYPES.get(dtype or "")
    return dt.block_bytes if dt is not None and dt.block == 1 else 1


def swap_bytes(data: bytes | memoryview, itemsize: int) -> bytes:
    """Reverse the byte order of every ``itemsize``-byte element (big <-> little endian)."""
    if itemsize <= 1:
        return bytes(data)
    if len(data) % itemsize:
        raise ValueError(f"{len(data)} bytes are not whole {itemsize}-byte elements")
    code = next((c for c in "HILQ" if array.array(c).itemsize == itemsize), None)
    if code is not None:
        arr = array.array(code)
        arr.frombytes(data)
        arr.byteswap()
        return arr.tobytes()
    out = bytearray(len(data))
    for k in range(itemsize):
        out[k::itemsize] = data[itemsize - 1 - k :: itemsize]
    return bytes(out)


def storage_chunks(inv: Inventory, storage: StorageRecord) -> Iterator[bytes]:
    """The little-endian bytes of a big-endian file's plain tensor, a chunk at a time."""
    path = inv.files[storage.file].path
    itemsize = _swap_size(storage.dtype)
    step = max(1, _DECODE_CHUNK // itemsize) * itemsize
    with open(path, "rb") as fh:
        fh.seek(storage.offset)
        left = storage.nbytes
        while left:
            data = fh.read(min(left, step))
            if not data or len(data) % itemsize:
                raise ValueError(f"{path}: storage {storage.key} ends early")
            left -= len(data)
            yield swap_bytes(data, itemsize)
