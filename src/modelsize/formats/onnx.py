"""ONNX models (``.onnx``), external data files included, read with :mod:`._protobuf` only.

A model is one protobuf ``ModelProto``; its ``graph`` holds ``node`` s, ``initializer`` s
(``TensorProto``) and the graph's interface. Accounting:

* an initializer's data (``raw_data``, a packed typed field, or a range of an external data
  file) is a storage: floating and 8-bit types are ``weights``, wider integers and bools
  (shape constants, indices) are ``buffers``; ``Constant`` node tensors count the same way;
  an initializer no node input, graph output or subgraph reads is ``unused_storage``;
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

from collections.abc import Iterator
from enum import Enum
from itertools import pairwise
from pathlib import Path

from modelsize._records import field, record
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
    packed_varints,
    read_varint,
    signed64,
)
from modelsize.formats.base import Source, is_regular_file, real_path
from modelsize.inventory import Inventory, InventoryBuilder, StorageRecord

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
MODEL_GRAPH, MODEL_TRAINING, MODEL_FUNCTIONS = 7, 20, 25
_TYPED_FIELDS = frozenset({4, 5, 6, 7, 10, 11})
# ModelProto field -> wire type, for sniffing files without the .onnx extension.
_MODEL_FIELDS = {
    1: VARINT, 2: LEN, 3: LEN, 4: LEN, 5: VARINT, 6: LEN, 7: LEN, 8: LEN, 14: LEN, 20: LEN,
    25: LEN, 26: LEN,
}


@record
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


class TensorKind(str, Enum):
    """What a ``TensorProto`` is to its graph."""

    INITIALIZER = "initializer"
    SPARSE_VALUES = "sparse_values"
    SPARSE_INDICES = "sparse_indices"
    NODE_TENSOR = "node_tensor"
    """A node's attribute (``Constant`` values...)."""


class GraphKind(str, Enum):
    """What a :class:`GraphSite` is."""

    MAIN = "main"
    SUBGRAPH = "subgraph"
    """A node's attribute (``If`` branches, ``Loop`` and ``Scan`` bodies)."""
    TRAINING = "training"
    FUNCTION = "function"
    """The body of a model-local function."""


@record(eq=False)
class GraphSite:
    """One graph of the model (or a function's body), as ``slim`` needs to rewrite it.

    ``start``/``end`` is the payload of the message; names are the graph's own (not scoped).
    A graph sees the names its ``parent`` sees, except those it defines itself.
    """

    start: int
    end: int
    kind: GraphKind
    scope: str
    parent: GraphSite | None
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    initializers: list[str] = field(default_factory=list)
    nodes: list[NodeSite] = field(default_factory=list)
    #: Bytes of the ``doc_string`` and ``metadata_props`` fields of the graph and of its
    #: inputs, outputs and value_info (what slim's ``debug-info`` pass clears).
    debug: int = 0

    @property
    def depth(self) -> int:
        """How many graphs enclose this one."""
        return 0 if self.parent is None else self.parent.depth + 1

    def defines(self) -> set[str]:
        """Names this graph gives values to: inputs, initializers, node outputs."""
        out = {*self.inputs, *self.initializers}
        for node in self.nodes:
            out.update(node.outputs)
        out.discard("")
        return out

    def uses(self) -> set[str]:
        """Names read here or in a nested subgraph and not bound there: node inputs, graph
        outputs, and what subgraphs read that is not their input or a node output.

        A subgraph's initializer does not hide an enclosing value of the same name: runtimes
        disagree on which one such a name reads (onnxruntime and onnx's reference evaluator
        differ), so both count as read.
        """
        out = set(self.outputs)
        for node in self.nodes:
            out.update(node.inputs)
            for sub in node.subgraphs:
                bound = set(sub.inputs)
                for inner in sub.nodes:
                    bound.update(inner.outputs)
                out |= sub.uses() - bound
        out.discard("")
        return out

    def encloses(self, other: GraphSite) -> bool:
        """Whether ``other`` is this graph or nested (at any depth) inside it."""
        g: GraphSite | None = other
        while g is not None:
            if g is self:
                return True
            g = g.parent
        return False


