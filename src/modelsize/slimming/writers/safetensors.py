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
import shutil
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modelsize import inputs
from modelsize.dtypes import DTYPES
from modelsize.formats.base import real_path
from modelsize.formats.safetensors import INDEX_SUFFIX
from modelsize.slimming.output import Output
from modelsize.slimming.plan import Plan, PlannedTensor
from modelsize.slimming.writers.base import Meter, Written, output_nbytes, slim_name, stream

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
    """One safetensors file: its header bytes and its tensors in data order."""

    name: str
    header: bytes
    tensors: list[PlannedTensor]
    data_bytes: int

    @property
    def nbytes(self) -> int:
        """Size of the file."""
        return len(self.header) + self.data_bytes


def layout(name: str, tensors: Sequence[PlannedTensor], metadata: dict[str, str],
           aliases: dict[str, str]) -> FileLayout:
    """Header and data order of one file (tensors sorted by element size, largest first)."""
    stored = [t for t in tensors if t.alias_of is None]
    order = sorted(stored, key=lambda t: -(DTYPES[t.dtype].block_bytes // DTYPES[t.dtype].block
                                          if t.dtype in DTYPES else 1))
    doc: dict[str, Any] = {}
    meta = dict(metadata)
    if aliases:
        meta[ALIASES_KEY] = json.dumps(aliases, sort_keys=True)
    if meta:
        doc["__metadata__"] = meta
    raw = {t.name: {"dtype": t.dtype, "shape": list(t.shape)} for t in order
           if t.dtype not in DTYPE_CODES}
    if raw:
        meta[RAW_KEY] = json.dumps(raw, sort_keys=True)
        doc["__metadata__"] = meta
    pos = 0
    for t in order:
        n = output_nbytes(t)
        doc[t.name] = {"dtype": dtype_code(t), "shape": list(stored_form(t)[1]),
                       "data_offsets": [pos, pos + n]}
        pos += n
    header = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    header += b" " * (-len(header) % 8)
    return FileLayout(name, struct.pack("<Q", len(header)) + header, order, pos)


def write_file(fh: Any, lay: FileLayout, meter: Meter, written: dict[str, Written]) -> None:
    """Write one laid-out file."""
    fh.write(lay.header)
    for t in lay.tensors:
        s = stream(t, meter)
        s.write_to(fh)
        written[t.name] = s.written


def _input_metadata(plan: Plan, file: int) -> dict[str, str]:
    """The ``__metadata__`` of an input safetensors file (kept on a same-format slim)."""
    from modelsize.formats.safetensors import read_metadata
    from modelsize.inventory import InventoryBuilder

    inv = plan.inventory
    if not inv.format.startswith("safetensors"):
        return {}
    b = InventoryBuilder(inv.format, [inv.files[file].path])
    meta = read_metadata(b)
    return {k: v for k, v in meta.items() if isinstance(v, str) and k != ALIASES_KEY}


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

    def write(self, out: Output, meter: Meter) -> dict[str, Written]:
        """Every shard, then the index, then the copied side files."""
        written: dict[str, Written] = {}
        for lay in self.layouts:
            write_file(out.open(lay.name), lay, meter, written)
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
        lay = layout(target.name, plan.tensors, meta, aliases)
        return SafetensorsJob([target.name], target.name, False, lay.nbytes, [lay])

    def _prepare_sharded(self, plan: Plan, target: Path) -> SafetensorsJob:
        inv = plan.inventory
        storages = {s.key: s for s in inv.storages}
        root = inv.path if inv.path.is_dir() else inv.path.parent
        by_file: dict[int, list[PlannedTensor]] = {}
        owner: dict[str, int] = {}
        for t in plan.tensors:
            original = t.record if t.alias_of is None else next(
                (o.record for o in plan.tensors if o.name == t.alias_of), t.record)
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
