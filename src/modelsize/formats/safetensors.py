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
import re
import struct
from array import array
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import Any, NamedTuple

from modelsize._extensions import compiled
from modelsize._records import field, record
from modelsize.categories import Category
from modelsize.dtypes import DTYPES, DType, canonical
from modelsize.errors import CorruptFileError, printable
from modelsize.formats import _limits
from modelsize.formats.base import Source, is_regular_file, real_path
from modelsize.inventory import Inventory, InventoryBuilder, paused_gc

#: The Rust implementation refuses headers above this; so do we, before reading one (the
#: limit in force is ``MODELSIZE_MAX_HEADER_BYTES``: :mod:`modelsize.formats._limits`).
MAX_HEADER = _limits.HEADER_BYTES.default
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
_QUANT_PARTS = frozenset({"qweight", "qzeros", "g_idx", "absmax", "quant_map", "scales"})


def _words(words: frozenset[str]) -> str:
    return "|".join(re.escape(w) for w in sorted(words))


#: Whether any part of a lowered name makes it EMA, a gradient or optimizer state: names
#: without one (nearly all) are classified without being split.
_SPECIAL = re.compile(
    rf"(?:^|[./])(?:(?:{_words(_EMA_PARTS | _GRAD_PARTS | _OPTIMIZER_PARTS | _OPTIMIZER_SLOTS)})"
    r"(?=[./]|$)|ema_)|_ema(?=[./]|$)"
)
_QUANT = re.compile(rf"(?:^|[./])(?:{_words(_QUANT_PARTS)})(?=[./]|$)")
#: A substring of every word _SPECIAL finds, tested (in this order) by classify_name before
#: it searches: names with none of them (nearly all) are not searched.
_SPECIAL_HINTS = ("ema", "grad", "opt", "exp_", "momentum", "square_avg", "acc_delta", "shadow",
                  "averaged", "swa")


def classify_name(name: str, floating: bool) -> tuple[Category, tuple[str, ...]]:
    """The category (and tags) of a tensor known only by its flat name and dtype.

    The rules of a torch state dict: floating tensors are weights; running statistics,
    position ids, rotary frequencies and integer tensors are buffers (integer tensors that
    hold quantized weights excepted); optimizer slots (``exp_avg``, ``optimizer.*``) are
    optimizer state; ``.grad`` tensors are gradients. EMA copies keep their category and get
    the tag ``"ema"``.
    """
    low = name.lower()
    if not ("ema" in low or "grad" in low or "opt" in low or "exp_" in low
            or "momentum" in low or "square_avg" in low or "acc_delta" in low
            or "shadow" in low or "averaged" in low or "swa" in low
            ) or _SPECIAL.search(low) is None:  # (the hints: see _SPECIAL_HINTS)
        # the common case, decided without splitting the name
        last = low.replace("/", ".").rstrip(".").rpartition(".")[2]
        if last in _BUFFER_NAMES:
            return Category.BUFFERS, ()
        if floating or "weight" in low or _QUANT.search(low) is not None:
            return Category.WEIGHTS, ()
        return Category.BUFFERS, ()
    lowered = [p for p in low.replace("/", ".").split(".") if p]
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


#: What classify_name answers for nearly every tensor: one tuple shared by all of them.
_WEIGHTS: tuple[Category, tuple[str, ...]] = (Category.WEIGHTS, ())


def classify_names(names: Sequence[str], floating: Sequence[bool]
                   ) -> list[tuple[Category, tuple[str, ...]]]:
    """:func:`classify_name` of each name, the same answers, in one pass.

    The words that make a tensor anything but a floating weight (:data:`_SPECIAL_HINTS`,
    :data:`_BUFFER_NAMES`) are looked for in all the names at once: where none holds one
    (most checkpoints), a floating tensor is a weight without its name being taken apart.
    """
    # One lowered string: str.lower maps each character alone (but a final sigma, which no
    # word here holds), and no word spans the newline between two names.
    blob = "\n".join(names).lower()
    if any(hint in blob for hint in _SPECIAL_HINTS):
        return list(map(classify_name, names, floating))
    found = [word for word in _BUFFER_NAMES if word in blob]
    del blob
    if not found:
        return [_WEIGHTS if f else classify_name(name, f)
                for name, f in zip(names, floating, strict=True)]
    search = re.compile("|".join(map(re.escape, sorted(found)))).search
    return [_WEIGHTS if f and search(name.lower()) is None else classify_name(name, f)
            for name, f in zip(names, floating, strict=True)]


