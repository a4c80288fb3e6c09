"""Locks the public API: a change here is a change users see."""

from __future__ import annotations

import subprocess
import sys

import modelsize
from modelsize.categories import Category


def test_public_names() -> None:
    assert sorted(modelsize.__all__) == sorted([
        "AccountingError", "Category", "CheckResult", "CorruptFileError", "Estimate",
        "EstimateError",
        "FileInfo", "Finding", "FindingKind", "InputError", "Inventory",
        "MissingDependencyError", "ModelSizeError", "PathNotFoundError", "Region", "Report",
        "SlimReport", "StorageRecord", "TensorRecord", "UnknownFormatError", "UsageError",
        "VerificationError", "Violation", "__version__", "check", "estimate", "inspect",
        "slim",
    ])


def test_public_functions_stay_functions() -> None:
    # Importing the subpackages that implement them must never rebind the public names.
    code = (
        "import modelsize, modelsize.estimation, modelsize.slimming, modelsize.cli.slim;"
        "import modelsize.checking, modelsize.cli.check;"
        "from modelsize import estimate, slim, inspect, check;"
        "import types; assert all(isinstance(f, types.FunctionType) for f in "
        "(estimate, slim, inspect, check, modelsize.estimate, modelsize.slim, modelsize.check)); "
        "modelsize.Estimate; modelsize.SlimReport; assert callable(modelsize.estimate)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_categories_are_the_closed_set() -> None:
    assert [c.value for c in Category] == [
        "weights", "buffers", "optimizer_state", "gradients", "activations", "unused_storage",
        "duplicates", "graph", "metadata", "other",
    ]


def test_import_does_not_import_frameworks() -> None:
    code = (
        "import sys, modelsize, modelsize.cli, modelsize.formats, modelsize.slimming;"
        "modelsize.formats.registry();"
        "bad = [m for m in ('torch', 'numpy', 'tensorflow', 'safetensors', 'onnx', 'h5py')"
        " if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
