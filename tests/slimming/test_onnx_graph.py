"""Graph passes in ``modelsize slim model.onnx``, on graphs made by the real exporters.

A CNN with BatchNorm exported by ``torch.onnx.export`` (both exporters, folding of their own
turned off so BatchNormalization nodes reach the file), a transformer encoder layer, and a
model with external data written by ``onnx.save_model``. Each output is checked against what
PyTorch itself computes (not against modelsize's own comparison), loaded by onnxruntime, and
inspected with the ``onnx`` package for the nodes the passes remove."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import modelsize
from modelsize.slimming.graph import onnx_passes
from tests.conftest import assert_one_line_error, run_cli

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402 (after the importorskip)


class _Cnn(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.b1 = torch.nn.BatchNorm2d(8)
        self.c2 = torch.nn.Conv2d(8, 16, 3, padding=1, bias=False)
        self.b2 = torch.nn.BatchNorm2d(16)
        self.fc = torch.nn.Linear(16, 4)
        self.bn = torch.nn.BatchNorm1d(4)

    def forward(self, x: Any) -> Any:
        x = torch.relu(self.b1(self.c1(x)))
        x = torch.relu(self.b2(self.c2(x)))
        return self.bn(self.fc(x.mean((2, 3))))


def _cnn() -> Any:
    torch.manual_seed(0)
    m = _Cnn()
    with torch.no_grad():
        for b in (m.b1, m.b2, m.bn):  # statistics far from the identity, so folding shows
            b.running_mean.uniform_(-1, 1)
            b.running_var.uniform_(0.5, 2)
            b.weight.uniform_(0.5, 2)
            b.bias.uniform_(-1, 1)
    return m.eval()


def _export(model: Any, args: tuple[Any, ...], path: Path, dynamo: bool) -> Path:
    """Export with the exporter's own folding off (BatchNormalization nodes stay)."""
    import warnings

    if dynamo:
        pytest.importorskip("onnxscript")  # what the dynamo exporter writes ONNX with
    kwargs: dict[str, Any] = {"optimize": False} if dynamo else {"do_constant_folding": False}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy exporter's deprecation notice
        torch.onnx.export(model, args, str(path), dynamo=dynamo, input_names=["x"],
                          verbose=False, **kwargs)
    return path


def _ops(path: Path) -> list[str]:
    return [n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node]


def _run(path: Path, x: np.ndarray) -> np.ndarray:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    s = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    return np.asarray(s.run(None, {s.get_inputs()[0].name: x})[0])


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _files_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.parent.iterdir() if p.name.startswith(path.name))


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_cnn_batchnorm_folded(tmp_path: Path, dynamo: bool) -> None:
    model = _cnn()
    x = torch.randn(2, 3, 8, 8)
    src = _export(model, (x,), tmp_path / "cnn.onnx", dynamo)
    assert _ops(src).count("BatchNormalization") == 3
    before = _sha(src)
    out = tmp_path / "cnn.slim.onnx"
    report = modelsize.slim(src, out, graph=True)
    assert _sha(src) == before
    assert "BatchNormalization" not in _ops(out)
    applied = {p.name.value: p for p in report.passes if p.applied}  # type: ignore[attr-defined]
    assert applied["fold-batchnorm"].changes == 3
    assert _files_bytes(out) < _files_bytes(src)
    with torch.no_grad():
        want = model(x).numpy()
    assert _rel(_run(out, x.numpy()), want) < 1e-5
    assert report.comparison.ok  # type: ignore[attr-defined]


