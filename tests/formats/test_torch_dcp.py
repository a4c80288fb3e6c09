"""torch.distributed.checkpoint directories (reader torch-dcp).

Single-process checkpoints are written at test time by ``dcp.save`` (no process group); the
2-rank one, with tensors sharded across ranks, is committed under tests/fixtures/torch_dcp with
its generator. Expected bytes come from torch's own reading of ``.metadata`` and from
:mod:`zipfile` on each item, never from the reader under test.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import warnings
import zipfile
from pathlib import Path
from typing import Any

import pytest

from modelsize.categories import Category
from modelsize.formats import read, sniff_format
from tests.conftest import REPO, assert_one_line_error, cli_json, run_cli

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

FIXTURES = REPO / "tests" / "fixtures" / "torch_dcp"


def _save(directory: Path) -> dict[str, Any]:
    """A model, its Adam state after one step and a step counter, saved with dcp.save."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2)
    )
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 7}
    with warnings.catch_warnings():
        # "torch.distributed is disabled ... assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(directory))
    return state


def _expected(directory: Path) -> dict[Category, int]:
    md = dcp.FileSystemReader(str(directory)).read_metadata()
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    totals = dict.fromkeys(Category, 0)
    for index, info in md.storage_data.items():
        raw = (directory / info.relative_path).read_bytes()[info.offset: info.offset + info.length]
        members = zipfile.ZipFile(io.BytesIO(raw)).infolist()
        entry = md.state_dict_metadata[index.fqn]
        optim = index.fqn.startswith("optim.")
        if isinstance(entry, TensorStorageMetadata):
            data = next(m.file_size for m in members if "/data/" in m.filename)
            if optim:
                totals[Category.OPTIMIZER_STATE] += data
            elif entry.properties.dtype.is_floating_point and "running_" not in index.fqn:
                totals[Category.WEIGHTS] += data
            else:
                totals[Category.BUFFERS] += data
        elif optim:
            pkl = next(m.file_size for m in members if m.filename.endswith("data.pkl"))
            totals[Category.OPTIMIZER_STATE] += pkl
    total = sum(p.stat().st_size for p in directory.iterdir() if p.is_file())
    totals[Category.METADATA] = total - sum(totals.values())
    return totals


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    directory = tmp_path_factory.mktemp("dcp") / "ckpt"
    return directory, _save(directory)


def test_every_category_exact(saved: tuple[Path, dict[str, Any]]) -> None:
    directory, state = saved
    inv = read(directory)
    assert inv.format == "torch-dcp"
    assert inv.file_bytes == sum(p.stat().st_size for p in directory.iterdir())
    assert dict(inv.bytes_by_category) == _expected(directory)
    # Independently of the item layout: the tensors' own bytes.
    model_bytes = sum(t.numel() * t.element_size() for t in state["model"].values())
    moments = sum(t.numel() * t.element_size() for s in state["optim"]["state"].values()
                  for t in s.values())
    by = inv.bytes_by_category
    assert by[Category.WEIGHTS] + by[Category.BUFFERS] == model_bytes
    assert moments < by[Category.OPTIMIZER_STATE]  # plus the pickled param groups
    assert inv.unsafe_globals == ()  # DCP's own dataclasses are not flagged


def test_names_and_categories(saved: tuple[Path, dict[str, Any]]) -> None:
    directory, state = saved
    inv = read(directory)
    by_name = {t.name: t for t in inv.tensors}
    assert set(by_name) == {f"model.{k}" for k in state["model"]} | {
        f"optim.state.{i}.{k}" for i, s in state["optim"]["state"].items() for k in s
    }
    assert by_name["model.0.weight"].category is Category.WEIGHTS
    assert by_name["model.1.running_var"].category is Category.BUFFERS
    assert by_name["model.1.num_batches_tracked"].category is Category.BUFFERS
    assert by_name["optim.state.0.exp_avg"].category is Category.OPTIMIZER_STATE
    assert by_name["model.0.weight"].shape == (8, 4)
    assert by_name["model.0.weight"].stored_nbytes == 8 * 4 * 4
    assert inv.facts["ranks"] == "1"


def test_metadata_or_distcp_file_reads_the_whole_checkpoint(
    saved: tuple[Path, dict[str, Any]]
) -> None:
    directory, _ = saved
    distcp = next(directory.glob("*.distcp"))
    assert sniff_format(directory / ".metadata") == "torch-dcp"
    assert sniff_format(distcp) == "torch-dcp"
    assert read(distcp).file_bytes == read(directory).file_bytes


