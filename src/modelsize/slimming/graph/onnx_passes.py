"""Graph passes on an ONNX ``ModelProto``, each measured and kept only when it helps.

Every pass works on a copy of the model; the copy replaces the model only when the pass
changed something and the model's bytes (the protobuf plus its external data) did not grow.
Constant folding also decides node by node: a node is folded only when its result needs no
more bytes than the constants it alone reads (folding that materialises a broadcast is how
other simplifiers made models several times larger).

The exact passes (:data:`EXACT`) compute the same function up to float rounding:

* ``debug-info``: ``doc_string`` and ``metadata_props`` of nodes, graphs and their inputs,
  outputs and value_info (the dynamo exporter's stack traces, FX nodes and name scopes:
  about 1 KB a node); the model's own ``metadata_props`` and ``doc_string`` are kept;
* ``identity``: ``y = Identity(x)`` removed, readers of ``y`` read ``x``;
* ``fold-batchnorm``: an inference ``BatchNormalization`` whose input is the only use of a
  ``Conv`` or ``Gemm`` output with constant weights is folded into their weights and bias;
* ``constant-folding``: a node whose inputs are all constants becomes an initializer
  (evaluated by ``onnx.reference`` under the model's own opsets);
* ``dead-nodes``: nodes no output, node or subgraph reads;
* ``unused-initializers``: initializers nothing reads (with their graph input and value_info);
* ``initializer-value-info``: ``value_info`` entries that repeat the type and shape of a
  top-level initializer, which declares both itself (the dynamo exporter writes one for every
  weight);
* ``duplicate-initializers``: initializers with the same dtype, shape and bytes stored once,
  readers renamed (no ``Identity`` node: it would cost bytes for small tensors).

The approximate ones run only when asked: ``cast-float16`` (float32 initializers stored as
float16 behind a ``Cast`` back to float32, so inputs, outputs and every node keep float32),
``quantize-int8`` (weight-only, per-output-channel symmetric int8 behind a
``DequantizeLinear``; ``Gather`` tables, embeddings, one scale a row) and
``quantize-dynamic`` (onnxruntime's ``quantize_dynamic``, int8
weights and dynamically quantized activations).

Tensors stored as external data are handled by their location: a pass that needs their values
(folding, casting) reads them through ``onnx.numpy_helper``; the others never read them.
Passes rewrite the top-level graph; names read inside subgraphs are respected everywhere.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from modelsize.slimming.writers._protowire import bytes_field

#: Ops never folded: nondeterministic, or with effects the graph relies on.
_NO_FOLD = frozenset({
    "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial",
    "Bernoulli", "Dropout", "If", "Loop", "Scan", "SequenceConstruct", "Optional",
})
#: A Cast or DequantizeLinear node costs about this many bytes; smaller savings are skipped.
_NODE_COST = 96
#: Tensors this small stay inline in an external-data output.
EXTERNAL_MIN = 1024


class PassName(str, Enum):
    """Every graph pass, by the name the report uses."""

    DEBUG_INFO = "debug-info"
    IDENTITY = "identity"
    FOLD_BATCHNORM = "fold-batchnorm"
    CONSTANT_FOLDING = "constant-folding"
    DEAD_NODES = "dead-nodes"
    UNUSED_INITIALIZERS = "unused-initializers"
    INITIALIZER_VALUE_INFO = "initializer-value-info"
    DUPLICATE_INITIALIZERS = "duplicate-initializers"
    CAST_FLOAT16 = "cast-float16"
    QUANTIZE_INT8 = "quantize-int8"
    QUANTIZE_DYNAMIC = "quantize-dynamic"

    def __str__(self) -> str:
        return self.value


#: Passes that only delete nodes or initializers (run in place: nothing to measure against).
_ONLY_REMOVE = frozenset({PassName.DEBUG_INFO, PassName.DEAD_NODES,
                          PassName.UNUSED_INITIALIZERS, PassName.INITIALIZER_VALUE_INFO})
#: The passes that apply with no option, in order.
EXACT: tuple[PassName, ...] = (
    PassName.DEBUG_INFO, PassName.IDENTITY, PassName.FOLD_BATCHNORM, PassName.CONSTANT_FOLDING,
    PassName.DEAD_NODES, PassName.UNUSED_INITIALIZERS, PassName.INITIALIZER_VALUE_INFO,
    PassName.DUPLICATE_INITIALIZERS,
)
#: Approximate passes: they change values.
APPROXIMATE = frozenset({PassName.CAST_FLOAT16, PassName.QUANTIZE_INT8,
                         PassName.QUANTIZE_DYNAMIC})


@dataclass(frozen=True)
class PassResult:
    """What one pass did: how many changes, the model's bytes before and after, and whether
    it was kept (``applied``) or skipped (nothing to do, or the model would have grown)."""

    name: PassName
    changes: int
    bytes_before: int
    bytes_after: int
    applied: bool
    note: str = ""

    @property
    def saved_bytes(self) -> int:
        """Bytes the pass saves (0 when skipped)."""
        return self.bytes_before - self.bytes_after if self.applied else 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"name": self.name.value, "changes": self.changes,
                "bytes_before": self.bytes_before, "bytes_after": self.bytes_after,
                "applied": self.applied, "saved_bytes": self.saved_bytes, "note": self.note}


# -- sizes and names ---------------------------------------------------------------------
def external_info(t: onnx.TensorProto) -> dict[str, str] | None:
    if t.data_location != onnx.TensorProto.EXTERNAL:
        return None
    return {e.key: e.value for e in t.external_data}


def _vlen(n: int) -> int:
    """Bytes of ``n`` as a protobuf varint."""
    return max(1, (n.bit_length() + 6) // 7)


def copy_except(src: Any, dst: Any, *skip: str) -> Any:
    """``dst`` with every field of ``src`` set but those named in ``skip`` (never copied)."""
    for fd, value in src.ListFields():
        if fd.name in skip:
            continue
        if hasattr(value, "extend"):
            getattr(dst, fd.name).extend(value)
        elif hasattr(value, "CopyFrom"):
            getattr(dst, fd.name).CopyFrom(value)
        elif isinstance(value, bytes) and fd.type == fd.TYPE_STRING:
            # A proto2 string that is not UTF-8 (protobuf reads it as bytes and keeps it;
            # setattr refuses it): merged as the field's own wire bytes.
            dst.MergeFromString(bytes_field(fd.number, value))
        else:
            setattr(dst, fd.name, value)
    return dst



def field_bytes(n: int) -> int:
    """Bytes of a length-delimited field of ``n`` bytes with a one-byte tag."""
    return 1 + _vlen(n) + n


def model_bytes(model: onnx.ModelProto) -> int:
    """The model's serialized bytes plus the external data its tensors point at (each range
    counted once). Exact, without serializing or copying the weights into the model: protobuf
    sizes the model and graph without their initializers and each initializer without its
    ``raw_data``, whose length is added back with the prefixes it needs. (``ByteSize`` on the
    model serializes every weight to size it; clearing and setting ``raw_data`` back would
    leave a copy of every weight in the message's arena on each call.)"""
    ranges = set()
    for t in all_tensors(model.graph):
        ext = external_info(t)
        if ext is not None:
            ranges.add((ext.get("location", ""), int(ext.get("offset", 0) or 0),
                        int(ext.get("length", 0) or 0)))
    external = sum(n for _, _, n in ranges)
    if not model.HasField("graph"):
        return model.ByteSize() + external
    graph = copy_except(model.graph, onnx.GraphProto(), "initializer").ByteSize()
    for t in model.graph.initializer:
        raw = next((len(v) for fd, v in t.ListFields() if fd.name == "raw_data"), None)
        if raw is None:
            graph += field_bytes(t.ByteSize())
        else:
            header = copy_except(t, onnx.TensorProto(), "raw_data").ByteSize()
            graph += field_bytes(header + field_bytes(raw))
    rest = copy_except(model, onnx.ModelProto(), "graph").ByteSize()
    return rest + field_bytes(graph) + external


def subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    """The graphs in a node's attributes (``If`` branches, ``Loop``/``Scan`` bodies)."""
    for a in node.attribute:
        if a.type == onnx.AttributeProto.GRAPH:
            yield a.g
        elif a.type == onnx.AttributeProto.GRAPHS:
            yield from a.graphs


def all_graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """``graph`` and every graph nested in it."""
    yield graph
    for node in graph.node:
        for sub in subgraphs(node):
            yield from all_graphs(sub)


def all_tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    for g in all_graphs(graph):
        yield from g.initializer
        for node in g.node:
            for a in node.attribute:
                if a.type == onnx.AttributeProto.TENSOR:
                    yield a.t


def _uses(graph: onnx.GraphProto) -> Counter[str]:
    """How many times each name is read: node inputs in every graph, graph outputs."""
    counts: Counter[str] = Counter()
    for g in all_graphs(graph):
        for node in g.node:
            counts.update(i for i in node.input if i)
        counts.update(o.name for o in g.output)
    return counts


def _sub_reads(graph: onnx.GraphProto) -> set[str]:
    """Names read inside subgraphs of ``graph``'s nodes (captured from the outer scope)."""
    names: set[str] = set()
    for node in graph.node:
        for sub in subgraphs(node):
            for g in all_graphs(sub):
                for n in g.node:
                    names.update(n.input)
                names.update(o.name for o in g.output)
    return names


def _sub_defines(graph: onnx.GraphProto) -> set[str]:
    names: set[str] = set()
    for node in graph.node:
        for sub in subgraphs(node):
            for g in all_graphs(sub):
                names.update(i.name for i in g.initializer)
                names.update(i.name for i in g.input)
                for n in g.node:
                    names.update(n.output)
    return names


def _rename_reads(graph: onnx.GraphProto, renames: dict[str, str]) -> None:
    """Every node input (subgraphs included) named in ``renames`` reads the new name."""
    if not renames:
        return
    for g in all_graphs(graph):
        for node in g.node:
            for i, name in enumerate(node.input):
                if name in renames:
                    node.input[i] = renames[name]


def _delete_at(field: Any, indices: list[int]) -> None:
    """Remove items of a repeated field by index, in place, order kept. (Clearing the field
    and adding the kept items back would copy each into the message's arena, which protobuf
    never shrinks: a copy of every kept weight, each time.)"""
    for i in sorted(set(indices), reverse=True):
        del field[i]


def _delete_where(field: Any, drop: Callable[[Any], bool]) -> int:
    """Remove the items of a repeated field for which ``drop`` is true (see :func:`_delete_at`)."""
    doomed = [i for i, item in enumerate(field) if drop(item)]
    _delete_at(field, doomed)
    return len(doomed)


class _Fresh:
    def __init__(self, graph: onnx.GraphProto) -> None:
        self.taken = {i.name for i in graph.initializer} | {i.name for i in graph.input}
        for g in all_graphs(graph):
            for n in g.node:
                self.taken.update(n.input)
                self.taken.update(n.output)

    def __call__(self, base: str) -> str:
        name, n = base, 1
        while name in self.taken:
            n += 1
            name = f"{base}_{n}"
        self.taken.add(name)
        return name


class Values:
    """Initializer values by name, external data read from ``base_dir``."""

    def __init__(self, model: onnx.ModelProto, base_dir: Path) -> None:
        self.base_dir = base_dir
        self.graph = model.graph

    def initializers(self) -> dict[str, onnx.TensorProto]:
        """The top-level initializers that no graph input makes overridable."""
        inputs = {i.name for i in self.graph.input}
        return {t.name: t for t in self.graph.initializer if t.name not in inputs}

    def array(self, t: onnx.TensorProto) -> np.ndarray:
        """A tensor's values (external data read from disk)."""
        return numpy_helper.to_array(t, str(self.base_dir))


def constants(graph: onnx.GraphProto, values: Values) -> dict[str, onnx.TensorProto]:
    """Constant values by name: overridable-free initializers and ``Constant`` nodes' values."""
    out = dict(values.initializers())
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and node.output:
            t = _constant_value(node)
            if t is not None:
                out[node.output[0]] = t
    return out


def _constant_value(node: onnx.NodeProto) -> onnx.TensorProto | None:
    """The value of a ``Constant`` node as a tensor (``value``, ``value_int(s)``,
    ``value_float(s)``); ``None`` for strings and sparse values."""
    for a in node.attribute:
        if a.name == "value" and a.type == onnx.AttributeProto.TENSOR:
            return a.t
        arrays = {"value_int": np.int64(a.i), "value_ints": np.array(a.ints, np.int64),
                  "value_float": np.float32(a.f),
                  "value_floats": np.array(a.floats, np.float32)}
        if a.name in arrays:
            return numpy_helper.from_array(np.asarray(arrays[a.name]), node.output[0])
    return None


def _elem_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element types of the graph's values, from onnx's shape inference where it works."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # too large to serialize, or a graph inference rejects
        inferred = model
    g = inferred.graph
    return {v.name: v.type.tensor_type.elem_type
            for v in [*g.input, *g.value_info, *g.output]
            if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type}


def _tensor_nbytes(t: onnx.TensorProto) -> int:
    ext = external_info(t)
    if ext is not None:
        return int(ext.get("length", 0) or 0)
    return t.ByteSize()


# -- exact passes ------------------------------------------------------------------------
def drop_debug_info(model: onnx.ModelProto, values: Values) -> int:
    """``doc_string`` and ``metadata_props`` of every node, graph and graph value (subgraphs
    included); no runtime reads them. Returns how many fields were cleared."""
    cleared = 0
    for g in all_graphs(model.graph):
        for item in (g, *g.node, *g.input, *g.output, *g.value_info):
            if item.doc_string:
                item.ClearField("doc_string")
                cleared += 1
            if len(item.metadata_props):
                cleared += len(item.metadata_props)
                item.ClearField("metadata_props")
    return cleared


def remove_identity(model: onnx.ModelProto, values: Values) -> int:
    """``y = Identity(x)``: readers of ``y`` read ``x`` (not when ``y`` is a graph output or
    read inside a subgraph, where renaming could meet a shadowing name)."""
    g = model.graph
    outputs = {o.name for o in g.output}
    sub = _sub_reads(g)
    renames: dict[str, str] = {}
    gone: list[int] = []
    for i, node in enumerate(g.node):
        if (node.op_type == "Identity" and node.domain in ("", "ai.onnx")
                and len(node.input) == 1 and len(node.output) == 1
                and node.output[0] not in outputs and node.output[0] not in sub):
            src = node.input[0]
            renames[node.output[0]] = renames.get(src, src)
            gone.append(i)
    if not renames:
        return 0
    for k, v in list(renames.items()):
        while v in renames:
            v = renames[v]
        renames[k] = v
    _delete_at(g.node, gone)
    _rename_reads(g, renames)
    return len(renames)


def _attr(node: onnx.NodeProto, name: str, default: Any) -> Any:
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _set_float_attr(node: onnx.NodeProto, name: str, value: float) -> None:
    for a in node.attribute:
        if a.name == name:
            a.f = value
            return
    node.attribute.append(onnx.helper.make_attribute(name, value))


#: Weight dtypes whose Conv + BatchNormalization fold repeats onnxruntime's own arithmetic.
_ORT_FOLD_TYPES = frozenset({np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)})


