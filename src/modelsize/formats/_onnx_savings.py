"""What ``modelsize slim``'s ONNX graph passes will at least save, from metadata alone.

``inspect`` reads no tensor data and needs no ``onnx`` package, so it cannot run the passes of
:mod:`modelsize.slimming.graph.onnx_passes`; but two of them remove bytes whose size the wire
format gives exactly (issue 18, item 23: ``inspect`` said "Nothing to slim" where ``slim``
saved 7 kB):

* ``debug-info`` clears ``doc_string`` and ``metadata_props`` of the main graph and its
  subgraphs, of their nodes, inputs, outputs and value_info. It runs first and only removes:
  it saves at least the bytes of those fields (more where a length prefix shrinks).
* ``fold-batchnorm`` folds an inference ``BatchNormalization`` into the ``Conv`` or ``Gemm``
  whose only reader it is. Its conditions are metadata (operators, names, uses, dtypes,
  shapes); what a fold saves (the node and its parameters) and adds (new weights and a bias
  under known names, a longer ``Conv``) is sized exactly here, after the debug bytes are gone.
  The pass keeps all its folds or none (none when the model would grow): the bound counts the
  folds sized exactly, less the largest growth of any fold it could not size (parameters from
  ``Constant`` nodes, external data), and is zero when that is not positive, or when the
  identity pass, which runs first, may rewire a ``BatchNormalization`` onto a ``Conv``.

Everything else the passes do (constant folding, duplicate constants, dead nodes, identities)
depends on values or is not sized here: the finding says slim may save more.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from modelsize._records import record
from modelsize.formats.onnx import GraphKind, GraphSite, NodeSite, Structure, TensorKind, TensorSite

#: ``TensorProto.DataType`` of the float types the fold computes in (float, float16, double),
#: with their element size.
_FLOATS = {1: 4, 10: 2, 11: 8}
_DEFAULT = ("", "ai.onnx")
#: Integer and bool types: never folded (the pass folds floating weights only).
_NOT_FLOATING = frozenset({2, 3, 4, 5, 6, 7, 9, 12, 13, 21, 22, 25, 26})


@record(frozen=True)
class GraphSavings:
    """Lower bounds of what the exact graph passes save, and hints of what more they may."""

    debug_bytes: int
    folds: int
    fold_bytes: int
    #: Nodes whose inputs are all constants (what constant folding looks at).
    constant_nodes: int
    identities: int

    @property
    def nbytes(self) -> int:
        """The bytes the passes save at least."""
        return self.debug_bytes + self.fold_bytes

    def facts(self) -> dict[str, str]:
        """As inventory facts (only the non-zero ones)."""
        out = {"onnx.debug_info_bytes": self.debug_bytes, "onnx.batchnorm_folds": self.folds,
               "onnx.batchnorm_fold_bytes": self.fold_bytes,
               "onnx.constant_nodes": self.constant_nodes, "onnx.identity_nodes": self.identities}
        return {k: str(v) for k, v in out.items() if v}


def _vlen(n: int) -> int:
    return max(1, (n.bit_length() + 6) // 7)


def _field(payload: int) -> int:
    """A length-delimited field with a one-byte tag."""
    return 1 + _vlen(payload) + payload


def _string(text: str) -> int:
    return _field(len(text.encode("utf-8")))


def _tensor_field(name: str, dims: tuple[int, ...], data_type: int, nbytes: int) -> int:
    """``numpy_helper.from_array``'s ``TensorProto`` as a graph's initializer field: unpacked
    dims, data_type, name, raw_data."""
    payload = sum(1 + _vlen(d) for d in dims) + 1 + _vlen(data_type) + _string(name)
    return _field(payload + _field(nbytes))


def _main_graphs(structure: Structure) -> tuple[GraphSite | None, list[GraphSite]]:
    """The main graph and every graph the debug-info pass visits (it and its subgraphs)."""
    main = next((g for g in structure.graphs.values() if g.kind == GraphKind.MAIN), None)
    if main is None:
        return None, []

    def walk(g: GraphSite) -> Iterator[GraphSite]:
        yield g
        for node in g.nodes:
            for sub in node.subgraphs:
                yield from walk(sub)

    return main, list(walk(main))


def graph_savings(structure: Structure) -> GraphSavings:
    """The lower bounds of :class:`GraphSavings` for a parsed model."""
    main, graphs = _main_graphs(structure)
    if main is None:
        return GraphSavings(0, 0, 0, 0, 0)
    debug = sum(g.debug + sum(n.debug for n in g.nodes) for g in graphs)
    overridden = set(main.inputs)
    # Constants as the passes see them: initializers no graph input overrides, and Constant
    # nodes' values (paddle2onnx writes every weight as one).
    consts: dict[str, _Const] = {}
    for t in structure.tensors.values():
        if t.graph is not main:
            continue
        if t.kind == TensorKind.INITIALIZER and t.bare not in overridden:
            consts[t.bare] = _Const(t, _field(t.end - t.start), True)
        elif t.kind == TensorKind.NODE_TENSOR and t.node is not None and t.attribute == "value" \
                and t.node.op_type == "Constant" and t.node.domain in _DEFAULT:
            node = t.node
            consts[t.bare] = _Const(t, _field(node.end - node.start - node.debug), False)
    constant_outputs = {o for n in main.nodes if n.op_type == "Constant"
                        and n.domain in _DEFAULT for o in n.outputs[:1]}
    known = set(consts) | constant_outputs
    constant_nodes = sum(1 for n in main.nodes if n.op_type != "Constant" and n.inputs
                         and all(i in known for i in n.inputs if i))
    ids = [n for n in main.nodes if n.op_type == "Identity"]
    # The identity pass runs first: an Identity between a Conv and a BatchNormalization, or in
    # front of their constants, may make a fold this count does not size.
    folding = {name for n in main.nodes if n.op_type in ("BatchNormalization", "Conv", "Gemm")
               for name in (*n.inputs, *n.outputs)}
    rewired = any(name in folding for n in ids for name in (*n.inputs, *n.outputs))
    folds, fold_bytes = (0, 0) if rewired else _folds(main, graphs, consts, constant_outputs)
    return GraphSavings(debug, folds, fold_bytes, constant_nodes, len(ids))


@record(frozen=True)
class _Const:
    """A constant: its tensor, the bytes its removal saves, whether it is an initializer (the
    fold replaces those in place; a Constant node's value is written anew beside it)."""

    tensor: TensorSite
    removal: int
    initializer: bool


def _folds(main: GraphSite, graphs: list[GraphSite], consts: dict[str, _Const],
           constant_outputs: set[str]) -> tuple[int, int]:
    """(folds sized exactly, the bytes all folds save at least)."""
    uses: Counter[str] = Counter()
    taken: set[str] = set(main.initializers) | set(main.inputs)
    for g in graphs:
        for node in g.nodes:
            uses.update(i for i in node.inputs if i)
            taken.update(node.inputs)
            taken.update(node.outputs)
        uses.update(g.outputs)
    outputs = set(main.outputs)
    producer = {o: n for n in main.nodes for o in n.outputs}

    def fresh(base: str) -> str:
        name, k = base, 1
        while name in taken:
            k += 1
            name = f"{base}_{k}"
        taken.add(name)
        return name

    saved, unsure, count = 0, 0, 0
    replaced: set[str] = set()
    for bn in main.nodes:
        if bn.op_type != "BatchNormalization" or bn.domain not in _DEFAULT:
            continue
        if bn.attrs.get("training_mode", 0) or len(bn.inputs) != 5 \
                or any(o for o in bn.outputs[1:]):
            continue
        x = bn.inputs[0]
        prev = producer.get(x)
        if prev is None or prev.op_type not in ("Conv", "Gemm") or prev.domain not in _DEFAULT \
                or uses[x] != 1 or x in outputs or len(prev.outputs) != 1:
            continue
        if len(prev.inputs) < 2:
            continue
        w_name = prev.inputs[1]
        bias = prev.inputs[2] if len(prev.inputs) > 2 and prev.inputs[2] else None
        names = [*bn.inputs[1:], w_name, *([bias] if bias else [])]
        if not all(n in consts or n in constant_outputs for n in names):
            continue  # the pass needs every one of them constant
        if any(n not in consts or consts[n].tensor.external for n in names):
            w_const = consts.get(w_name)
            growth = _worst_growth(bn, prev, w_const.tensor if w_const else None)
            if growth is None:
                return 0, 0
            unsure += growth
            continue
        params = [consts[n].tensor for n in bn.inputs[1:]]
        w = consts[w_name].tensor
        if w.data_type not in _FLOATS and w.data_type not in _NOT_FLOATING:
            return 0, 0  # bfloat16, float8...: whether the pass folds them is not sized here
        if not _folds_as_sized(prev, w, params):
            continue
        c = params[0].dims[0]
        item = _FLOATS[w.data_type]
        change = _field(bn.end - bn.start - bn.debug)  # the node goes
        read_once = Counter(bn.inputs[1:])
        change += sum(consts[p].removal for p in read_once
                      if uses[p] == read_once[p] and p not in (w_name, bias))  # only it read
        in_place_w = consts[w_name].initializer and uses[w_name] == 1 \
            and w_name not in replaced
        w_new = w_name if in_place_w else fresh(f"{w_name}_bnfold")
        numel = 1
        for d in w.dims:
            numel *= d
        change -= _tensor_field(w_new, w.dims, w.data_type, numel * item)
        if in_place_w or uses[w_name] == 1:
            change += consts[w_name].removal  # replaced, or left unread and dropped
        in_place_b = bias is not None and consts[bias].initializer and uses[bias] == 1 \
            and bias not in replaced and bias != w_new
        b_new = bias if in_place_b and bias else fresh(f"{bn.outputs[0]}_bias")
        change -= _tensor_field(b_new, (c,), w.data_type, c * item)
        if bias is not None and uses[bias] == 1 and bias != w_name:
            change += consts[bias].removal
        replaced.update((w_new, b_new))
        before = prev.end - prev.start - prev.debug
        after = (before - sum(_string(i) for i in prev.inputs) - _string(x)
                 + _string(prev.inputs[0]) + _string(w_new) + _string(b_new)
                 + _string(bn.outputs[0]))
        change -= _field(after) - _field(before)
        saved += change
        count += 1
    total = saved - unsure
    return (count, total) if total > 0 and count else (0, 0)


def _folds_as_sized(prev: NodeSite, w: TensorSite, params: list[TensorSite]) -> bool:
    """The pass's own conditions, on dtypes and shapes: it folds this pair."""
    if w.data_type not in _FLOATS or any(len(p.dims) != 1 for p in params):
        return False
    c = params[0].dims[0]
    if any(p.dims != (c,) for p in params):
        return False
    if prev.op_type == "Conv":
        return len(w.dims) >= 3 and w.dims[0] == c
    trans_b = int(prev.attrs.get("transB", 0))
    return len(w.dims) == 2 and w.dims[0 if trans_b else 1] == c \
        and prev.attrs.get("beta", 1.0) != 0.0


def _worst_growth(bn: NodeSite, prev: NodeSite, w: TensorSite | None) -> int | None:
    """The most a fold the pass may make adds to the model (a new copy of the weight and a
    new bias under fresh names, a longer node), ``None`` when its weight is not sized."""
    if w is None or w.data_type not in _FLOATS or not w.dims:
        return None
    item = _FLOATS[w.data_type]
    numel = 1
    for d in w.dims:
        numel *= d
    c = max(w.dims[0], w.dims[-1])
    suffix = 16  # "_bnfold"/"_bias" and a counter
    names = len(prev.inputs[1]) + len(bn.outputs[0]) + 2 * suffix
    return (_tensor_field(prev.inputs[1] + "x" * suffix, w.dims, w.data_type, numel * item)
            + _tensor_field(bn.outputs[0] + "x" * suffix, (c,), w.data_type, c * item)
            + _string(bn.outputs[0]) + 2 * names + 8)
