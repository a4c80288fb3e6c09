"""modelsize on model files other people published (the corpus of ``fetch.py``), checked
against ground truth computed by each file's own framework (``truth.py``, in subprocesses).

Runs when the corpus cache is filled (``.venv/bin/python tests/realfiles/fetch.py``, as
``.ci/run`` does) and skips otherwise. For every file: the reader is the expected one; every
tensor the framework sees is there with its name, dtype, shape and bytes (and nothing else);
bytes shared, duplicated or reached by no tensor are what the framework's tensors say they
are; the categories add up to the file's size; and ``slim`` writes a copy that the framework
loads with tensors equal to the input's. TensorFlow and Keras run from the TF venv
(``tests/conftest.py::tf_python``); without it those checks skip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

import modelsize
from modelsize.categories import Category
from modelsize.errors import ModelSizeError
from modelsize.inventory import Inventory, TensorRecord
from tests.conftest import tf_python
from tests.realfiles.fetch import CORPUS, ModelFile, Wheel, cache_dir

TRUTH = Path(__file__).with_name("truth.py")
TF_FRAMEWORKS = frozenset({"tensorflow", "keras", "tflite"})
#: Bytes that are tensor data (everything but structure and framing).
DATA = frozenset(Category) - {Category.GRAPH, Category.METADATA}

#: Bugs the corpus found in files another change owns: (file name, test) -> what is wrong.
KNOWN: dict[tuple[str, str], str] = {
    ("silero_vad.onnx", "printed-fix"): "its 16 B of duplicates are Constant values inside the "
    "If's two branches; the ONNX passes merge those of the main graph only",
}


def _params(test: str) -> list[Any]:
    return [
        pytest.param(w, mf, id=f"{w.package}/{mf.name}",
                     marks=[pytest.mark.xfail(strict=False, reason=KNOWN[(mf.name, test)])]
                     if (mf.name, test) in KNOWN else [])
        for w in CORPUS for mf in w.files
    ]


def _path(w: Wheel, mf: ModelFile) -> Path:
    path = cache_dir() / "files" / w.folder / mf.member.rstrip("/")
    if not path.exists():
        pytest.skip(f"{path} not fetched (run tests/realfiles/fetch.py)")
    return path


# -- ground truth, computed once per session in as few subprocesses as possible -------------
def _run_truths(jobs: list[tuple[str, str]], tmp: Path) -> dict[str, Any]:
    """Ground truths for ``jobs`` ([framework, path]): the main venv's and the TF venv's
    processes run side by side (TF only when its venv exists)."""
    procs = []
    for tag, group in (("main", [j for j in jobs if j[0] not in TF_FRAMEWORKS]),
                       ("tf", [j for j in jobs if j[0] in TF_FRAMEWORKS])):
        python = sys.executable if tag == "main" else _tf_python()
        if not group or python is None:
            continue
        jobs_file, out_file = tmp / f"jobs-{tag}.json", tmp / f"truth-{tag}.json"
        jobs_file.write_text(json.dumps(group))
        procs.append((out_file, subprocess.Popen(
            [python, str(TRUTH), str(jobs_file), str(out_file)], stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "HOME": str(tmp)})))
    out: dict[str, Any] = {}
    for out_file, proc in procs:
        _, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-4000:]
        out.update(json.loads(out_file.read_text()))
    return out


def _tf_python() -> str | None:
    try:
        return tf_python()
    except pytest.skip.Exception:
        return None


class Truths:
    """Ground truths of every fetched corpus file and of its slimmed copy, computed at first
    use: every slim first, then one process per venv for all of them."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self._truths: dict[str, Any] | None = None
        self._slims: dict[str, tuple[Any, Path]] = {}

    def _compute(self) -> dict[str, Any]:
        if self._truths is None:
            root = cache_dir() / "files"
            jobs: list[tuple[str, str]] = []
            for w in CORPUS:
                for mf in w.files:
                    path = root / w.folder / mf.member.rstrip("/")
                    if not path.exists():
                        continue
                    jobs.append((mf.framework, str(path)))
                    report, out, framework = _slim(mf, path, self.tmp / "slim")
                    self._slims[str(path)] = (report, out)
                    if not isinstance(report, Exception):
                        jobs.append((framework, str(out)))
                    if mf.framework == "keras-h5":
                        jobs += [("keras", str(path)), ("keras", str(out))]
            self._truths = _run_truths(jobs, self.tmp)
        return self._truths

    def of(self, framework: str, path: Path) -> Any:
        """The ground truth of ``path`` read by ``framework`` (skips without the TF venv)."""
        return _found(self._compute(), framework, path)

    def slim(self, path: Path) -> tuple[Any, Path]:
        """What ``modelsize.slim`` returned (or raised) for ``path``, and its output path."""
        self._compute()
        return self._slims[str(path)]


