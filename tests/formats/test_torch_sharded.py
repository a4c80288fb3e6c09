"""Hugging Face directories and sharded checkpoints of torch.save shards (reader pytorch-sharded).

The sharded checkpoint is written by huggingface_hub's ``save_torch_state_dict(...,
safe_serialization=False)``, the function that names and splits ``pytorch_model-0000x-of-0000y.bin``
shards (transformers 5 no longer writes ``.bin`` weights from ``save_pretrained``), for a tiny
GPT-2 built by transformers from its config. Expected bytes come from the model's own state
dict: tied weights (``lm_head`` shares ``wte``'s storage) are counted once.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from modelsize.categories import Category
from modelsize.formats import read, sniff_format
from tests.conftest import REPO, assert_one_line_error, cli_json, run_cli

torch = pytest.importorskip("torch")


def _unique_storage_bytes(state_dict: dict[str, Any]) -> int:
    seen: dict[int, int] = {}
    for t in state_dict.values():
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A sharded GPT-2 directory and the state dict it holds."""
    transformers = pytest.importorskip("transformers")
    hub = pytest.importorskip("huggingface_hub")
    directory = tmp_path_factory.mktemp("gpt2")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16,
        bos_token_id=0, eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(config)
    config.save_pretrained(directory)
    state = model.state_dict()
    hub.save_torch_state_dict(state, directory, safe_serialization=False, max_shard_size="50KB")
    return directory, state


def _sizes(directory: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in directory.iterdir()}


def test_directory_counts_every_shard_and_the_config(gpt2: tuple[Path, dict[str, Any]]) -> None:
    directory, state = gpt2
    sizes = _sizes(directory)
    shards = sorted(n for n in sizes if n.startswith("pytorch_model-"))
    assert len(shards) > 1, "max_shard_size should have split the model"
    inv = read(directory)
    assert inv.format == "pytorch-sharded"
    assert inv.file_bytes == sum(sizes.values())
    weights = _unique_storage_bytes(state)
    by = inv.bytes_by_category
    assert by[Category.WEIGHTS] == weights
    assert by[Category.GRAPH] == sizes["config.json"]
    assert by[Category.METADATA] == inv.file_bytes - weights - sizes["config.json"]
    assert sum(v for c, v in by.items() if c not in (
        Category.WEIGHTS, Category.GRAPH, Category.METADATA)) == 0
    index = json.loads((directory / "pytorch_model.bin.index.json").read_text())
    assert index["metadata"]["total_size"] == weights
    assert {t.name for t in inv.tensors} == set(state) == set(index["weight_map"])
    assert inv.facts["shards"] == str(len(shards))
    assert inv.notes == ()


def test_index_file_alone_leaves_the_config_out(gpt2: tuple[Path, dict[str, Any]]) -> None:
    directory, state = gpt2
    sizes = _sizes(directory)
    inv = read(directory / "pytorch_model.bin.index.json")
    assert inv.format == "pytorch-sharded"
    assert inv.file_bytes == sum(sizes.values()) - sizes["config.json"]
    assert inv.bytes_by_category[Category.WEIGHTS] == _unique_storage_bytes(state)
    assert inv.bytes_by_category[Category.GRAPH] == 0


def test_cli_json(gpt2: tuple[Path, dict[str, Any]]) -> None:
    directory, state = gpt2
    out = cli_json("inspect", str(directory))
    assert out["format"] == "pytorch-sharded"
    assert out["file_bytes"] == sum(_sizes(directory).values())
    assert out["bytes_by_category"]["weights"] == _unique_storage_bytes(state)
    assert len(out["files"]) == len(_sizes(directory))


@pytest.mark.parametrize("name,legacy", [("pytorch_model.bin", False), ("model.pt", True)])
def test_single_weights_file_directory(tmp_path: Path, name: str, legacy: bool) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    state = model.state_dict()
    torch.save(state, tmp_path / name, _use_new_zipfile_serialization=not legacy)
    (tmp_path / "config.json").write_text('{"model_type": "toy"}')
    (tmp_path / "README.md").write_text("not weights")
    inv = read(tmp_path)
    assert inv.format == "pytorch-sharded"
    floats = sum(t.numel() * t.element_size() for k, t in state.items()
                 if k.endswith(("weight", "bias")))
    buffers = sum(t.numel() * t.element_size() for k, t in state.items()
                  if not k.endswith(("weight", "bias")))
    assert inv.bytes_by_category[Category.WEIGHTS] == floats
    assert inv.bytes_by_category[Category.BUFFERS] == buffers
    assert inv.bytes_by_category[Category.GRAPH] == len('{"model_type": "toy"}')
    assert inv.file_bytes == (tmp_path / name).stat().st_size + len('{"model_type": "toy"}')
    assert any("README.md" in n for n in inv.notes)


def test_safetensors_directories_stay_with_the_safetensors_reader(tmp_path: Path) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    state = {"w": torch.zeros(4, 4)}
    safetensors_torch.save_file(state, str(tmp_path / "model.safetensors"))
    torch.save(state, tmp_path / "pytorch_model.bin")
    assert sniff_format(tmp_path) == "safetensors"


def _copy(gpt2: tuple[Path, dict[str, Any]], tmp_path: Path) -> Path:
    directory = tmp_path / "model"
    shutil.copytree(gpt2[0], directory)
    return directory


