"""NumPy ``.npy`` arrays and ``.npz`` archives of them, read without NumPy.

A ``.npy`` file is the magic ``\\x93NUMPY``, a version, a header length (u16 for 1.0, u32 for
2.0/3.0) and a Python literal dict ``{'descr': '<f4', 'fortran_order': False, 'shape': (3,)}``
parsed with :func:`ast.literal_eval` once its length is checked; then ``numel * itemsize``
bytes of data. The header is metadata; the data is one storage. Bytes after the data are
``other`` with a note.

Object arrays (``descr`` ``'|O'`` or a record with an object field) hold a pickle instead of
data. It is scanned, never loaded, for the callables it would import. The NumPy arrays it holds
(a dict of weights saved with ``np.save``) are tensors, their data storages where it lies in
the pickle (as latin-1 text at protocol 2), the rest of the pickle metadata; a pickle of other
objects counts as ``other``: the array's contents, but not tensor data whose size follows from
a shape.

An ``.npz`` is a zip of ``name.npy`` members. A stored member is a header (metadata) and a
storage; a deflated member (``np.savez_compressed``) is one compressed storage whose logical
size is ``numel * itemsize``. Only as much of a deflated member is inflated as its header
needs, except for object arrays, whose pickle must be scanned whole: a member read whole is
checked against its CRC-32 (array data, never read, is not).

A bare ``.npy`` array is taken as a weight whatever its dtype (a single saved array is most
often one); arrays of an ``.npz`` are classified by name like a state dict
(:func:`~modelsize.formats.safetensors.classify_name`).
"""

from __future__ import annotations

import ast
import functools
import mmap
import os
import re
import struct
import zipfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modelsize._records import record
from modelsize.categories import Category
from modelsize.dtypes import numel
from modelsize.errors import CorruptFileError, printable
from modelsize.formats import _zip
from modelsize.formats.base import Source
from modelsize.formats.safetensors import classify_name
from modelsize.inventory import Inventory, InventoryBuilder, StorageRecord, paused_gc

if TYPE_CHECKING:
    from modelsize.formats._pickle import Data

MAGIC = b"\x93NUMPY"
#: NumPy itself refuses headers above 10 000 bytes unless told otherwise; we allow more but
#: never hand an unbounded string to the literal parser.
MAX_HEADER = 1 << 20
#: NumPy's own limit (NPY_MAXDIMS); it also keeps ``numel`` of a hostile shape cheap.
MAX_DIMS = 64

_KINDS = {
    ("b", 1): "bool",
    ("i", 1): "int8", ("i", 2): "int16", ("i", 4): "int32", ("i", 8): "int64",
    ("u", 1): "uint8", ("u", 2): "uint16", ("u", 4): "uint32", ("u", 8): "uint64",
    ("f", 2): "float16", ("f", 4): "float32", ("f", 8): "float64", ("f", 16): "float128",
    ("c", 8): "complex64", ("c", 16): "complex128", ("c", 32): "complex256",
}
_TYPESTR = re.compile(r"^([<>|=]?)([biufcmMOSaUV])(\d*)(?:\[(\d*)(\w+)\])?$")
#: The units NumPy knows for datetime64 and timedelta64 (``[10ns]`` repeats one).
_TIME_UNITS = frozenset({"Y", "M", "W", "D", "h", "m", "s", "ms", "us", "\u03bcs", "ns", "ps",
                         "fs", "as", "generic"})
#: NumPy keeps an item's size in a C int: a dtype (or a field's subarray) may not be larger.
MAX_ITEMSIZE = 2**31 - 1
#: Array sizes are C ``npy_intp`` (64-bit): elements and bytes both stay below this.
MAX_ELEMENTS = 2**63 - 1


@record(frozen=True)
class NpyDType:
    """A NumPy dtype as far as sizing needs: a name, bytes per element, whether it pickles."""

    name: str
    itemsize: int
    has_object: bool = False
    floating: bool = False
    structured: bool = False


@record(frozen=True)
class NpyHeader:
    """A parsed ``.npy`` header; ``nbytes`` is its length including magic and version."""

    dtype: NpyDType
    shape: tuple[int, ...]
    nbytes: int
    fortran: bool = False
    big_endian: bool = False

    @property
    def data_nbytes(self) -> int:
        """Bytes of array data that must follow the header (0 for object arrays)."""
        return 0 if self.dtype.has_object else numel(self.shape) * self.dtype.itemsize


