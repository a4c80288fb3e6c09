"""TensorFlow checkpoints and SavedModels, read without TensorFlow.

A checkpoint is a *tensor bundle*: ``PREFIX.index``, a sorted table (see :mod:`._sstable`)
mapping each tensor name to a ``BundleEntryProto`` (dtype, shape, shard, offset, size,
crc32c, slices), and ``PREFIX.data-NNNNN-of-MMMMM`` shards holding the raw tensor bytes.
The empty key holds the ``BundleHeaderProto`` (number of shards, endianness, version).
Around a bundle there may be a TF1 ``PREFIX.meta`` (the ``MetaGraphDef``: graph), a
``checkpoint`` state file naming the latest prefix of a directory, or a SavedModel directory
(``saved_model.pb``: graph; ``variables/variables.*``: the bundle; ``assets/``: data).

Which bytes are what:

* TF2 object-based checkpoints carry ``_CHECKPOINTABLE_OBJECT_GRAPH``, a
  ``TrackableObjectGraph``: the variables reachable from the root without passing through an
  optimizer are the model's (weights, or buffers when listed as non-trainable or named like
  BatchNorm statistics); slot variables and what hangs only under an optimizer are optimizer
  state. Key prefixes are not trusted: Keras 3 keys model kernels
  ``optimizer/_trainable_variables/N`` because the optimizer is walked first.
* TF1 ``Saver`` checkpoints have no object graph: optimizer slots are recognised by name
  (``w/Adam``, ``w/Adam_1``, ``beta1_power``, ``global_step``...); when a ``.meta`` is present,
  its ``trainable_variables`` collection separates weights from buffers.
* ``DT_STRING`` tensors hold serialized bytes: the object graph is metadata, Keras 2 layer
  configs (``OBJECT_CONFIG_JSON``) are graph, anything else (vocabularies) is other.
* Two variables with identical bytes (a SavedModel from ``model.export()`` stores every
  variable twice) are found by the inventory builder and charged as duplicates; two entries
  naming the very same bytes (a bundle written by ``modelsize slim --dedupe``) view one
  storage, counted once.
"""

from __future__ import annotations

import mmap
import os
import re
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from modelsize._records import field, record
from modelsize.categories import Category
from modelsize.dtypes import DTYPES, numel
from modelsize.errors import CorruptFileError, UsageError, printable
from modelsize.formats._protobuf import LEN, VARINT, Buffer, ProtobufError, iter_fields
from modelsize.formats._sstable import FOOTER_SIZE, MAGIC, SSTableError, iter_table
from modelsize.formats.base import Source, is_regular_file, real_path
from modelsize.inventory import Inventory, InventoryBuilder

FORMAT = "tensorflow"
OBJECT_GRAPH_KEY = b"_CHECKPOINTABLE_OBJECT_GRAPH"
_SHARD_RE = re.compile(r"^(?P<prefix>.*)\.data-(?P<index>\d{5})-of-(?P<count>\d{5})$")
_STATE_RE = re.compile(r'^\s*model_checkpoint_path\s*:\s*"((?:[^"\\]|\\.)*)"', re.M)
#: More shards than this is a lie (TensorFlow's own names have five digits).
_MAX_SHARDS = 99_999
#: Files a SavedModel directory may hold before we stop listing them.
_MAX_DIR_FILES = 100_000
#: The object graph and ``.meta`` are read whole; past this they are not believed.
_MAX_PROTO_BYTES = 1 << 30

#: ``tensorflow/core/framework/types.proto`` DataType -> (canonical dtype, TF name).
_TF_DTYPES: dict[int, tuple[str | None, str]] = {
    1: ("float32", "float"),
    2: ("float64", "double"),
    3: ("int32", "int32"),
    4: ("uint8", "uint8"),
    5: ("int16", "int16"),
    6: ("int8", "int8"),
    7: (None, "string"),
    8: ("complex64", "complex64"),
    9: ("int64", "int64"),
    10: ("bool", "bool"),
    11: ("qint8", "qint8"),
    12: ("quint8", "quint8"),
    13: ("qint32", "qint32"),
    14: ("bfloat16", "bfloat16"),
    15: ("int16", "qint16"),
    16: ("uint16", "quint16"),
    17: ("uint16", "uint16"),
    18: ("complex128", "complex128"),
    19: ("float16", "half"),
    20: (None, "resource"),
    21: (None, "variant"),
    22: ("uint32", "uint32"),
    23: ("uint64", "uint64"),
    24: ("float8_e5m2", "float8_e5m2"),
    25: ("float8_e4m3fn", "float8_e4m3fn"),
    26: ("float8_e4m3fnuz", "float8_e4m3fnuz"),
    27: ("uint8", "float8_e4m3b11fnuz"),
    28: ("float8_e5m2fnuz", "float8_e5m2fnuz"),
    29: ("int8", "int4"),
    30: ("uint8", "uint4"),
    31: ("int8", "int2"),
    32: ("uint8", "uint2"),
}

