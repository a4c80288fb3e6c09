"""safetensors files, sharded safetensors checkpoints and Hugging Face model directories.

A ``.safetensors`` file is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON
(``{"name": {"dtype", "shape", "data_offsets"}, "__metadata__": {...}}``, offsets relative to
the end of the header, possibly space-padded) and then the data. The header is metadata; every
tensor is its own storage, categorised by its name (:func:`classify_name`).

A sharded checkpoint is a ``*.safetensors.index.json`` (``{"metadata": {"total_size"},
"weight_map": {name: shard}}``) beside its shards: one inventory covers the index (metadata)
and every shard. A directory in the Hugging Face layout (an index or ``*.safetensors`` files,
usually with ``config.json``) reads the same way; ``config.json`` describes the architecture, so
it counts as ``graph``, and ``generation_config.json`` as metadata. Other files of such a
directory (tokenizers, READMEs) are not part of the model's bytes: a note names how many were
left out.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from modelsize.categories import Category
from modelsize.dtypes import DTYPES, canonical
from modelsize.errors import CorruptFileError, printable
from modelsize.formats.base import Source, is_regular_file, real_path
from modelsize.inventory import Inventory, InventoryBuilder

#: The Rust implementation refuses headers above this; so do we, before reading one.
MAX_HEADER = 100_000_000
#: An index file is a JSON map of tensor names; even the largest models stay far below this.
MAX_INDEX = 100_000_000
INDEX_SUFFIX = ".safetensors.index.json"
#: Files of a model directory counted with the weights, and their category.
_SIDE_FILES: dict[str, Category] = {
    "config.json": Category.GRAPH,
    "generation_config.json": Category.METADATA,
}

# -- classifying tensors by name ---------------------------------------------------------------

_GRAD_PARTS = frozenset({"grad", "grads", "gradients"})
_OPTIMIZER_PARTS = frozenset(
    {"optimizer", "optim", "optimizer_state", "optimizer_states", "opt_state"}
)
_OPTIMIZER_SLOTS = frozenset(
    {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "acc_delta",
     "exp_inf"}
)
_BUFFER_NAMES = frozenset(
    {"running_mean", "running_var", "num_batches_tracked", "position_ids", "inv_freq",
     "masked_bias", "relative_position_index", "_float_tensor", "freqs_cis"}
)
_EMA_PARTS = frozenset(
    {"ema", "ema_model", "model_ema", "ema_state_dict", "ema_params", "shadow_params",
     "averaged_model", "averaged_params", "swa_model"}
)
#: Integer tensors that hold quantized weights (GPTQ/AWQ/bitsandbytes), not buffers.
_QUANT_PARTS = frozenset({"qweight", "qzeros", "g_idx", "absmax", "quant_map"})


def classify_name(name: str, floating: bool) -> tuple[Category, tuple[str, ...]]:
    """The category (and tags) of a tensor known only by its flat name and dtype.

    The rules of a torch state dict: floating tensors are weights; running statistics,
    position ids, rotary frequencies and integer tensors are buffers (integer tensors that
    hold quantized weights excepted); optimizer slots (``exp_avg``, ``optimizer.*``) are
    optimizer state; ``.grad`` tensors are gradients. EMA copies keep their category and get
    the tag ``"ema"``.
    """
    parts = [p for p in name.replace("/", ".").split(".") if p]
    lowered = [p.lower() for p in parts]
    tags: tuple[str, ...] = ()
    if any(p in _EMA_PARTS or p.startswith("ema_") or p.endswith("_ema") for p in lowered):
        tags = ("ema",)
    if any(p in _GRAD_PARTS for p in lowered):
        return Category.GRADIENTS, tags
    if any(p in _OPTIMIZER_PARTS or p in _OPTIMIZER_SLOTS for p in lowered):
        return Category.OPTIMIZER_STATE, tags
    last = lowered[-1] if lowered else ""
    if last in _BUFFER_NAMES:
        return Category.BUFFERS, tags
    if floating:
        return Category.WEIGHTS, tags
    if any("weight" in p or p in _QUANT_PARTS for p in lowered):
        return Category.WEIGHTS, tags
    return Category.BUFFERS, tags


# -- one safetensors file ----------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors header, validated."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class Header:
    """A parsed safetensors header: where the data starts and what lies in it."""

    data_start: int
    entries: tuple[Entry, ...]
    metadata: dict[str, Any]


def looks_like_safetensors(head: bytes, size: int, suffix: str = "") -> bool:
    """The magic of a safetensors file: a plausible header length followed by ``{``.

    With the ``.safetensors`` extension a header length past the end of the file is still
    accepted, so that a truncated file is reported as corrupt rather than unknown.
    """
    if len(head) < 9 or head[8:9] != b"{":
        return False
    n = struct.unpack_from("<Q", head)[0]
    return n >= 2 and (n <= size - 8 or suffix == ".safetensors")


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {printable(key)!r} appears twice")
        out[key] = value
    return out


def _bounded_numel(shape: list[int], limit: int) -> int | None:
    """``numel(shape)``, or None once it passes ``limit``.

    A hostile header may list a million huge dimensions; multiplying them all out would take
    hours of big-integer arithmetic.
    """
    if 0 in shape:
        return 0
    count = 1
    for dim in shape:
        count *= dim
        if count > limit:
            return None
    return count


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_header(builder: InventoryBuilder, file: int = 0) -> Header:
    """Read and validate the header of file ``file``; every size checked before it is used."""
    path = builder.files[file].path
    size = builder.files[file].nbytes
    with open(path, "rb") as fh:
        raw_len = fh.read(8)
        if len(raw_len) < 8:
            raise builder.corrupt(
                f"expected an 8-byte header length, the file has {size} bytes", 0, file
            )
        n = struct.unpack("<Q", raw_len)[0]
        if n > MAX_HEADER:
            raise builder.corrupt(
                f"header length {n} is above the {MAX_HEADER}-byte limit of safetensors", 0, file
            )
        builder.check_range(8, n, "safetensors header", file)
        raw = fh.read(n)
    try:
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise builder.corrupt(f"header is not valid UTF-8 JSON ({exc})", 8, file) from exc
    if not isinstance(doc, dict):
        raise builder.corrupt(
            f"expected a JSON object as header, found {type(doc).__name__}", 8, file
        )
    data_start = 8 + n
    data_size = size - data_start
    metadata = doc.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise builder.corrupt(
            f"__metadata__ should be an object of strings, found {type(metadata).__name__}",
            8, file,
        )
    entries = [_entry(builder, file, name, info, data_size) for name, info in doc.items()]
    return Header(data_start, tuple(entries), metadata)


def _entry(builder: InventoryBuilder, file: int, name: str, info: Any, data_size: int) -> Entry:
    def bad(reason: str) -> Exception:
        return builder.corrupt(f"tensor {printable(name)!r}: {reason}", 8, file)

    if not isinstance(info, dict):
        raise bad(f"expected an object with dtype, shape, data_offsets; found {info!r:.80}")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str):
        raise bad(f"dtype should be a string, found {dtype!r:.80}")
    canon = canonical(dtype)
    if canon is None:
        raise bad(f"unknown dtype {dtype!r:.40}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise bad(f"shape should be a list of non-negative integers, found {shape!r:.80}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise bad(f"data_offsets should be [begin, end] with begin <= end, found {offsets!r:.80}")
    begin, end = offsets
    if end > data_size:
        raise bad(f"data_offsets [{begin}, {end}] run past the data area ({data_size} bytes)")
    dt = DTYPES[canon]
    count = _bounded_numel(shape, data_size * dt.block + 1)
    if count is None:
        raise bad(f"shape {shape!r:.80} needs more bytes than the data area holds ({data_size})")
    if count % dt.block:
        raise bad(f"{count} elements of {dtype} do not fill whole bytes")
    expected = dt.nbytes(count)
    if end - begin != expected:
        raise bad(
            f"shape {shape} of {dtype} needs {expected} bytes but data_offsets "
            f"[{begin}, {end}] hold {end - begin}"
        )
    return Entry(name, canon, tuple(shape), begin, end)


def account_file(builder: InventoryBuilder, file: int = 0, prefix: str = "") -> Header:
    """Declare the header, every tensor and any stray bytes of one safetensors file."""
    header = parse_header(builder, file)
    builder.add_region(0, header.data_start, Category.METADATA, "safetensors header", file)
    for e in header.entries:
        key = prefix + e.name
        builder.add_storage(
            key, header.data_start + e.begin, e.end - e.begin, file=file, dtype=e.dtype
        )
        category, tags = classify_name(e.name, DTYPES[e.dtype].floating)
        builder.add_tensor(e.name, e.dtype, e.shape, category, storage=key, tags=tags)
    _account_stray(builder, header, file)
    fmt = header.metadata.get("format")
    if isinstance(fmt, str) and "safetensors_format" not in builder.facts:
        builder.facts["safetensors_format"] = printable(fmt, 40)
    return header


def _account_stray(builder: InventoryBuilder, header: Header, file: int) -> None:
    """Data-area bytes no tensor claims: ``other``, with a note (safetensors refuses them)."""
    pos = 0
    end_of_data = builder.files[file].nbytes - header.data_start
    stray = 0
    spans = sorted((e.begin, e.end) for e in header.entries if e.end > e.begin)
    for begin, end in [*spans, (end_of_data, end_of_data)]:
        if begin > pos:
            builder.add_region(
                header.data_start + pos, begin - pos, Category.OTHER, "bytes no tensor claims",
                file,
            )
            stray += begin - pos
        pos = max(pos, end)
    if stray:
        builder.notes.append(
            f"{builder.files[file].path.name}: {stray} bytes of the data area belong to no "
            "tensor (the safetensors library refuses to load such a file)"
        )


# -- sharded checkpoints and directories -------------------------------------------------------


def _find_index(directory: Path) -> Path | None:
    preferred = directory / ("model" + INDEX_SUFFIX)
    if preferred.is_file():
        return preferred
    found = sorted(p for p in directory.glob("*" + INDEX_SUFFIX) if p.is_file())
    return found[0] if found else None


def _safetensors_files(directory: Path) -> list[Path]:
    """Every ``.safetensors`` file of a folder (whether they are one model is
    :func:`_read_dir`'s question)."""
    return sorted(p for p in directory.glob("*.safetensors") if p.is_file())


def read_weight_map(path: Path, format: str = "safetensors-index") -> dict[str, str]:
    """The weight map of a sharded checkpoint's index (tensor name -> shard file), validated.

    Shared by the safetensors and torch shard readers: both use Hugging Face's index layout.
    """

    def bad(reason: str) -> CorruptFileError:
        return CorruptFileError(path, format, reason)

    size = path.stat().st_size
    if size > MAX_INDEX:
        raise bad(f"index is {size} bytes, more than the {MAX_INDEX} modelsize reads")
    try:
        doc = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise bad(f"expected a JSON index, found invalid JSON ({exc})") from exc
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise bad('expected {"weight_map": {tensor name: shard file name}}')
    return weight_map


def _shard_paths(index: Path, weight_map: dict[str, str]) -> dict[str, Path]:
    """Each shard name of the weight map -> its path beside the index, checked to exist.

    Shard names must be relative paths that stay inside the index's directory (an index must
    not make us open ``/dev/stdin`` or a file elsewhere); the check is on the name, not the
    resolved path, because the Hugging Face cache links every file to a blob outside its
    snapshot directory. Names that reach the same file map to one path.
    """
    by_real: dict[Path, Path] = {}
    out: dict[str, Path] = {}
    for shard in sorted(set(weight_map.values())):
        rel = PurePosixPath(shard.replace("\\", "/"))
        if not shard or rel.is_absolute() or ".." in rel.parts or ":" in shard:
            raise CorruptFileError(
                index, "safetensors-index",
                f"shard {printable(shard)!r} is not a file name inside the index's directory",
            )
        path = index.parent.joinpath(*rel.parts)
        if not is_regular_file(path):  # a FIFO shard is refused, not "missing"
            raise CorruptFileError(
                index, "safetensors-index",
                f"shard {printable(shard)!r} named in the index is missing "
                f"(expected {printable(str(path))})",
            )
        out[shard] = by_real.setdefault(real_path(path), path)
    return out


def _relative(path: Path, base: Path) -> str:
    try:
        return path.relative_to(base).as_posix()
    except ValueError:
        return path.as_posix()


def _total_size(index: Path) -> int | None:
    try:
        doc = json.loads(index.read_bytes().decode("utf-8"))
        total = doc.get("metadata", {}).get("total_size")
    except (ValueError, AttributeError):
        return None
    return total if _is_int(total) else None


def read_checkpoint(
    format: str,
    root: Path,
    *,
    index: Path | None,
    shards: list[Path],
    side_files: list[tuple[Path, Category]],
    left_out: list[Path],
) -> Inventory:
    """One inventory over an optional index, its shards and the side files of a directory."""
    weight_map: dict[str, str] = {}
    shard_of: dict[str, Path] = {}
    if index is not None:
        weight_map = read_weight_map(index)
        shard_of = _shard_paths(index, weight_map)
        shards = list(dict.fromkeys(shard_of.values()))
    paths: list[Path] = ([index] if index is not None else []) + shards
    paths += [p for p, _ in side_files]
    builder = InventoryBuilder(format, paths, root=root)
    if index is not None:
        builder.add_region(0, builder.files[0].nbytes, Category.METADATA, "safetensors index")
    first_shard = 1 if index is not None else 0
    names_in: dict[Path, set[str]] = {}
    stored = 0
    for i, shard in enumerate(shards, start=first_shard):
        prefix = f"{_relative(shard, shards[0].parent)}:" if len(shards) > 1 else ""
        header = account_file(builder, i, prefix)
        names_in[shard] = {e.name for e in header.entries}
        stored += sum(e.end - e.begin for e in header.entries)
    for j, (path, category) in enumerate(side_files, start=first_shard + len(shards)):
        builder.add_region(0, builder.files[j].nbytes, category, path.name, j)

    if index is not None:
        for name, shard_name in weight_map.items():
            if name not in names_in[shard_of[shard_name]]:
                raise builder.corrupt(
                    f"index places tensor {printable(name)!r} in {printable(shard_name)!r}, "
                    "which holds no such tensor"
                )
        extra = sum(len(names - set(weight_map)) for names in names_in.values())
        if extra:
            builder.notes.append(f"{extra} tensor(s) in the shards are not listed in the index")
        total = _total_size(index)
        if total is not None and total != stored:
            builder.notes.append(
                f"index metadata says total_size {total} bytes; the shards hold {stored} bytes "
                "of tensor data"
            )
    if left_out:
        builder.notes.append(
            f"{len(left_out)} other file(s) in {printable(root.name)} (tokenizer, docs...) are "
            "not model weights and were not counted: "
            + ", ".join(printable(p.name, 60) for p in left_out[:5])
            + (", ..." if len(left_out) > 5 else "")
        )
    return builder.build()


def _read_dir(format: str, directory: Path) -> Inventory:
    """A folder of safetensors weights: its index and shards, or its single file, with the
    side files; a folder of separate models is refused (one line: give one file)."""
    import re

    from modelsize.errors import UsageError

    index = _find_index(directory)
    shards = [] if index is not None else _safetensors_files(directory)
    # Without an index, several files are one model only as the shards of one:
    # STEM-00001-of-00003.safetensors, every one with the same stem and count.
    named = [re.fullmatch(r"(.+)-(\d+)-of-(\d+)\.safetensors", p.name) for p in shards]
    one_model = len(shards) < 2 or (
        len({(m[1], int(m[3])) if m else None for m in named}) == 1
        and all(m is not None and 1 <= int(m[2]) <= int(m[3]) for m in named))
    if not one_model:
        # No index, no shard names: files that happen to share a folder (a model beside its
        # slimmed copy) are not one checkpoint; adding them up would invent duplicates.
        names = ", ".join(printable(p.name, 60) for p in shards[:4])
        raise UsageError(
            f"{printable(str(directory))}: folder holds {len(shards)} separate safetensors "
            f"models ({names}{', ...' if len(shards) > 4 else ''}) and no index; give one file"
        )
    side = [
        (directory / name, cat) for name, cat in _SIDE_FILES.items()
        if (directory / name).is_file()
    ]
    used = {real_path(p) for p in [*shards, *(p for p, _ in side)]}
    if index is not None:
        used.add(real_path(index))
        used |= {real_path(p) for p in _shard_paths(index, read_weight_map(index)).values()}
    left_out = sorted(
        p for p in directory.iterdir() if p.is_file() and real_path(p) not in used
    )
    return read_checkpoint(
        format, directory, index=index, shards=shards, side_files=side, left_out=left_out
    )


class SafetensorsReader:
    """A single ``.safetensors`` file, or a directory of them without an index."""

    name: str = "safetensors"
    extensions: tuple[str, ...] = (".safetensors",)

    def sniff(self, source: Source) -> bool:
        """The header-length magic; or a directory holding ``*.safetensors`` but no index."""
        if source.kind == "dir":
            return _find_index(source.path) is None and bool(_safetensors_files(source.path))
        return source.kind == "file" and looks_like_safetensors(
            source.head, source.size, source.suffix
        )

    def read(self, source: Source) -> Inventory:
        """Account for the header, every tensor and any stray bytes."""
        if source.kind == "dir":
            return _read_dir(self.name, source.path)
        builder = InventoryBuilder(self.name, [source.path], root=source.path)
        account_file(builder)
        return builder.build()


class SafetensorsIndexReader:
    """A sharded checkpoint: ``*.safetensors.index.json`` or a directory holding one."""

    name: str = "safetensors-index"
    extensions: tuple[str, ...] = (INDEX_SUFFIX,)

    def sniff(self, source: Source) -> bool:
        """An index file (JSON with a ``weight_map``), or a directory that holds one."""
        if source.kind == "dir":
            return _find_index(source.path) is not None
        if source.kind != "file" or source.head.lstrip()[:1] != b"{":
            return False
        # pytorch_model.bin.index.json has a weight_map too: only safetensors shards are ours.
        return source.path.name.endswith(INDEX_SUFFIX) or (
            source.suffix == ".json"
            and b'"weight_map"' in source.head
            and b'.safetensors"' in source.head
        )

    def read(self, source: Source) -> Inventory:
        """One inventory over the index and every shard it names."""
        if source.kind == "dir":
            return _read_dir(self.name, source.path)
        return read_checkpoint(
            self.name, source.path, index=source.path, shards=[], side_files=[], left_out=[]
        )
