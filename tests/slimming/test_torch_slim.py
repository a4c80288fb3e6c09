"""slim of PyTorch files: torch zip, legacy, bare tensors, views, modules, model directories.

Every output is loaded by torch itself (``weights_only=True``) and compared with what torch
loads from the input; sizes are checked against the files on disk.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import modelsize  # noqa: E402
from modelsize import Category  # noqa: E402
from modelsize.errors import UsageError  # noqa: E402
from tests.conftest import REPO, run_cli  # noqa: E402


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(), torch.nn.Flatten(),
        torch.nn.Linear(4 * 6 * 6, 10),
    )


def _train_checkpoint(path: Path, **extra: object) -> torch.nn.Module:
    model = _net()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 1, 8, 8)).sum().backward()
    opt.step()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), **extra}, path)
    return model


class Custom(torch.nn.Module):
    """A user's own module class: loading a pickle of it imports this test module."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _net()


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_training_checkpoint_to_weights_only(tmp_path: Path) -> None:
    src = tmp_path / "train.pt"
    model = _train_checkpoint(src, epoch=3, rng_state=torch.get_rng_state())
    before = _sha(src)
    report = modelsize.slim(src)
    out = tmp_path / "train.slim.pt"
    assert report.target == out and report.verified
    sd = torch.load(out, weights_only=True)
    expected = model.state_dict()
    assert list(sd) == list(expected)  # the model's own keys, in order
    assert all(torch.equal(sd[k], expected[k]) for k in expected)
    fresh = _net()
    fresh.load_state_dict(sd)  # strict: nothing missing, nothing extra
    assert _sha(src) == before
    assert out.stat().st_size == report.output_bytes == report.predicted_bytes
    after = modelsize.inspect(out).inventory.bytes_by_category
    assert after[Category.OPTIMIZER_STATE] == 0 and after[Category.OTHER] == 0
    weights = sum(v.numel() * v.element_size() for v in expected.values())
    assert after[Category.WEIGHTS] + after[Category.BUFFERS] == weights
    assert {d.category for d in report.dropped} == {Category.OPTIMIZER_STATE, Category.OTHER}


def test_keep_keeps_the_layout_and_plain_values(tmp_path: Path) -> None:
    src = tmp_path / "train.pt"
    model = _train_checkpoint(src, epoch=3, meta={"lr": 0.1, "tags": ["a", "b"]})
    out = tmp_path / "keep.pt"
    modelsize.slim(src, out, keep=["epoch", "meta"])
    ckpt = torch.load(out, weights_only=True)
    assert set(ckpt) == {"model", "epoch", "meta"}
    assert ckpt["epoch"] == 3 and ckpt["meta"] == {"lr": 0.1, "tags": ["a", "b"]}
    assert all(torch.equal(ckpt["model"][k], v) for k, v in model.state_dict().items())


def test_drop_only_what_is_asked(tmp_path: Path) -> None:
    src = tmp_path / "train.pt"
    _train_checkpoint(src, rng_state=torch.get_rng_state())
    report = modelsize.slim(src, tmp_path / "o.pt", drop=["optimizer_state"])
    assert {d.category for d in report.dropped} == {Category.OPTIMIZER_STATE}
    assert report.output is not None
    assert report.output.bytes_by_category[Category.OTHER] > 0  # the RNG state stays


def test_slice_writes_only_its_rows(tmp_path: Path) -> None:
    table = torch.randn(1000, 64)
    src = tmp_path / "rows.pt"
    torch.save(table[:10], src)
    report = modelsize.slim(src, tmp_path / "rows.slim.pt")
    t = torch.load(tmp_path / "rows.slim.pt", weights_only=True)
    assert isinstance(t, torch.Tensor) and torch.equal(t, table[:10])
    assert report.output is not None
    assert report.output.bytes_by_category[Category.UNUSED_STORAGE] == 0
    assert report.output.bytes_by_category[Category.WEIGHTS] == 10 * 64 * 4


