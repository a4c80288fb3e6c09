"""Every fix ``inspect`` prints runs exactly as printed, and the finding is gone after it.

The files are the demo's stories (written by the real frameworks on the spot, plus the TF1
checkpoint the package ships). Each finding's ``action`` is split like a shell would and run
through the CLI in the folder the report names files from; the output is inspected again: that
finding is gone and nothing else changed (the same tensors by key, with the same dtype and
shape, except what the fix is about).
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from modelsize import Category, inspect
from modelsize.findings import FindingKind, fix_command
from modelsize.inventory import Inventory
from tests.conftest import run_cli

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from modelsize.cli.demo import STORIES

    d = tmp_path_factory.mktemp("demo")
    import os

    here = Path.cwd()
    os.chdir(d)
    try:
        for _, make in STORIES:
            make(Path("."))
    finally:
        os.chdir(here)
    return d


def _paths(demo_dir: Path) -> list[str]:
    return ["train.pt", "first_rows.pt", "model_f64.pt", "whole_model.pt", "tied.safetensors",
            "tf1_mlp_adam/model.ckpt"]


def _keys(inv: Inventory, skip: set[Category] = frozenset()) -> dict[str, tuple[str, tuple[int, ...]]]:  # noqa: E501
    return {t.key: (t.dtype, t.shape) for t in inv.tensors if t.category not in skip}


_CATEGORY = {
    FindingKind.OPTIMIZER_STATE: Category.OPTIMIZER_STATE,
    FindingKind.GRADIENTS: Category.GRADIENTS,
    FindingKind.ACTIVATIONS: Category.ACTIVATIONS,
    FindingKind.DUPLICATES: Category.DUPLICATES,
}


@pytest.mark.parametrize("name", ["train.pt", "first_rows.pt", "model_f64.pt", "whole_model.pt",
                                  "tied.safetensors", "tf1_mlp_adam/model.ckpt"])
def test_each_action_runs_as_printed(demo_dir: Path, name: str) -> None:
    import os

    here = Path.cwd()
    os.chdir(demo_dir)
    try:
        report = inspect(name)
    finally:
        os.chdir(here)
    actions = [f for f in report.findings if f.action.startswith("modelsize slim")]
    assert actions, f"{name}: no fix printed"
    commands = [(f.kind, f.action) for f in actions]
    combined = fix_command(report.inventory, list(report.findings))
    if combined and combined not in [a for _, a in commands]:
        commands.append((None, combined))
    for kind, action in commands:
        argv = shlex.split(action)
        assert argv[:2] == ["modelsize", "slim"]
        out_name = argv[argv.index("-o") + 1]
        out = demo_dir / out_name
        if out.exists() or any(out.parent.glob(out.name + ".*")):
            for p in [out, *out.parent.glob(out.name + ".*")]:
                p.unlink()
        proc = run_cli(*argv[1:], cwd=demo_dir)
        assert proc.returncode == 0, (action, proc.stderr)
        after = inspect(out)
        kinds = {f.kind for f in after.findings}
        before = report.inventory
        if kind is None or kind == FindingKind.FIX_ALL:
            fixed = {f.kind for f in report.findings if f.bytes} - {FindingKind.FIX_ALL}
            assert not kinds & fixed, (action, kinds)
            continue
        assert kind not in kinds, (action, kinds)
        gone = {_CATEGORY[kind]} if kind in _CATEGORY else set()
        want = _keys(before, gone | {Category.UNUSED_STORAGE})
        got = _keys(after.inventory)
        if kind == FindingKind.WIDE_DTYPE:
            want = {k: ("float32" if d == "float64" else d, s) for k, (d, s) in want.items()}
        if kind == FindingKind.DUPLICATES:  # the copy is an alias: stored once
            assert set(got) <= set(_keys(before))
            assert set(got) >= set(_keys(before, {Category.DUPLICATES}))
            continue
        assert got == want, action


# -- issue 18 item 14: a training checkpoint with gradients -----------------------------------


@pytest.fixture()
def grads_ckpt(tmp_path: Path) -> tuple[Path, dict[str, object]]:
    """``{"model", "optimizer", "epoch", "grads"}`` after one Adam step, by torch."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 3,
            "grads": {n: p.grad for n, p in model.named_parameters()}}
    path = tmp_path / "train.pt"
    torch.save(ckpt, path)
    return path, ckpt