class _ConvNet(torch.nn.Module):
    """Conv + BatchNorm only (the second conv with or without a bias): what onnxruntime
    folds itself when it loads the model."""

    def __init__(self, bias2: bool) -> None:
        super().__init__()
        self.c1, self.b1 = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8)
        self.c2 = torch.nn.Conv2d(8, 16, 3, stride=2, bias=bias2)
        self.b2 = torch.nn.BatchNorm2d(16)

    def forward(self, x: Any) -> Any:
        return torch.relu(self.b2(self.c2(torch.relu(self.b1(self.c1(x)))))).mean((2, 3))


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_conv_batchnorm_fold_is_bitwise_under_onnxruntime(tmp_path: Path, dynamo: bool) -> None:
    """onnxruntime folds Conv + BatchNormalization in float32 when it loads the original; the
    fold repeats its arithmetic, so both files give the same bits. (The dynamo exporter with
    its optimizer off writes a bias-less conv's zero bias as ``Expand(CastLike(0))``, which
    onnxruntime does not fold before its Conv + BN fusion: it runs that pair unfused, and no
    fold can match that bit for bit. So the no-bias path is covered by TorchScript.)"""
    torch.manual_seed(0)
    model = _ConvNet(bias2=dynamo)
    with torch.no_grad():
        for b in (model.b1, model.b2):
            b.running_mean.uniform_(-1, 1)
            b.running_var.uniform_(0.5, 2)
            b.weight.uniform_(0.5, 2)
            b.bias.uniform_(-1, 1)
    model.eval()
    x = torch.randn(4, 3, 16, 16)
    src = _export(model, (x,), tmp_path / "c.onnx", dynamo)
    assert _ops(src).count("BatchNormalization") == 2
    out = tmp_path / "c.slim.onnx"
    report = modelsize.slim(src, out, graph=True)
    assert "BatchNormalization" not in _ops(out)
    got, want = _run(out, x.numpy()), _run(src, x.numpy())
    assert got.dtype == want.dtype == np.float32
    assert np.array_equal(got, want)
    assert report.comparison.max_rel == 0.0  # type: ignore[attr-defined]