@record(eq=False)
class NodeSite:
    """One ``NodeProto``: payload range, operator, the names it reads and writes."""

    start: int
    end: int
    graph: GraphSite
    op_type: str = ""
    domain: str = ""
    name: str = ""
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    subgraphs: list[GraphSite] = field(default_factory=list)
    #: Bytes of its ``doc_string`` and ``metadata_props`` fields.
    debug: int = 0
    #: Its scalar attributes (``epsilon``, ``training_mode``, ``transB``...).
    attrs: dict[str, float] = field(default_factory=dict)


@record(eq=False)
class TensorSite:
    """One ``TensorProto`` with a storage or not: the inventory's name for it, the name it has
    in its graph (``bare``: the initializer's name, or the output of the node holding it),
    what it is, where its payload is, and the attribute holding it (node tensors)."""

    name: str
    bare: str
    kind: TensorKind
    start: int
    end: int
    graph: GraphSite
    node: NodeSite | None = None
    attribute: str = ""
    #: Whether the name is the ``TensorProto``'s own (else it comes from the node).
    own_name: bool = True
    index: int = -1
    #: An initializer no node, graph output or subgraph reads.
    unused: bool = False
    dims: tuple[int, ...] = ()
    #: ``TensorProto.DataType``.
    data_type: int = 0
    #: Its data lives in an external file.
    external: bool = False


@record
class Structure:
    """The graphs, nodes and tensors of a model by the offset of their payload."""

    graphs: dict[int, GraphSite] = field(default_factory=dict)
    nodes: dict[int, NodeSite] = field(default_factory=dict)
    tensors: dict[int, TensorSite] = field(default_factory=dict)
    #: ``{domain: version}`` of ``opset_import`` (``""`` is the default domain).
    opsets: dict[str, int] = field(default_factory=dict)
    ir_version: int = 0
    #: Names the training graphs bind (``initialization_binding``, ``update_binding``).
    bindings: set[str] = field(default_factory=set)


@record
class _Model:
    graph_ranges: list[tuple[int, int]] = field(default_factory=list)
    tensors: list[_Tensor] = field(default_factory=list)
    #: Non-graph byte ranges inside graph fields (string tensors, scattered typed fields).
    data_regions: list[tuple[int, int, Category, str]] = field(default_factory=list)
    facts: dict[str, str] = field(default_factory=dict)
    structure: Structure = field(default_factory=Structure)


def _entry_size(dtype: str, number: int) -> int:
    """Bytes of one value of typed field ``number`` for ``dtype`` (sub-byte types hold one
    packed byte per ``int32_data`` entry)."""
    dt = DTYPES[dtype]
    if number in (7, 10) or (number == 11 and dtype == "uint64"):
        return 8
    if number in (4, 11) or dtype == "int32":
        return 4
    if dt.block != 1 and dt.block_bytes != 1:
        raise ValueError(f"{dtype} values in int32_data cannot be decoded")
    return dt.block_bytes if dt.block == 1 else 1


_DECODE_CHUNK = 1 << 20


