"""TensorFlow output: a tensor bundle (``PREFIX.index`` + ``PREFIX.data-00000-of-00001``),
written without TensorFlow.

The data file holds the kept tensors back to back, streamed from the input. The index is a
sorted table (:mod:`._tftable`): under the empty key a ``BundleHeaderProto`` (one shard,
little-endian, version 1), then a ``BundleEntryProto`` per tensor (dtype, shape, shard,
offset, size and the masked CRC-32C of its bytes, which TensorFlow checks on every read). The
CRC-32C is computed as the bytes stream (:mod:`._tfcrc`); for a tensor copied as it is, it
must equal the input's, or the input is damaged and nothing is written.

What each kind of input becomes:

* a TF2 object-based checkpoint keeps its keys (TensorFlow finds a value through the graph,
  whatever its key; kept keys let ``modelsize diff`` pair input and output, even Keras 3's
  ``optimizer/_trainable_variables/N`` for model kernels); its object graph
  (``_CHECKPOINTABLE_OBJECT_GRAPH``) is rewritten without the optimizer, its slot variables
  and whatever else was dropped (:mod:`._tfgraph`), so ``tf.train.Checkpoint(model=model)
  .restore(prefix)`` matches every node;
* a TF1 ``Saver`` checkpoint keeps its variable names; its ``.meta`` graph is not written (it
  is the training graph: restoring it would look for the optimizer's slots), see the note;
* a partitioned variable keeps its slices and its full entry (listing the slices kept);
* a directory (a ``checkpoint`` state file naming the latest prefix) gives a directory with
  the bundle under the same prefix name and a new state file;
* a SavedModel is refused: its graph refers to every variable, so slimming it is a graph
  rewrite (not done yet); ``--to safetensors`` writes its variables.

Deduplicated tensors share bytes: the alias's index entry points at its original's offset,
size and checksum (TensorFlow reads each entry by offset; nothing forbids two entries to name
the same bytes). ``--cast`` is allowed: ``tf.train.load_checkpoint`` reads the narrower dtype,
but restoring into variables of the old dtype fails (see the note).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from modelsize.errors import CorruptFileError, UsageError, printable
from modelsize.formats._protobuf import I32, LEN, ProtobufError, iter_fields, read_varint
from modelsize.formats._sstable import SSTableError, iter_table
from modelsize.formats.tensorflow import (
    FORMAT,
    OBJECT_GRAPH_KEY,
    Entry,
    _string_payload,
    decode_entry,
    decode_slice_key,
    tensor_name,
)
from modelsize.slimming.output import Output
from modelsize.slimming.plan import Plan, PlannedTensor
from modelsize.slimming.writers._tfcrc import crc32c, mask
from modelsize.slimming.writers._tfgraph import rewrite_object_graph
from modelsize.slimming.writers._tftable import (
    field_bytes,
    field_fixed32,
    field_varint,
    table,
    varint,
)
from modelsize.slimming.writers.base import Meter, Written, output_nbytes, slim_name, stream

#: canonical dtype -> TensorFlow ``DataType`` for cast tensors (uncast ones keep the input's).
TF_DTYPES: dict[str, int] = {"float32": 1, "float64": 2, "bfloat16": 14, "float16": 19}
DATA_SUFFIX = ".data-00000-of-00001"
_BUNDLE_FILE_RE = re.compile(r"\.(index|meta|data-\d{5}-of-\d{5})$")
#: ``BundleHeaderProto``: ``num_shards: 1``, ``version { producer: 1 }``.
_HEADER = field_varint(1, 1) + field_bytes(3, field_varint(1, 1))


@dataclass
class _InputEntry:
    """One entry of the input's index: the decoded entry and its raw fields."""

    entry: Entry
    raw: bytes
    crc: int

    def fields(self, *numbers: int) -> bytes:
        """The raw bytes of the fields ``numbers`` (tag included), in file order."""
        return b"".join(self.raw[f.start : f.end] for f in iter_fields(self.raw)
                        if f.number in numbers)


@dataclass
class _OutputEntry:
    """One tensor of the output's index."""

    key: bytes
    dtype: int
    shape: bytes
    offset: int
    size: int
    crc: int = 0
    #: The stored tensor whose bytes (and checksum) an alias shares.
    alias_of: str | None = None

    def encode(self) -> bytes:
        out = field_varint(1, self.dtype) + self.shape
        if self.offset:
            out += field_varint(4, self.offset)
        if self.size:
            out += field_varint(5, self.size)
        return out + field_fixed32(6, self.crc)  # always there: the index size is known early