# -- one safetensors file ----------------------------------------------------------------------


class Entry(NamedTuple):
    """One tensor of a safetensors header, validated."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@record(frozen=True)
class Header:
    """A parsed safetensors header: where the data starts and what lies in it.

    The tensors are kept as columns (a record per tensor would cost more than the tensor's
    name); :attr:`entries` makes :class:`Entry` records of them on demand.
    """

    data_start: int
    metadata: dict[str, Any]
    names: list[str] = field(repr=False)
    dtypes: list[str] = field(repr=False)
    shapes: list[tuple[int, ...]] = field(repr=False)
    begins: array[int] = field(repr=False)
    ends: array[int] = field(repr=False)

    @property
    def entries(self) -> tuple[Entry, ...]:
        """Every tensor, in header order."""
        return tuple(map(Entry, self.names, self.dtypes, self.shapes, self.begins, self.ends))

    @property
    def data_nbytes(self) -> int:
        """Bytes of data the tensors claim (overlaps counted twice)."""
        return sum(self.ends) - sum(self.begins)


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


def _bounded_numel(shape: Sequence[int], limit: int) -> int | None:
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


class _Bad(Exception):
    """A tensor entry that fails validation: its name and what is wrong."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(reason)
        self.name = name
        self.reason = reason


class _Columns:
    """The tensors of a header as they are validated, a column per field."""

    def __init__(self, data_size: int) -> None:
        self.data_size = data_size
        self.names: list[str] = []
        self.dtypes: list[str] = []
        self.shapes: list[tuple[int, ...]] = []
        self.begins: array[int] = array("q")
        self.ends: array[int] = array("q")
        #: dtype as spelled in the header -> (canonical name, DType)
        self.known: dict[str, tuple[str, DType]] = {}
        #: every distinct shape once (most repeat)
        self.seen_shapes: dict[tuple[int, ...], tuple[int, ...]] = {}

    def add(self, name: str, dtype: str, shape: tuple[int, ...], begin: int, end: int) -> None:
        """Validate one tensor and append it; :class:`_Bad` if it is not valid."""
        known = self.known.get(dtype)
        if known is None:
            canon = canonical(dtype)
            if canon is None:
                raise _Bad(name, f"unknown dtype {dtype!r:.40}")
            known = self.known[dtype] = (canon, DTYPES[canon])
        canon, dt = known
        if not 0 <= begin <= end:
            raise _Bad(name, "data_offsets should be [begin, end] with begin <= end, found "
                       f"{[begin, end]!r:.80}")
        data_size = self.data_size
        if end > data_size:
            raise _Bad(name, f"data_offsets [{begin}, {end}] run past the data area "
                       f"({data_size} bytes)")
        if len(shape) == 1:
            count: int | None = shape[0]
        else:
            count = _bounded_numel(shape, data_size * dt.block + 1)
            if count is None:
                raise _Bad(name, f"shape {list(shape)!r:.80} needs more bytes than the data "
                           f"area holds ({data_size})")
        assert count is not None
        block = dt.block
        if block == 1:
            expected = count * dt.block_bytes
        else:
            if count % block:
                raise _Bad(name, f"{count} elements of {dtype} do not fill whole bytes")
            expected = count // block * dt.block_bytes
        if end - begin != expected:
            raise _Bad(name, f"shape {list(shape)} of {dtype} needs {expected} bytes but "
                       f"data_offsets [{begin}, {end}] hold {end - begin}")
        same = self.seen_shapes.get(shape)
        if same is None:
            if len(self.seen_shapes) < 1 << 16:
                self.seen_shapes[shape] = shape
        else:
            shape = same
        self.names.append(name)
        self.dtypes.append(canon)
        self.shapes.append(shape)
        self.begins.append(begin)
        self.ends.append(end)