def _found(truths: dict[str, Any], framework: str, path: Path) -> Any:
    key = f"{framework}:{path}"
    if key not in truths:
        pytest.skip(f"no {framework} ground truth (no TF venv)")
    truth = truths[key]
    assert "error" not in truth, f"{framework} could not load {path}: {truth['error']}"
    return truth


#: How each input format is slimmed: (``to``, output suffix, framework that reads the output).
SLIM_OUTPUT = {
    "pytorch": ("same", ".pt", "torch"), "pytorch-legacy": ("same", ".pt", "torch"),
    "onnx": ("same", ".onnx", "onnx"), "safetensors": ("same", ".safetensors", "safetensors"),
    "keras-h5": ("same", ".hdf5", "keras-h5"), "npy": ("same", ".npy", "numpy"),
    # A SavedModel's graph names every variable: slim writes its tensors, not a SavedModel.
    "tensorflow": ("safetensors", ".safetensors", "safetensors"),
    "tflite": ("same", ".tflite", "tflite"),
    "pickle": ("same", ".npz", "npz"),
}


def _slim_output(mf: ModelFile, path: Path) -> tuple[str, str, str]:
    """``SLIM_OUTPUT`` for this file: the arrays inside an object array (a pickled dict of
    them) fit no one-array ``.npy``, they go to an ``.npz``."""
    if mf.format == "npy" and _object_npy(path):
        return "npz", ".npz", "npz"
    return SLIM_OUTPUT[mf.format]


def _slim(mf: ModelFile, path: Path, folder: Path) -> tuple[Any, Path, str]:
    to, suffix, framework = _slim_output(mf, path)
    folder.mkdir(exist_ok=True)
    out = folder / f"{path.parent.name}-{mf.name}{suffix}"
    try:
        return modelsize.slim(path, out, to=to), out, framework
    except (ModelSizeError, OSError) as exc:
        return exc, out, framework


def _object_npy(path: Path) -> bool:
    """Whether a ``.npy`` file holds an object array (its header's descr, read as NumPy does)."""
    import numpy as np

    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                else np.lib.format.read_array_header_2_0)
        return bool(read(f)[2].hasobject)


@pytest.fixture(scope="session")
def truths(tmp_path_factory: pytest.TempPathFactory) -> Truths:
    return Truths(tmp_path_factory.mktemp("realfiles"))


# -- helpers ---------------------------------------------------------------------------------
def _by_name(inv: Inventory) -> dict[str, TensorRecord]:
    names = Counter(t.name for t in inv.tensors)
    assert not [n for n, k in names.items() if k > 1], "tensor names repeat"
    return {t.name: t for t in inv.tensors}


def _truth_by_name(truth: dict[str, Any]) -> dict[str, Any]:
    return {t["name"]: t for t in truth["tensors"]}


def _assert_same_tensors(inv: Inventory, truth: dict[str, Any],
                         extra: Iterable[str] = ()) -> None:
    """The framework's tensors are modelsize's, by name, dtype, shape and bytes."""
    ours, theirs = _by_name(inv), _truth_by_name(truth)
    missing = sorted(set(theirs) - set(ours))
    unexpected = sorted(set(ours) - set(theirs) - set(extra))
    assert not missing and not unexpected, (missing[:5], unexpected[:5])
    wrong = [(n, t["dtype"], ours[n].dtype, t["shape"], list(ours[n].shape), t["nbytes"],
              ours[n].nbytes)
             for n, t in theirs.items()
             if t["dtype"] != "string" and (t["dtype"], t["shape"], t["nbytes"])
             != (ours[n].dtype, list(ours[n].shape), ours[n].nbytes)]
    assert not wrong, wrong[:5]