def _fold_conv_as_ort(w: np.ndarray, scale: np.ndarray, b: np.ndarray, mean: np.ndarray,
                      var: np.ndarray, conv_b: np.ndarray | None,
                      eps: float) -> tuple[np.ndarray, np.ndarray]:
    """Conv weight and bias with a BatchNormalization folded in exactly as onnxruntime's
    ``ConvBNFusion`` does when it loads the unfolded model (``conv_bn_fusion.cc`` and
    ``Initializer``'s element-wise ops): the same steps in the same order, each computed in
    float32 (float64 for double) and rounded to the tensors' dtype, epsilon a float32. So
    onnxruntime runs the folded model bit for bit as it runs the original."""
    t = w.dtype
    n = np.float64 if t == np.float64 else np.float32

    def op(f: Callable[..., np.ndarray], *xs: np.ndarray) -> np.ndarray:
        return np.asarray(f(*(np.asarray(x).astype(n) for x in xs))).astype(t)

    std = op(np.sqrt, op(np.add, var, np.float32(eps)))
    s = op(np.divide, scale, std)
    new_w = op(np.multiply, w, s.reshape((-1,) + (1,) * (w.ndim - 1)))
    if conv_b is not None:
        new_b = op(np.add, op(np.multiply, op(np.subtract, conv_b, mean), s), b)
    else:
        new_b = op(np.subtract, b, op(np.multiply, mean, s))
    return new_w, new_b


