"""TensorFlow Lite models (``.tflite``): one flatbuffer, read without TensorFlow or flatbuffers.

A flatbuffer starts with the offset of its root table and, at bytes 4..8, the file identifier
``TFL3``. The root is a ``Model`` (tensorflow/lite/schema/schema.fbs)::

    Model { version, operator_codes, subgraphs, description, buffers, metadata_buffer,
            metadata, signature_defs, external_buffer_groups, external_buffers }
    SubGraph { tensors, inputs, outputs, operators, name }
    Tensor { shape, type, buffer, name, quantization, is_variable, sparsity, shape_signature }
    Buffer { data: [ubyte], offset: ulong, size: ulong }

A tensor whose ``buffer`` has a data vector (an empty one too: the interpreter reads a constant
of 0 bytes) is a constant; buffer 0 is the empty sentinel, and the
tensors without bytes (inputs, activations) are counted, not listed. A buffer's bytes are the
``data`` vector, or, in a model past 2 GB, ``size`` bytes at file offset ``offset`` after the
flatbuffer. Accounting:

* a buffer's bytes are a storage: ``weights`` when its tensor is floating, 8-bit or sub-byte,
  or quantized (an int32 bias with a scale); ``buffers`` for other integers and bools (shape
  constants, indices) and variable tensors; two tensors on one buffer share it;
* quantization arrays (``scale``, ``zero_point``, ``min``, ``max``) and sparsity indexes of a
  constant are ``weights`` (they are part of how its values are stored, as a GGUF block's
  scales are); those of an activation are ``graph``;
* buffers that metadata entries name (``min_runtime_version``, TFLite Support metadata,
  ``OfflineMemoryAllocation``...) are ``metadata``; buffers nothing names, ``unused_storage``;
* operators, operator codes, subgraphs, tensor tables, names and signatures are ``graph``;
* everything else (the root, the buffer index, length prefixes, alignment padding) is
  ``metadata``. Vectors nested in an operator's options table are not walked: their few bytes
  count as metadata.

Every offset, count and length is checked against the file size before it is followed, and
nothing is allocated from a declared size; ``read`` never reads buffer data. A sparse tensor's
buffer (and one of a type modelsize cannot size, strings) is an *encoded* storage: for ``slim``,
:meth:`TfliteReader.storage_chunks` gives a sparse tensor dense, as TFLite's ``Densify`` does,
refusing a dense size far past the stored bytes (:data:`DENSE_RATIO`).
"""

from __future__ import annotations

import math
import mmap
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from modelsize._records import field, record
from modelsize.categories import Category
from modelsize.dtypes import DTYPES, numel
from modelsize.errors import CorruptFileError, MissingDependencyError, UsageError, printable
from modelsize.formats.base import Source
from modelsize.inventory import Inventory, InventoryBuilder, StorageRecord

IDENTIFIER = b"TFL3"

#: ``TensorType`` (schema.fbs) -> canonical dtype names of :mod:`modelsize.dtypes`.
TFLITE_DTYPES: dict[int, str] = {
    0: "float32", 1: "float16", 2: "int32", 3: "uint8", 4: "int64", 5: "string", 6: "bool",
    7: "int16", 8: "complex64", 9: "int8", 10: "float64", 11: "complex128", 12: "uint64",
    13: "resource", 14: "variant", 15: "uint32", 16: "uint16", 17: "int4", 18: "bfloat16",
    19: "int2", 20: "uint4",
}
#: Integer and bool constants without quantization are shape constants, indices: ``buffers``.
_BUFFER_DTYPES = frozenset({"int16", "uint16", "int32", "uint32", "int64", "uint64", "bool"})
#: Sparsity index vectors (``SparseIndexVector`` union): type -> element size.
_INDEX_VECTORS = {1: 4, 2: 2, 3: 1}
_METADATA_FACTS = ("min_runtime_version", "CONVERSION_METADATA", "TFLITE_METADATA")

# Field slots (the n-th field of a table, from schema.fbs).
_M_VERSION, _M_OPCODES, _M_SUBGRAPHS, _M_DESCRIPTION, _M_BUFFERS = 0, 1, 2, 3, 4
_M_METADATA_BUFFER, _M_METADATA, _M_SIGNATURES, _M_EXT_GROUPS, _M_EXT_BUFFERS = 5, 6, 7, 8, 9
_SG_TENSORS, _SG_INPUTS, _SG_OUTPUTS, _SG_OPERATORS, _SG_NAME = 0, 1, 2, 3, 4
_T_SHAPE, _T_TYPE, _T_BUFFER, _T_NAME, _T_QUANT, _T_VARIABLE, _T_SPARSITY = 0, 1, 2, 3, 4, 5, 6
_T_SHAPE_SIGNATURE, _T_VARIANTS, _T_EXTERNAL = 7, 9, 10
_Q_MIN, _Q_MAX, _Q_SCALE, _Q_ZERO, _Q_DETAILS, _Q_AXIS = 0, 1, 2, 3, 5, 6
_B_DATA, _B_OFFSET, _B_SIZE = 0, 1, 2
_OP_OPCODE, _OP_INPUTS, _OP_OUTPUTS, _OP_OPTIONS, _OP_CUSTOM, _OP_MUTATING = 0, 1, 2, 4, 5, 7
_OP_INTERMEDIATES, _OP_LARGE_OFFSET, _OP_LARGE_SIZE, _OP_OPTIONS2 = 8, 9, 10, 12


