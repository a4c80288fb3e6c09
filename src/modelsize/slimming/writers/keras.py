"""Keras output: ``.keras`` archives, legacy ``.h5`` full models and ``.weights.h5`` files.

All three keep their variables in HDF5, written here with h5py (``modelsize[keras]``). The
output has the input's groups, attributes and links, copied with h5py in the input's order,
without what the plan drops: a group whose datasets are all dropped goes too (a legacy
model's ``optimizer_weights``, a Keras 3 file's ``optimizer``), because Keras would otherwise
look for the variables its attributes name. Every kept dataset is written contiguous, with the
input's HDF5 type (or the ``--cast`` type), its bytes streamed a chunk at a time into
hyperslabs of the dataset with that type as the memory type: no conversion, and never more
than a chunk in memory. A deduplicated alias is a hard link to its original (a second name for
one dataset), unless its attributes (or shape) differ: then it is stored again.

Dataset space is allocated when the dataset is created and never filled, so the same skeleton
written to a scratch object that keeps only HDF5's metadata gives the output's exact size
before a byte of data is written: ``--dry-run`` is exact, and a ``.keras`` archive's HDF5
member is written in place inside the zip, its size known for the header.

What Keras makes of the output (Keras 3.15 checked):

* legacy ``.h5``: without ``optimizer_weights`` ``load_model`` compiles the model from
  ``training_config`` with a fresh optimizer, silently; ``training_config`` is kept.
* ``.keras``: ``config.json`` is copied unchanged, its ``compile_config`` included, so
  ``load_model`` compiles the model, builds a fresh optimizer and warns that the file has
  none of its variables ("Skipping variable loading for optimizer"); ``compile=False``
  loads without the warning. Keras 3 itself never leaves the optimizer out of a ``.keras``
  file (``include_optimizer`` is ignored there): this is the file it does not write.
* ``.weights.h5``: ``load_weights`` restores every layer; Keras needs the name to end in
  ``.weights.h5``, so the default output is ``NAME.slim.weights.h5``.

Refused with a clear error: chunked or filtered (gzip...) datasets, variable-length and
reference types (Keras writes none of them), ``--cast bfloat16`` (Keras keeps bfloat16 in an
opaque HDF5 type modelsize reads as bytes), and an input Keras itself would not load (member
names twice, ``config.json`` not a model config, weights of layers the config lacks:
:mod:`modelsize.slimming.loadable`). In a ``.keras`` archive the weights member is written
stored, as Keras writes it; every other member is copied as it is, compressed bytes and all,
so none is ever inflated (a deflate bomb among the assets stays a few MB). Where h5py cannot
read the input (a damaged heap, a name that is not UTF-8), the input is refused in one line.
"""

from __future__ import annotations

import contextlib
import io
import math
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from modelsize import inputs
from modelsize.categories import Category
from modelsize.errors import CorruptFileError, MissingDependencyError, UsageError, printable
from modelsize.formats import _zip
from modelsize.slimming.checksum import crc32
from modelsize.slimming.loadable import keras_h5_listed, refuse_unloadable
from modelsize.slimming.output import Output
from modelsize.slimming.plan import Plan, PlannedTensor
from modelsize.slimming.writers.base import Meter, Written, slim_name, stream
from modelsize.slimming.zipwriter import Member, ZipWriter, local_extra

WEIGHTS_MEMBER = "model.weights.h5"
#: HDF5 types of the dtypes ``--cast`` can produce here (names of ``h5py.h5t`` constants).
_CAST_TYPES = {"float16": "IEEE_F16LE", "float32": "IEEE_F32LE", "float64": "IEEE_F64LE"}
_COPY_STEP = 1 << 20


def _h5py() -> Any:
    try:
        import h5py
    except ImportError as exc:
        raise MissingDependencyError("h5py", "modelsize slim of Keras files",
                                     extra="keras") from exc
    return h5py


# -- file objects h5py reads and writes through (its "fileobj" driver) ---------------------