def storage_chunks(inv: Inventory, storage: StorageRecord) -> Iterator[bytes]:
    """The little-endian bytes of an encoded storage, a chunk at a time: the values of typed
    fields (``float_data``, ``int32_data`` varints...) as ``raw_data`` would hold them, or an
    external range whose dtype has no fixed layout, as it is."""
    path = inv.files[storage.file].path
    with open(path, "rb") as fh:
        if storage.file != 0 or storage.dtype is None or storage.dtype not in DTYPES:
            fh.seek(storage.offset)
            left = storage.nbytes
            while left:
                data = fh.read(min(left, _DECODE_CHUNK))
                if not data:
                    raise ValueError(f"{path}: storage {storage.key} ends early")
                left -= len(data)
                yield data
            return
        buf = FileBuffer(fh.fileno(), path.stat().st_size)
        out = bytearray()
        try:
            for f in iter_fields(buf, storage.offset, storage.offset + storage.nbytes):
                size = _entry_size(storage.dtype, f.number)
                mask = (1 << (8 * size)) - 1
                if f.wire_type == VARINT:
                    out += (f.value & mask).to_bytes(size, "little")
                elif f.wire_type in (I32, I64):
                    out += f.value.to_bytes(size, "little")
                elif f.number in (4, 10):  # packed fixed32/fixed64: already the raw bytes
                    for pos in range(f.data_start, f.end, _DECODE_CHUNK):
                        out += buf[pos : min(f.end, pos + _DECODE_CHUNK)]
                        if len(out) >= _DECODE_CHUNK:
                            yield bytes(out)
                            out.clear()
                else:
                    carry = b""
                    for pos in range(f.data_start, f.end, _DECODE_CHUNK):
                        data = carry + buf[pos : min(f.end, pos + _DECODE_CHUNK)]
                        whole = len(data)
                        while whole and data[whole - 1] & 0x80:
                            whole -= 1
                        carry = data[whole:]
                        for value in packed_varints(data, 0, whole):
                            out += (value & mask).to_bytes(size, "little")
                        if len(out) >= _DECODE_CHUNK:
                            yield bytes(out)
                            out.clear()
                    if carry:
                        raise ProtobufError("packed varints end inside a value", f.end)
                if len(out) >= _DECODE_CHUNK:
                    yield bytes(out)
                    out.clear()
        except ProtobufError as exc:
            raise CorruptFileError(path, "onnx", exc.reason, exc.offset) from exc
        if out:
            yield bytes(out)


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
        model = _parse(path)
        externals, file_of = _external_files(path, model)
        from modelsize.formats._onnx_savings import graph_savings

        builder = InventoryBuilder(self.name, [path, *externals], root=path)
        builder.facts.update(model.facts)
        builder.facts.update(graph_savings(model.structure).facts())
        _declare(builder, model, file_of)
        return builder.build(Category.METADATA)

    storage_chunks = staticmethod(storage_chunks)


def _parse(path: Path) -> _Model:
    size = path.stat().st_size
    if size == 0:
        raise CorruptFileError(path, OnnxReader.name, "file is empty")
    with open(path, "rb") as fh:
        try:
            return _Parser(FileBuffer(fh.fileno(), size), path).parse()
        except ProtobufError as exc:
            raise CorruptFileError(path, OnnxReader.name, exc.reason, exc.offset) from exc


def read_structure(path: Path) -> Structure:
    """The graphs, nodes and tensors of the model at ``path``, by payload offset (what
    ``slim`` rewrites), named as :class:`OnnxReader` names them."""
    return _parse(path).structure


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


#: Where a tensor sits: (kind, graph, node, attribute name).
_SiteOf = tuple[TensorKind, GraphSite, "NodeSite | None", str]