#: Bytes read at a time by :meth:`TfliteReader.storage_chunks`.
_CHUNK = 8 << 20

_SCALARS = {fmt: struct.Struct("<" + fmt) for fmt in "bBhHiIqQ"}


class _Corrupt(Exception):
    """A bound broken while walking the flatbuffer: (reason, offset)."""

    def __init__(self, reason: str, offset: int) -> None:
        super().__init__(reason)
        self.reason = reason
        self.offset = offset


class _Flat:
    """Bounded reads of a flatbuffer; every table, vector and string read is recorded as a
    byte range of the category it was read for."""

    def __init__(self, buf: mmap.mmap | bytes) -> None:
        self.buf = buf
        self.size = len(buf)
        self.ranges: dict[Category, list[tuple[int, int]]] = {}

    def need(self, pos: int, nbytes: int, what: str) -> None:
        if pos < 0 or nbytes < 0 or pos + nbytes > self.size:
            raise _Corrupt(f"{what} claims bytes {pos}..{pos + nbytes} but the file has "
                           f"{self.size} (truncated or corrupt file?)", pos)

    def scalar(self, fmt: str, pos: int, what: str) -> int:
        packer = _SCALARS[fmt]
        if pos < 0 or pos + packer.size > self.size:
            self.need(pos, packer.size, what)  # raises, naming it
        return int(packer.unpack_from(self.buf, pos)[0])

    def mark(self, category: Category, start: int, stop: int) -> None:
        if stop > start:
            self.ranges.setdefault(category, []).append((start, stop))

    def deref(self, pos: int, what: str) -> int:
        """The position a ``uoffset`` at ``pos`` points to (always forward, inside the file)."""
        target = pos + self.scalar("I", pos, what)
        self.need(target, 4, what)
        return target

    def table(self, pos: int, what: str, category: Category) -> _Table:
        vtable = pos - self.scalar("i", pos, f"{what} table")
        vt_size = self.scalar("H", vtable, f"vtable of {what}")
        inline = self.scalar("H", vtable + 2, f"vtable of {what}")
        if vt_size < 4 or vt_size % 2 or inline < 4:
            raise _Corrupt(f"{what} has a malformed vtable (size {vt_size}, table {inline})",
                           vtable)
        self.need(vtable, vt_size, f"vtable of {what}")
        self.need(pos, inline, f"{what} table")
        self.mark(category, vtable, vtable + vt_size)
        self.mark(category, pos, pos + inline)
        return _Table(self, pos, vtable, vt_size, inline, what, category)

    def vector(self, start: int, elem: int, what: str) -> tuple[int, int]:
        """``(first element, count)`` of the vector whose length prefix is at ``start``."""
        count = self.scalar("I", start, f"length of {what}")
        self.need(start + 4, count * elem, f"{what} ({count} elements)")
        return start + 4, count