def _assert_duplicates_real(inv: Inventory, truth: dict[str, Any]) -> None:
    """Every tensor modelsize calls a duplicate holds the same values as its original, apart."""
    theirs = _truth_by_name(truth)
    for t in inv.tensors:
        if t.duplicate_of:
            a, b = theirs[t.name], theirs[t.duplicate_of]
            assert a["digest"] == b["digest"], (t.name, t.duplicate_of)
            assert a["storage"] != b["storage"], (t.name, "shares its original's storage")


def _reached(records: list[dict[str, Any]]) -> int:
    """Bytes of the storages that some tensor reaches (union of the views' spans)."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for r in records:
        spans.setdefault(r["storage"], []).append(tuple(r["reach"]))
    total = 0
    for ranges in spans.values():
        end = 0
        for a, b in sorted(ranges):
            total += max(0, b - max(a, end))
            end = max(end, b)
    return total


def _data_bytes(inv: Inventory) -> int:
    return sum(inv.bytes_by_category[c] for c in DATA)


def _on_disk(path: Path) -> int:
    files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
    return sum(p.stat().st_size for p in files)


# -- inspect ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("wheel", "mf"), _params("inspect"))
def test_inspect_matches_the_framework(wheel: Wheel, mf: ModelFile, truths: Truths) -> None:
    path = _path(wheel, mf)
    inv = modelsize.inspect(path).inventory
    assert inv.format == mf.format
    assert sum(inv.bytes_by_category.values()) == inv.file_bytes == _on_disk(path)
    assert inv.tensors and any(t.stored_nbytes for t in inv.tensors), "read with no tensor"
    truth = truths.of(mf.framework, path)
    CHECKS[mf.framework](inv, truth, truths, mf, path)


def _check_torch(inv: Inventory, truth: Any, truths: Truths, mf: ModelFile, path: Path) -> None:
    _assert_same_tensors(inv, truth)
    _assert_duplicates_real(inv, truth)
    assert sum(s.nbytes for s in inv.storages) == truth["storage_bytes"]
    assert _data_bytes(inv) == truth["storage_bytes"]
    unreached = truth["storage_bytes"] - _reached(truth["tensors"])
    assert inv.bytes_by_category[Category.UNUSED_STORAGE] == unreached
    for t in inv.tensors:  # a training checkpoint: the optimizer's state dict is its state
        if t.duplicate_of:
            expected = {Category.DUPLICATES}
        elif t.name.split(".")[0].startswith("optim"):
            expected = {Category.OPTIMIZER_STATE}
        else:
            expected = {Category.WEIGHTS, Category.BUFFERS}
        assert t.category in expected, (t.name, t.category)


def _check_torchscript(inv: Inventory, truth: Any, truths: Truths, mf: ModelFile,
                       path: Path) -> None:
    constants = [t.name for t in inv.tensors if t.name.startswith("constants.")]
    _assert_same_tensors(inv, truth, extra=constants)
    ours = _by_name(inv)
    for name in truth["state_dict"]:
        assert ours[name].category in (Category.WEIGHTS, Category.BUFFERS), name
    attribute_storages = {ours[t["name"]].storage for t in truth["tensors"]}
    assert sum(s.nbytes for s in inv.storages
               if s.key in attribute_storages) == truth["storage_bytes"]


def _check_onnx(inv: Inventory, truth: Any, truths: Truths, mf: ModelFile, path: Path) -> None:
    _assert_same_tensors(inv, truth)
    _assert_duplicates_real(inv, truth)
    unused = {t.name for t in inv.tensors if t.category is Category.UNUSED_STORAGE}
    assert unused == set(truth["unused"])


def _check_safetensors(inv: Inventory, truth: Any, truths: Truths, mf: ModelFile,
                       path: Path) -> None:
    _assert_same_tensors(inv, truth)
    assert _data_bytes(inv) == truth["storage_bytes"]


def _check_h5(inv: Inventory, truth: Any, truths: Truths, mf: ModelFile, path: Path) -> None:
    _assert_same_tensors(inv, truth)
    assert _data_bytes(inv) == truth["storage_bytes"]
    keras = truths.of("keras", path)
    # The model's weights are what Keras loads: trainable ones weights, the rest buffers.
    digests = {t["name"]: t["digest"] for t in truth["tensors"]}
    for category, trainable in ((Category.WEIGHTS, True), (Category.BUFFERS, False)):
        ours = sorted(digests[t.name] for t in inv.tensors_in(category))
        assert ours == sorted(w["digest"] for w in keras["tensors"]
                              if w["trainable"] is trainable), category


def _check_tensorflow(inv: Inventory, truth: Any, truths: Truths, mf: ModelFile,
                      path: Path) -> None:
    _assert_same_tensors(inv, truth)
    ours = _by_name(inv)
    variables = truth["variables"]
    assert set(variables) | {"_CHECKPOINTABLE_OBJECT_GRAPH"} == set(ours)
    assert ours["_CHECKPOINTABLE_OBJECT_GRAPH"].category in (Category.METADATA, Category.GRAPH)
    for key, v in variables.items():
        if v["trainable"]:
            expected = Category.WEIGHTS
        elif key.startswith("optimizer/") or "/.OPTIMIZER_SLOT/" in key:
            expected = Category.OPTIMIZER_STATE
        elif key.startswith("keras_api/metrics/"):
            expected = Category.OTHER  # a metric's running total, not the model
        else:
            expected = Category.BUFFERS
        assert ours[key].category is expected, (key, ours[key].category, expected)


def _check_tflite(inv: Inventory, truth: Any, truths: Truths, mf: ModelFile,
                  path: Path) -> None:
    """Constants by name; their buffers plus their quantization arrays are the data bytes;
    metadata buffers are metadata."""
    _assert_same_tensors(inv, truth)
    assert sum(s.nbytes for s in inv.storages) == truth["storage_bytes"]
    assert _data_bytes(inv) == truth["storage_bytes"] + truth["quant_bytes"]
    assert sum(r.nbytes for r in inv.regions
               if r.label.startswith("metadata ")) == sum(truth["metadata"].values())
    ours = _by_name(inv)
    for t in truth["tensors"]:
        assert ("per-channel" in "".join(ours[t["name"]].tags)) is (t["scales"] > 1), t["name"]


def _check_numpy(inv: Inventory, truth: Any, truths: Truths, mf: ModelFile, path: Path) -> None:
    if truth["object"]:
        _check_arrays(inv, truth, truths, mf, path)
        return
    [ours], [theirs] = inv.tensors, truth["tensors"]
    assert (ours.dtype, list(ours.shape), ours.nbytes) == (
        theirs["dtype"], theirs["shape"], theirs["nbytes"])
    assert inv.bytes_by_category[Category.WEIGHTS] == theirs["nbytes"]
    assert inv.bytes_by_category[Category.METADATA] == inv.file_bytes - theirs["nbytes"]


def _check_arrays(inv: Inventory, truth: Any, truths: Truths, mf: ModelFile,
                  path: Path) -> None:
    """Arrays inside a pickle have no names of their own: the same arrays, once each."""
    stored: dict[str, TensorRecord] = {}
    for t in inv.tensors:
        stored.setdefault(t.storage or t.name, t)
    ours = Counter((t.dtype, tuple(t.shape)) for t in stored.values())
    theirs = Counter((t["dtype"], tuple(t["shape"])) for t in truth["tensors"])
    assert ours == theirs, (list((theirs - ours).items())[:5], list((ours - theirs).items())[:5])
    assert sum(t.nbytes for t in stored.values()) == sum(t["nbytes"] for t in truth["tensors"])


CHECKS = {
    "torch": _check_torch, "torchscript": _check_torchscript, "onnx": _check_onnx,
    "safetensors": _check_safetensors, "keras-h5": _check_h5, "tensorflow": _check_tensorflow,
    "tflite": _check_tflite, "numpy": _check_numpy, "pickle": _check_arrays,
}


# -- slim ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("wheel", "mf"), _params("slim"))
def test_slim_output_loads_with_equal_tensors(wheel: Wheel, mf: ModelFile,
                                              truths: Truths) -> None:
    path = _path(wheel, mf)
    report, out = truths.slim(path)
    if isinstance(report, Exception):
        raise report
    assert report.verified
    after = truths.of(_slim_output(mf, path)[2], out)
    before = truths.of(mf.framework, path)
    # TorchScript constants are no attribute of the module: torch shows them nowhere; a TF
    # string (the object graph) is no tensor of the model.
    kept = [k for k in report.kept if not k.alias_of and not k.source_name.startswith(
        ("constants.", "_CHECKPOINTABLE_OBJECT_GRAPH"))]
    assert kept
    if mf.framework in ("pickle", "numpy"):  # arrays without names of their own
        digests = {t["digest"] for t in before["tensors"]}
        assert {t["digest"] for t in after["tensors"]} <= digests
        assert len(after["tensors"]) == len(kept)
    else:
        theirs, ours = _truth_by_name(after), _truth_by_name(before)
        for k in kept:
            assert theirs[k.name]["digest"] == ours[k.source_name]["digest"], k.name
    if mf.framework == "keras-h5":
        # Keras loads the slimmed file as the same model, weight for weight.
        def weights(truth: Any) -> list[str]:
            return sorted(w["digest"] for w in truth["tensors"])

        assert weights(truths.of("keras", out)) == weights(truths.of("keras", path))


# -- a SavedModel's printed fix, run as printed (TF venv) -------------------------------------
@pytest.mark.parametrize(("wheel", "mf"), [
    p for p in _params("printed-fix") if p.values[1].format == "tensorflow"
    and p.values[1].member.endswith("/")])
def test_saved_model_printed_fix_runs_as_printed(wheel: Wheel, mf: ModelFile,
                                                 tmp_path: Path) -> None:
    # basic-pitch's SavedModel holds a Keras 2 Adam whose slots TensorFlow 2.16+ cannot
    # revive ('_UserObject' object has no attribute 'add_slot'): slim reads it without the
    # links to the slots, keeps what the signature reads and verifies it.
    import shutil

    from modelsize import formats
    from modelsize.findings import fix_command
    from tests.conftest import run_printed_in_tf

    src = tmp_path / _path(wheel, mf).name
    shutil.copytree(_path(wheel, mf), src)
    report = modelsize.inspect(src)
    command = fix_command(report.inventory, list(report.findings))
    assert command is not None and "--drop" not in command
    proc = run_printed_in_tf(command, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Verified" in proc.stdout
    out = formats.read(src.with_name(src.name + ".slim")).bytes_by_category
    assert out[Category.OPTIMIZER_STATE] == 0
    for kept in (Category.WEIGHTS, Category.BUFFERS):
        assert out[kept] == report.inventory.bytes_by_category[kept]
    # Frozen, no larger than pruned: constant folding computes basic-pitch's CQT kernels once
    # for each of its convolutions (746 kB of constants, 145 kB distinct).
    proc = run_printed_in_tf(f"modelsize slim {src} --freeze -o {src}.frozen", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _on_disk(Path(f"{src}.frozen")) <= _on_disk(Path(f"{src}.slim"))


# -- every printed fix, run as printed ------------------------------------------------------
@pytest.mark.parametrize(("wheel", "mf"), _params("printed-fix"))
def test_printed_fix_runs_as_printed_and_fixes_it(wheel: Wheel, mf: ModelFile,
                                                  tmp_path: Path) -> None:
    # What `modelsize inspect` prints as the fix runs, exit 0, on a copy of the file (the
    # framework's venv for TensorFlow and Keras files), and what it fixes is gone after.
    import shlex
    import shutil

    from modelsize.findings import FindingKind, fix_command
    from tests.conftest import run_cli, run_printed_in_tf

    path = _path(wheel, mf)
    src = tmp_path / path.name
    if path.is_dir():
        shutil.copytree(path, src)
    else:
        shutil.copy(path, src)
    report = modelsize.inspect(src)
    command = fix_command(report.inventory, list(report.findings))
    if command is None:
        assert not [f for f in report.findings if f.bytes
                    and f.kind != FindingKind.UNSAFE_CODE], "a saving with no fix printed"
        return
    if mf.framework in TF_FRAMEWORKS or mf.framework == "keras-h5":
        proc = run_printed_in_tf(command, tmp_path)
    else:
        proc = run_cli(*shlex.split(command)[1:], cwd=tmp_path)
    assert proc.returncode == 0, (command, proc.stderr[-3000:])
    fixed = {f.kind for f in report.findings if f.bytes and f.kind != FindingKind.UNSAFE_CODE}
    left = {f.kind for f in modelsize.inspect(shlex.split(command)[-1]).findings}
    assert not fixed & left, (command, sorted(fixed & left))