class _Parser:
    """Walks a ``ModelProto`` once, collecting graph ranges and tensor data locations."""

    def __init__(self, buf: Buffer, path: Path) -> None:
        self.buf = buf
        self.path = path
        self.model = _Model()
        self.anonymous = 0
        self.names: set[str] = set()

    def parse(self) -> _Model:
        buf, model = self.buf, self.model
        structure = model.structure
        known = False
        opsets: list[str] = []
        main: GraphSite | None = None
        training: list[GraphSite] = []
        for f in iter_fields(buf, 0, len(buf)):
            if f.number == 1 and f.wire_type == VARINT:
                known = True
                if f.value == 0:  # the checker: "does not have an ir_version set properly"
                    raise ProtobufError("ir_version 0: ONNX IR versions start at 1", f.start)
                model.facts["onnx.ir_version"] = str(f.value)
                structure.ir_version = f.value
            elif f.number == 2 and f.wire_type == LEN:
                model.facts["onnx.producer"] = printable(_text(buf, f), 80)
            elif f.number == 3 and f.wire_type == LEN:
                model.facts["onnx.producer_version"] = printable(_text(buf, f), 40)
            elif f.number == 14 and f.wire_type == LEN:
                _check_message(buf, f.data_start, f.end, "StringStringEntryProto")
            elif f.number == 26 and f.wire_type == LEN:  # configuration
                _check_message(buf, f.data_start, f.end, "DeviceConfigurationProto")
            elif f.number == 8 and f.wire_type == LEN:
                opsets.append(self._opset(f))
            elif f.number == MODEL_GRAPH:
                _expect(f, LEN, "ModelProto.graph")
                known = True
                main = self.graph(f.data_start, f.end, 0, "", None, GraphKind.MAIN)
            elif f.number == MODEL_FUNCTIONS:
                _expect(f, LEN, "ModelProto.functions")
                model.graph_ranges.append((f.start, f.end))
                self.function(f)
            elif f.number == MODEL_TRAINING:
                _expect(f, LEN, "ModelProto.training_info")
                model.graph_ranges.append((f.start, f.end))
                for g in iter_fields(buf, f.data_start, f.end):
                    if g.number in (1, 2):
                        _expect(g, LEN, "TrainingInfoProto graph")
                        training.append(self.graph(g.data_start, g.end, 1, "training/", None,
                                                   GraphKind.TRAINING))
                    elif g.number in (3, 4) and g.wire_type == LEN:
                        structure.bindings.update(self._entry(g))
        if not known:
            raise ProtobufError("no ir_version or graph: this is not an ONNX ModelProto", 0)
        if opsets:
            model.facts["onnx.opset"] = ", ".join(opsets)
        if main is None:
            model.facts.setdefault(UNLOADABLE_FACT, "the model has no graph (onnxruntime: 'No "
                                   "graph was found in the protobuf')")
        for site in training:  # training graphs read the model's initializers
            site.parent = main
        self._mark_unused()
        return model

    def _opset(self, f: Field) -> str:
        domain, version = "", 0
        for g in iter_fields(self.buf, f.data_start, f.end):
            if g.number == 1 and g.wire_type == LEN:
                domain = _text(self.buf, g)
            elif g.number == 2 and g.wire_type == VARINT:
                version = signed64(g.value)
        self.model.structure.opsets[domain] = version
        return f"{printable(domain, 60) or 'ai.onnx'} {version}"

    def graph(self, start: int, end: int, depth: int, scope: str, parent: GraphSite | None,
              kind: GraphKind) -> GraphSite:
        """A ``GraphProto``: nodes and interface -> graph, initializers -> tensors."""
        if depth > MAX_GRAPH_DEPTH:
            raise ProtobufError(f"subgraphs nested deeper than {MAX_GRAPH_DEPTH}", start)
        site = GraphSite(start, end, kind, scope, parent)
        self.model.structure.graphs[start] = site
        named: set[str] = set()
        for f in iter_fields(self.buf, start, end):
            if f.number == 1:
                _expect(f, LEN, "GraphProto.node")
                self.model.graph_ranges.append((f.start, f.end))
                site.nodes.append(self.node(f, depth, scope, site))
                node = site.nodes[-1]
                name = node.name
                if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
                    continue  # onnxruntime makes Constant nodes initializers before it looks
                if name and name in named and kind is GraphKind.MAIN:
                    self.model.facts.setdefault(
                        UNLOADABLE_FACT, f"two nodes are named {printable(name, 80)!r} "
                        "(onnxruntime: 'two nodes with same node name')")
                named.add(name)
            elif f.number in (11, 12, 13):
                _expect(f, LEN, "GraphProto input/output/value_info")
                self.model.graph_ranges.append((f.start, f.end))
                name, debug, untyped = self._value_info(f)
                site.debug += debug
                if f.number != 13:
                    (site.inputs if f.number == 11 else site.outputs).append(name)
                    if untyped is not None and kind is GraphKind.MAIN:
                        self.model.facts.setdefault(
                            UNLOADABLE_FACT, f"graph {'input' if f.number == 11 else 'output'} "
                            f"{printable(name, 80)!r} is a tensor of element type {untyped}, "
                            "which ONNX does not define (onnxruntime: 'Invalid tensor data "
                            f"type {untyped}')")
            elif f.number in (10, 16):  # doc_string, metadata_props
                site.debug += f.nbytes
                if f.number == 16 and f.wire_type == LEN:
                    _check_message(self.buf, f.data_start, f.end, "StringStringEntryProto")
            elif f.number == 14 and f.wire_type == LEN:  # quantization_annotation
                _check_message(self.buf, f.data_start, f.end, "TensorAnnotation")
            elif f.number == 5:
                _expect(f, LEN, "GraphProto.initializer")
                name, _ = self.tensor(f.data_start, f.end, scope, None,
                                      site=(TensorKind.INITIALIZER, site, None, ""))
                site.initializers.append(name[len(scope):])
            elif f.number == 15:
                _expect(f, LEN, "GraphProto.sparse_initializer")
                name = self.sparse(f, scope, None, (TensorKind.SPARSE_VALUES, site, None, ""))
                site.initializers.append(name[len(scope):])
        return site

    def _value_info(self, f: Field) -> tuple[str, int, int | None]:
        """The name of a ``ValueInfoProto``, the bytes of its doc_string and metadata_props,
        and, where its type is a tensor of an element type ONNX does not define (0, UNDEFINED
        or none, or past the last: the checker lets it pass, onnxruntime refuses the model:
        "Invalid tensor data type N"), that type; its type is checked to parse."""
        name, debug, untyped = "", 0, None
        for g in iter_fields(self.buf, f.data_start, f.end):
            if g.number == 1 and g.wire_type == LEN:
                name = _text(self.buf, g)
            elif g.number == 2 and g.wire_type == LEN:
                _check_message(self.buf, g.data_start, g.end, "TypeProto")
                untyped = _untyped_tensor(self.buf, g.data_start, g.end)
            elif g.number in (3, 4):
                debug += g.nbytes
                if g.number == 4 and g.wire_type == LEN:
                    _check_message(self.buf, g.data_start, g.end, "StringStringEntryProto")
        return name, debug, untyped

    def function(self, f: Field) -> None:
        name = ""
        site = GraphSite(f.data_start, f.end, GraphKind.FUNCTION, "", None)
        self.model.structure.graphs[f.data_start] = site
        for g in iter_fields(self.buf, f.data_start, f.end):
            if g.number == 1 and g.wire_type == LEN:
                name = _text(self.buf, g)
                site.scope = f"{name}/"
            elif g.number in (4, 5) and g.wire_type == LEN:
                (site.inputs if g.number == 4 else site.outputs).append(_text(self.buf, g))
            elif g.number == 7:
                _expect(g, LEN, "FunctionProto.node")
                site.nodes.append(self.node(g, 1, f"{name}/", site))

    def node(self, f: Field, depth: int, scope: str, graph: GraphSite) -> NodeSite:
        """Tensors inside a node (``Constant`` values, attributes) and its subgraphs."""
        site = NodeSite(f.data_start, f.end, graph)
        self.model.structure.nodes[f.data_start] = site
        node_name = ""
        attributes: list[Field] = []
        for g in iter_fields(self.buf, f.data_start, f.end):
            if g.number == 1 and g.wire_type == LEN:
                site.inputs.append(_text(self.buf, g))
            elif g.number == 2 and g.wire_type == LEN:
                site.outputs.append(_text(self.buf, g))
            elif g.number == 3 and g.wire_type == LEN:
                node_name = site.name = _text(self.buf, g)
            elif g.number == 4 and g.wire_type == LEN:
                site.op_type = _text(self.buf, g)
            elif g.number == 7 and g.wire_type == LEN:
                site.domain = _text(self.buf, g)
            elif g.number in (6, 9):  # doc_string, metadata_props
                site.debug += g.nbytes
                if g.number == 9 and g.wire_type == LEN:
                    _check_message(self.buf, g.data_start, g.end, "StringStringEntryProto")
            elif g.number == 10 and g.wire_type == LEN:  # device_configurations
                _check_message(self.buf, g.data_start, g.end, "NodeDeviceConfigurationProto")
            elif g.number == 5:
                _expect(g, LEN, "NodeProto.attribute")
                attributes.append(g)
        output = next((o for o in site.outputs if o), "")
        base = scope + (output or node_name or "node")
        for attr in attributes:
            self.attribute(attr, depth, scope, base, site)
        return site

    def attribute(self, f: Field, depth: int, scope: str, base: str, node: NodeSite) -> None:
        attr_name = ""
        inner: list[Field] = []
        scalar: float | None = None
        for g in iter_fields(self.buf, f.data_start, f.end):
            if g.number == 1 and g.wire_type == LEN:
                attr_name = _text(self.buf, g)
            elif g.number == 2 and g.wire_type == I32:
                scalar = g.as_float()
            elif g.number == 3 and g.wire_type == VARINT:
                scalar = g.as_int64()
            elif g.number in (5, 6, 10, 11, 22, 23):
                _expect(g, LEN, "AttributeProto tensor/graph")
                inner.append(g)
        if scalar is not None:
            node.attrs[attr_name] = scalar
        name = base if attr_name == "value" else f"{base}.{attr_name}"
        site = (TensorKind.NODE_TENSOR, node.graph, node, attr_name)
        for i, g in enumerate(inner):
            label = name if len(inner) == 1 else f"{name}[{i}]"
            if g.number in (5, 10):
                # A tensor's own name is scoped like an initializer's: exporters give the
                # Constant values of both branches of an If the same name (silero-vad).
                self.tensor(g.data_start, g.end, scope, label[len(scope):], site=site)
            elif g.number in (22, 23):
                self.sparse(g, scope, label[len(scope):], site)
            else:
                node.subgraphs.append(self.graph(g.data_start, g.end, depth + 1, f"{label}/",
                                                 node.graph, GraphKind.SUBGRAPH))

    def sparse(self, f: Field, scope: str, default_name: str | None, site: _SiteOf) -> str:
        """A ``SparseTensorProto``: its values and indices both hold the weight's bytes.
        Returns the name of its values."""
        parts: dict[int, Field] = {}
        for g in iter_fields(self.buf, f.data_start, f.end):
            if g.number in (1, 2):
                _expect(g, LEN, "SparseTensorProto values/indices")
                parts[g.number] = g
        if 1 not in parts:
            raise ProtobufError("sparse tensor without values", f.start)
        values, category = self.tensor(parts[1].data_start, parts[1].end, scope, default_name,
                                       site=site)
        if 2 in parts:
            kind = TensorKind.SPARSE_INDICES if site[0] == TensorKind.SPARSE_VALUES else site[0]
            self.tensor(parts[2].data_start, parts[2].end, "", f"{values}.indices",
                        category=category, force_name=True, site=(kind, *site[1:]))
        return values

    def _mark_unused(self) -> None:
        """Initializers no node, graph output or subgraph reads are ``unused_storage``
        (names a training graph binds or reads count as read)."""
        structure, model = self.model.structure, self.model
        free_in_training = set().union(*(g.uses() - g.defines() for g in structure.graphs.values()
                                         if g.kind == GraphKind.TRAINING))
        used: dict[int, set[str]] = {}
        unused: list[TensorSite] = []
        for site in structure.tensors.values():
            if site.kind == TensorKind.NODE_TENSOR:
                continue
            g = site.graph
            names = used.get(id(g))
            if names is None:
                names = used[id(g)] = g.uses()
                if g.kind == GraphKind.MAIN:
                    names |= free_in_training | structure.bindings
            if site.bare not in names:
                unused.append(site)
        spans: list[tuple[int, int]] = []
        for site in unused:
            site.unused = True
            if site.index >= 0:
                model.tensors[site.index].category = Category.UNUSED_STORAGE
            spans.append((site.start, site.end))
        if spans and model.data_regions:
            model.data_regions = [
                (a, b, Category.UNUSED_STORAGE if any(s <= a and b <= e for s, e in spans)
                 else cat, label)
                for a, b, cat, label in model.data_regions
            ]

    def tensor(
        self,
        start: int,
        end: int,
        scope: str,
        default_name: str | None,
        *,
        category: Category | None = None,
        force_name: bool = False,
        site: _SiteOf | None = None,
    ) -> tuple[str, Category]:
        """Record one ``TensorProto``; return its name and category."""
        before = len(self.model.tensors)
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
        own_name = not force_name and bool(name)
        if own_name and default_name is not None and scope + name in self.names:
            own_name = False  # a name already taken: a node's value is named after its node
        if not own_name:
            if default_name is None:
                self.anonymous += 1
                default_name = f"initializer_{self.anonymous}"
            name = default_name
        bare = name
        name = scope + name
        self.names.add(name)
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
            if numel(shape):  # the checker: "should contain one and only one value field"
                raise ProtobufError(
                    f"tensor {printable(name)!r} ({dtype}{list(shape)}) holds no data"
                    + (f" (external_data without data_location EXTERNAL, {location})"
                       if external else ""), start)
            self.model.tensors.append(
                _Tensor(name, dtype, shape, category, start, 0, has_storage=False)
            )
        if site is not None:
            kind, graph, node, attribute = site
            if node is not None:
                bare = next((o for o in node.outputs if o), "")
            index = before if len(self.model.tensors) > before else -1
            self.model.structure.tensors[start] = TensorSite(
                name, bare, kind, start, end, graph, node, attribute, own_name, index,
                dims=shape, data_type=data_type, external=location == _EXTERNAL)
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


