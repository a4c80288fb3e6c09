"""slim of safetensors (single, sharded, directories) and NumPy files, loaded back by their
own libraries."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest

import modelsize
from modelsize import Category
from modelsize.errors import UsageError
from tests.conftest import assert_one_line_error, run_cli

safetensors_numpy = pytest.importorskip("safetensors.numpy")


def _tied(path: Path) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((500, 32), dtype=np.float32)
    tensors = {"wte.weight": emb, "lm_head.weight": emb.copy(),
               "ln.weight": np.ones(32, np.float32), "exp_avg.ln": np.zeros(32, np.float32) + 1,
               "step": np.array([3], np.int64)}
    safetensors_numpy.save_file(tensors, str(path), metadata={"format": "pt", "note": "kept"})
    return tensors


def test_dedupe_records_the_alias_and_keeps_metadata(tmp_path: Path) -> None:
    src = tmp_path / "tied.safetensors"
    tensors = _tied(src)
    report = modelsize.slim(src, tmp_path / "o.safetensors", dedupe=True)
    out = tmp_path / "o.safetensors"
    got = safetensors_numpy.load_file(str(out))
    from safetensors import safe_open

    with safe_open(str(out), "np") as f:
        meta = f.metadata()
    alias = json.loads(meta["modelsize.aliases"])
    (copy, original), = alias.items()
    assert {copy, original} == {"wte.weight", "lm_head.weight"} and copy not in got
    assert meta["note"] == "kept"
    assert np.array_equal(got[original], tensors["wte.weight"])
    assert set(got) == set(tensors) - {copy}  # --dedupe drops nothing else
    assert out.stat().st_size == report.predicted_bytes
    assert modelsize.inspect(out).inventory.bytes_by_category[Category.DUPLICATES] == 0


def test_default_slim_drops_optimizer_slots(tmp_path: Path) -> None:
    src = tmp_path / "tied.safetensors"
    _tied(src)
    report = modelsize.slim(src)
    got = safetensors_numpy.load_file(str(tmp_path / "tied.slim.safetensors"))
    assert "exp_avg.ln" not in got and "ln.weight" in got
    assert {d.name for d in report.dropped} >= {"exp_avg.ln"}


def test_cast_to_bfloat16_matches_torch(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file, save_file

    w = torch.randn(257, 33) * 3
    save_file({"w": w, "b": torch.arange(4)}, str(tmp_path / "a.safetensors"))
    modelsize.slim(tmp_path / "a.safetensors", tmp_path / "b.safetensors", cast="bfloat16")
    got = load_file(str(tmp_path / "b.safetensors"))
    assert got["w"].dtype == torch.bfloat16 and torch.equal(got["w"], w.to(torch.bfloat16))
    assert torch.equal(got["b"], torch.arange(4))


def _sharded(folder: Path) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    folder.mkdir()
    parts = {
        "model-00001-of-00002.safetensors": {"a.weight": rng.standard_normal((8, 4)),
                                             "a.grad": rng.standard_normal((8, 4))},
        "model-00002-of-00002.safetensors": {"b.weight": rng.standard_normal((3, 8))},
    }
    weight_map = {}
    for shard, tensors in parts.items():
        safetensors_numpy.save_file(tensors, str(folder / shard))
        weight_map.update(dict.fromkeys(tensors, shard))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 1}, "weight_map": weight_map}))
    (folder / "config.json").write_text('{"model_type": "x"}')
    (folder / "tokenizer.json").write_text("{}")
    return {k: v for t in parts.values() for k, v in t.items()}


def test_sharded_directory_keeps_its_shards(tmp_path: Path) -> None:
    tensors = _sharded(tmp_path / "m")
    report = modelsize.slim(tmp_path / "m")
    out = tmp_path / "m.slim"
    assert report.target == out
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(p.name for p in (tmp_path / "m").iterdir())
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {"a.weight", "b.weight"}
    shards = {k: safetensors_numpy.load_file(str(out / v)) for k, v in index["weight_map"].items()}
    assert all(np.array_equal(shards[k][k], tensors[k]) for k in index["weight_map"])
    assert index["metadata"]["total_size"] == 8 * 4 * 8 + 3 * 8 * 8
    assert report.predicted_bytes == sum(p.stat().st_size for p in out.iterdir())
    assert (out / "tokenizer.json").read_text() == "{}"


def test_sharded_dedupe_keeps_the_alias_out_of_the_index(tmp_path: Path) -> None:
    """A duplicate in another shard is stored once; the index names only stored tensors (it
    named the alias too, and the output's own verification refused it: exit 2 naming the
    staging folder; found by the fuzz target's seed check)."""
    tensors = _sharded(tmp_path / "m")
    second = tmp_path / "m" / "model-00002-of-00002.safetensors"
    safetensors_numpy.save_file({"b.weight": tensors["b.weight"],
                                 "tied.weight": tensors["a.weight"].copy()}, str(second))
    index_path = tmp_path / "m" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["tied.weight"] = second.name
    index_path.write_text(json.dumps(index))
    report = modelsize.slim(tmp_path / "m", tmp_path / "o", dedupe=True)
    assert report.verified
    index = json.loads((tmp_path / "o" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {"a.weight", "a.grad", "b.weight"}
    from safetensors import safe_open

    for name, shard in index["weight_map"].items():
        with safe_open(str(tmp_path / "o" / shard), "np") as f:
            assert np.array_equal(f.get_tensor(name), tensors[name])
    with safe_open(str(tmp_path / "o" / "model-00001-of-00002.safetensors"), "np") as f:
        assert json.loads(f.metadata()["modelsize.aliases"]) == {"tied.weight": "a.weight"}


def test_sharded_to_one_file(tmp_path: Path) -> None:
    tensors = _sharded(tmp_path / "m")
    modelsize.slim(tmp_path / "m" / "model.safetensors.index.json", tmp_path / "one.safetensors",
                   to="safetensors")
    got = safetensors_numpy.load_file(str(tmp_path / "one.safetensors"))
    assert set(got) == {"a.weight", "b.weight"}
    assert np.array_equal(got["b.weight"], tensors["b.weight"])


def test_npz_round_trip_stored_and_compressed(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    arrays = {"w": rng.standard_normal((30, 20)),
              "f": np.asfortranarray(rng.standard_normal((7, 5))),
              "be": np.arange(12, dtype=">f4").reshape(3, 4), "labels": np.array(["a", "bc"]),
              "exp_avg": np.zeros(5)}
    for save, compressed in ((np.savez, False), (np.savez_compressed, True)):
        src = tmp_path / f"a{compressed}.npz"
        save(src, **arrays)
        out = tmp_path / f"o{compressed}.npz"
        report = modelsize.slim(src, out)
        got = np.load(out)
        assert set(got.files) == set(arrays) - {"exp_avg"}
        for k in got.files:
            assert np.array_equal(got[k], arrays[k]), k
        assert got["be"].dtype == np.dtype("<f4")
        members = zipfile.ZipFile(out).infolist()
        assert all((m.compress_type == zipfile.ZIP_DEFLATED) == compressed for m in members)
        if not compressed:
            assert report.predicted_bytes == out.stat().st_size


def test_npy_cast(tmp_path: Path) -> None:
    src = tmp_path / "w.npy"
    a = np.random.default_rng(3).standard_normal((64, 64))
    np.save(src, a)
    report = modelsize.slim(src, tmp_path / "w32.npy", cast="float32")
    got = np.load(tmp_path / "w32.npy")
    assert got.dtype == np.float32 and np.array_equal(got, a.astype(np.float32))
    assert report.kept[0].max_abs_error == pytest.approx(float(np.abs(got - a).max()))
    assert report.predicted_bytes == (tmp_path / "w32.npy").stat().st_size


def test_npz_cannot_hold_bfloat16(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    torch.save({"w": torch.ones(3, dtype=torch.bfloat16)}, tmp_path / "b.pt")
    with pytest.raises(UsageError, match="cannot hold bfloat16"):
        modelsize.slim(tmp_path / "b.pt", tmp_path / "b.npz", to="npz")
    assert not (tmp_path / "b.npz").exists()


def test_to_npz_from_torch(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    sd = {"x.weight": torch.randn(4, 3), "x.bias": torch.randn(4)}
    torch.save({"model": sd, "optimizer": {"state": {}, "param_groups": []}}, tmp_path / "t.pt")
    modelsize.slim(tmp_path / "t.pt", tmp_path / "t.npz", to="npz")
    got = np.load(tmp_path / "t.npz")
    assert set(got.files) == set(sd)
    assert np.array_equal(got["x.weight"], sd["x.weight"].numpy())


def test_bytes_no_tensor_claims_are_not_copied(tmp_path: Path) -> None:
    """A byte after the last tensor (the fuzz target made one by shortening the header length):
    the safetensors library refuses the file. Nothing to dedupe copied it as it was (exit 0)
    before; now refused, and the default slim (which drops those bytes) writes a file the
    library loads."""
    from safetensors import SafetensorError, safe_open

    src = tmp_path / "stray.safetensors"
    safetensors_numpy.save_file({"w": np.arange(6, dtype=np.float32)}, str(src))
    src.write_bytes(src.read_bytes() + b"\x00")
    with pytest.raises(SafetensorError, match="not fully covered"):
        safe_open(str(src), "np")
    proc = run_cli("slim", str(src), "--dedupe", "-o", str(tmp_path / "o.safetensors"))
    assert_one_line_error(proc, src)
    assert "1 bytes of the data area belong to no tensor" in proc.stderr
    assert not (tmp_path / "o.safetensors").exists()
    modelsize.slim(src, tmp_path / "fixed.safetensors")
    with safe_open(str(tmp_path / "fixed.safetensors"), "np") as f:
        assert np.array_equal(f.get_tensor("w"), np.arange(6, dtype=np.float32))
