"""`modelsize demo` runs on a fresh machine and tells each story."""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path

import pytest

from modelsize import Category, inspect
from tests.conftest import run_cli

pytest.importorskip("torch")


def test_demo_inspect_section(tmp_path: Path) -> None:
    proc = run_cli("demo", "--only", "inspect", "--dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    out = " ".join(proc.stdout.split())
    assert "Adam" in out and "exp_avg" in out  # the training checkpoint
    assert "storage no tensor reaches" in out  # the slice
    assert "float64" in out  # the wide copy
    assert "activations cached" in out  # the whole pickled module
    assert "second copies of identical tensors" in out  # tied weights cloned
    assert "tf1_mlp_adam/model.ckpt" in out  # the TensorFlow story
    # The demo writes only where it was told to.
    assert (tmp_path / "train.pt").is_file()


def test_shipped_tensorflow_story_matches_tensorflow_numbers(tmp_path: Path) -> None:
    data = files("modelsize") / "demo_data"
    manifest = json.loads((data / "MANIFEST.json").read_text())
    folder = Path(str(data / "tf1_mlp_adam"))
    report = inspect(folder / "model.ckpt")
    by = report.inventory.bytes_by_category
    assert by[Category.WEIGHTS] == manifest["weights"]
    assert by[Category.OPTIMIZER_STATE] == manifest["optimizer_state"]
    assert report.file_bytes == sum(p.stat().st_size for p in folder.glob("model.ckpt.*"))