def fold_batchnorm(model: onnx.ModelProto, values: Values) -> int:
    """Fold inference ``BatchNormalization`` into the ``Conv`` or ``Gemm`` before it.

    Into a Conv with float16, float32 or float64 tensors of one dtype it folds with
    onnxruntime's own arithmetic (:func:`_fold_conv_as_ort`): onnxruntime folds the pair
    itself when it loads the original, so the outputs stay bitwise equal. Otherwise (mixed
    dtypes, and Gemm, which onnxruntime leaves unfolded) it computes in float64 and rounds
    once."""
    g = model.graph
    consts = constants(g, values)
    uses = _uses(g)
    outputs = {o.name for o in g.output}
    producer = {o: n for n in g.node for o in n.output}
    fresh = _Fresh(g)
    removed: list[int] = []
    first_new = len(g.initializer)
    fresh_names: set[str] = set()
    replaced: set[str | None] = set()
    folded = 0
    for index, bn in enumerate(g.node):
        if bn.op_type != "BatchNormalization" or bn.domain not in ("", "ai.onnx"):
            continue
        if _attr(bn, "training_mode", 0) or len(bn.input) != 5 \
                or any(o for o in bn.output[1:]):
            continue
        x = bn.input[0]
        prev = producer.get(x)
        if prev is None or prev.op_type not in ("Conv", "Gemm") or prev.domain not in (
                "", "ai.onnx") or uses[x] != 1 or x in outputs or len(prev.output) != 1:
            continue
        if not all(n in consts for n in bn.input[1:]) or len(prev.input) < 2 \
                or prev.input[1] not in consts:
            continue
        bias_name = prev.input[2] if len(prev.input) > 2 and prev.input[2] else None
        if bias_name is not None and bias_name not in consts:
            continue
        w_t = consts[prev.input[1]]
        w_raw = values.array(w_t)
        dtype = w_raw.dtype
        if not np.issubdtype(dtype, np.floating):
            continue
        eps = float(_attr(bn, "epsilon", 1e-5))
        raw = [values.array(consts[n]) for n in bn.input[1:]]
        raw_b = values.array(consts[bias_name]) if bias_name else None
        scale, b, mean, var = (a.astype(np.float64) for a in raw)
        s = scale / np.sqrt(var + eps)
        if prev.op_type == "Conv":
            if w_raw.ndim < 3 or w_raw.shape[0] != s.shape[0] or any(a.ndim != 1 for a in raw):
                continue
            if dtype in _ORT_FOLD_TYPES and all(
                    a.dtype == dtype for a in [*raw, *([raw_b] if raw_b is not None else [])]):
                new_w, new_b = _fold_conv_as_ort(w_raw, raw[0], raw[1], raw[2], raw[3],
                                                 raw_b, eps)
            else:
                new_w = w_raw.astype(np.float64) * s.reshape((-1,) + (1,) * (w_raw.ndim - 1))
                old_b = raw_b.astype(np.float64) if raw_b is not None else 0.0
                new_b = (old_b - mean) * s + b
        else:
            # alpha scales A @ B; the per-column factor commutes with it.
            beta = float(_attr(prev, "beta", 1.0))
            trans_b = int(_attr(prev, "transB", 0))
            w = w_raw.astype(np.float64)
            if w.ndim != 2 or w.shape[0 if trans_b else 1] != s.shape[0] or beta == 0.0:
                continue
            new_w = w * (s[:, None] if trans_b else s[None, :])
            old_c = values.array(consts[bias_name]).astype(np.float64) if bias_name else 0.0
            new_b = ((beta * old_c - mean) * s + b) / beta
        inits = values.initializers()
        # Tensors only this node reads are replaced under their own names.
        w_name = prev.input[1] if prev.input[1] in inits and uses[prev.input[1]] == 1 \
            and prev.input[1] not in replaced else fresh(f"{prev.input[1]}_bnfold")
        b_name = bias_name if bias_name in inits and uses[bias_name] == 1 \
            and bias_name not in replaced and bias_name != w_name \
            else fresh(f"{bn.output[0]}_bias")
        replaced.update((w_name, b_name))
        # Into the model one by one: never a second copy of every folded weight at once.
        g.initializer.add().CopyFrom(numpy_helper.from_array(new_w.astype(dtype), w_name))
        g.initializer.add().CopyFrom(
            numpy_helper.from_array(np.asarray(new_b, dtype=dtype), b_name))
        fresh_names.update((w_name, b_name))
        del new_w, new_b
        inputs = [prev.input[0], w_name, b_name]
        del prev.input[:]
        prev.input.extend(inputs)
        prev.output[0] = bn.output[0]
        removed.append(index)
        folded += 1
    if folded:
        _delete_at(g.node, removed)
        _delete_at(g.initializer, [i for i, t in enumerate(g.initializer)
                                   if i < first_new and t.name in fresh_names])
    return folded