class _Window(io.RawIOBase):
    """Bytes ``base..`` of a seekable binary file, seen as a whole file: an HDF5 file inside a
    zip archive (read from a stored member, or written in place as the output's member)."""

    def __init__(self, fh: BinaryIO, base: int, size: int | None = None,
                 writable: bool = False) -> None:
        super().__init__()
        self.fh = fh
        self.base = base
        self.size = size if size is not None else 0
        self.limit = size
        self._writable = writable
        self.pos = 0

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return self._writable

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else self.pos + pos if whence == 1 else self.size + pos
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer: Any) -> int:
        mv = memoryview(buffer).cast("B")
        n = max(0, min(len(mv), self.size - self.pos))
        self.fh.seek(self.base + self.pos)
        got = self.fh.readinto(mv[:n]) if n else 0  # type: ignore[attr-defined]
        self.pos += got
        return got

    def write(self, data: Any) -> int:
        if not self._writable:
            raise io.UnsupportedOperation("read-only")
        self.fh.seek(self.base + self.pos)
        n = self.fh.write(data)
        self.pos += n
        self.size = max(self.size, self.pos)
        return n

    def truncate(self, size: int | None = None) -> int:
        if not self._writable:
            raise io.UnsupportedOperation("read-only")
        self.size = self.pos if size is None else size
        self.fh.truncate(self.base + self.size)
        return self.size

    def flush(self) -> None:
        if self._writable:
            self.fh.flush()


class _InflatedFile(io.RawIOBase):
    """A deflated zip member as a read-only file (random access through an InflatedBlob)."""

    def __init__(self, blob: Any) -> None:
        super().__init__()
        self.blob = blob
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        size = self.blob.size
        self.pos = pos if whence == 0 else self.pos + pos if whence == 1 else size + pos
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer: Any) -> int:
        mv = memoryview(buffer).cast("B")
        n = max(0, min(len(mv), self.blob.size - self.pos))
        if n:
            mv[:n] = self.blob.read(self.pos, n)
        self.pos += n
        return n


class _Sizer(io.RawIOBase):
    """A file that keeps only the pages HDF5 writes (its metadata, when no data is written)
    and its size: where the skeleton of an output is built to learn its exact size."""

    PAGE = 4096

    def __init__(self) -> None:
        super().__init__()
        self.pages: dict[int, bytearray] = {}
        self.pos = 0
        self.size = 0

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else self.pos + pos if whence == 1 else self.size + pos
        return self.pos

    def tell(self) -> int:
        return self.pos

    def truncate(self, size: int | None = None) -> int:
        self.size = self.pos if size is None else size
        return self.size

    def write(self, data: Any) -> int:
        mv = memoryview(data).cast("B")
        done = 0
        while done < len(mv):
            page, at = divmod(self.pos + done, self.PAGE)
            take = min(len(mv) - done, self.PAGE - at)
            self.pages.setdefault(page, bytearray(self.PAGE))[at : at + take] = mv[
                done : done + take]
            done += take
        self.pos += done
        self.size = max(self.size, self.pos)
        return done

    def readinto(self, buffer: Any) -> int:
        mv = memoryview(buffer).cast("B")
        n = max(0, min(len(mv), self.size - self.pos))
        done = 0
        while done < n:
            page, at = divmod(self.pos + done, self.PAGE)
            take = min(n - done, self.PAGE - at)
            held = self.pages.get(page)
            mv[done : done + take] = held[at : at + take] if held is not None else bytes(take)
            done += take
        self.pos += n
        return n


