"""``torch.distributed.checkpoint`` (DCP) directories, read without torch.

Layout written by ``dcp.save(state_dict, checkpoint_id=DIR)`` (``FileSystemWriter``)::

    DIR/.metadata        a pickle of ``Metadata``: ``state_dict_metadata`` (fqn ->
                         ``TensorStorageMetadata(properties.dtype, size, chunks)`` or
                         ``BytesStorageMetadata``), ``storage_data`` (``MetadataIndex(fqn,
                         offset, index)`` -> ``_StorageInfo(relative_path, offset, length)``) and
                         ``planner_data`` (fqn -> the key path in the original state dict)
    DIR/__R_N.distcp     rank R's N-th file: each item a complete ``torch.save`` archive of one
                         tensor chunk, or of one non-tensor value (a "bytes" item)

Each item's archive is parsed in place (its zip structure and ``data.pkl`` are metadata, its
one storage member holds the chunk's bytes). Categories come from the state dict's structure:
the key paths are rebuilt into a tree and classified by the same rules as any torch
checkpoint, so ``optim.state.*`` under an optimizer state dict is optimizer state and
``optim.param_groups.*`` bytes items count as optimizer state too.

``.metadata`` is loaded by torch with ``pickle.load`` and bytes items with
``torch.load(weights_only=False)``: any callable they name beyond DCP's own dataclasses is
reported as unsafe. Not read: files written with ``SerializationFormat.SAFETENSORS``.
"""

from __future__ import annotations

import math
import re
import struct
import zipfile
from pathlib import Path
from typing import IO, Any, cast

from modelsize._records import record
from modelsize.categories import Category
from modelsize.dtypes import DTYPES, canonical
from modelsize.errors import CorruptFileError, printable
from modelsize.formats import _zip
from modelsize.formats._pickle import Call, Global, PickleError, UnhashableKey, scan, scan_all
from modelsize.formats._torch_tree import (
    StorageRef,
    classify,
    describe,
    global_name,
    mapping_items,
    storage_dtype,
)
from modelsize.formats.base import SeekableBytes, Source, is_regular_file
from modelsize.formats.safetensors import classify_name
from modelsize.formats.torch_sharded import inside, relative, split_facts
from modelsize.inventory import Inventory, InventoryBuilder

FORMAT = "torch-dcp"
METADATA_NAME = ".metadata"
SUFFIX = ".distcp"
#: ``.metadata`` lists every chunk of every tensor; larger than this is not a real one.
MAX_METADATA = 1 << 30
#: A bytes item's pickle, or a tensor item's ``data.pkl``, read whole up to this size.
MAX_ITEM_PICKLE = 1 << 28
_DCP = "torch.distributed.checkpoint"
#: Callables of ``.metadata`` that only rebuild DCP's own dataclasses (allow-listed here; the
#: generic pickle judge does not know them).
DCP_GLOBALS: frozenset[str] = frozenset(
    {f"{_DCP}.metadata.{n}" for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    )}
    | {f"{_DCP}.filesystem._StorageInfo", f"{_DCP}.storage._StorageInfo",
       "pathlib.PosixPath", "pathlib.WindowsPath", "pathlib.PurePosixPath",
       "pathlib.PureWindowsPath", "pathlib._local.PosixPath", "pathlib._local.WindowsPath"}
)
_RANK_FILE = re.compile(r"^__(\d+)_(\d+)\.distcp$")
_LOCAL = struct.Struct("<4sHHHHHIIIHH")
#: What zipfile raises on a malformed archive (NotImplementedError: "zip file version 24.4").
_ZIP_ERRORS = (zipfile.BadZipFile, ValueError, EOFError, struct.error, NotImplementedError)
_OPTIMIZER_ROOTS = frozenset(
    {"optim", "optimizer", "optimizers", "optim_state", "optimizer_state", "optimizer_states",
     "optimizer_state_dict"}
)