@pytest.mark.parametrize("view", ["column", "transpose", "step", "offset_transpose"])
def test_non_contiguous_views(tmp_path: Path, view: str) -> None:
    big = torch.arange(300 * 70, dtype=torch.float32).reshape(300, 70)
    tensors = {
        "column": big[:, 5:8], "transpose": big.t(), "step": big[::7, ::3],
        "offset_transpose": big[10:50, 2:40].t(),
    }
    src = tmp_path / "views.pt"
    torch.save({"w": tensors[view], "full_bias": torch.ones(3)}, src)
    modelsize.slim(src, tmp_path / "out.pt")
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    assert torch.equal(got["w"], tensors[view]) and got["w"].is_contiguous()


def test_tied_weights_stay_tied(tmp_path: Path) -> None:
    emb = torch.nn.Embedding(50, 8)
    head = torch.nn.Linear(8, 50, bias=False)
    head.weight = emb.weight
    src = tmp_path / "tied.pt"
    torch.save({"emb.weight": emb.weight, "head.weight": head.weight}, src)
    modelsize.slim(src, tmp_path / "out.pt")
    sd = torch.load(tmp_path / "out.pt", weights_only=True)
    assert sd["emb.weight"].data_ptr() == sd["head.weight"].data_ptr()
    assert (tmp_path / "out.pt").stat().st_size < 50 * 8 * 4 * 2


def test_cloned_duplicate_becomes_shared_storage(tmp_path: Path) -> None:
    w = torch.randn(64, 32)
    src = tmp_path / "dup.pt"
    torch.save({"a": w, "b": w.clone()}, src)
    report = modelsize.slim(src, tmp_path / "out.pt", dedupe=True)
    sd = torch.load(tmp_path / "out.pt", weights_only=True)
    assert torch.equal(sd["a"], w) and torch.equal(sd["b"], w)
    assert sd["a"].data_ptr() == sd["b"].data_ptr()
    assert [k.alias_of for k in report.kept] == [None, "a"]
    assert modelsize.inspect(tmp_path / "out.pt").inventory.bytes_by_category[
        Category.DUPLICATES] == 0


def test_casts_match_torch(tmp_path: Path) -> None:
    torch.manual_seed(1)
    sd = {"w": torch.randn(100, 30, dtype=torch.float64) * 10, "i": torch.arange(5)}
    src = tmp_path / "f64.pt"
    torch.save(sd, src)
    for dtype in ("float32", "bfloat16", "float16"):
        out = tmp_path / f"{dtype}.pt"
        report = modelsize.slim(src, out, cast=dtype)
        got = torch.load(out, weights_only=True)
        want = sd["w"].float().to(getattr(torch, dtype))
        assert got["w"].dtype == getattr(torch, dtype)
        assert torch.equal(got["w"], want), dtype  # bit-exact: torch's own rounding
        assert torch.equal(got["i"], sd["i"])  # integers are never cast
        kept = {k.name: k for k in report.kept}
        err = (want.double() - sd["w"]).abs().max().item()
        assert kept["w"].max_abs_error == pytest.approx(err, rel=1e-6, abs=1e-12)


def test_float16_overflow_is_reported(tmp_path: Path) -> None:
    src = tmp_path / "big.pt"
    torch.save({"w": torch.tensor([1.0, 1e6, -7e4])}, src)
    report = modelsize.slim(src, tmp_path / "o.pt", cast="float16")
    assert report.kept[0].overflow == 2
    assert any("infinity" in n for n in report.notes)


def test_whole_module_with_activations_and_unsafe_class(tmp_path: Path) -> None:
    model = Custom()
    model.net[1].cached = torch.randn(100, 100)  # an activation left in a module attribute
    src = tmp_path / "whole.pt"
    torch.save(model, src)
    assert any("Custom" in g for g in modelsize.inspect(src).inventory.unsafe_globals)
    for to, name in (("same", "w.pt"), ("safetensors", "w.safetensors")):
        report = modelsize.slim(src, tmp_path / name, to=to)
        assert report.output is not None and not report.output.unsafe_globals
        assert any("unsafe" in n for n in report.notes)
    sd = torch.load(tmp_path / "w.pt", weights_only=True)
    assert list(sd) == list(model.state_dict())
    from safetensors.torch import load_file

    st = load_file(str(tmp_path / "w.safetensors"))
    assert all(torch.equal(st[k], v) for k, v in model.state_dict().items())


