"""safetensors output: one file, or the shards of a sharded checkpoint with a new index.

A file is an 8-byte header length, the JSON header padded with spaces to a multiple of 8 (as
the safetensors library writes it) and the tensors back to back, largest element size first
so that every tensor stays aligned when the file is memory-mapped. Aliases of deduplicated
tensors cannot share bytes in safetensors (the library refuses overlapping tensors), so they
are recorded in the header's ``__metadata__`` under ``modelsize.aliases`` (a JSON map of alias
-> tensor holding the bytes) and their bytes are stored once. Types safetensors cannot name
(GGML block-quantized ``q4_K``..., packed 4-bit integers) are stored as their raw bytes, a
``U8`` tensor, with the real dtype and shape under ``modelsize.raw_dtypes``: nothing is lost,
and ``--to safetensors`` works from every input.

A sharded input (an index, or a directory of shards) keeps its shard assignment: each shard is
rewritten without what was dropped, shards left empty disappear, and the index gets the new
``weight_map`` and ``total_size``. The other files of a model directory (``config.json``,
tokenizer files...) are copied as they are.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from array import array
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modelsize import inputs
from modelsize.dtypes import DTYPES
from modelsize.formats.base import real_path
from modelsize.formats.safetensors import INDEX_SUFFIX
from modelsize.inventory import TensorRecord
from modelsize.slimming.output import Output
from modelsize.slimming.plan import Plan, PlannedTensor
from modelsize.slimming.writers.base import (
    Meter,
    Written,
    WrittenTable,
    output_nbytes,
    slim_name,
    stream,
    write_tensors,
)

#: canonical dtype -> safetensors spelling.
DTYPE_CODES: dict[str, str] = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "float8_e8m0fnu": "F8_E8M0",
    "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "float4_e2m1fn": "F4", "float6_e2m3fn": "F6_E2M3", "float6_e3m2fn": "F6_E3M2",
    "complex64": "C64", "int8": "I8", "uint8": "U8", "int16": "I16", "uint16": "U16",
    "int32": "I32", "uint32": "U32", "int64": "I64", "uint64": "U64", "bool": "BOOL",
}
ALIASES_KEY = "modelsize.aliases"


RAW_KEY = "modelsize.raw_dtypes"


def dtype_code(t: PlannedTensor) -> str:
    """The safetensors dtype of a planned tensor (``U8`` for what safetensors cannot name)."""
    return DTYPE_CODES.get(t.dtype, "U8")


def stored_form(t: PlannedTensor) -> tuple[str, tuple[int, ...]]:
    """(dtype, shape) as the file holds the tensor: packed and block-quantized types
    (GGML ``q4_K``, 4-bit ints...) that safetensors has no name for are kept as their raw
    bytes, a ``U8`` tensor, with the real dtype and shape in the header's metadata."""
    if t.dtype in DTYPE_CODES:
        return t.dtype, t.shape
    return "uint8", (output_nbytes(t),)


@dataclass
class FileLayout:
    """One safetensors file: its header bytes and its tensors in data order.

    The tensors are ``tensors`` (planned tensors), or ``order``: indices of ``plan``'s
    tensors (a plan of a million tensors is not turned into a million objects to be laid
    out). The header is dropped once written (:meth:`release`).
    """

    name: str
    header: bytes | bytearray
    tensors: list[PlannedTensor]
    data_bytes: int
    plan: Plan | None = None
    order: array[int] | None = None
    header_nbytes: int = -1

    def __post_init__(self) -> None:
        if self.header_nbytes < 0:
            self.header_nbytes = len(self.header)

    @property
    def nbytes(self) -> int:
        """Size of the file."""
        return self.header_nbytes + self.data_bytes

    def release(self) -> None:
        """Forget the header bytes (written: verification reads the file)."""
        self.header = b""


#: Header entries encoded at a time.
_BATCH = 4096