#: The messages under a ``TypeProto``, and ``metadata_props`` entries (field number -> message,
#: for the fields that are messages): protobuf parses them when it loads the model, so one
#: that does not parse makes the whole file unloadable, though modelsize needs nothing from it.
_TYPE_MESSAGES: dict[str, dict[int, str]] = {
    "TypeProto": {1: "Tensor", 4: "Sequence", 5: "Map", 7: "Opaque", 8: "Tensor",
                  9: "Sequence"},
    "Tensor": {2: "TensorShapeProto"},
    "Sequence": {1: "TypeProto"},
    "Map": {2: "TypeProto"},
    "TensorShapeProto": {1: "Dimension"},
    "Dimension": {},
    "Opaque": {},
    "StringStringEntryProto": {},
    # ONNX 1.18's sharding annotations (onnx.proto: NodeProto.device_configurations,
    # ModelProto.configuration) and GraphProto.quantization_annotation.
    "NodeDeviceConfigurationProto": {2: "ShardingSpecProto"},
    "ShardingSpecProto": {3: "IntIntListEntryProto", 4: "ShardedDimProto"},
    "IntIntListEntryProto": {},
    "ShardedDimProto": {2: "SimpleShardedDimProto"},
    "SimpleShardedDimProto": {},
    "DeviceConfigurationProto": {},
    "TensorAnnotation": {2: "StringStringEntryProto"},
}