def parse_typestr(descr: str) -> NpyDType:
    """Size of a NumPy type string such as ``'<f4'``, ``'|S10'``, ``'<U3'``, ``'<M8[ns]'``.

    Only what ``numpy.dtype`` itself accepts is accepted (a ``ValueError`` says why not): item
    sizes that fit NumPy's C int, the sizes each kind has, datetime units NumPy knows.
    """
    m = _TYPESTR.match(descr)
    if m is None:
        raise ValueError(f"unknown NumPy type string {descr!r:.40}")
    _, kind, digits, repeat, unit = m.groups()
    if unit is not None and (kind not in "mM" or unit not in _TIME_UNITS):
        raise ValueError(f"type string {descr!r:.40}: NumPy has no such datetime unit")
    if kind == "O":
        if digits not in ("", "4", "8"):
            raise ValueError(f"type string {descr!r:.40}: an object is 8 bytes")
        return NpyDType("object", 8, has_object=True)
    if len(digits) > 10 or (digits and int(digits) > MAX_ITEMSIZE // (4 if kind == "U" else 1)):
        raise ValueError(
            f"type string {descr!r:.40}: item size above the {MAX_ITEMSIZE:,} bytes NumPy "
            "allows (np.load refuses it)"
        )
    size = int(digits) if digits else 0
    if (kind, size) in _KINDS:
        name = _KINDS[(kind, size)]
        return NpyDType(name, size, floating=kind in "fc")
    if kind in "mM" and size == 8:
        base = "timedelta64" if kind == "m" else "datetime64"
        return NpyDType(base + (f"[{repeat}{unit}]" if unit and unit != "generic" else ""), 8)
    if kind in "Sa":
        return NpyDType(f"bytes{size * 8}", size)
    if kind == "U":
        return NpyDType(f"str{size * 32}", size * 4)
    if kind == "V":
        return NpyDType(f"void{size * 8}", size)
    raise ValueError(f"unsupported NumPy type string {descr!r:.40}")


def _field_name(name: Any) -> str:
    """A structured field's name (a title may come with it, as a ``(title, name)`` pair)."""
    if isinstance(name, tuple) and len(name) == 2 and all(isinstance(n, str) for n in name):
        return str(name[1])
    if not isinstance(name, str):
        raise ValueError(f"a structured field's name must be a string, found {name!r:.60}")
    return name


def parse_descr(descr: Any, depth: int = 0) -> NpyDType:
    """Size of a ``descr``: a type string, or a structured list of ``(name, descr[, shape])``.

    Field names must be strings and distinct; a field's subarray and the record itself must
    fit NumPy's item size limit (NumPy refuses them otherwise).
    """
    if isinstance(descr, str):
        return parse_typestr(descr)
    if not isinstance(descr, list) or depth > 32:
        raise ValueError(f"descr should be a type string or a list of fields, found {descr!r:.60}")
    itemsize = 0
    has_object = False
    names: set[str] = set()
    for field in descr:
        if not isinstance(field, tuple) or len(field) not in (2, 3):
            raise ValueError(f"a structured field should be (name, descr[, shape]): {field!r:.60}")
        name = _field_name(field[0])
        sub = parse_descr(field[1], depth + 1)
        count = 1
        if len(field) == 3:
            shape = field[2] if isinstance(field[2], tuple) else (field[2],)
            if len(shape) > MAX_DIMS or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
            ):
                raise ValueError(f"field shape should be non-negative integers: {field[2]!r:.60}")
            count = _capped_numel(shape, MAX_ITEMSIZE + 1)
            if sub.itemsize * count > MAX_ITEMSIZE:
                raise ValueError(f"field {name!r:.40} is larger than the {MAX_ITEMSIZE:,} "
                                 "bytes NumPy allows")
        padding = name == "" and sub.name.startswith("void") and not sub.structured
        if not padding:
            if name in names:
                raise ValueError(f"field name {name!r:.40} appears twice")
            names.add(name)
        itemsize += sub.itemsize * count
        if itemsize > MAX_ITEMSIZE:
            raise ValueError(f"records are larger than the {MAX_ITEMSIZE:,} bytes NumPy allows")
        has_object = has_object or sub.has_object
    return NpyDType(f"void{itemsize * 8}", itemsize, has_object, structured=True)