# The header as the safetensors library writes it (compact JSON, keys in this order), parsed
# entry by entry from the bytes: no JSON object is made, and the header is never decoded as a
# whole. Anything else goes to the JSON parser.
_WS = rb"[ \t\n\r]*"
_STR = rb'"([^"\\\x00-\x1f]*(?:\\.[^"\\\x00-\x1f]*)*)"'
_ANY_STR = rb'"[^"\\\x00-\x1f]*(?:\\.[^"\\\x00-\x1f]*)*"'
_NUM = rb"(?:0|[1-9][0-9]*)"
_ENTRY = re.compile(
    _WS + _STR + _WS + rb":" + _WS + rb'\{"dtype":' + _WS + rb'"([A-Za-z0-9_]{1,40})",'
    + _WS + rb'"shape":' + _WS + rb"\[((?:" + _NUM + rb"(?:," + _NUM + rb")*)?)\]," + _WS
    + rb'"data_offsets":' + _WS + rb"\[(" + _NUM + rb"),(" + _NUM + rb")\]\}" + _WS
    + rb"([,}])"
)
_PAIR = _ANY_STR + _WS + rb":" + _WS + _ANY_STR
_METADATA = re.compile(
    _WS + rb'"__metadata__"' + _WS + rb":" + _WS + rb"(\{" + _WS + rb"(?:" + _PAIR + rb"(?:"
    + _WS + rb"," + _WS + _PAIR + rb")*)?" + _WS + rb"\})" + _WS + rb"([,}])"
)
_headers = compiled("_headers")
_scan_entries = getattr(_headers, "scan_safetensors", None)

#: Arrays, objects, strings and commas a legal header may hold beyond those of its tensors
#: (metadata, brackets inside names...): past them, JSON parsing is refused before it starts.
_SLACK = 1 << 20


def _scan_compact(raw: bytes, cols: _Columns) -> dict[str, Any] | None:
    """Parse a header written the way the safetensors library writes it into ``cols``; the
    metadata, or None if the header is written some other way (``cols`` is then partial)."""
    if raw[:1] != b"{":
        return None
    metadata: dict[str, Any] | None = None
    pos = 1
    if raw[1:].lstrip(b" \t\n\r")[:1] == b"}":
        return {}
    match_entry, match_meta = _ENTRY.match, _METADATA.match
    # Each distinct shape text once: (shape, its element count), the count None if the shape
    # needs more bytes than the data area holds.
    shapes: dict[bytes, tuple[tuple[int, ...], int | None]] = {}
    known = cols.known
    data_size = cols.data_size
    names, dtypes, shape_col = cols.names, cols.dtypes, cols.shapes
    begins, ends = cols.begins.append, cols.ends.append
    # The compiled scanner takes the entries it can (see _headers.c), this loop the one it
    # stops before; it knows the dtypes this loop has met, by their spelling's bytes.
    scan = _scan_entries
    fast_known: dict[bytes, tuple[str, int]] = {}
    while True:
        if scan is not None:
            pos, closed, more_begins, more_ends = scan(
                raw, pos, data_size, fast_known, shapes, names, dtypes, shape_col)
            cols.begins.frombytes(more_begins)
            cols.ends.frombytes(more_ends)
            if closed:
                break
        m = match_entry(raw, pos)
        if m is not None:
            name_b, dtype_b, shape_b, begin_b, end_b, close = m.groups()
            name = (json.loads(b'"' + name_b + b'"') if b"\\" in name_b
                    else name_b.decode("utf-8"))
            if name == "__metadata__":
                return None
            seen = shapes.get(shape_b)
            if seen is None:
                shape = tuple(map(int, shape_b.split(b","))) if shape_b else ()
                seen = (shape, _bounded_numel(shape, data_size * 32 + 1))
                if len(shapes) < 1 << 16:
                    shapes[shape_b] = seen
            shape, count = seen
            begin, end = int(begin_b), int(end_b)
            dtype = dtype_b.decode("ascii")
            dt = known.get(dtype)
            # The common case checked here; anything else by cols.add (which says what is wrong).
            if (dt is not None and count is not None and dt[1].block == 1 and begin <= end
                    and end <= data_size and end - begin == count * dt[1].block_bytes):
                names.append(name)
                dtypes.append(dt[0])
                shape_col.append(shape)
                begins(begin)
                ends(end)
            else:
                cols.add(name, dtype, shape, begin, end)
                if scan is not None and dtype_b not in fast_known:
                    dt = known[dtype]
                    if dt[1].block == 1:
                        fast_known[dtype_b] = (dt[0], dt[1].block_bytes)
        else:
            m = match_meta(raw, pos)
            if m is None or metadata is not None:
                return None
            metadata = json.loads(m.group(1), object_pairs_hook=_no_duplicate_keys)
            close = m.group(2)
        pos = m.end()
        if close == b"}":
            break
    if raw[pos:].strip(b" \t\n\r"):
        return None
    return metadata or {}