@record
class _Table:
    flat: _Flat
    pos: int
    vtable: int
    vt_size: int
    inline: int
    what: str
    category: Category

    def field(self, slot: int, width: int) -> int:
        """Position of field ``slot`` in the table, or 0 when absent."""
        entry = 4 + 2 * slot
        if entry + 2 > self.vt_size:
            return 0
        off = self.flat.scalar("H", self.vtable + entry, f"vtable of {self.what}")
        if off == 0:
            return 0
        if off + width > self.inline:
            raise _Corrupt(f"field {slot} of {self.what} lies outside its table "
                           f"({off} + {width} > {self.inline} bytes)", self.pos)
        return self.pos + off

    def scalar(self, slot: int, fmt: str, default: int = 0) -> int:
        pos = self.field(slot, _SCALARS[fmt].size)
        return default if pos == 0 else self.flat.scalar(fmt, pos, self.what)

    def ref(self, slot: int, what: str) -> int:
        """Position a reference field points to, 0 when absent."""
        pos = self.field(slot, 4)
        return 0 if pos == 0 else self.flat.deref(pos, what)

    def vector(self, slot: int, elem: int, what: str, category: Category | None = None,
               ) -> tuple[int, int]:
        """``(first element, count)`` of a vector field (``(0, 0)`` when absent); its bytes
        are marked ``category`` (the table's own by default)."""
        start = self.ref(slot, what)
        if start == 0:
            return 0, 0
        first, count = self.flat.vector(start, elem, what)
        self.flat.mark(category or self.category, start, first + count * elem)
        return first, count

    def string(self, slot: int, what: str, category: Category | None = None) -> str | None:
        first, count = self.vector(slot, 1, what, category)
        if first == 0:
            return None
        self.flat.mark(category or self.category, first + count,
                       min(first + count + 1, self.flat.size))  # the NUL terminator
        try:  # flatbuffers strings are UTF-8; TFLite's Python API decodes them strictly
            return bytes(self.flat.buf[first:first + count]).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _Corrupt(f"{what} is not UTF-8 text ({exc.reason} at byte {exc.start})",
                           first) from exc

    def tables(self, slot: int, what: str, category: Category | None = None,
               ) -> Iterator[_Table]:
        """The tables of a vector-of-tables field."""
        cat = category or self.category
        first, count = self.vector(slot, 4, what, cat)
        for i in range(count):
            yield self.flat.table(self.flat.deref(first + 4 * i, what), f"{what}[{i}]", cat)

    def ints(self, slot: int, what: str, category: Category | None = None) -> list[int]:
        first, count = self.vector(slot, 4, what, category)
        return list(struct.unpack_from(f"<{count}i", self.flat.buf, first)) if count else []


@record
class Constant:
    """A constant tensor: one with bytes in a buffer; ``name`` is the inventory's (prefixed by
    its subgraph's name past the first, made unique), ``(subgraph, index)`` where it is."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    buffer: int
    quantized: str = ""  # "", "per-tensor", or "per-channel (axis N, K scales)"
    variable: bool = False
    sparse: bool = False
    subgraph: int = 0
    index: int = 0
    #: Where its ``SparsityParameters`` table is (0: not sparse).
    sparsity: int = 0


@record
class _Model:
    tensors: list[Constant] = field(default_factory=list)
    #: buffer index -> (data offset, size) of buffers with bytes.
    buffers: dict[int, tuple[int, int]] = field(default_factory=dict)
    #: buffer index -> metadata name.
    metadata: dict[int, str] = field(default_factory=dict)
    #: byte ranges outside the flatbuffer (large custom options): graph.
    graph_extra: list[tuple[int, int]] = field(default_factory=list)
    facts: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


class TfliteReader:
    """Reads TensorFlow Lite flatbuffers without TensorFlow or the flatbuffers package."""

    name: str = "tflite"
    extensions: tuple[str, ...] = (".tflite", ".lite")

    def sniff(self, source: Source) -> bool:
        """The flatbuffer file identifier ``TFL3`` at bytes 4..8."""
        return source.kind == "file" and source.size >= 8 and source.head[4:8] == IDENTIFIER

    def read(self, source: Source) -> Inventory:
        """Account for every byte of the model, reading only the flatbuffer's tables."""
        path = source.path
        builder = InventoryBuilder(self.name, [path], root=path)
        size = builder.files[0].nbytes
        if size < 8:
            raise builder.corrupt(f"file has {size} bytes, too few for a flatbuffer")
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            flat = _Flat(buf)
            try:
                model = _parse(flat)
                metadata_values = _metadata_values(flat, model)
            except _Corrupt as exc:
                raise builder.corrupt(exc.reason, exc.offset) from exc
        builder.facts.update(model.facts)
        builder.facts.update(metadata_values)
        builder.notes.extend(model.notes)
        _declare(builder, flat, model)
        return builder.build(Category.METADATA)

    def storage_chunks(self, inv: Inventory, storage: StorageRecord) -> Iterator[bytes]:
        """An *encoded* buffer's tensor: a sparse tensor densified (TFLite's ``Densify``), the
        bytes of a type modelsize cannot size (strings) as they are."""
        path = inv.files[storage.file].path
        if storage.logical_nbytes is not None:
            dense = _dense_bytes(path, storage)
            for pos in range(0, len(dense), _CHUNK):
                yield dense[pos:pos + _CHUNK]
            return
        with open(path, "rb") as fh:
            fh.seek(storage.offset)
            left = storage.nbytes
            while left:
                data = fh.read(min(left, _CHUNK))
                if not data:
                    raise ValueError(f"{path}: buffer {storage.key} ends early")
                left -= len(data)
                yield data


