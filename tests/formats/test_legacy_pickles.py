"""Checkpoints from every PyTorch generation and both Pythons, and the bytes views reach.

The legacy files are committed under tests/fixtures/legacy_torch (hand-built where Python 2.7
and torch 0.x cannot be installed; generate.py says how each was made). Their categories are
the bytes the generator wrote; torch itself loads each of them in a subprocess and must find
the tensors the manifest lists, and ``modelsize slim`` must turn each into a torch file that
``torch.load(weights_only=True)`` reads with the same tensors. A Python 2 NumPy pickle of the
same era is read by the generic pickle reader, its arrays itemized.

Then: storages that no tensor reaches (a parser failure, refused), and the bytes strided views
reach (their elements, not the span between their first and last ones).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import pickle
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

import modelsize
from modelsize.categories import Category
from modelsize.errors import CorruptFileError
from modelsize.formats import read
from modelsize.formats._pickle import Global, scan
from tests.conftest import REPO, assert_one_line_error, by_cat, nbytes, run_cli
from tests.fixtures.legacy_torch import generate as gen

torch = pytest.importorskip("torch")

FIXTURES = REPO / "tests" / "fixtures" / "legacy_torch"
MANIFEST: dict[str, Any] = json.loads((FIXTURES / "MANIFEST.json").read_text())
FILES = sorted(MANIFEST["files"])

def tensors_of(obj: Any) -> dict[str, Any]:
    """{dotted name: dtype, shape, sha256 of the elements} of every tensor torch loaded.

    Also run in a subprocess (its source is sent there), so it imports what it needs.
    """
    import hashlib

    import torch

    out: dict[str, Any] = {}

    def walk(value: Any, name: str) -> None:
        if isinstance(value, torch.nn.Module):
            value = value.state_dict()
        if isinstance(value, torch.Tensor):
            data = value.contiguous().numpy().tobytes()
            out[name] = {"dtype": str(value.dtype).removeprefix("torch."),
                         "shape": list(value.shape), "sha256": hashlib.sha256(data).hexdigest()}
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{name}.{k}" if name else str(k))
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{name}.{i}" if name else str(i))

    walk(obj, "")
    return out


#: Loads each file given with torch.load(weights_only=False) and prints its tensors_of().
_TORCH_LOAD = "\n".join([
    "import json, sys, warnings",
    "from typing import Any",
    "import torch",
    "warnings.simplefilter('ignore')",
    inspect.getsource(tensors_of),
    "print(json.dumps({p: tensors_of(torch.load(p, weights_only=False, map_location='cpu'))",
    "                  for p in sys.argv[1:]}))",
])
#: Globals a fixture may name to be loaded by torch.load(weights_only=False) here.
_LOADABLE = ("torch.", "collections.OrderedDict", "builtins.set")


@pytest.fixture(scope="module")
def loaded_by_torch() -> dict[str, Any]:
    """What torch loads from each fixture, loaded in one fresh interpreter.

    torch.load(weights_only=False) runs code from a pickle: a fixture is loaded only if every
    global its pickles name is torch's own, ``collections.OrderedDict`` or ``builtins.set``
    (the module pickles call ``torch.nn.backends.thnn._get_thnn_function_backend``, kept in
    today's torch for them, and module classes of ``torch.nn``).
    """
    for name in FILES:
        named = _all_globals(FIXTURES / name)
        assert all(g.startswith(_LOADABLE) for g in named), (name, named)
    proc = subprocess.run(
        [sys.executable, "-c", _TORCH_LOAD, *(str(FIXTURES / n) for n in FILES)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    found: dict[str, Any] = json.loads(proc.stdout)
    return {Path(p).name: t for p, t in found.items()}


def torch_tensors(path: Path) -> dict[str, Any]:
    """What ``torch.load(weights_only=True)`` finds in ``path`` (safe to load in-process)."""
    return tensors_of(torch.load(path, weights_only=True))


def without_category(tensors: dict[str, Any]) -> dict[str, Any]:
    return {k: {f: v for f, v in t.items() if f != "category"} for k, t in tensors.items()}


# -- the committed fixtures --------------------------------------------------------------------


@pytest.mark.parametrize("name", FILES)
def test_fixture_is_the_one_the_manifest_describes(name: str) -> None:
    data = (FIXTURES / name).read_bytes()
    entry = MANIFEST["files"][name]
    assert len(data) == entry["bytes"]
    assert hashlib.sha256(data).hexdigest() == entry["sha256"]


@pytest.mark.parametrize("name", FILES)
def test_categories_are_the_bytes_written(name: str) -> None:
    entry = MANIFEST["files"][name]
    inv = read(FIXTURES / name)
    assert inv.format == "pytorch-legacy"
    assert by_cat(inv) == entry["bytes_by_category"]
    found = {t.name: (t.dtype, list(t.shape), t.category.value) for t in inv.tensors}
    assert found == {k: (t["dtype"], t["shape"], t["category"])
                     for k, t in entry["tensors"].items()}


@pytest.mark.parametrize("name", FILES)
def test_torch_loads_what_the_manifest_lists(name: str, loaded_by_torch: dict[str, Any]) -> None:
    assert loaded_by_torch[name] == without_category(MANIFEST["files"][name]["tensors"])


def _all_globals(path: Path) -> set[str]:
    """Every global the five pickles of a legacy file name, persistent ids included."""
    data = path.read_bytes()
    names: set[str] = set()

    def pid_globals(pid: object) -> None:
        if isinstance(pid, tuple):
            names.update(str(p) for p in pid if isinstance(p, Global))

    pos = 0
    for _ in range(5):
        s = scan(data, offset=pos, persistent_load=pid_globals)
        names.update(str(g) for g in s.globals)
        pos = s.end
    return names


@pytest.mark.parametrize("name", FILES)
def test_slim_writes_the_state_dict_torch_reads(name: str, tmp_path: Path) -> None:
    entry = MANIFEST["files"][name]
    out = tmp_path / "out.pt"
    report = modelsize.slim(FIXTURES / name, out)
    assert report.verified
    assert report.output.bytes_by_category[Category.UNUSED_STORAGE] == 0
    kept = {k: t for k, t in entry["tensors"].items() if t["category"] in ("weights", "buffers")}
    expected = without_category(kept)
    container = "state_dict."  # the checkpoint's model; its optimizer state is dropped
    expected = {k.removeprefix(container): t for k, t in expected.items()}
    if report.copied:
        # Nothing to slim: the output is the input byte for byte (issue 18), CUDA storage
        # locations included, so a CPU machine loads it as it loads the input.
        assert out.read_bytes() == (FIXTURES / name).read_bytes()
        got = tensors_of(torch.load(out, weights_only=True, map_location="cpu"))
    else:
        got = torch_tensors(out)
    assert got == expected
    assert report.output.file_bytes == out.stat().st_size


def test_python2_state_dict_was_read_with_zero_tensors_before() -> None:
    """The issue's file: every byte of weights was unused_storage, with advice to slim it."""
    inv = read(FIXTURES / "py2_torch04_state_dict.pt")
    cats = by_cat(inv)
    assert cats["unused_storage"] == 0
    assert len(inv.tensors) == 9
    report = modelsize.inspect(FIXTURES / "py2_torch04_state_dict.pt")
    assert not [f for f in report.findings if f.kind.value == "unused_storage"]


def test_module_pickle_of_python2_names_parameters_by_their_keys() -> None:
    inv = read(FIXTURES / "py2_torch04_module.pt")
    assert {t.name for t in inv.tensors} == {"0.weight", "0.bias", "1.weight", "1.bias",
                                             "1.running_mean", "1.running_var"}
    assert inv.facts["module_classes"] == ", ".join(
        f"torch.nn.modules.{m}" for m in ("container.Sequential", "linear.Linear",
                                          "batchnorm.BatchNorm1d"))


# -- storages no tensor reaches: a parser failure, not a finding ------------------------------


def _legacy_bytes(obj: object, model: gen.Model) -> bytes:
    return gen.legacy_file("py3", obj, model, gen.LINUX_SIZES)[0]


def test_storages_no_tensor_reaches_are_refused(tmp_path: Path) -> None:
    """A tensor used as a dict key (modelsize walks values only) leaves its storage unreached:
    the only storage of the file, so the reader refuses it instead of calling it unused."""
    m = gen.Model("py3", gen._PY2_CLASSES, "cpu")
    key = m.tensor_v2("w", (4,), "float32", "weights")
    path = tmp_path / "keyed.pt"
    path.write_bytes(_legacy_bytes({key: "weight"}, m))
    with pytest.raises(CorruptFileError, match="found 1 storage but no tensor refers to it: "
                       "this looks like a pickle layout modelsize does not understand; "
                       "please report it"):
        read(path)
    assert_one_line_error(run_cli("inspect", str(path)), path)


def test_one_stray_storage_among_reached_ones_is_unused(tmp_path: Path) -> None:
    m = gen.Model("py3", gen._PY2_CLASSES, "cpu")
    a = m.tensor_v2("a", (4,), "float32", "weights")
    b = m.tensor_v2("b", (2,), "float32", "weights")
    stray = m.tensor_v2("stray", (3,), "float32", "weights")
    path = tmp_path / "stray.pt"
    path.write_bytes(_legacy_bytes({"a": a, "b": b, stray: 1}, m))
    cats = by_cat(read(path))
    assert cats["weights"] == (4 + 2) * 4 and cats["unused_storage"] == 3 * 4


@pytest.mark.parametrize("legacy", [False, True])
def test_storage_saved_by_itself_is_data(tmp_path: Path, legacy: bool) -> None:
    t = torch.arange(6, dtype=torch.float32)
    path = tmp_path / "storage.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TypedStorage is deprecated
        obj = {"untyped": t.untyped_storage(), "typed": torch.arange(3).storage()}
        torch.save(obj, path, _use_new_zipfile_serialization=not legacy)
    inv = read(path)
    cats = by_cat(inv)
    assert cats["unused_storage"] == 0
    assert cats["weights"] + cats["buffers"] == 6 * 4 + 3 * 8
    assert {t.name: t.shape for t in inv.tensors} == {"untyped": (24,), "typed": (3,)}
    assert all("storage" in t.tags for t in inv.tensors)


# -- parameters as every torch wrote them --------------------------------------------------


@pytest.mark.parametrize("legacy", [False, True])
def test_parameter_with_python_state(tmp_path: Path, legacy: bool) -> None:
    """torch 2.x writes _rebuild_parameter_with_state for a Parameter with attributes."""
    p = torch.nn.Parameter(torch.ones(3, 2))
    p.tag = "shared"  # type: ignore[attr-defined]
    path = tmp_path / "param.pt"
    torch.save({"p": p, "q": torch.nn.Parameter(torch.zeros(4))}, path,
               _use_new_zipfile_serialization=not legacy)
    raw = path.read_bytes() if legacy else b""
    if legacy:
        assert b"_rebuild_parameter_with_state" in raw
    inv = read(path)
    assert {t.name: t.category for t in inv.tensors} == {
        "p": Category.WEIGHTS, "q": Category.WEIGHTS}
    assert by_cat(inv)["weights"] == nbytes(p, torch.zeros(4))


def test_torch03_variable_and_parameter_reduce_forms(tmp_path: Path) -> None:
    """torch 0.3 pickled ``Variable.__reduce_ex__`` as ``(type(self), (data,), state)``: the
    class called on the tensor, then BUILD with (requires_grad, volatile, hooks)."""
    m = gen.Model("py2", gen._PY2_CLASSES, "cuda:0")
    hooks = gen.ordered_dict([], "py2")
    param = gen.Reduce(gen.G("torch.nn.parameter", "Parameter"),
                       (m.tensor_v1("p", (2, 2), "float32", "weights"),), (True, False, hooks))
    hidden = gen.Reduce(gen.G("torch.autograd.variable", "Variable"),
                        (m.tensor_v1("hidden", (3,), "float32", "weights"),), (False, True, None))
    path = tmp_path / "variables.pt"
    path.write_bytes(gen.legacy_file("py2", {"p": param, "hidden": hidden}, m,
                                     gen.LINUX_SIZES)[0])
    inv = read(path)
    assert {t.name: t.shape for t in inv.tensors} == {"p": (2, 2), "hidden": (3,)}
    assert by_cat(inv)["weights"] == (4 + 3) * 4


# -- the bytes strided views reach ----------------------------------------------------------


def _reached(t: Any, base: Any) -> set[int]:
    """Byte offsets of ``t``'s elements inside ``base``'s storage (from torch's own strides)."""
    size = t.element_size()
    first = t.storage_offset()
    offsets = {first}
    for d, s in zip(t.shape, t.stride(), strict=True):
        offsets = {o + k * s for o in offsets for k in range(d)}
    return {o * size + b for o in offsets for b in range(size)}


@pytest.mark.parametrize("legacy", [False, True])
def test_column_slice_is_charged_its_elements(tmp_path: Path, legacy: bool) -> None:
    big = torch.randn(1000, 1000)
    path = tmp_path / "col.pt"
    torch.save(big[:, :3], path, _use_new_zipfile_serialization=not legacy)
    inv = read(path)
    cats = by_cat(inv)
    assert cats["weights"] == 1000 * 3 * 4
    assert cats["unused_storage"] == nbytes(big) - 1000 * 3 * 4
    report = modelsize.inspect(path)
    unused = [f for f in report.findings if f.kind.value == "unused_storage"]
    assert unused and unused[0].bytes == cats["unused_storage"]

    out = tmp_path / "col.slim.pt"
    modelsize.slim(path, out)
    loaded = torch.load(out, weights_only=True)
    assert torch.equal(loaded["tensor"] if isinstance(loaded, dict) else loaded, big[:, :3])
    assert out.stat().st_size < 20_000


@pytest.mark.parametrize(
    "views",
    [
        pytest.param(lambda b: {"t": b.t()}, id="transpose"),
        pytest.param(lambda b: {"s": b[::2, ::3]}, id="steps"),
        pytest.param(lambda b: {"c": b[:, 1:4], "r": b[5:9], "d": b[2:30:7, 2:6]},
                     id="overlapping"),
        pytest.param(lambda b: {"w": b[:, :3], "hidden_states": b[:, 2:5].t()}, id="categories"),
        pytest.param(lambda b: {"diag": b.diagonal(), "col": b[:, 0], "x": b[3:5, ::9]},
                     id="diagonal"),
        pytest.param(lambda b: {"e": b[:1, :4].expand(6, 4), "u": b.unfold(1, 4, 3)},
                     id="expand-unfold"),
    ],
)
def test_strided_views_reach_their_elements(tmp_path: Path, views: Any) -> None:
    big = torch.randn(40, 30)
    obj = views(big)
    path = tmp_path / "views.pt"
    torch.save(obj, path)
    inv = read(path)
    cats = by_cat(inv)
    # Bytes reached, by category, from torch's own strides (first view by name keeps a byte:
    # weights before activations, as the inventory's precedence says).
    reached: dict[str, set[int]] = {"weights": set(), "activations": set()}
    for name, t in obj.items():
        reached["activations" if name == "hidden_states" else "weights"] |= _reached(t, big)
    reached["activations"] -= reached["weights"]
    assert cats["weights"] == len(reached["weights"])
    assert cats["activations"] == len(reached["activations"])
    assert cats["unused_storage"] == nbytes(big) - sum(len(s) for s in reached.values())
    stored = {t.name: t.stored_nbytes for t in inv.tensors}
    assert sum(stored.values()) == sum(len(s) for s in reached.values())


def test_huge_view_is_counted_without_listing_its_elements(tmp_path: Path) -> None:
    """Hand-built legacy files (metadata only) whose views take 10**6 rows of 3 columns of a
    10**6 x 1000 float32 storage held in a sparse file: one view alone is counted exactly;
    two overlapping ones are merged as their spans, with a note."""
    rows, cols = 1_000_000, 1000
    numel = rows * cols
    st = gen.Storage("1", gen._PY2_CLASSES["float32"], "cpu", "float32", [])
    pid = ("storage", st.cls, st.key, "cpu", numel, None)
    rebuild = gen.G("torch._utils", "_rebuild_tensor_v2")
    hooks = gen.ordered_dict([], "py3")

    def columns(first: int) -> gen.Reduce:
        return gen.Reduce(rebuild, (_Pid(pid), first, (rows, 3), (cols, 1), False, hooks))

    def make(obj: object, path: Path) -> None:
        info = {"protocol_version": 1001, "little_endian": True, "type_sizes": gen.LINUX_SIZES}
        pickles = b"".join(gen.Pickler("py3").dumps(v)
                           for v in (gen.MAGIC, 1001, info, obj, [st.key]))
        with open(path, "wb") as fh:
            fh.write(pickles + numel.to_bytes(8, "little"))
            fh.truncate(len(pickles) + 8 + 4 * numel)  # a hole: no byte of data is written

    one = tmp_path / "huge.pt"
    make({"w": columns(0)}, one)
    cats = by_cat(read(one))
    assert cats["weights"] == rows * 3 * 4
    assert cats["unused_storage"] == 4 * numel - rows * 3 * 4

    two = tmp_path / "huge2.pt"
    make({"w": columns(0), "v": columns(1)}, two)
    inv = read(two)
    cats = by_cat(inv)
    exact = rows * 4 * 4  # columns 0..3 of every row
    span = ((rows - 1) * cols + 4) * 4  # first to last byte of the two views
    assert exact <= cats["weights"] <= span
    assert cats["weights"] + cats["unused_storage"] == 4 * numel
    assert any("more than 65,536 separate runs" in n for n in inv.notes)


class _Pid(gen.Pid):
    """A persistent id given as its tuple (no element values behind it)."""

    def __init__(self, value: tuple[Any, ...]) -> None:
        self.fixed = value

    def value(self, py2: bool) -> tuple[Any, ...]:
        return self.fixed


def test_column_slice_shares_precedence_with_math(tmp_path: Path) -> None:
    """The same numbers without torch's help: 3 of 10 columns of a 10x10 float64 matrix."""
    big = torch.arange(100, dtype=torch.float64).reshape(10, 10)
    path = tmp_path / "c.pt"
    torch.save({"c": big[:, 7:]}, path)
    cats = by_cat(read(path))
    assert cats["weights"] == 10 * 3 * 8
    assert cats["unused_storage"] == (100 - 30) * 8
    assert math.prod(big[:, 7:].shape) * 8 == cats["weights"]


# -- NumPy arrays pickled by Python 2 ----------------------------------------------------------


class _NumpyOnly(pickle.Unpickler):
    """Loads NumPy arrays and nothing else (the fixture is ours, but a pickle runs code)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in {("numpy.core.multiarray", "_reconstruct"), ("numpy", "ndarray"),
                              ("numpy", "dtype")}:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} refused")


def test_python2_numpy_pickle_itemizes_its_arrays() -> None:
    name = "py2_numpy_weights.pkl"
    entry = MANIFEST["pickles"][name]
    path = FIXTURES / name
    assert hashlib.sha256(path.read_bytes()).hexdigest() == entry["sha256"]
    inv = read(path)
    assert inv.format == "pickle"
    assert by_cat(inv) == entry["bytes_by_category"]
    assert {t.name: (t.dtype, list(t.shape)) for t in inv.tensors} == {
        k: (a["dtype"], a["shape"]) for k, a in entry["tensors"].items()}
    # What Python 3 loads from it (latin-1, as NumPy documents for Python 2 pickles).
    with open(path, "rb") as fh:
        obj = _NumpyOnly(fh, encoding="latin1").load()
    arrays = {f"param values.{i}": a for i, a in enumerate(obj["param values"])}
    arrays["mean value"] = obj["mean value"]
    assert {k: (str(a.dtype), list(a.shape), hashlib.sha256(a.tobytes()).hexdigest())
            for k, a in arrays.items()} == {
        k: (a["dtype"], a["shape"], a["sha256"]) for k, a in entry["tensors"].items()}


def test_python2_torch_checkpoint_with_a_numpy_array(tmp_path: Path) -> None:
    m = gen.Model("py2", gen._PY2_CLASSES, "cuda:0")
    state = gen.ordered_dict([("fc.weight", m.tensor_v2("fc.weight", (2, 3), "float32",
                                                        "weights"))], "py2")
    mean = gen.numpy_array([0.5, 0.25, 0.125], (3,), "f4", {})
    data, cats = gen.legacy_file("py2", {"state_dict": state, "pixel_mean": mean}, m,
                                 gen.LINUX_SIZES)
    path = tmp_path / "with_numpy.pt"
    path.write_bytes(data)
    inv = read(path)
    assert {t.name: t.shape for t in inv.tensors} == {"state_dict.fc.weight": (2, 3),
                                                      "pixel_mean": (3,)}
    found = by_cat(inv)
    assert found["weights"] == cats["weights"] + 3 * 4
    assert found["metadata"] == cats["metadata"] - 3 * 4