def _check_message(buf: Buffer, start: int, end: int, kind: str, depth: int = 0) -> None:
    """Raise :class:`ProtobufError` unless ``buf[start:end]`` parses as the message ``kind``
    of :data:`_TYPE_MESSAGES` (with every message inside it)."""
    if depth > MAX_GRAPH_DEPTH:
        raise ProtobufError(f"types nested deeper than {MAX_GRAPH_DEPTH}", start)
    inner = _TYPE_MESSAGES[kind]
    for f in iter_fields(buf, start, end):
        sub = inner.get(f.number)
        if sub is not None and f.wire_type == LEN:
            _check_message(buf, f.data_start, f.end, sub, depth + 1)


#: The fact saying why onnxruntime would not load a model the checker and modelsize read: no
#: main graph, or a main-graph input or output typed as a tensor of no element type.
UNLOADABLE_FACT = "onnx.unloadable"


def _untyped_tensor(buf: Buffer, start: int, end: int) -> int | None:
    """The ``elem_type`` of the tensor type (dense or sparse) in the ``TypeProto`` in
    ``buf[start:end]`` where ONNX defines no such type (0 or absent, or unknown); else None."""
    for f in iter_fields(buf, start, end):
        if f.number in (1, 8) and f.wire_type == LEN:
            elem = 0
            for g in iter_fields(buf, f.data_start, f.end):
                if g.number == 1 and g.wire_type == VARINT:
                    elem = g.value
            return None if elem in ONNX_DTYPES else elem
    return None


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
    me = real_path(model_path)
    folder = me.parent
    files: list[Path] = []
    index_of_target: dict[Path, int] = {}
    file_of: dict[str, int] = {}
    for t in model.tensors:
        if t.location is None or t.location in file_of:
            continue
        rel = Path(t.location)
        target = real_path(folder / rel, must_exist=False)
        if rel.is_absolute() or not target.is_relative_to(folder) or target == me:
            raise CorruptFileError(
                model_path, "onnx",
                f"tensor {printable(t.name)!r} points at external data "
                f"{printable(t.location)!r} outside the model's folder (or the model itself)",
            )
        if not is_regular_file(target):
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