def _capped_numel(shape: tuple[int, ...], cap: int) -> int:
    """``numel(shape)``, or ``cap`` once it reaches it (a hostile shape is never multiplied
    out in full)."""
    if 0 in shape:
        return 0
    count = 1
    for d in shape:
        count *= d
        if count >= cap:
            return cap
    return count


def parse_header(read_prefix: Callable[[int], bytes], available: int) -> NpyHeader:
    """Parse a ``.npy`` header from a stream of ``available`` bytes.

    ``read_prefix(n)`` returns the first ``n`` bytes of the stream (fewer if it is shorter).
    Raises :class:`ValueError` saying what was expected and what was found.
    """
    start = read_prefix(12)
    if start[:6] != MAGIC:
        raise ValueError(f"expected the NumPy magic \\x93NUMPY, found {start[:6]!r}")
    if len(start) < 10:
        raise ValueError(f"header ends after {len(start)} bytes")
    major = start[6]
    if major == 1:
        length, pre = struct.unpack_from("<H", start, 8)[0], 10
    elif major in (2, 3):
        if len(start) < 12:
            raise ValueError(f"header ends after {len(start)} bytes")
        length, pre = struct.unpack_from("<I", start, 8)[0], 12
    else:
        raise ValueError(f"expected .npy format version 1, 2 or 3, found {major}.{start[7]}")
    if pre + length > available:
        raise ValueError(
            f"header length {length} runs past the end of the data ({available} bytes)"
        )
    if length > MAX_HEADER:
        raise ValueError(f"header length {length} is above the {MAX_HEADER}-byte limit")
    raw = read_prefix(pre + length)[pre:]
    if len(raw) != length:
        raise ValueError(f"header should be {length} bytes, found {len(raw)}")
    text = raw.decode("utf-8" if major == 3 else "latin1")
    # Headers repeat (an archive of arrays of a few shapes): each text is parsed once.
    parsed = _parse_dict(text) if len(text) > _CACHED_TEXT else _parse_dict_cached(text)
    return NpyHeader(parsed[0], parsed[1], pre + length, parsed[2], parsed[3])


#: Headers as NumPy's ``write_array`` writes them: parsed by this, not by ``ast``.
_CANONICAL = re.compile(
    r"\{'descr': '([<>|=]?[a-zA-Z][0-9]*(?:\[[0-9]*\w+\])?)', "
    r"'fortran_order': (True|False), 'shape': \((|[0-9]+,|[0-9]+(?:, [0-9]+)+)\), \}[ \n]*"
)
#: Header texts up to this long are remembered once parsed.
_CACHED_TEXT = 4096


def _parse_dict(text: str) -> tuple[NpyDType, tuple[int, ...], bool, bool]:
    """(dtype, shape, fortran order, big-endian) of a header's dict, checked as NumPy would."""
    m = _CANONICAL.fullmatch(text)
    if m is not None:
        descr: Any = m.group(1)
        fortran: Any = m.group(2) == "True"
        shape: Any = tuple(int(d) for d in m.group(3).split(",") if d)
    else:
        try:
            doc = ast.literal_eval(text)
        except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError) as exc:
            raise ValueError(
                f"header is not a Python literal dict ({type(exc).__name__})") from exc
        if not isinstance(doc, dict) or set(doc) != {"descr", "fortran_order", "shape"}:
            raise ValueError(
                f"expected a dict with keys descr, fortran_order, shape; found "
                f"{text.strip()!r:.80}"
            )
        descr, fortran, shape = doc["descr"], doc["fortran_order"], doc["shape"]
    if not isinstance(shape, tuple) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise ValueError(f"shape should be a tuple of non-negative integers, found {shape!r:.60}")
    if len(shape) > MAX_DIMS:
        raise ValueError(f"shape has {len(shape)} dimensions, NumPy allows {MAX_DIMS}")
    if not isinstance(fortran, bool):
        raise ValueError(f"fortran_order should be True or False, found {fortran!r:.40}")
    dtype = parse_descr(descr)
    # NumPy multiplies the dimensions other than 0 by the item size (a 0 does not make a
    # huge one fit: "array is too big"), and each must be an npy_intp ("Maximum allowed
    # dimension exceeded")
    count = _capped_numel(tuple(d for d in shape if d), MAX_ELEMENTS + 1)
    if count > MAX_ELEMENTS or count * dtype.itemsize > MAX_ELEMENTS:
        raise ValueError(f"shape {shape!r:.60} of {dtype.itemsize}-byte items is larger than "
                         "NumPy's largest array")
    big = isinstance(descr, str) and descr.startswith(">") and dtype.itemsize > 1
    if big and dtype.name.startswith(("str", "bytes", "void", "datetime", "timedelta")):
        big = False  # bytes are bytes; datetimes are left as they are
    return dtype, shape, fortran, big


