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


FIXTURES = Path(__file__).parent / "fixtures"


def test_one_float64_tensor_is_one_tensor(tmp_path: Path) -> None:
    """Issue 18: "1 tensors are float64"."""
    path = tmp_path / "mixed.pt"
    torch.save({"a": torch.zeros(4, dtype=torch.float64), "b": torch.zeros(4),
                "c": torch.zeros(3)}, path)
    wide = [f for f in inspect(path).findings if f.kind == FindingKind.WIDE_DTYPE]
    assert wide[0].message.startswith("1 tensor is float64")
    torch.save({"a": torch.zeros(4, dtype=torch.float64), "b": torch.zeros(4, dtype=torch.float64),
                "c": torch.zeros(3)}, path)
    wide = [f for f in inspect(path).findings if f.kind == FindingKind.WIDE_DTYPE]
    assert wide[0].message.startswith("2 tensors are float64")


class _WithGraph(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)


@pytest.mark.parametrize("path, words", [
    ("onnx/mlp.onnx", "computation graph"),
    ("keras/model.keras", "config.json"),
    ("keras/legacy.h5", "model_config"),
    ("module", "pickled module objects"),
])
def test_graph_bytes_are_described_in_the_formats_terms(tmp_path: Path, path: str,
                                                        words: str) -> None:
    """Issue 18: an ONNX or Keras model's structure was "pickled module objects"."""
    if path == "module":
        file = tmp_path / "module.pt"
        torch.save(_WithGraph(), file)
    else:
        file = FIXTURES / path
    report = inspect(file)
    assert report.inventory.bytes_by_category[Category.GRAPH] * 100 >= report.file_bytes
    sentence = next(s for s in report.summary.split(". ") if "model structure" in s)
    assert words in sentence
    assert ("pickled" in sentence) == (path == "module")


@pytest.mark.parametrize("path, described", [
    ("keras/model.keras", "Adam optimizer state (momentum, velocity)"),  # Keras 3 optimizer/vars/N
    ("keras/legacy.h5", "Adam optimizer state (m, v)"),  # tf.keras optimizer_weights/Adam/m/...
])
def test_keras_optimizer_slots_are_named(path: str, described: str) -> None:
    """Issue 18: Keras 3 stores optimizer variables as ``optimizer/vars/N``: described as
    "(vars)". Their names come from the optimizer's class in ``config.json`` (the fixture's
    generator compiled with ``optimizer="adam"``)."""
    from modelsize.findings import optimizer_description

    report = inspect(FIXTURES / path)
    assert optimizer_description(report.inventory) == described
    finding = next(f for f in report.findings if f.kind == FindingKind.OPTIMIZER_STATE)
    assert described in finding.message and "vars" not in finding.message


def test_keras_optimizer_slots_follow_the_config() -> None:
    """The slots each Keras 3 optimizer makes, as keras/src/optimizers names them."""
    from modelsize.formats._keras_optimizer import optimizer_facts

    def facts(cls: str, **config: object) -> dict[str, str]:
        return optimizer_facts({"compile_config": {"optimizer": {"class_name": cls,
                                                                 "config": config}}})

    assert facts("Adam", amsgrad=True)["optimizer_slots"] == "momentum, velocity, velocity_hat"
    assert facts("RMSprop", momentum=0.9, centered=True)["optimizer_slots"] == (
        "velocity, momentum, average_gradient")
    assert facts("SGD", momentum=0.0) == {"optimizer": "SGD"}
    assert facts("MyOptimizer") == {"optimizer": "MyOptimizer"}
    assert optimizer_facts({"config": {}}) == {}
    assert optimizer_facts([1, 2]) == {}


def test_a_folder_of_model_files_names_them(tmp_path: Path) -> None:
    """``inspect .`` in a folder holding a checkpoint that is no model folder says which model
    files it holds (it said "holds no model file")."""
    torch = pytest.importorskip("torch")
    torch.save({"w": torch.ones(2)}, tmp_path / "train.pt")
    (tmp_path / "notes.txt").write_text("x")
    proc = run_cli("inspect", ".", cwd=tmp_path)
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert "holds 1 model file (train.pt): give one" in proc.stderr


@pytest.mark.parametrize(("name", "slot"), [
    ("optimizer.state.0.exp_avg", "exp_avg"),
    ("optimizer.state.12.momentum_buffer", "momentum_buffer"),
    ("optimizer.state.3.12", "state"),
    ("dense_kernel_momentum", "momentum"),
    ("a.b.x_velocity_hat", "velocity_hat"),
    ("opt._private.v", "v"),
    ("opt.v._private", "v"),
    ("optimizer_weights/Adam/m/dense/kernel:0", "m"),
    ("dense/kernel/.OPTIMIZER_SLOT/optimizer/m/.ATTRIBUTES/VARIABLE_VALUE", "m"),
    ("training/Adam/dense/kernel/m:0", "m"),
    ("layer_norm", "norm"),
])
def test_slot_names(name: str, slot: str) -> None:
    from modelsize.findings import _slot
    from modelsize.inventory import TensorRecord

    record = TensorRecord(name, "F32", (1,), Category.OPTIMIZER_STATE, 4)
    assert _slot(record) == slot