def test_missing_shard(gpt2: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    directory = _copy(gpt2, tmp_path)
    (directory / "pytorch_model-00002-of-00003.bin").unlink()
    proc = run_cli("inspect", str(directory))
    assert_one_line_error(proc, "pytorch_model.bin.index.json")
    assert "missing" in proc.stderr


def test_truncated_shard(gpt2: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    directory = _copy(gpt2, tmp_path)
    shard = directory / "pytorch_model-00001-of-00003.bin"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    assert_one_line_error(run_cli("inspect", str(directory)), directory)


@pytest.mark.parametrize(
    "weight_map,expected",
    [
        ({"transformer.wte.weight": "pytorch_model-00003-of-00003.bin"}, "holds no such tensor"),
        ({"transformer.wte.weight": "../outside.bin"}, "not a file name inside"),
        ({"transformer.wte.weight": "/etc/passwd"}, "not a file name inside"),
    ],
)
def test_lying_index(
    gpt2: tuple[Path, dict[str, Any]], tmp_path: Path, weight_map: dict[str, str], expected: str
) -> None:
    directory = _copy(gpt2, tmp_path)
    index = directory / "pytorch_model.bin.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"].update(weight_map)
    index.write_text(json.dumps(doc))
    proc = run_cli("inspect", str(directory))
    assert_one_line_error(proc, index)
    assert expected in proc.stderr


def test_index_that_is_not_json(gpt2: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    directory = _copy(gpt2, tmp_path)
    index = directory / "pytorch_model.bin.index.json"
    index.write_text('{"weight_map": {"a": "pytorch_model-00001-of-00003.bin"')
    assert_one_line_error(run_cli("inspect", str(directory)), index)


def test_total_size_disagreement_is_a_note(
    gpt2: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    directory = _copy(gpt2, tmp_path)
    index = directory / "pytorch_model.bin.index.json"
    doc = json.loads(index.read_text())
    doc["metadata"]["total_size"] += 1
    index.write_text(json.dumps(doc))
    inv = read(directory)
    assert any("total_size" in n for n in inv.notes)


# -- transformers' Trainer checkpoints (committed: Trainer needs accelerate) -----------------

TRAINER = REPO / "tests" / "fixtures" / "hf_trainer"


def test_trainer_checkpoint_fixture_is_what_trainer_wrote() -> None:
    manifest = json.loads((TRAINER / "MANIFEST.json").read_text())
    for name, entry in manifest["files"].items():
        data = (TRAINER / "checkpoint-2" / name).read_bytes()
        assert len(data) == entry["bytes"]
        assert hashlib.sha256(data).hexdigest() == entry["sha256"]


def _numpy_text_bytes(path: Path) -> int:
    """File bytes of the NumPy arrays in a torch.save file (the RNG state of ``rng_state.pth``):
    pickled at protocol 2, their data is latin-1 text, UTF-8 in the file."""
    import numpy as np
    import torch

    found: list[int] = []

    def walk(obj: Any) -> None:
        if isinstance(obj, np.ndarray) and obj.dtype != object:
            found.append(len(obj.tobytes().decode("latin-1").encode("utf-8")))
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)

    walk(torch.load(path, weights_only=False))  # the committed fixture: trusted
    return sum(found)


def test_trainer_checkpoint_counts_optimizer_and_rng_files() -> None:
    manifest = json.loads((TRAINER / "MANIFEST.json").read_text())
    out = cli_json("inspect", str(TRAINER / "checkpoint-2"))
    assert out["format"] == "pytorch-sharded"
    assert out["file_bytes"] == sum(e["bytes"] for e in manifest["files"].values())
    # The manifest counts the torch tensors of the RNG file as other; its NumPy RNG state is
    # RNG state too (other), charged with the bytes of its text.
    numpy_rng = _numpy_text_bytes(TRAINER / "checkpoint-2" / "rng_state.pth")
    assert numpy_rng > 2496  # 624 uint32 of MT19937 state, UTF-8 spelled
    expected = dict(manifest["categories"])
    expected["other"] += numpy_rng
    expected["metadata"] -= numpy_rng
    assert {k: v for k, v in out["bytes_by_category"].items() if v} == expected
    assert out["facts"]["trainer_global_step"] == "2"
    assert out["notes"] == [
        "rng_state.pth: 1 NumPy array keeps its data as latin-1 text (_codecs.encode: bytes "
        f"pickled by Python 3 at protocol 2): 2,496 bytes stored as {numpy_rng:,} bytes of UTF-8"
    ]
    names = {t["name"]: t["category"] for t in out["tensors"]}
    assert names["rng_state.pth:cpu"] == "other"
    assert names["transformer.wte.weight"] == "weights"
    assert {c for n, c in names.items() if n.startswith("optimizer.pt:")} == {"optimizer_state"}
    # training_args.bin really is a pickle of transformers classes: loading it runs their code.
    assert any(g.startswith("transformers.") for g in out["unsafe_globals"])


def test_trainer_checkpoint_with_torch_weights(tmp_path: Path) -> None:
    directory = tmp_path / "checkpoint-2"
    shutil.copytree(TRAINER / "checkpoint-2", directory)
    (directory / "model.safetensors").unlink()
    torch.save({"w": torch.zeros(3, 3)}, directory / "pytorch_model.bin")
    inv = read(directory)
    assert inv.format == "pytorch-sharded"
    assert inv.bytes_by_category[Category.WEIGHTS] == 36
    manifest = json.loads((TRAINER / "MANIFEST.json").read_text())
    assert inv.bytes_by_category[Category.OPTIMIZER_STATE] == manifest["categories"][
        "optimizer_state"]