def _evaluate(model: onnx.ModelProto, node: onnx.NodeProto,
              inputs: dict[str, np.ndarray]) -> list[np.ndarray] | None:
    """Run one node under the model's opsets with onnx's reference evaluator."""
    from onnx.reference import ReferenceEvaluator

    graph = onnx.helper.make_graph(
        [node], "fold",
        [onnx.helper.make_tensor_value_info(n, onnx.helper.np_dtype_to_tensor_dtype(a.dtype),
                                            a.shape) for n, a in inputs.items()],
        [onnx.helper.make_empty_tensor_value_info(o) for o in node.output])
    tiny = onnx.helper.make_model(graph, opset_imports=list(model.opset_import),
                                  ir_version=model.ir_version)
    try:
        return list(ReferenceEvaluator(tiny).run(None, inputs))
    except Exception:  # an op the reference evaluator lacks or rejects: leave the node
        return None


def _predicted_nbytes(model: onnx.ModelProto, node: onnx.NodeProto,
                      inputs: dict[str, np.ndarray]) -> int | None:
    """Bytes of a node's outputs from onnx's shape inference (small integer inputs given as
    values, so shapes read from them propagate); ``None`` when a shape stays unknown."""
    small = {n: a for n, a in inputs.items() if a.dtype.kind in "iu" and a.size <= 64}
    graph = onnx.helper.make_graph(
        [node], "predict",
        [onnx.helper.make_tensor_value_info(n, onnx.helper.np_dtype_to_tensor_dtype(a.dtype),
                                            a.shape) for n, a in inputs.items()
         if n not in small],
        [onnx.helper.make_empty_tensor_value_info(o) for o in node.output if o],
        [numpy_helper.from_array(a, n) for n, a in small.items()])
    tiny = onnx.helper.make_model(graph, opset_imports=list(model.opset_import),
                                  ir_version=model.ir_version)
    try:
        inferred = onnx.shape_inference.infer_shapes(tiny, strict_mode=True, data_prop=True)
    except Exception:  # an op shape inference does not know
        return None
    total = 0
    for out in inferred.graph.output:
        tt = out.type.tensor_type
        dims = tt.shape.dim if tt.HasField("shape") else None
        if not tt.elem_type or dims is None or any(not d.HasField("dim_value") for d in dims):
            return None
        try:
            item = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type).itemsize
        except (KeyError, TypeError):
            return None
        total += int(np.prod([d.dim_value for d in dims], dtype=np.int64)) * item
    return total


