"""Where an ONNX slim puts its tensors: one file, or ``OUT.data`` beside it.

The layout is chosen for the output (``--external-data auto|always|never``), not copied from
the input. Inputs are a small CNN exported by ``torch.onnx.export`` and re-saved with external
data by ``onnx.save_model``; outputs are checked against what PyTorch computes, the tensors'
locations are read with the ``onnx`` package, and input files are compared by sha256."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from modelsize import formats
from modelsize.errors import UsageError
from modelsize.slimming.graph import onnx_passes, onnx_slim
from modelsize.slimming.plan import SlimOptions
from tests.slimming.test_onnx_graph import _cnn, _export, _ops, _rel, _run, _sha

onnx = pytest.importorskip("onnx")
torch = pytest.importorskip("torch")
from onnx import TensorProto  # noqa: E402 (after the importorskip)


def _slim(src: Path, out: Path, layout: str = "auto", force: bool = False) -> Any:
    return onnx_slim.slim_onnx(formats.read(src), out, SlimOptions(graph=True), dry_run=False,
                               force=force, external_data=layout)


def _sources(tmp_path: Path, location: str = "ext.bin") -> tuple[Any, np.ndarray, Path, Path]:
    """The CNN, an input, its export with inline tensors and a copy with external data."""
    model = _cnn()
    x = torch.randn(1, 3, 8, 8)
    inline = _export(model, (x,), tmp_path / "inline.onnx", dynamo=False)
    ext = tmp_path / "ext.onnx"
    onnx.save_model(onnx.load(str(inline)), str(ext), save_as_external_data=True,
                    location=location, size_threshold=0)
    assert (tmp_path / location).stat().st_size > 0
    return model, x.numpy(), inline, ext


def _want(model: Any, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return np.asarray(model(torch.from_numpy(x)).numpy())


def _locations(path: Path) -> list[str | None]:
    """Each initializer's data file (``None``: inline)."""
    model = onnx.load(str(path), load_external_data=False)
    return [next((e.value for e in t.external_data if e.key == "location"), None)
            if t.data_location == TensorProto.EXTERNAL else None
            for t in model.graph.initializer]


def _all_bytes(*paths: Path) -> int:
    return sum(p.stat().st_size for p in paths)


def test_external_input_becomes_one_file_by_default(tmp_path: Path) -> None:
    import modelsize

    model, x, _, src = _sources(tmp_path)
    sums = {p.name: _sha(p) for p in (src, tmp_path / "ext.bin")}
    out = tmp_path / "o" / "ext.slim.onnx"
    out.parent.mkdir()
    report = modelsize.slim(src, out, graph=True)
    assert {p.name: _sha(p) for p in (src, tmp_path / "ext.bin")} == sums
    assert [p.name for p in out.parent.iterdir()] == [out.name]
    assert set(_locations(out)) == {None}
    # Written a weight at a time, initializers after the rest of the graph: what onnx reads
    # back serializes to as many bytes.
    assert out.stat().st_size == len(onnx.load(str(out)).SerializeToString())
    assert "BatchNormalization" not in _ops(out)
    assert _rel(_run(out, x), _want(model, x)) < 1e-5
    assert [p for p, _ in report.output_files] == [out]
    assert out.stat().st_size < _all_bytes(src, tmp_path / "ext.bin")


@pytest.mark.parametrize("source", ["inline", "external"])
def test_always_writes_a_data_file(tmp_path: Path, source: str) -> None:
    model, x, inline, ext = _sources(tmp_path)
    src = inline if source == "inline" else ext
    before = _all_bytes(*[p for p in tmp_path.iterdir() if p.name.startswith(src.name)
                          or (source == "external" and p.name == "ext.bin")])
    out = tmp_path / "o" / "m.onnx"
    out.parent.mkdir()
    report = _slim(src, out, "always")
    data = out.parent / "m.onnx.data"
    assert sorted(p.name for p in out.parent.iterdir()) == ["m.onnx", "m.onnx.data"]
    proto = onnx.load(str(out), load_external_data=False)
    for t in proto.graph.initializer:
        item = onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
        external = t.data_location == TensorProto.EXTERNAL
        assert external == (int(np.prod(t.dims)) * item >= onnx_passes.EXTERNAL_MIN), t.name
    assert "m.onnx.data" in _locations(out)
    assert _rel(_run(out, x), _want(model, x)) < 1e-5
    assert [p for p, _ in report.output_files] == [out, data]
    assert _all_bytes(out, data) < before