class _Block(torch.nn.Module):
    """A pre-norm transformer block: attention with two heads, then a GELU MLP."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.up, self.down = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x: Any) -> Any:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in (q, k, v))
        att = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.down(torch.nn.functional.gelu(self.up(self.ln2(x))))


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_transformer_block(tmp_path: Path, dynamo: bool) -> None:
    torch.manual_seed(0)
    layer = _Block().eval()
    x = torch.randn(1, 5, 16)
    src = _export(layer, (x,), tmp_path / "block.onnx", dynamo)
    out = tmp_path / "block.slim.onnx"
    report = modelsize.slim(src, out, graph=True)
    assert _files_bytes(out) <= _files_bytes(src)
    with torch.no_grad():
        want = layer(x).numpy()
    assert _rel(_run(out, x.numpy()), want) < 1e-5
    for p in report.passes:  # type: ignore[attr-defined]
        assert not p.applied or p.bytes_after <= p.bytes_before


def _broadcast_model(path: Path) -> Path:
    """``Y = X + Expand(c, [512, 512])``: folding the Expand would store 1 MiB for a scalar."""
    nodes = [helper.make_node("Expand", ["c", "shape"], ["big"]),
             helper.make_node("Add", ["X", "big"], ["Y"]),
             helper.make_node("Identity", ["W"], ["W2"]),
             helper.make_node("Mul", ["Y", "W2"], ["Z"]),
             helper.make_node("Mul", ["Z", "W_copy"], ["Out"])]
    w = np.arange(512, dtype=np.float32)
    inits = [numpy_helper.from_array(np.array(1.5, np.float32), "c"),
             numpy_helper.from_array(np.array([512, 512], np.int64), "shape"),
             numpy_helper.from_array(w, "W"), numpy_helper.from_array(w.copy(), "W_copy"),
             numpy_helper.from_array(np.ones(300, np.float32), "unused")]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [512, 512])],
        [helper.make_tensor_value_info("Out", TensorProto.FLOAT, [512, 512])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def test_passes_never_grow_the_file(tmp_path: Path) -> None:
    src = _broadcast_model(tmp_path / "b.onnx")
    out = tmp_path / "b.slim.onnx"
    report = modelsize.slim(src, out, graph=True)
    ops = _ops(out)
    assert "Expand" in ops and "Identity" not in ops
    names = {t.name for t in onnx.load(str(out)).graph.initializer}
    assert "unused" not in names and len(names & {"W", "W_copy"}) == 1
    assert out.stat().st_size < src.stat().st_size - 300 * 4 - 512 * 4
    x = np.random.default_rng(0).standard_normal((512, 512)).astype(np.float32)
    want = (x + 1.5) * np.arange(512, dtype=np.float32) ** 2
    np.testing.assert_allclose(_run(out, x), want, rtol=1e-6)
    done = {p.name.value: p.changes for p in report.passes if p.applied}  # type: ignore[attr-defined]
    assert done == {"identity": 1, "unused-initializers": 1, "duplicate-initializers": 1}


@pytest.mark.parametrize("quantize", ["int8", "float16", "dynamic"])
def test_quantize_within_documented_bound(tmp_path: Path, quantize: str) -> None:
    model = _cnn()
    x = torch.randn(1, 3, 8, 8)
    src = _export(model, (x,), tmp_path / "cnn.onnx", dynamo=False)
    out = tmp_path / "q.onnx"
    report = modelsize.slim(src, out, graph=True, quantize=quantize)
    with torch.no_grad():
        want = model(x).numpy()
    bound = {"int8": 0.1, "float16": 1e-2, "dynamic": 0.2}[quantize]
    assert _rel(_run(out, x.numpy()), want) < bound
    assert out.stat().st_size < src.stat().st_size
    assert report.comparison.kind != "exact"  # type: ignore[attr-defined]
    if quantize == "int8":
        assert "DequantizeLinear" in _ops(out)


def test_cli_refuses_over_tolerance_and_writes_nothing(tmp_path: Path) -> None:
    src = _export(_cnn(), (torch.randn(1, 3, 8, 8),), tmp_path / "cnn.onnx", dynamo=False)
    out = tmp_path / "q.onnx"
    proc = run_cli("slim", str(src), "-o", str(out), "--quantize", "int8", "--tolerance", "0")
    assert proc.returncode == 1, proc.stderr
    assert "tolerance" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["cnn.onnx"]


def test_cli_dry_run_existing_output_and_bad_input(tmp_path: Path) -> None:
    src = _export(_cnn(), (torch.randn(1, 3, 8, 8),), tmp_path / "cnn.onnx", dynamo=False)
    out = tmp_path / "o.onnx"
    proc = run_cli("slim", str(src), "-o", str(out), "--dry-run", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert not out.exists()
    planned = {p["name"] for p in doc["passes"] if p["applied"]}
    assert "fold-batchnorm" in planned
    proc = run_cli("slim", str(src), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "fold-batchnorm" in proc.stdout and "max rel" in proc.stdout
    assert out.stat().st_size == doc["predicted_bytes"]
    proc = run_cli("slim", str(src), "-o", str(out))
    assert_one_line_error(proc, out)
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(src.read_bytes()[:200])
    assert_one_line_error(run_cli("slim", str(bad), "-o", str(tmp_path / "b.onnx")), bad)


def test_initializer_level_slim_never_grows(tmp_path: Path) -> None:
    """``--no-graph``: small int64 values stay varints, a 4-float graph-output copy keeps its
    bytes rather than becoming an Identity node (both used to make the file larger)."""
    ids = helper.make_tensor("ids", TensorProto.INT64, [64], list(range(64)))  # int64_data
    b = np.arange(4, dtype=np.float32)
    nodes = [helper.make_node("Gather", ["table", "ids"], ["g"]),
             helper.make_node("Add", ["g", "B"], ["Y"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("table", TensorProto.FLOAT, [64, 4])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [64, 4]),
         helper.make_tensor_value_info("B_out", TensorProto.FLOAT, [4])],
        [ids, numpy_helper.from_array(b, "B"), numpy_helper.from_array(b.copy(), "B_out")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    src = tmp_path / "m.onnx"
    onnx.save(model, str(src))
    out = tmp_path / "m.slim.onnx"
    proc = run_cli("slim", str(src), "-o", str(out), "--no-graph")
    assert proc.returncode == 0, proc.stderr
    assert out.stat().st_size <= src.stat().st_size
    table = np.random.default_rng(0).standard_normal((64, 4)).astype(np.float32)
    s = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    y, b_out = s.run(None, {"table": table})
    np.testing.assert_array_equal(y, table + b)
    np.testing.assert_array_equal(b_out, b)


def _debug_fields(model: Any) -> int:
    """doc_strings and metadata entries of nodes, graph and graph values (not the model's)."""
    g = model.graph
    items = [g, *g.node, *g.input, *g.output, *g.value_info]
    return sum(len(i.metadata_props) + bool(i.doc_string) for i in items)


def test_debug_info_dropped_outputs_identical(tmp_path: Path) -> None:
    # The dynamo exporter writes a stack trace, FX node and name scopes on every node.
    model = _cnn()
    x = torch.randn(2, 3, 8, 8)
    src = _export(model, (x,), tmp_path / "cnn.onnx", True)
    proto = onnx.load(str(src))
    proto.graph.node[0].doc_string = "a note"
    helper.set_model_props(proto, {"labels": "cat,dog"})
    proto.doc_string = "model card"
    onnx.save(proto, str(src))
    fields = _debug_fields(proto)
    assert fields > len(proto.graph.node)  # several per node
    out = tmp_path / "cnn.slim.onnx"
    report = modelsize.slim(src, out, graph=True)
    applied = {p.name.value: p for p in report.passes if p.applied}  # type: ignore[attr-defined]
    assert applied["debug-info"].changes == fields
    slimmed = onnx.load(str(out))
    assert _debug_fields(slimmed) == 0
    assert {p.key: p.value for p in slimmed.metadata_props} == {"labels": "cat,dog"}
    assert slimmed.doc_string == "model card"
    with torch.no_grad():
        want = model(x).numpy()
    assert _rel(_run(out, x.numpy()), want) < 1e-5


def test_debug_info_alone_keeps_outputs_bitwise(tmp_path: Path) -> None:
    model = _cnn()
    x = torch.randn(2, 3, 8, 8)
    src = _export(model, (x,), tmp_path / "cnn.onnx", True)
    proto = onnx.load(str(src))
    before = proto.ByteSize()
    slimmed, results = onnx_passes.run_passes(proto, tmp_path, [onnx_passes.PassName.DEBUG_INFO])
    assert results[0].applied
    assert results[0].saved_bytes == before - slimmed.ByteSize() > 0
    out = tmp_path / "debug.onnx"
    onnx.save(slimmed, str(out))
    assert np.array_equal(_run(out, x.numpy()), _run(src, x.numpy()))


def test_int8_quantizes_embedding_tables(tmp_path: Path) -> None:
    torch.manual_seed(0)
    emb = torch.nn.Embedding(300, 16).eval()
    ids = torch.tensor([[0, 5, 299, 7]])
    src = _export(emb, (ids,), tmp_path / "emb.onnx", False)
    out = tmp_path / "emb.slim.onnx"
    report = modelsize.slim(src, out, graph=True, quantize="int8")
    slimmed = onnx.load(str(out))
    assert [t.data_type for t in slimmed.graph.initializer if t.dims == [300, 16]] == [
        TensorProto.INT8]
    assert _files_bytes(out) < _files_bytes(src) / 3
    s = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    got = s.run(None, {s.get_inputs()[0].name: ids.numpy()})[0]
    table = emb.weight.detach().numpy()
    want = table[ids.numpy()]
    # Symmetric per-row int8: each value within half a step (row max / 127) of the float one.
    step = np.abs(table).max(axis=1)[ids.numpy()][..., None] / 127
    assert np.all(np.abs(got - want) <= step / 2 + 1e-7)
    assert report.comparison.ok  # type: ignore[attr-defined]


def test_initializer_value_info_dropped(tmp_path: Path) -> None:
    """The dynamo exporter declares every weight's type and shape twice: in the initializer
    and in value_info. The second goes; one that disagrees with its initializer stays."""
    pytest.importorskip("onnxscript")
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    src = tmp_path / "c.onnx"
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(_ConvNet(bias2=True).eval(), (x,), str(src), dynamo=True,
                          input_names=["x"], verbose=False)
    proto = onnx.load(str(src))
    inits = {t.name for t in proto.graph.initializer}
    repeated = [v.name for v in proto.graph.value_info if v.name in inits]
    assert repeated
    odd = next(v for v in proto.graph.value_info if v.name == "c1.bias")
    odd.type.tensor_type.shape.dim[0].ClearField("dim_value")  # [8] declared as [N]
    odd.type.tensor_type.shape.dim[0].dim_param = "N"
    onnx.save(proto, str(src))
    out = tmp_path / "c.slim.onnx"
    report = modelsize.slim(src, out, graph=True)
    done = {p.name.value: p.changes for p in report.passes if p.applied}  # type: ignore[attr-defined]
    assert done["initializer-value-info"] == len(repeated) - 1
    left = [v.name for v in onnx.load(str(out)).graph.value_info if v.name in inits]
    assert left == ["c1.bias"]
    assert np.array_equal(_run(out, x.numpy()), _run(src, x.numpy()))


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_model_bytes_is_exact(tmp_path: Path, dynamo: bool) -> None:
    """What the passes are measured by: the file's size, inline or with external data, for
    tensors stored as raw bytes or in typed fields."""
    src = _export(_cnn(), (torch.randn(1, 3, 8, 8),), tmp_path / "c.onnx", dynamo)
    proto = onnx.load(str(src))
    proto.graph.initializer.append(numpy_helper.from_array(np.ones(3000, np.float32), "raw"))
    typed = helper.make_tensor("typed", TensorProto.FLOAT, [2000], [0.5] * 2000)
    proto.graph.initializer.append(typed)
    assert onnx_passes.model_bytes(proto) == len(proto.SerializeToString())
    ext = tmp_path / "e.onnx"
    onnx.save_model(proto, str(ext), save_as_external_data=True, location="w.bin",
                    size_threshold=0)
    bare = onnx.load(str(ext), load_external_data=False)
    assert onnx_passes.model_bytes(bare) == sum(
        (tmp_path / n).stat().st_size for n in ("e.onnx", "w.bin"))


def _branchy_model(path: Path) -> Path:
    """silero-vad's shape of problem: ``If(sr == 16000)`` picks a branch; the one for 16 kHz
    reflect-pads the samples by 4 (it needs 5 of them), the other reshapes them into rows of
    7 (no made-up length fits). Weights are ``Constant`` nodes, as paddle2onnx writes them,
    and one initializer nobody reads."""
    pad = helper.make_graph(
        [helper.make_node("Pad", ["X", "pads"], ["P"], mode="reflect"),
         helper.make_node("Mul", ["P", "w"], ["T"])],
        "then", [], [helper.make_tensor_value_info("T", TensorProto.FLOAT, [None, None])])
    rows = helper.make_graph(
        [helper.make_node("Reshape", ["X", "seven"], ["E"])],
        "else", [], [helper.make_tensor_value_info("E", TensorProto.FLOAT, [None, None])])
    nodes = [
        helper.make_node("Constant", [], ["rate"], value=numpy_helper.from_array(
            np.array(16000, np.int64))),
        helper.make_node("Constant", [], ["pads"], value=numpy_helper.from_array(
            np.array([0, 4, 0, 4], np.int64))),
        helper.make_node("Constant", [], ["seven"], value=numpy_helper.from_array(
            np.array([-1, 7], np.int64))),
        helper.make_node("Constant", [], ["w"], value=numpy_helper.from_array(
            np.float32(0.5))),
        helper.make_node("Equal", ["sr", "rate"], ["is16k"]),
        helper.make_node("If", ["is16k"], ["Y"], then_branch=pad, else_branch=rows),
    ]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", "samples"]),
         helper.make_tensor_value_info("sr", TensorProto.INT64, [])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, None])],
        [numpy_helper.from_array(np.ones(300, np.float32), "unused")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def test_inputs_the_original_runs_on_are_searched(tmp_path: Path, capfd: Any) -> None:
    # Free dimensions of 1 and a sample rate of 0 or 1 run neither branch; the verification
    # tries longer dimensions and the sample rate the graph compares with.
    src = _branchy_model(tmp_path / "vad.onnx")
    out = tmp_path / "vad.slim.onnx"
    report = modelsize.slim(src, out, graph=True)
    assert report.verified
    cmp = report.comparison  # type: ignore[attr-defined]
    assert cmp.inputs == "free dimensions 64, sr = 16000" and cmp.max_rel == 0
    assert "onnxruntime" not in capfd.readouterr().err  # its failed runs are not printed
    x = np.random.default_rng(1).standard_normal((2, 9)).astype(np.float32)
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    got = sess.run(None, {"X": x, "sr": np.array(16000, np.int64)})[0]
    np.testing.assert_array_equal(got, np.pad(x, ((0, 0), (4, 4)), mode="reflect") * 0.5)
    # Kept and dropped as the reader names tensors: the Constant values stay, the unread
    # initializer goes, in the report of a run and of a dry run alike.
    for r in (report, modelsize.slim(src, tmp_path / "dry.onnx", graph=True, dry_run=True)):
        assert [d.name for d in r.dropped] == ["unused"]
        assert {"rate", "pads", "seven", "w"} <= {k.name for k in r.kept}


def test_original_that_runs_on_no_made_up_input_is_one_line(tmp_path: Path) -> None:
    # The rate reaches the comparison through an Identity: no made-up input runs the 16 kHz
    # branch, and the other runs on none. Exit 2, one line, nothing written.
    src = _branchy_model(tmp_path / "vad.onnx")
    model = onnx.load(str(src))
    model.graph.node[4].input[1] = "rate_again"
    model.graph.node.insert(4, helper.make_node("Identity", ["rate"], ["rate_again"]))
    onnx.save(model, str(src))
    proc = run_cli("slim", str(src), "-o", str(tmp_path / "o.onnx"))
    assert_one_line_error(proc, src)
    assert "onnxruntime cannot run it" in proc.stderr and not (tmp_path / "o.onnx").exists()


def test_duplicate_constant_nodes_merged(tmp_path: Path) -> None:
    # paddle2onnx writes weights as Constant nodes: equal ones are stored once, and a Constant
    # equal to an initializer reads the initializer (never the other way round: a node's value
    # is not defined before the node).
    w = np.linspace(-1, 1, 256, dtype=np.float32)
    nodes = [
        helper.make_node("Mul", ["X", "W"], ["A"]),
        helper.make_node("Constant", [], ["c1"], value=numpy_helper.from_array(w)),
        helper.make_node("Add", ["A", "c1"], ["B"]),
        helper.make_node("Constant", [], ["c2"], value=numpy_helper.from_array(w * 2)),
        helper.make_node("Constant", [], ["c3"], value=numpy_helper.from_array(w * 2)),
        helper.make_node("Mul", ["B", "c2"], ["C"]),
        helper.make_node("Sub", ["C", "c3"], ["Y"]),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [4, 256])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [4, 256])],
        [numpy_helper.from_array(w, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    src, out = tmp_path / "p.onnx", tmp_path / "p.slim.onnx"
    onnx.save(model, str(src))
    report = modelsize.slim(src, out, graph=True)
    done = {p.name.value: p.changes for p in report.passes if p.applied}  # type: ignore[attr-defined]
    assert done.get("duplicate-initializers") == 2
    slim = onnx.load(str(out))
    assert [n.output[0] for n in slim.graph.node if n.op_type == "Constant"] == ["c2"]
    assert out.stat().st_size < src.stat().st_size - 2 * 256 * 4
    x = np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32)
    np.testing.assert_array_equal(_run(out, x), ((x * w) + w) * (w * 2) - w * 2)
    assert {d.name for d in report.dropped} == {"c1", "c3"}