def test_fix_all_first_then_each_fix_runs_in_any_order(
        grads_ckpt: tuple[Path, dict[str, object]]) -> None:
    """The combined fix is listed first; every printed fix runs as printed one after the
    other in the same folder (no "exists; use --force": each writes its own OUT), and each
    fix leaves the other finding in its output."""
    import json

    path, _ = grads_ckpt
    report = inspect(path)
    kinds = [f.kind for f in report.findings]
    assert kinds == [FindingKind.FIX_ALL, FindingKind.OPTIMIZER_STATE, FindingKind.GRADIENTS]
    combined = report.findings[0]
    assert combined.action == fix_command(report.inventory, list(report.findings))
    assert combined.bytes == sum(f.bytes for f in report.findings[1:])
    proc = run_cli("inspect", str(path), "--json")
    assert json.loads(proc.stdout)["findings"][0]["kind"] == "fix_all"
    text = run_cli("inspect", str(path)).stdout
    assert text.index("[fix_all]") < text.index("[optimizer_state]") < text.index("[gradients]")

    outs = [shlex.split(f.action)[-1] for f in report.findings]
    assert len(set(outs)) == len(outs), outs
    for f in report.findings:  # in the order printed, nothing removed in between
        proc = run_cli(*shlex.split(f.action)[1:], cwd=path.parent)
        assert proc.returncode == 0, (f.action, proc.stderr)
    left = {f.kind: {g.kind for g in inspect(path.parent / out).findings}
            for f, out in zip(report.findings, outs, strict=True)}
    assert left[FindingKind.FIX_ALL] == set()
    assert left[FindingKind.OPTIMIZER_STATE] == {FindingKind.GRADIENTS}
    assert left[FindingKind.GRADIENTS] == {FindingKind.OPTIMIZER_STATE}


@pytest.mark.parametrize("drop", [None, ["optimizer_state"], ["gradients"], ["ema"]])
@pytest.mark.parametrize("to", ["same", "safetensors", "npz"])
def test_kept_tensors_keep_their_category(grads_ckpt: tuple[Path, dict[str, object]],
                                          tmp_path: Path, drop: list[str] | None,
                                          to: str) -> None:
    """Gradients stay gradients: inspect of the output puts every kept tensor in the
    category it had in the input (--drop optimizer_state used to write grads.* as weights)."""
    import modelsize

    path, _ = grads_ckpt
    out = tmp_path / f"out.{'pt' if to == 'same' else to}"
    report = modelsize.slim(path, out, drop=drop, to=to)
    before = {t.name: t.category for t in report.source.tensors}
    after = {t.name: t.category for t in inspect(out).inventory.tensors}
    assert {k.name: after[k.name] for k in report.kept} == {
        k.name: before[k.source_name] for k in report.kept}
    if drop == ["optimizer_state"]:
        assert any(c == Category.GRADIENTS for c in after.values())


def test_kept_optimizer_layout_loads_in_torch(grads_ckpt: tuple[Path, dict[str, object]],
                                              tmp_path: Path) -> None:
    """--drop gradients keeps {"model": ..., "optimizer": ...}: torch loads it weights-only and
    the optimizer takes its state back."""
    import torch

    import modelsize

    path, ckpt = grads_ckpt
    out = tmp_path / "no-grads.pt"
    modelsize.slim(path, out, drop=["gradients"])
    got = torch.load(out, weights_only=True)
    assert set(got) == {"model", "optimizer"}
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    model.load_state_dict(got["model"])
    opt = torch.optim.Adam(model.parameters())
    opt.load_state_dict(got["optimizer"])
    saved = ckpt["optimizer"]["state"]  # type: ignore[index]
    for i, state in opt.state_dict()["state"].items():
        assert torch.equal(state["exp_avg"], saved[i]["exp_avg"])