_parse_dict_cached = functools.lru_cache(maxsize=1024)(_parse_dict)


# -- shared accounting -------------------------------------------------------------------------


def _scan_pickle(
    builder: InventoryBuilder, data: Data, start: int, end: int, name: str, what: str,
    offset: int, blob_base: int | None,
) -> list[tuple[int, int]] | None:
    """Record the unsafe globals of an object array's pickle ``data[start:end]`` (it is never
    loaded) and declare the NumPy arrays it holds as tensors; ``None`` if it holds none.

    ``what`` prefixes error messages (empty for a lone ``.npy``, the member for an ``.npz``).
    ``blob_base`` is the file offset of ``data`` (0 for a map of the file, ``None`` if it was
    inflated): the arrays' data found in the pickle is then declared as storages, returned as
    (offset, bytes) holes.
    """
    from modelsize.formats._limits import ParseBudget
    from modelsize.formats._pickle import Call, PickleError, scan_all
    from modelsize.formats._torch_tree import classify

    if start >= end:
        raise builder.corrupt(f"{what}object array without the pickle of its contents", offset)
    try:
        scans = scan_all(data, offset=start, end=end,
                         budget=ParseBudget(builder.files[0].path, f"{name}'s pickle"))
    except PickleError as exc:
        named = f"; before breaking it named {', '.join(exc.unsafe)}" if exc.unsafe else ""
        raise builder.corrupt(
            f"{what}malformed object-array pickle ({exc}){named}", offset
        ) from exc
    # np.load refuses object arrays unless allow_pickle=True, because the pickle then runs with
    # full powers: every callable it names is reported, numpy's own rebuilds included.
    for scan in scans:
        for called in scan.unsafe or [str(g) for g in scan.globals]:
            builder.add_unsafe_global(called)
    builder.notes.append(
        f"{printable(name)}: object array stored as a pickle (np.load needs allow_pickle=True)"
    )
    # np.load reads one pickle: the arrays it builds are those of the first. Tensors are named
    # after the object array's items (a 0-d array's one item: its own name).
    root = scans[0].value
    state = root.state if isinstance(root, Call) else None
    if isinstance(state, tuple) and len(state) == 5 and isinstance(state[4], list):
        root = state[4][0] if len(state[4]) == 1 and state[1] == () else state[4]
    summary = classify(root, builder, prefix=(name,), blob_base=blob_base)
    return summary.blobs if summary.tensors else None


#: Decides an array's category and tags once its header is known.
Classifier = Callable[[str, NpyHeader], tuple[Category, tuple[str, ...]]]


def classify_bare(name: str, header: NpyHeader) -> tuple[Category, tuple[str, ...]]:
    """A lone ``.npy`` array: a weight whatever its dtype, unless its name says otherwise."""
    return classify_name(name, floating=True)


def classify_member(name: str, header: NpyHeader) -> tuple[Category, tuple[str, ...]]:
    """An ``.npz`` member: by name and dtype, like an entry of a state dict."""
    return classify_name(name, header.dtype.floating)


def _declare_array(
    builder: InventoryBuilder, name: str, header: NpyHeader, classify: Classifier,
    storage: str | None,
) -> None:
    category, tags = classify(name, header)
    dt = header.dtype
    if dt.structured:
        builder.notes.append(
            f"{printable(name)}: structured dtype counted as {dt.itemsize}-byte records ({dt.name})"
        )
    strides = None
    if header.fortran and len(header.shape) > 1:
        strides, step = [], 1
        for d in header.shape:
            strides.append(step)
            step *= max(d, 1)
    builder.add_tensor(
        name, dt.name, header.shape, category, storage=storage, tags=tags, itemsize=dt.itemsize,
        strides=strides,
    )


class _Prefixes:
    """``read_prefix`` functions for streams of one file, read through one open handle (an
    archive of 200,000 arrays is not opened 400,000 times). The first read of a stream takes
    :data:`_AHEAD` bytes: nearly every header is inside them."""

    _AHEAD = 512

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_RDONLY)

    def close(self) -> None:
        """Close the handle."""
        os.close(self.fd)

    def at(self, offset: int, limit: int) -> Callable[[int], bytes]:
        """``read_prefix`` for the ``limit`` bytes at ``offset``."""
        ahead = os.pread(self.fd, min(self._AHEAD, limit), offset)

        def read_prefix(n: int) -> bytes:
            n = min(n, limit)
            return ahead[:n] if n <= len(ahead) else os.pread(self.fd, n, offset)

        return read_prefix


