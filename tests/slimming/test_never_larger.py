"""Never larger (issue 18 item 8) and names that say the format (item 10).

A slim with nothing to drop copied nothing: it rewrote the same tensors in its own framing,
and published files grew (a legacy torch file of 312 tensors by 2,137 bytes, a whole pickled
LSTM module by 40 kB, "Saved -1.77 kB (-0%)", exit 0). Now such a slim writes the input byte
for byte (unless the format's writer stores the same tensors in less space), verified like any
output, and says there was nothing to slim; a slim that does grow a file says why. Every file
here is written by its own framework in tmp_path.
"""

from __future__ import annotations

import filecmp
import pickle
import shlex
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import modelsize
from tests.conftest import assert_one_line_error, run_cli

torch = pytest.importorskip("torch")


class _Tagger(torch.nn.Module):
    """A module pickled whole: an LSTM (its _flat_weights) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = torch.nn.LSTM(8, 16, num_layers=2)
        self.head = torch.nn.Linear(16, 4)


def _state() -> dict[str, object]:
    torch.manual_seed(0)
    return {f"layer{i}.weight": torch.randn(4, 4) for i in range(312)}


def _torch_zip(d: Path) -> Path:
    torch.save(_state(), d / "model.pt")
    return d / "model.pt"


def _torch_legacy(d: Path) -> Path:
    torch.save(_state(), d / "legacy.pt", _use_new_zipfile_serialization=False)
    return d / "legacy.pt"


def _lstm_module(d: Path) -> Path:
    torch.save(_Tagger(), d / "tagger.pt")
    return d / "tagger.pt"


def _lstm_module_legacy(d: Path) -> Path:
    torch.save(_Tagger(), d / "tagger_legacy.pt", _use_new_zipfile_serialization=False)
    return d / "tagger_legacy.pt"


def _safetensors(d: Path) -> Path:
    from safetensors.torch import save_file

    save_file(dict(list(_state().items())[:20]), str(d / "w.safetensors"))
    return d / "w.safetensors"


def _npy(d: Path) -> Path:
    np.save(d / "a.npy", np.arange(35, dtype=np.float32).reshape(5, 7))
    return d / "a.npy"


def _npz(d: Path) -> Path:
    np.savez(d / "a.npz", w=np.ones((3, 5), np.float32), b=np.arange(5))
    return d / "a.npz"


def _npz_compressed(d: Path) -> Path:
    np.savez_compressed(d / "c.npz", w=np.ones((30, 50), np.float32), b=np.arange(5))
    return d / "c.npz"


def _pickle(d: Path) -> Path:
    rng = np.random.default_rng(0)
    with open(d / "arrays.pkl", "wb") as fh:
        pickle.dump({"emb": rng.random((50, 8), dtype=np.float32), "vocab": ["a", "b"], "n": 3},
                    fh)
    return d / "arrays.pkl"


def _onnx(d: Path) -> Path:
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.random((8, 4), dtype=np.float32), "w")
    b = numpy_helper.from_array(rng.random(4, dtype=np.float32), "b")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["xw"]),
         helper.make_node("Add", ["xw", "b"], ["y"])],
        "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], [w, b])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
              d / "mlp.onnx")
    return d / "mlp.onnx"


def _gguf(d: Path) -> Path:
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(d / "m.gguf"), "llama")
    w.add_tensor("blk.0.attn_q.weight", np.ones((4, 8), np.float32))
    w.add_tensor("output_norm.weight", np.ones(8, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return d / "m.gguf"


def _trainer_folder(d: Path) -> Path:
    from safetensors.torch import save_file

    folder = d / "model"
    folder.mkdir()
    save_file({"fc.weight": torch.ones(4, 4)}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text('{"architectures": ["X"]}')
    return folder


MAKERS: dict[str, Callable[[Path], Path]] = {
    "torch-zip": _torch_zip, "torch-legacy-312": _torch_legacy, "lstm-module": _lstm_module,
    "lstm-module-legacy": _lstm_module_legacy, "safetensors": _safetensors, "npy": _npy,
    "npz": _npz, "npz-compressed": _npz_compressed, "pickle": _pickle, "onnx": _onnx,
    "gguf": _gguf, "folder": _trainer_folder,
}


#: Files whose writer stores the same tensors in less space: a pickled module becomes its
#: state dict (no module code, no class to import), np.savez's zip64 extras go.
SMALLER_REWRITE = frozenset({"lstm-module", "lstm-module-legacy", "npz"})


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_nothing_to_drop_is_a_byte_for_byte_copy(tmp_path: Path, kind: str) -> None:
    src = MAKERS[kind](tmp_path)
    report = modelsize.slim(src)  # the default: drop what inference does not need
    out = report.target
    assert report.dropped == () and report.verified
    assert report.output_bytes is not None and report.output_bytes <= report.source_bytes
    if kind in SMALLER_REWRITE:
        assert not report.copied and report.output_bytes < report.source_bytes
        return
    assert report.copied and report.output_bytes == report.source_bytes
    if src.is_dir():
        assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in src.iterdir())
        assert all(filecmp.cmp(p, out / p.name, shallow=False) for p in src.iterdir())
    else:
        assert out.name == f"{src.stem}.slim{src.suffix}"  # the input's own format and name
        assert filecmp.cmp(src, out, shallow=False)
    assert report.to_dict()["copied"] is True
    assert any(n.startswith("nothing to slim") for n in report.notes)


@pytest.mark.parametrize("kind", ["torch-legacy-312", "safetensors", "pickle"])
def test_cli_says_there_was_nothing_to_slim(tmp_path: Path, kind: str) -> None:
    src = MAKERS[kind](tmp_path)
    out = tmp_path / f"out{src.suffix}"
    proc = run_cli("slim", str(src), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "Nothing to slim: copied the input byte for byte" in proc.stdout
    assert "Saved -" not in proc.stdout
    assert filecmp.cmp(src, out, shallow=False)


class _Flat(torch.nn.Module):
    """300 small parameters viewing one flat storage (as ``flatten_parameters`` leaves an
    LSTM's): one storage pickled whole, where a state dict would hold 300."""

    def __init__(self) -> None:
        super().__init__()
        flat = torch.zeros(300 * 4)
        self.ps = torch.nn.ParameterList(
            [torch.nn.Parameter(flat[i * 4:(i + 1) * 4]) for i in range(300)])


def test_a_copied_module_pickle_says_it_keeps_its_code(tmp_path: Path) -> None:
    """A whole module whose state-dict rewrite would be larger is copied, and the report says
    the copy keeps the pickle's imports (and how to leave them behind)."""
    src = tmp_path / "flat.pt"
    torch.save(_Flat(), src)
    out = tmp_path / "out.pt"
    proc = run_cli("slim", str(src), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "Nothing to slim" in proc.stdout and "the copy is the input's pickle" in proc.stdout
    assert "--to safetensors" in proc.stdout
    assert filecmp.cmp(src, out, shallow=False)


def test_flags_with_nothing_to_do_copy_too(tmp_path: Path) -> None:
    src = _torch_legacy(tmp_path)
    for i, flags in enumerate((["--drop", "optimizer_state"], ["--cast", "float32"],
                               ["--dedupe"])):
        out = tmp_path / f"o{i}.pt"
        proc = run_cli("slim", str(src), *flags, "-o", str(out))
        assert proc.returncode == 0, proc.stderr
        assert filecmp.cmp(src, out, shallow=False), flags


def test_a_smaller_rewrite_is_still_written(tmp_path: Path) -> None:
    """Nothing dropped, but the writer stores the same tensors in less space: written."""
    src = tmp_path / "views.pt"
    big = torch.arange(300 * 70, dtype=torch.float32).reshape(300, 70)
    torch.save({"w": big.t()}, src)
    report = modelsize.slim(src, tmp_path / "o.pt")
    assert not report.copied and report.output_bytes is not None
    assert report.output_bytes <= report.source_bytes


def test_a_larger_output_says_why(tmp_path: Path) -> None:
    """A legacy torch file whose only droppable tensor is 8 bytes of RNG state: the zip it is
    written as (slim writes no legacy files) is larger, and the report says by how much and
    where the bytes went."""
    state = _state()
    state["rng_state"] = torch.zeros(2, dtype=torch.int32)
    src = tmp_path / "legacy.pt"
    torch.save(state, src, _use_new_zipfile_serialization=False)
    out = tmp_path / "o.pt"
    proc = run_cli("slim", str(src), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert out.stat().st_size > src.stat().st_size
    assert "Larger by" in proc.stdout and "Saved -" not in proc.stdout
    report = modelsize.slim(src, tmp_path / "o2.pt")
    grew = (tmp_path / "o2.pt").stat().st_size - src.stat().st_size
    note = next(n for n in report.notes if "larger than the input" in n)
    assert f"{grew:,} bytes larger" in note and "slim writes no pytorch-legacy files" in note
    assert "metadata" in note


def test_a_conversion_says_why_it_is_larger(tmp_path: Path) -> None:
    src = _safetensors(tmp_path)
    report = modelsize.slim(src, tmp_path / "o.npz", to="npz")
    if report.output_bytes is not None and report.output_bytes > report.source_bytes:
        assert any("as --to npz asks" in n for n in report.notes)
    assert not report.copied


# -- item 10: a pickle's slimmed copy is an .npz, and says so ------------------------------------


def _pickle_with_findings(d: Path) -> Path:
    rng = np.random.default_rng(0)
    w = rng.random((64, 8), dtype=np.float32)
    with open(d / "arrays.pkl", "wb") as fh:
        pickle.dump({"emb": w, "emb_copy": w.copy(), "f64": rng.random(16), "n": 3}, fh)
    return d / "arrays.pkl"


def test_pickle_fixes_name_npz_outputs_and_run_as_printed(tmp_path: Path) -> None:
    src = _pickle_with_findings(tmp_path)
    report = modelsize.inspect(src)
    actions = [f.action for f in report.findings]
    assert len(actions) == 3  # fix all, duplicates, wide dtype
    for action in actions:
        argv = shlex.split(action)
        assert argv[-1].endswith(".npz"), action
        proc = run_cli(*argv[1:], cwd=tmp_path)
        assert proc.returncode == 0, (action, proc.stderr)
        with np.load(tmp_path / argv[-1]) as z:
            assert np.array_equal(z["emb"], pickle.loads(src.read_bytes())["emb"])


def test_an_npz_is_never_written_under_a_pickle_name(tmp_path: Path) -> None:
    src = _pickle_with_findings(tmp_path)
    out = tmp_path / "arrays.slim.pkl"
    proc = run_cli("slim", str(src), "--dedupe", "-o", str(out))
    assert_one_line_error(proc, out)
    assert "arrays.slim.npz" in proc.stderr and "pickle.load" in proc.stderr
    assert not out.exists()
    with pytest.raises(modelsize.InputError, match=r"name it arrays\.slim\.npz"):
        modelsize.slim(src, out, dedupe=True)


def test_a_pickle_with_nothing_to_slim_stays_a_pickle(tmp_path: Path) -> None:
    src = _pickle(tmp_path)
    out = tmp_path / "arrays.slim.pkl"
    proc = run_cli("slim", str(src), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    with open(out, "rb") as fh:
        got = pickle.load(fh)  # our own file, written in this test
    assert set(got) == {"emb", "vocab", "n"}


@pytest.mark.parametrize("name, flags", [("o.pt", ["--to", "safetensors"]),
                                         ("o.safetensors", ["--to", "pytorch"]),
                                         ("o.pkl", ["--to", "npz"])])
def test_other_names_that_lie_are_refused(tmp_path: Path, name: str, flags: list[str]) -> None:
    src = _torch_zip(tmp_path)
    proc = run_cli("slim", str(src), *flags, "-o", str(tmp_path / name))
    assert_one_line_error(proc, tmp_path / name)
    assert not (tmp_path / name).exists()