def _scan_json(raw: bytes, cols: _Columns) -> dict[str, Any]:
    """Parse any header with the JSON parser into ``cols``; its metadata.

    Entries are turned into tuples as they are parsed. The parser builds whatever the header
    holds, so its arrays, objects, strings and commas are counted first (bytes are counted in
    C, fast): a legal header has three arrays and objects, ten quotes and at most a few commas
    per tensor, and one that holds many more (a header of nested lists) is refused unparsed.
    """
    tensors = raw.count(b'"data_offsets"')
    containers = raw.count(b"[") + raw.count(b"{")
    if (containers > 3 * tensors + _SLACK or raw.count(b'"') > 10 * tensors + 2 * _SLACK
            or raw.count(b",") > 16 * tensors + _SLACK):
        raise ValueError(
            f"it holds {containers:,} arrays and objects for {tensors:,} tensors: not a "
            "safetensors header (a tensor's entry holds three)"
        )

    def compact(pairs: list[tuple[str, Any]]) -> Any:
        if len(pairs) == 3:
            info = dict(pairs)
            if len(info) == 3 and "dtype" in info and "shape" in info and "data_offsets" in info:
                shape, offsets = info["shape"], info["data_offsets"]
                if type(shape) is list:
                    info["shape"] = tuple(shape)
                if type(offsets) is list:
                    info["data_offsets"] = tuple(offsets)
                return info
        return _no_duplicate_keys(pairs)

    doc = json.loads(raw.decode("utf-8"), object_pairs_hook=compact)
    if not isinstance(doc, dict):
        raise _Bad("", f"expected a JSON object as header, found {type(doc).__name__}")
    metadata = doc.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise _Bad("", f"__metadata__ should be an object of strings, found "
                   f"{type(metadata).__name__}")
    for name, info in doc.items():
        if not isinstance(info, dict):
            raise _Bad(name, "expected an object with dtype, shape, data_offsets; found "
                       f"{info!r:.80}")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dtype, str):
            raise _Bad(name, f"dtype should be a string, found {dtype!r:.80}")
        if not isinstance(shape, tuple) or not all(_is_int(d) and d >= 0 for d in shape):
            raise _Bad(name, "shape should be a list of non-negative integers, found "
                       f"{shape!r:.80}")
        if (not isinstance(offsets, tuple) or len(offsets) != 2
                or not all(_is_int(o) for o in offsets)):
            raise _Bad(name, "data_offsets should be [begin, end] with begin <= end, found "
                       f"{offsets!r:.80}")
        cols.add(name, dtype, shape, offsets[0], offsets[1])
    return metadata


def parse_header(builder: InventoryBuilder, file: int = 0) -> Header:
    """Read and validate the header of file ``file``; every size checked before it is used.

    A header is at most ``MODELSIZE_MAX_HEADER_BYTES`` (100 MB, the safetensors library's own
    limit); its memory grows with its tensors, never with what it merely claims.
    """
    path = builder.files[file].path
    size = builder.files[file].nbytes
    with open(path, "rb") as fh:
        raw_len = fh.read(8)
        if len(raw_len) < 8:
            raise builder.corrupt(
                f"expected an 8-byte header length, the file has {size} bytes", 0, file
            )
        n = struct.unpack("<Q", raw_len)[0]
        builder.check_range(8, n, "safetensors header", file)
        _limits.HEADER_BYTES.check(path, n, "the safetensors header")
        raw = fh.read(n)
    data_start = 8 + n
    cols = _Columns(size - data_start)
    try:
        metadata = _scan_compact(raw, cols)
        if metadata is None:
            cols = _Columns(size - data_start)
            metadata = _scan_json(raw, cols)
    except _Bad as exc:
        where = f"tensor {printable(exc.name)!r}: " if exc.name else ""
        raise builder.corrupt(f"{where}{exc.reason}", 8, file) from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise builder.corrupt(f"header is not valid UTF-8 JSON ({exc})", 8, file) from exc
    return Header(data_start, metadata, cols.names, cols.dtypes, cols.shapes, cols.begins,
                  cols.ends)


