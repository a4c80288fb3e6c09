"""The framework-free data model every reader produces and every feature consumes.

An :class:`Inventory` partitions every byte of a checkpoint's files into :class:`Category`
buckets. Bytes are accounted in two kinds of pieces:

* a :class:`StorageRecord` is a run of file bytes holding tensor data; the
  :class:`TensorRecord` s viewing it decide its category (bytes no view reaches are
  ``unused_storage``, bytes identical to an earlier storage are ``duplicates``);
* a :class:`Region` is any other byte range (headers, pickles, zip structures, graph).

Readers never compute totals: they describe what they found to an :class:`InventoryBuilder`,
which fills the gaps, resolves shared storages and duplicates, and derives the totals once.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import itertools
import math
import operator
import os
import re
import zlib
from array import array
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

from modelsize._records import field, fields_of, record
from modelsize.categories import PRECEDENCE, Category, empty_totals
from modelsize.dtypes import DTYPES, DType, canonical, numel
from modelsize.errors import AccountingError, CorruptFileError

#: Whether building an inventory may read tensor bytes (the duplicate search does): off for a
#: sparse mirror of a remote file (:mod:`modelsize.remote`), whose tensor bytes are holes.
READ_DATA: ContextVar[bool] = ContextVar("modelsize_read_data", default=True)
#: Where the duplicate search goes when READ_DATA is off: ``compare(builder, candidates,
#: storages) -> {key: original key}`` for the candidate groups ``(dtype, keys)`` (a remote
#: file's sampled ranges, fetched by range requests); None: no duplicate search.
SAMPLED_DUPLICATES: ContextVar[Callable[[InventoryBuilder, list[tuple[str, list[str]]],
                                         Mapping[str, StorageRecord]], dict[str, str]] | None]
SAMPLED_DUPLICATES = ContextVar("modelsize_sampled_duplicates", default=None)


@record(frozen=True)
class FileInfo:
    """One file of a (possibly multi-file) checkpoint."""

    path: Path
    nbytes: int


@record(frozen=True, slots=True)
class Region:
    """A byte range of one file that holds no tensor data."""

    file: int
    offset: int
    nbytes: int
    category: Category
    label: str


class Charges(Mapping[Category, int]):
    """A storage's bytes by category when one category has them all: ``{category: nbytes}``
    without a dict (a checkpoint has one per storage, a million for some)."""

    __slots__ = ("category", "nbytes")

    def __init__(self, category: Category, nbytes: int) -> None:
        self.category = category
        self.nbytes = nbytes

    def __getitem__(self, key: Category) -> int:
        if key is self.category or key == self.category:
            return self.nbytes
        raise KeyError(key)

    def __iter__(self) -> Iterator[Category]:
        yield self.category

    def __len__(self) -> int:
        return 1

    def __repr__(self) -> str:
        return f"{{{self.category!r}: {self.nbytes}}}"


#: The bytes by category of an empty storage.
_NO_CHARGES: Mapping[Category, int] = MappingProxyType({})


@record(frozen=True, slots=True)
class StorageRecord:
    """A run of file bytes holding the data of one saved storage (or one tensor).

    ``nbytes`` is what it occupies in the file; ``logical_nbytes`` what it holds once
    decompressed (equal unless ``compressed``). ``compressed`` means the file bytes are not the
    raw little-endian data (deflated, big-endian, text, varints...): only the format's reader
    can decode them (``storage_chunks``). ``bytes_by_category`` is filled by the builder (a
    read-only mapping: a dict, or :class:`Charges` when one category has every byte).
    """

    key: str
    file: int
    offset: int
    nbytes: int
    logical_nbytes: int
    compressed: bool = False
    dtype: str | None = None
    bytes_by_category: Mapping[Category, int] = field(default_factory=dict, compare=False)
    duplicate_of: str | None = None


@record(frozen=True, slots=True)
class TensorRecord:
    """One tensor as named in the file.

    ``nbytes`` is the logical size (``numel * itemsize``); ``stored_nbytes`` the file bytes
    this record is charged with (0 for a second view of a shared storage, the compressed size
    for a compressed member). ``storage_offset`` is in bytes; ``strides`` in elements, ``None``
    for a C-contiguous tensor. ``container`` is the part of the name before the key the framework
    loads: ``model.`` for ``model.fc1.weight`` in ``{"model": state_dict, "optimizer": ...}``,
    ``shard.bin:`` for a tensor of a merged multi-file checkpoint, empty when the name is the
    key.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    category: Category
    nbytes: int
    stored_nbytes: int = 0
    storage: str | None = None
    storage_offset: int = 0
    tags: tuple[str, ...] = ()
    duplicate_of: str | None = None
    strides: tuple[int, ...] | None = None
    container: str = ""

    @property
    def key(self) -> str:
        """The name without its container: what ``load_state_dict`` expects."""
        if self.container and self.name.startswith(self.container):
            return self.name[len(self.container) :]
        return self.name

    @property
    def numel(self) -> int:
        """Number of elements."""
        return numel(self.shape)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (the schema documented in the README)."""
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "nbytes": self.nbytes,
            "stored_nbytes": self.stored_nbytes,
            "category": self.category.value,
            "storage": self.storage,
            "tags": list(self.tags),
            "duplicate_of": self.duplicate_of,
        }


@record(frozen=True)
class Inventory:
    """Everything a reader learnt about a checkpoint, with totals derived once.

    ``unsafe_globals`` lists every callable a pickle in the file would import and call that is
    not a known-safe rebuild function (``posix.system``, ``__main__.Net``...).
    """

    format: str
    files: tuple[FileInfo, ...]
    tensors: tuple[TensorRecord, ...]
    storages: tuple[StorageRecord, ...]
    regions: tuple[Region, ...]
    unsafe_globals: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    facts: dict[str, str] = field(default_factory=dict)
    bytes_by_category: dict[Category, int] = field(init=False)
    file_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        totals = empty_totals()
        for region in self.regions:
            totals[region.category] += region.nbytes
        for storage in self.storages:
            charges = storage.bytes_by_category
            if type(charges) is Charges:
                totals[charges.category] += charges.nbytes
                continue
            for cat, n in charges.items():
                totals[cat] += n
        file_bytes = sum(f.nbytes for f in self.files)
        if sum(totals.values()) != file_bytes:
            raise AccountingError(
                f"{self.format} inventory of {self.files[0].path if self.files else '?'}: "
                f"categories add up to {sum(totals.values())} bytes, files hold {file_bytes}"
            )
        object.__setattr__(self, "bytes_by_category", totals)
        object.__setattr__(self, "file_bytes", file_bytes)

    @property
    def path(self) -> Path:
        """The path the user gave (first file, or the directory for multi-file checkpoints)."""
        return Path(self.facts.get("path", str(self.files[0].path if self.files else "")))

    def tensors_in(self, *categories: Category) -> list[TensorRecord]:
        """Tensors of the given categories, in file order."""
        wanted = set(categories)
        return [t for t in self.tensors if t.category in wanted]


#: Runs of elements one strided view is listed by. Past it, a view whose elements do not
#: overlap keeps its exact byte count but is merged with other views of its storage as its whole
#: span, and a self-overlapping one is taken as its span: overestimates, each with a note.
MAX_RUNS = 1 << 16


class _View:
    """The bytes of its storage that tensor ``record_index`` reaches.

    ``start..stop`` is the span from its first to its last byte and ``nbytes`` the bytes its
    elements occupy in it. ``runs`` lists them as sorted, disjoint ``(start, stop)`` byte
    ranges, listed on demand (:meth:`listed`): a view alone in its part of a storage is charged
    ``nbytes`` without them. ``layout`` (shape, strides, byte offset, element size) is kept for
    that of a strided view. ``approximate`` says an overestimate was made.
    """

    __slots__ = (
        "approximate", "category", "layout", "nbytes", "record_index", "runs", "start", "stop",
    )

    def __init__(
        self,
        record_index: int,
        category: Category,
        start: int,
        stop: int,
        nbytes: int,
        layout: tuple[tuple[int, ...], tuple[int, ...], int, int] | None = None,
        approximate: bool = False,
    ) -> None:
        self.record_index = record_index
        self.category = category
        self.start = start
        self.stop = stop
        self.nbytes = nbytes
        self.layout = layout
        self.approximate = approximate
        self.runs: list[tuple[int, int]] | None = None

    def listed(self) -> list[tuple[int, int]]:
        """Its byte runs; past :data:`MAX_RUNS` of them, its span (an overestimate)."""
        if self.runs is not None:
            return self.runs
        if self.layout is None:
            self.runs = [(self.start, self.stop)]
            self.approximate = self.approximate or self.nbytes != self.stop - self.start
            return self.runs
        shape, strides, offset, size = self.layout
        first, stop, runs, count, approximate = element_runs(shape, strides, MAX_RUNS)
        self.nbytes, self.approximate = count * size, approximate
        if runs is None:  # too many to list: the span stands for them
            runs, self.approximate = [(first, stop)], True
        self.runs = [(offset + a * size, offset + b * size) for a, b in runs]
        return self.runs

    def clip(self, size: int) -> None:
        """Keep only what lies inside a storage of ``size`` bytes."""
        self.runs = [(max(a, 0), min(b, size)) for a, b in self.listed() if b > 0 and a < size]
        self.start, self.stop = max(0, self.start), max(0, min(size, self.stop))
        self.nbytes = sum(b - a for a, b in self.runs)


_Record = TypeVar("_Record", Region, StorageRecord, TensorRecord)

#: Parts of quantized layouts a loader needs under every module's name even where their bytes
#: are equal: the NF4 code table of every bitsandbytes layer (``quant_map``), GPTQ's ``g_idx``
#: without act-order, compressed-tensors' ``weight_shape``. They are never duplicates: dropping
#: one breaks the load (see :mod:`modelsize.quantization`).
LAYOUT_PARTS = re.compile(
    r"(?:^|[./])(?:quant_map|nested_quant_map|quant_state|weight_shape|g_idx|weight_g_idx"
    r"|weight_format)(?=[./]|$)")


#: Words one of which every name of :data:`LAYOUT_PARTS` holds.
_LAYOUT_WORDS = ("quant", "shape", "g_idx", "_format")


def is_layout_part(name: str) -> bool:
    """Whether ``name`` is one of :data:`LAYOUT_PARTS` (substrings tried first: a million
    names cost no regex search)."""
    return (("quant" in name or "shape" in name or "g_idx" in name or "_format" in name)
            and LAYOUT_PARTS.search(name) is not None)


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """The cyclic garbage collector paused: building a million records would otherwise set it
    off again and again, each time walking every record made so far (the records hold no
    cycles; reference counting frees them)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _maker(cls: type[_Record]) -> Callable[..., _Record]:
    """A function making a frozen, slotted record from all its fields, positionally.

    A frozen dataclass's ``__init__`` sets each field through ``object.__setattr__``: for the
    million records of a large checkpoint that is most of the time spent reading it. The
    record is made as an instance of a plain twin class with the same slots (so the same
    memory layout), its fields set as ordinary attributes, and then given its class: three
    times faster, and the result is in every way the frozen record. Only for records without
    ``__post_init__``.
    """
    names = list(fields_of(cls))
    if tuple(names) != cls.__slots__:  # type: ignore[attr-defined]
        raise TypeError(f"{cls.__name__}: fields and slots differ")
    twin = type(f"_{cls.__name__}Twin", (), {"__slots__": cls.__slots__})  # type: ignore[attr-defined]
    args = ", ".join(f"a{i}" for i in range(len(names)))
    body = "".join(f"    o.{n} = a{i}\n" for i, n in enumerate(names))
    env: dict[str, Any] = {"new": object.__new__, "twin": twin, "cls": cls}
    exec(f"def make({args}):\n    o = new(twin)\n{body}    o.__class__ = cls\n    return o\n",
         env)
    make: Callable[..., _Record] = env["make"]
    make.__doc__ = f"A {cls.__name__} from its fields: {', '.join(names)}."
    return make