def fold_constants(model: onnx.ModelProto, values: Values) -> int:
    """Nodes whose inputs are all constants become initializers, when that costs no bytes."""
    g = model.graph
    consts = constants(g, values)
    uses = _uses(g)
    outputs = {o.name for o in g.output}
    sub = _sub_reads(g)
    keep: list[onnx.NodeProto] = []
    new_inits: list[onnx.TensorProto] = []
    folded = 0
    types: dict[str, int] | None = None
    for node in g.node:
        if (node.op_type == "CastLike" and len(node.input) == 2 and node.input[0] in consts
                and node.input[1] not in consts and node.domain in ("", "ai.onnx")):
            # CastLike(constant, x) is a Cast to x's type, which shape inference knows.
            types = _elem_types(model) if types is None else types
            to = types.get(node.input[1])
            if to:
                node = onnx.helper.make_node("Cast", [node.input[0]], list(node.output),
                                             name=node.name, to=to)
        ins = [i for i in node.input if i]
        foldable = (node.domain in ("", "ai.onnx") and node.op_type not in _NO_FOLD
                    and node.op_type != "Constant" and ins and all(i in consts for i in ins)
                    and not any(True for _ in subgraphs(node)))
        if not foldable:
            keep.append(node)
            continue
        solely = {i for i in set(ins) if uses[i] == ins.count(i) and i not in outputs
                  and i not in sub}
        freed = node.ByteSize() + sum(_tensor_nbytes(consts[i]) for i in solely)
        arrays = {i: values.array(consts[i]) for i in set(ins)}
        predicted = _predicted_nbytes(model, node, arrays)
        if any(a.dtype == object for a in arrays.values()) or predicted is None \
                or predicted > freed:
            # Unknown or larger than what it frees: never evaluated, so a lying shape
            # cannot make a huge allocation either.
            keep.append(node)
            continue
        results = _evaluate(model, node, arrays)
        if results is None or len(results) != len(node.output) \
                or any(not isinstance(r, np.ndarray) or r.dtype == object for r in results):
            keep.append(node)
            continue
        new = [numpy_helper.from_array(np.ascontiguousarray(r), name)
               for r, name in zip(results, node.output, strict=True) if name]
        # Bytes freed: the node, and each constant only this node reads.
        if sum(t.ByteSize() for t in new) > freed:
            keep.append(node)
            continue
        for t in new:
            consts[t.name] = t
        new_inits.extend(new)
        folded += 1
    if folded:
        del g.node[:]
        g.node.extend(keep)
        g.initializer.extend(new_inits)
    return folded


def remove_dead_nodes(model: onnx.ModelProto, values: Values) -> int:
    """Nodes of the top-level graph none of whose outputs anything reads."""
    g = model.graph
    removed = 0
    while True:
        uses = _uses(g)
        dead = [i for i, n in enumerate(g.node) if not any(uses[o] for o in n.output if o)]
        if not dead:
            return removed
        _delete_at(g.node, dead)
        removed += len(dead)