def _parse(flat: _Flat) -> _Model:
    model = _Model()
    root = flat.table(flat.deref(0, "root offset"), "Model", Category.METADATA)
    model.facts["tflite.schema_version"] = str(root.scalar(_M_VERSION, "I"))
    description = root.string(_M_DESCRIPTION, "description")
    if description:
        model.facts["tflite.description"] = printable(description, 80)

    buffer_tables = list(root.tables(_M_BUFFERS, "buffers"))
    for i, b in enumerate(buffer_tables):
        first, count = b.vector(_B_DATA, 1, f"buffers[{i}].data", Category.METADATA)
        offset, nbytes = b.scalar(_B_OFFSET, "Q"), b.scalar(_B_SIZE, "Q")
        if count or (first and i):  # an empty data vector too: a constant of 0 bytes
            model.buffers[i] = (first, count)
        elif offset > 1 and nbytes:  # a model past 2 GB: the bytes follow the flatbuffer
            flat.need(offset, nbytes, f"buffers[{i}] (offset {offset}, size {nbytes})")
            model.buffers[i] = (offset, nbytes)

    for i, m in enumerate(root.tables(_M_METADATA, "metadata")):
        name = m.string(0, f"metadata[{i}].name") or f"metadata[{i}]"
        index = m.scalar(1, "I")
        if index >= len(buffer_tables):
            raise _Corrupt(f"metadata[{i}] ({printable(name, 80)!r}) refers to buffer {index}, "
                           f"but the model has {len(buffer_tables)}", m.pos)
        model.metadata.setdefault(index, name)
    for index in root.ints(_M_METADATA_BUFFER, "metadata_buffer"):
        if not 0 <= index < len(buffer_tables):
            raise _Corrupt(f"metadata_buffer names buffer {index}, but the model has "
                           f"{len(buffer_tables)}", root.pos)
        model.metadata.setdefault(index, "metadata_buffer")

    codes = []
    for i, code in enumerate(root.tables(_M_OPCODES, "operator_codes", Category.GRAPH)):
        custom = code.string(1, f"operator_codes[{i}].custom_code")
        builtin = max(code.scalar(0, "b"), code.scalar(3, "i"))
        codes.append(custom or str(builtin))
        if not custom and not 0 <= builtin <= LAST_BUILTIN:
            model.facts.setdefault(
                UNLOADABLE_FACT, f"operator_codes[{i}] is builtin operator {builtin}, which no "
                f"TFLite schema modelsize knows has (the newest ends at {LAST_BUILTIN}; the "
                "interpreter: 'Op builtin_code out of range')")
    for i, sig in enumerate(root.tables(_M_SIGNATURES, "signature_defs", Category.GRAPH)):
        for slot in (0, 1):
            if not sig.field(slot, 4):  # the interpreter: "NULL SignatureDef inputs for ..."
                model.facts.setdefault(
                    UNLOADABLE_FACT, f"signature_defs[{i}] has no {('inputs', 'outputs')[slot]} "
                    f"vector (the interpreter: 'NULL SignatureDef {('inputs', 'outputs')[slot]}')")
            for j, tmap in enumerate(sig.tables(slot, f"signature_defs[{i}].tensors")):
                tmap.string(0, f"signature_defs[{i}].tensors[{j}].name")
        sig.string(2, f"signature_defs[{i}].signature_key")
    for slot in (_M_EXT_GROUPS, _M_EXT_BUFFERS):
        for ext in root.tables(slot, "external_buffers"):
            ext.string(0, "external_buffer_groups.name")
    if root.field(_M_EXT_BUFFERS, 4):
        model.notes.append("the model names external buffers (weights in other files): "
                           "those files are not read")

    n_tensors = n_ops = 0
    subgraphs = list(root.tables(_M_SUBGRAPHS, "subgraphs", Category.GRAPH))
    for s, sg in enumerate(subgraphs):
        sg_name = sg.string(_SG_NAME, f"subgraphs[{s}].name")
        prefix = "" if s == 0 else f"{sg_name or f'subgraph{s}'}/"
        refs = [(f"subgraphs[{s}].{w}", sg.ints(slot, f"subgraphs[{s}].{w}"))
                for w, slot in (("inputs", _SG_INPUTS), ("outputs", _SG_OUTPUTS))]
        for k, op in enumerate(sg.tables(_SG_OPERATORS, f"subgraphs[{s}].operators")):
            refs += _operator(flat, op, f"subgraphs[{s}].operators[{k}]", model, codes)
            n_ops += 1
        count = 0
        for k, t in enumerate(sg.tables(_SG_TENSORS, f"subgraphs[{s}].tensors")):
            count += 1
            _tensor(flat, t, f"subgraphs[{s}].tensors[{k}]", prefix, model, len(buffer_tables),
                    (s, k))
        n_tensors += count
        _check_indices(refs, count, s, sg.pos)
    _unique_names(model.tensors)
    model.facts["tflite.subgraphs"] = str(len(subgraphs))
    model.facts["tflite.operators"] = f"{n_ops} ({len(set(codes))} kinds)"
    model.facts["tflite.tensors"] = f"{n_tensors} ({len(model.tensors)} constant)"
    quantized = [t for t in model.tensors if t.quantized]
    if quantized:
        per_channel = sum(t.quantized.startswith("per-channel") for t in quantized)
        model.facts["tflite.quantization"] = (
            f"{len(quantized)} constant tensors quantized, {per_channel} per-channel")
    return model