def read_metadata(builder: InventoryBuilder, file: int = 0) -> dict[str, Any]:
    """The ``__metadata__`` of file ``file`` without parsing its tensors when it comes first
    (where the safetensors library writes it); else from the whole header."""
    path = builder.files[file].path
    with open(path, "rb") as fh:
        raw_len = fh.read(8)
        if len(raw_len) == 8:
            n = struct.unpack("<Q", raw_len)[0]
            if 8 + n <= builder.files[file].nbytes:
                head = fh.read(min(n, 1 << 20))
                m = _METADATA.match(head, 1) if head[:1] == b"{" else None
                if m is not None:
                    try:
                        found = json.loads(m.group(1), object_pairs_hook=_no_duplicate_keys)
                    except ValueError:
                        found = None
                    if isinstance(found, dict):
                        return found
                elif head[:1] == b"{" and b'"__metadata__"' not in head and n <= len(head):
                    return {}
    return parse_header(builder, file).metadata


def account_file(builder: InventoryBuilder, file: int = 0, prefix: str = "") -> Header:
    """Declare the header, every tensor and any stray bytes of one safetensors file."""
    with paused_gc():
        header = parse_header(builder, file)
        start = header.data_start
        builder.add_region(0, start, Category.METADATA, "safetensors header", file)
        floating = {name: dt.floating for name, dt in DTYPES.items()}
        names, dtypes = header.names, header.dtypes
        builder.add_whole_tensors(
            file, start, [prefix + name for name in names] if prefix else names, names,
            dtypes, header.shapes, header.begins, header.ends,
            classify_names(names, list(map(floating.__getitem__, dtypes))),
        )
        _account_stray(builder, header, file)
    fmt = header.metadata.get("format")
    if isinstance(fmt, str) and "safetensors_format" not in builder.facts:
        builder.facts["safetensors_format"] = printable(fmt, 40)
    return header


#: The label of data-area bytes no tensor claims (the safetensors library refuses the file).
STRAY = "bytes no tensor claims"


def _account_stray(builder: InventoryBuilder, header: Header, file: int) -> None:
    """Data-area bytes no tensor claims: ``other``, with a note (safetensors refuses them)."""
    end_of_data = builder.files[file].nbytes - header.data_start
    if header.data_nbytes == end_of_data:
        return  # the tensors tile the data area (or overlap: the builder refuses that)
    pos = 0
    stray = 0
    spans = sorted((b, e) for b, e in zip(header.begins, header.ends, strict=True) if e > b)
    for begin, end in [*spans, (end_of_data, end_of_data)]:
        if begin > pos:
            builder.add_region(
                header.data_start + pos, begin - pos, Category.OTHER, STRAY, file,
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


@record(frozen=True)
class Index:
    """A sharded checkpoint's index: its weight map (tensor name -> shard file name) and the
    ``metadata.total_size`` it claims (None if absent or not an integer)."""

    weight_map: dict[str, str]
    total_size: int | None


#: (path, size, mtime) -> the index read from it: a reader asks for it several times.
_INDEXES: dict[tuple[str, int, int], Index] = {}


def read_index(path: Path, format: str = "safetensors-index") -> Index:
    """Read and validate an index (Hugging Face's layout, shared by safetensors and torch
    shards), once: at most ``MODELSIZE_MAX_JSON_BYTES``, parsed by the JSON parser with each
    shard name kept once however many tensors name it."""

    def bad(reason: str) -> CorruptFileError:
        return CorruptFileError(path, format, reason)

    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    hit = _INDEXES.get(key)
    if hit is not None:
        return hit
    _limits.JSON_BYTES.check(path, st.st_size, "the index")
    shards: dict[str, str] = {}

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in items:
            out[k] = shards.setdefault(v, v) if type(v) is str else v
        return out

    try:
        doc = json.loads(path.read_bytes().decode("utf-8"), object_pairs_hook=pairs)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise bad(f"expected a JSON index, found invalid JSON ({exc})") from exc
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise bad('expected {"weight_map": {tensor name: shard file name}}')
    meta = doc.get("metadata")
    total = meta.get("total_size") if isinstance(meta, dict) else None
    index = Index(weight_map, total if _is_int(total) else None)
    _INDEXES.clear()  # the last one only: memory for one index, not every index ever read
    _INDEXES[key] = index
    return index


def read_weight_map(path: Path, format: str = "safetensors-index") -> dict[str, str]:
    """The weight map of a sharded checkpoint's index (tensor name -> shard file), validated.

    Shared by the safetensors and torch shard readers: both use Hugging Face's index layout.
    """
    return read_index(path, format).weight_map


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
    return read_index(index).total_size


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
