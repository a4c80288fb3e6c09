"""safetensors: real files written by safetensors / huggingface_hub / transformers, and liars.

Every expected number is computed here from the file itself (the header length in its first
8 bytes, ``os.stat``) or from the tensors that were saved (``numel * element_size``).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path

import pytest

from modelsize.categories import Category
from modelsize.errors import CorruptFileError, InputError
from modelsize.formats import Registry, read
from modelsize.formats.safetensors import (
    SafetensorsIndexReader,
    SafetensorsReader,
    classify_name,
)
from modelsize.inventory import Inventory
from tests.conftest import assert_one_line_error, run_cli

torch = pytest.importorskip("torch")
st_torch = pytest.importorskip("safetensors.torch")

ONLY_SAFETENSORS = Registry([SafetensorsIndexReader(), SafetensorsReader()])


def _read(path: Path) -> Inventory:
    return read(path, ONLY_SAFETENSORS)


def _header_len(path: Path) -> int:
    return int(struct.unpack("<Q", path.read_bytes()[:8])[0])


def _nbytes(t: object) -> int:
    return int(t.numel() * t.element_size())  # type: ignore[attr-defined]


def _craft(path: Path, header: Mapping[str, object], data: bytes, pad: int = 0) -> Path:
    raw = json.dumps(header).encode() + b" " * pad
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


# -- real files --------------------------------------------------------------------------------


def test_state_dict_categories_add_up_to_the_byte(tmp_path: Path) -> None:
    sd = {
        "conv.weight": torch.randn(4, 3, 3, 3),
        "conv.bias": torch.randn(4),
        "bn.running_mean": torch.randn(4),
        "bn.running_var": torch.rand(4),
        "bn.num_batches_tracked": torch.tensor(7),
        "optimizer.state.0.exp_avg": torch.randn(4, 3),
        "fc.weight.grad": torch.randn(2, 4),
        "ema.fc.weight": torch.randn(2, 4),
        "fp16": torch.randn(5, dtype=torch.float16).to(torch.bfloat16),
    }
    path = tmp_path / "model.safetensors"
    st_torch.save_file(sd, str(path))
    inv = _read(path)

    assert inv.format == "safetensors"
    assert inv.file_bytes == path.stat().st_size
    by_name = {t.name: t for t in inv.tensors}
    assert set(by_name) == set(sd)
    for name, t in sd.items():
        rec = by_name[name]
        assert rec.shape == tuple(t.shape)
        assert rec.nbytes == rec.stored_nbytes == _nbytes(t)
    assert by_name["fp16"].dtype == "bfloat16"
    assert by_name["ema.fc.weight"].tags == ("ema",)

    def total(*names: str) -> int:
        return sum(_nbytes(sd[n]) for n in names)

    cats = inv.bytes_by_category
    assert cats[Category.WEIGHTS] == total("conv.weight", "conv.bias", "ema.fc.weight", "fp16")
    assert cats[Category.BUFFERS] == total(
        "bn.running_mean", "bn.running_var", "bn.num_batches_tracked"
    )
    assert cats[Category.OPTIMIZER_STATE] == total("optimizer.state.0.exp_avg")
    assert cats[Category.GRADIENTS] == total("fc.weight.grad")
    assert cats[Category.METADATA] == 8 + _header_len(path)
    assert cats[Category.OTHER] == cats[Category.DUPLICATES] == 0
    assert sum(cats.values()) == path.stat().st_size


def test_numpy_file_with_metadata(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    st_numpy = pytest.importorskip("safetensors.numpy")
    arrays = {"a": np.arange(10, dtype=np.int32), "b": np.ones((3, 5), dtype=np.float64)}
    path = tmp_path / "arrays.safetensors"
    st_numpy.save_file(arrays, str(path), metadata={"format": "np", "note": "x" * 300})
    inv = _read(path)
    assert inv.bytes_by_category[Category.BUFFERS] == arrays["a"].nbytes
    assert inv.bytes_by_category[Category.WEIGHTS] == arrays["b"].nbytes
    assert inv.bytes_by_category[Category.METADATA] == 8 + _header_len(path)
    assert inv.facts["safetensors_format"] == "np"
    assert inv.facts["path"] == str(path)


def test_cloned_tied_weight_is_a_duplicate(tmp_path: Path) -> None:
    emb = torch.randn(16, 8)
    path = tmp_path / "tied.safetensors"
    st_torch.save_file({"embed.weight": emb, "lm_head.weight": emb.clone()}, str(path))
    inv = _read(path)
    by_name = {t.name: t for t in inv.tensors}
    assert by_name["embed.weight"].category is Category.WEIGHTS
    assert by_name["lm_head.weight"].category is Category.DUPLICATES
    assert by_name["lm_head.weight"].duplicate_of == "embed.weight"
    assert inv.bytes_by_category[Category.DUPLICATES] == _nbytes(emb)
    assert inv.bytes_by_category[Category.WEIGHTS] == _nbytes(emb)


def test_sub_byte_and_fnuz_dtypes(tmp_path: Path) -> None:
    if not hasattr(torch, "float4_e2m1fn_x2"):
        pytest.skip("torch without float4")
    packed = torch.zeros(4, 8, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    fnuz = torch.zeros(3, dtype=torch.float8_e4m3fnuz)
    path = tmp_path / "fp4.safetensors"
    st_torch.save_file({"w4": packed, "w8": fnuz}, str(path))
    by_name = {t.name: t for t in _read(path).tensors}
    # safetensors writes F4 with a shape in 4-bit elements: 32 packed bytes = 64 elements.
    assert by_name["w4"].dtype == "float4_e2m1fn"
    assert by_name["w4"].nbytes == 32
    assert by_name["w8"].dtype == "float8_e4m3fnuz"
    assert by_name["w8"].nbytes == 3


@pytest.mark.parametrize(
    ("name", "floating", "category", "tags"),
    [
        ("model.layers.0.mlp.up_proj.weight", True, Category.WEIGHTS, ()),
        ("bn1.running_var", True, Category.BUFFERS, ()),
        ("bn1.num_batches_tracked", False, Category.BUFFERS, ()),
        ("embeddings.position_ids", False, Category.BUFFERS, ()),
        ("rotary_emb.inv_freq", True, Category.BUFFERS, ()),
        ("layers.0.attn.q_proj.qweight", False, Category.WEIGHTS, ()),
        ("layers.0.attn.q_proj.weight.absmax", True, Category.WEIGHTS, ()),
        ("labels", False, Category.BUFFERS, ()),
        ("optimizer.state.3.exp_avg_sq", True, Category.OPTIMIZER_STATE, ()),
        ("state.fc.momentum_buffer", True, Category.OPTIMIZER_STATE, ()),
        ("fc.weight.grad", True, Category.GRADIENTS, ()),
        ("ema.fc.weight", True, Category.WEIGHTS, ("ema",)),
        ("model_ema.bn.running_mean", True, Category.BUFFERS, ("ema",)),
        ("params/dense/kernel", True, Category.WEIGHTS, ()),
    ],
)
def test_classify_name(
    name: str, floating: bool, category: Category, tags: tuple[str, ...]
) -> None:
    assert classify_name(name, floating) == (category, tags)


# -- sharded checkpoints and directories -------------------------------------------------------


def _sharded(tmp_path: Path) -> tuple[Path, dict[str, object]]:
    hub = pytest.importorskip("huggingface_hub")
    torch.manual_seed(0)
    sd = {f"layers.{i}.weight": torch.randn(32, 32) for i in range(4)}
    sd["norm.running_mean"] = torch.randn(32)
    out = tmp_path / "ckpt"
    out.mkdir()
    hub.save_torch_state_dict(sd, out, max_shard_size="5KB")
    return out, sd


def test_sharded_index_covers_index_and_every_shard(tmp_path: Path) -> None:
    out, sd = _sharded(tmp_path)
    index = out / "model.safetensors.index.json"
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) > 1
    inv = _read(index)

    assert inv.format == "safetensors-index"
    assert {f.path.name for f in inv.files} == {index.name} | {s.name for s in shards}
    assert inv.file_bytes == index.stat().st_size + sum(s.stat().st_size for s in shards)
    cats = inv.bytes_by_category
    assert cats[Category.WEIGHTS] == sum(_nbytes(t) for n, t in sd.items() if "weight" in n)
    assert cats[Category.BUFFERS] == _nbytes(sd["norm.running_mean"])
    headers = sum(8 + _header_len(s) for s in shards)
    assert cats[Category.METADATA] == index.stat().st_size + headers
    assert sum(cats.values()) == inv.file_bytes
    assert inv.facts["path"] == str(index)
    assert not inv.notes


def test_directory_with_index_reads_the_same(tmp_path: Path) -> None:
    out, _ = _sharded(tmp_path)
    config = out / "config.json"
    config.write_text(json.dumps({"model_type": "toy", "hidden_size": 32}))
    (out / "tokenizer.json").write_text("{}")
    by_index = _read(out / "model.safetensors.index.json")
    inv = _read(out)
    assert inv.format == "safetensors-index"
    assert inv.facts["path"] == str(out)
    assert inv.bytes_by_category[Category.GRAPH] == config.stat().st_size
    assert inv.file_bytes == by_index.file_bytes + config.stat().st_size
    assert any("tokenizer.json" in n for n in inv.notes)


def test_directory_without_index(tmp_path: Path) -> None:
    """Shards named as Hugging Face names them are one model without an index."""
    w = torch.randn(8, 8)
    st_torch.save_file({"w": w}, str(tmp_path / "model-00001-of-00002.safetensors"))
    st_torch.save_file({"head.w": torch.randn(2, 8)},
                       str(tmp_path / "model-00002-of-00002.safetensors"))
    inv = _read(tmp_path)
    assert inv.format == "safetensors"
    assert len(inv.files) == 2
    assert inv.bytes_by_category[Category.WEIGHTS] == _nbytes(w) + 2 * 8 * 4
    assert inv.file_bytes == sum(p.stat().st_size for p in tmp_path.iterdir())


@pytest.mark.parametrize("names", [
    ("tied.safetensors", "tied.slim.safetensors"),
    ("model.safetensors", "adapter.safetensors"),
    ("model-00001-of-00002.safetensors", "model-00001-of-00003.safetensors"),
    ("model-00001-of-00002.safetensors", "other-00002-of-00002.safetensors"),
])
def test_separate_models_in_one_folder_are_refused(tmp_path: Path, names: tuple[str, ...]
                                                   ) -> None:
    """Issue 18 item 22: files that share a folder without an index or shard names are
    separate models: adding them up invents duplicates and a --dedupe that merges them."""
    t = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    for name in names:
        st_torch.save_file({"embed.weight": t, "head.weight": t.clone()}, str(tmp_path / name))
    with pytest.raises(InputError, match="separate safetensors models"):
        _read(tmp_path)
    proc = run_cli("inspect", str(tmp_path))
    assert_one_line_error(proc, tmp_path)
    assert all(n in proc.stderr for n in names)
    assert _read(tmp_path / names[0]).format == "safetensors"  # each file alone reads


@pytest.mark.slow
def test_transformers_save_pretrained_sharded(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, vocab_size=100, n_positions=64, n_head=2,
        bos_token_id=0, eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(config)
    model.save_pretrained(tmp_path, max_shard_size="50KB")
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert len(shards) > 1
    inv = _read(tmp_path)
    saved = {k for s in shards for k in json.loads(s.read_bytes()[8 : 8 + _header_len(s)])}
    saved.discard("__metadata__")
    params = {n: p for n, p in model.state_dict().items() if n in saved}
    assert inv.bytes_by_category[Category.WEIGHTS] == sum(_nbytes(p) for p in params.values())
    assert inv.bytes_by_category[Category.GRAPH] == (tmp_path / "config.json").stat().st_size
    assert inv.file_bytes == sum(p.stat().st_size for p in tmp_path.iterdir())


def test_missing_shard_is_named(tmp_path: Path) -> None:
    out, _ = _sharded(tmp_path)
    victim = sorted(out.glob("*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(CorruptFileError, match=victim.name):
        _read(out / "model.safetensors.index.json")
    with pytest.raises(CorruptFileError, match=victim.name):
        _read(out)


def test_index_may_not_leave_its_directory(tmp_path: Path) -> None:
    outside = tmp_path / "outside.safetensors"
    st_torch.save_file({"w": torch.zeros(2)}, str(outside))
    inner = tmp_path / "ckpt"
    inner.mkdir()
    index = inner / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {"w": "../outside.safetensors"}}))
    with pytest.raises(CorruptFileError, match="inside the index's directory"):
        _read(index)


def test_hub_cache_layout_with_symlinked_shards(tmp_path: Path) -> None:
    out, sd = _sharded(tmp_path)
    snapshot = tmp_path / "snapshots" / "abc123"
    blobs = tmp_path / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, f in enumerate(sorted(out.iterdir())):
        blob = blobs / f"blob{i}"
        f.rename(blob)
        (snapshot / f.name).symlink_to(Path("..", "..", "blobs", blob.name))
    inv = _read(snapshot)
    assert inv.file_bytes == sum(b.stat().st_size for b in blobs.iterdir())
    assert inv.bytes_by_category[Category.WEIGHTS] == sum(
        _nbytes(t) for n, t in sd.items() if "weight" in n
    )


def test_index_naming_the_wrong_shard(tmp_path: Path) -> None:
    out, _ = _sharded(tmp_path)
    index = out / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"]["ghost.weight"] = sorted(doc["weight_map"].values())[0]
    index.write_text(json.dumps(doc))
    with pytest.raises(CorruptFileError, match=r"ghost\.weight"):
        _read(index)


def test_index_total_size_disagreement_is_a_note(tmp_path: Path) -> None:
    out, _ = _sharded(tmp_path)
    index = out / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["metadata"]["total_size"] += 1
    index.write_text(json.dumps(doc))
    assert any("total_size" in n for n in _read(index).notes)


# -- stray bytes and liars ---------------------------------------------------------------------


def test_hole_and_trailing_bytes_are_other(tmp_path: Path) -> None:
    header = {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [1], "data_offsets": [12, 16]},
    }
    path = _craft(tmp_path / "holes.safetensors", header, bytes(range(16)) + b"tail!", pad=3)
    inv = _read(path)
    assert inv.bytes_by_category[Category.OTHER] == 4 + 5
    assert inv.bytes_by_category[Category.WEIGHTS] == 12
    assert inv.bytes_by_category[Category.METADATA] == 8 + _header_len(path)
    assert any("belong to no tensor" in n for n in inv.notes)


def _good_header() -> dict[str, object]:
    return {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}


LIARS: dict[str, tuple[dict[str, object], bytes, str]] = {
    "offsets_past_end": (
        {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}, bytes(8),
        "run past the data area",
    ),
    "shape_vs_offsets": (
        {"w": {"dtype": "F32", "shape": [3, 2], "data_offsets": [0, 16]}}, bytes(16),
        "needs 24 bytes",
    ),
    "unknown_dtype": (
        {"w": {"dtype": "F33", "shape": [4], "data_offsets": [0, 16]}}, bytes(16),
        "unknown dtype",
    ),
    "negative_dim": (
        {"w": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}}, bytes(16),
        "non-negative",
    ),
    "bool_dim": (
        {"w": {"dtype": "U8", "shape": [True], "data_offsets": [0, 1]}}, bytes(1),
        "non-negative",
    ),
    "reversed_offsets": (
        {"w": {"dtype": "U8", "shape": [0], "data_offsets": [4, 0]}}, bytes(4),
        "begin <= end",
    ),
    "overlap": (
        {
            "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]},
        },
        bytes(range(16)), "overlaps",
    ),
    "metadata_not_object": ({**_good_header(), "__metadata__": [1]}, bytes(16), "__metadata__"),
    "entry_not_object": ({"w": 3}, bytes(16), "expected an object"),
    "huge_shape": (
        {"w": {"dtype": "F64", "shape": [2**40, 2**40], "data_offsets": [0, 16]}}, bytes(16),
        "needs",
    ),
    "million_dims": (
        {"w": {"dtype": "F32", "shape": [2**60] * 1_000_000, "data_offsets": [0, 16]}},
        bytes(16), "needs more bytes than the data area",
    ),
}


@pytest.mark.parametrize("case", sorted(LIARS))
def test_lying_header_is_corrupt(tmp_path: Path, case: str) -> None:
    header, data, message = LIARS[case]
    path = _craft(tmp_path / f"{case}.safetensors", header, data)
    with pytest.raises(CorruptFileError, match=message):
        _read(path)


def test_header_length_past_end_of_file(tmp_path: Path) -> None:
    path = tmp_path / "trunc.safetensors"
    st_torch.save_file({"w": torch.randn(64)}, str(path))
    raw = path.read_bytes()
    path.write_bytes(raw[: 8 + _header_len(path) // 2])
    with pytest.raises(CorruptFileError, match="header"):
        _read(path)


def test_header_length_above_limit_is_refused_before_reading(tmp_path: Path) -> None:
    path = tmp_path / "huge.safetensors"
    path.write_bytes(struct.pack("<Q", 2**62) + b'{"w": 1}')
    with pytest.raises(CorruptFileError, match=r"header claims bytes 8\.\.") as err:
        _read(path)
    assert "but the file has 16" in str(err.value)


def test_truncated_data(tmp_path: Path) -> None:
    path = tmp_path / "short.safetensors"
    st_torch.save_file({"w": torch.randn(64)}, str(path))
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(CorruptFileError, match="run past"):
        _read(path)


@pytest.mark.parametrize(
    "raw", [b"{not json", b'["a list"]', b'{"w": {"dtype": "F32"}, "w": {}}', b"\xff\xfe{}"]
)
def test_bad_json_header(tmp_path: Path, raw: bytes) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(InputError):
        _read(path)


def test_bad_index_json(tmp_path: Path) -> None:
    index = tmp_path / "model.safetensors.index.json"
    index.write_text('{"weight_map": {"w": 5}}')
    with pytest.raises(CorruptFileError, match="weight_map"):
        _read(index)
    index.write_text('{"weight_map": ')
    with pytest.raises(CorruptFileError, match="JSON"):
        _read(index)


def test_cli_reports_one_line(tmp_path: Path) -> None:
    path = _craft(
        tmp_path / "liar.safetensors",
        {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}, bytes(4),
    )
    assert_one_line_error(run_cli("inspect", str(path)), path)


def test_classify_name_searches_every_name_a_special_word_could_be_in() -> None:
    """classify_name searches with _SPECIAL only names holding one of _SPECIAL_HINTS: every
    word _SPECIAL finds holds one, and classify_name tests each of them."""
    import inspect as pyinspect

    from modelsize.formats import safetensors as st

    words = (st._EMA_PARTS | st._GRAD_PARTS | st._OPTIMIZER_PARTS | st._OPTIMIZER_SLOTS
             | {"ema_model_x", "x_ema"})
    for word in words:
        assert st._SPECIAL.search(f"a.{word}") is not None, word
        assert any(hint in word for hint in st._SPECIAL_HINTS), word
    source = pyinspect.getsource(st.classify_name)
    assert all(f'"{hint}" in low' in source for hint in st._SPECIAL_HINTS)
    for name, floating in [("m.exp_avg", True), ("ema.w", True), ("w.grad", True),
                           ("opt_state.0.mu", True), ("layer.0.weight", True),
                           ("bn.running_mean", True), ("x.momentum_buffer", True)]:
        special = st._SPECIAL.search(name.lower()) is not None
        assert (st.classify_name(name, floating)[0].value in ("optimizer_state", "gradients")
                or "ema" in st.classify_name(name, floating)[1]) == special, name
