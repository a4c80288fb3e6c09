"""ONNX models (``.onnx``), external data files included, read with :mod:`._protobuf` only.

A model is one protobuf ``ModelProto``; its ``graph`` holds ``node`` s, ``initializer`` s
(``TensorProto``) and the graph's interface. Accounting:

* an initializer's data (``raw_data``, a packed typed field, or a range of an external data
  file) is a storage: floating and 8-bit types are ``weights``, wider integers and bools
  (shape constants, indices) are ``buffers``; ``Constant`` node tensors count the same way;
* nodes, the graph's inputs/outputs/value_info, functions and training graphs are ``graph``;
* everything else (version, opsets, producer, tensor names and dims) is ``metadata``;
* bytes of an external data file that no initializer points at are ``unused_storage``
  (alignment padding before a page-aligned tensor, as ``onnx.save`` writes, is metadata);
  two initializers pointing at the same external bytes count them once.

Only field headers are read (through a small block cache, not a memory map: see
:class:`._protobuf.FileBuffer`): a 2 GB ``raw_data`` costs one length prefix, never a
read. External ``location`` s must stay inside the model's folder.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

from modelsize.categories import Category
from modelsize.dtypes import DTYPES, numel
from modelsize.errors import CorruptFileError, printable
from modelsize.formats._protobuf import (
    I32,
    I64,
    LEN,
    VARINT,
    Buffer,
    Field,
    FileBuffer,
    ProtobufError,
    iter_fields,
    read_varint,
    signed64,
)
from modelsize.formats.base import Source
from modelsize.inventory import Inventory, InventoryBuilder

#: ``TensorProto.DataType`` -> canonical dtype names of :mod:`modelsize.dtypes`.
ONNX_DTYPES: dict[int, str] = {
    1: "float32", 2: "uint8", 3: "int8", 4: "uint16", 5: "int16", 6: "int32", 7: "int64",
    8: "string", 9: "bool", 10: "float16", 11: "float64", 12: "uint32", 13: "uint64",
    14: "complex64", 15: "complex128", 16: "bfloat16", 17: "float8_e4m3fn",
    18: "float8_e4m3fnuz", 19: "float8_e5m2", 20: "float8_e5m2fnuz", 21: "uint4", 22: "int4",
    23: "float4_e2m1fn", 24: "float8_e8m0fnu", 25: "uint2", 26: "int2", 27: "float6_e2m3fn",
    28: "float6_e3m2fn",
}
#: Packed sub-byte types: bits per element (ONNX packs them densely, rounding up to a byte).
_SUB_BYTE_BITS = {"uint4": 4, "int4": 4, "float4_e2m1fn": 4, "uint2": 2, "int2": 2}
_STRING = 8
_FLOAT, _DOUBLE, _COMPLEX64, _COMPLEX128 = 1, 11, 14, 15
#: Integer and bool initializers are shape constants, indices, masks: ``buffers``.
_BUFFER_DTYPES = frozenset({"int16", "uint16", "int32", "uint32", "int64", "uint64", "bool"})
_EXTERNAL = 1
_PAGE = 4096
_MAX_PADDING = 64 * 1024
MAX_GRAPH_DEPTH = 32

# Field numbers (onnx.proto).
_MODEL_GRAPH, _MODEL_TRAINING, _MODEL_FUNCTIONS = 7, 20, 25
_TYPED_FIELDS = frozenset({4, 5, 6, 7, 10, 11})
# ModelProto field -> wire type, for sniffing files without the .onnx extension.
_MODEL_FIELDS = {
    1: VARINT, 2: LEN, 3: LEN, 4: LEN, 5: VARINT, 6: LEN, 7: LEN, 8: LEN, 14: LEN, 20: LEN,
    25: LEN, 26: LEN,
}


@dataclass
class _Tensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    category: Category
    offset: int  # inline: byte range of the data in the model file; external: in its file
    nbytes: int
    encoded: bool = False  # varints, strings, sub-byte types: bytes charged whole, not per element
    location: str | None = None  # external data file, relative to the model's folder
    has_storage: bool = True


@dataclass
class _Model:
    graph_ranges: list[tuple[int, int]] = field(default_factory=list)
    tensors: list[_Tensor] = field(default_factory=list)
    #: Non-graph byte ranges inside graph fields (string tensors, scattered typed fields).
    data_regions: list[tuple[int, int, Category, str]] = field(default_factory=list)
    facts: dict[str, str] = field(default_factory=dict)


class OnnxReader:
    """Reads ``.onnx`` models and their external data without the ``onnx`` package."""

    name: str = "onnx"
    extensions: tuple[str, ...] = (".onnx",)

    def sniff(self, source: Source) -> bool:
        """``.onnx`` files, or a head that decodes as a ``ModelProto`` (protobuf has no magic)."""
        if source.kind != "file" or source.size == 0:
            return False
        return source.suffix == ".onnx" or _looks_like_model(source.head)

    def read(self, source: Source) -> Inventory:
        """Account for the model file and every external data file it names."""
        path = source.path
        size = path.stat().st_size
        if size == 0:
            raise CorruptFileError(path, self.name, "file is empty")
        with open(path, "rb") as fh:
            try:
                model = _Parser(FileBuffer(fh.fileno(), size), path).parse()
            except ProtobufError as exc:
                raise CorruptFileError(path, self.name, exc.reason, exc.offset) from exc
        externals, file_of = _external_files(path, model)
        builder = InventoryBuilder(self.name, [path, *externals], root=path)
        builder.facts.update(model.facts)
        _declare(builder, model, file_of)
        return builder.build(Category.METADATA)


def _looks_like_model(head: bytes) -> bool:
    """Whether ``head`` starts like a ``ModelProto``: ``ir_version`` first, then known fields."""
    try:
        key, pos = read_varint(head, 0, len(head))
        if key != (1 << 3 | VARINT):
            return False
        ir_version, pos = read_varint(head, pos, len(head))
        if not 3 <= ir_version <= 20:
            return False
        seen = 0
        while pos < len(head):
            key, pos = read_varint(head, pos, len(head))
            number, wire = key >> 3, key & 7
            if _MODEL_FIELDS.get(number) != wire:
                return False
            seen += 1
            if wire == VARINT:
                _, pos = read_varint(head, pos, len(head))
            else:
                length, pos = read_varint(head, pos, len(head))
                pos += length
        return seen >= 1
    except ProtobufError:
        return False


class _Parser:
    """Walks a ``ModelProto`` once, collecting graph ranges and tensor data locations."""

    def __init__(self, buf: Buffer, path: Path) -> None:
        self.buf = buf
        self.path = path
        self.model = _Model()
        self.anonymous = 0

    def parse(self) -> _Model:
        buf, model = self.buf, self.model
        known = False
        opsets: list[str] = []
        for f in iter_fields(buf, 0, len(buf)):
            if f.number == 1 and f.wire_type == VARINT:
                known = True
                model.facts["onnx.ir_version"] = str(f.value)
            elif f.number == 2 and f.wire_type == LEN:
                model.facts["onnx.producer"] = printable(_text(buf, f), 80)
            elif f.number == 3 and f.wire_type == LEN:
                model.facts["onnx.producer_version"] = printable(_text(buf, f), 40)
            elif f.number == 8 and f.wire_type == LEN:
                opsets.append(self._opset(f))
            elif f.number == _MODEL_GRAPH:
                _expect(f, LEN, "ModelProto.graph")
                known = True
                self.graph(f.data_start, f.end, 0, "")
            elif f.number == _MODEL_FUNCTIONS:
                _expect(f, LEN, "ModelProto.functions")
                model.graph_ranges.append((f.start, f.end))
                self.function(f)
            elif f.number == _MODEL_TRAINING:
                _expect(f, LEN, "ModelProto.training_info")
                model.graph_ranges.append((f.start, f.end))
                for g in iter_fields(buf, f.data_start, f.end):
                    if g.number in (1, 2):
                        _expect(g, LEN, "TrainingInfoProto graph")
                        self.graph(g.data_start, g.end, 1, "training/")
        if not known:
            raise ProtobufError("no ir_version or graph: this is not an ONNX ModelProto", 0)
        if opsets:
            model.facts["onnx.opset"] = ", ".join(opsets)
        return model

    def _opset(self, f: Field) -> str:
        domain, version = "ai.onnx", 0
        for g in iter_fields(self.buf, f.data_start, f.end):
            if g.number == 1 and g.wire_type == LEN and g.value:
                domain = printable(_text(self.buf, g), 60)
            elif g.number == 2 and g.wire_type == VARINT:
                version = signed64(g.value)
        return f"{domain} {version}"

    def graph(self, start: int, end: int, depth: int, scope: str) -> None:
        """A ``GraphProto``: nodes and interface -> graph, initializers -> tensors."""
        if depth > MAX_GRAPH_DEPTH:
            raise ProtobufError(f"subgraphs nested deeper than {MAX_GRAPH_DEPTH}", start)
        for f in iter_fields(self.buf, start, end):
            if f.number == 1:
                _expect(f, LEN, "GraphProto.node")
                self.model.graph_ranges.append((f.start, f.end))
                self.node(f, depth, scope)
            elif f.number in (11, 12, 13):
                _expect(f, LEN, "GraphProto input/output/value_info")
                self.model.graph_ranges.append((f.start, f.end))
            elif f.number == 5:
                _expect(f, LEN, "GraphProto.initializer")
                self.tensor(f.data_start, f.end, scope, None)
            elif f.number == 15:
                _expect(f, LEN, "GraphProto.sparse_initializer")
                self.sparse(f, scope, None)

    def function(self, f: Field) -> None:
        name = ""
        for g in iter_fields(self.buf, f.data_start, f.end):
            if g.number == 1 and g.wire_type == LEN:
                name = _text(self.buf, g)
            elif g.number == 7:
                _expect(g, LEN, "FunctionProto.node")
                self.node(g, 1, f"{name}/")

    def node(self, f: Field, depth: int, scope: str) -> None:
        """Tensors inside a node (``Constant`` values, attributes) and its subgraphs."""
        output = node_name = ""
        attributes: list[Field] = []
        for g in iter_fields(self.buf, f.data_start, f.end):
            if g.number == 2 and g.wire_type == LEN and not output:
                output = _text(self.buf, g)
            elif g.number == 3 and g.wire_type == LEN:
                node_name = _text(self.buf, g)
            elif g.number == 5:
                _expect(g, LEN, "NodeProto.attribute")
                attributes.append(g)
        base = scope + (output or node_name or "node")
        for attr in attributes:
            self.attribute(attr, depth, scope, base)

    def attribute(self, f: Field, depth: int, scope: str, base: str) -> None:
        attr_name = ""
        inner: list[Field] = []
        for g in iter_fields(self.buf, f.data_start, f.end):
            if g.number == 1 and g.wire_type == LEN:
                attr_name = _text(self.buf, g)
            elif g.number in (5, 6, 10, 11, 22, 23):
                _expect(g, LEN, "AttributeProto tensor/graph")
                inner.append(g)
        name = base if attr_name == "value" else f"{base}.{attr_name}"
        for i, g in enumerate(inner):
            label = name if len(inner) == 1 else f"{name}[{i}]"
            if g.number in (5, 10):
                self.tensor(g.data_start, g.end, "", label)
            elif g.number in (22, 23):
                self.sparse(g, "", label)
            else:
                self.graph(g.data_start, g.end, depth + 1, f"{label}/")

    def sparse(self, f: Field, scope: str, default_name: str | None) -> None:
        """A ``SparseTensorProto``: its values and indices both hold the weight's bytes."""
        parts: dict[int, Field] = {}
        for g in iter_fields(self.buf, f.data_start, f.end):
            if g.number in (1, 2):
                _expect(g, LEN, "SparseTensorProto values/indices")
                parts[g.number] = g
        if 1 not in parts:
            raise ProtobufError("sparse tensor without values", f.start)
        values, category = self.tensor(parts[1].data_start, parts[1].end, scope, default_name)
        if 2 in parts:
            self.tensor(parts[2].data_start, parts[2].end, "", f"{values}.indices",
                        category=category, force_name=True)

    def tensor(
        self,
        start: int,
        end: int,
        scope: str,
        default_name: str | None,
        *,
        category: Category | None = None,
        force_name: bool = False,
    ) -> tuple[str, Category]:
        """Record one ``TensorProto``; return its name and category."""
        buf = self.buf
        dims: list[int] = []
        data_type = 0
        name = ""
        raw: Field | None = None
        typed: list[Field] = []
        external: dict[str, str] = {}
        location = 0
        for f in iter_fields(buf, start, end):
            n = f.number
            if n == 1:
                if f.wire_type == LEN:
                    pos = f.data_start
                    while pos < f.end:
                        value, pos = read_varint(buf, pos, f.end)
                        dims.append(signed64(value))
                else:
                    _expect(f, VARINT, "TensorProto.dims")
                    dims.append(signed64(f.value))
            elif n == 2:
                _expect(f, VARINT, "TensorProto.data_type")
                data_type = f.value
            elif n == 8 and f.wire_type == LEN:
                name = _text(buf, f)
            elif n == 9:
                _expect(f, LEN, "TensorProto.raw_data")
                raw = f
            elif n in _TYPED_FIELDS:
                typed.append(f)
            elif n == 13:
                _expect(f, LEN, "TensorProto.external_data")
                ext_key, ext_value = self._entry(f)
                external[ext_key] = ext_value
            elif n == 14:
                _expect(f, VARINT, "TensorProto.data_location")
                location = f.value
        if force_name or not name:
            if default_name is None:
                self.anonymous += 1
                default_name = f"initializer_{self.anonymous}"
            name = default_name
        name = scope + name
        if any(d < 0 for d in dims):
            raise ProtobufError(f"tensor {printable(name)!r} has negative dims {dims}", start)
        dtype = ONNX_DTYPES.get(data_type)
        if dtype is None:
            raise ProtobufError(
                f"tensor {printable(name)!r} has unknown data_type {data_type}", start
            )
        shape = tuple(dims)
        if category is None:
            category = Category.BUFFERS if dtype in _BUFFER_DTYPES else Category.WEIGHTS
        expected = _expected_nbytes(dtype, shape)
        # Bytes whose element layout the dtype table cannot describe are charged whole.
        opaque = expected is None or dtype not in DTYPES

        if location == _EXTERNAL:
            self.model.tensors.append(self._external(name, dtype, shape, category, external,
                                                     expected, start))
        elif raw is not None:
            if expected is not None and raw.value != expected:
                raise ProtobufError(
                    f"tensor {printable(name)!r}: raw_data holds {raw.value} bytes but "
                    f"{dtype}{list(shape)} needs {expected}",
                    raw.start,
                )
            self.model.tensors.append(_Tensor(
                name, dtype, shape, category, raw.data_start, raw.value, encoded=opaque,
            ))
        elif typed:
            self._typed(name, dtype, data_type, shape, category, typed)
        else:
            self.model.tensors.append(
                _Tensor(name, dtype, shape, category, start, 0, has_storage=False)
            )
        return name, category

    def _typed(
        self, name: str, dtype: str, data_type: int, shape: tuple[int, ...], category: Category,
        typed: list[Field],
    ) -> None:
        """Values in typed repeated fields (``float_data``...): the fields' bytes are the data."""
        if data_type == _STRING:
            for f in typed:
                self.model.data_regions.append((f.start, f.end, Category.BUFFERS, name))
            return
        raw_layout = len(typed) == 1 and typed[0].wire_type == LEN and (
            (typed[0].number == 4 and data_type in (_FLOAT, _COMPLEX64))
            or (typed[0].number == 10 and data_type in (_DOUBLE, _COMPLEX128))
        )
        if raw_layout:
            f = typed[0]
            expected = _expected_nbytes(dtype, shape)
            if expected is not None and f.value != expected:
                raise ProtobufError(
                    f"tensor {printable(name)!r}: packed data holds {f.value} bytes but "
                    f"{dtype}{list(shape)} needs {expected}",
                    f.start,
                )
            self.model.tensors.append(_Tensor(name, dtype, shape, category, f.data_start, f.value))
            return
        contiguous = all(a.end == b.start for a, b in pairwise(typed))
        if contiguous:
            first, last = typed[0], typed[-1]
            self.model.tensors.append(_Tensor(
                name, dtype, shape, category, first.start, last.end - first.start, encoded=True,
            ))
            return
        for f in typed:
            self.model.data_regions.append((f.start, f.end, category, name))
        self.model.tensors.append(_Tensor(name, dtype, shape, category, typed[0].start, 0,
                                          has_storage=False))

    def _external(
        self, name: str, dtype: str, shape: tuple[int, ...], category: Category,
        entries: dict[str, str], expected: int | None, at: int,
    ) -> _Tensor:
        where = entries.get("location")
        if not where:
            raise ProtobufError(f"tensor {printable(name)!r} is external but has no location", at)
        try:
            offset = int(entries.get("offset", "0") or "0")
            length = int(entries["length"]) if entries.get("length") else -1
        except ValueError as exc:
            raise ProtobufError(
                f"tensor {printable(name)!r}: external offset/length are not integers "
                f"({printable(str(entries), 120)})",
                at,
            ) from exc
        if offset < 0:
            raise ProtobufError(f"tensor {printable(name)!r}: negative external offset", at)
        if length == -1:
            length = expected if expected is not None else -1
        if expected is not None and length != expected:
            raise ProtobufError(
                f"tensor {printable(name)!r}: external length {length} but "
                f"{dtype}{list(shape)} needs {expected}",
                at,
            )
        opaque = expected is None or dtype not in DTYPES
        return _Tensor(name, dtype, shape, category, offset, length, encoded=opaque,
                       location=where)

    def _entry(self, f: Field) -> tuple[str, str]:
        key = value = ""
        for g in iter_fields(self.buf, f.data_start, f.end):
            if g.number == 1 and g.wire_type == LEN:
                key = _text(self.buf, g)
            elif g.number == 2 and g.wire_type == LEN:
                value = _text(self.buf, g)
        return key, value


