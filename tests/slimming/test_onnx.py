"""``modelsize slim`` on ONNX models: models built here with ``onnx.helper``, slimmed, then
checked by the real framework: ``onnx.checker`` accepts the output and onnxruntime computes
the same outputs as on the input (exactly for deduplication and unused initializers; for
``--cast``, exactly what the input computes with its weights rounded by NumPy or
``ml_dtypes``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import modelsize
from modelsize.categories import Category
from modelsize.errors import UsageError
from tests.conftest import REPO, assert_one_line_error, run_cli

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402 (after the importorskip)

FIXTURES = REPO / "tests" / "fixtures" / "onnx"
OPSET = [helper.make_opsetid("", 17)]
FLOAT = TensorProto.FLOAT


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def _f32(r: np.random.Generator, *shape: int) -> np.ndarray:
    return r.standard_normal(shape).astype(np.float32)


def _vi(name: str, shape: list[int], dtype: int = FLOAT) -> Any:
    return helper.make_tensor_value_info(name, dtype, shape)


def _save(model: Any, path: Path, full_check: bool = True, **kwargs: Any) -> Path:
    onnx.checker.check_model(model, full_check=full_check)
    onnx.save(model, path, **kwargs)
    return path


def _run(path: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3  # onnxruntime warns about the input's unused initializers
    session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    return list(session.run(None, feeds))


def _slim(src: Path, out: Path, **kwargs: Any) -> modelsize.SlimReport:
    """Slim, check the prediction of a dry run against the files written, check the model."""
    dry = modelsize.slim(src, out, dry_run=True, **kwargs)
    report = modelsize.slim(src, out, **kwargs)
    assert report.verified
    written = sum(size for _, size in report.output_files)
    assert dry.predicted_bytes == report.predicted_bytes == written
    onnx.checker.check_model(str(out))
    return report


def _initializers(path: Path) -> dict[str, Any]:
    model = onnx.load(str(path), load_external_data=False)
    return {t.name: t for t in model.graph.initializer}


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.array_equal(x, y)


# -- models ------------------------------------------------------------------------------------


def _mlp(r: np.random.Generator) -> Any:
    """``Y = relu(X @ W1 + B1) @ W2 + relu(...) @ W2_copy + C``, reshaped by an int64 shape;
    ``W2_copy`` duplicates ``W2``; ``stale`` is read by no node."""
    w2 = _f32(r, 16, 4)
    inits = [
        numpy_helper.from_array(_f32(r, 8, 16), "W1"),
        numpy_helper.from_array(_f32(r, 16), "B1"),
        numpy_helper.from_array(w2, "W2"),
        numpy_helper.from_array(w2.copy(), "W2_copy"),
        numpy_helper.from_array(np.array([2, 2], dtype=np.int64), "shape"),
        numpy_helper.from_array(_f32(r, 32, 32), "stale"),
    ]
    nodes = [
        helper.make_node("MatMul", ["X", "W1"], ["h0"]),
        helper.make_node("Add", ["h0", "B1"], ["h1"]),
        helper.make_node("Relu", ["h1"], ["h2"]),
        helper.make_node("MatMul", ["h2", "W2"], ["z1"]),
        helper.make_node("MatMul", ["h2", "W2_copy"], ["z2"]),
        helper.make_node("Add", ["z1", "z2"], ["z3"]),
        helper.make_node("Constant", [], ["C"], value=numpy_helper.from_array(_f32(r, 4))),
        helper.make_node("Add", ["z3", "C"], ["z4"]),
        helper.make_node("Reshape", ["z4", "shape"], ["Y"]),
    ]
    graph = helper.make_graph(nodes, "mlp", [_vi("X", [1, 8])], [_vi("Y", [2, 2])], inits)
    return helper.make_model(graph, opset_imports=OPSET)


def _if_model(r: np.random.Generator) -> Any:
    """An ``If`` whose branches read the outer ``W`` and ``B``; the then-branch holds its own
    copy of ``W`` (``Wt``), the else-branch a weight of its own (``Be``); ``B_out`` is a copy
    of ``B`` that is also an output of the model; a ``Constant`` holds a third copy of ``W``."""
    w, b = _f32(r, 4, 4), _f32(r, 4)
    then = helper.make_graph(
        [helper.make_node("MatMul", ["X", "Wt"], ["t1"]),
         helper.make_node("Add", ["t1", "B"], ["then_out"])],
        "then", [], [_vi("then_out", [1, 4])], [numpy_helper.from_array(w.copy(), "Wt")])
    other = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["e1"]),
         helper.make_node("Add", ["e1", "B"], ["e2"]),
         helper.make_node("Mul", ["e2", "Be"], ["else_out"])],
        "else", [], [_vi("else_out", [1, 4])], [numpy_helper.from_array(_f32(r, 4), "Be")])
    nodes = [
        helper.make_node("ReduceSum", ["X"], ["s"], keepdims=0),
        helper.make_node("Greater", ["s", "zero"], ["cond"]),
        helper.make_node("If", ["cond"], ["Y"], then_branch=then, else_branch=other),
        helper.make_node("Constant", [], ["C"], value=numpy_helper.from_array(w.copy())),
        helper.make_node("MatMul", ["X", "C"], ["Z"]),
        helper.make_node("Add", ["Z", "B_dup"], ["Z2"]),
    ]
    inits = [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "B"),
             numpy_helper.from_array(b.copy(), "B_dup"),
             numpy_helper.from_array(np.array(0, np.float32), "zero"),
             numpy_helper.from_array(_f32(r, 3, 3), "unused"),
             numpy_helper.from_array(b.copy(), "B_out")]
    graph = helper.make_graph(nodes, "ifm", [_vi("X", [1, 4])],
                              [_vi("Y", [1, 4]), _vi("Z2", [1, 4]), _vi("B_out", [4])], inits)
    return helper.make_model(graph, opset_imports=OPSET)


def _loop_model(r: np.random.Generator) -> Any:
    """A ``Loop`` body that reads the outer ``W`` and its own copy of it, ``W_body``."""
    w = _f32(r, 4, 4)
    body = helper.make_graph(
        [helper.make_node("MatMul", ["acc_in", "W"], ["a1"]),
         helper.make_node("MatMul", ["a1", "W_body"], ["a2"]),
         helper.make_node("Tanh", ["a2"], ["acc_out"]),
         helper.make_node("Identity", ["cond_in"], ["cond_out"])],
        "body", [_vi("i", [], TensorProto.INT64), _vi("cond_in", [], TensorProto.BOOL),
                 _vi("acc_in", [1, 4])],
        [_vi("cond_out", [], TensorProto.BOOL), _vi("acc_out", [1, 4])],
        [numpy_helper.from_array(w.copy(), "W_body")])
    nodes = [helper.make_node("Loop", ["trips", "", "X"], ["Y"], body=body)]
    inits = [numpy_helper.from_array(np.array(3, np.int64), "trips"),
             numpy_helper.from_array(w, "W")]
    graph = helper.make_graph(nodes, "loop", [_vi("X", [1, 4])], [_vi("Y", [1, 4])], inits)
    return helper.make_model(graph, opset_imports=OPSET)


def _big_external(r: np.random.Generator, folder: Path) -> Path:
    """A 2 MiB weight and small ones in ``w.bin``, a copy of the big weight, an unused
    external weight; the int64 shape stays inline (onnxruntime reads shapes inline only)."""
    big = _f32(r, 512, 1024)
    inits = [
        numpy_helper.from_array(_f32(r, 3, 512), "A"),
        numpy_helper.from_array(big, "Big"),
        numpy_helper.from_array(big.copy(), "Big_copy"),
        numpy_helper.from_array(_f32(r, 1024), "bias"),
        numpy_helper.from_array(_f32(r, 300, 300), "orphan"),
        numpy_helper.from_array(np.array([2, -1], dtype=np.int64), "shape"),
    ]
    nodes = [
        helper.make_node("MatMul", ["X", "A"], ["h"]),
        helper.make_node("MatMul", ["h", "Big"], ["y1"]),
        helper.make_node("MatMul", ["h", "Big_copy"], ["y2"]),
        helper.make_node("Sum", ["y1", "y2", "bias"], ["y"]),
        helper.make_node("Reshape", ["y", "shape"], ["Y"]),
    ]
    graph = helper.make_graph(nodes, "ext", [_vi("X", [2, 3])], [_vi("Y", [2, 1024])], inits)
    model = helper.make_model(graph, opset_imports=OPSET)
    onnx.checker.check_model(model, full_check=True)
    path = folder / "ext.onnx"
    onnx.save(model, path, save_as_external_data=True, all_tensors_to_one_file=True,
              location="w.bin", size_threshold=64)
    return path


def _rounded(model: Any, dtype: str) -> Any:
    """A copy of ``model`` whose float initializers and Constant values are rounded to
    ``dtype`` (float16 by NumPy, bfloat16 by ``ml_dtypes``, onnx's dependency) and stored
    back as float32."""
    import copy

    out = copy.deepcopy(model)

    def rounded(t: Any) -> Any:
        if t.data_type != FLOAT:
            return t
        a = numpy_helper.to_array(t)
        if dtype == "float16":
            b = a.astype(np.float16).astype(np.float32)
        else:
            ml_dtypes = pytest.importorskip("ml_dtypes")
            b = a.astype(ml_dtypes.bfloat16).astype(np.float32)
        return numpy_helper.from_array(b, t.name)

    def visit(g: Any) -> None:
        for t in g.initializer:
            t.CopyFrom(rounded(t))
        for node in g.node:
            for attr in node.attribute:
                if attr.HasField("t"):
                    attr.t.CopyFrom(rounded(attr.t))
                if attr.HasField("g"):
                    visit(attr.g)

    visit(out.graph)
    return out


# -- deduplication and unused initializers: outputs exactly the same ------------------------


def test_mlp_dedupe_and_unused(tmp_path: Path) -> None:
    model = _mlp(_rng())
    src = _save(model, tmp_path / "mlp.onnx")
    out = tmp_path / "mlp.slim.onnx"
    report = _slim(src, out)
    inits = _initializers(out)
    assert set(inits) == {"W1", "B1", "W2", "shape"}  # W2_copy merged, stale removed
    nodes = onnx.load(str(out)).graph.node
    assert [list(n.input) for n in nodes if n.op_type == "MatMul"][-1] == ["h2", "W2"]
    x = _f32(_rng(1), 1, 8)
    _same(_run(src, {"X": x}), _run(out, {"X": x}))
    # The inspected output has neither duplicates nor unused initializers.
    after = modelsize.inspect(out).inventory.bytes_by_category
    assert after[Category.DUPLICATES] == after[Category.UNUSED_STORAGE] == 0
    before = modelsize.inspect(src).inventory.bytes_by_category
    assert before[Category.DUPLICATES] == 16 * 4 * 4
    assert before[Category.UNUSED_STORAGE] == 32 * 32 * 4
    assert {d.name for d in report.dropped} == {"stale"}
    # Every byte not of W2_copy and stale is kept: the data shrank by exactly theirs.
    data = sum(n for c, n in after.items() if c in (Category.WEIGHTS, Category.BUFFERS))
    assert data == sum(a.nbytes for a in map(numpy_helper.to_array, model.graph.initializer)) \
        + 4 * 4 - 16 * 4 * 4 - 32 * 32 * 4


def test_if_subgraph_reads_outer_initializer(tmp_path: Path) -> None:
    src = _save(_if_model(_rng()), tmp_path / "if.onnx")
    out = tmp_path / "if.slim.onnx"
    report = _slim(src, out)
    model = onnx.load(str(out))
    graph = model.graph
    # B_out (4 floats) keeps its bytes: an Identity node would be larger than the copy.
    assert {t.name for t in graph.initializer} == {"W", "B", "B_out", "zero"}
    node_if = next(n for n in graph.node if n.op_type == "If")
    then, other = (next(a.g for a in node_if.attribute if a.name == f"{b}_branch")
                   for b in ("then", "else"))
    assert not then.initializer  # Wt merged into the outer W
    assert list(then.node[0].input) == ["X", "W"]
    assert [t.name for t in other.initializer] == ["Be"]
    assert list(other.node[1].input) == ["e1", "B"]
    identities = [(list(n.input), list(n.output)) for n in graph.node if n.op_type == "Identity"]
    assert identities == [(["W"], ["C"])]
    assert [o.name for o in graph.output] == ["Y", "Z2", "B_out"]  # the interface is kept
    for x in (_f32(_rng(1), 1, 4), -np.abs(_f32(_rng(2), 1, 4))):  # both branches
        _same(_run(src, {"X": x}), _run(out, {"X": x}))
    assert {k.name: k.alias_of for k in report.kept if k.alias_of} == {
        "W": "Y.then_branch/Wt", "C": "Y.then_branch/Wt", "B_dup": "B", "B_out": "B"}
    names = {t.name for t in report.output.tensors} if report.output else set()
    assert names == {"W", "B", "B_out", "zero", "Y.else_branch/Be"}


def test_loop_body_copy_merged_into_outer(tmp_path: Path) -> None:
    src = _save(_loop_model(_rng()), tmp_path / "loop.onnx")
    out = tmp_path / "loop.slim.onnx"
    _slim(src, out, dedupe=True)
    body = onnx.load(str(out)).graph.node[0].attribute[0].g
    assert not body.initializer and list(body.node[1].input) == ["a1", "W"]
    x = _f32(_rng(1), 1, 4)
    _same(_run(src, {"X": x}), _run(out, {"X": x}))


def test_names_bound_by_a_subgraph_are_not_renamed(tmp_path: Path) -> None:
    """The Loop body's input ``B_dup`` hides the outer ``B_dup``: merging the outer copy into
    ``B`` renames the outer reads only."""
    r = _rng()
    b, w = _f32(r, 4), _f32(r, 4, 4)
    body = helper.make_graph(
        [helper.make_node("MatMul", ["B_dup", "W"], ["m"]),
         helper.make_node("Add", ["m", "B"], ["B_next"]),
         helper.make_node("Identity", ["cond_in"], ["cond_out"])],
        "body", [_vi("i", [], TensorProto.INT64), _vi("cond_in", [], TensorProto.BOOL),
                 _vi("B_dup", [1, 4])],
        [_vi("cond_out", [], TensorProto.BOOL), _vi("B_next", [1, 4])])
    nodes = [helper.make_node("Loop", ["trips", "", "X"], ["L"], body=body),
             helper.make_node("Add", ["L", "B_dup"], ["Y"])]
    inits = [numpy_helper.from_array(b, "B"), numpy_helper.from_array(b.copy(), "B_dup"),
             numpy_helper.from_array(w, "W"),
             numpy_helper.from_array(np.array(2, np.int64), "trips")]
    graph = helper.make_graph(nodes, "shadow", [_vi("X", [1, 4])], [_vi("Y", [1, 4])], inits)
    src = _save(helper.make_model(graph, opset_imports=OPSET), tmp_path / "shadow.onnx")
    out = tmp_path / "shadow.slim.onnx"
    _slim(src, out)
    g = onnx.load(str(out)).graph
    assert {t.name for t in g.initializer} == {"B", "W", "trips"}
    assert list(g.node[1].input) == ["L", "B"]
    assert list(g.node[0].attribute[0].g.node[0].input) == ["B_dup", "W"]  # the body's own
    x = _f32(_rng(1), 1, 4)
    _same(_run(src, {"X": x}), _run(out, {"X": x}))


def test_subgraph_initializer_shadowing_an_outer_name(tmp_path: Path) -> None:
    """A then-branch initializer named like the outer ``B``: onnxruntime and onnx's reference
    evaluator disagree on which one the branch reads, so slim leaves both names alone: the
    copy of ``B`` keeps its bytes, and ``--cast`` is refused."""
    r = _rng()
    b = _f32(r, 4)
    then = helper.make_graph([helper.make_node("Add", ["X", "B"], ["t"])], "then", [],
                             [_vi("t", [1, 4])], [numpy_helper.from_array(_f32(r, 4), "B")])
    other = helper.make_graph([helper.make_node("Sub", ["X", "B"], ["e"])], "else", [],
                              [_vi("e", [1, 4])])
    nodes = [helper.make_node("ReduceSum", ["X"], ["s"], keepdims=0),
             helper.make_node("Greater", ["s", "zero"], ["cond"]),
             helper.make_node("If", ["cond"], ["Y"], then_branch=then, else_branch=other),
             helper.make_node("Mul", ["X", "B_copy"], ["Z"])]
    inits = [numpy_helper.from_array(b, "B"), numpy_helper.from_array(b.copy(), "B_copy"),
             numpy_helper.from_array(np.array(0, np.float32), "zero")]
    graph = helper.make_graph(nodes, "shadow", [_vi("X", [1, 4])],
                              [_vi("Y", [1, 4]), _vi("Z", [1, 4])], inits)
    src = _save(helper.make_model(graph, opset_imports=OPSET), tmp_path / "shadow.onnx")
    out = tmp_path / "shadow.slim.onnx"
    report = _slim(src, out)
    assert {t.name for t in onnx.load(str(out)).graph.initializer} == {"B", "B_copy", "zero"}
    assert any("kept their own bytes" in n for n in report.notes)
    for x in (_f32(_rng(1), 1, 4), -np.abs(_f32(_rng(2), 1, 4))):
        _same(_run(src, {"X": x}), _run(out, {"X": x}))
    proc = run_cli("slim", str(src), "--no-graph", "--cast", "float16", "-o",
                   str(tmp_path / "c.onnx"))
    assert_one_line_error(proc, src)
    assert "shadowing" in proc.stderr


def test_initializers_listed_as_inputs_ir3(tmp_path: Path) -> None:
    """IR 3 lists every initializer among the graph's inputs: removing one removes its input,
    casting one renames and retypes it."""
    r = _rng()
    w = _f32(r, 4, 4)
    inits = [numpy_helper.from_array(w, "W"), numpy_helper.from_array(w.copy(), "W_copy"),
             numpy_helper.from_array(_f32(r, 2), "unused")]
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["a"]),
         helper.make_node("MatMul", ["a", "W_copy"], ["Y"])], "ir3",
        [_vi("X", [1, 4]), _vi("W", [4, 4]), _vi("W_copy", [4, 4]), _vi("unused", [2])],
        [_vi("Y", [1, 4])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 8)], ir_version=3)
    src = _save(model, tmp_path / "ir3.onnx")
    x = _f32(_rng(1), 1, 4)
    out = tmp_path / "ir3.slim.onnx"
    _slim(src, out)
    assert [i.name for i in onnx.load(str(out)).graph.input] == ["X", "W"]
    _same(_run(src, {"X": x}), _run(out, {"X": x}))
    cast = tmp_path / "ir3.f16.onnx"
    _slim(src, cast, cast="float16", dedupe=True)
    inputs = {i.name: i.type.tensor_type.elem_type for i in onnx.load(str(cast)).graph.input}
    assert inputs == {"X": FLOAT, "W_float16": TensorProto.FLOAT16}
    ref = tmp_path / "ir3.rounded.onnx"
    onnx.save(_rounded(model, "float16"), ref)
    _same(_run(ref, {"X": x}), _run(cast, {"X": x}))


# -- --cast: float16/bfloat16 storage, Cast nodes back --------------------------------------


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cast_keeps_model_runnable(tmp_path: Path, dtype: str) -> None:
    model = _if_model(_rng())
    src = _save(model, tmp_path / "if.onnx")
    out = tmp_path / f"if.{dtype}.onnx"
    report = _slim(src, out, cast=dtype, dedupe=True)
    code = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}[dtype]
    graph = onnx.load(str(out)).graph
    assert {t.name: t.data_type for t in graph.initializer} == {
        f"W_{dtype}": code, f"B_{dtype}": code, f"zero_{dtype}": code,
        f"B_out_{dtype}": code}
    casts = [(list(n.input), list(n.output)) for n in graph.node if n.op_type == "Cast"]
    assert casts[0] == ([f"W_{dtype}"], ["W"])  # at the top of the graph
    assert (["W"], ["C"]) in [(list(n.input), list(n.output)) for n in graph.node
                              if n.op_type == "Identity"]
    node_if = next(n for n in graph.node if n.op_type == "If")
    other = next(a.g for a in node_if.attribute if a.name == "else_branch")
    assert [t.name for t in other.initializer] == [f"Be_{dtype}"]
    assert (other.node[0].op_type, list(other.node[0].input), list(other.node[0].output)) == (
        "Cast", [f"Be_{dtype}"], ["Be"])
    ref = tmp_path / "rounded.onnx"
    onnx.save(_rounded(model, dtype), ref)
    for x in (_f32(_rng(1), 1, 4), -np.abs(_f32(_rng(2), 1, 4))):
        got, want, exact = _run(out, {"X": x}), _run(ref, {"X": x}), _run(src, {"X": x})
        _same(got, want)  # what the input computes with rounded weights, to the bit
        tol = 1e-2 if dtype == "float16" else 5e-2
        for g, e in zip(got, exact, strict=True):
            np.testing.assert_allclose(g, e, rtol=tol, atol=tol)
    assert all(k.dtype == dtype for k in report.kept if k.source_dtype == "float32")
    inv = modelsize.inspect(out).inventory
    assert {t.dtype for t in inv.tensors} == {dtype}


def test_cast_constant_node(tmp_path: Path) -> None:
    """A ``Constant`` is cast in place: its output renamed, a ``Cast`` right after it."""
    model = _mlp(_rng())
    src = _save(model, tmp_path / "mlp.onnx")
    out = tmp_path / "mlp.f16.onnx"
    _slim(src, out, cast="float16")
    nodes = [(n.op_type, list(n.input), list(n.output)) for n in onnx.load(str(out)).graph.node]
    at = nodes.index(("Constant", [], ["C_float16"]))
    assert nodes[at + 1] == ("Cast", ["C_float16"], ["C"])
    assert nodes[:4] == [("Cast", [f"{w}_float16"], [w]) for w in ("W1", "B1", "W2", "W2_copy")]
    ref = tmp_path / "ref.onnx"
    onnx.save(_rounded(model, "float16"), ref)
    x = _f32(_rng(1), 1, 8)
    _same(_run(ref, {"X": x}), _run(out, {"X": x}))
    names = {t.name: t.dtype for t in modelsize.inspect(out).inventory.tensors}
    assert names == {"W1_float16": "float16", "B1_float16": "float16", "W2_float16": "float16",
                     "W2_copy_float16": "float16", "shape": "int64", "C_float16": "float16"}


def test_cast_constant_of_shape_and_sparse_initializer(tmp_path: Path) -> None:
    r = _rng()
    sparse = helper.make_sparse_tensor(
        numpy_helper.from_array(_f32(r, 3), "S"),
        numpy_helper.from_array(np.array([1, 5, 9], dtype=np.int64), "S_idx"), [12])
    nodes = [
        helper.make_node("ConstantOfShape", ["dims"], ["filled"],
                         value=numpy_helper.from_array(np.array([0.1], np.float32))),
        helper.make_node("Add", ["X", "S"], ["a"]),
        helper.make_node("Add", ["a", "filled"], ["Y"]),
    ]
    graph = helper.make_graph(
        nodes, "sp", [_vi("X", [12])], [_vi("Y", [12])],
        [numpy_helper.from_array(np.array([12], np.int64), "dims")], sparse_initializer=[sparse])
    model = helper.make_model(graph, opset_imports=OPSET)
    # onnx's shape inference types a sparse initializer as sparse_tensor; onnxruntime
    # densifies it, as ONNX intends.
    src = _save(model, tmp_path / "sp.onnx", full_check=False)
    out = tmp_path / "sp.f16.onnx"
    _slim(src, out, cast="float16")
    g = onnx.load(str(out)).graph
    assert g.sparse_initializer[0].values.data_type == TensorProto.FLOAT16
    nodes = [(n.op_type, list(n.input), list(n.output)) for n in g.node]
    assert nodes[:2] == [("Cast", ["S_float16"], ["S"]),
                         ("ConstantOfShape", ["dims"], ["filled_float16"])]
    assert nodes[2] == ("Cast", ["filled_float16"], ["filled"])
    x = _f32(_rng(1), 12)
    _run(src, {"X": x})
    values = numpy_helper.to_array(sparse.values).astype(np.float16).astype(np.float32)
    dense = np.zeros(12, np.float32)
    dense[[1, 5, 9]] = values
    want = x + dense + np.float32(np.float16(0.1))
    _same(_run(out, {"X": x}), [want.astype(np.float32)])


def test_cast_refuses_an_old_opset(tmp_path: Path) -> None:
    model = _loop_model(_rng())
    model.opset_import[0].version = 11
    src = _save(model, tmp_path / "old.onnx")
    with pytest.raises(UsageError, match="opset 13"):
        modelsize.slim(src, tmp_path / "o.onnx", cast="bfloat16")
    _slim(src, tmp_path / "o16.onnx", cast="float16")


# -- external data ---------------------------------------------------------------------------


def test_external_data_stays_external(tmp_path: Path) -> None:
    src = _big_external(_rng(), tmp_path)
    out = tmp_path / "ext.slim.onnx"
    report = _slim(src, out)
    assert [p.name for p, _ in report.output_files] == ["ext.slim.onnx", "ext.slim.onnx.data"]
    inits = _initializers(out)
    assert set(inits) == {"A", "Big", "bias", "shape"}
    where = {n: {e.key: e.value for e in t.external_data} for n, t in inits.items()}
    assert inits["shape"].HasField("raw_data") and not where["shape"]  # inline stays inline
    assert {w["location"] for n, w in where.items() if w} == {"ext.slim.onnx.data"}
    offsets = {n: (int(w["offset"]), int(w["length"])) for n, w in where.items() if w}
    assert offsets == {"A": (0, 3 * 512 * 4), "Big": (8192, 512 * 1024 * 4),
                       "bias": (8192 + 512 * 1024 * 4, 1024 * 4)}  # Big aligned to 4096
    assert (tmp_path / "ext.slim.onnx.data").stat().st_size == 8192 + (512 + 1) * 1024 * 4
    x = _f32(_rng(1), 2, 3)
    _same(_run(src, {"X": x}), _run(out, {"X": x}))
    after = modelsize.inspect(out).inventory.bytes_by_category
    assert after[Category.DUPLICATES] == after[Category.UNUSED_STORAGE] == 0

    cast = tmp_path / "ext.f16.onnx"
    _slim(src, cast, cast="float16")
    ref = tmp_path / "ref.onnx"
    onnx.save(_rounded(onnx.load(str(src)), "float16"), ref)
    _same(_run(ref, {"X": x}), _run(cast, {"X": x}))


def test_shared_external_bytes_stay_shared(tmp_path: Path) -> None:
    """Two initializers on the same external bytes, listed apart (``--keep``): one range."""
    for name in ("shared_external.onnx", "shared_external.bin"):
        (tmp_path / name).write_bytes((FIXTURES / name).read_bytes())
    out = tmp_path / "s.onnx"
    _slim(tmp_path / "shared_external.onnx", out, keep=["A*"], cast="float16")
    where = {n: {e.key: e.value for e in t.external_data} for n, t in _initializers(out).items()}
    assert where["A_float16"]["offset"] == "0" and where["B_float16"]["offset"] == "32"
    assert (tmp_path / "s.onnx.data").stat().st_size == (16 + 8) * 2


# -- the committed fixtures ----------------------------------------------------------------


@pytest.mark.parametrize("name", ["mlp.onnx", "typed.onnx", "shared_external.onnx"])
def test_fixtures_run_the_same(tmp_path: Path, name: str) -> None:
    for f in FIXTURES.iterdir():
        if f.suffix in (".onnx", ".data", ".bin"):
            (tmp_path / f.name).write_bytes(f.read_bytes())
    src, out = tmp_path / name, tmp_path / f"slim-{name}"
    _slim(src, out)
    feeds = {"X": _f32(_rng(), 1, 8)} if name == "mlp.onnx" else {}
    _same(_run(src, feeds), _run(out, feeds))


def test_external_fixture_holds_the_inline_fixture_weights(tmp_path: Path) -> None:
    """``external.onnx`` is ``mlp.onnx`` with every initializer in ``external.onnx.data``
    (onnxruntime cannot run it: its Reshape shape is external); slimmed, its weights read by
    ``onnx`` equal those of ``mlp.onnx`` slimmed."""
    for name in ("external.onnx", "external.onnx.data", "mlp.onnx"):
        (tmp_path / name).write_bytes((FIXTURES / name).read_bytes())
    _slim(tmp_path / "external.onnx", tmp_path / "e.onnx")
    _slim(tmp_path / "mlp.onnx", tmp_path / "m.onnx")
    stored = _initializers(tmp_path / "e.onnx").values()
    assert all(t.data_location == TensorProto.EXTERNAL for t in stored)
    ext = onnx.load(str(tmp_path / "e.onnx")).graph.initializer
    inline = onnx.load(str(tmp_path / "m.onnx")).graph.initializer
    assert [t.name for t in ext] == [t.name for t in inline] == ["W1", "B1", "W2", "shape"]
    for a, b in zip(ext, inline, strict=True):
        np.testing.assert_array_equal(numpy_helper.to_array(a), numpy_helper.to_array(b))


def test_typed_fields_become_raw_data(tmp_path: Path) -> None:
    """``float_data``, ``double_data``, ``int32_data`` (float16 bits), ``int64_data`` varints
    and sparse parts decode to the values ``onnx`` reads (kept with ``--keep``)."""
    out = tmp_path / "typed.onnx"
    _slim(FIXTURES / "typed.onnx", out, keep=["*"])
    before = onnx.load(str(FIXTURES / "typed.onnx")).graph
    after = onnx.load(str(out)).graph
    for a, b in zip(before.initializer, after.initializer, strict=True):
        assert a.name == b.name
        if a.data_type != TensorProto.STRING:
            # raw_data, unless the typed fields are smaller (int64 varints): copied as they are
            assert b.HasField("raw_data") or b == a
        np.testing.assert_array_equal(numpy_helper.to_array(a), numpy_helper.to_array(b))
    sa, sb = before.sparse_initializer[0], after.sparse_initializer[0]
    for x, y in ((sa.values, sb.values), (sa.indices, sb.indices)):
        np.testing.assert_array_equal(numpy_helper.to_array(x), numpy_helper.to_array(y))


# -- bad input -------------------------------------------------------------------------------


def test_dropping_a_tensor_the_graph_reads_is_refused(tmp_path: Path) -> None:
    src = _save(_mlp(_rng()), tmp_path / "mlp.onnx")
    proc = run_cli("slim", str(src), "--drop", "buffers", "-o", str(tmp_path / "o.onnx"))
    assert_one_line_error(proc, src)
    assert "'shape'" in proc.stderr and not (tmp_path / "o.onnx").exists()


def test_corrupt_model_is_one_line(tmp_path: Path) -> None:
    data = (FIXTURES / "mlp.onnx").read_bytes()
    src = tmp_path / "cut.onnx"
    src.write_bytes(data[: len(data) // 2])
    proc = run_cli("slim", str(src), "-o", str(tmp_path / "o.onnx"))
    assert_one_line_error(proc, src)


def test_cli_json_dry_run(tmp_path: Path) -> None:
    src = _save(_mlp(_rng()), tmp_path / "mlp.onnx")
    proc = run_cli("slim", str(src), "--dry-run", "--json", "-o", str(tmp_path / "o.onnx"))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert not (tmp_path / "o.onnx").exists()
    report = modelsize.slim(src, tmp_path / "o.onnx")
    assert doc["predicted_bytes"] == report.output_files[0][1]
