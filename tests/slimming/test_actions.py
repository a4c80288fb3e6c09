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
        if kind is None:
            fixed = {f.kind for f in report.findings if f.bytes}
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
