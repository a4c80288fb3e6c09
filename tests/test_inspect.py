"""End to end: real files -> `modelsize inspect` text, JSON and findings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from modelsize import Category, FindingKind, inspect
from tests.conftest import cli_json, run_cli

torch = pytest.importorskip("torch")
nn = torch.nn


def _cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                         nn.Linear(8 * 26 * 26, 10))


@pytest.fixture()
def train_ckpt(tmp_path: Path) -> tuple[Path, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = _cnn()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 1, 28, 28)).sum().backward()
    opt.step()
    path = tmp_path / "train.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 1}, path)
    return path, model, opt


def test_training_checkpoint_json(
    train_ckpt: tuple[Path, nn.Module, torch.optim.Optimizer],
) -> None:
    path, model, opt = train_ckpt
    out = cli_json("inspect", str(path))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    optim = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values())
    by = out["bytes_by_category"]
    assert list(by) == [c.value for c in Category]
    assert by["weights"] == weights
    assert by["buffers"] == buffers
    assert by["optimizer_state"] == optim
    assert sum(by.values()) == out["file_bytes"] == path.stat().st_size
    assert out["format"] == "pytorch"
    kinds = {f["kind"]: f for f in out["findings"]}
    assert kinds["optimizer_state"]["bytes"] == optim
    assert "--drop optimizer_state" in kinds["optimizer_state"]["action"]
    assert "Adam" in out["summary"] and "exp_avg" in out["summary"]
    for t in out["tensors"]:
        assert set(t) >= {"name", "dtype", "shape", "nbytes", "category"}


def test_text_report_opens_with_the_explanation(
    train_ckpt: tuple[Path, nn.Module, torch.optim.Optimizer],
) -> None:
    path, _, _ = train_ckpt
    proc = run_cli("inspect", str(path), "--top", "3")
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "train.pt is" in text and "optimizer state" in text
    assert "Largest tensors (3 of" in text
    assert "[optimizer_state]" in text


def test_api_report(train_ckpt: tuple[Path, nn.Module, torch.optim.Optimizer]) -> None:
    path, _, _ = train_ckpt
    report = inspect(path)
    assert report.file_bytes == path.stat().st_size
    assert report.findings[0].kind == FindingKind.OPTIMIZER_STATE
    json.dumps(report.to_dict())


def test_float64_is_a_finding(tmp_path: Path) -> None:
    model = _cnn().double()
    path = tmp_path / "f64.pt"
    torch.save(model.state_dict(), path)
    report = inspect(path)
    wide = [f for f in report.findings if f.kind == FindingKind.WIDE_DTYPE]
    f64 = sum(t.numel() * 8 for t in model.state_dict().values() if t.dtype == torch.float64)
    assert wide and wide[0].bytes == f64 // 2


def test_inspect_needs_no_framework(tmp_path: Path) -> None:
    """With torch, numpy and safetensors unimportable, inspect still reads their files."""
    pt = tmp_path / "m.pt"
    torch.save(_cnn().state_dict(), pt)
    code = (
        "import sys\n"
        "for m in ('torch', 'numpy', 'safetensors', 'tensorflow', 'h5py', 'onnx'):\n"
        "    sys.modules[m] = None\n"
        "from modelsize.cli import main\n"
        f"sys.exit(main(['inspect', {str(pt)!r}, '--json']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["file_bytes"] == pt.stat().st_size


def test_bare_optimizer_state_dict_is_optimizer_state(
    train_ckpt: tuple[Path, nn.Module, torch.optim.Optimizer], tmp_path: Path,
) -> None:
    _, _, opt = train_ckpt
    path = tmp_path / "optimizer.pt"
    torch.save(opt.state_dict(), path)
    by = inspect(path).inventory.bytes_by_category
    optim = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values())
    assert by[Category.OPTIMIZER_STATE] == optim
    assert by[Category.WEIGHTS] == 0