def remove_unused_initializers(model: onnx.ModelProto, values: Values) -> int:
    """Top-level initializers nothing reads, with their graph input and value_info."""
    g = model.graph
    uses = _uses(g)
    gone = {t.name for t in g.initializer if not uses[t.name]}
    if not gone:
        return 0
    _delete_where(g.initializer, lambda t: t.name in gone)
    for field in (g.input, g.value_info):
        kept = [v for v in field if v.name not in gone]
        del field[:]
        field.extend(kept)
    return len(gone)


def remove_initializer_value_info(model: onnx.ModelProto, values: Values) -> int:
    """``value_info`` entries of top-level initializers whose element type and static shape
    are the initializer's own (one that disagrees is left for the runtime to judge)."""
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    keep = []
    for v in g.value_info:
        t = inits.get(v.name)
        tt = v.type.tensor_type if v.type.HasField("tensor_type") else None
        if t is not None and tt is not None and tt.elem_type == t.data_type and (
                not tt.HasField("shape") or [d.dim_value if d.HasField("dim_value") else None
                                             for d in tt.shape.dim] == list(t.dims)):
            continue
        keep.append(v)
    removed = len(g.value_info) - len(keep)
    if removed:
        del g.value_info[:]
        g.value_info.extend(keep)
    return removed


def _digest(t: onnx.TensorProto, values: Values) -> tuple[object, ...]:
    """dtype, shape and a hash of the values (external data hashed a chunk at a time)."""
    h = hashlib.sha256()
    ext = external_info(t)
    if ext is not None:
        path = values.base_dir / ext.get("location", "")
        offset, length = int(ext.get("offset", 0) or 0), int(ext.get("length", 0) or 0)
        with open(path, "rb") as fh:
            fh.seek(offset)
            left = length
            while left > 0:
                chunk = fh.read(min(left, 1 << 22))
                if not chunk:
                    break
                h.update(chunk)
                left -= len(chunk)
    else:
        h.update(np.ascontiguousarray(values.array(t)).tobytes())
    return (t.data_type, tuple(t.dims), h.hexdigest())


def _duplicates(model: onnx.ModelProto, values: Values) -> dict[str, str]:
    """Initializers and main-graph ``Constant`` values to rename to an equal one (dtype,
    shape, bytes) that holds their values; only tensors whose dtype and shape another shares
    are hashed. Initializers come first, so that one holds what a ``Constant`` repeats, and a
    ``Constant`` is held only by one before it (paddle2onnx writes weights as Constants)."""
    g = model.graph
    protected = {o.name for o in g.output} | _sub_defines(g)
    uses = _uses(g)
    # (name, tensor, bytes its removal saves)
    candidates = [(n, t, _tensor_nbytes(t)) for n, t in values.initializers().items()
                  if n not in protected]
    for node in g.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and node.output \
                and node.output[0] not in protected and len(node.attribute) == 1 \
                and node.attribute[0].name == "value" \
                and node.attribute[0].type == onnx.AttributeProto.TENSOR:
            candidates.append((node.output[0], node.attribute[0].t, node.ByteSize()))
    shapes = Counter((t.data_type, tuple(t.dims)) for _, t, _ in candidates)
    holders: dict[tuple[object, ...], str] = {}
    renames: dict[str, str] = {}
    for name, t, saves in candidates:
        if shapes[(t.data_type, tuple(t.dims))] < 2:
            continue
        key = _digest(t, values)
        holder = holders.setdefault(key, name)
        if holder != name and (len(holder) - len(name)) * uses[name] < saves:
            renames[name] = holder
    return renames


def merge_duplicates(model: onnx.ModelProto, values: Values) -> int:
    """Initializers and ``Constant`` values with equal dtype, shape and bytes stored once;
    readers renamed."""
    g = model.graph
    renames = _duplicates(model, values)
    if not renames:
        return 0
    _rename_reads(g, renames)
    _delete_where(g.initializer, lambda t: t.name in renames)
    _delete_where(g.node, lambda n: n.op_type == "Constant" and bool(n.output)
                  and n.output[0] in renames)
    kept = [v for v in g.value_info if v.name not in renames]
    del g.value_info[:]
    g.value_info.extend(kept)
    return len(renames)


# -- approximate passes ------------------------------------------------------------------
def cast_float16(model: onnx.ModelProto, values: Values) -> int:
    """float32/float64 initializers stored as float16, a ``Cast`` back in front of the graph;
    tensors too small to pay for the node, or with values float16 cannot hold, are kept."""
    g = model.graph
    fresh = _Fresh(g)
    top: list[onnx.NodeProto] = []
    protected = _sub_defines(g)
    cast = 0
    for i, t in enumerate(g.initializer):
        if t.data_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE) \
                or t.name in protected or t.name not in values.initializers():
            continue
        a = values.array(t)
        item = 4 if t.data_type == onnx.TensorProto.FLOAT else 8
        if a.size * (item - 2) <= _NODE_COST:
            continue
        if a.size and np.nanmax(np.abs(a)) > np.finfo(np.float16).max:
            continue
        name, to = t.name, t.data_type
        new_name = fresh(f"{name}_float16")
        g.initializer[i].CopyFrom(numpy_helper.from_array(a.astype(np.float16), new_name))
        top.append(onnx.helper.make_node("Cast", [new_name], [name], to=to,
                                         name=fresh(f"modelsize/cast/{name}")))
        cast += 1
    if cast:
        nodes = [*top, *g.node]
        del g.node[:]
        g.node.extend(nodes)
    return cast