def _check_indices(refs: list[tuple[str, list[int]]], count: int, s: int, pos: int) -> None:
    """Every tensor index of a subgraph's interface and operators names one of its ``count``
    tensors, or is -1 (an optional input), as the TFLite interpreter requires."""
    for what, indices in refs:
        bad = next((i for i in indices if not -1 <= i < count), None)
        if bad is not None:
            raise _Corrupt(f"{what} names tensor {bad}, but subgraph {s} has {count} tensors",
                           pos)


#: The last ``BuiltinOperator`` of the newest schema (TensorFlow 2.21's: STABLEHLO_SHIFT_LEFT);
#: an interpreter refuses a larger code ("Op builtin_code out of range: N. Are you using old
#: TFLite binary with newer model?"). Read by slim's loader rules, not by inspect.
LAST_BUILTIN = 209
#: The fact saying why the interpreter would not load a model modelsize reads (an unknown
#: builtin code, a signature without its inputs or outputs vector); read by slim's rules.
UNLOADABLE_FACT = "tflite.unloadable"

#: Inputs the kernels of these builtin operators (and the XNNPACK delegate that TFLite applies
#: by default) read by position without checking the operator's count: a FULLY_CONNECTED with
#: one input crashed the interpreter in ``allocate_tensors`` (SIGSEGV). Builtin code -> its
#: name and the least inputs it needs (a weight or a second operand); -1 entries count.
_LEAST_INPUTS: dict[str, tuple[str, int]] = {
    "0": ("ADD", 2), "3": ("CONV_2D", 2), "4": ("DEPTHWISE_CONV_2D", 2),
    "9": ("FULLY_CONNECTED", 2), "18": ("MUL", 2), "41": ("SUB", 2), "42": ("DIV", 2),
}


def _operator(flat: _Flat, op: _Table, what: str, model: _Model,
              codes: list[str]) -> list[tuple[str, list[int]]]:
    """Mark an operator's bytes; return its tensor index lists (checked by the caller)."""
    code = op.scalar(_OP_OPCODE, "I")
    if code >= len(codes):
        raise _Corrupt(f"{what} uses operator code {code}, but the model has {len(codes)}",
                       op.pos)
    refs = [(f"{what}.{name}", op.ints(slot, f"{what} tensor list"))
            for name, slot in (("inputs", _OP_INPUTS), ("outputs", _OP_OUTPUTS),
                               ("intermediates", _OP_INTERMEDIATES))]
    least = _LEAST_INPUTS.get(codes[code])
    if least is not None and len(refs[0][1]) < least[1]:
        raise _Corrupt(f"{what} is a {least[0]} with {len(refs[0][1])} input(s); its kernel "
                       f"reads {least[1]} (the TFLite interpreter crashes on it)", op.pos)
    op.vector(_OP_MUTATING, 1, f"{what} tensor list")
    op.vector(_OP_CUSTOM, 1, f"{what}.custom_options")
    for slot in (_OP_OPTIONS, _OP_OPTIONS2):
        options = op.ref(slot, f"{what} options")
        if options:
            flat.table(options, f"{what} options", Category.GRAPH)
    offset, nbytes = op.scalar(_OP_LARGE_OFFSET, "Q"), op.scalar(_OP_LARGE_SIZE, "Q")
    if offset > 1 and nbytes:
        flat.need(offset, nbytes, f"{what}.large_custom_options")
        model.graph_extra.append((offset, offset + nbytes))
    return refs