class _Bytes:
    """A :class:`~modelsize.slimming.source.TensorSource` over bytes made here."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.nbytes = len(data)

    def chunks(self) -> Iterator[bytes]:
        if self.data:
            yield self.data


def string_tensor(payload: bytes) -> tuple[bytes, int]:
    """A scalar ``DT_STRING`` tensor as a bundle stores it, and its entry's masked CRC-32C.

    The bytes: the varint length, the masked CRC-32C of the length (as a 32-bit or 64-bit
    integer), the string. The entry's CRC-32C covers the length integer, the length checksum
    and the string (TensorFlow's ``WriteStringTensor``).
    """
    n = len(payload)
    crc = crc32c(n.to_bytes(4 if n <= 0xFFFFFFFF else 8, "little"))
    length_crc = mask(crc).to_bytes(4, "little")
    crc = crc32c(payload, crc32c(length_crc, crc))
    return varint(n) + length_crc + payload, mask(crc)


#: ``DT_STRING``; and the DataTypes whose tensors a bundle stores as their raw bytes, checksum
#: over those bytes, though the inventory does not list them in their own dtype (quantized
#: integers, 8-bit floats, packed 4- and 2-bit integers). Resources and variants are not
#: checked (a variant's bytes are serialized protos with checksums of their own).
_DT_STRING = 7
#: The longest varint (TensorFlow's ``ReadVarint64``, protobuf's).
_MAX_VARINT = 10
_RAW_DTYPES = frozenset({11, 12, 13, 15, 16, 24, 25, 26, 27, 28, 29, 30, 31, 32})


class _StringCheck:
    """TensorFlow's reading of a ``DT_STRING`` tensor (``ReadStringTensor``), fed its bytes as
    they stream: a varint length per element, the masked CRC-32C of those lengths (each as a
    4-byte integer, 8 bytes past ``2**32 - 1``), then the strings. TensorFlow refuses the
    tensor when the length checksum does not match, and when the entry's CRC-32C (over the
    lengths as integers, the length checksum's 4 bytes and the strings) does not."""

    def __init__(self, count: int) -> None:
        self.left = count  # lengths still to read
        self.pending = bytearray()  # bytes of the lengths and checksum not parsed yet
        self.crc = 0
        self.strings = 0  # bytes the lengths announce
        self.payload = -1  # string bytes seen, once the checksum is read
        self.problem = ""

    def feed(self, chunk: bytes | memoryview) -> None:
        if self.problem:
            return
        if self.payload >= 0:
            self.crc = crc32c(chunk, self.crc)
            self.payload += len(chunk)
            return
        buf = self.pending
        buf += chunk
        pos = 0
        while self.left:
            end = len(buf)
            if end - pos < _MAX_VARINT and all(b & 0x80 for b in buf[pos:end]):
                del buf[:pos]
                return  # a length continues in the next chunk
            try:
                value, pos = read_varint(buf, pos, end)
            except ProtobufError:
                self.problem = "its string lengths are unreadable"
                return
            self.left -= 1
            self.strings += value
            width = 4 if value <= 0xFFFFFFFF else 8
            self.crc = crc32c(value.to_bytes(width, "little"), self.crc)
        if len(buf) - pos < 4:
            del buf[:pos]
            return
        stored = buf[pos : pos + 4]
        if int.from_bytes(stored, "little") != mask(self.crc):
            self.problem = "the checksum of its string lengths does not match"
            return
        self.crc = crc32c(bytes(stored), self.crc)
        rest = bytes(buf[pos + 4 :])
        self.pending = bytearray()
        self.payload = 0
        self.feed(rest)

    def finish(self, recorded: int) -> str:
        """What TensorFlow would refuse in the tensor (``""``: nothing) once all is fed."""
        if self.problem:
            return self.problem
        if self.payload < 0:
            return "its string lengths run past its bytes"
        if self.payload != self.strings:
            return (f"its strings hold {self.payload} bytes where its lengths add up to "
                    f"{self.strings}")
        if mask(self.crc) != recorded:
            return (f"its bytes' CRC-32C is {mask(self.crc):#010x} but the index records "
                    f"{recorded:#010x}")
        return ""


def _read_index(path: Path) -> dict[str, _InputEntry]:
    """Every entry of the input's index, by the name its inventory gives the tensor."""
    try:
        buf = path.read_bytes()
        out: dict[str, _InputEntry] = {}
        for key, start, end in iter_table(buf):
            if not key:
                continue
            raw = buf[start:end]
            crc = next((f.value for f in iter_fields(raw) if f.number == 6 and f.wire_type == I32),
                       0)
            out[tensor_name(key)] = _InputEntry(decode_entry(key, raw, 0, len(raw)), raw, crc)
        return out
    except (SSTableError, ProtobufError) as exc:
        raise CorruptFileError(path, FORMAT, exc.reason, exc.offset) from exc
    except (OSError, ValueError) as exc:
        raise CorruptFileError(path, FORMAT, str(exc)) from exc


def _exact(t: PlannedTensor) -> bool:
    """Whether the inventory holds the tensor's real dtype (not strings, variants, int4...)."""
    return not any(tag.startswith("tf_dtype=") for tag in t.record.tags)


@dataclass
class TensorflowJob:
    """A bundle at a prefix (and a ``checkpoint`` state file when the output is a folder)."""

    files: list[str]
    main: str
    directory: bool
    predicted_bytes: int | None
    data_name: str
    index_name: str
    state: bytes | None
    stored: list[tuple[PlannedTensor, _OutputEntry, _InputEntry | None]]
    aliases: list[_OutputEntry]
    #: Entries of partitioned variables (no bytes: the list of their slices).
    full: list[tuple[bytes, bytes]]
    #: The input's data shards (a damaged one is named in the error).
    shards: tuple[Path, ...]

    def index(self) -> bytes:
        """The ``.index`` file for the entries as they stand."""
        by_name = {t.name: e for t, e, _ in self.stored}
        for alias in self.aliases:
            original = by_name[alias.alias_of or ""]
            alias.offset, alias.size, alias.crc = original.offset, original.size, original.crc
        entries = [(b"", _HEADER)] + [(e.key, e.encode()) for _, e, _ in self.stored]
        entries += [(e.key, e.encode()) for e in self.aliases] + self.full
        return table(sorted(entries))

    def _damaged(self, t: PlannedTensor, source: _InputEntry, crc: int) -> CorruptFileError:
        return CorruptFileError(
            self.shards[source.entry.shard], FORMAT,
            f"{printable(t.name)}: its bytes' CRC-32C is {crc:#010x} but the index records "
            f"{source.crc:#010x} (the data file is damaged; TensorFlow refuses it too)")

    def _check_input_crc(self, t: PlannedTensor, source: _InputEntry) -> None:
        """A tensor to cast is checked against its recorded CRC-32C first: its output bytes
        get a checksum of their own, which would otherwise pass damaged input on as sound."""
        assert t.source is not None
        crc = 0
        for chunk in t.source.chunks():
            crc = crc32c(chunk, crc)
        if mask(crc) != source.crc:
            raise self._damaged(t, source, mask(crc))

    @staticmethod
    def _raw_problem(source: _InputEntry, crc: int) -> str:
        """For a dtype stored as raw bytes, whether their CRC-32C is the index's."""
        if source.entry.dtype not in _RAW_DTYPES or mask(crc) == source.crc:
            return ""
        return f"its bytes' CRC-32C is {mask(crc):#010x} but the index records {source.crc:#010x}"

    def write(self, out: Output, meter: Meter) -> dict[str, Written]:
        """The data file, streamed with each tensor's CRC-32C; then the index; then the state."""
        written: dict[str, Written] = {}
        fh = out.open(self.data_name)
        for t, entry, source in self.stored:
            if t.cast and source is not None and _exact(t):
                self._check_input_crc(t, source)
            s = stream(t, meter)
            strings = (_StringCheck(math.prod(source.entry.shape)) if source is not None
                       and not _exact(t) and source.entry.dtype == _DT_STRING else None)
            crc = 0
            for chunk in s.chunks():
                fh.write(chunk)
                if strings is not None:
                    strings.feed(chunk)
                else:
                    crc = crc32c(chunk, crc)
            written[t.name] = s.written
            if source is None:  # made here (the object graph): its checksum is known
                continue
            if not _exact(t):
                # Strings and the dtypes the inventory lists as bytes are copied as they are,
                # checksum too: checked first as TensorFlow checks them, or a damaged input
                # would be passed on as sound (variants and resources are copied unchecked).
                entry.crc = source.crc
                problem = (strings.finish(source.crc) if strings is not None
                           else self._raw_problem(source, crc))
                if problem:
                    raise CorruptFileError(
                        self.shards[source.entry.shard], FORMAT,
                        f"{printable(t.name)}: {problem} (the data file is damaged; TensorFlow "
                        "refuses it too)")
                continue
            entry.crc = mask(crc)
            if not t.cast and entry.crc != source.crc:
                raise self._damaged(t, source, entry.crc)
        out.open(self.index_name).write(self.index())
        if self.state is not None:
            out.open("checkpoint").write(self.state)
        return written

    def output_name(self, name: str) -> str:
        """Keys are kept: the output's reader gives every tensor its input name."""
        return name


def _target_prefix(target: Path) -> Path:
    """``x.index``, ``x.data-00000-of-00001``, ``x.meta`` -> ``x``; a prefix stays."""
    return target.with_name(_BUNDLE_FILE_RE.sub("", target.name)) if _BUNDLE_FILE_RE.search(
        target.name) else target


def _state_file(prefix_name: str) -> bytes:
    quoted = prefix_name.replace("\\", "\\\\").replace('"', '\\"')
    return (f'model_checkpoint_path: "{quoted}"\n'
            f'all_model_checkpoint_paths: "{quoted}"\n').encode()


def _keep_half_slices(plan: Plan) -> None:
    """Slices of a partitioned variable stay in their dtype under ``--cast float16``:
    TensorFlow restores a slice by copying it into the full tensor, which it does for every
    dtype but half (``RestoreV2``: "Dtype half not supported"); a note says so."""
    by_name = {t.name: t for t in plan.tensors}
    kept = [t for t in plan.tensors
            if t.cast and t.dtype == "float16" and "slice" in t.record.tags]
    for t in kept:
        t.dtype = t.record.dtype
    for t in plan.tensors:
        if t.alias_of is not None and t.alias_of in by_name:
            t.dtype = by_name[t.alias_of].dtype
    if kept:
        names = ", ".join(printable(t.name, 60) for t in kept[:3])
        more = f" and {len(kept) - 3} more" if len(kept) > 3 else ""
        plan.notes.append(
            f"{len(kept)} slice(s) of partitioned variables kept as they are ({names}{more}): "
            "TensorFlow cannot restore a partitioned variable stored as float16")


class TensorflowWriter:
    """TensorFlow checkpoints (tensor bundles), TF1 and TF2."""

    name = "tensorflow"

    def default_target(self, plan: Plan, source: Path) -> Path:
        """``model.ckpt`` -> ``model.ckpt.slim`` (a prefix); a folder -> ``folder.slim/``."""
        if source.is_dir():
            return source.with_name(source.name + ".slim")
        return _target_prefix(slim_name(source))

    def prepare(self, plan: Plan, target: Path) -> TensorflowJob:
        """Every entry, offset and the index's size, before a byte is written."""
        inv = plan.inventory
        if inv.format != FORMAT:
            raise UsageError(f"the tensorflow writer reads TensorFlow checkpoints, not "
                             f"{inv.format}")
        if inv.facts.get("layout") == "saved_model":
            raise UsageError(
                f"{printable(str(inv.path))} is a SavedModel: its graph refers to every variable, "
                "and slimming it means rewriting that graph, which modelsize does not do yet; "
                "write its tensors with --to safetensors (or --to npz)"
            )
        if "prefix" not in inv.facts:
            raise UsageError(f"{printable(str(inv.path))} holds no tensor bundle")
        in_prefix = Path(inv.facts["prefix"])
        directory = inv.path.is_dir() and not _BUNDLE_FILE_RE.search(target.name)
        if directory:
            prefix_name = in_prefix.name
        else:
            if target.is_dir():
                raise UsageError(
                    f"{printable(str(target))} is a folder: name the output's prefix inside it "
                    f"(e.g. {printable(str(target / in_prefix.name))})"
                )
            prefix_name = _target_prefix(target).name
        data_name, index_name = prefix_name + DATA_SUFFIX, prefix_name + ".index"
        inputs = _read_index(inv.files[0].path)
        job = TensorflowJob(
            files=[data_name, index_name] + (["checkpoint"] if directory else []),
            main=index_name, directory=directory, predicted_bytes=None, data_name=data_name,
            index_name=index_name, state=_state_file(prefix_name) if directory else None,
            stored=[], aliases=[], full=[],
            shards=tuple(f.path for f in inv.files[1 : 1 + int(inv.facts.get("shards", 0))]),
        )
        _keep_half_slices(plan)
        kept_keys: set[str] = set()
        #: partitioned variable -> (output dtype, extents of the slices kept)
        slices: dict[bytes, tuple[int, list[tuple[tuple[int, int], ...]]]] = {}
        for t in plan.tensors:
            source = inputs.get(t.record.name)
            if source is None:
                raise UsageError(f"{printable(t.record.name)} is not an entry of the input's "
                                 "index (a modelsize bug: please report it)")
            base = source.entry.key.decode("utf-8", "replace")
            if "slice" in t.record.tags:
                base, extents = decode_slice_key(source.entry.key)
                dtype = TF_DTYPES[t.dtype] if t.cast else source.entry.dtype
                slices.setdefault(base.encode(), (dtype, []))[1].append(extents)
            kept_keys.add(base)
        graph = self._object_graph(plan, kept_keys)
        offset = 0
        for t in plan.tensors:
            source = inputs[t.record.name]
            dtype = TF_DTYPES[t.dtype] if t.cast else source.entry.dtype
            entry = _OutputEntry(source.entry.key, dtype, source.fields(2), 0, 0)
            if t.alias_of is not None:
                entry.alias_of = t.alias_of
                job.aliases.append(entry)
                continue
            entry.offset, entry.size = offset, output_nbytes(t)
            offset += entry.size
            if graph is not None and t is graph[0]:
                entry.crc = graph[1]
                job.stored.append((t, entry, None))
            else:
                job.stored.append((t, entry, source))
        for key, (dtype, kept) in slices.items():
            full = inputs.get(tensor_name(key))
            if full is None:
                raise CorruptFileError(inv.files[0].path, FORMAT, "slices of "
                                       f"{printable(tensor_name(key))} without their full entry")
            listed = [f for f in iter_fields(full.raw) if f.number == 7 and f.wire_type == LEN]
            job.full.append((key, field_varint(1, dtype) + full.fields(2) + b"".join(
                full.raw[f.start : f.end]
                for f, extents in zip(listed, full.entry.slices, strict=True) if extents in kept
            )))
        job.predicted_bytes = offset + len(job.index()) + len(job.state or b"")
        self._notes(plan, job, directory)
        return job

    def _object_graph(self, plan: Plan, kept_keys: set[str]) -> tuple[PlannedTensor, int] | None:
        """Replace the planned object graph (TF2) by one without the dropped nodes; return the
        new planned tensor and its entry's checksum, or None when it stands as it is."""
        name = OBJECT_GRAPH_KEY.decode()
        for i, t in enumerate(plan.tensors):
            if t.record.name != name or t.source is None:
                continue
            raw = b"".join(bytes(c) for c in t.source.chunks())
            try:
                graph = rewrite_object_graph(_string_payload(raw), kept_keys)
            except (ValueError, UnicodeDecodeError) as exc:
                raise CorruptFileError(plan.inventory.files[0].path, FORMAT,
                                       f"object graph unreadable: {exc}") from exc
            if graph is None:
                return None
            data, crc = string_tensor(graph[0])
            record = dataclasses.replace(t.record, shape=(len(data),), nbytes=len(data),
                                         stored_nbytes=len(data))
            new = plan.tensors[i] = PlannedTensor(record, t.name, t.dtype, _Bytes(data))
            plan.notes.append(
                f"object graph rewritten without the {len(plan.dropped)} dropped tensor(s) and "
                f"the {graph[1]} object(s) only they needed (optimizer, slot variables...): "
                "tf.train.Checkpoint(model=model).restore(prefix) matches every object left"
            )
            return new, crc
        return None

    def _notes(self, plan: Plan, job: TensorflowJob, directory: bool) -> None:
        inv = plan.inventory
        if any(f.path.name.endswith(".meta") for f in inv.files):
            plan.notes.append(
                "the input's .meta (the TF1 training graph, optimizer included) is not written: "
                "read the slim bundle with tf.train.load_checkpoint(prefix), or restore it with "
                "tf.compat.v1.train.Saver(var_list=<the model's variables>).restore(sess, prefix) "
                "in a graph that builds the model"
            )
        cast = [t for t in plan.stored if t.cast]
        if cast:
            plan.notes.append(
                f"{len(cast)} tensor(s) cast to {cast[0].dtype}: tf.train.load_checkpoint reads "
                "them as such, but restoring them into variables of the old dtype "
                "(Checkpoint.restore, Saver.restore) fails; build the model in the new dtype"
            )
        if job.aliases:
            plan.notes.append(
                f"{len(job.aliases)} duplicate(s) share their original's bytes (two index entries, "
                "one copy in the data file): "
                + ", ".join(f"{printable(e.key.decode('utf-8', 'replace'), 60)} = "
                            f"{printable(e.alias_of or '', 60)}" for e in job.aliases[:3])
            )
        if directory:
            plan.notes.append(f"a checkpoint state file names {job.index_name[:-6]} as the "
                              "folder's latest checkpoint")