def _account_plain(
    builder: InventoryBuilder, prefixes: _Prefixes, name: str, start: int, length: int,
    classify: Classifier, member: _zip.Member | None = None,
) -> None:
    """An uncompressed ``.npy`` stream at ``start`` of ``length`` bytes: header, data, rest.

    ``member`` is the stored ``.npz`` member holding the stream, if any: an object array's
    pickle is then CRC-checked with its member; messages name it.
    """
    path = builder.files[0].path
    try:
        header = parse_header(prefixes.at(start, length), length)
    except ValueError as exc:
        raise builder.corrupt(f"{_member(member)}{exc}", start) from exc
    what = _member(member) if header.dtype.has_object else ""
    builder.add_region(start, header.nbytes, Category.METADATA, f"npy header of {name}")
    data_start, rest = start + header.nbytes, length - header.nbytes
    if header.dtype.has_object:
        if member is not None:
            _zip.check_members(path, [member], builder)
        # Parsed in place, in a map of the file: only the pages the parser touches are read.
        data: Data = b""
        if rest:
            with open(path, "rb") as fh:
                data = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        holes = _scan_pickle(builder, data, data_start, data_start + rest, name, what,
                             data_start, 0)
        if holes is None:
            builder.add_region(data_start, rest, Category.OTHER, f"pickled object array {name}")
            _declare_array(builder, name, header, classify, None)
        else:
            _account_pickle(builder, data_start, rest, name, holes)
        return
    need = header.data_nbytes
    if need > rest:
        raise builder.corrupt(
            f"{_member(member)}shape {header.shape} of {header.dtype.name} needs {need} bytes "
            f"of data, only {rest} follow the header", data_start,
        )
    # Big-endian data is "encoded": the reader's storage_chunks swaps it to little-endian.
    builder.add_storage(name, data_start, need, dtype=header.dtype.name,
                        compressed=header.big_endian)
    _declare_array(builder, name, header, classify, name)
    if rest > need:
        builder.add_region(data_start + need, rest - need, Category.OTHER, f"after {name}")
        builder.notes.append(f"{printable(name)}: {rest - need} bytes after the array data")


def _account_pickle(
    builder: InventoryBuilder, start: int, length: int, name: str, holes: list[tuple[int, int]]
) -> None:
    """An object array's pickle that holds arrays: their data are storages (declared), the
    rest is the pickle's structure (metadata)."""
    from modelsize.formats._torch_tree import add_pickle_region

    add_pickle_region(
        builder, start, start + length, Category.METADATA, f"pickled object array {name}", holes
    )


# -- decoding storages for slim ----------------------------------------------------------------

_DECODE_CHUNK = 8 << 20


def _swap(data: bytes, itemsize: int) -> bytes:
    """Big-endian elements to little-endian (complex numbers swap each half)."""
    import array

    if itemsize in (16, 32):  # complex: two floats per element, each swapped
        itemsize //= 2
    codes = {2: "H", 4: "I", 8: "Q"}
    code = next((c for c in codes.values() if array.array(c).itemsize == itemsize), None)
    if itemsize <= 1 or code is None:
        return data
    arr = array.array(code)
    arr.frombytes(data)
    arr.byteswap()
    return arr.tobytes()