def _tensor(flat: _Flat, t: _Table, what: str, prefix: str, model: _Model,
            n_buffers: int, where: tuple[int, int]) -> None:
    shape = tuple(t.ints(_T_SHAPE, f"{what}.shape"))
    t.ints(_T_SHAPE_SIGNATURE, f"{what}.shape_signature")
    type_id = t.scalar(_T_TYPE, "b")
    buffer = t.scalar(_T_BUFFER, "I")
    name = t.string(_T_NAME, f"{what}.name") or what
    if buffer >= n_buffers and buffer != 0:
        raise _Corrupt(f"{what} ({printable(name, 80)!r}) refers to buffer {buffer}, but the "
                       f"model has {n_buffers}", t.pos)
    constant = buffer in model.buffers
    own = Category.WEIGHTS if constant else Category.GRAPH
    quantized = _quantization(flat, t, what, own)
    sparsity = _sparsity(flat, t, what, own)
    for k, variant in enumerate(t.tables(_T_VARIANTS, f"{what}.variant_tensors")):
        variant.ints(0, f"{what}.variant_tensors[{k}].shape")
    dt = DTYPES.get(TFLITE_DTYPES.get(type_id, ""))
    if dt is not None and _overflows(shape, dt.nbytes):
        raise _Corrupt(f"{what} ({printable(name, 80)!r}) has shape {list(shape)}, whose bytes "
                       "overflow 64 bits (the interpreter refuses it)", t.pos)
    if not constant:
        return
    if any(d < 0 for d in shape):
        raise _Corrupt(f"constant {what} ({printable(name, 80)!r}) has shape {list(shape)}",
                       t.pos)
    dtype = TFLITE_DTYPES.get(type_id, f"tflite_type_{type_id}")
    model.tensors.append(Constant(prefix + name, dtype, shape, buffer, quantized,
                                  bool(t.scalar(_T_VARIABLE, "B")), bool(sparsity), *where,
                                  sparsity))


def _overflows(shape: tuple[int, ...], nbytes: Callable[[int], int]) -> bool:
    """Whether the interpreter's ``BytesRequired`` overflows: each dimension taken as a
    ``size_t`` (a negative one is huge), their product and its bytes past 64 bits."""
    count = 1
    for d in shape:
        count *= d % (1 << 64)
        if count >= 1 << 64:
            return True
    return nbytes(count) >= 1 << 64


def _quantization(flat: _Flat, t: _Table, what: str, category: Category) -> str:
    """Mark a tensor's quantization parameters; say how it is quantized ("" if not)."""
    start = t.ref(_T_QUANT, f"{what}.quantization")
    if not start:
        return ""
    q = flat.table(start, f"{what}.quantization", Category.GRAPH)
    for slot in (_Q_MIN, _Q_MAX, _Q_ZERO):
        q.vector(slot, 8 if slot == _Q_ZERO else 4, f"{what}.quantization", category)
    _, scales = q.vector(_Q_SCALE, 4, f"{what}.quantization.scale", category)
    details = q.ref(_Q_DETAILS, f"{what}.quantization.details")
    if details:
        custom = flat.table(details, f"{what}.quantization.details", category)
        custom.vector(0, 1, f"{what}.quantization.details.custom", category)
    if scales > 1:
        return f"per-channel (axis {q.scalar(_Q_AXIS, 'i')}, {scales} scales)"
    return "per-tensor" if scales == 1 else ""


def _sparsity(flat: _Flat, t: _Table, what: str, category: Category) -> int:
    """Mark a tensor's sparsity parameters; where they are (0: none)."""
    start = t.ref(_T_SPARSITY, f"{what}.sparsity")
    if not start:
        return 0
    sp = flat.table(start, f"{what}.sparsity", category)
    sp.ints(0, f"{what}.sparsity.traversal_order", category)
    sp.ints(1, f"{what}.sparsity.block_map", category)
    for k, dim in enumerate(sp.tables(2, f"{what}.sparsity.dim_metadata", category)):
        for type_slot, value_slot in ((2, 3), (4, 5)):
            elem = _INDEX_VECTORS.get(dim.scalar(type_slot, "B"))
            values = dim.ref(value_slot, f"{what}.sparsity.dim_metadata[{k}]")
            if elem and values:
                vec = flat.table(values, f"{what}.sparsity.dim_metadata[{k}]", category)
                vec.vector(0, elem, f"{what}.sparsity.dim_metadata[{k}].values")
    return start


def _unique_names(tensors: list[Constant]) -> None:
    """Suffix ``#2``, ``#3``... to names already taken (TFLite does not require unique names)."""
    seen: dict[str, int] = {}
    for t in tensors:
        n = seen.get(t.name, 0) + 1
        seen[t.name] = n
        if n > 1:
            t.name = f"{t.name}#{n}"


def _metadata_values(flat: _Flat, model: _Model) -> dict[str, str]:
    """Short text metadata buffers (``min_runtime_version``), as facts: at most 64 bytes."""
    out: dict[str, str] = {}
    for index, name in model.metadata.items():
        if name in _METADATA_FACTS[:1] and index in model.buffers:
            offset, nbytes = model.buffers[index]
            text = bytes(flat.buf[offset:offset + min(nbytes, 64)]).split(b"\0", 1)[0]
            out[f"tflite.{name}"] = printable(text.decode("utf-8", "replace"), 40)
    names = sorted(set(model.metadata.values()))
    if names:
        out["tflite.metadata"] = printable(", ".join(names), 120)
    return out