def _fields(obj: object, cls: str, what: str) -> dict[str, Any]:
    """The attributes of a pickled DCP dataclass ``cls`` (from ``BUILD`` state), else raise."""
    name = global_name(obj.func) if isinstance(obj, Call) else ""
    if not (name.startswith(_DCP + ".") and name.rsplit(".", 1)[-1] == cls):
        raise ValueError(f"{what} is {describe(obj)}, expected a DCP {cls}")
    assert isinstance(obj, Call)
    state = obj.state
    if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
        state = {**(state[0] if isinstance(state[0], dict) else {}), **state[1]}
    if state is None:
        return {}
    if isinstance(state, tuple) and cls == "TensorProperties":
        keys = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")
        return dict(zip(keys, state, strict=False))
    if not isinstance(state, dict):
        raise ValueError(f"{what}: {cls} state is {describe(state)}, expected its fields")
    return {str(k): v for k, v in state.items()}


def _size(obj: object, what: str) -> tuple[int, ...]:
    if isinstance(obj, Call) and global_name(obj.func) == "torch.Size" and obj.args:
        obj = obj.args[0]
    if not isinstance(obj, (tuple, list)) or len(obj) > 64 or not all(
        type(d) is int and d >= 0 for d in obj
    ):
        raise ValueError(f"{what} is {describe(obj)}, expected a tuple of sizes")
    return tuple(obj)


@record
class _Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    stored: bool = False


@record
class _TensorMeta:
    fqn: str
    dtype: str
    dtype_ref: Global
    size: tuple[int, ...]
    chunks: list[_Chunk]


@record
class _Item:
    fqn: str
    index: int | None
    offset: tuple[int, ...] | None
    file: str
    start: int
    length: int
    transformed: bool


class _Window(SeekableBytes):
    """Bytes ``start .. start + length`` of an open file, as a seekable file of their own."""

    def __init__(self, fh: IO[bytes], start: int, length: int) -> None:
        super().__init__(length)
        self.fh, self.start = fh, start

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), self.size - self.pos))
        if n == 0:
            return 0
        self.fh.seek(self.start + self.pos)
        data = self.fh.read(n)
        buffer[: len(data)] = data
        self.pos += len(data)
        return len(data)


@record(frozen=True)
class _Member:
    name: str
    data_offset: int  # relative to the item's start
    size: int
    stored: bool


def _item_members(fh: IO[bytes], start: int, length: int) -> dict[str, _Member]:
    """The members of the ``torch.save`` archive that fills one item, located inside it."""
    window = _Window(fh, start, length)
    infos = _zip.directory(cast(IO[bytes], window))  # a seekable binary file
    out: dict[str, _Member] = {}
    for info in infos:
        if not 0 <= info.header_offset <= length - _LOCAL.size:
            raise ValueError(f"member {info.filename!r} header at {info.header_offset} lies "
                             "outside the item")
        window.seek(info.header_offset)
        raw = window.read(_LOCAL.size)
        if len(raw) != _LOCAL.size or raw[:4] != b"PK\x03\x04":
            raise ValueError(f"member {info.filename!r} has no local header at "
                             f"{info.header_offset} of the item")
        fields = _LOCAL.unpack(raw)
        data = info.header_offset + _LOCAL.size + fields[9] + fields[10]
        if data + info.compress_size > length:
            raise ValueError(f"member {info.filename!r} runs past the end of the item")
        stored = info.compress_type == zipfile.ZIP_STORED
        if stored and info.compress_size != info.file_size:
            raise ValueError(f"stored member {info.filename!r} sizes disagree")
        out[info.filename] = _Member(info.filename, data, info.compress_size, stored)
    return out


def pickle_member(members: dict[str, _Member]) -> str | None:
    """The name of an item archive's pickle (``data.pkl``, or ``ARCHIVE/data.pkl``)."""
    return next((n for n in members if n == "data.pkl" or (
        n.endswith("/data.pkl") and n.count("/") == 1)), None)


def storage_items(data: bytes) -> list[tuple[str, int, int, bool]]:
    """``(relative_path, offset, length, transformed)`` of each ``storage_data`` item of a
    ``.metadata`` pickle: where the remote walker (:mod:`modelsize.remote_regions`) finds the
    archives whose headers the reader reads. Raises ``PickleError`` or ``ValueError``."""
    read = _DcpRead(Path(), Path())
    read.notes = []
    items = read.structure(scan(data).value)[2]
    return [(i.file, i.start, i.length, i.transformed) for i in items]