def _text(buf: Buffer, f: Field) -> str:
    try:
        return f.text(buf)
    except UnicodeDecodeError as exc:
        raise ProtobufError(f"field {f.number} is not valid UTF-8", f.start) from exc


def _expect(f: Field, wire_type: int, what: str) -> None:
    if f.wire_type != wire_type:
        names = {VARINT: "varint", LEN: "length-delimited", I32: "fixed32", I64: "fixed64"}
        raise ProtobufError(
            f"{what} should be {names[wire_type]}, found {names.get(f.wire_type, f.wire_type)}",
            f.start,
        )


def _expected_nbytes(dtype: str, shape: tuple[int, ...]) -> int | None:
    """Bytes the values of ``dtype[shape]`` take, or ``None`` when not fixed (strings...)."""
    if dtype in _SUB_BYTE_BITS:
        return -(-numel(shape) * _SUB_BYTE_BITS[dtype] // 8)
    dt = DTYPES.get(dtype)
    return dt.nbytes(numel(shape)) if dt else None


def _external_files(model_path: Path, model: _Model) -> tuple[list[Path], dict[str, int]]:
    """External data files in order of first use (each once), and the file index of each
    ``location``; every file is checked to lie inside the model's folder."""
    me = model_path.resolve()
    folder = me.parent
    files: list[Path] = []
    index_of_target: dict[Path, int] = {}
    file_of: dict[str, int] = {}
    for t in model.tensors:
        if t.location is None or t.location in file_of:
            continue
        rel = Path(t.location)
        target = (folder / rel).resolve()
        if rel.is_absolute() or not target.is_relative_to(folder) or target == me:
            raise CorruptFileError(
                model_path, "onnx",
                f"tensor {printable(t.name)!r} points at external data "
                f"{printable(t.location)!r} outside the model's folder (or the model itself)",
            )
        if not target.is_file():
            raise CorruptFileError(
                model_path, "onnx",
                f"tensor {printable(t.name)!r} needs external data file "
                f"{printable(t.location)!r}, which is missing (copy it beside the model)",
            )
        if target not in index_of_target:
            files.append(model_path.parent / rel)
            index_of_target[target] = len(files)  # file 0 is the model itself
        file_of[t.location] = index_of_target[target]
    return files, file_of


def _declare(builder: InventoryBuilder, model: _Model, file_of: dict[str, int]) -> None:
    inline = [t for t in model.tensors if t.location is None]
    claimed: list[tuple[int, int]] = []
    for t in inline:
        if not t.has_storage:
            builder.add_tensor(t.name, t.dtype, t.shape, t.category)
            continue
        key = f"{t.name}@{t.offset}"
        builder.add_storage(
            key, t.offset, t.nbytes, compressed=t.encoded, dtype=t.dtype,
            logical_nbytes=_expected_nbytes(t.dtype, t.shape) if t.encoded else None,
        )
        builder.add_tensor(t.name, t.dtype, t.shape, t.category, storage=key)
        claimed.append((t.offset, t.offset + t.nbytes))
    for start, end, category, label in model.data_regions:
        builder.add_region(start, end - start, category, printable(label, 80))
        claimed.append((start, end))
    for start, end in _subtract(_union(model.graph_ranges), _union(claimed)):
        builder.add_region(start, end - start, Category.GRAPH, "graph")

    by_file: dict[int, list[_Tensor]] = {}
    for t in model.tensors:
        if t.location is not None:
            by_file.setdefault(file_of[t.location], []).append(t)
    for file, tensors in by_file.items():
        _declare_external(builder, file, tensors)


def _declare_external(builder: InventoryBuilder, file: int, tensors: list[_Tensor]) -> None:
    """One storage per run of overlapping tensor ranges; unreferenced bytes are unused."""
    size = builder.files[file].nbytes
    fname = builder.files[file].path.name
    for t in tensors:
        if t.nbytes < 0:
            t.nbytes = size - t.offset
        builder.check_range(t.offset, t.nbytes, f"external data of {printable(t.name)!r}", file)
    clusters: list[tuple[int, int, list[_Tensor]]] = []
    for t in sorted(tensors, key=lambda t: (t.offset, t.nbytes)):
        end = t.offset + t.nbytes
        if clusters and t.offset < clusters[-1][1]:
            start, stop, members = clusters[-1]
            clusters[-1] = (start, max(stop, end), [*members, t])
        else:
            clusters.append((t.offset, end, [t]))
    pos = 0
    for start, stop, members in clusters:
        if start > pos:
            # onnx.save pads large tensors to a page boundary (at most 64 KiB of zeros).
            padding = start % _PAGE == 0 and start - pos < _MAX_PADDING
            builder.add_region(
                pos, start - pos, Category.METADATA if padding else Category.UNUSED_STORAGE,
                "alignment padding" if padding else "external data no tensor uses", file,
            )
        key = f"{fname}@{start}"
        encoded = any(m.encoded for m in members)
        builder.add_storage(key, start, stop - start, file=file, compressed=encoded,
                            dtype=members[0].dtype)
        for m in members:
            dt = DTYPES.get(m.dtype)
            element = max(1, dt.block_bytes // dt.block) if dt else 1
            builder.add_tensor(m.name, m.dtype, m.shape, m.category, storage=key,
                               storage_offset=(m.offset - start) // element,
                               tags=("external",))
        pos = max(pos, stop)
    if size > pos:
        builder.add_region(pos, size - pos, Category.UNUSED_STORAGE,
                           "external data no tensor uses", file)


def _union(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(r for r in ranges if r[1] > r[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _subtract(ranges: list[tuple[int, int]], holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``ranges`` minus ``holes``; both sorted and disjoint."""
    out: list[tuple[int, int]] = []
    i = 0
    for a, b in ranges:
        while i < len(holes) and holes[i][1] <= a:
            i += 1
        j = i
        pos = a
        while j < len(holes) and holes[j][0] < b:
            if holes[j][0] > pos:
                out.append((pos, holes[j][0]))
            pos = max(pos, holes[j][1])
            j += 1
        if pos < b:
            out.append((pos, b))
    return out