def _category(t: Constant) -> Category:
    if t.variable or (t.dtype in _BUFFER_DTYPES and not t.quantized):
        return Category.BUFFERS
    return Category.WEIGHTS


def _declare(builder: InventoryBuilder, flat: _Flat, model: _Model) -> None:
    used: set[int] = set()
    for t in model.tensors:
        offset, nbytes = model.buffers[t.buffer]
        key = f"buffer {t.buffer}"
        dt = DTYPES.get(t.dtype)
        expected = dt.nbytes(numel(t.shape)) if dt else None
        encoded = t.sparse or expected is None
        if not encoded and expected is not None and expected > nbytes:
            raise builder.corrupt(
                f"tensor {printable(t.name, 80)!r} ({t.dtype} {list(t.shape)}) needs "
                f"{expected} bytes but its buffer {t.buffer} holds {nbytes}", offset)
        if not builder.has_storage(key):
            builder.add_storage(key, offset, nbytes, dtype=t.dtype, compressed=encoded,
                                logical_nbytes=expected if encoded and expected else None)
        tags = (t.quantized,) if t.quantized else ()
        builder.add_tensor(t.name, t.dtype, t.shape, _category(t), storage=key,
                           tags=tags + (("sparse",) if t.sparse else ()))
        used.add(t.buffer)

    claimed: list[tuple[int, int]] = [
        (o, o + n) for i, (o, n) in model.buffers.items() if i in used]
    for index, (offset, nbytes) in sorted(model.buffers.items()):
        if index in used:
            continue
        meta = model.metadata.get(index)
        builder.add_region(offset, nbytes, Category.METADATA if meta else Category.UNUSED_STORAGE,
                           f"metadata {printable(meta, 60)}" if meta else
                           f"buffer {index} (no tensor or metadata uses it)")
        claimed.append((offset, offset + nbytes))
    for start, stop in model.graph_extra:
        flat.mark(Category.GRAPH, start, stop)
    for category in (Category.WEIGHTS, Category.GRAPH):
        mine = _subtract(_union(flat.ranges.get(category, [])), _union(claimed))
        for start, stop in mine:
            builder.add_region(start, stop - start, category,
                               "quantization and sparsity of constants"
                               if category is Category.WEIGHTS else "graph")
        claimed.extend(mine)