#: DataTypes whose stored size must be exactly numel * itemsize.
_EXACT_DTYPES = frozenset({1, 2, 3, 4, 5, 6, 8, 9, 10, 14, 17, 18, 19, 22, 23})

#: TF1 optimizer slot suffixes (``<var>/Adam_1``) and bookkeeping variables.
_TF1_SLOT_RE = re.compile(
    r"/(Adam|Momentum|RMSProp|Adagrad|AdagradDA|Ftrl|Adadelta|ProximalAdagrad|"
    r"ProximalGradientDescent|LazyAdam|Adamax|Nadam|AdamW|LAMB|Lamb|LARS)(_\d+)?$"
)
_TF1_OPTIMIZER_LEAF_RE = re.compile(r"^(beta[12]_power|global_step)(_\d+)?$")
#: Non-trainable state inference needs, by variable name (used when nothing better says so).
_BUFFER_LEAVES = frozenset(
    {
        "moving_mean", "moving_variance", "moving_stddev", "renorm_mean", "renorm_stddev",
        "renorm_mean_weight", "renorm_stddev_weight", "seed_generator_state",
    }
)
_OPTIMIZER_EDGES = frozenset({"optimizer", "_optimizer"})
_TRAINABLE_EDGES = frozenset({"trainable_variables", "_trainable_variables", "trainable_weights"})
_NON_TRAINABLE_EDGES = frozenset(
    {"non_trainable_variables", "_non_trainable_variables", "non_trainable_weights"}
)
#: Keras metrics (``keras_api/metrics/N/total``): accumulators of a training run, not the model.
_METRIC_EDGES = frozenset({"metrics", "_metrics", "compile_metrics"})