def test_legacy_format_input(tmp_path: Path) -> None:
    src = tmp_path / "legacy.pt"
    model = _train_checkpoint(src)
    torch.save(torch.load(src, weights_only=True), src, _use_new_zipfile_serialization=False)
    modelsize.slim(src, tmp_path / "o.pt")
    sd = torch.load(tmp_path / "o.pt", weights_only=True)
    assert all(torch.equal(sd[k], v) for k, v in model.state_dict().items())


def test_dtypes_without_legacy_storage(tmp_path: Path) -> None:
    sd = {"f8": torch.randn(4, 4).to(torch.float8_e4m3fn),
          "u16": torch.arange(6, dtype=torch.int32).to(torch.uint16),
          "bf": torch.randn(3, dtype=torch.bfloat16), "b": torch.tensor([True, False])}
    src = tmp_path / "d.pt"
    torch.save(sd, src)
    modelsize.slim(src, tmp_path / "o.pt")
    got = torch.load(tmp_path / "o.pt", weights_only=True)
    for k, v in sd.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k].view(torch.uint8),
                                                      v.view(torch.uint8)), k


def test_trainer_directory(tmp_path: Path) -> None:
    src = REPO / "tests/fixtures/hf_trainer/checkpoint-2"
    out = tmp_path / "model"
    report = modelsize.slim(src, out)
    names = sorted(p.name for p in out.iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors"]
    from safetensors.torch import load_file

    assert load_file(str(out / "model.safetensors")).keys() == load_file(
        str(src / "model.safetensors")).keys()
    assert report.output_bytes == sum(p.stat().st_size for p in out.iterdir())
    assert report.predicted_bytes == report.output_bytes


def test_trainer_directory_printed_fix_passes_untouched_files_through(tmp_path: Path) -> None:
    """Issue 18 item 15: the printed fix ``--drop optimizer_state`` of a Trainer checkpoint
    exited 2 on ``rng_state.pth`` (a NumPy RNG state pickled as latin-1 text). A file the fix
    does not touch passes through byte for byte; the output is still a Trainer checkpoint
    (its ``trainer_state.json`` kept), resumable with a fresh optimizer."""
    import shlex

    src = tmp_path / "checkpoint-2"
    shutil.copytree(REPO / "tests/fixtures/hf_trainer/checkpoint-2", src)
    fix = next(f.action for f in modelsize.inspect(src).findings
               if f.kind.value == "optimizer_state")
    argv = shlex.split(fix)
    assert argv[2:5] == [str(src), "--drop", "optimizer_state"]
    proc = run_cli(*argv[1:], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = Path(argv[-1])
    names = sorted(p.name for p in out.iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors",
                     "rng_state.pth", "trainer_state.json"]
    for name in names:
        assert _sha(out / name) == _sha(src / name), name
    rng = torch.load(out / "rng_state.pth", weights_only=False)  # the fixture's own file
    assert set(rng) >= {"python", "numpy", "cpu"}
    after = modelsize.inspect(out).inventory
    assert after.bytes_by_category[Category.OPTIMIZER_STATE] == 0
    assert after.bytes_by_category[Category.OTHER] > 0  # the RNG states, still there


def test_torch_shards_with_index(tmp_path: Path) -> None:
    src = tmp_path / "sharded"
    src.mkdir()
    torch.manual_seed(0)
    a = {"l1.weight": torch.randn(20, 10), "l1.bias": torch.randn(20)}
    b = {"l2.weight": torch.randn(5, 20).double(), "l2.bias": torch.randn(5).double()}
    torch.save(a, src / "pytorch_model-00001-of-00002.bin")
    torch.save(b, src / "pytorch_model-00002-of-00002.bin")
    index = {"metadata": {"total_size": 0}, "weight_map": {
        **{k: "pytorch_model-00001-of-00002.bin" for k in a},
        **{k: "pytorch_model-00002-of-00002.bin" for k in b}}}
    (src / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    (src / "config.json").write_text("{}")
    (src / "tokenizer.json").write_text("{}")
    out = tmp_path / "out"
    report = modelsize.slim(src, out, cast="float32")
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in src.iterdir())
    new_index = json.loads((out / "pytorch_model.bin.index.json").read_text())
    assert new_index["weight_map"] == index["weight_map"]
    got = torch.load(out / "pytorch_model-00002-of-00002.bin", weights_only=True)
    assert got["l2.weight"].dtype == torch.float32
    assert torch.equal(got["l2.weight"], b["l2.weight"].float())
    assert report.predicted_bytes == report.output_bytes
    # the first shard holds nothing to cast: it passes through as it is
    first = "pytorch_model-00001-of-00002.bin"
    assert _sha(out / first) == _sha(src / first)


def test_cli_refuses_to_overwrite(tmp_path: Path) -> None:
    src = tmp_path / "train.pt"
    _train_checkpoint(src)
    proc = run_cli("slim", str(src), "-o", str(src))
    assert proc.returncode == 2 and "overwrite the input" in proc.stderr
    (tmp_path / "o.pt").write_bytes(b"x")
    proc = run_cli("slim", str(src), "-o", str(tmp_path / "o.pt"))
    assert proc.returncode == 2 and "--force" in proc.stderr
    assert (tmp_path / "o.pt").read_bytes() == b"x"
    proc = run_cli("slim", str(src), "-o", str(tmp_path / "o.pt"), "--force")
    assert proc.returncode == 0, proc.stderr
    assert torch.load(tmp_path / "o.pt", weights_only=True)


def test_nothing_left_is_refused(tmp_path: Path) -> None:
    opt_only = tmp_path / "opt.pt"
    model = _net()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 1, 8, 8)).sum().backward()
    opt.step()
    torch.save(opt.state_dict(), opt_only)
    with pytest.raises(UsageError, match="nothing would be left"):
        modelsize.slim(opt_only, tmp_path / "o.pt")
    assert not (tmp_path / "o.pt").exists()