def test_auto_uses_a_data_file_only_over_the_limit(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    model, x, inline, _ = _sources(tmp_path)
    monkeypatch.setattr(onnx_slim, "MAX_PROTO", 4096)  # the CNN is about 7 kB
    out = tmp_path / "o" / "m.onnx"
    out.parent.mkdir()
    _slim(inline, out)
    assert (out.parent / "m.onnx.data").is_file()
    assert _rel(_run(out, x), _want(model, x)) < 1e-5
    never = tmp_path / "n" / "m.onnx"
    never.parent.mkdir()
    with pytest.raises(UsageError, match="--external-data"):
        _slim(inline, never, "never")
    assert list(never.parent.iterdir()) == []


def test_one_file_over_a_data_file_output_leaves_no_orphan(tmp_path: Path) -> None:
    model, x, inline, _ = _sources(tmp_path)
    out = tmp_path / "o" / "m.onnx"
    out.parent.mkdir()
    _slim(inline, out, "always")
    assert (out.parent / "m.onnx.data").is_file()
    _slim(inline, out, "auto", force=True)
    assert [p.name for p in out.parent.iterdir()] == ["m.onnx"]
    assert _rel(_run(out, x), _want(model, x)) < 1e-5


def test_the_inputs_data_file_is_never_removed_or_overwritten(tmp_path: Path) -> None:
    """An input whose data file is named like the output's: ``m.onnx`` reads ``out.onnx.data``,
    and ``out.onnx``, the output replaced, reads it too."""
    model, x, _, src = _sources(tmp_path, location="out.onnx.data")
    data = tmp_path / "out.onnx.data"
    out = tmp_path / "out.onnx"
    shutil.copy(src, out)
    before = _sha(data)
    _slim(src, out, "auto", force=True)
    assert _sha(data) == before
    assert set(_locations(out)) == {None}
    assert _rel(_run(out, x), _want(model, x)) < 1e-5
    with pytest.raises(UsageError, match="overwrite the input"):
        _slim(src, out, "always", force=True)
    assert _sha(data) == before


def test_an_unknown_layout_is_one_clear_error(tmp_path: Path) -> None:
    _, _, inline, _ = _sources(tmp_path)
    with pytest.raises(UsageError, match="auto, always, never"):
        _slim(inline, tmp_path / "o.onnx", "sometimes")
    assert not (tmp_path / "o.onnx").exists()


def test_choose_layout() -> None:
    """Inline up to the limit, a data file above it; ``never`` refuses above it."""
    limit = onnx_slim.MAX_PROTO
    auto, always, never = (onnx_slim.ExternalData(v) for v in ("auto", "always", "never"))
    assert not onnx_slim.choose_layout(auto, limit, Path("m.onnx"))
    assert onnx_slim.choose_layout(auto, limit + 1, Path("m.onnx"))
    assert onnx_slim.choose_layout(always, 1, Path("m.onnx"))
    assert not onnx_slim.choose_layout(never, limit, Path("m.onnx"))
    with pytest.raises(UsageError, match=r"m\.onnx"):
        onnx_slim.choose_layout(never, limit + 1, Path("m.onnx"))


def test_cli_external_data_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from modelsize.cli import main

    model, x, inline, _ = _sources(tmp_path)
    out = tmp_path / "cli" / "m.onnx"
    out.parent.mkdir()
    assert main(["slim", str(inline), "-o", str(out), "--external-data", "always"]) == 0
    assert "m.onnx.data" in _locations(out)
    assert _rel(_run(out, x), _want(model, x)) < 1e-5
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(["slim", str(inline), "-o", str(out), "--external-data", "sometimes"])
    assert exc.value.code == 2