def storage_chunks(inv: Inventory, storage: StorageRecord) -> Iterator[bytes]:
    """The little-endian data of an encoded storage: a deflated member (its ``.npy`` header
    skipped) or big-endian data, a chunk at a time."""
    from modelsize.formats._torch_tree import LATIN1_KEY, latin1_chunks

    if storage.key.startswith(LATIN1_KEY):  # an array inside an object array's pickle
        yield from latin1_chunks(inv, storage)
        return
    path = inv.files[storage.file].path
    if inv.format == "npy" or not _deflated(path, storage.key):
        itemsize = _itemsize_of(storage.dtype)
        with open(path, "rb") as fh:
            fh.seek(storage.offset)
            left = storage.nbytes
            while left:
                data = fh.read(min(left, _DECODE_CHUNK - _DECODE_CHUNK % itemsize))
                if not data:
                    raise ValueError(f"{path}: storage {storage.key} ends early")
                left -= len(data)
                yield _swap(data, itemsize)
        return
    member = _zip.Member(storage.key, storage.offset, storage.offset, storage.nbytes, 0,
                         _zip.DEFLATED, 0)

    def corrupt(reason: str) -> CorruptFileError:
        return CorruptFileError(path, inv.format, f"member {printable(storage.key)}.npy: "
                                f"{reason}", storage.offset)

    try:
        header = parse_header(_inflate_prefix(path, member), 1 << 62)
    except (ValueError, zlib.error) as exc:
        raise corrupt(str(exc)) from exc
    itemsize = header.dtype.itemsize
    d = zlib.decompressobj(-15)
    skip = header.nbytes
    carry = b""
    given = 0
    with open(path, "rb") as fh:
        fh.seek(storage.offset)
        left = storage.nbytes
        while left or d.unconsumed_tail:
            raw = d.unconsumed_tail or fh.read(min(left, 1 << 20))
            if not d.unconsumed_tail:
                left -= len(raw)
            if not raw:
                break
            try:
                out = d.decompress(raw, _DECODE_CHUNK)
            except zlib.error as exc:
                raise corrupt(f"its deflate stream is damaged ({exc})") from exc
            if skip:
                cut = min(skip, len(out))
                out, skip = out[cut:], skip - cut
            out = carry + out
            whole = len(out) - len(out) % max(1, itemsize)
            carry = out[whole:]
            if whole:
                given += whole
                yield _swap(out[:whole], itemsize) if header.big_endian else out[:whole]
            if d.eof:
                break
    given += len(carry)
    if given < storage.logical_nbytes:
        raise corrupt(f"inflates to {given} bytes of array data, its header needs "
                      f"{storage.logical_nbytes} (np.load refuses it)")
    if carry:
        yield carry


_DEFLATED_CACHE: dict[tuple[str, int, int], frozenset[str]] = {}


def _deflated(path: Path, key: str) -> bool:
    """Whether the ``.npz`` member holding storage ``key`` is deflated (cached per file)."""
    st = path.stat()
    cache_key = (str(path), st.st_mtime_ns, st.st_size)
    names = _DEFLATED_CACHE.get(cache_key)
    if names is None:
        names = frozenset(i.filename.removesuffix(".npy") for i in _zip.directory(path)
                          if i.compress_type == zipfile.ZIP_DEFLATED)
        _DEFLATED_CACHE.clear()
        _DEFLATED_CACHE[cache_key] = names
    return key in names


def _itemsize_of(dtype: str | None) -> int:
    from modelsize.dtypes import DTYPES

    dt = DTYPES.get(dtype or "")
    return dt.block_bytes if dt is not None and dt.block == 1 else 1


# -- .npy --------------------------------------------------------------------------------------


class NpyReader:
    """A single array saved with ``np.save``."""

    name: str = "npy"
    extensions: tuple[str, ...] = (".npy",)

    def sniff(self, source: Source) -> bool:
        """The ``\\x93NUMPY`` magic."""
        return source.kind == "file" and source.head[:6] == MAGIC

    storage_chunks = staticmethod(storage_chunks)

    def read(self, source: Source) -> Inventory:
        """Header, data and any trailing bytes of the array."""
        builder = InventoryBuilder(self.name, [source.path], root=source.path)
        prefixes = _Prefixes(source.path)
        try:
            _account_plain(builder, prefixes, source.path.stem, 0, builder.files[0].nbytes,
                           classify_bare)
        finally:
            prefixes.close()
        return builder.build()


# -- .npz --------------------------------------------------------------------------------------


def _member(m: _zip.Member | None) -> str:
    """How messages about ``m`` begin (nothing for a lone ``.npy``)."""
    return f"member {printable(m.name)!r}: " if m is not None else ""