# --------------------------------------------------------------------------------------
# Where the files are
# --------------------------------------------------------------------------------------
@record
class Layout:
    """The files of one checkpoint or SavedModel, and what the non-bundle ones hold.

    ``prefix`` is a string, not a :class:`~pathlib.Path`: a bundle's prefix may be empty
    (files named exactly ``.index``, ``.data-00000-of-00001``, ``.meta``, as one published
    package ships them), which a ``Path`` cannot spell (``Path("d/")`` is ``d``).
    """

    kind: str  # "checkpoint", "saved_model", or "ambiguous" (several bundles, none named)
    root: Path
    prefix: str | None
    extras: list[tuple[Path, Category, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def index(self) -> Path | None:
        """The bundle's ``.index`` file (None for a SavedModel without variables)."""
        return None if self.prefix is None else _suffixed(self.prefix, ".index")

    @property
    def meta(self) -> Path | None:
        """The TF1 ``.meta`` beside the bundle, when there is one."""
        if self.prefix is None:
            return None
        meta = _suffixed(self.prefix, ".meta")
        return meta if meta.is_file() else None


def _suffixed(prefix: str, suffix: str) -> Path:
    """``PREFIX + suffix`` as a path (``"d/" + ".index"`` is ``d/.index``)."""
    return Path(prefix + suffix)


def _prefix_in(folder: Path, name: str) -> str:
    """The prefix ``name`` inside ``folder`` (``name`` may be empty: ``"d/"``)."""
    return os.path.join(str(folder), name)


def _shown(prefix_name: str) -> str:
    """A prefix's name for a message: the empty prefix is shown as ``""``."""
    return printable(prefix_name, 60) or '""'


def _is_table(path: Path) -> bool:
    """Whether ``path`` is a file ending with the table magic number."""
    try:
        size = path.stat().st_size
        if not path.is_file() or size < FOOTER_SIZE:
            return False
        with open(path, "rb") as fh:
            fh.seek(size - 8)
            return int.from_bytes(fh.read(8), "little") == MAGIC
    except OSError:
        return False


def _prefix_of(path: Path) -> str | None:
    """The bundle prefix a checkpoint file (or a bare prefix) belongs to, if it has an index."""
    name = path.name
    candidates = [str(path)]
    if name.endswith(".index") or name.endswith(".meta"):
        candidates.insert(0, _prefix_in(path.parent, name.rsplit(".", 1)[0]))
    match = _SHARD_RE.match(name)
    if match:
        candidates.insert(0, _prefix_in(path.parent, match["prefix"]))
    for prefix in candidates:
        if _is_table(_suffixed(prefix, ".index")):
            return prefix
    return None


def _state_prefix(directory: Path) -> tuple[str, list[str]] | None:
    """The latest prefix named by a directory's ``checkpoint`` state file."""
    state = directory / "checkpoint"
    if not state.is_file():
        return None
    with open(state, "rb") as fh:
        text = fh.read(1 << 20).decode("utf-8", "replace")
    match = _STATE_RE.search(text)
    if not match:
        return None
    named = re.sub(r"\\(.)", r"\1", match[1])
    prefix = named if os.path.isabs(named) else _prefix_in(directory, named)
    if not _is_table(_suffixed(prefix, ".index")):
        # Saver wrote an absolute path and the directory moved since: TF looks beside it too.
        prefix = _prefix_in(directory, os.path.basename(named))
    others = sorted(
        p.name[: -len(".index")]
        for p in directory.glob("*.index")
        if p.name[: -len(".index")] != os.path.basename(prefix)
    )
    return prefix, others


def locate(source: Source) -> Layout | None:
    """How ``source`` maps to checkpoint files, or None if it is not a TensorFlow checkpoint.

    Accepted: a prefix (``model.ckpt``, ``ckpt-1``: not a file itself), any file of a bundle
    (``.index``, ``.data-*``, ``.meta``), a directory with a ``checkpoint`` state file or a
    single bundle, and a SavedModel directory (or its ``saved_model.pb``). The prefix may be
    empty (a folder holding ``.index`` and ``.data-00000-of-00001``).
    """
    path = source.path
    if source.kind == "file" and path.name in ("saved_model.pb", "saved_model.pbtxt"):
        return _saved_model(path.parent)
    if source.kind in ("file", "missing"):
        prefix = _prefix_of(path)
        return None if prefix is None else Layout("checkpoint", path, prefix)
    if source.kind != "dir":
        return None
    if (path / "saved_model.pb").is_file() or (path / "saved_model.pbtxt").is_file():
        return _saved_model(path)
    state = _state_prefix(path)
    if state is not None and _is_table(_suffixed(state[0], ".index")):
        prefix, others = state
        layout = Layout("checkpoint", path, prefix, [(path / "checkpoint", Category.METADATA,
                                                      "checkpoint state file")])
        if others:
            layout.notes.append(
                f"directory also holds {len(others)} older checkpoint(s) not counted here: "
                + ", ".join(_shown(o) for o in others[:5])
                + (" ..." if len(others) > 5 else "")
            )
        return layout
    tables = sorted(p for p in path.glob("*.index") if _is_table(p))
    if len(tables) == 1:
        return Layout("checkpoint", path, _prefix_in(path, tables[0].name[: -len(".index")]))
    if len(tables) > 1:
        names = ", ".join(_shown(p.name[: -len(".index")]) for p in tables[:5])
        return Layout("ambiguous", path, None, notes=[names])
    return None


def _saved_model(directory: Path) -> Layout:
    prefix = _prefix_in(directory / "variables", "variables")
    layout = Layout("saved_model", directory,
                    prefix if _suffixed(prefix, ".index").is_file() else None)
    bundle = set()
    if layout.prefix is not None:
        bundle = {real_path(p) for p in (directory / "variables").glob("variables.*")
                  if p.name == "variables.index" or _SHARD_RE.match(p.name)}
    count = 0
    for dirpath, dirnames, filenames in os.walk(directory):
        dirnames.sort()
        for name in sorted(filenames):
            file = Path(dirpath) / name
            count += 1
            if count > _MAX_DIR_FILES:
                raise UsageError(
                    f"{printable(str(directory))}: more than {_MAX_DIR_FILES} files in a "
                    "SavedModel directory; point modelsize at the checkpoint inside it"
                )
            if file.is_symlink() or not file.is_file() or real_path(file) in bundle:
                continue
            rel = file.relative_to(directory).as_posix()
            if rel in ("saved_model.pb", "saved_model.pbtxt"):
                layout.extras.append((file, Category.GRAPH, "SavedModel graph"))
            elif rel == "keras_metadata.pb":
                layout.extras.append((file, Category.GRAPH, "Keras model config"))
            elif rel == "fingerprint.pb":
                layout.extras.append((file, Category.METADATA, "SavedModel fingerprint"))
            else:
                layout.extras.append((file, Category.OTHER, f"file {rel}"))
    return layout


# --------------------------------------------------------------------------------------
# The bundle index
# --------------------------------------------------------------------------------------
@record(frozen=True)
class Entry:
    """One ``BundleEntryProto``."""

    key: bytes
    dtype: int
    shape: tuple[int, ...]
    shard: int
    offset: int
    size: int
    slices: tuple[tuple[tuple[int, int], ...], ...] = ()


def _decode_shape(buf: Buffer, start: int, end: int) -> tuple[int, ...]:
    dims: list[int] = []
    for f in iter_fields(buf, start, end):
        if f.number == 2 and f.wire_type == LEN:
            size = 0
            for d in iter_fields(buf, f.data_start, f.end):
                if d.number == 1 and d.wire_type == VARINT:
                    size = d.as_int64()
            if size < 0:
                raise ProtobufError(f"tensor dimension {size} is negative", f.start)
            dims.append(size)
        elif f.number == 3 and f.wire_type == VARINT and f.value:
            raise ProtobufError("saved tensor has an unknown rank", f.start)
    return tuple(dims)


def _decode_slice(buf: Buffer, start: int, end: int) -> tuple[tuple[int, int], ...]:
    """A ``TensorSliceProto`` as ``((start, length or -1 for all), ...)``."""
    extents: list[tuple[int, int]] = []
    for f in iter_fields(buf, start, end):
        if f.number == 1 and f.wire_type == LEN:
            first, length = 0, -1
            for e in iter_fields(buf, f.data_start, f.end):
                if e.number == 1 and e.wire_type == VARINT:
                    first = e.as_int64()
                elif e.number == 2 and e.wire_type == VARINT:
                    length = e.as_int64()
            extents.append((first, length))
    return tuple(extents)


def decode_entry(key: bytes, buf: Buffer, start: int, end: int) -> Entry:
    """Decode the ``BundleEntryProto`` in ``buf[start:end]``."""
    dtype, shard, offset, size = 0, 0, 0, 0
    shape: tuple[int, ...] = ()
    slices: list[tuple[tuple[int, int], ...]] = []
    for f in iter_fields(buf, start, end):
        if f.number == 1 and f.wire_type == VARINT:
            dtype = f.value
        elif f.number == 2 and f.wire_type == LEN:
            shape = _decode_shape(buf, f.data_start, f.end)
        elif f.number == 3 and f.wire_type == VARINT:
            shard = f.as_int64()
        elif f.number == 4 and f.wire_type == VARINT:
            offset = f.as_int64()
        elif f.number == 5 and f.wire_type == VARINT:
            size = f.as_int64()
        elif f.number == 7 and f.wire_type == LEN:
            slices.append(_decode_slice(buf, f.data_start, f.end))
    return Entry(key, dtype, shape, shard, offset, size, tuple(slices))


def _decode_header(buf: Buffer, start: int, end: int) -> tuple[int, int]:
    """``(num_shards, endianness)`` from the ``BundleHeaderProto``."""
    shards, endianness = 1, 0
    for f in iter_fields(buf, start, end):
        if f.number == 1 and f.wire_type == VARINT:
            shards = f.as_int64()
        elif f.number == 2 and f.wire_type == VARINT:
            endianness = f.value
    return shards, endianness


def _read_signed_increasing(key: bytes, pos: int) -> tuple[int, int]:
    """OrderedCode's ``ReadSignedNumIncreasing`` for values of up to 7 bytes."""
    negative = not key[pos] & 0x80
    mask = 0xFF if negative else 0
    first = key[pos] ^ mask
    length = 0
    while length < 8 and first & (0x80 >> length):
        length += 1
    if length == 0 or length == 8 or pos + length > len(key):
        raise ValueError("slice key number unreadable")
    raw = int.from_bytes(bytes(b ^ mask for b in key[pos : pos + length]), "big")
    value = raw & ((1 << (7 * length - 1)) - 1)
    return (~value if negative else value), pos + length


def decode_slice_key(key: bytes) -> tuple[str, tuple[tuple[int, int], ...]]:
    """Name and ``((start, length), ...)`` of a partitioned variable's slice key.

    The key is ``OrderedCode``: ``0``, the escaped name ending ``\\x00\\x01``, the number of
    dimensions, then a signed start and length per dimension.
    """
    if not key.startswith(b"\x00"):
        raise ValueError("not a slice key")
    name = bytearray()
    pos = 1
    while True:
        if pos + 1 >= len(key):
            raise ValueError("slice key name does not terminate")
        byte = key[pos]
        if byte == 0x00:
            nxt = key[pos + 1]
            if nxt == 0x01:
                pos += 2
                break
            if nxt != 0xFF:
                raise ValueError("bad escape in slice key")
            name.append(0)
            pos += 2
        elif byte == 0xFF:
            name.append(0xFF)
            pos += 2
        else:
            name.append(byte)
            pos += 1
    if pos >= len(key) or key[pos] == 0 or key[pos] > 8:
        raise ValueError("slice key rank unreadable")
    ndims = int.from_bytes(key[pos + 1 : pos + 1 + key[pos]], "big")
    pos += 1 + key[pos]
    extents = []
    for _ in range(min(ndims, 64)):
        start, pos = _read_signed_increasing(key, pos)
        length, pos = _read_signed_increasing(key, pos)
        extents.append((start, length))
    return name.decode("utf-8"), tuple(extents)


def _slice_label(name: str, extents: tuple[tuple[int, int], ...]) -> str:
    parts = [":" if length < 0 else f"{start}:{start + length}" for start, length in extents]
    return f"{name}[{','.join(parts)}]"


def tensor_name(key: bytes) -> str:
    """The name the inventory gives the tensor stored under ``key`` (a slice gets its label);
    ``ValueError`` for an unreadable slice key."""
    if key.startswith(b"\x00"):
        return _slice_label(*decode_slice_key(key))
    return printable(key.decode("utf-8", "replace"), 300)


# --------------------------------------------------------------------------------------
# What each variable is
# --------------------------------------------------------------------------------------
@record
class _Node:
    children: list[tuple[int, str]] = field(default_factory=list)
    attributes: list[tuple[str, str, str]] = field(default_factory=list)  # name, full, key
    slots: list[tuple[int, int]] = field(default_factory=list)  # original, slot variable


def parse_object_graph(buf: Buffer) -> list[_Node]:
    """The nodes of a ``TrackableObjectGraph`` (node 0 is the root)."""
    nodes: list[_Node] = []
    for f in iter_fields(buf, 0, len(buf)):
        if f.number != 1 or f.wire_type != LEN:
            continue
        node = _Node()
        for g in iter_fields(buf, f.data_start, f.end):
            if g.wire_type != LEN:
                continue
            if g.number == 1:
                node_id, local = 0, ""
                for h in iter_fields(buf, g.data_start, g.end):
                    if h.number == 1 and h.wire_type == VARINT:
                        node_id = h.value
                    elif h.number == 2 and h.wire_type == LEN:
                        local = h.text(buf)
                node.children.append((node_id, local))
            elif g.number == 2:
                values = {1: "", 2: "", 3: ""}
                for h in iter_fields(buf, g.data_start, g.end):
                    if h.number in values and h.wire_type == LEN:
                        values[h.number] = h.text(buf)
                node.attributes.append((values[1], values[2], values[3]))
            elif g.number == 3:
                original, slot = -1, -1
                for h in iter_fields(buf, g.data_start, g.end):
                    if h.number == 1 and h.wire_type == VARINT:
                        original = h.value
                    elif h.number == 3 and h.wire_type == VARINT:
                        slot = h.value
                node.slots.append((original, slot))
        nodes.append(node)
    count = len(nodes)
    for i, node in enumerate(nodes):
        for child, _ in node.children:
            if child >= count:
                raise ProtobufError(f"object graph node {i} names child {child} of {count}", 0)
        for original, slot in node.slots:
            if not (0 <= original < count and 0 <= slot < count):
                raise ProtobufError(f"object graph node {i} has a slot outside the graph", 0)
    return nodes


def _reach(nodes: list[_Node], starts: list[int], skip: set[int],
           skip_edges: frozenset[str] = frozenset()) -> set[int]:
    seen: set[int] = set()
    stack = [s for s in starts if s not in skip]
    while stack:
        i = stack.pop()
        if i in seen:
            continue
        seen.add(i)
        for child, local in nodes[i].children:
            if child not in seen and child not in skip and local not in skip_edges:
                stack.append(child)
    return seen


def classify_graph(nodes: list[_Node]) -> dict[str, Category]:
    """Checkpoint key -> category, from the object graph's structure."""
    if not nodes:
        return {}
    optimizers = {i for i, n in enumerate(nodes) if n.slots}
    incoming: dict[int, list[str]] = {}
    trainable: set[int] = set()
    frozen: set[int] = set()
    for node in nodes:
        for child, local in node.children:
            incoming.setdefault(child, []).append(local)
            if local in _OPTIMIZER_EDGES:
                optimizers.add(child)
            elif local in _TRAINABLE_EDGES:
                trainable.update(c for c, _ in nodes[child].children)
            elif local in _NON_TRAINABLE_EDGES:
                frozen.update(c for c, _ in nodes[child].children)
    optimizers.discard(0)
    model = _reach(nodes, [0], optimizers)
    # An optimizer's list of the variables it trains points at model weights, not its state.
    optimizer_state = _reach(nodes, list(optimizers), set(), _TRAINABLE_EDGES)
    optimizer_state.update(slot for i in optimizers for _, slot in nodes[i].slots)
    counters = {c for c, local in nodes[0].children if local == "save_counter"}
    metrics = _reach(nodes, [c for n in nodes for c, local in n.children
                             if local in _METRIC_EDGES], set())

    def full_names(ids: set[int]) -> set[str]:
        return {a[1] for i in ids for a in nodes[i].attributes if a[1]}

    trainable_names, frozen_names = full_names(trainable), full_names(frozen)
    out: dict[str, Category] = {}
    for i, node in enumerate(nodes):
        for _, full_name, key in node.attributes:
            if not key:
                continue
            leaves = {full_name.rsplit("/", 1)[-1], *incoming.get(i, [])}
            if i in counters:
                cat = Category.METADATA
            elif i in trainable or (i not in frozen and full_name in trainable_names):
                cat = Category.WEIGHTS
            elif i in optimizer_state and i not in model:
                cat = Category.OPTIMIZER_STATE
            elif i in metrics:
                cat = Category.OTHER
            elif i in frozen or full_name in frozen_names or leaves & _BUFFER_LEAVES:
                cat = Category.BUFFERS
            elif i in model:
                cat = Category.WEIGHTS
            else:
                cat = Category.OTHER
            out[key] = cat
    return out


def classify_name(name: str, trainable: set[str] | None) -> Category:
    """Category of a TF1 variable from its name (and the ``.meta`` trainable set, if any)."""
    leaf = name.rsplit("/", 1)[-1]
    if _TF1_SLOT_RE.search(name) or _TF1_OPTIMIZER_LEAF_RE.match(leaf):
        return Category.OPTIMIZER_STATE
    if trainable:
        return Category.WEIGHTS if name in trainable else Category.BUFFERS
    return Category.BUFFERS if leaf in _BUFFER_LEAVES else Category.WEIGHTS


def trainable_from_meta(buf: Buffer) -> set[str]:
    """Names in a ``MetaGraphDef``'s ``trainable_variables`` collection (``:0`` stripped)."""
    names: set[str] = set()
    for f in iter_fields(buf, 0, len(buf)):
        if f.number != 4 or f.wire_type != LEN:
            continue
        key, value = "", None
        for g in iter_fields(buf, f.data_start, f.end):
            if g.number == 1 and g.wire_type == LEN:
                key = g.text(buf)
            elif g.number == 2 and g.wire_type == LEN:
                value = g
        if key != "trainable_variables" or value is None:
            continue
        for g in iter_fields(buf, value.data_start, value.end):
            if g.number != 2 or g.wire_type != LEN:
                continue
            for item in iter_fields(buf, g.data_start, g.end):
                if item.number != 1 or item.wire_type != LEN:
                    continue
                for v in iter_fields(buf, item.data_start, item.end):
                    if v.number == 1 and v.wire_type == LEN:
                        names.add(v.text(buf).rsplit(":", 1)[0])
                    elif v.number == 4 and v.wire_type == LEN:
                        for s in iter_fields(buf, v.data_start, v.end):
                            if s.number == 1 and s.wire_type == LEN:
                                names.add(s.text(buf))
    return names


# --------------------------------------------------------------------------------------
# The reader
# --------------------------------------------------------------------------------------
def _map(stack: ExitStack, path: Path) -> Buffer:
    with open(path, "rb") as fh:
        if os.fstat(fh.fileno()).st_size == 0:
            return b""
        return stack.enter_context(mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ))


def _string_payload(buf: bytes) -> bytes:
    """The bytes of a scalar ``DT_STRING`` tensor as a bundle stores it.

    Layout: a varint length per element, the masked CRC-32C of those lengths (4 bytes), then
    the strings.
    """
    length, pos = 0, 0
    shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("string tensor length unreadable")
        byte = buf[pos]
        pos += 1
        length |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            break
    if pos + 4 + length != len(buf):
        raise ValueError(
            f"string tensor of {len(buf)} bytes declares a {length}-byte string"
        )
    return buf[pos + 4 :]


class TensorflowReader:
    """TensorFlow tensor bundles (TF1 Saver, TF2 object-based) and SavedModel directories."""

    name = FORMAT
    extensions = (".index", ".data-00000-of-00001", ".meta", ".ckpt", "saved_model.pb")

    def sniff(self, source: Source) -> bool:
        """A bundle file, a prefix with an ``.index`` beside it, or a checkpoint directory."""
        try:
            return locate(source) is not None
        except (OSError, UsageError):
            return source.kind == "dir" and (source.path / "saved_model.pb").is_file()

    def read(self, source: Source) -> Inventory:
        """Account for every byte of the checkpoint's files (index, shards, graph, assets)."""
        layout = locate(source)
        if layout is None:
            raise CorruptFileError(source.path, FORMAT, "no .index file found for this checkpoint")
        if layout.kind == "ambiguous":
            raise UsageError(
                f"{printable(str(source.path))}: directory holds several checkpoints "
                f"({layout.notes[0]}) and no checkpoint state file; give one prefix"
            )
        with ExitStack() as stack:
            return _Bundle(layout, stack).read()


class _Bundle:
    """One read of a checkpoint: the builder plus the mapped index."""

    def __init__(self, layout: Layout, stack: ExitStack) -> None:
        self.layout = layout
        self.stack = stack
        self.shard_count = 0
        self.builder: InventoryBuilder

    def corrupt(self, reason: str, offset: int | None = None, file: int = 0) -> CorruptFileError:
        return self.builder.corrupt(reason, offset, file)

    def read(self) -> Inventory:
        layout = self.layout
        index = layout.index
        entries: list[Entry] = []
        shards: list[Path] = []
        if index is not None:
            assert layout.prefix is not None
            index_buf = _map(self.stack, index)
            shard_count, entries = self._entries(index, index_buf)
            self.shard_count = shard_count
            shards = [
                _suffixed(layout.prefix, f".data-{i:05d}-of-{shard_count:05d}")
                for i in range(shard_count)
            ]
            missing = [p.name for p in shards if not is_regular_file(p)]
            if missing:
                raise CorruptFileError(
                    index, FORMAT,
                    f"index names {shard_count} data shard(s) but {printable(missing[0])} "
                    "is missing",
                )
        extras = list(layout.extras)
        meta = layout.meta
        if meta is not None:
            extras.append((meta, Category.GRAPH, "MetaGraphDef"))
        paths = ([index] if index is not None else []) + shards + [p for p, _, _ in extras]
        self.builder = InventoryBuilder(FORMAT, paths, root=layout.root)
        b = self.builder
        b.notes.extend(layout.notes)
        b.facts["layout"] = layout.kind
        if layout.prefix is not None:
            b.facts["prefix"] = str(layout.prefix)
            b.facts["shards"] = str(len(shards))
        first_extra = len(paths) - len(extras)
        for i, (_, cat, label) in enumerate(extras):
            b.add_region(0, b.files[first_extra + i].nbytes, cat, label, first_extra + i)
        if entries:
            self._tensors(entries, meta)
        return b.build()

    def _entries(self, index: Path, buf: Buffer) -> tuple[int, list[Entry]]:
        shard_count = 1
        endianness = 0
        entries: list[Entry] = []
        pos = 0
        try:
            for key, start, end in iter_table(buf):
                pos = start
                if key == b"":
                    shard_count, endianness = _decode_header(buf, start, end)
                else:
                    entries.append(decode_entry(key, buf, start, end))
        except (SSTableError, ProtobufError) as exc:
            raise CorruptFileError(index, FORMAT, exc.reason, exc.offset) from exc
        except UnicodeDecodeError as exc:
            raise CorruptFileError(index, FORMAT, f"undecodable text ({exc.reason})", pos) from exc
        if not 1 <= shard_count <= _MAX_SHARDS:
            raise CorruptFileError(
                index, FORMAT, f"bundle header claims {shard_count} shards (1..{_MAX_SHARDS})"
            )
        if endianness != 0:
            raise CorruptFileError(
                index, FORMAT, "bundle is big-endian; modelsize reads little-endian bundles"
            )
        return shard_count, entries

    def _read_bytes(self, entry: Entry, limit: int = _MAX_PROTO_BYTES) -> bytes:
        file = 1 + entry.shard
        self.builder.check_range(entry.offset, entry.size, f"tensor {_name(entry)}", file)
        if entry.size > limit:
            raise self.corrupt(f"{_name(entry)} is {entry.size} bytes, more than modelsize "
                               f"reads whole ({limit})", entry.offset, file)
        with open(self.builder.files[file].path, "rb") as fh:
            fh.seek(entry.offset)
            return fh.read(entry.size)

    def _graph_categories(self, entries: list[Entry]) -> dict[str, Category] | None:
        graph = next((e for e in entries if e.key == OBJECT_GRAPH_KEY), None)
        if graph is None:
            return None
        file = 1 + graph.shard
        if not 0 <= graph.shard < len(self.builder.files) - 1 or graph.dtype != 7:
            raise self.corrupt("object graph entry is not a string tensor in a data shard")
        try:
            payload = _string_payload(self._read_bytes(graph))
            return classify_graph(parse_object_graph(payload))
        except (ValueError, UnicodeDecodeError) as exc:
            raise self.corrupt(f"object graph unreadable: {exc}", graph.offset, file) from exc

    def _trainable(self, meta: Path | None) -> set[str] | None:
        if meta is None:
            return None
        file = len(self.builder.files) - 1
        try:
            return trainable_from_meta(_map(self.stack, meta))
        except ProtobufError as exc:
            raise self.corrupt(f"MetaGraphDef unreadable: {exc.reason}", exc.offset, file) from exc
        except UnicodeDecodeError as exc:
            raise self.corrupt(f"MetaGraphDef has undecodable text ({exc.reason})", None,
                               file) from exc

    def _tensors(self, entries: list[Entry], meta: Path | None) -> None:
        b = self.builder
        shard_files = self.shard_count
        by_graph = self._graph_categories(entries)
        trainable = self._trainable(meta) if by_graph is None else None
        b.facts["checkpoint"] = "object-based (TF2)" if by_graph is not None else "name-based (TF1)"
        partitioned = {e.key.decode("utf-8", "replace"): e for e in entries if e.slices}
        stored_slices: dict[str, set[tuple[tuple[int, int], ...]]] = {}
        # Entries naming the same bytes (a deduplicated bundle) view one storage.
        ranges: dict[tuple[int, int, int], str] = {}
        for entry in entries:
            if not 0 < entry.dtype < 200:  # DataType values and their _REF twins (+100)
                raise self.corrupt(f"{_name(entry)} has dtype {entry.dtype}, which is not a "
                                   "TensorFlow DataType")
            if entry.slices:
                continue  # a partitioned variable's data lives in its slice entries
            if not 0 <= entry.shard < shard_files:
                raise self.corrupt(
                    f"{_name(entry)} lies in shard {entry.shard} of {shard_files}"
                )
            name, tags = _name(entry), []
            if entry.key.startswith(b"\x00"):
                try:
                    base, extents = decode_slice_key(entry.key)
                except (ValueError, UnicodeDecodeError) as exc:
                    raise self.corrupt(f"slice key {_name(entry)} unreadable: {exc}") from exc
                if base not in partitioned:
                    raise self.corrupt(f"slice of {printable(base)} whose full entry is missing")
                stored_slices.setdefault(base, set()).add(extents)
                name, tags = _slice_label(base, extents), ["slice"]
            else:
                base = name
            file = 1 + entry.shard
            storage = ranges.setdefault((entry.shard, entry.offset, entry.size), name)
            if storage == name or not entry.size:
                storage = name
                b.add_storage(name, entry.offset, entry.size, file=file)
            canonical, tf_name = _TF_DTYPES.get(entry.dtype, (None, f"DataType {entry.dtype}"))
            if entry.key == OBJECT_GRAPH_KEY:
                cat = Category.METADATA
            elif canonical is None:
                cat = Category.GRAPH if base.endswith("OBJECT_CONFIG_JSON") else Category.OTHER
            elif by_graph is not None:
                cat = by_graph.get(base, classify_name(base, None))
            else:
                cat = classify_name(base, trainable)
            dt = DTYPES.get(canonical or "")
            expected = dt.nbytes(numel(entry.shape)) if dt else -1
            if dt is not None and expected == entry.size:
                b.add_tensor(name, dt.name, entry.shape, cat, storage=storage, tags=tags)
                continue
            if dt is not None and entry.dtype in _EXACT_DTYPES:
                raise self.corrupt(
                    f"{name} is {tf_name} {list(entry.shape)} ({expected} bytes) but its entry "
                    f"claims {entry.size} bytes", entry.offset, file,
                )
            # Strings, variants and exotic dtypes: account the stored bytes as they are.
            b.add_tensor(name, "uint8", (entry.size,), cat, storage=storage,
                         tags=[*tags, f"tf_dtype={tf_name}", f"shape={list(entry.shape)}"])
        for base, full in partitioned.items():
            # TensorFlow finds a partitioned variable's slices through its full entry's list:
            # a slice listed but not stored, or stored but not listed, breaks its reader.
            listed, stored = set(full.slices), stored_slices.get(base, set())
            if listed != stored:
                odd = sorted(listed ^ stored)[0]
                raise self.corrupt(
                    f"partitioned variable {printable(base)} "
                    f"{'lists' if odd in listed else 'does not list'} the slice "
                    f"{_slice_label(base, odd)}, which the bundle "
                    f"{'does not hold' if odd in listed else 'holds'}")
            _check_cover(base, full, self.corrupt)


def _check_cover(base: str, full: Entry, corrupt: Callable[[str], CorruptFileError]) -> None:
    """A partitioned variable's slices lie inside its shape and cover it (their volumes add up
    to its own), as restoring it needs ("Does not have sufficient slices")."""
    shape = full.shape
    volume = 0
    for extents in full.slices:
        if len(extents) != len(shape):
            raise corrupt(f"partitioned variable {printable(base)} of shape {list(shape)} lists "
                          f"a slice of rank {len(extents)}")
        n = 1
        for (start, length), dim in zip(extents, shape, strict=True):
            length = dim if length < 0 else length
            if start < 0 or start + length > dim or (length == dim and start):
                raise corrupt(f"partitioned variable {printable(base)} of shape {list(shape)} "
                              f"lists the slice {_slice_label(base, extents)}, outside it")
            n *= length
        volume += n
    if volume != numel(shape):
        raise corrupt(f"the slices of partitioned variable {printable(base)} hold {volume} "
                      f"elements, its shape {list(shape)} {numel(shape)} (TensorFlow cannot "
                      "restore it)")


def _name(entry: Entry) -> str:
    return printable(entry.key.decode("utf-8", "replace"), 300)