def read_item_pickle(fh: IO[bytes], start: int, length: int) -> bytes:
    """What the reader reads of one item's archive (its end records, central directory,
    local headers and pickle), read through ``fh``; returns the pickle. Raises what a broken
    archive raises (``_ZIP_ERRORS``), and whatever ``fh`` raises."""
    members = _item_members(fh, start, length)
    pkl = pickle_member(members)
    if pkl is None or not members[pkl].stored or members[pkl].size > MAX_ITEM_PICKLE:
        return b""
    return _read(fh, start + members[pkl].data_offset, members[pkl].size)


def _read(fh: IO[bytes], offset: int, n: int) -> bytes:
    fh.seek(offset)
    data = fh.read(n)
    if len(data) != n:
        raise ValueError(f"file ends {n - len(data)} bytes early")
    return data


class _DcpRead:
    def __init__(self, directory: Path, root: Path) -> None:
        self.dir = directory
        self.root = root
        self.meta_path = directory / METADATA_NAME

    def bad(self, reason: str, path: Path | None = None) -> CorruptFileError:
        return CorruptFileError(path or self.meta_path, FORMAT, reason)

    # -- .metadata ----------------------------------------------------------------------
    def parse_metadata(self) -> tuple[dict[str, _TensorMeta], dict[str, None], list[_Item],
                                      dict[str, tuple[object, ...]], list[str]]:
        size = self.meta_path.stat().st_size
        if size > MAX_METADATA:
            raise self.bad(f".metadata is {size} bytes, more than the {MAX_METADATA} modelsize "
                           "reads")
        data = self.meta_path.read_bytes()
        try:
            parsed = scan(data)
        except PickleError as exc:
            extra = f" (before that it calls {', '.join(exc.unsafe)})" if exc.unsafe else ""
            raise self.bad(f"expected a pickled DCP Metadata: {exc}{extra}") from exc
        self.unsafe = [u for u in parsed.unsafe if u not in DCP_GLOBALS]
        if parsed.end != len(data):
            self.notes.append(f".metadata holds {len(data) - parsed.end} bytes after its pickle")
        try:
            return self.structure(parsed.value)
        except ValueError as exc:
            raise self.bad(str(exc)) from exc

    def structure(self, root: object) -> tuple[dict[str, _TensorMeta], dict[str, None],
                                               list[_Item], dict[str, tuple[object, ...]],
                                               list[str]]:
        md = _fields(root, "Metadata", ".metadata")
        sdm = md.get("state_dict_metadata")
        storage = md.get("storage_data")
        if not isinstance(sdm, dict) or not isinstance(storage, dict):
            raise ValueError("Metadata has no state_dict_metadata / storage_data dicts")
        tensors: dict[str, _TensorMeta] = {}
        byte_items: dict[str, None] = {}
        for fqn, entry in sdm.items():
            if not isinstance(fqn, str):
                raise ValueError(f"state_dict_metadata key {describe(fqn)} is not a string")
            kind = global_name(entry.func).rsplit(".", 1)[-1] if isinstance(entry, Call) else ""
            if kind == "BytesStorageMetadata":
                byte_items[fqn] = None
                continue
            f = _fields(entry, "TensorStorageMetadata", f"entry {fqn!r}")
            props = _fields(f.get("properties"), "TensorProperties", f"{fqn!r} properties")
            ref = props.get("dtype")
            dtype = canonical(global_name(ref)) if isinstance(ref, Global) else None
            if dtype is None or not isinstance(ref, Global):
                raise ValueError(f"{fqn!r} has dtype {describe(ref)}, not a torch dtype")
            shape = _size(f.get("size"), f"{fqn!r} size")
            chunks_in = f.get("chunks")
            if not isinstance(chunks_in, list):
                raise ValueError(f"{fqn!r} chunks are {describe(chunks_in)}, expected a list")
            chunks = []
            for c in chunks_in:
                cf = _fields(c, "ChunkStorageMetadata", f"{fqn!r} chunk")
                offsets = _size(cf.get("offsets"), f"{fqn!r} chunk offsets")
                sizes = _size(cf.get("sizes"), f"{fqn!r} chunk sizes")
                if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
                    o + s > d for o, s, d in zip(offsets, sizes, shape, strict=True)
                ):
                    raise ValueError(f"{fqn!r} chunk at {offsets} of size {sizes} does not fit "
                                     f"in the tensor's size {shape}")
                chunks.append(_Chunk(offsets, sizes))
            tensors[fqn] = _TensorMeta(fqn, dtype, ref, shape, chunks)

        items = []
        for key, info in storage.items():
            k = _fields(key.value if isinstance(key, UnhashableKey) else key, "MetadataIndex",
                        "storage_data key")
            fqn, index, offset = k.get("fqn"), k.get("index"), k.get("offset")
            s = _fields(info, "_StorageInfo", f"storage_data of {fqn!r}")
            rel, start, length = s.get("relative_path"), s.get("offset"), s.get("length")
            if not isinstance(fqn, str) or not isinstance(rel, str):
                raise ValueError(f"storage_data entry {describe(fqn)} has no fqn/relative_path")
            if not (type(start) is int and type(length) is int and start >= 0 and length >= 0):
                raise ValueError(f"storage_data of {fqn!r}: offset {describe(start)} / length "
                                 f"{describe(length)} are not sizes")
            items.append(
                _Item(fqn, index if type(index) is int else None,
                      None if offset is None else _size(offset, f"{fqn!r} index offset"),
                      rel, start, length, bool(s.get("transform_descriptors")))
            )
        paths: dict[str, tuple[object, ...]] = {}
        planner = md.get("planner_data")
        for fqn, path in (planner.items() if isinstance(planner, dict) else ()):
            if isinstance(fqn, str) and isinstance(path, tuple):
                paths[fqn] = path
        version = md.get("version")
        return tensors, byte_items, items, paths, [str(version)] if isinstance(version, str) else []

    # -- categories ---------------------------------------------------------------------
    def categories(
        self, tensors: dict[str, _TensorMeta], byte_items: dict[str, None],
        paths: dict[str, tuple[object, ...]],
    ) -> tuple[dict[str, tuple[Category, tuple[str, ...]]], set[str]]:
        """Category and tags of each tensor fqn, and the fqns of bytes items of an optimizer.

        The state dict is rebuilt from the key paths with storage-less tensors as leaves and
        classified into a scratch builder: the rules are those of any torch checkpoint.
        """
        tree: dict[object, Any] = {}
        joined: dict[str, str] = {}

        def place(fqn: str, leaf: object) -> None:
            path = paths.get(fqn) or tuple(fqn.split("."))
            node = tree
            for part in path[:-1]:
                child = node.setdefault(part, {})
                if not isinstance(child, dict):
                    return
                node = child
            node.setdefault(path[-1], leaf)
            joined[fqn] = ".".join(str(p) for p in path)

        for fqn, t in tensors.items():
            stride = tuple(math.prod(t.size[i + 1:]) for i in range(len(t.size)))
            place(fqn, Call(Global("torch._utils", "_rebuild_meta_tensor_no_storage"),
                            (t.dtype_ref, t.size, stride)))
        for fqn in byte_items:
            place(fqn, "bytes")
        scratch = InventoryBuilder(FORMAT, [self.meta_path])
        classify(tree, scratch)
        found = {t.name: (t.category, t.tags) for t in scratch.build().tensors}
        out: dict[str, tuple[Category, tuple[str, ...]]] = {}
        for fqn, t in tensors.items():
            hit = found.get(joined.get(fqn, ""))
            floating = DTYPES[t.dtype].floating
            out[fqn] = hit if hit is not None else classify_name(fqn, floating)
        optimizer = {
            fqn for fqn in byte_items if self.under_optimizer(tree, paths.get(fqn)
                                                              or tuple(fqn.split(".")))
        }
        return out, optimizer

    @staticmethod
    def under_optimizer(tree: dict[object, Any], path: tuple[object, ...]) -> bool:
        node: object = tree
        for part in path:
            items = mapping_items(node)
            keys = {k for k, _ in items or []}
            if "state" in keys and "param_groups" in keys:
                return True
            if str(part).lower() in _OPTIMIZER_ROOTS:
                return True
            node = node.get(part) if isinstance(node, dict) else None
        return False

    # -- the files ----------------------------------------------------------------------
    def run(self) -> Inventory:
        self.notes: list[str] = []
        tensors, byte_items, items, paths, version = self.parse_metadata()
        by_name: dict[str, Path] = {}
        for item in items:
            if item.file not in by_name:
                path = inside(self.dir, item.file, self.meta_path, FORMAT, "relative_path")
                if not is_regular_file(path):
                    raise self.bad(f"storage_data places {printable(item.fqn)!r} in "
                                   f"{printable(item.file)!r}, which is missing")
                by_name[item.file] = path
        names = sorted(by_name)
        stale = sorted(
            p for p in self.dir.glob("*" + SUFFIX)
            if p.is_file() and p.name not in by_name and relative(p, self.dir) not in by_name
        )
        files = [self.meta_path, *(by_name[n] for n in names), *stale]
        b = InventoryBuilder(FORMAT, files, root=self.root)
        self.builder = b
        index_of = {n: i + 1 for i, n in enumerate(names)}
        b.add_region(0, b.files[0].nbytes, Category.METADATA, ".metadata")
        for name in self.unsafe:
            b.add_unsafe_global(name)
        for i, p in enumerate(stale, start=1 + len(names)):
            b.add_region(0, b.files[i].nbytes, Category.OTHER, f"{p.name} (not in .metadata)", i)
        if stale:
            b.notes.append(
                f"{len(stale)} .distcp file(s) are not referenced by .metadata (left over from "
                "an earlier save?) and count as other: "
                + ", ".join(printable(p.name, 60) for p in stale[:5])
            )

        cats, optimizer = self.categories(tensors, byte_items, paths)
        for item in sorted(items, key=lambda it: (it.file, it.start)):
            file = index_of[item.file]
            b.check_range(item.start, item.length, f"storage_data item {item.fqn!r}", file)
            with open(b.files[file].path, "rb") as fh:
                if item.fqn in tensors:
                    self.tensor_item(fh, item, file, tensors[item.fqn], cats[item.fqn])
                elif item.fqn in byte_items:
                    cat = Category.OPTIMIZER_STATE if item.fqn in optimizer else Category.METADATA
                    self.bytes_item(fh, item, file, cat, paths.get(item.fqn))
                else:
                    raise self.bad(f"storage_data names {printable(item.fqn)!r}, which "
                                   "state_dict_metadata does not list")
        for t in tensors.values():
            missing = [c.offsets for c in t.chunks if not c.stored]
            if missing:
                raise self.bad(f"tensor {printable(t.fqn)!r} chunk at {missing[0]} has no entry "
                               "in storage_data")
        b.facts["dcp_files"] = str(len(names))
        if version:
            b.facts["dcp_version"] = version[0]
        b.notes.extend(self.notes)
        inv = b.build()
        ranks: dict[str, list[int]] = {}
        for i, n in enumerate(names, start=1):
            m = _RANK_FILE.match(Path(n).name)
            if m:
                ranks.setdefault(f"rank {int(m.group(1))}", []).append(i)
        if ranks:
            inv.facts["ranks"] = str(len(ranks))
            inv.facts.update(split_facts(inv, dict(sorted(ranks.items(),
                                                          key=lambda kv: int(kv[0][5:])))))
        return inv

    def corrupt_item(self, item: _Item, file: int, reason: str) -> CorruptFileError:
        return self.builder.corrupt(
            f"item {printable(item.fqn)!r} at bytes {item.start}..{item.start + item.length}: "
            f"{reason}", item.start, file,
        )

    def members(self, fh: IO[bytes], item: _Item, file: int) -> tuple[dict[str, _Member], str]:
        try:
            members = _item_members(fh, item.start, item.length)
        except _ZIP_ERRORS as exc:
            raise self.corrupt_item(item, file, f"expected a torch.save archive ({exc})") from exc
        pkl = pickle_member(members)
        if pkl is None:
            raise self.corrupt_item(item, file, "the item's archive has no data.pkl")
        return members, pkl

    def item_pickle(
        self, fh: IO[bytes], item: _Item, file: int, members: dict[str, _Member], pkl: str
    ) -> bytes:
        m = members[pkl]
        if not m.stored or m.size > MAX_ITEM_PICKLE:
            raise self.corrupt_item(item, file, f"{pkl} is compressed or larger than "
                                                f"{MAX_ITEM_PICKLE} bytes")
        return _read(fh, item.start + m.data_offset, m.size)

    def storage(self, pid: object, item: _Item, file: int, members: dict[str, _Member],
                archive: str, refs: dict[str, StorageRef]) -> StorageRef:
        """A persistent id of an item's pickle, declared as a storage of the checkpoint."""
        if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage"):
            raise self.corrupt_item(item, file, f"persistent id {describe(pid)} is not a storage")
        dtype = storage_dtype(pid[1])
        key, numel = pid[2], pid[4]
        if dtype is None or not isinstance(key, str) or type(numel) is not int or numel < 0:
            raise self.corrupt_item(item, file, f"storage {describe(key)} of type "
                                                f"{describe(pid[1])} is invalid")
        m = members.get(f"{archive}data/{key}")
        if m is None:
            raise self.corrupt_item(item, file, f"its pickle refers to storage {key!r}, which "
                                                "the archive lacks")
        full = f"{item.file}@{item.start}/data/{key}"
        ref = StorageRef(full, dtype, numel)
        if ref.nbytes != m.size:
            raise self.corrupt_item(item, file, f"storage {key!r} should hold {numel} x {dtype} "
                                                f"= {ref.nbytes} bytes, the member holds {m.size}")
        if not self.builder.has_storage(full):
            self.builder.add_storage(full, item.start + m.data_offset, m.size, file=file,
                                     compressed=not m.stored, dtype=dtype)
        refs[key] = ref
        return ref

    def tensor_item(self, fh: IO[bytes], item: _Item, file: int, meta: _TensorMeta,
                    cat: tuple[Category, tuple[str, ...]]) -> None:
        b = self.builder
        chunk = self.chunk_of(item, meta, file)
        name = chunk_name(meta.fqn, chunk.offsets, len(meta.chunks))
        dt = DTYPES[meta.dtype]
        if item.transformed:
            # A compressed stream: its bytes cannot be split into header and data.
            key = f"{item.file}@{item.start}"
            b.add_storage(key, item.start, item.length, file=file, compressed=True,
                          logical_nbytes=dt.nbytes(math.prod(chunk.sizes)), dtype=meta.dtype)
            b.add_tensor(name, meta.dtype, chunk.sizes, cat[0], storage=key, tags=cat[1])
            return
        members, pkl = self.members(fh, item, file)
        data = self.item_pickle(fh, item, file, members, pkl)
        refs: dict[str, StorageRef] = {}
        archive = pkl[: -len("data.pkl")]
        try:
            parsed = scan(data, persistent_load=lambda pid: self.storage(
                pid, item, file, members, archive, refs))
        except PickleError as exc:
            raise self.corrupt_item(item, file, f"{pkl} is not a valid pickle: {exc}") from exc
        for u in parsed.unsafe:
            b.add_unsafe_global(u)
        call = parsed.value
        func = global_name(call.func) if isinstance(call, Call) else ""
        args = call.args if isinstance(call, Call) else ()
        if not func.startswith("torch._utils._rebuild_tensor") or len(args) < 4 or not (
            isinstance(args[0], StorageRef) and type(args[1]) is int and args[1] >= 0
        ):
            raise self.corrupt_item(item, file, f"expected one tensor, found {describe(call)}")
        try:
            shape, stride = _size(args[2], "size"), _size(args[3], "stride")
        except ValueError as exc:
            raise self.corrupt_item(item, file, str(exc)) from exc
        if shape != chunk.sizes or canonical(args[0].dtype) != meta.dtype:
            raise self.corrupt_item(
                item, file, f".metadata says {meta.dtype}{list(chunk.sizes)}, the item holds "
                f"{args[0].dtype}{list(shape)}")
        last = args[1] + sum((d - 1) * s for d, s in zip(shape, stride, strict=False))
        if math.prod(shape) and dt.nbytes(last + 1) > args[0].nbytes:
            raise self.corrupt_item(item, file, "the tensor reaches past its storage")
        b.add_tensor(name, meta.dtype, shape, cat[0], storage=args[0].key,
                     storage_offset=args[1], strides=stride, tags=cat[1])

    def chunk_of(self, item: _Item, meta: _TensorMeta, file: int) -> _Chunk:
        chunk = None
        if item.index is not None and 0 <= item.index < len(meta.chunks):
            chunk = meta.chunks[item.index]
            if item.offset is not None and chunk.offsets != item.offset:
                chunk = None
        if chunk is None and item.offset is not None:
            chunk = next((c for c in meta.chunks if c.offsets == item.offset), None)
        if chunk is None:
            raise self.corrupt_item(item, file, f"no chunk of {meta.fqn!r} starts at "
                                                f"{item.offset}")
        if chunk.stored:
            raise self.corrupt_item(item, file, f"chunk {chunk.offsets} is stored twice")
        chunk.stored = True
        return chunk

    def bytes_item(self, fh: IO[bytes], item: _Item, file: int, cat: Category,
                   path: tuple[object, ...] | None) -> None:
        b = self.builder
        if item.transformed:
            b.add_region(item.start, item.length, cat, f"bytes item {item.fqn}", file)
            return
        members, pkl = self.members(fh, item, file)
        data = self.item_pickle(fh, item, file, members, pkl)
        refs: dict[str, StorageRef] = {}
        archive = pkl[: -len("data.pkl")]
        try:
            scans = scan_all(data)
        except PickleError as exc:
            raise self.corrupt_item(item, file, f"{pkl} is not a valid pickle: {exc}") from exc
        for s in scans:
            for u in s.unsafe:
                b.add_unsafe_global(u)
        if any(n.startswith(archive + "data/") for n in members):
            # A value holding tensors: they are declared as the storages its pickle names.
            parsed = scan(data, persistent_load=lambda pid: self.storage(
                pid, item, file, members, archive, refs))
            prefix = tuple(str(p) for p in path) if path else tuple(item.fqn.split("."))
            classify(parsed.value, b, prefix=prefix)
        m = members[pkl]
        b.add_region(item.start + m.data_offset, m.size, cat, f"value of {item.fqn}", file)