class _Counter(io.RawIOBase):
    """A file that keeps nothing but its size: what an archive's exact size is learnt on (its
    members' data skipped over, only their headers and the directory written)."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = 0
        self.size = 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else self.pos + pos if whence == 1 else self.size + pos
        self.size = max(self.size, self.pos)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def write(self, data: Any) -> int:
        n = len(memoryview(data).cast("B"))
        self.pos += n
        self.size = max(self.size, self.pos)
        return n


# -- the decision: which datasets, groups and links the output has --------------------------


@dataclass
class _Layout:
    """What the HDF5 output holds, by dataset path (names are the input's)."""

    tensors: dict[str, PlannedTensor]
    #: alias path -> path of the dataset holding its bytes.
    aliases: dict[str, str]
    #: Groups dropped because every dataset under them is dropped.
    pruned: frozenset[str]


def _ancestors(name: str) -> Iterator[str]:
    parts = name.split("/")
    for i in range(1, len(parts)):
        yield "/".join(parts[:i])


def _layout(plan: Plan) -> _Layout:
    tensors = {t.name: t for t in plan.tensors if t.alias_of is None}
    aliases = plan.aliases
    had = {g for t in plan.inventory.tensors for g in _ancestors(t.name)}
    alive = {g for name in [*tensors, *aliases] for g in _ancestors(name)}
    return _Layout(tensors, aliases, frozenset(had - alive))


@dataclass
class _Fill:
    """A created dataset and the planned tensor whose bytes go into it."""

    dataset: Any  # h5py.h5d.DatasetID
    type: Any  # h5py.h5t.TypeID: the file type, used as memory type (no conversion)
    shape: tuple[int, ...]
    tensor: PlannedTensor
    #: Whether its Written is the tensor's (False for an alias stored as a copy).
    own: bool = True


def _check(plan: Plan, src: Any, lay: _Layout) -> None:
    """Refuse what the writer cannot copy exactly, naming the file and the dataset."""
    h5py = _h5py()
    where = printable(str(plan.inventory.path))

    def chunked(name: str) -> UsageError:
        return UsageError(f"{where}: {printable(name)} is a chunked or compressed HDF5 "
                          "dataset; modelsize slim rewrites contiguous datasets (what Keras "
                          "writes) only")

    for d in plan.dropped:
        r = d.record
        if d.reason.startswith("holds no data") and (
            r.stored_nbytes or any(tag.startswith(("chunks=", "filters=")) for tag in r.tags)
        ):
            raise chunked(r.name)
    for name, t in lay.tensors.items():
        obj = src.get(name)
        if not isinstance(obj, h5py.Dataset):
            raise UsageError(f"{where}: {printable(name)} is no longer a dataset of the input "
                             "(was it changed while slim ran?)")
        try:
            dtype = obj.dtype
        except (ValueError, TypeError) as exc:  # a type h5py maps to no NumPy dtype
            raise CorruptFileError(plan.inventory.path, plan.inventory.format,
                                   f"{printable(name)}: h5py cannot read its HDF5 type "
                                   f"({printable(str(exc), 120)})") from exc
        if dtype.hasobject:
            raise UsageError(f"{where}: {printable(name)} holds variable-length or reference "
                             "HDF5 data, which cannot be copied byte for byte")
        filters = obj.id.get_create_plist().get_nfilters()
        if filters or (obj.chunks is not None and tuple(obj.chunks) != tuple(obj.shape)):
            raise chunked(name)
        if t.cast:
            if t.dtype not in _CAST_TYPES:
                raise UsageError(
                    f"--cast {t.dtype}: Keras keeps {t.dtype} in an opaque HDF5 type that "
                    "modelsize reads as bytes; use --cast float16"
                )
            if dtype.byteorder == ">":
                raise UsageError(f"{where}: {printable(name)} is big-endian; --cast cannot "
                                 "read it")


def _copy_attrs(h5py: Any, src: Any, dst: Any) -> None:
    """Every attribute, in the input's order, with its HDF5 type and shape."""
    for key in src.attrs:
        aid = src.attrs.get_id(key)
        value = src.attrs[key]
        try:
            if isinstance(value, h5py.Empty):
                dst.attrs.create(key, value)
            else:
                dst.attrs.create(key, value, shape=aid.shape, dtype=aid.dtype)
        except (OSError, ValueError, TypeError) as exc:
            raise UsageError(f"attribute {printable(key)} of {printable(src.name)} cannot be "
                             f"copied by h5py: {printable(str(exc))}") from exc


def _create_dataset(h5py: Any, group: Any, name: str, tid: Any, shape: tuple[int, ...]) -> Any:
    """A contiguous dataset whose space is allocated now and never filled."""
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_layout(h5py.h5d.CONTIGUOUS)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    dcpl.set_obj_track_times(False)
    space = (h5py.h5s.create_simple(shape) if shape else h5py.h5s.create(h5py.h5s.SCALAR))
    return h5py.h5d.create(group.id, name.encode("utf-8"), tid, space, dcpl=dcpl)


def _build(src: Any, dst: Any, lay: _Layout) -> list[_Fill]:
    """Copy the input's structure into ``dst`` (no data): groups, attributes, links and the
    kept datasets. Returns the datasets to fill, in creation order."""
    h5py = _h5py()
    fills: list[_Fill] = []
    made: dict[tuple[int, int], str | None] = {}  # input object -> its output path (or None)
    links: list[tuple[str, str]] = []  # (new name, existing output path): hard links
    _copy_attrs(h5py, src, dst)
    stack: list[tuple[Any, Any, str]] = [(src, dst, "")]
    while stack:
        sgroup, dgroup, prefix = stack.pop()
        children = []
        for key in sgroup:
            path = f"{prefix}{key}"
            link = sgroup.get(key, getlink=True)
            if isinstance(link, h5py.SoftLink):
                dgroup[key] = h5py.SoftLink(link.path)
                continue
            if isinstance(link, h5py.ExternalLink):
                dgroup[key] = h5py.ExternalLink(link.filename, link.path)
                continue
            obj = sgroup[key]
            ident = (obj.id.fileno, h5py.h5o.get_info(obj.id).addr)
            if ident in made:  # a second hard link to an object already copied
                target = made[ident]
                if target is not None:
                    links.append((path, target))
                continue
            if isinstance(obj, h5py.Group):
                if path in lay.pruned:
                    made[ident] = None
                    continue
                made[ident] = path
                gcpl = h5py.h5p.create(h5py.h5p.GROUP_CREATE)
                gcpl.set_obj_track_times(False)
                new = h5py.Group(h5py.h5g.create(dgroup.id, key.encode("utf-8"), gcpl=gcpl))
                _copy_attrs(h5py, obj, new)
                children.append((obj, new, f"{path}/"))
            elif isinstance(obj, h5py.Dataset):
                made[ident] = _dataset(h5py, obj, dgroup, key, path, lay, fills)
            elif isinstance(obj, h5py.Datatype):
                made[ident] = path
                dgroup[key] = obj.dtype
        stack.extend(reversed(children))
    for path, target in links:
        dst[path] = dst[target]
    for alias, original in lay.aliases.items():
        t = lay.tensors[original]
        copy, shape = src[alias], tuple(src[alias].shape)
        if shape == tuple(dst[original].shape) and _attrs_of(copy) == _attrs_of(src[original]):
            dst[alias] = dst[original]
            continue
        # Another shape or other attributes: it cannot be the original's dataset; store again.
        parent, _, key = alias.rpartition("/")
        tid = _output_type(h5py, src[original], t)
        ds = _create_dataset(h5py, dst[parent] if parent else dst, key, tid, shape)
        _copy_attrs(h5py, copy, h5py.Dataset(ds))
        fills.append(_Fill(ds, tid, shape, t, own=False))
    return fills


def _attrs_of(obj: Any) -> list[tuple[str, str, str]]:
    """An object's attributes as comparable text: name, HDF5-side dtype, value."""
    return [(k, str(obj.attrs.get_id(k).dtype), repr(obj.attrs[k])) for k in obj.attrs]


def _output_type(h5py: Any, obj: Any, t: PlannedTensor) -> Any:
    if t.cast:
        return getattr(h5py.h5t, _CAST_TYPES[t.dtype]).copy()
    return obj.id.get_type().copy()


def _dataset(h5py: Any, obj: Any, dgroup: Any, key: str, path: str, lay: _Layout,
             fills: list[_Fill]) -> str | None:
    t = lay.tensors.get(path)
    if t is None:
        return None  # dropped, or an alias (linked once every dataset exists)
    tid = _output_type(h5py, obj, t)
    shape = tuple(obj.shape)
    ds = _create_dataset(h5py, dgroup, key, tid, shape)
    _copy_attrs(h5py, obj, h5py.Dataset(ds))
    fills.append(_Fill(ds, tid, shape, t))
    return path


def _boxes(shape: tuple[int, ...], start: int,
           stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Hyperslabs ``(offset, count)`` whose union is elements ``start..stop`` (C order) of an
    array of ``shape``: at most two per dimension."""
    out: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def split(prefix: tuple[int, ...], dims: tuple[int, ...], a: int, b: int) -> None:
        ones = (1,) * len(prefix)
        if len(dims) == 1:
            out.append(((*prefix, a), (*ones, b - a)))
            return
        inner = math.prod(dims[1:])
        r0, o0 = divmod(a, inner)
        r1, o1 = divmod(b, inner)
        if r0 == r1:
            split((*prefix, r0), dims[1:], o0, o1)
            return
        if o0:
            split((*prefix, r0), dims[1:], o0, inner)
            r0 += 1
        if r1 > r0:
            out.append(((*prefix, r0, *(0,) * (len(dims) - 1)), (*ones, r1 - r0, *dims[1:])))
        if o1:
            split((*prefix, r1), dims[1:], 0, o1)

    if start < stop:
        split((), shape, start, stop)
    return out


def _fill(h5py: Any, f: _Fill, meter: Meter | None) -> Written:
    """Stream the tensor's bytes into the dataset, a chunk at a time, without conversion."""
    import numpy as np

    itemsize = f.type.get_size()
    s = stream(f.tensor, meter)
    element = 0
    carry = b""
    for chunk in s.chunks():
        data: bytes | memoryview = carry + bytes(chunk) if carry else chunk
        whole = len(data) - len(data) % itemsize
        carry = bytes(data[whole:])
        n = whole // itemsize
        if not n:
            continue
        space = f.dataset.get_space()
        if f.shape:
            space.select_none()
            for offset, count in _boxes(f.shape, element, element + n):
                space.select_hyperslab(offset, count, op=h5py.h5s.SELECT_OR)
        memory = h5py.h5s.create_simple((n,))
        buf = np.frombuffer(data, dtype=np.uint8, count=whole)
        f.dataset.write(memory, space, buf, mtype=f.type)
        element += n
    if carry or element != math.prod(f.shape):
        raise ValueError(f"{f.tensor.name}: wrote {element} elements of "
                         f"{math.prod(f.shape)}")
    return s.written


# -- reading the input's structure with h5py -----------------------------------------------


def _zip_member(path: Path, name: str) -> zipfile.ZipInfo:
    with zipfile.ZipFile(path) as zf:
        return zf.getinfo(name)


@contextlib.contextmanager
def _open_input(plan: Plan) -> Iterator[tuple[Any, bytes]]:
    """The input's HDF5 file opened by h5py (read-only), and its user block's bytes."""
    h5py = _h5py()
    inv = plan.inventory
    path = inv.files[0].path
    with contextlib.ExitStack() as stack:
        try:
            raw: Any
            if inv.format == "keras":
                from modelsize.formats import _zip
                from modelsize.formats.keras import InflatedBlob
                from modelsize.inventory import InventoryBuilder

                builder = InventoryBuilder(inv.format, [path])
                member = next((m for m in _zip.members(path, builder)
                               if m.name == WEIGHTS_MEMBER), None)
                if member is None:
                    raise UsageError(f"{printable(str(path))}: no {WEIGHTS_MEMBER} in the "
                                     "archive")
                fh = stack.enter_context(inputs.open_input(path))
                if member.method == _zip.STORED:
                    raw = _Window(fh, member.data_offset, member.file_size)
                else:
                    raw = _InflatedFile(InflatedBlob(fh, member))
                f = stack.enter_context(h5py.File(raw, "r"))
            else:
                raw = stack.enter_context(inputs.open_input(path))
                f = stack.enter_context(h5py.File(inputs.reopen_path(path), "r", locking=False))
            head = b""
            if f.userblock_size:
                raw.seek(0)
                head = raw.read(f.userblock_size) or b""
        except (OSError, ValueError, zipfile.BadZipFile, zlib.error) as exc:
            raise CorruptFileError(path, inv.format, f"h5py cannot read it: {exc}") from exc
        yield f, head


def _write_hdf5(plan: Plan, lay: _Layout, fh: Any, meter: Meter | None,
                check: bool = False) -> dict[str, Written]:
    """The whole HDF5 output into the file object ``fh``; its data only with a ``meter``
    (without, the skeleton: what sizes the output). ``check`` refuses what cannot be copied.

    h5py reads the input's objects as they are copied: where it cannot (a damaged heap, a name
    that is not UTF-8), the input is corrupt, and said so in one line. Errors of the operating
    system (a full disk while writing) go on as they are.
    """
    try:
        return _write_hdf5_unchecked(plan, lay, fh, meter, check)
    except OSError as exc:
        if exc.errno is not None:
            raise
        raise _h5py_failed(plan, exc) from exc
    except (RuntimeError, KeyError, UnicodeDecodeError, TypeError) as exc:
        raise _h5py_failed(plan, exc) from exc


def _h5py_failed(plan: Plan, exc: BaseException) -> CorruptFileError:
    inv = plan.inventory
    return CorruptFileError(inv.files[0].path, inv.format,
                            f"h5py cannot read it: {type(exc).__name__}: {exc}")


def _write_hdf5_unchecked(plan: Plan, lay: _Layout, fh: Any, meter: Meter | None,
                          check: bool) -> dict[str, Written]:
    h5py = _h5py()
    written: dict[str, Written] = {}
    with _open_input(plan) as (src, head):
        if check:
            _check(plan, src, lay)
        kwargs = {"userblock_size": len(head)} if head else {}
        with h5py.File(fh, "w", **kwargs) as dst:
            fills = _build(src, dst, lay)
            if meter is not None:
                for f in fills:
                    w = _fill(h5py, f, meter if f.own else None)
                    if f.own:
                        written[f.tensor.name] = w
    if head:
        fh.seek(0)
        fh.write(head)
    return written


def _hdf5_size(plan: Plan, lay: _Layout) -> int:
    """The output's exact size: its skeleton, built where only metadata is kept."""
    sizer = _Sizer()
    _write_hdf5(plan, lay, sizer, None, check=True)
    return sizer.size


def _notes(plan: Plan, target: Path, lay: _Layout) -> None:
    dropped = [d for d in plan.dropped if d.record.category != Category.OPTIMIZER_STATE
               and not d.reason.startswith("holds no data")]
    if dropped:
        plan.notes.append(
            f"Keras loads a layer only with all its variables: {printable(dropped[0].record.name)}"
            f"{f' and {len(dropped) - 1} more' if len(dropped) > 1 else ''} dropped, so "
            "load_model/load_weights may refuse the output"
        )
    optimizer = any(d.record.category == Category.OPTIMIZER_STATE for d in plan.dropped)
    if plan.inventory.format == "keras":
        if optimizer:
            plan.notes.append(
                "the optimizer's variables are gone: keras.models.load_model compiles the "
                "model with a fresh optimizer and warns that the file holds none of its "
                "variables (load_model(path, compile=False) does not)"
            )
        if not target.name.endswith(".keras"):
            plan.notes.append("keras.models.load_model needs a name ending in .keras")
    elif plan.inventory.facts.get("layout") == "Keras 3 weights" and not target.name.endswith(
            ".weights.h5"):
        plan.notes.append("Keras 3 load_weights needs a name ending in .weights.h5")
    if lay.aliases:
        plan.notes.append(f"{len(lay.aliases)} duplicate(s) are hard links to one dataset")


def _check_format(plan: Plan, expected: str) -> None:
    if plan.inventory.format != expected:
        raise UsageError(f"the {expected} writer cannot write {plan.inventory.format} input; "
                         "use --to safetensors")


# -- the jobs --------------------------------------------------------------------------------


@dataclass
class KerasH5Job:
    """One HDF5 file: a legacy Keras model or a weights file."""

    files: list[str]
    main: str
    directory: bool
    predicted_bytes: int | None
    plan: Plan
    layout: _Layout

    def write(self, out: Output, meter: Meter) -> dict[str, Written]:
        """Skeleton, then every kept dataset's bytes streamed into it."""
        return _write_hdf5(self.plan, self.layout, out.open(self.main), meter)

    def output_name(self, name: str) -> str:
        """Datasets keep their paths."""
        return name


class _InPlaceZipWriter(ZipWriter):
    """A :class:`ZipWriter` that also lets a function write a stored member's bytes in place
    (h5py writes an HDF5 file out of order), its CRC read back afterwards."""

    def write_in_place(self, member: Member, fill: Callable[[_Window], None]) -> Member:
        """Header (sizes as planned), ``fill`` into the data window, then CRC and sizes."""
        m = member
        m.header_offset = self.pos
        extra = local_extra(m, m.header_offset)
        header = self.local_header(m, extra, crc=0, compressed=0)
        self.fh.seek(m.header_offset)
        self.fh.write(header)
        m.data_offset = m.header_offset + len(header)
        window = _Window(self.fh, m.data_offset, writable=True)
        fill(window)
        m.nbytes = m.compressed = window.size
        if len(local_extra(m, m.header_offset)) != len(extra):
            raise ValueError(f"member {m.name}: {window.size} bytes written, the header was "
                             "laid out for another size")
        self.fh.flush()
        crc, pos = 0, 0
        while pos < window.size:
            self.fh.seek(m.data_offset + pos)
            piece = self.fh.read(min(_COPY_STEP, window.size - pos))
            if not piece:
                raise ValueError(f"member {m.name} reads back short")
            crc = crc32(piece, crc)
            pos += len(piece)
        m.crc = crc
        self.fh.seek(m.header_offset)
        self.fh.write(self.local_header(m, extra, crc=crc, compressed=m.compressed))
        self.pos = m.data_offset + m.compressed
        self.fh.seek(self.pos)
        self.members.append(m)
        return m


def _copy_raw(zw: ZipWriter, m: _zip.Member, src: BinaryIO) -> None:
    """Copy a member as it is in the input (its compressed bytes, CRC and sizes): a deflated
    member is never inflated, so an archive holding a deflate bomb stays as small as it was."""
    out = Member(m.name, m.file_size, deflate=m.method == _zip.DEFLATED)
    out.header_offset = zw.pos
    extra = local_extra(out, out.header_offset)
    header = zw.local_header(out, extra, crc=m.crc, compressed=m.compress_size)
    zw.fh.seek(out.header_offset)
    zw.fh.write(header)
    out.data_offset = out.header_offset + len(header)
    out.compressed, out.crc = m.compress_size, m.crc
    if isinstance(zw.fh, _Counter):
        zw.fh.seek(m.compress_size, 1)
    else:
        left, pos = m.compress_size, m.data_offset
        while left:
            src.seek(pos)
            piece = src.read(min(left, _COPY_STEP))
            if not piece:
                raise ValueError(f"member {m.name} ends early in the input")
            zw.fh.write(piece)
            left -= len(piece)
            pos += len(piece)
    zw.pos = out.data_offset + out.compressed
    zw.members.append(out)


def _write_archive(fh: BinaryIO, path: Path, members: list[_zip.Member], hdf5_bytes: int,
                   fill: Callable[[_Window], None] | None) -> None:
    """The output archive into ``fh``: every member copied as it is, the weights member written
    in place by ``fill`` (with no ``fill``, a :class:`_Counter` learns the archive's size)."""
    zw = _InPlaceZipWriter(fh)
    with open(path, "rb") as src:
        for m in members:
            if m.name != WEIGHTS_MEMBER:
                _copy_raw(zw, m, src)
            elif fill is None:
                _skip_in_place(zw, Member(m.name, hdf5_bytes))
            else:
                zw.write_in_place(Member(m.name, hdf5_bytes), fill)
    zw.close()


def _skip_in_place(zw: ZipWriter, m: Member) -> None:
    """A stored member's header and ``m.nbytes`` skipped over, as :meth:`write_in_place` would
    lay them out (for a :class:`_Counter`)."""
    m.header_offset = zw.pos
    extra = local_extra(m, m.header_offset)
    zw.fh.write(zw.local_header(m, extra, crc=0, compressed=m.nbytes))
    m.data_offset = zw.fh.tell()
    zw.fh.seek(m.nbytes, 1)
    m.compressed = m.nbytes
    zw.pos = m.data_offset + m.nbytes
    zw.members.append(m)


@dataclass
class KerasJob:
    """A ``.keras`` archive: the input's members in order, the weights member rewritten."""

    files: list[str]
    main: str
    directory: bool
    predicted_bytes: int | None
    plan: Plan
    layout: _Layout
    members: list[_zip.Member] = field(default_factory=list)
    hdf5_bytes: int = 0

    def write(self, out: Output, meter: Meter) -> dict[str, Written]:
        """Every member copied as it is; the HDF5 member written by h5py in place."""
        written: dict[str, Written] = {}

        def fill(window: _Window) -> None:
            written.update(_write_hdf5(self.plan, self.layout, window, meter))

        _write_archive(out.open(self.main), self.plan.inventory.files[0].path, self.members,
                       self.hdf5_bytes, fill)
        return written

    def output_name(self, name: str) -> str:
        """Datasets keep their paths."""
        return name


# -- the writers -----------------------------------------------------------------------------


class KerasH5Writer:
    """Legacy Keras ``.h5`` models and weights, Keras 3 ``.weights.h5``."""

    name = "keras-h5"

    def default_target(self, plan: Plan, source: Path) -> Path:
        """``x.slim.h5``; ``x.slim.weights.h5`` (Keras 3 loads only that suffix)."""
        if source.name.endswith(".weights.h5"):
            return source.with_name(source.name[: -len(".weights.h5")] + ".slim.weights.h5")
        return slim_name(source)

    def prepare(self, plan: Plan, target: Path) -> KerasH5Job:
        """Check every kept dataset, then size the output from its skeleton. An input Keras
        would not load is refused first."""
        _check_format(plan, "keras-h5")
        refuse_unloadable(plan.inventory)
        listed = keras_h5_listed(plan.inventory)
        needed = [d for d in plan.dropped if d.record.name in listed]
        if needed:
            d = needed[0]
            raise UsageError(
                f"{printable(str(plan.inventory.path))}: Keras's HDF5 loader reads every weight "
                f"a layer lists, and layer {printable(listed[d.record.name])} lists "
                f"{printable(d.record.name)} ({d.record.category.value}): keep it "
                f"(--keep '{printable(d.record.name)}') or write another format (--to "
                "safetensors)")
        lay = _layout(plan)
        size = _hdf5_size(plan, lay)
        _notes(plan, target, lay)
        return KerasH5Job([target.name], target.name, False, size, plan, lay)


class KerasWriter:
    """Keras 3 ``.keras`` archives."""

    name = "keras"

    def default_target(self, plan: Plan, source: Path) -> Path:
        """``x.slim.keras``."""
        return slim_name(source, ".keras")

    def prepare(self, plan: Plan, target: Path) -> KerasJob:
        """The members in the input's order, copied as they are, the weights member stored;
        the archive's exact size. An input Keras would not load is refused first."""
        _check_format(plan, "keras")
        # Every member read through (zipfile checks each one's CRC-32 when Keras loads it; a
        # stored weights member is otherwise read by h5py in place, unchecked).
        refuse_unloadable(plan.inventory, whole=True)
        path = plan.inventory.files[0].path
        from modelsize.inventory import InventoryBuilder

        members = _zip.members(path, InventoryBuilder("keras", [path]))
        for m in members:
            if m.method not in (_zip.STORED, _zip.DEFLATED):
                raise CorruptFileError(path, "keras", f"member {m.name!r} uses compression "
                                       f"method {m.method}; Keras writes stored members")
        lay = _layout(plan)
        hdf5 = _hdf5_size(plan, lay)
        counter = _Counter()
        _write_archive(counter, path, members, hdf5, None)  # type: ignore[arg-type]
        if any(m.method != _zip.STORED for m in members if m.name == WEIGHTS_MEMBER):
            plan.notes.append(f"the input's {WEIGHTS_MEMBER} is deflated; the output stores "
                              "it, as Keras writes it")
        _notes(plan, target, lay)
        return KerasJob([target.name], target.name, False, counter.size, plan, lay,
                        members, hdf5)


__all__ = ["KerasH5Job", "KerasH5Writer", "KerasJob", "KerasWriter"]