def test_dry_run_predicts_the_size_and_writes_nothing(tmp_path: Path) -> None:
    src = tmp_path / "train.pt"
    _train_checkpoint(src)
    before = sorted(tmp_path.iterdir())
    dry = modelsize.slim(src, tmp_path / "o.pt", dry_run=True)
    assert sorted(tmp_path.iterdir()) == before
    real = modelsize.slim(src, tmp_path / "o.pt")
    assert dry.predicted_bytes == real.output_bytes == (tmp_path / "o.pt").stat().st_size
    proc = run_cli("slim", str(src), "-o", str(tmp_path / "p.pt"), "--dry-run", "--json")
    data = json.loads(proc.stdout)
    assert data["dry_run"] and data["predicted_bytes"] == real.output_bytes
    assert not (tmp_path / "p.pt").exists()


def test_diff_pairs_every_kept_tensor(tmp_path: Path) -> None:
    src = tmp_path / "train.pt"
    model = _train_checkpoint(src)
    torch.save({"model_state_dict": model.state_dict(),
                "optimizer_state_dict": torch.load(src, weights_only=True)["optimizer"]},
               tmp_path / "b.pt")
    modelsize.slim(tmp_path / "b.pt", tmp_path / "w.pt")
    d = modelsize.diff.diff(tmp_path / "b.pt", tmp_path / "w.pt") if hasattr(
        modelsize, "diff") else __import__("modelsize.diff", fromlist=["diff"]).diff(
        tmp_path / "b.pt", tmp_path / "w.pt")
    assert d.unchanged == len(model.state_dict())
    assert not d.added  # nothing only in the slim file
    assert all(t.category == Category.OPTIMIZER_STATE for t in d.removed)


def test_json_report(tmp_path: Path) -> None:
    src = tmp_path / "train.pt"
    _train_checkpoint(src)
    proc = run_cli("slim", str(src), "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["verified"] is True
    assert data["output_bytes"] == (tmp_path / "train.slim.pt").stat().st_size
    assert data["bytes_by_category"]["optimizer_state"]["after"] == 0
    assert data["dropped_by_category"]["optimizer_state"]["tensors"] == len(
        [d for d in data["dropped"] if d["category"] == "optimizer_state"])
    assert sum(v["before"] for v in data["bytes_by_category"].values()) == data["input_bytes"]
    assert sum(v["after"] for v in data["bytes_by_category"].values()) == data["output_bytes"]


def test_output_in_a_folder_that_does_not_exist(tmp_path: Path) -> None:
    src = tmp_path / "train.pt"
    _train_checkpoint(src)
    proc = run_cli("slim", str(src), "-o", str(tmp_path / "nope" / "o.pt"))
    assert proc.returncode == 2 and "no such folder" in proc.stderr
    shutil.rmtree(tmp_path / "nope", ignore_errors=True)
