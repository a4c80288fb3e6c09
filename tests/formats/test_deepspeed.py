"""DeepSpeed checkpoint directories (reader deepspeed).

The checkpoints under tests/fixtures/deepspeed were written by DeepSpeed 0.19.8 itself
(``engine.save_checkpoint`` on CPU, 2 ranks over gloo; see its generate.py). DeepSpeed is not
needed here: the expected bytes per category were recorded at generation time from
``torch.load`` of each file, and are checked against the files' sha256 first.
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

FIXTURES = REPO / "tests" / "fixtures" / "deepspeed"
MANIFEST: dict[str, Any] = json.loads((FIXTURES / "MANIFEST.json").read_text())
CASES = sorted(MANIFEST["cases"])


def _expected(files: dict[str, Any], only: str = "") -> dict[str, int]:
    totals: dict[str, int] = {}
    size = 0
    for rel, entry in files.items():
        if not rel.startswith(only):
            continue
        size += entry["bytes"]
        for cat, n in (entry.get("tensor_bytes") or {}).items():
            totals[cat] = totals.get(cat, 0) + n
    totals["metadata"] = size - sum(totals.values())
    return {k: v for k, v in totals.items() if v}


@pytest.mark.parametrize("case", CASES)
def test_fixture_is_what_deepspeed_wrote(case: str) -> None:
    for rel, entry in MANIFEST["cases"][case]["files"].items():
        data = (FIXTURES / case / rel).read_bytes()
        assert len(data) == entry["bytes"], rel
        assert hashlib.sha256(data).hexdigest() == entry["sha256"], rel


@pytest.mark.parametrize("case", CASES)
def test_every_category_exact(case: str) -> None:
    files = MANIFEST["cases"][case]["files"]
    inv = read(FIXTURES / case)
    assert inv.format == "deepspeed"
    assert inv.file_bytes == sum(e["bytes"] for e in files.values())
    got = {c.value: n for c, n in inv.bytes_by_category.items() if n}
    assert got == _expected(files)
    assert len(inv.files) == len(files)


@pytest.mark.parametrize("case", CASES)
def test_tag_directory_alone(case: str) -> None:
    files = MANIFEST["cases"][case]["files"]
    tag = MANIFEST["cases"][case]["latest"]
    inv = read(FIXTURES / case / tag)
    assert inv.format == "deepspeed"
    got = {c.value: n for c, n in inv.bytes_by_category.items() if n}
    assert got == _expected(files, only=tag + "/")


def test_model_and_optimizer_split_per_rank() -> None:
    out = cli_json("inspect", str(FIXTURES / "zero1"))
    files = MANIFEST["cases"]["zero1"]["files"]
    facts = out["facts"]
    assert facts["tag"] == "global_step1"
    assert facts["zero"].startswith("ZeRO stage 1 or 2")
    for rank in (0, 1):
        entry = files[f"global_step1/zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"]
        optim = entry["tensor_bytes"]["optimizer_state"]
        assert facts[f"rank {rank} optimizer states"].startswith(f"{entry['bytes']} bytes:")
        assert f"{optim} optimizer_state" in facts[f"rank {rank} optimizer states"]
    model = files["global_step1/mp_rank_00_model_states.pt"]
    assert facts["mp rank 0 model states"].startswith(f"{model['bytes']} bytes:")
    assert facts["model_states_bytes"] == str(model["bytes"])
    # DeepSpeed's own data classes need DeepSpeed to unpickle but run no foreign code.
    assert out["unsafe_globals"] == []
    assert "deepspeed" in facts["unpickling_needs"]
    names = {t["name"]: t for t in out["tensors"]}
    assert names["mp0.model:module.0.weight"]["category"] == "weights"
    assert names["mp0.model:module.position_ids"]["category"] == "buffers"
    flat = "rank0.optim:optimizer_state_dict.single_partition_of_fp32_groups.0"
    assert names[flat]["category"] == "optimizer_state"


def test_fp32_master_weights_of_the_model_file_are_optimizer_state() -> None:
    inv = read(FIXTURES / "bf16_nozero")
    fp32 = [t for t in inv.tensors if ".fp32_groups." in t.name]
    assert fp32 and all(t.category is Category.OPTIMIZER_STATE for t in fp32)
    assert all(t.dtype == "float32" for t in fp32)
    assert {t.dtype for t in inv.tensors if t.name.startswith("mp0.model:module.")
            and t.category is Category.WEIGHTS} == {"bfloat16"}
    assert inv.facts["zero"].startswith("no ZeRO")


def test_zero3_says_where_the_weights_are() -> None:
    inv = read(FIXTURES / "zero3")
    assert inv.facts["zero"].startswith("ZeRO stage 3")
    assert inv.bytes_by_category[Category.WEIGHTS] == 0
    assert any("zero_to_fp32" in n for n in inv.notes)


def test_one_file_is_a_plain_torch_checkpoint() -> None:
    path = FIXTURES / "zero1" / "global_step1" / "mp_rank_00_model_states.pt"
    assert sniff_format(path) == "pytorch"


def _copy(tmp_path: Path, case: str = "zero1") -> Path:
    root = tmp_path / case
    shutil.copytree(FIXTURES / case, root)
    return root


def test_helper_scripts_are_left_out_with_a_note(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    (root / "zero_to_fp32.py").write_text("# DeepSpeed copies this script beside checkpoints\n")
    inv = read(root)
    assert inv.file_bytes == sum(e["bytes"] for e in MANIFEST["cases"]["zero1"]["files"].values())
    assert any("zero_to_fp32.py" in n for n in inv.notes)


def test_without_latest_the_highest_step_is_read(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    (root / "latest").unlink()
    shutil.copytree(root / "global_step1", root / "global_step10")
    inv = read(root)
    assert all("global_step10" in str(f.path) for f in inv.files)
    assert any("highest step" in n for n in inv.notes)


def test_latest_naming_a_missing_tag(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    (root / "latest").write_text("global_step99")
    proc = run_cli("inspect", str(root))
    assert_one_line_error(proc, "latest")
    assert "global_step99" in proc.stderr


def test_latest_escaping_the_directory(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    (root / "latest").write_text("../..")
    assert_one_line_error(run_cli("inspect", str(root)), "latest")


def test_truncated_optimizer_file(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    path = root / "global_step1" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    path.write_bytes(path.read_bytes()[:1000])
    assert_one_line_error(run_cli("inspect", str(root)), root)


def test_missing_model_states(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    (root / "global_step1" / "mp_rank_00_model_states.pt").unlink()
    proc = run_cli("inspect", str(root))
    assert_one_line_error(proc, "global_step1")
    assert "model_states" in proc.stderr