def _union(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(r for r in ranges if r[1] > r[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _subtract(ranges: list[tuple[int, int]], holes: list[tuple[int, int]],
              ) -> list[tuple[int, int]]:
    """Parts of the sorted, disjoint ``ranges`` outside the sorted, disjoint ``holes``."""
    out: list[tuple[int, int]] = []
    j = 0
    for a, b in ranges:
        while j < len(holes) and holes[j][1] <= a:
            j += 1
        k = j
        while k < len(holes) and holes[k][0] < b:
            if holes[k][0] > a:
                out.append((a, holes[k][0]))
            a = max(a, holes[k][1])
            k += 1
        if a < b:
            out.append((a, b))
    return out


#: A sparse tensor is densified for slim when its dense bytes are at most this many times its
#: stored bytes plus this many bytes (a header may claim any shape: memory follows real bytes).
DENSE_RATIO, DENSE_SLACK = 64, 64 << 20
_INDEX_CODES = {4: "i", 2: "H", 1: "B"}


def _dense_bytes(path: Path, storage: StorageRecord) -> bytes:
    """The dense little-endian bytes of the sparse tensor stored in ``storage``."""
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        flat = _Flat(buf)
        try:
            model = _parse(flat)
            [t] = [c for c in model.tensors if f"buffer {c.buffer}" == storage.key and c.sparse]
            dt = DTYPES[t.dtype]
            dense = dt.nbytes(numel(t.shape))
            if dense > DENSE_RATIO * storage.nbytes + DENSE_SLACK:
                raise UsageError(
                    f"{printable(str(path))}: sparse tensor {printable(t.name, 80)} would be "
                    f"{dense:,} bytes dense from {storage.nbytes:,} stored, more than modelsize "
                    f"densifies ({DENSE_RATIO}x + {DENSE_SLACK >> 20} MiB)")
            params = _sparse_params(flat, t.sparsity, t.name)
            values = bytes(buf[storage.offset:storage.offset + storage.nbytes])
            return _densify(values, dt.block_bytes, t.shape, *params)
        except (_Corrupt, ValueError) as exc:
            reason = exc.reason if isinstance(exc, _Corrupt) else str(exc)
            raise CorruptFileError(path, "tflite", f"sparse tensor in {storage.key}: "
                                   f"{reason}") from exc


def _sparse_params(flat: _Flat, pos: int, what: str,
                   ) -> tuple[list[int], list[int], list[tuple[int, int, list[int], list[int]]]]:
    """``(traversal_order, block_map, levels)``; a level is ``(format, dense_size,
    array_segments, array_indices)``."""
    sp = flat.table(pos, f"{what}.sparsity", Category.WEIGHTS)
    order = sp.ints(0, "traversal_order")
    block_map = sp.ints(1, "block_map")
    levels = []
    for k, dim in enumerate(sp.tables(2, "dim_metadata")):
        arrays: list[list[int]] = []
        for type_slot, value_slot in ((2, 3), (4, 5)):
            elem = _INDEX_VECTORS.get(dim.scalar(type_slot, "B"))
            values = dim.ref(value_slot, f"dim_metadata[{k}]")
            if elem and values:
                vec = flat.table(values, f"dim_metadata[{k}]", Category.WEIGHTS)
                first, count = vec.vector(0, elem, f"dim_metadata[{k}].values")
                arrays.append(list(struct.unpack_from(f"<{count}{_INDEX_CODES[elem]}",
                                                      flat.buf, first)))
            else:
                arrays.append([])
        levels.append((dim.scalar(0, "b"), dim.scalar(1, "i"), arrays[0], arrays[1]))
    return order, block_map, levels


def _densify(values: bytes, itemsize: int, shape: tuple[int, ...], order: list[int],
             block_map: list[int], levels: list[tuple[int, int, list[int], list[int]]],
             ) -> bytes:
    """TFLite's sparse format (TACO: traversal order, dense and CSR levels, dense blocks)
    written out dense, level by level with NumPy (the leaves come in the stored order)."""
    np = _numpy()
    n, k = len(shape), len(block_map)
    if len(order) != n + k or len(levels) != n + k or sorted(order) != list(range(n + k)):
        raise ValueError(f"traversal order {order} does not fit {n} dims and {k} block dims")
    if any(not 0 <= d < n for d in block_map):
        raise ValueError(f"block map {block_map} names dims outside {n}")
    block_size = [levels[order[n + b]][1] for b in range(k)]
    dense_count = math.prod(shape)
    prev = np.zeros(1, dtype=np.int64)
    coords: list[Any] = []
    for fmt, size, segments, indices in levels:
        if fmt == 0:
            if size < 0 or len(prev) * max(size, 0) > dense_count:
                raise ValueError(f"dense level of {size} exceeds the tensor")
            parent = np.repeat(np.arange(len(prev)), size)
            coord = np.tile(np.arange(size, dtype=np.int64), len(prev))
            prev = prev[parent] * size + coord
        else:
            seg = np.asarray(segments, dtype=np.int64)
            idx = np.asarray(indices, dtype=np.int64)
            if len(prev) and (prev.max() + 1 >= len(seg)):
                raise ValueError("a CSR level has too few segments")
            starts, ends = seg[prev], seg[prev + 1]
            counts = ends - starts
            if (counts < 0).any() or (len(ends) and (ends.max() > len(idx))):
                raise ValueError("a CSR level's segments are out of order or out of range")
            parent = np.repeat(np.arange(len(prev)), counts)
            offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
            prev = np.repeat(starts, counts) + offsets
            coord = idx[prev]
        coords = [c[parent] for c in coords] + [coord]
    if len(prev) * itemsize != len(values):
        raise ValueError(f"{len(prev)} positions for {len(values) // max(itemsize, 1)} values")
    orig: list[Any] = [None] * n
    for i in range(n):
        orig[order[i]] = coords[i]
    for i in range(n, n + k):
        b = order[i] - n
        orig[block_map[b]] = orig[block_map[b]] * block_size[b] + coords[i]
    for d in range(n):
        if len(orig[d]) and (orig[d].min() < 0 or orig[d].max() >= shape[d]):
            raise ValueError(f"indices outside dimension {d} of {list(shape)}")
    out = np.zeros((dense_count, itemsize), dtype=np.uint8)
    if n and len(prev):
        out[np.ravel_multi_index(orig, shape)] = np.frombuffer(values, np.uint8).reshape(
            -1, itemsize)
    return out.tobytes()


def _numpy() -> Any:
    try:
        import numpy
    except ImportError as exc:
        raise MissingDependencyError("numpy", "densifying a sparse TFLite tensor",
                                     extra="slim") from exc
    return numpy


def constants(buf: mmap.mmap | bytes) -> list[Constant]:
    """The constant tensors of a flatbuffer, named as the inventory names them."""
    flat = _Flat(buf)
    try:
        return _parse(flat).tensors
    except _Corrupt as exc:
        raise ValueError(f"{exc.reason} (byte {exc.offset})") from exc


def read_path(path: str | Path) -> Inventory:
    """Read one ``.tflite`` file (for scripts; ``modelsize.formats.read`` is the usual way)."""
    return TfliteReader().read(Source.open(path))