def _opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def quantize_int8(model: onnx.ModelProto, values: Values) -> int:
    """Weight-only int8: each float ``Conv``/``Gemm``/``MatMul`` weight and ``Gather`` table
    (axis 0: embeddings; 2-D and more) stored as int8 with one float scale per output channel
    or table row (symmetric), read through ``DequantizeLinear`` (opset 13 and later)."""
    if _opset(model) < 13:
        return 0
    g = model.graph
    fresh = _Fresh(g)
    inits = values.initializers()
    weights: dict[str, int] = {}
    for node in g.node:
        if node.op_type in ("Conv", "ConvTranspose") and len(node.input) > 1:
            weights.setdefault(node.input[1], 1 if node.op_type == "ConvTranspose" else 0)
        elif node.op_type == "Gemm" and len(node.input) > 1:
            weights.setdefault(node.input[1], 0 if _attr(node, "transB", 0) else 1)
        elif node.op_type == "MatMul" and len(node.input) > 1:
            weights.setdefault(node.input[1], -1)
        elif node.op_type == "Gather" and _attr(node, "axis", 0) == 0:
            weights.setdefault(node.input[0], 0)  # an embedding table: one scale a row
    protected = _sub_defines(g)
    top: list[onnx.NodeProto] = []
    scales: list[onnx.TensorProto] = []
    done = 0
    for i, t in enumerate(g.initializer):
        axis = weights.get(t.name)
        if axis is None or t.name not in inits or t.name in protected \
                or t.data_type != onnx.TensorProto.FLOAT or len(t.dims) < 2:
            continue
        a = values.array(t).astype(np.float32)
        axis = axis % a.ndim
        if a.size * 3 <= _NODE_COST + 4 * a.shape[axis]:
            continue
        other = tuple(d for d in range(a.ndim) if d != axis)
        amax = np.max(np.abs(a), axis=other)
        scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
        shape = [1] * a.ndim
        shape[axis] = -1
        q = np.clip(np.rint(a / scale.reshape(shape)), -127, 127).astype(np.int8)
        name = t.name
        q_name, s_name = fresh(f"{name}_int8"), fresh(f"{name}_scale")
        g.initializer[i].CopyFrom(numpy_helper.from_array(q, q_name))
        scales.append(numpy_helper.from_array(scale, s_name))
        top.append(onnx.helper.make_node("DequantizeLinear", [q_name, s_name], [name],
                                         axis=axis, name=fresh(f"modelsize/dq/{name}")))
        done += 1
    if done:
        g.initializer.extend(scales)
        nodes = [*top, *g.node]
        del g.node[:]
        g.node.extend(nodes)
    return done


def quantize_dynamic(model: onnx.ModelProto, values: Values) -> int:
    """onnxruntime's dynamic quantization (int8 weights, activations quantized at run time)."""
    import tempfile

    from onnxruntime.quantization import QuantType
    from onnxruntime.quantization import quantize_dynamic as ort_quantize

    quiet = logging.getLogger()
    level = quiet.level
    with tempfile.TemporaryDirectory(prefix="modelsize-q-") as tmp:
        src, dst = Path(tmp) / "in.onnx", Path(tmp) / "out.onnx"
        full = onnx.ModelProto()
        full.CopyFrom(model)
        onnx.external_data_helper.load_external_data_for_model(full, str(values.base_dir))
        big = full.ByteSize() > (1 << 31) - (1 << 24)
        onnx.save_model(full, str(src), save_as_external_data=big)
        del full
        quiet.setLevel(logging.ERROR)  # its advice to pre-process goes to the root logger
        try:
            ort_quantize(str(src), str(dst), weight_type=QuantType.QInt8,
                         use_external_data_format=big)
        finally:
            quiet.setLevel(level)
        out = onnx.load_model(str(dst))
    before = Counter(n.op_type for n in model.graph.node)
    after = Counter(n.op_type for n in out.graph.node)
    changed = sum((after - before).values())
    model.CopyFrom(out)
    return changed


PASSES: dict[PassName, Callable[[onnx.ModelProto, Values], int]] = {
    PassName.DEBUG_INFO: drop_debug_info,
    PassName.IDENTITY: remove_identity,
    PassName.FOLD_BATCHNORM: fold_batchnorm,
    PassName.CONSTANT_FOLDING: fold_constants,
    PassName.DEAD_NODES: remove_dead_nodes,
    PassName.UNUSED_INITIALIZERS: remove_unused_initializers,
    PassName.INITIALIZER_VALUE_INFO: remove_initializer_value_info,
    PassName.DUPLICATE_INITIALIZERS: merge_duplicates,
    PassName.CAST_FLOAT16: cast_float16,
    PassName.QUANTIZE_INT8: quantize_int8,
    PassName.QUANTIZE_DYNAMIC: quantize_dynamic,
}


def select(cast: str | None, quantize: str | None) -> list[PassName]:
    """The passes a slim runs: the exact ones, then a cast or a quantization if asked."""
    names = list(EXACT)
    if quantize == "int8":
        names.append(PassName.QUANTIZE_INT8)
    elif quantize == "dynamic":
        names.append(PassName.QUANTIZE_DYNAMIC)
    elif quantize == "float16" or cast == "float16":
        names.append(PassName.CAST_FLOAT16)
    if names[-1] in APPROXIMATE:
        # Quantized or cast weights leave float copies and folding leftovers behind.
        names += [PassName.DEAD_NODES, PassName.UNUSED_INITIALIZERS]
    return names


