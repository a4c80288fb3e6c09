"""slim of partitioned checkpoints: DeepSpeed ZeRO directories and torch.distributed.checkpoint.

The DeepSpeed checkpoints under tests/fixtures/deepspeed were written by DeepSpeed itself, and
``expected/CASE.pt`` is what DeepSpeed's own ``zero_to_fp32`` consolidates from them (see that
folder's generate.py and MANIFEST.json). The DCP checkpoints under tests/fixtures/torch_dcp were
written by ``torch.distributed.checkpoint.save``; torch's own ``dcp_to_torch_save`` is run here
as the reference. Every output is loaded by torch with ``weights_only=True``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import modelsize  # noqa: E402
from modelsize import Category, formats  # noqa: E402
from modelsize.errors import CorruptFileError, UsageError  # noqa: E402
from modelsize.slimming.consolidate import logical_tensors  # noqa: E402
from modelsize.slimming.core import plan_slim  # noqa: E402
from modelsize.slimming.plan import SlimOptions  # noqa: E402
from modelsize.slimming.source import Concat, FileRange  # noqa: E402
from tests.conftest import REPO, assert_one_line_error, cli_json, run_cli  # noqa: E402

DS = REPO / "tests" / "fixtures" / "deepspeed"
DS_MANIFEST: dict[str, Any] = json.loads((DS / "MANIFEST.json").read_text())
DS_CASES = sorted(DS_MANIFEST["cases"])
DCP = REPO / "tests" / "fixtures" / "torch_dcp"


def _generator() -> Any:
    """DeepSpeed's fixture generator, for its model definitions (DeepSpeed is not imported)."""
    spec = importlib.util.spec_from_file_location("ds_fixture_generate", DS / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _reference(case: str) -> dict[str, Any]:
    entry = DS_MANIFEST["cases"][case]["expected"]
    path = DS / entry["file"]
    assert _sha(path) == entry["sha256"]
    ref = torch.load(path, weights_only=True)
    assert list(ref) == entry["keys"]
    return dict(ref)


def _no_optimizer_state(path: Path) -> None:
    after = modelsize.inspect(path).inventory.bytes_by_category
    assert after[Category.OPTIMIZER_STATE] == 0 and after[Category.GRADIENTS] == 0


# -- DeepSpeed ------------------------------------------------------------------------------


@pytest.mark.parametrize("case", DS_CASES)
def test_deepspeed_equals_zero_to_fp32(case: str, tmp_path: Path) -> None:
    src = DS / case
    before = {p: _sha(p) for p in src.rglob("*") if p.is_file()}
    out = tmp_path / "model.pt"
    report = modelsize.slim(src, out)
    assert report.verified and out.stat().st_size == report.output_bytes == report.predicted_bytes
    sd = torch.load(out, weights_only=True)
    ref = _reference(case)
    assert list(sd) == list(ref)  # zero_to_fp32's keys, in its order
    for k, v in ref.items():
        assert sd[k].dtype == v.dtype and torch.equal(sd[k], v), k
    # The keys the model loads, and a fresh model takes them (strict).
    entry = DS_MANIFEST["cases"][case]
    assert set(sd) == set(entry["model_keys"])
    model = _generator().build_model(entry["model"])
    model.load_state_dict(sd)
    _no_optimizer_state(out)
    assert {p: _sha(p) for p in before} == before


@pytest.mark.parametrize("case", ["zero1", "bf16_zero1", "zero2_tied"])
def test_master_weights_agree_with_the_module_copy(case: str, tmp_path: Path) -> None:
    """Independent of DeepSpeed's script: a ZeRO 1/2 model file keeps the module's own copy of
    every weight, the master weights rounded to its dtype."""
    out = tmp_path / "model.pt"
    modelsize.slim(DS / case, out)
    sd = torch.load(out, weights_only=True)
    module = torch.load(DS / case / "global_step1" / "mp_rank_00_model_states.pt",
                        weights_only=True)["module"]
    assert set(module) == set(sd)
    for k, v in module.items():
        assert torch.equal(sd[k].to(v.dtype), v), k
    if case.startswith("bf16"):
        assert sd["0.weight"].dtype == torch.float32  # the fp32 masters, not the bf16 copy


def test_tied_weights_are_stored_once(tmp_path: Path) -> None:
    for case in ("zero2_tied", "zero3_tied"):
        out = tmp_path / f"{case}.pt"
        report = modelsize.slim(DS / case, out)
        assert {k.name: k.alias_of for k in report.kept if k.alias_of} == {
            "head.weight": "embed.weight"}
        sd = torch.load(out, weights_only=True)
        assert sd["head.weight"].data_ptr() == sd["embed.weight"].data_ptr()


@pytest.mark.parametrize("case", ["zero1", "zero3_tied"])
def test_each_weight_is_byte_ranges_of_the_rank_files(case: str) -> None:
    inv = formats.read(DS / case)
    plan = plan_slim(inv, SlimOptions())
    optim = {f.path for f in inv.files if f.path.name.endswith("optim_states.pt")}
    frozen = {"frozen.weight", "frozen.bias"}
    ranks_used: set[Path] = set()
    for t in plan.stored:
        if t.record.category != Category.WEIGHTS or t.name in frozen:
            continue
        assert isinstance(t.source, Concat), t.name
        assert all(isinstance(p, FileRange) and p.path in optim for p in t.source.parts)
        assert t.source.nbytes == t.record.numel * 4  # fp32 masters, padding cut
        ranks_used.update(p.path for p in t.source.parts if isinstance(p, FileRange))
        size = min(f.nbytes for f in inv.files if f.path in optim)
        assert all(isinstance(p, FileRange) and p.nbytes < size for p in t.source.parts)
    assert ranks_used == optim
    if case == "zero3_tied":  # every parameter is split over both ranks
        weights = [t for t in plan.stored if t.record.category == Category.WEIGHTS]
        assert all(isinstance(t.source, Concat) and len({
            p.path for p in t.source.parts if isinstance(p, FileRange)}) == 2 for t in weights)


def test_which_weights_is_said(tmp_path: Path) -> None:
    facts = modelsize.inspect(DS / "bf16_zero1").inventory.facts
    assert facts["full_weights"].startswith("fp32 master weights")
    assert "as saved" in modelsize.inspect(DS / "bf16_nozero").inventory.facts["full_weights"]
    found = logical_tensors(formats.read(DS / "zero3"), None)
    assert found is not None
    records, _ = found
    assert any("fp32 master weights" in n and "zero_to_fp32" in n for n in found.notes)
    assert {r.category for r in records} == {Category.WEIGHTS, Category.BUFFERS,
                                             Category.OPTIMIZER_STATE}


def test_keeping_optimizer_state_keeps_the_rank_tensors(tmp_path: Path) -> None:
    out = tmp_path / "all.pt"
    report = modelsize.slim(DS / "zero1", out, drop=["gradients"])
    sd = torch.load(out, weights_only=True)
    assert not report.dropped
    moments = {k: tuple(v.shape) for k, v in sd.items() if k.endswith("exp_avg")}
    assert moments == {
        f"rank{r}.optim:optimizer_state_dict.base_optimizer_state.state.0.exp_avg": (38,)
        for r in (0, 1)}
    ref = _reference("zero1")
    assert all(torch.equal(sd[k], v) for k, v in ref.items())


def test_cast_and_safetensors_output(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    ref = _reference("zero3_tied")
    out = tmp_path / "m.safetensors"
    modelsize.slim(DS / "zero3_tied", out, to="safetensors", cast="bfloat16",
                   drop=["optimizer_state"], dedupe=True)
    got = load_file(out)
    assert set(got) | {"head.weight"} == set(ref)  # the tie is kept in the metadata
    for k, v in got.items():
        want = ref[k].to(torch.bfloat16) if ref[k].is_floating_point() else ref[k]
        assert torch.equal(v, want), k


def test_dry_run_predicts_the_size(tmp_path: Path) -> None:
    out = tmp_path / "m.pt"
    dry = modelsize.slim(DS / "zero3", out, dry_run=True)
    assert not out.exists() and dry.predicted_bytes is not None
    real = modelsize.slim(DS / "zero3", out)
    assert out.stat().st_size == dry.predicted_bytes == real.output_bytes


def test_cli_default_target_and_inspect(tmp_path: Path) -> None:
    src = tmp_path / "ckpt"
    shutil.copytree(DS / "zero3_tied", src)
    proc = run_cli("slim", str(src))
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "ckpt.slim.pt"
    assert out.is_file()
    data = cli_json("inspect", str(out))
    assert data["bytes_by_category"]["optimizer_state"] == 0
    assert "optimizer_state" not in {f["kind"] for f in data["findings"]}
    assert set(torch.load(out, weights_only=True)) == set(
        DS_MANIFEST["cases"]["zero3_tied"]["model_keys"])


def _copy_case(case: str, tmp_path: Path) -> Path:
    dst = tmp_path / case
    shutil.copytree(DS / case, dst)
    return dst


def test_missing_rank_file_is_one_clear_error(tmp_path: Path) -> None:
    src = _copy_case("zero1", tmp_path)
    (src / "global_step1" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CorruptFileError, match="partitioned over 2 ranks but 1 optimizer"):
        modelsize.slim(src, tmp_path / "out.pt")
    proc = run_cli("slim", str(src), "-o", str(tmp_path / "out.pt"))
    assert_one_line_error(proc, "global_step1")
    assert not (tmp_path / "out.pt").exists()


def test_zero3_without_optimizer_files_is_refused(tmp_path: Path) -> None:
    src = _copy_case("zero3", tmp_path)
    for f in (src / "global_step1").glob("*optim_states.pt"):
        f.unlink()
    with pytest.raises(UsageError, match="ZeRO-3 checkpoint without"):
        modelsize.slim(src, tmp_path / "out.pt")


def test_model_parallel_checkpoint_is_refused(tmp_path: Path) -> None:
    src = _copy_case("zero1", tmp_path)
    tag = src / "global_step1"
    shutil.copy(tag / "mp_rank_00_model_states.pt", tag / "mp_rank_01_model_states.pt")
    with pytest.raises(UsageError, match="tensor/pipeline-parallel"):
        modelsize.slim(src, tmp_path / "out.pt")


def test_lying_param_shapes_are_corrupt(tmp_path: Path) -> None:
    src = _copy_case("zero1", tmp_path)
    path = src / "global_step1" / "mp_rank_00_model_states.pt"
    state = torch.load(path, weights_only=True)
    state["param_shapes"][0]["0.weight"] = torch.Size([9, 4])  # 4 more than the partitions
    torch.save(state, path)
    with pytest.raises(CorruptFileError, match="ends at element 76 of group 0"):
        modelsize.slim(src, tmp_path / "out.pt")


# -- torch.distributed.checkpoint -----------------------------------------------------------


def _dcp_reference(directory: Path, tmp_path: Path) -> dict[str, Any]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ref = tmp_path / "reference.pt"
    dcp_to_torch_save(directory, ref)
    return dict(torch.load(ref, weights_only=False))


def test_dcp_layouts_fixture_is_intact() -> None:
    manifest = json.loads((DCP / "MANIFEST.json").read_text())["layouts"]
    for name, entry in manifest["files"].items():
        assert _sha(DCP / "layouts" / name) == entry["sha256"], name
    inv = formats.read(DCP / "layouts")
    assert {c.value: n for c, n in inv.bytes_by_category.items() if n} == manifest["categories"]


@pytest.mark.parametrize("case", ["two_ranks", "layouts"])
def test_dcp_equals_dcp_to_torch_save(case: str, tmp_path: Path) -> None:
    src = DCP / case
    ref = _dcp_reference(src, tmp_path)
    out = tmp_path / "model.pt"
    report = modelsize.slim(src, out)
    assert report.verified and out.stat().st_size == report.predicted_bytes
    sd = torch.load(out, weights_only=True)
    model = ref["model"]
    assert list(sd) == list(model)  # the model's keys, without the "model." container
    for k, v in model.items():
        assert sd[k].dtype == v.dtype and sd[k].shape == v.shape and torch.equal(sd[k], v), k
    _no_optimizer_state(out)


def test_dcp_keeps_the_optimizer_when_asked(tmp_path: Path) -> None:
    ref = _dcp_reference(DCP / "layouts", tmp_path)
    out = tmp_path / "all.safetensors"
    modelsize.slim(DCP / "layouts", out, drop=["gradients"], to="safetensors")
    from safetensors.torch import load_file

    got = load_file(out)
    assert torch.equal(got["optim.state.emb.weight.exp_avg"],
                       ref["optim"]["state"]["emb.weight"]["exp_avg"])
    assert torch.equal(got["model.grid3"], ref["model"]["grid3"])


def test_dcp_sources_concat_rows_and_assemble_the_rest() -> None:
    plan = plan_slim(formats.read(DCP / "layouts"), SlimOptions())
    kinds = {t.name: type(t.source).__name__ for t in plan.stored}
    assert kinds["rows.weight"] == "Concat"  # dimension 0 split 3 + 2: byte ranges in order
    assert kinds["steps"] == "FileRange"  # replicated: one chunk, read as it is
    for name in ("emb.weight", "proj.weight", "col.weight", "cube", "grid3", "t.weight",
                 "tiny"):
        assert kinds[name] == "_Assembled", name


def _rewrite_metadata(directory: Path, change: Any) -> None:
    path = directory / ".metadata"
    with path.open("rb") as fh:
        md = pickle.load(fh)  # torch's own dataclasses (a trusted file we just copied)
    change(md)
    with path.open("wb") as fh:
        pickle.dump(md, fh)


def test_dcp_chunks_that_do_not_tile_are_corrupt(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    src = tmp_path / "dcp"
    shutil.copytree(DCP / "layouts", src)

    def shift(md: Any) -> None:
        # Move one chunk of emb.weight a row down: same volume, a gap above and an overlap.
        entry = md.state_dict_metadata["model.emb.weight"]
        chunk = entry.chunks[1]
        assert tuple(chunk.offsets) == (0, 2)
        entry.chunks[1] = type(chunk)(offsets=torch.Size([1, 2]), sizes=chunk.sizes)
        old = next(k for k in md.storage_data
                   if k.fqn == "model.emb.weight" and tuple(k.offset) == (0, 2))
        md.storage_data[MetadataIndex(old.fqn, torch.Size([1, 2]), old.index)] = (
            md.storage_data.pop(old))

    _rewrite_metadata(src, shift)
    with pytest.raises(CorruptFileError, match=r"emb\.weight.*overlap"):
        modelsize.slim(src, tmp_path / "out.pt")

    def grow(md: Any) -> None:
        md.state_dict_metadata["model.rows.weight"].size = torch.Size([6, 3])

    shutil.rmtree(src)
    shutil.copytree(DCP / "layouts", src)
    _rewrite_metadata(src, grow)
    proc = run_cli("slim", str(src), "-o", str(tmp_path / "out.pt"))
    assert_one_line_error(proc, ".metadata")
    assert "rows.weight" in proc.stderr and "15 elements, the tensor 18" in proc.stderr
