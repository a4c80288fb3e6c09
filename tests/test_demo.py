"""`modelsize demo` runs on a fresh machine and tells each story."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from importlib.resources import files
from pathlib import Path

import pytest

from modelsize import Category, inspect
from tests.conftest import assert_one_line_error, run_cli

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


def test_without_dir_the_folder_is_kept_and_the_printed_fixes_run(tmp_path: Path) -> None:
    """The demo printed fixes naming files in a temporary folder it then deleted (issue 18)."""
    proc = subprocess.run(
        [sys.executable, "-m", "modelsize", "demo", "--only", "train_checkpoint"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    (folder,) = re.findall(r"\(files in (.+)\)", proc.stdout)
    assert Path(folder).parent == tmp_path and Path(folder).is_dir()
    assert f"kept in {folder}" in proc.stdout
    fixes = re.findall(r"^\$ (modelsize slim .+)$", proc.stdout, re.M)
    assert fixes
    for fix in fixes:
        again = run_cli(*shlex.split(fix)[1:], cwd=Path(folder))
        assert again.returncode == 0, again.stderr
    assert (Path(folder) / "train.slim.pt").is_file()


def test_a_second_demo_in_the_same_folder_runs_its_fixes_again(tmp_path: Path) -> None:
    for _ in range(2):
        proc = run_cli("demo", "--only", "train_checkpoint", "--dir", str(tmp_path))
        assert proc.returncode == 0, proc.stderr
        assert "exists; use --force" not in proc.stdout
        assert "Saved" in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.pt"]


def test_dir_that_is_not_a_folder_is_one_line(tmp_path: Path) -> None:
    assert_one_line_error(run_cli("demo", "--only", "inspect", "--dir", "/dev/null"), "/dev/null")
    (tmp_path / "file").write_text("x")
    assert_one_line_error(run_cli("demo", "--dir", str(tmp_path / "file" / "sub")), "sub")


@pytest.mark.parametrize("name", ["bogus", "Inspect"])
def test_unknown_only_is_one_line(name: str) -> None:
    proc = run_cli("demo", "--only", name)
    assert_one_line_error(proc, name)
    assert "train_checkpoint" in proc.stderr and proc.stdout == ""
