"""``modelsize diff``: bytes by category side by side and tensors added, removed, changed.

Checkpoints are written by torch in tmp_path; expected bytes are numel * itemsize of what was
saved.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from modelsize.categories import Category
from modelsize.diff import diff
from modelsize.inspection import inspect
from modelsize.report.diff_text import render_diff
from tests.conftest import assert_one_line_error, run_cli

torch = pytest.importorskip("torch")


def _nbytes(t: Any) -> int:
    return int(t.numel() * t.element_size())


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, Any],
                                                           dict[str, Any]]:
    """Before: a float32 state dict. After: one tensor cast, one reshaped, one dropped, one new,
    and the Adam state saved beside it."""
    torch.manual_seed(0)
    before = {
        "embed.weight": torch.randn(10, 4),
        "fc.weight": torch.randn(4, 4),
        "fc.bias": torch.randn(4),
        "head.weight": torch.randn(3, 4),
    }
    after = {
        "embed.weight": before["embed.weight"].half(),
        "fc.weight": torch.randn(8, 4),
        "fc.bias": before["fc.bias"].clone(),
        "lora.weight": torch.randn(2, 4),
    }
    adam = {"exp_avg": torch.zeros(8, 4), "exp_avg_sq": torch.zeros(8, 4)}
    d = tmp_path_factory.mktemp("diff")
    a, b = d / "before.pt", d / "after.pt"
    torch.save(before, a)
    torch.save({"model": after, "optimizer": {"state": {0: adam}, "param_groups": [
        {"lr": 0.1, "params": [0]}]}}, b)
    return a, b, before, {**{f"model.{k}": v for k, v in after.items()}, **{
        f"optimizer.state.0.{k}": v for k, v in adam.items()}}


def test_tensors_added_removed_changed(pair: tuple[Path, Path, dict[str, Any],
                                                   dict[str, Any]]) -> None:
    a, b, _, after = pair
    d = diff(a, b)
    # "model." is the container of a training checkpoint: inside it, names are the model's keys
    # and pair with the plain state dict's (unambiguously here).
    removed = {t.name for t in d.removed}
    added = {t.name for t in d.added}
    assert removed == {"head.weight"}
    assert added == {"model.lora.weight", "optimizer.state.0.exp_avg",
                     "optimizer.state.0.exp_avg_sq"}
    assert {c.name: c.changes for c in d.changed} == {"embed.weight": ("dtype",),
                                                      "fc.weight": ("shape",)}
    assert d.unchanged == 1 and d.renamed == 3
    assert set(after) == added | {"model.embed.weight", "model.fc.weight", "model.fc.bias"}


def test_wrapper_prefix_is_matched(tmp_path: Path) -> None:
    torch.manual_seed(0)
    state = {"fc.weight": torch.randn(4, 4), "fc.bias": torch.randn(4)}
    a, b = tmp_path / "plain.pt", tmp_path / "ddp.pt"
    torch.save(state, a)
    torch.save({f"module.{k}": v.half() for k, v in state.items()}, b)
    d = diff(a, b)
    assert d.renamed == 2 and not d.added and not d.removed
    assert {c.name for c in d.changed} == set(state)
    assert all(c.changes == ("dtype",) for c in d.changed)
    out = d.to_dict()
    assert out["tensors"]["matched_by_stripped_name"] == 2
    assert {c["b_name"] for c in out["changed"]} == {f"module.{k}" for k in state}


def test_dtype_and_shape_changes_by_name(tmp_path: Path) -> None:
    torch.manual_seed(0)
    before = {"a": torch.randn(10, 4), "b": torch.randn(4, 4), "c": torch.randn(4),
              "gone": torch.randn(3)}
    after = {"a": before["a"].half(), "b": torch.randn(8, 4), "c": before["c"].clone(),
             "new": torch.randn(2, 2)}
    pa, pb = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save(before, pa)
    torch.save(after, pb)
    d = diff(pa, pb)
    assert [t.name for t in d.removed] == ["gone"]
    assert [t.name for t in d.added] == ["new"]
    assert d.added[0].nbytes == _nbytes(after["new"])
    changes = {c.name: c.changes for c in d.changed}
    assert changes == {"a": ("dtype",), "b": ("shape",)}
    assert d.unchanged == 1
    by = d.category_delta()
    assert by[Category.WEIGHTS] == (sum(_nbytes(t) for t in before.values()),
                                    sum(_nbytes(t) for t in after.values()))


def test_bytes_by_category_side_by_side(pair: tuple[Path, Path, dict[str, Any],
                                                    dict[str, Any]]) -> None:
    a, b, before, after = pair
    out = diff(a, b).to_dict()
    assert out["file_bytes"] == {"a": a.stat().st_size, "b": b.stat().st_size,
                                 "delta": b.stat().st_size - a.stat().st_size}
    cats = out["bytes_by_category"]
    assert cats["weights"]["a"] == sum(_nbytes(t) for t in before.values())
    assert cats["weights"]["b"] == sum(_nbytes(t) for k, t in after.items()
                                       if k.startswith("model."))
    assert cats["optimizer_state"] == {
        "a": 0, "b": sum(_nbytes(t) for k, t in after.items() if k.startswith("optimizer.")),
        "delta": sum(_nbytes(t) for k, t in after.items() if k.startswith("optimizer.")),
    }
    for cat, row in cats.items():
        assert row["delta"] == row["b"] - row["a"]
        assert row["a"] == inspect(a).inventory.bytes_by_category[Category(cat)]
    json.dumps(out)


def test_render_diff(tmp_path: Path) -> None:
    torch.save({"w": torch.zeros(4, 4)}, tmp_path / "a.pt")
    torch.save({"w": torch.zeros(4, 4).half(), "v": torch.zeros(3)}, tmp_path / "b.pt")
    text = render_diff(diff(tmp_path / "a.pt", tmp_path / "b.pt"))
    assert "weights" in text and "total" in text
    assert "Only in B (added) (1" in text
    assert "float32 4x4 weights" in text and "float16 4x4 weights" in text


def test_cli(tmp_path: Path) -> None:
    torch.save({"w": torch.zeros(4, 4)}, tmp_path / "a.pt")
    torch.save({"w": torch.zeros(4, 4), "v": torch.zeros(3)}, tmp_path / "b.pt")
    proc = run_cli("diff", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert [t["name"] for t in out["added"]] == ["v"]
    assert out["bytes_by_category"]["weights"]["delta"] == 12
    text = run_cli("diff", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"))
    assert text.returncode == 0 and "Only in B" in text.stdout


def test_cli_bad_input(tmp_path: Path) -> None:
    torch.save({"w": torch.zeros(4, 4)}, tmp_path / "a.pt")
    (tmp_path / "b.pt").write_bytes(b"PK\x03\x04 truncated")
    assert_one_line_error(run_cli("diff", str(tmp_path / "a.pt"), str(tmp_path / "b.pt")),
                          "b.pt")
    assert_one_line_error(run_cli("diff", str(tmp_path / "a.pt"), str(tmp_path / "nope.pt")),
                          "nope.pt")


def test_slimmed_checkpoint_pairs_every_kept_tensor_with_its_source(tmp_path: Path) -> None:
    """Issue 18 item 16: ``{"model", "optimizer", "epoch", "grads"}`` slimmed to the model's
    state dict: ``model.fc.weight`` -> ``fc.weight`` is one tensor kept, not one removed and
    one added, although ``grads.fc.weight`` has the same key."""
    import modelsize

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    src, out = tmp_path / "train.pt", tmp_path / "train.slim.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 3,
                "grads": {n: p.grad for n, p in model.named_parameters()}}, src)
    report = modelsize.slim(src, out)
    assert {k.name for k in report.kept} == set(model.state_dict())

    d = diff(src, out)
    assert d.added == ()
    assert d.unchanged == len(model.state_dict()) and not d.changed
    assert d.renamed == len(model.state_dict())
    assert {t.name for t in d.removed} == {x.name for x in report.dropped}
    assert all(t.category != Category.WEIGHTS for t in d.removed)