def test_two_ranks_committed_fixture() -> None:
    manifest = json.loads((FIXTURES / "MANIFEST.json").read_text())
    directory = FIXTURES / "two_ranks"
    for name, entry in manifest["files"].items():
        data = (directory / name).read_bytes()
        assert len(data) == entry["bytes"]
        assert hashlib.sha256(data).hexdigest() == entry["sha256"]
    out = cli_json("inspect", str(directory))
    assert out["format"] == "torch-dcp"
    assert {k: v for k, v in out["bytes_by_category"].items() if v} == manifest["categories"]
    names = {t["name"] for t in out["tensors"]}
    # The sharded weight is one chunk per rank, each in its rank's file.
    assert {"model.fc.weight@0,0", "model.fc.weight@4,0", "model.fc.bias"} <= names
    assert out["facts"]["ranks"] == "2"
    assert out["facts"]["rank 0"].startswith(f"{manifest['files']['__0_0.distcp']['bytes']} bytes")


def _copy(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> Path:
    directory = tmp_path / "ckpt"
    directory.mkdir()
    for p in saved[0].iterdir():
        (directory / p.name).write_bytes(p.read_bytes())
    return directory


def test_missing_distcp(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    directory = _copy(saved, tmp_path)
    next(directory.glob("*.distcp")).unlink()
    proc = run_cli("inspect", str(directory))
    assert_one_line_error(proc, ".metadata")
    assert "missing" in proc.stderr


def test_truncated_distcp(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    directory = _copy(saved, tmp_path)
    distcp = next(directory.glob("*.distcp"))
    distcp.write_bytes(distcp.read_bytes()[:-100])
    proc = run_cli("inspect", str(directory))
    assert_one_line_error(proc, distcp)
    assert "claims bytes" in proc.stderr


def _rewrite_metadata(directory: Path, change: Any) -> None:
    md = dcp.FileSystemReader(str(directory)).read_metadata()
    change(md)
    with open(directory / ".metadata", "wb") as fh:
        pickle.dump(md, fh)


def test_metadata_pointing_past_the_end(
    saved: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    directory = _copy(saved, tmp_path)

    def lie(md: Any) -> None:
        info = next(iter(md.storage_data.values()))
        info.length += 10**9

    _rewrite_metadata(directory, lie)
    proc = run_cli("inspect", str(directory))
    assert_one_line_error(proc, directory)
    assert "claims bytes" in proc.stderr


def test_metadata_item_that_is_no_archive(
    saved: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    directory = _copy(saved, tmp_path)

    def shift(md: Any) -> None:
        for index, info in md.storage_data.items():
            if index.fqn == "model.0.weight":
                info.offset += 7

    _rewrite_metadata(directory, shift)
    proc = run_cli("inspect", str(directory))
    assert_one_line_error(proc, directory)
    assert "model.0.weight" in proc.stderr


def test_metadata_escaping_the_directory(
    saved: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    directory = _copy(saved, tmp_path)

    def escape(md: Any) -> None:
        next(iter(md.storage_data.values())).relative_path = "../../etc/passwd"

    _rewrite_metadata(directory, escape)
    proc = run_cli("inspect", str(directory))
    assert_one_line_error(proc, ".metadata")
    assert "not a file name inside" in proc.stderr


def test_truncated_metadata(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    directory = _copy(saved, tmp_path)
    meta = directory / ".metadata"
    meta.write_bytes(meta.read_bytes()[:300])
    assert_one_line_error(run_cli("inspect", str(directory)), ".metadata")


def test_metadata_that_runs_code_is_reported(
    saved: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    directory = _copy(saved, tmp_path)

    class Payload:
        def __reduce__(self) -> tuple[Any, tuple[str]]:
            return (os.system, ("true",))

    def plant(md: Any) -> None:
        md.planner_data["step"] = Payload()

    _rewrite_metadata(directory, plant)
    inv = read(directory)
    assert [g for g in inv.unsafe_globals if g.endswith("system")], inv.unsafe_globals
    assert dict(inv.bytes_by_category) == _expected(directory)


def test_stale_distcp_counts_as_other(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    directory = _copy(saved, tmp_path)
    (directory / "__7_0.distcp").write_bytes(b"x" * 123)
    inv = read(directory)
    assert inv.bytes_by_category[Category.OTHER] == 123
    assert any("not referenced" in n for n in inv.notes)
