"""A GGUF model split by gguf-split (``m-00001-of-00003.gguf`` ...) is one model: read from its
first shard or from a folder holding its shards, locally and remotely."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from modelsize import formats
from modelsize.cli import main
from modelsize.inventory import READ_DATA, Inventory

gguf = pytest.importorskip("gguf")


def _split(folder: Path, name: str = "m", tensors: int = 5) -> list[Path]:
    """gguf-py's own split writer: 2 tensors per shard, each 4 x 8 float32."""
    folder.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(folder / f"{name}.gguf", "llama", split_max_tensors=2)
    w.add_block_count(tensors)
    for i in range(tensors):
        w.add_tensor(f"blk.{i}.w", np.full((4, 8), i, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sorted(folder.glob(f"{name}-*.gguf"))


def _read(path: Path) -> Inventory:
    token = READ_DATA.set(False)
    try:
        return formats.read(path)
    finally:
        READ_DATA.reset(token)


def test_the_first_shard_reads_the_whole_model(tmp_path: Path) -> None:
    shards = _split(tmp_path)
    assert [p.name for p in shards] == [f"m-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    inv = _read(shards[0])
    assert sorted(t.name for t in inv.tensors) == [f"blk.{i}.w" for i in range(5)]
    assert all(t.nbytes == 4 * 8 * 4 for t in inv.tensors)
    assert inv.file_bytes == sum(p.stat().st_size for p in shards)
    assert [f.path.name for f in inv.files] == [p.name for p in shards]
    assert inv.facts["gguf.architecture"] == "llama"


def test_a_folder_of_the_shards_is_the_model(tmp_path: Path) -> None:
    shards = _split(tmp_path / "model")
    (tmp_path / "model" / "README.md").write_text("# split\n")
    inv = _read(tmp_path / "model")
    assert len(inv.tensors) == 5 and len(inv.files) == 3
    assert inv.bytes_by_category == _read(shards[0]).bytes_by_category


def test_a_later_shard_alone_and_a_first_shard_without_the_others(tmp_path: Path) -> None:
    shards = _split(tmp_path)
    assert [t.name for t in _read(shards[1]).tensors] == ["blk.2.w", "blk.3.w"]
    shards[2].unlink()
    inv = _read(shards[0])
    assert [t.name for t in inv.tensors] == ["blk.0.w", "blk.1.w"]
    assert any("m-00003-of-00003.gguf not beside it" in n for n in inv.notes)


def test_a_folder_with_two_models_is_not_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                              ) -> None:
    _split(tmp_path / "two")
    shutil.copy(_split(tmp_path / "other", "q8")[0], tmp_path / "two" / "q8.gguf")
    assert main(["inspect", str(tmp_path / "two")]) == 2
    assert "give one" in capsys.readouterr().err