def _inflate_prefix(path: Path, member: _zip.Member) -> Callable[[int], bytes]:
    """``read_prefix`` for a deflated member: inflates only as far as asked (the first call
    inflates :data:`_Prefixes._AHEAD` bytes, which later short reads are served from)."""
    ahead: list[bytes] = []

    def inflate(n: int) -> bytes:
        d = zlib.decompressobj(-15)
        out = bytearray()
        with open(path, "rb") as fh:
            fh.seek(member.data_offset)
            left = member.compress_size
            pending = b""
            while len(out) < n:
                if not pending:
                    if left == 0:
                        break
                    pending = fh.read(min(left, 1 << 16))
                    if not pending:
                        break
                    left -= len(pending)
                out += d.decompress(pending, n - len(out))
                pending = d.unconsumed_tail
                if d.eof:
                    break
        return bytes(out)

    def read_prefix(n: int) -> bytes:
        if not ahead:
            ahead.append(inflate(_Prefixes._AHEAD))
        if n <= len(ahead[0]) or len(ahead[0]) < _Prefixes._AHEAD:
            return ahead[0][:n]
        return inflate(n)

    return read_prefix


class NpzReader:
    """A zip of ``.npy`` members written by ``np.savez`` or ``np.savez_compressed``."""

    name: str = "npz"
    extensions: tuple[str, ...] = (".npz",)

    def sniff(self, source: Source) -> bool:
        """A zip archive whose members are all ``.npy`` arrays."""
        if source.kind != "file" or not source.is_zip:
            return False
        names = [n for n in source.zip_names() if not n.endswith("/")]
        return bool(names) and all(n.endswith(".npy") for n in names)

    storage_chunks = staticmethod(storage_chunks)

    def read(self, source: Source) -> Inventory:
        """Zip structures as metadata, each member as header plus storage."""
        builder = InventoryBuilder(self.name, [source.path], root=source.path)
        items = _zip.members(source.path, builder, infos=source.zip_infos(), names=True)
        _zip.account_headers(builder, items)
        prefixes = _Prefixes(source.path)
        try:
            with paused_gc():
                self._account_members(builder, source.path, prefixes, items)
        finally:
            prefixes.close()
        return builder.build()

    def _account_members(self, builder: InventoryBuilder, path: Path, prefixes: _Prefixes,
                         items: list[_zip.Member]) -> None:
        for m in items:
            if m.name.endswith("/") and m.compress_size == 0:
                continue
            name = m.name.removesuffix(".npy")
            if not m.name.endswith(".npy"):
                builder.add_region(m.data_offset, m.compress_size, Category.OTHER, m.name)
                builder.notes.append(f"member {printable(m.name)!r} is not an array")
                continue
            if m.method == _zip.STORED:
                _account_plain(
                    builder, prefixes, name, m.data_offset, m.compress_size, classify_member, m
                )
            elif m.method == _zip.DEFLATED:
                self._account_deflated(builder, path, m, name)
            else:
                raise builder.corrupt(
                    f"member {printable(m.name)!r} uses compression method {m.method}; "
                    "np.load reads stored and deflated members", m.header_offset,
                )

    def _account_deflated(
        self, builder: InventoryBuilder, path: Path, m: _zip.Member, name: str
    ) -> None:
        try:
            header = parse_header(_inflate_prefix(path, m), m.file_size)
        except zlib.error as exc:
            raise builder.corrupt(f"{_member(m)}its deflate stream is damaged ({exc})",
                                  m.data_offset) from exc
        except ValueError as exc:
            raise builder.corrupt(f"{_member(m)}{exc}", m.data_offset) from exc
        if header.dtype.has_object:
            data = _zip.read_member(path, m, builder)
            # Inflated: the arrays inside have no place in the file, the member holds them.
            holes = _scan_pickle(
                builder, data, header.nbytes, len(data), name, _member(m), m.data_offset, None
            )
            builder.add_region(
                m.data_offset, m.compress_size, Category.OTHER, f"pickled object array {name}"
            )
            if holes is None:
                _declare_array(builder, name, header, classify_member, None)
            return
        need = header.data_nbytes
        if header.nbytes + need > m.file_size:
            raise builder.corrupt(
                f"{_member(m)}shape {header.shape} of {header.dtype.name} needs {need} "
                f"bytes after its {header.nbytes}-byte header, the member inflates to "
                f"{m.file_size}",
                m.data_offset,
            )
        if header.nbytes + need < m.file_size:
            builder.notes.append(
                f"{printable(name)}: {m.file_size - header.nbytes - need} bytes after the array "
                "data (compressed with it, so counted with it)"
            )
        # The compressed header cannot be told apart from the compressed data: the whole
        # member is the storage, its logical size the array's.
        builder.add_storage(
            name, m.data_offset, m.compress_size, logical_nbytes=need, compressed=True,
            dtype=header.dtype.name,
        )
        _declare_array(builder, name, header, classify_member, name)