def chunk_name(fqn: str, offsets: tuple[int, ...], chunks: int) -> str:
    """The inventory's name for one chunk: the fqn alone for a tensor saved whole."""
    return fqn if chunks == 1 else f"{fqn}@{','.join(str(o) for o in offsets)}"


@record(frozen=True)
class ChunkedTensor:
    """One tensor of the state dict as ``.metadata`` describes it: its full size and the boxes
    (``offsets``, ``sizes``) its chunks cover, each named in the inventory by ``names``."""

    fqn: str
    dtype: str
    size: tuple[int, ...]
    chunks: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]
    names: tuple[str, ...]
    path: tuple[str, ...]


def chunked_tensors(inv: Inventory) -> list[ChunkedTensor]:
    """The full tensors of a DCP checkpoint already read into ``inv``, in ``.metadata`` order.

    ``.metadata`` (the inventory's first file) is parsed again, never loaded: the inventory
    keeps each chunk as a tensor of its own and not the full size it belongs to.
    """
    meta_path = inv.files[0].path
    read = _DcpRead(meta_path.parent, meta_path.parent)
    read.notes = []
    tensors, _, _, paths, _ = read.parse_metadata()
    out = []
    for fqn, t in tensors.items():
        boxes = tuple((c.offsets, c.sizes) for c in t.chunks)
        path = paths.get(fqn)
        out.append(ChunkedTensor(
            fqn, t.dtype, t.size, boxes,
            tuple(chunk_name(fqn, o, len(boxes)) for o, _ in boxes),
            tuple(str(p) for p in path) if path else (fqn,),
        ))
    return out


class TorchDcpReader:
    """``torch.distributed.checkpoint`` directories (``.metadata`` + ``*.distcp``)."""

    name = FORMAT
    extensions = (SUFFIX, METADATA_NAME)

    def sniff(self, source: Source) -> bool:
        """A directory with a ``.metadata`` file, or that pickle or a ``.distcp`` file itself."""
        if source.kind == "dir":
            return (source.path / METADATA_NAME).is_file()
        if source.kind != "file":
            return False
        if source.path.name == METADATA_NAME:
            return source.head[:1] == b"\x80"  # a pickle, as DCP writes it
        return source.suffix == SUFFIX and is_regular_file(source.path.parent / METADATA_NAME)

    def read(self, source: Source) -> Inventory:
        """One inventory over ``.metadata`` and every file it references."""
        directory = source.path if source.kind == "dir" else source.path.parent
        return _DcpRead(directory, source.path).run()