def _rank(dtype: str) -> int:
    """The data order's key: largest element size first (unknown dtypes last)."""
    dt = DTYPES.get(dtype)
    return -(dt.block_bytes // dt.block) if dt is not None else 1


def layout(name: str, tensors: Sequence[PlannedTensor] | Plan, metadata: dict[str, str],
           aliases: dict[str, str]) -> FileLayout:
    """Header and data order of one file (tensors sorted by element size, largest first).

    ``tensors`` is a list of planned tensors, or a whole :class:`Plan`, laid out by index
    without making it hold its tensors as objects. The header is what ``json.dumps(doc,
    separators=(",", ":"), ensure_ascii=False)`` gives for ``{"__metadata__": ..., name:
    {"dtype", "shape", "data_offsets"}, ...}``, written an entry at a time: a million
    tensors cost their bytes, not a million dicts.
    """
    from json.encoder import encode_basestring  # type: ignore[attr-defined]

    plan = tensors if isinstance(tensors, Plan) else None
    rows: Iterator[tuple[int, TensorRecord, str, str, str | None]] = (
        plan.described() if plan is not None else
        ((i, t.record, t.name, t.dtype, t.alias_of)
         for i, t in enumerate(tensors)))  # type: ignore[arg-type]
    # Pass 1: the data order (a stable sort by element size, as buckets of indices) and the
    # raw tensors, whose real dtypes the metadata names.
    buckets: dict[int, array[int]] = {}
    ranks: dict[str, int] = {}
    raw: dict[str, dict[str, Any]] = {}
    for i, _rec, tname, dtype, alias in rows:
        if alias is not None:
            continue
        rank = ranks.get(dtype)
        if rank is None:
            rank = ranks[dtype] = _rank(dtype)
        bucket = buckets.get(rank)
        if bucket is None:
            bucket = buckets[rank] = array("q")
        bucket.append(i)
        if dtype not in DTYPE_CODES:
            raw[tname] = {"dtype": dtype, "shape": list(_rec.shape)}
    order = array("q")
    for rank in sorted(buckets):
        order += buckets.pop(rank)
    meta = dict(metadata)
    if aliases:
        meta[ALIASES_KEY] = json.dumps(aliases, sort_keys=True)
    if raw:
        meta[RAW_KEY] = json.dumps(raw, sort_keys=True)
    header = bytearray(8)
    header += b"{"
    if meta:
        header += b'"__metadata__":' + json.dumps(
            meta, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        if order:
            header += b","
    # Pass 2: the entries, with their offsets.
    sizes = _sizes(plan, tensors)
    pos = 0
    shapes: dict[tuple[int, ...], str] = {}
    pieces: list[str] = []
    rows = (plan.described(order) if plan is not None else
            ((i, tensors[i].record, tensors[i].name, tensors[i].dtype, None)  # type: ignore[index]
             for i in order))
    left = len(order)
    for i, rec, tname, dtype, _ in rows:
        n = sizes(i, rec, dtype)
        code = DTYPE_CODES.get(dtype)
        shape: tuple[int, ...] = rec.shape
        if code is None:
            code, shape = "U8", (n,)
        text = shapes.get(shape)
        if text is None:
            text = ",".join(map(str, shape))
            if len(shapes) < 1 << 16:
                shapes[shape] = text
        pieces.append(f'{encode_basestring(tname)}:{{"dtype":"{code}","shape":[{text}],'
                      f'"data_offsets":[{pos},{pos + n}]}}')
        pos += n
        left -= 1
        if len(pieces) == _BATCH:
            header += ",".join(pieces).encode("utf-8")
            if left:
                header += b","
            pieces.clear()
    header += ",".join(pieces).encode("utf-8")
    header += b"}"
    header += b" " * (-(len(header) - 8) % 8)
    header[:8] = struct.pack("<Q", len(header) - 8)
    if plan is not None:
        return FileLayout(name, header, [], pos, plan, order)
    return FileLayout(name, header, [tensors[i] for i in order], pos)  # type: ignore[index]


def _sizes(plan: Plan | None, tensors: Any) -> Any:
    """``size(index, record, output dtype)``: the output bytes of a planned tensor."""
    sources = plan.sources() if plan is not None else None
    if sources is None:
        row = plan.row if plan is not None else tensors.__getitem__
        return lambda i, rec, dtype: output_nbytes(row(i))
    nbytes = sources.nbytes

    def size(i: int, rec: TensorRecord, dtype: str) -> int:
        if dtype != rec.dtype:
            return DTYPES[dtype].nbytes(rec.numel)
        return rec.nbytes if rec.strides is None else nbytes(rec)

    return size


def write_file(fh: Any, lay: FileLayout, meter: Meter,
               written: dict[str, Written] | WrittenTable) -> None:
    """Write one laid-out file."""
    fh.write(lay.header)
    if lay.plan is not None and lay.order is not None:
        assert isinstance(written, WrittenTable)
        write_tensors(fh, lay.plan, lay.order, meter, written)
        return
    for t in lay.tensors:
        s = stream(t, meter)
        s.write_to(fh)
        written[t.name] = s.written  # type: ignore[index]


def _input_metadata(plan: Plan, file: int) -> dict[str, str]:
    """The ``__metadata__`` of an input safetensors file (kept on a same-format slim).

    A header that does not name ``__metadata__`` anywhere (scanned a piece at a time) has
    none: its tensors are not parsed a second time to find out.
    """
    from modelsize.formats.safetensors import read_metadata
    from modelsize.inventory import InventoryBuilder

    inv = plan.inventory
    if not inv.format.startswith("safetensors"):
        return {}
    path = inv.files[file].path
    if not _names_metadata(path):
        return {}
    b = InventoryBuilder(inv.format, [path])
    meta = read_metadata(b)
    return {k: v for k, v in meta.items() if isinstance(v, str) and k != ALIASES_KEY}


def _names_metadata(path: Path) -> bool:
    """Whether the header of safetensors file ``path`` holds ``"__metadata__"`` (``True``
    where it cannot tell: the reader then says what is wrong)."""
    token = b'"__metadata__"'
    step = 8 << 20
    try:
        with inputs.reading(path) as fd:
            head = os.pread(fd, 8, 0)
            if len(head) < 8:
                return True
            n = struct.unpack("<Q", head)[0]
            pos, tail = 8, b""
            while pos < 8 + n:
                piece = os.pread(fd, min(step, 8 + n - pos), pos)
                if not piece:
                    return True
                if token in tail + piece[: len(token)] or token in piece:
                    return True
                tail = piece[-len(token):]
                pos += len(piece)
    except OSError:
        return True
    return False


@dataclass
class SafetensorsJob:
    """A single file, or shards plus an index in a folder."""

    files: list[str]
    main: str
    directory: bool
    predicted_bytes: int | None
    layouts: list[FileLayout]
    index: bytes | None = None
    copies: list[tuple[Path, str]] = field(default_factory=list)

    def write(self, out: Output, meter: Meter) -> Mapping[str, Written]:
        """Every shard, then the index, then the copied side files. A single file laid out
        from the plan returns a :class:`WrittenTable` (by plan index)."""
        written: dict[str, Written] | WrittenTable = {}
        for lay in self.layouts:
            if lay.plan is not None:
                written = WrittenTable(lay.plan)
            write_file(out.open(lay.name), lay, meter, written)
            lay.release()
        if self.index is not None:
            out.open(self.main).write(self.index)
        for src, name in self.copies:
            with inputs.open_input(src) as fin:
                shutil.copyfileobj(fin, out.open(name), 1 << 20)
        return written

    def output_name(self, name: str) -> str:
        """Names are kept as they are."""
        return name

    def output_form(self, t: PlannedTensor) -> tuple[str, tuple[int, ...]]:
        """How the output's reader sees a tensor (raw ``U8`` for unnamed dtypes)."""
        return stored_form(t)


class SafetensorsWriter:
    """``.safetensors`` (single or sharded)."""

    name = "safetensors"

    def _sharded(self, plan: Plan) -> bool:
        inv = plan.inventory
        return plan.options.to == "same" and inv.format.startswith("safetensors") and (
            inv.path.is_dir() or inv.path.name.endswith(INDEX_SUFFIX) or len(inv.files) > 1
        )

    def default_target(self, plan: Plan, source: Path) -> Path:
        """``x.slim.safetensors``; ``model.slim/`` for a sharded checkpoint."""
        if self._sharded(plan):
            folder = source if source.is_dir() else source.parent
            return folder.with_name(folder.name + ".slim")
        return slim_name(source, ".safetensors")

    def prepare(self, plan: Plan, target: Path) -> SafetensorsJob:
        """Lay out every file before writing."""
        if self._sharded(plan):
            return self._prepare_sharded(plan, target)
        aliases = plan.aliases
        meta = _input_metadata(plan, 0) if plan.options.to == "same" else {}
        meta.setdefault("format", "pt")
        lay = layout(target.name, plan, meta, aliases)
        return SafetensorsJob([target.name], target.name, False, lay.nbytes, [lay])

    def _prepare_sharded(self, plan: Plan, target: Path) -> SafetensorsJob:
        inv = plan.inventory
        storages = {s.key: s for s in inv.storages}
        root = inv.path if inv.path.is_dir() else inv.path.parent
        by_file: dict[int, list[PlannedTensor]] = {}
        owner: dict[str, int] = {}
        record_of = {t.name: t.record for t in plan.tensors} if plan.aliases else {}
        for t in plan.tensors:
            original = t.record if t.alias_of is None else record_of.get(t.alias_of,
                                                                          t.record)
            st = storages.get(original.storage or "")
            file = st.file if st is not None else 0
            by_file.setdefault(file, []).append(t)
            owner[t.name] = file
        layouts: list[FileLayout] = []
        weight_map: dict[str, str] = {}
        for file, tensors in sorted(by_file.items()):
            rel = _relative(inv.files[file].path, root)
            aliases = {t.name: t.alias_of for t in tensors if t.alias_of is not None}
            lay = layout(rel, tensors, _input_metadata(plan, file), aliases)
            layouts.append(lay)
            for t in tensors:
                if t.alias_of is None:  # an alias is in its shard's metadata, not the index
                    weight_map[t.name] = rel
        index_name = _index_name(inv, root)
        total = sum(lay.data_bytes for lay in layouts)
        index = None
        files = [lay.name for lay in layouts]
        if index_name is not None:
            doc = {"metadata": {"total_size": total}, "weight_map": weight_map}
            index = (json.dumps(doc, indent=2, sort_keys=False) + "\n").encode("utf-8")
            files.append(index_name)
        shard_paths = {real_path(inv.files[f].path) for f in by_file} | {
            real_path(f.path) for f in inv.files if f.path.name.endswith(".safetensors")}
        copies = []
        if inv.path.is_dir():
            for p in sorted(root.iterdir()):
                if p.is_file() and real_path(p) not in shard_paths and p.name != index_name:
                    copies.append((p, p.name))
                    files.append(p.name)
        predicted = sum(lay.nbytes for lay in layouts) + (len(index) if index else 0) + sum(
            p.stat().st_size for p, _ in copies)
        main = index_name or layouts[-1].name if layouts else (index_name or "")
        return SafetensorsJob(files, main, True, predicted, layouts, index, copies)


def _index_name(inv: Any, root: Path) -> str | None:
    for f in inv.files:
        if f.path.name.endswith(INDEX_SUFFIX):
            return _relative(f.path, root)
    return None


def _relative(path: Path, base: Path) -> str:
    try:
        return path.relative_to(base).as_posix()
    except ValueError:
        return path.name