def _setter(cls: type, name: str) -> Callable[[Any, Any], None]:
    """Sets one field of a record the builder made and has not handed out yet (the records
    are frozen for everyone else)."""
    setter: Callable[[Any, Any], None] = cls.__dict__[name].__set__
    return setter


_region = _maker(Region)
_storage = _maker(StorageRecord)
_tensor = _maker(TensorRecord)
_set_charges = _setter(StorageRecord, "bytes_by_category")
_set_original = _setter(StorageRecord, "duplicate_of")
_set_stored = _setter(TensorRecord, "stored_nbytes")
_set_category = _setter(TensorRecord, "category")
_set_duplicate = _setter(TensorRecord, "duplicate_of")

#: Shapes are shared between the tensors that have them; past this many distinct ones, new
#: shapes are no longer remembered.
_MAX_SHAPES = 1 << 16
#: A block of one byte-sized element: the layout of dtypes outside the table.
_BYTE = (1, 1)


class InventoryBuilder:
    """Collects what a reader finds and turns it into an :class:`Inventory`.

    The builder owns the accounting rules shared by all formats: gaps between described byte
    ranges are ``default`` (normally metadata), bytes of a storage reached by no view are
    ``unused_storage``, overlapping views count once (by :data:`PRECEDENCE`), and storages
    whose bytes equal an earlier storage's are ``duplicates``.

    Each declared tensor and storage becomes its record at once (one object each, whatever
    the checkpoint's size); :meth:`build` fills in what only the whole can tell (bytes by
    category, stored bytes, duplicates) before the records are handed out.
    """

    def __init__(self, format: str, paths: Iterable[str | Path], *, root: str | Path | None = None):
        self.format = format
        self.files: list[FileInfo] = []
        for p in paths:
            path = Path(p)
            self.files.append(FileInfo(path, path.stat().st_size))
        self._regions: list[Region] = []
        self._storages: dict[str, StorageRecord] = {}
        #: CRC-32 of a storage's bytes where the file records one (zip members).
        self._crc: dict[str, int] = {}
        self._tensors: list[TensorRecord] = []
        #: How many storages (each with its tensor) :meth:`add_whole_tensors` declared: where
        #: that is every storage and every tensor, tensor ``i`` is storage ``i``'s one view,
        #: whole and contiguous, and :meth:`build` takes the shortcuts of that case.
        self._whole = 0
        #: (first tensor, count) of each add_whole_tensors call: its tensors come with their
        #: stored bytes and storages with their charges, as build gives them in that case.
        self._whole_spans: list[tuple[int, int]] = []
        self._whole_charges: dict[Category, dict[int, Charges]] = {}
        #: (elements, bytes) per block of the tensors whose dtype is packed or not in the
        #: table (by index): what their strided views are counted in.
        self._blocks: dict[int, tuple[int, int]] = {}
        #: Each distinct shape once, shared by the tensors that have it.
        self._shapes: dict[tuple[int, ...], tuple[int, ...]] = {}
        #: dtype as a reader spells it -> (canonical name, DType), for dtypes in the table.
        self._dtypes: dict[str, tuple[str, DType]] = {}
        self._unsafe: dict[str, None] = {}
        self.notes: list[str] = []
        self.facts: dict[str, str] = {}
        if root is not None:
            self.facts["path"] = str(root)
        #: What the reader parsed, for the message when storages are left without tensors
        #: (the tree walker of pickled checkpoints sets ``pickle``).
        self.layout = "file"

    # -- what readers call -------------------------------------------------------------
    def corrupt(self, reason: str, offset: int | None = None, file: int = 0) -> CorruptFileError:
        """A :class:`CorruptFileError` for this file (raise it)."""
        return CorruptFileError(self.files[file].path, self.format, reason, offset)

    def check_range(self, offset: int, nbytes: int, what: str, file: int = 0) -> None:
        """Refuse a declared byte range that does not fit in the file."""
        size = self.files[file].nbytes
        if offset < 0 or nbytes < 0 or offset + nbytes > size:
            raise self.corrupt(
                f"{what} claims bytes {offset}..{offset + nbytes} but the file has {size}",
                offset,
                file,
            )

    def add_region(
        self, offset: int, nbytes: int, category: Category, label: str, file: int = 0
    ) -> None:
        """Declare a non-tensor byte range."""
        if nbytes == 0:
            return
        self.check_range(offset, nbytes, label, file)
        self._regions.append(_region(file, offset, nbytes, category, label))

    def add_regions(self, file: int, regions: Iterable[tuple[int, int, Category, str]]) -> None:
        """:meth:`add_region` of each ``(offset, nbytes, category, label)``, in one call."""
        size = self.files[file].nbytes
        append = self._regions.append
        region = _region
        for offset, nbytes, category, label in regions:
            if nbytes == 0:
                continue
            if offset < 0 or nbytes < 0 or offset + nbytes > size:
                self.check_range(offset, nbytes, label, file)  # raises, naming it
            append(region(file, offset, nbytes, category, label))

    def add_storage(
        self,
        key: str,
        offset: int,
        nbytes: int,
        *,
        file: int = 0,
        logical_nbytes: int | None = None,
        compressed: bool = False,
        dtype: str | None = None,
        crc32: int | None = None,
    ) -> None:
        """Declare the file bytes of one storage. Keys are unique within the inventory.

        ``crc32`` is the CRC-32 the file records for the storage's (uncompressed) bytes, if
        any: storages whose CRCs differ cannot be duplicates, and are never read to find out.
        """
        if offset < 0 or nbytes < 0 or offset + nbytes > self.files[file].nbytes:
            self.check_range(offset, nbytes, f"storage {key}", file)  # raises, naming it
        if key in self._storages:
            raise self.corrupt(f"storage {key!r} declared twice", offset, file)
        if crc32 is not None:
            self._crc[key] = crc32
        self._storages[key] = _storage(
            key, file, offset, nbytes, nbytes if logical_nbytes is None else logical_nbytes,
            compressed, dtype, _NO_CHARGES, None,
        )

    def has_storage(self, key: str) -> bool:
        """Whether a storage with this key was declared."""
        return key in self._storages

    def add_tensor(
        self,
        name: str,
        dtype: str,
        shape: Iterable[int],
        category: Category,
        *,
        storage: str | None = None,
        storage_offset: int = 0,
        strides: Iterable[int] | None = None,
        tags: Iterable[str] = (),
        itemsize: int | None = None,
        container: str = "",
    ) -> None:
        """Declare a tensor; ``storage_offset`` is in elements, ``strides`` in elements.

        A tensor without ``storage`` holds no file bytes of its own (e.g. a meta tensor).
        ``itemsize`` gives the bytes per element of a dtype outside the table (NumPy strings,
        structured records); without it such a dtype is sized 0 with a note.
        """
        # A shape met before is taken as it was normalised then (equal tuples hash alike).
        shared = self._shapes.get(shape) if type(shape) is tuple else None  # type: ignore[arg-type]
        shape_t = shared if shared is not None else self._shared(tuple(map(int, shape)))
        known = self._dtypes.get(dtype)
        dt: DType | None
        if known is not None:
            dt_name, dt = known
        else:
            dt_name = dtype if dtype in DTYPES else canonical(dtype) or dtype
            dt = DTYPES.get(dt_name)
            if dt is not None:
                self._dtypes[dtype] = (dt_name, dt)
            elif itemsize is not None:
                dt = DType(dt_name, 1, int(itemsize))
        n = math.prod(shape_t)
        if dt is None:
            nbytes = 0
            self.notes.append(f"unknown dtype {dtype!r} for {name}: size taken as 0")
            self._blocks[len(self._tensors)] = (1, 0)
        else:
            block, block_bytes = dt.block, dt.block_bytes
            nbytes = n * block_bytes if block == 1 else -(-n // block) * block_bytes
            if block != 1 or dt_name not in DTYPES:
                self._blocks[len(self._tensors)] = (block, block_bytes)
        strides_t = tuple(map(int, strides)) if strides is not None else None
        if strides_t is not None and (not n or is_contiguous(shape_t, strides_t)):
            strides_t = None
        offset_bytes = dt.nbytes(int(storage_offset)) if dt and storage_offset else 0
        self._tensors.append(_tensor(
            name, dt_name, shape_t, category, nbytes, 0, storage, offset_bytes,
            tags if type(tags) is tuple else tuple(tags), None, strides_t, container,
        ))

    def add_plain_tensor(
        self, name: str, dtype: str, shape: tuple[int, ...], nbytes: int, category: Category,
        storage: str, offset_bytes: int, strides: tuple[int, ...] | None,
        tags: tuple[str, ...], container: str,
    ) -> None:
        """:meth:`add_tensor` of a tensor the reader has checked: ``dtype`` canonical, of one
        element per block; ``shape`` and ``strides`` tuples of ints, ``strides`` None where the
        view is contiguous (or empty); ``nbytes`` and the offset in bytes."""
        self._tensors.append(_tensor(name, dtype, self._shared(shape), category, nbytes, 0,
                                     storage, offset_bytes, tags, None, strides, container))

    def _shared(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The one tuple kept for shapes equal to ``shape`` (it, the first time it is met)."""
        shared = self._shapes.get(shape)
        if shared is not None:
            return shared
        if len(self._shapes) < _MAX_SHAPES:
            self._shapes[shape] = shape
        return shape

    def add_whole_tensors(
        self,
        file: int,
        start: int,
        keys: Sequence[str],
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[tuple[int, ...]],
        begins: Sequence[int],
        ends: Sequence[int],
        classes: Sequence[tuple[Category, tuple[str, ...]]],
    ) -> None:
        """Declare tensors each alone in a storage of its own, contiguous, from columns:
        what :meth:`add_storage` and :meth:`add_tensor` declare for each, in one pass.

        Tensor ``i`` is named ``names[i]``, has storage ``keys[i]`` at bytes
        ``start + begins[i] .. start + ends[i]`` of file ``file``, and its category and tags are
        ``classes[i]``. The caller has checked what the general methods check per tensor: each
        dtype is canonical (a key of :data:`~modelsize.dtypes.DTYPES`) and each span holds
        exactly the shape's bytes (a safetensors header, validated). Ranges and keys are
        checked here, the ranges at once.
        """
        size = self.files[file].nbytes
        count = len(keys)
        if count and not (start >= 0 and start + max(ends) <= size and min(begins) >= 0):
            for key, begin, end in zip(keys, begins, ends, strict=True):
                self.check_range(start + begin, end - begin, f"storage {key}", file)
        storages = self._storages
        if storages and not storages.keys().isdisjoint(keys):
            self._declared_twice(keys, begins, start, file, set(storages))
        before = len(storages)
        storage = _storage
        no_charges = _NO_CHARGES
        # Each storage is charged here what build would charge it were it the one whole view's
        # (its tensor stores its bytes below): Charges shared by a size and category.
        shared = self._whole_charges
        category: Category | None = None
        same_size: dict[int, Charges] = {}
        charges: Mapping[Category, int]
        for key, dtype, begin, end, cls in zip(keys, dtypes, begins, ends, classes, strict=True):
            nbytes = end - begin
            if nbytes:
                if cls[0] is not category:
                    category = cls[0]
                    same_size = shared.setdefault(category, {})
                one = same_size.get(nbytes)
                if one is None:
                    one = Charges(category, nbytes)
                    if len(same_size) < 1 << 16:
                        same_size[nbytes] = one
                charges = one
            else:
                charges = no_charges
            storages[key] = storage(key, file, start + begin, nbytes, nbytes, False, dtype,
                                    charges, None)
        if len(storages) != before + count:
            self._declared_twice(keys, begins, start, file, set())
        tensors = self._tensors
        first = len(tensors)
        self._whole += count
        self._whole_spans.append((first, count))
        tensor = _tensor
        tensors.extend([
            tensor(name, dtype, shape, cls[0], end - begin, end - begin, key, 0, cls[1], None,
                   None, "")
            for name, dtype, shape, begin, end, key, cls in zip(
                names, dtypes, shapes, begins, ends, keys, classes, strict=True)
        ])
        packed = {d: (dt.block, dt.block_bytes) for d in set(dtypes)
                  if (dt := DTYPES[d]).block != 1}
        if packed:
            for i, dtype in enumerate(dtypes, first):
                if dtype in packed:
                    self._blocks[i] = packed[dtype]

    def _declared_twice(self, keys: Sequence[str], begins: Sequence[int], start: int, file: int,
                        seen: set[str]) -> None:
        """Raise for the first of ``keys`` already in ``seen`` or met twice."""
        for key, begin in zip(keys, begins, strict=True):
            if key in seen:
                raise self.corrupt(f"storage {key!r} declared twice", start + begin, file)
            seen.add(key)

    def add_unsafe_global(self, name: str) -> None:
        """Record a callable the file would import and call on load."""
        self._unsafe[name] = None

    # -- accounting --------------------------------------------------------------------
    def build(self, default: Category = Category.METADATA, *, dedupe: bool = True) -> Inventory:
        """Resolve storages, fill gaps with ``default`` and return the inventory.

        A builder builds once: the records it made are completed and handed out.
        """
        with paused_gc():
            return self._build(default, dedupe)

    def _block(self, index: int) -> tuple[int, int]:
        """(elements, bytes) per block of tensor ``index``'s dtype."""
        found = self._blocks.get(index)
        if found is not None:
            return found
        dt = DTYPES.get(self._tensors[index].dtype)
        return (dt.block, dt.block_bytes) if dt is not None else _BYTE

    def _build(self, default: Category, dedupe: bool) -> Inventory:
        tensors = self._tensors
        storages = self._storages
        # Storage key -> the index of its only view when that view is contiguous (most
        # storages: no _View is made for them), else the list of its views. ``None`` when the
        # only view of storage i is tensor i, contiguous (a safetensors file: its million
        # storages are then neither mapped nor looked up by key).
        by_storage: dict[str, int | list[_View]] | None = None
        whole = self._whole == len(storages) == len(tensors)
        if not whole and not (len(tensors) == len(storages) and all(
                t.strides is None and t.storage == key
                for t, key in zip(tensors, storages, strict=True))):
            by_storage = {}
            for i, t in enumerate(tensors):
                key = t.storage
                if key is None:
                    continue
                seen = by_storage.get(key)
                if seen is None:
                    if key not in storages:
                        raise self.corrupt(
                            f"tensor {t.name!r} refers to missing storage {key!r}")
                    by_storage[key] = i if t.strides is None else [self._view(i)]
                    continue
                if isinstance(seen, int):
                    seen = by_storage[key] = [self._view(seen)]
                seen.append(self._view(i))
            self._check_reached(by_storage)

        rank = {c: i for i, c in enumerate(PRECEDENCE)}
        approximated: list[str] = []
        unused = Category.UNUSED_STORAGE
        # Storages of one size and category share their (immutable) Charges.
        shared: dict[Category, dict[int, Charges]] = {c: {} for c in Category}
        if not whole:
            # Other views or storages too: what add_whole_tensors stored is worked out anew.
            for first, count in self._whole_spans:
                for t in tensors[first:first + count]:
                    _set_stored(t, 0)
        # Where every storage is a whole tensor's, add_whole_tensors charged them.
        for index, (key, st) in enumerate((storages if not whole else {}).items()):
            nbytes = st.nbytes
            found = index if by_storage is None else by_storage.get(key)
            charges: Mapping[Category, int]
            if type(found) is int:  # one contiguous view
                t = tensors[found]
                start, size = t.storage_offset, t.nbytes
                if st.compressed or (start == 0 and size == nbytes):
                    reached = nbytes
                else:
                    reached = max(0, min(start + size, nbytes) - max(start, 0))
                if reached:
                    _set_stored(t, t.stored_nbytes + reached)
                if reached == nbytes:
                    if not nbytes:
                        continue  # no bytes: no charges
                    same_size = shared[t.category]
                    one = same_size.get(nbytes)
                    if one is None:
                        one = Charges(t.category, nbytes)
                        if len(same_size) < 1 << 16:
                            same_size[nbytes] = one
                    charges = one
                elif reached:
                    charges = {t.category: reached, unused: nbytes - reached}
                else:
                    charges = Charges(unused, nbytes)
            elif found is None:
                if not nbytes:
                    continue
                charges = Charges(unused, nbytes)
            else:
                assert isinstance(found, list)
                charges = self._charge_views(found, nbytes, st.compressed, rank, approximated)
            _set_charges(st, charges)
        if approximated:
            more = f" and {len(approximated) - 1} more" if len(approximated) > 1 else ""
            self.notes.append(
                f"the bytes reached by {approximated[0]!r}{more} are counted up to the span of "
                f"the view where it meets other views or repeats elements: its elements form "
                f"more than {MAX_RUNS:,} separate runs, too many to list one by one "
                "(unused_storage may be understated)"
            )

        dedupe = dedupe and (READ_DATA.get() or SAMPLED_DUPLICATES.get() is not None)
        dup_of: dict[str, str] = self._find_duplicates(by_storage) if dedupe else {}
        del by_storage
        for key, original in dup_of.items():
            st = storages[key]
            totals = {Category.DUPLICATES: sum(
                n for c, n in st.bytes_by_category.items() if c != unused
            )}
            if unused in st.bytes_by_category:
                totals[unused] = st.bytes_by_category[unused]
            _set_charges(st, totals)
            _set_original(st, original)
        if dup_of:
            # A tensor of a duplicate storage duplicates the tensor viewing the original
            # storage the same way (same offset, shape, strides, dtype); none may (then it is
            # no alias).
            originals = set(dup_of.values())
            same_view: dict[tuple[Any, ...], str] = {}
            for t in tensors:
                if t.storage in originals:
                    same_view.setdefault(
                        (t.storage, t.storage_offset, t.shape, t.strides, t.dtype), t.name)
            duplicates = Category.DUPLICATES
            for t in tensors:
                if t.storage in dup_of:
                    _set_category(t, duplicates)
                    _set_duplicate(t, same_view.get((dup_of[t.storage], t.storage_offset,
                                                     t.shape, t.strides, t.dtype)))

        regions = self._regions + self._gaps(default)
        regions.sort(key=lambda r: (r.file, r.offset))
        inventory = Inventory(
            format=self.format,
            files=tuple(self.files),
            tensors=tuple(tensors),
            storages=tuple(storages.values()),
            regions=tuple(regions),
            unsafe_globals=tuple(self._unsafe),
            notes=tuple(dict.fromkeys(self.notes)),
            facts=dict(self.facts),
        )
        # Handed out: a second build would change records the inventory holds.
        self._tensors, self._storages, self._blocks = [], {}, {}
        return inventory

    def _view(self, index: int) -> _View:
        """The bytes of its storage tensor ``index`` reaches (see :func:`element_runs`)."""
        t = self._tensors[index]
        offset, nbytes, strides = t.storage_offset, t.nbytes, t.strides
        if strides is None or nbytes == 0:
            return _View(index, t.category, offset, offset + nbytes, nbytes)
        block, block_bytes = self._block(index)
        # Span and element count only (one run at most): most views need no more.
        first, stop, _, count, approximate = element_runs(t.shape, strides, 1)
        if block != 1:
            # Packed sub-byte elements share bytes: only the span can be said to be reached.
            start = offset + (first // block) * block_bytes
            span = -(-(stop - first) // block) * block_bytes
            return _View(index, t.category, start, start + span, span)
        return _View(index, t.category, offset + first * block_bytes,
                     offset + stop * block_bytes, count * block_bytes,
                     (t.shape, strides, offset, block_bytes), approximate)

    def _charge_views(
        self, views: list[_View], nbytes: int, compressed: bool, rank: dict[Category, int],
        approximated: list[str],
    ) -> dict[Category, int]:
        """The bytes by category of a storage of ``nbytes`` with several (or strided) views."""
        totals: dict[Category, int] = {}
        tensors = self._tensors
        if compressed:
            # Compressed bytes cannot be mapped to element ranges: the best view owns all.
            best = min(views, key=lambda v: (rank[v.category], v.record_index))
            totals[best.category] = nbytes
            t = tensors[best.record_index]
            _set_stored(t, t.stored_nbytes + nbytes)
            return totals
        stored: defaultdict[int, int] = defaultdict(int)
        reached = _charge(views, nbytes, rank, totals, stored)
        for index, n in stored.items():
            if n:
                t = tensors[index]
                _set_stored(t, t.stored_nbytes + n)
        approximated.extend(tensors[v.record_index].name for v in views if v.approximate)
        if nbytes > reached:
            totals[Category.UNUSED_STORAGE] = nbytes - reached
        return totals

    def _check_reached(self, by_storage: Mapping[str, object]) -> None:
        """Refuse storages left without tensors by a layout the reader did not understand.

        Whole storages that no tensor refers to, in a file where no storage (or fewer storages
        than those) is reached, are a parser's failure, not a finding: reported as
        ``unused_storage``, they would have the user slim the model away.
        """
        if len(by_storage) * 2 >= len(self._storages):
            return  # at least as many reached as could be unreached
        unreached = [k for k, st in self._storages.items() if st.nbytes and k not in by_storage]
        if not unreached or len(unreached) <= len(by_storage):
            return
        if not by_storage:
            n = len(unreached)
            what = f"{n} storages but no tensor refers to them" if n > 1 else (
                "1 storage but no tensor refers to it")
        else:
            what = (f"{len(self._storages)} storages but no tensor refers to "
                    f"{len(unreached)} of them")
        raise self.corrupt(
            f"found {what}: this looks like a {self.layout} layout modelsize does not "
            "understand; please report it"
        )

    def _gaps(self, default: Category) -> list[Region]:
        # Spans carry what they are (a region or a storage), named only for an error message.
        spans: list[list[tuple[int, int, int]]] = [[] for _ in self.files]
        what: list[Region | StorageRecord] = []
        for r in self._regions:
            spans[r.file].append((r.offset, r.offset + r.nbytes, len(what)))
            what.append(r)
        for st in self._storages.values():
            if st.nbytes:
                spans[st.file].append((st.offset, st.offset + st.nbytes, len(what)))
                what.append(st)

        def label(i: int) -> str:
            if i < 0:
                return "start of file"
            w = what[i]
            return w.label if isinstance(w, Region) else f"storage {w.key}"

        gaps: list[Region] = []
        for file, items in enumerate(spans):
            items.sort()
            pos = 0
            prev = -1
            for start, stop, index in items:
                if start < pos:
                    raise self.corrupt(
                        f"{label(index)} overlaps {label(prev)} (bytes {start}..{pos})", start,
                        file,
                    )
                if start > pos:
                    gaps.append(_region(file, pos, start - pos, default, "structure"))
                pos, prev = stop, index
            size = self.files[file].nbytes
            if size > pos:
                gaps.append(_region(file, pos, size - pos, default, "structure"))
        return gaps

    def _find_duplicates(self, by_storage: Mapping[str, int | list[_View]] | None
                         ) -> dict[str, str]:
        """Map storage key -> key of an earlier storage holding identical bytes.

        Candidates must agree on dtype, shape of their first view, size and recorded CRC-32
        (zip members: equal bytes have equal CRCs, so most storages of a checkpoint are ruled
        out unread); a digest of their first 4 KiB and of samples of their middle and end
        (read in file order, a window at a time, so a million small storages cost a few large
        reads) prunes them before they are compared whole, a piece at a time, so only real
        duplicates are read to the end.
        Storages whose bytes are one value repeated (zero-initialised biases, counters) are
        left alone: equal by construction, not by accident of saving. Large candidates whose
        samples are one value repeated are left alone unread (a file of zero-initialised
        tensors would otherwise be read whole): a duplicate whose start, middle and end are
        constant but whose other bytes differ from that value goes unreported.
        """
        storages = self._storages
        if by_storage is None and self._whole == len(storages) == len(self._tensors):
            return self._confirm_duplicates(self._whole_candidates(), storages)
        # Each storage with the first tensor viewing it (storage i's is tensor i where
        # by_storage is None: a safetensors file's million storages are not looked up by key).
        pairs: Iterable[tuple[str, StorageRecord, TensorRecord]]
        if by_storage is None:
            pairs = zip(storages, storages.values(), self._tensors, strict=True)
        else:
            pairs = self._first_views(by_storage)
        return self._confirm_duplicates(self._signature_groups(pairs), storages)

    def _signature_groups(self, pairs: Iterable[tuple[str, StorageRecord, TensorRecord]]
                          ) -> list[tuple[str, list[str]]]:
        """The candidate groups ``(dtype, keys)`` of :meth:`_find_duplicates` among
        ``(key, storage, its first view)``, in order of each group's second storage."""
        # Signature -> its first storage's key; signatures met twice or more -> all their keys
        # (no list is made for the storages alone in their signature: nearly all of them).
        first_of: dict[tuple[Any, ...], str] = {}
        groups: dict[tuple[Any, ...], list[str]] = {}
        crc = self._crc
        itemsizes: dict[str, int] = {}
        for key, st, first in pairs:
            if st.nbytes == 0:
                continue
            dtype = first.dtype
            itemsize = itemsizes.get(dtype)
            if itemsize is None:
                itemsize = itemsizes[dtype] = _itemsize(dtype)
            if not st.compressed and st.nbytes <= itemsize:
                continue  # one element: one value repeated, never a duplicate (see constant)
            if is_layout_part(first.name):
                continue
            sig = (st.nbytes, st.logical_nbytes, st.compressed, dtype, first.shape, crc.get(key))
            earlier = first_of.setdefault(sig, key)
            if earlier is not key:
                same = groups.get(sig)
                if same is None:
                    groups[sig] = [earlier, key]
                else:
                    same.append(key)
        del first_of
        candidates = [(sig[3], keys) for sig, keys in groups.items()]
        del groups
        return candidates

    def _whole_candidates(self) -> list[tuple[str, list[str]]]:
        """:meth:`_find_duplicates`' candidate groups, in its order, where tensor ``i`` is the
        one whole view of storage ``i`` (see :meth:`add_whole_tensors`): storages are grouped by
        size alone (an int: no signature tuple made and hashed per storage), then each group
        of two or more is checked to share one dtype and shape, and split by them where it
        does not; where names of layout parts occur, all go the general way."""
        tensors = self._tensors
        # Size -> its first tensor; sizes met twice or more -> their tensors (records already
        # made, no index kept per storage) and where the second lies.
        first_of: dict[int, TensorRecord] = {}
        by_size: dict[int, list[TensorRecord]] = {}
        second: dict[int, int] = {}
        for i, t in enumerate(tensors):
            n = t.nbytes
            j = first_of.setdefault(n, t)
            if j is not t:
                same = by_size.get(n)
                if same is None:
                    by_size[n] = [j, t]
                    second[n] = i
                else:
                    same.append(t)
        del first_of
        if not by_size:
            return []
        for found in by_size.values():
            for k in range(0, len(found), 1 << 12):  # names joined a few thousand at a time
                names = "\n".join([t.name for t in found[k : k + (1 << 12)]])
                if any(word in names for word in _LAYOUT_WORDS):
                    storages = self._storages
                    return self._signature_groups(
                        zip(storages, storages.values(), tensors, strict=True))
        # Tensor i views storage i, whose key is its ``storage``.
        groups: list[tuple[int, str, list[str]]] = []
        position: dict[str, int] = {}
        for n, found in by_size.items():
            first = found[0]
            dtype, shape = first.dtype, first.shape
            if all([t.dtype == dtype and t.shape == shape for t in found]):
                if n > _itemsize(dtype):
                    groups.append((second[n], dtype, [t.storage for t in found]))  # type: ignore[misc]
                continue
            # Of one size, several dtypes or shapes ((1024, 4096) and (4096, 1024)): split.
            split: dict[tuple[str, tuple[int, ...]], list[TensorRecord]] = {}
            for t in found:
                split.setdefault((t.dtype, t.shape), []).append(t)
            if not position:
                position = {t.storage: i for i, t in enumerate(tensors)}  # type: ignore[misc]
            groups += [(position[same[1].storage], dtype,  # type: ignore[index]
                        [t.storage for t in same])  # type: ignore[misc]
                       for (dtype, _), same in split.items()
                       if len(same) > 1 and n > _itemsize(dtype)]
        groups.sort()  # in the order of each group's second storage, as the general way
        return [(dtype, same) for _, dtype, same in groups]

    def _first_views(self, by_storage: Mapping[str, int | list[_View]]
                     ) -> Iterator[tuple[str, StorageRecord, TensorRecord]]:
        """Each storage some tensor views, with the first such tensor."""
        tensors = self._tensors
        for key, st in self._storages.items():
            found = by_storage.get(key)
            if found is not None:
                yield key, st, tensors[found if isinstance(found, int) else found[0].record_index]

    def _confirm_duplicates(self, candidates: list[tuple[str, list[str]]],
                            storages: Mapping[str, StorageRecord]) -> dict[str, str]:
        """Of each group of candidate ``(dtype, keys)`` (same size and first view, in
        order), the storages whose bytes equal an earlier one's: ``{key: original key}``
        (see :meth:`_find_duplicates` for what is left alone)."""
        result: dict[str, str] = {}
        if not candidates:
            return result
        sampled = None if READ_DATA.get() else SAMPLED_DUPLICATES.get()
        if sampled is not None:
            return sampled(self, candidates, storages)
        with _FileReader(self, storages) as reader:
            for dtype, keys in candidates:
                itemsize = _itemsize(dtype)
                for equal in reader.probe_groups(keys):
                    if reader.sampled_constant(equal[0], itemsize):
                        # equal samples, each one value repeated: zero-initialised tensors,
                        # left alone unread (reading 300 zero tensors of a 10 GB file to rule
                        # them out would read all 10 GB)
                        continue
                    for identical in reader.identical(equal):
                        if reader.constant(identical[0], itemsize):
                            continue
                        for key in identical[1:]:
                            result[key] = identical[0]
        return result


class NotSimpleError(Exception):
    """What a reader declared is more than :class:`TotalsBuilder` accounts for without
    records (the caller reads the file with an :class:`InventoryBuilder`)."""


class TotalsBuilder(InventoryBuilder):
    """An :class:`InventoryBuilder` that makes no record per tensor or storage: what a reader
    declares is checked as it comes (``expect(index, name, dtype, shape)``, for each tensor in
    order) and :meth:`build` returns a :class:`LazyInventory` holding the totals that
    :meth:`InventoryBuilder.build` would give for the same declarations.

    It accounts for files whose every storage is viewed whole by one contiguous tensor,
    declared right after it, storages lying in the order of their offsets (a safetensors
    file as slim writes it): a few columns per storage instead of two records. Anything else
    raises :class:`NotSimpleError`. Duplicates are found as the builder finds them
    (:meth:`InventoryBuilder._confirm_duplicates`), among the storages whose CRC-32s,
    given to :meth:`build` by the caller who read them all, are equal: storages whose bytes
    differ cannot be duplicates, so the others are never read again.
    """

    def __init__(self, format: str, paths: Iterable[str | Path], *,
                 root: str | Path | None = None,
                 expect: Callable[[int, str, str, tuple[int, ...]], None] | None = None):
        super().__init__(format, paths, root=root)
        self.expect = expect
        #: Tensors declared so far.
        self.count = 0
        self._open: str | None = None  # the last storage's key, until its tensor comes
        self.st_file = array("i")
        self.st_offset = array("q")
        self.st_nbytes = array("q")
        self._st_category = bytearray()
        self._st_dtype: list[str] = []
        self._st_shape: list[tuple[int, ...]] = []
        self._layout_parts: set[int] = set()  # storages never duplicates (is_layout_part)
        self._end: dict[int, int] = {}  # per file, where its last storage ends
        #: (dtype as declared, shape) -> (canonical dtype, bytes)
        self._sizes: dict[tuple[str, tuple[int, ...]], tuple[str, int]] = {}

    def add_storage(self, key: str, offset: int, nbytes: int, *, file: int = 0,
                    logical_nbytes: int | None = None, compressed: bool = False,
                    dtype: str | None = None, crc32: int | None = None) -> None:
        """:meth:`InventoryBuilder.add_storage`, kept as columns."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.files[file].nbytes:
            self.check_range(offset, nbytes, f"storage {key}", file)  # raises, naming it
        if self._open is not None:
            raise NotSimpleError(f"storage {self._open!r} has no tensor of its own")
        if compressed or (logical_nbytes is not None and logical_nbytes != nbytes) or (
                crc32 is not None):
            raise NotSimpleError(f"storage {key!r} is encoded")
        if offset < self._end.get(file, 0):
            raise NotSimpleError(f"storage {key!r} lies before the one declared before it")
        if nbytes:
            self._end[file] = offset + nbytes
        self._open = key
        self.st_file.append(file)
        self.st_offset.append(offset)
        self.st_nbytes.append(nbytes)

    def add_tensor(self, name: str, dtype: str, shape: Iterable[int], category: Category, *,
                   storage: str | None = None, storage_offset: int = 0,
                   strides: Iterable[int] | None = None, tags: Iterable[str] = (),
                   itemsize: int | None = None, container: str = "") -> None:
        """:meth:`InventoryBuilder.add_tensor` of a tensor viewing its storage whole,
        checked by ``expect`` and counted; :class:`NotSimpleError` for any other."""
        if storage_offset or strides is not None or itemsize is not None:
            raise NotSimpleError(f"tensor {name!r} is a view the totals do not follow")
        shape_t = shape if type(shape) is tuple else tuple(map(int, shape))
        known = self._sizes.get((dtype, shape_t))  # type: ignore[arg-type]
        if known is None:
            dt_name = dtype if dtype in DTYPES else canonical(dtype) or dtype
            dt = DTYPES.get(dt_name)
            if dt is None:
                raise NotSimpleError(f"tensor {name!r} has a dtype of unknown size")
            n = math.prod(shape_t)  # type: ignore[arg-type]
            known = (dt_name, n * dt.block_bytes if dt.block == 1
                     else -(-n // dt.block) * dt.block_bytes)
            if len(self._sizes) < 1 << 16:
                self._sizes[(dtype, shape_t)] = known  # type: ignore[index]
        dt_name, nbytes = known
        if storage is not None:
            if storage != self._open:
                raise NotSimpleError(f"tensor {name!r} views a storage not its own")
            if nbytes != self.st_nbytes[-1]:
                raise NotSimpleError(f"tensor {name!r} views part of its storage")
            self._open = None
            self._st_category.append(_CATEGORY_INDEX[category])
            self._st_dtype.append(dt_name)
            self._st_shape.append(shape_t)  # type: ignore[arg-type]
            if is_layout_part(name):
                self._layout_parts.add(len(self._st_dtype) - 1)
        if self.expect is not None:
            self.expect(self.count, name, dt_name, shape_t)  # type: ignore[arg-type]
        self.count += 1

    def add_plain_tensor(
        self, name: str, dtype: str, shape: tuple[int, ...], nbytes: int, category: Category,
        storage: str, offset_bytes: int, strides: tuple[int, ...] | None,
        tags: tuple[str, ...], container: str,
    ) -> None:
        """:meth:`InventoryBuilder.add_plain_tensor` of a tensor viewing its storage whole."""
        if offset_bytes or strides is not None:
            raise NotSimpleError(f"tensor {name!r} is a view the totals do not follow")
        self.add_tensor(name, dtype, shape, category, storage=storage, tags=tags,
                        container=container)

    def add_whole_tensors(
        self,
        file: int,
        start: int,
        keys: Sequence[str],
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[tuple[int, ...]],
        begins: Sequence[int],
        ends: Sequence[int],
        classes: Sequence[tuple[Category, tuple[str, ...]]],
    ) -> None:
        """:meth:`InventoryBuilder.add_whole_tensors`, a storage and its tensor at a time (each
        kept as columns and checked by ``expect`` as it comes)."""
        add_storage, add_tensor = self.add_storage, self.add_tensor
        for key, name, dtype, shape, begin, end, (category, tags) in zip(
                keys, names, dtypes, shapes, begins, ends, classes, strict=True):
            add_storage(key, start + begin, end - begin, file=file, dtype=dtype)
            add_tensor(name, dtype, shape, category, storage=key, tags=tags)

    def build(self, default: Category = Category.METADATA, *, dedupe: bool = True,
              crcs: Sequence[int] | None = None) -> LazyInventory:
        """The totals (see the class docstring); ``crcs`` are the storages' CRC-32s, in
        declaration order, without which no storage is a duplicate."""
        if self._open is not None:
            raise NotSimpleError(f"storage {self._open!r} has no tensor of its own")
        with paused_gc():
            totals = empty_totals()
            categories = list(Category)
            nbytes, category = self.st_nbytes, self._st_category
            sums = [0] * len(categories)
            for n, index in zip(nbytes, category, strict=True):
                sums[index] += n
            for cat, n in zip(categories, sums, strict=True):
                totals[cat] += n
            if dedupe and crcs is not None and READ_DATA.get():
                for i in self._duplicates(crcs):
                    totals[categories[category[i]]] -= nbytes[i]
                    totals[Category.DUPLICATES] += nbytes[i]
            for region in self._regions:
                totals[region.category] += region.nbytes
            totals[default] += self._gap_bytes()
        file_bytes = sum(f.nbytes for f in self.files)
        if sum(totals.values()) != file_bytes:
            raise AccountingError(
                f"{self.format} totals of {self.files[0].path if self.files else '?'}: "
                f"categories add up to {sum(totals.values())} bytes, files hold {file_bytes}")
        return LazyInventory(self.format, tuple(self.files), totals,
                             unsafe_globals=tuple(self._unsafe),
                             notes=tuple(dict.fromkeys(self.notes)), facts=dict(self.facts),
                             declared_regions=tuple(self._regions))

    def _gap_bytes(self) -> int:
        """Bytes of the files no region or storage describes (what
        :meth:`InventoryBuilder._gaps` makes regions of). Storages lie in order and apart
        (:meth:`add_storage` checks), so only the few regions are looked for among them; an
        overlap is left to the full read to name."""
        offsets, sizes = self.st_offset, self.st_nbytes
        covered = sum(sizes)
        one_file = not any(self.st_file)
        spans: dict[int, list[tuple[int, int]]] = {}
        for r in self._regions:
            if r.nbytes:
                spans.setdefault(r.file, []).append((r.offset, r.offset + r.nbytes))
                covered += r.nbytes
        for file, regions in spans.items():
            regions.sort()
            for (_, stop), (start, _) in itertools.pairwise(regions):
                if start < stop:
                    raise NotSimpleError(f"bytes {start}..{stop} are declared twice")
            for start, stop in regions:
                k = max(0, bisect.bisect_right(offsets, start) - 1) if one_file else 0
                while k < len(offsets) and (offsets[k] < stop or not one_file):
                    if (self.st_file[k] == file and sizes[k]
                            and offsets[k] < stop and offsets[k] + sizes[k] > start):
                        raise NotSimpleError(f"bytes {start}..{stop} are declared twice")
                    k += 1
        return sum(f.nbytes for f in self.files) - covered

    def _duplicates(self, crcs: Sequence[int]) -> list[int]:
        """Indices of the storages whose bytes equal an earlier storage's (as
        :meth:`InventoryBuilder._find_duplicates` finds them)."""
        nbytes, dtypes, shapes = self.st_nbytes, self._st_dtype, self._st_shape
        itemsizes: dict[str, int] = {}

        def candidate(i: int) -> bool:
            dtype = dtypes[i]
            itemsize = itemsizes.get(dtype)
            if itemsize is None:
                itemsize = itemsizes[dtype] = _itemsize(dtype)
            # one element: one value repeated, never a duplicate; nor are layouts' parts
            return nbytes[i] > itemsize and i not in self._layout_parts

        # Only CRCs met twice can be duplicates: found by sorting the values, their indices
        # then listed (nothing per storage is kept when, as usual, every CRC differs).
        values = sorted(crcs)
        repeated = {a for a, b in itertools.pairwise(values) if a == b}
        del values
        order = sorted((i for i, c in enumerate(crcs) if c in repeated),
                       key=crcs.__getitem__) if repeated else []
        groups: list[tuple[str, list[str]]] = []
        storages: dict[str, StorageRecord] = {}
        j = 0
        while j < len(order):
            stop = j + 1
            while stop < len(order) and crcs[order[stop]] == crcs[order[j]]:
                stop += 1
            if stop - j > 1:
                same: dict[tuple[Any, ...], list[int]] = {}
                for i in sorted(order[j:stop]):
                    if candidate(i):
                        same.setdefault((nbytes[i], dtypes[i], shapes[i]), []).append(i)
                for sig, found in same.items():
                    if len(found) < 2:
                        continue
                    keys = []
                    for i in found:
                        key = str(i)
                        storages[key] = _storage(key, self.st_file[i], self.st_offset[i],
                                                 nbytes[i], nbytes[i], False, sig[1],
                                                 _NO_CHARGES, None)
                        keys.append(key)
                    groups.append((sig[1], keys))
            j = stop
        del order
        groups.sort(key=lambda g: int(g[1][0]))
        return sorted(int(k) for k in self._confirm_duplicates(groups, storages))


_CATEGORY_INDEX: dict[Category, int] = {c: i for i, c in enumerate(Category)}


class LazyInventory(Inventory):
    """An :class:`Inventory` whose totals are known and whose records are read when first
    asked for: a slim's output of a million tensors, whose report needs its bytes by category
    and seldom its records. ``load()`` reads them (the file as committed); they must add up
    to the same totals, or the file changed since (:class:`AccountingError`).

    ``declared_regions`` are the regions its reader declared (a few: headers, stray bytes),
    without the gaps a full read adds between them: what the loader's rules look up by label
    (:mod:`modelsize.slimming.loadable`) without reading the records.
    """

    declared_regions: tuple[Region, ...]

    def __init__(self, format: str, files: tuple[FileInfo, ...],
                 bytes_by_category: dict[Category, int], *,
                 unsafe_globals: tuple[str, ...] = (), notes: tuple[str, ...] = (),
                 facts: dict[str, str] | None = None,
                 load: Callable[[], Inventory] | None = None,
                 declared_regions: tuple[Region, ...] = ()) -> None:
        for name, value in (("format", format), ("files", files),
                            ("unsafe_globals", unsafe_globals), ("notes", notes),
                            ("facts", {} if facts is None else facts),
                            ("bytes_by_category", bytes_by_category),
                            ("file_bytes", sum(f.nbytes for f in files)),
                            ("load", load), ("_loaded", None),
                            ("declared_regions", declared_regions)):
            object.__setattr__(self, name, value)

    def relabel(self, files: tuple[FileInfo, ...], path: Path,
                load: Callable[[], Inventory] | None) -> LazyInventory:
        """The same totals for the same bytes under other names (a staged output committed)."""
        facts = dict(self.facts)
        facts["path"] = str(path)
        return LazyInventory(self.format, files, dict(self.bytes_by_category),
                             unsafe_globals=self.unsafe_globals, notes=self.notes, facts=facts,
                             load=load, declared_regions=self.declared_regions)

    def full(self) -> Inventory:
        """The inventory with its records, read on first use."""
        loaded: Inventory | None = self.__dict__["_loaded"]
        if loaded is None:
            load = self.__dict__["load"]
            if load is None:
                raise ValueError(f"the records of {self.path} were not kept and cannot be read")
            loaded = load()
            if (loaded.bytes_by_category != self.bytes_by_category
                    or loaded.file_bytes != self.file_bytes):
                raise AccountingError(f"{self.path} changed since it was accounted for")
            object.__setattr__(self, "_loaded", loaded)
        return loaded

    @property  # type: ignore[override]
    def tensors(self) -> tuple[TensorRecord, ...]:
        """Every tensor (read on first use)."""
        return self.full().tensors

    @property  # type: ignore[override]
    def storages(self) -> tuple[StorageRecord, ...]:
        """Every storage (read on first use)."""
        return self.full().storages

    @property  # type: ignore[override]
    def regions(self) -> tuple[Region, ...]:
        """Every region (read on first use)."""
        return self.full().regions

    def __repr__(self) -> str:
        return (f"<LazyInventory {self.path} ({self.format}): {self.file_bytes:,} bytes; "
                "records read on first use>")


#: Bytes sampled at the start, the middle and the end of a duplicate candidate.
_PROBE = 4096
_CHUNK = 1 << 20
#: Small candidates lying closer than this are read together, in one read of up to _CHUNK.
_NEAR = _PROBE
#: Candidates whose chunks are held side by side; more are compared by hashes of their chunks.
_MAX_SIDE_BY_SIDE = 8
#: Bytes at the start of a candidate that tell it apart before its probes are digested
#: (32 float32 values: after one optimizer step, the layer norms of two layers can agree in
#: their first 8).
_HEAD = 128
#: Small candidates are read in windows where a window holds at least this many on average
#: (a read of a few nearby storages costs more than a short read of each).
_PER_WINDOW = 8
#: The offset part of a place, ``(file << 64) | offset``.
_OFFSET = (1 << 64) - 1
_offset_of = operator.attrgetter("offset")
_file_of = operator.attrgetter("file")


def _itemsize(dtype: str) -> int:
    """Bytes of one value of ``dtype`` for :meth:`_FileReader.constant` (1 if unknown)."""
    return max(1, int(DTYPES[dtype].itemsize)) if dtype in DTYPES else 1


def _split(keys: list[str], sample: Callable[[str], bytes]) -> list[list[str]]:
    """The groups (of two or more, in order) of ``keys`` whose samples are equal."""
    by_sample: dict[bytes, list[str]] = {}
    for key in keys:
        by_sample.setdefault(sample(key), []).append(key)
    return [same for same in by_sample.values() if len(same) > 1]


def _samples(nbytes: int) -> tuple[tuple[int, int], ...]:
    """The byte ranges of a storage that its probe digest covers: all of a small one; else its
    first, middle and last :data:`_PROBE` bytes."""
    if nbytes <= 3 * _PROBE:
        return ((0, nbytes),)
    mid = nbytes // 2
    return ((0, _PROBE), (mid, mid + _PROBE), (nbytes - _PROBE, nbytes))


def _windows(at: list[int], nbytes: int) -> list[tuple[int, int]] | None:
    """Runs ``(first, stop)`` of the storages at ``at`` (sorted ``(file << 64) | offset``, each
    ``nbytes`` long) that one read covers: storages less than :data:`_NEAR` apart in one file,
    the read at most :data:`_CHUNK` bytes. None where the windows would hold fewer than
    :data:`_PER_WINDOW` storages on average: reading each storage's head alone is cheaper."""
    gaps = list(map(operator.sub, itertools.islice(at, 1, None), at))
    limit = nbytes + _NEAR
    ends = [len(at)]
    breaks = sum(map(limit.__lt__, gaps))
    if (breaks + 1) * _PER_WINDOW > len(at):
        return None
    if breaks:
        ends[:0] = itertools.compress(range(1, len(at)), map(limit.__lt__, gaps))
    del gaps
    windows: list[tuple[int, int]] = []
    j = 0
    for end in ends:
        while j < end:
            stop = bisect.bisect_right(at, at[j] + _CHUNK - nbytes, j + 1, end)
            windows.append((j, stop))
            j = stop
    return windows if len(windows) * _PER_WINDOW <= len(at) else None


class _FileReader:
    """Reads storage bytes for duplicate detection through one open handle per file."""

    def __init__(self, builder: InventoryBuilder,
                 storages: Mapping[str, StorageRecord]) -> None:
        self.builder = builder
        self.storages = storages
        self.handles: dict[int, int] = {}
        self.closing = contextlib.ExitStack()

    def __enter__(self) -> _FileReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.closing.close()

    def _fd(self, file: int) -> int:
        fd = self.handles.get(file)
        if fd is None:
            # One handle per file for the whole build; reads are positioned (pread).
            path = self.builder.files[file].path
            fh = self.closing.enter_context(open(path, "rb", buffering=0))  # noqa: SIM115
            fd = self.handles[file] = fh.fileno()
        return fd

    def _pread(self, file: int, start: int, nbytes: int, what: StorageRecord) -> bytes:
        fd = self._fd(file)
        data = os.pread(fd, nbytes, start)
        while len(data) < nbytes:  # a short read: the file ends, or shrank meanwhile
            more = os.pread(fd, nbytes - len(data), start + len(data))
            if not more:
                raise self.builder.corrupt(f"storage {what.key} ends early", what.offset,
                                           what.file)
            data += more
        return data

    def _pread_at(self, place: int, nbytes: int, what: StorageRecord) -> bytes:
        """``nbytes`` at ``place``, ``(file << 64) | offset`` (see :meth:`probe_groups`)."""
        return self._pread(place >> 64, place & _OFFSET, nbytes, what)

    def read(self, key: str, start: int, stop: int) -> bytes:
        """Bytes ``start..stop`` of a storage (at most a chunk)."""
        st = self.storages[key]
        return self._pread(st.file, st.offset + start, stop - start, st)

    def probe_groups(self, keys: list[str]) -> list[list[str]]:
        """The groups (of two or more, in order) of same-sized ``keys`` whose probes (see
        :func:`_samples`) look equal: only they can hold equal bytes.

        Storages are first told apart by (the hashes of) their first :data:`_HEAD` bytes, which
        is all it takes for trained weights: one short read each, in file order, where small
        storages lying near each other are read together (a million 8-byte tensors cost a few
        reads, not a million). Only storages whose head another shares are read further: their
        probes' CRC-32 decides.
        """
        sts = list(map(self.storages.__getitem__, keys))
        nbytes = sts[0].nbytes
        samples = _samples(nbytes)
        # Where each storage lies, (file << 64) | offset, and the storages in file order.
        places = list(map(_offset_of, sts))
        files = {0} if len(self.builder.files) == 1 else set(map(_file_of, sts))
        if files != {0}:
            places = list(map(operator.or_, [f << 64 for f in map(_file_of, sts)], places))
        if all(map(operator.le, places, itertools.islice(places, 1, None))):
            order, at = list(range(len(sts))), places
        else:
            order = sorted(range(len(sts)), key=places.__getitem__)
            at = list(map(places.__getitem__, order))
        del places
        head = min(nbytes, _HEAD)
        windows = _windows(at, nbytes) if len(samples) == 1 else None
        # The heads' hashes, in file order (ints: a million candidates hold no million heads).
        found: list[int] = []
        if windows is not None:
            # Small storages lying close: their heads read in windows of up to _CHUNK bytes.
            for j, stop in windows:
                base = at[j]
                data = self._pread_at(base, at[stop - 1] + head - base, sts[order[j]])
                found += [hash(data[p - base : p - base + head]) for p in at[j:stop]]
        else:
            found = self._hashes(at, head, sts, order, files)
        if len(set(found)) == len(found):
            return []  # every head differs (nearly always): no two storages can be equal
        digests: list[object] = [0] * len(sts)
        for i, h in zip(order, found, strict=True):
            digests[i] = h
        # Heads met twice or more: the CRC-32 of every probe decides (read again, in order).
        shared = Counter(found)
        crc32 = zlib.crc32
        if windows is not None:
            for j, stop in windows:
                inside = [k for k in range(j, stop) if shared[found[k]] > 1]
                if not inside:
                    continue
                base = at[inside[0]]
                window = memoryview(self._pread_at(base, at[inside[-1]] + nbytes - base,
                                                   sts[order[inside[0]]]))
                for k in inside:
                    p = at[k] - base
                    digests[order[k]] = (found[k], crc32(window[p : p + nbytes]))
        else:
            for k, i in enumerate(order):
                if shared[found[k]] > 1:
                    crc = 0
                    for a, b in samples:
                        crc = crc32(self._pread_at(at[k] + a, b - a, sts[i]), crc)
                    digests[i] = (found[k], crc)
        first_with: dict[object, int] = {}
        groups: dict[int, list[str]] = {}
        for i, digest in enumerate(digests):
            j = first_with.setdefault(digest, i)
            if j != i:
                same = groups.get(j)
                if same is None:
                    groups[j] = [keys[j], keys[i]]
                else:
                    same.append(keys[i])
        return list(groups.values())

    def _hashes(self, at: list[int], head: int, sts: list[StorageRecord], order: list[int],
                files: set[int]) -> list[int]:
        """The hashes of the first ``head`` bytes at each of ``at`` (storages ``sts[order[k]]``
        of ``files``), one read each; the heads themselves are not kept."""
        pread = os.pread
        if files == {0}:
            fd = self._fd(0)
            found = [hash(h) for p in at if len(h := pread(fd, head, p)) == head]
        else:
            fd_of = self._fd
            found = [hash(h) for p in at
                     if len(h := pread(fd_of(p >> 64), head, p & _OFFSET)) == head]
        if len(found) < len(at):
            # A short read: the file ends early, or shrank since it was opened. Read again
            # (completing short reads) to name the first storage that ends early.
            found = [hash(self._pread_at(p, head, sts[i])) for p, i in zip(at, order, strict=True)]
        return found

    def identical(self, keys: list[str]) -> list[list[str]]:
        """The groups (of two or more, in order) of same-sized ``keys`` with equal bytes.

        Compared a piece at a time, the pieces growing from 64 KiB to 1 MiB: candidates stop
        being read where they differ, which for storages with equal samples (mostly zeros, say)
        is usually long before their end.
        """
        n = self.storages[keys[0]].nbytes
        groups = [keys]
        pos, step = 0, _CHUNK // 16
        while pos < n and groups:
            stop = min(n, pos + step)
            groups = [same for g in groups for same in self.split_piece(g, pos, stop)]
            pos, step = stop, min(2 * step, _CHUNK)
        return groups

    def split_piece(self, keys: list[str], start: int, stop: int) -> list[list[str]]:
        """:func:`_split` on the bytes ``start..stop``: large pieces of a few candidates are
        compared side by side (hashing 1 MiB costs more than comparing it with a few others),
        of many candidates by a digest; small pieces are their own keys."""
        if stop - start <= 3 * _PROBE:
            return _split(keys, lambda k: self.read(k, start, stop))
        if len(keys) > _MAX_SIDE_BY_SIDE:
            import hashlib  # here: only large groups of candidates need it; slow to import

            return _split(keys, lambda k: hashlib.blake2b(
                self.read(k, start, stop), digest_size=20).digest())
        seen: list[tuple[bytes, list[str]]] = []
        for key in keys:
            piece = self.read(key, start, stop)
            for other, same in seen:
                if piece == other:
                    same.append(key)
                    break
            else:
                seen.append((piece, [key]))
        return [same for _, same in seen if len(same) > 1]

    def sampled_constant(self, key: str, itemsize: int) -> bool:
        """Whether a large storage's samples (start, middle, end) are one value repeated."""
        st = self.storages[key]
        if st.compressed or st.nbytes <= 3 * _PROBE:
            return False  # small: read whole anyway, :meth:`constant` decides exactly
        sample = b"".join(self.read(key, a, b) for a, b in _samples(st.nbytes))
        value = sample[:itemsize]
        return bool(value) and sample == value * (len(sample) // len(value))

    def constant(self, key: str, itemsize: int) -> bool:
        """Whether a (stored) storage's bytes are one ``itemsize`` value repeated."""
        st = self.storages[key]
        if st.compressed:
            return False
        value = b""
        for pos in range(0, st.nbytes, _CHUNK):
            chunk = self.read(key, pos, min(st.nbytes, pos + _CHUNK))
            if not value:
                value = chunk[:itemsize]
            if chunk != value * (len(chunk) // len(value)):
                return False
        return True


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of a C-contiguous tensor of ``shape``."""
    out = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        out[i] = out[i + 1] * max(shape[i + 1], 1)
    return tuple(out)


def is_contiguous(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether ``strides`` lay ``shape`` out in C order (strides of size-1 dims do not matter)."""
    if len(shape) != len(strides):
        return False
    expected = 1
    for d, s in zip(reversed(shape), reversed(strides), strict=True):
        if d != 1 and s != expected:
            return False
        expected *= d
    return True


# -- the bytes views reach ------------------------------------------------------------------


def element_runs(
    shape: tuple[int, ...], strides: tuple[int, ...], limit: int = MAX_RUNS
) -> tuple[int, int, list[tuple[int, int]] | None, int, bool]:
    """The storage elements a view of ``shape`` and ``strides`` reaches, from its offset.

    Returns ``(first, stop, runs, count, approximate)``: the span ``first..stop`` (``first`` is
    negative where a stride is), the sorted, disjoint runs of elements in it (``None`` when
    there would be more than ``limit``) and the number of elements reached. Computed a dimension
    at a time from the smallest stride, as runs of a repeated pattern, never as a set of
    indices: a column slice ``big[:, :3]`` of a 1000x1000 matrix is 1000 runs of 3 elements,
    ``numel`` elements counted exactly however large. Past ``limit`` runs, a pattern whose
    copies overlap (``as_strided`` views that reuse elements) is taken as its span and
    ``approximate`` is set.
    """
    base = 0
    dims: list[tuple[int, int]] = []
    for d, s in zip(shape, strides, strict=False):
        if d == 0:
            return 0, 0, [], 0, False
        if d == 1 or s == 0:
            continue  # one element along it, or the same elements again (expand)
        if s < 0:
            base += (d - 1) * s
            s = -s
        dims.append((s, d))
    dims.sort()
    runs: list[tuple[int, int]] | None = [(0, 1)]
    hull = count = 1
    approximate = False
    for s, d in dims:
        if runs is not None and len(runs) == 1 and s <= hull:
            # Copies of one block that overlap or touch: still one block.
            hull += (d - 1) * s
            runs, count = [(0, hull)], hull
        elif s >= hull:
            # Copies that cannot overlap: every element is new (exact without listing them).
            runs = _repeat(runs, d, s) if runs is not None and len(runs) * d <= limit else None
            count *= d
            hull += (d - 1) * s
        elif runs is not None and len(runs) * d <= limit:
            runs = _union([(a + i * s, b + i * s) for i in range(d) for a, b in runs])
            hull += (d - 1) * s
            count = sum(b - a for a, b in runs)
        else:
            hull += (d - 1) * s
            runs, count, approximate = [(0, hull)], hull, True
    if base:
        runs = None if runs is None else [(a + base, b + base) for a, b in runs]
    return base, base + hull, runs, count, approximate


def _repeat(runs: list[tuple[int, int]], d: int, s: int) -> list[tuple[int, int]]:
    """``runs`` and ``d - 1`` copies of them, each ``s`` further (copies do not overlap)."""
    out: list[tuple[int, int]] = []
    for i in range(d):
        shift = i * s
        for a, b in runs:
            a, b = a + shift, b + shift
            if out and out[-1][1] == a:
                out[-1] = (out[-1][0], b)
            else:
                out.append((a, b))
    return out


def _union(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, disjoint ranges covering the same elements as ``runs``."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(runs):
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _charge(
    views: list[_View],
    size: int,
    rank: dict[Category, int],
    totals: dict[Category, int],
    stored: dict[int, int],
) -> int:
    """Charge the bytes of a storage of ``size`` bytes its ``views`` reach; return their total.

    A byte reached by several views is charged once, to the first by category precedence.
    Views whose spans overlap no other view's are charged their exact bytes without listing
    them; only groups of overlapping spans are merged, run by run.
    """
    reached = 0
    live = []
    for v in views:
        if v.start < 0 or v.stop > size:
            v.clip(size)
        if v.nbytes:
            live.append(v)
    if len(live) > 1:
        live.sort(key=lambda v: v.start)
    groups: list[list[_View]] = []
    group_stop = 0
    for v in live:
        if groups and v.start < group_stop:
            groups[-1].append(v)
            group_stop = max(group_stop, v.stop)
        else:
            groups.append([v])
            group_stop = v.stop
    for group in groups:
        if len(group) == 1:
            only = group[0]
            if only.approximate:
                only.listed()  # elements that repeat: listed, they are counted once
            totals[only.category] = totals.get(only.category, 0) + only.nbytes
            stored[only.record_index] += only.nbytes
            reached += only.nbytes
        else:
            reached += _charge_overlapping(group, rank, totals, stored)
    return reached


def _charge_overlapping(
    group: list[_View], rank: dict[Category, int], totals: dict[Category, int],
    stored: dict[int, int],
) -> int:
    """:func:`_charge` for views whose spans overlap: their runs merged in precedence order."""
    starts: list[int] = []
    stops: list[int] = []
    covered = 0
    for v in sorted(group, key=lambda v: (rank[v.category], v.record_index)):
        new = 0
        for a, b in v.listed():
            i = bisect.bisect_left(stops, a)  # the first range that ends at or after a
            j = bisect.bisect_right(starts, b)  # past the last that starts at or before b
            if i == j:
                starts.insert(i, a)
                stops.insert(i, b)
                new += b - a
                continue
            lo, hi = min(a, starts[i]), max(b, stops[j - 1])
            new += (hi - lo) - sum(stops[k] - starts[k] for k in range(i, j))
            starts[i:j] = [lo]
            stops[i:j] = [hi]
        if new:
            totals[v.category] = totals.get(v.category, 0) + new
            stored[v.record_index] += new
            covered += new
    return covered