def run_passes(model: onnx.ModelProto, base_dir: Path, names: list[PassName],
               rounds: int = 4) -> tuple[onnx.ModelProto, list[PassResult]]:
    """Run ``names`` in order on copies of ``model``; keep each only if it did not grow it.
    The exact ones run again while a round made the model smaller (a fold opens another).
    A model a pass replaced is released at once (pass ``model`` as a temporary, not a name
    the caller keeps, and no more than two copies are ever held)."""
    first = next((i for i, n in enumerate(names) if n in APPROXIMATE), len(names))
    box = [model]
    del model
    size = model_bytes(box[0])
    results: list[PassResult] = []
    for _ in range(rounds):
        before = size
        size, done = _round(box, base_dir, names[:first], size)
        results = done if not results else [
            _merge(a, b) for a, b in zip(results, done, strict=True)]
        if size == before:
            break
    size, done = _round(box, base_dir, names[first:], size)
    return box.pop(), results + done


def _merge(first: PassResult, later: PassResult) -> PassResult:
    """One pass over several rounds: changes added, bytes from first to last kept."""
    if not later.applied:
        return first
    if not first.applied:
        return later
    return PassResult(first.name, first.changes + later.changes, first.bytes_before,
                      first.bytes_before - first.saved_bytes - later.saved_bytes, True)


def _round(box: list[onnx.ModelProto], base_dir: Path, names: list[PassName],
           size: int) -> tuple[int, list[PassResult]]:
    """One round of ``names`` on the model in ``box``, replaced there by each kept copy."""
    results: list[PassResult] = []
    for name in names:
        if not _may_apply(name, box[0], base_dir):
            results.append(PassResult(name, 0, size, size, False, "nothing to do"))
            continue
        model_before = box[0]
        if name in _ONLY_REMOVE:
            candidate = box[0]  # it only deletes: the model cannot grow, no copy to go back to
        else:
            candidate = onnx.ModelProto()
            candidate.CopyFrom(box[0])
        was_read = {n for n, k in _uses(candidate.graph).items() if k}
        changes = PASSES[name](candidate, Values(candidate, base_dir))
        if changes:
            _drop_orphans(candidate.graph, was_read)
        after = model_bytes(candidate) if changes else size
        if changes and after <= size:
            results.append(PassResult(name, changes, size, after, True))
            box[0], size = candidate, after
            if candidate is not model_before:
                # What the pass replaced stays in the copy's arena (protobuf never shrinks
                # one): a fresh copy holds only what is left.
                box[0] = onnx.ModelProto()
                box[0].CopyFrom(candidate)
        else:
            note = "nothing to do" if not changes else (
                f"skipped: it would add {after - size:,} bytes")
            results.append(PassResult(name, changes, size, after if changes else size, False,
                                      note))
        del candidate, model_before
    return size, results


def _may_apply(name: PassName, model: onnx.ModelProto, base_dir: Path) -> bool:
    """A look for something the pass could change (spares copying the model)."""
    g = model.graph
    ops = {n.op_type for n in g.node}
    if name == PassName.IDENTITY:
        return "Identity" in ops
    if name == PassName.FOLD_BATCHNORM:
        return "BatchNormalization" in ops
    if name == PassName.CONSTANT_FOLDING:
        known = {t.name for t in g.initializer} - {i.name for i in g.input}
        known |= {n.output[0] for n in g.node if n.op_type == "Constant" and n.output}
        return any(n.op_type != "Constant" and n.input
                   and (n.op_type == "CastLike" or all(i in known for i in n.input if i))
                   for n in g.node)
    if name == PassName.CAST_FLOAT16:
        return any(t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE)
                   for t in g.initializer)
    if name == PassName.DUPLICATE_INITIALIZERS:
        return bool(_duplicates(model, Values(model, base_dir)))
    return True


def _drop_orphans(g: onnx.GraphProto, was_read: set[str]) -> None:
    """Nodes and initializers a pass left unread (read before it): a pass is measured with
    what it made useless removed, not with what was useless before."""
    while True:
        uses = _uses(g)
        gone = {t.name for t in g.initializer if not uses[t.name] and t.name in was_read}
        nodes = [i for i, n in enumerate(g.node) if not any(uses[o] for o in n.output if o)
                 and any(o in was_read for o in n.output if o)]
        if not nodes and not gone:
            return
        _delete_at(g.node, nodes)
        _delete_at(g.initializer, [i for i, t in enumerate(g.initializer) if t.name in gone])
        for field in (g.input, g.value_info):
            kept = [v for v in field if v.name not in gone]
            del field[:]
            field.extend(kept)


def external_sources(model: onnx.ModelProto, base_dir: Path) -> list[onnx.TensorProto]:
    """Every tensor of ``model`` whose data is external, after checking its file range."""
    out = []
    for t in all_tensors(model.graph):
        ext = external_info(t)
        if ext is None:
            continue
        path = base_dir / ext.get("location", "")
        end = int(ext.get("offset", 0) or 0) + int(ext.get("length", 0) or 0)
        if not path.is_file() or os.path.getsize(path) < end:
            raise ValueError(f"{t.name}: external data {ext.get('location', '')!r} is missing "
                             "or shorter than the tensor")
        out.append(t)
    return out
