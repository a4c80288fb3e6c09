"""slim of Lua Torch .t7 files: the thin clone that ``clearState()`` would have saved.

Lua cannot run here, so the nn models are written by a tiny encoder of torch7's ``File.lua``
``writeObject`` layout (binary and ascii), checked against the ``torchfile`` package (a t7
reader we did not write) before use. The expected output of each slim is built by the same
encoder from a hand-written description of the thin clone (dropped tensors replaced by
``tensor.new()``, storages only dropped tensors used left out, partial storages compacted) and
compared byte for byte; ``torchfile`` then loads the output and its kept tensors must equal the
input's. Real Torch7 files come from ../shared/fixtures/t7 (see PROVENANCE.md there).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import modelsize
from modelsize.categories import Category
from modelsize.errors import UsageError
from tests.conftest import assert_one_line_error, run_cli, shared_fixture

torchfile = pytest.importorskip("torchfile")

#: torch7 element type -> NumPy dtype of its elements (Long is the file's long size).
KINDS = {"Float": "<f4", "Double": "<f8", "Half": "<f2", "Byte": "u1", "Int": "<i4"}


# -- a tiny torch7 serializer ----------------------------------------------------------------


@dataclass(eq=False)
class Storage:
    index: int
    kind: str
    values: Any  # a sequence of numbers


@dataclass(eq=False)
class Tensor:
    index: int
    kind: str
    sizes: tuple[int, ...] = ()
    storage: Storage | None = None
    offset: int = 0  # 0-based, elements
    strides: tuple[int, ...] | None = None  # None: contiguous


@dataclass(eq=False)
class Table:
    index: int
    items: list[tuple[Any, Any]] = field(default_factory=list)


@dataclass(eq=False)
class Module:
    index: int
    cls: str
    fields: Table


@dataclass(eq=False)
class Function:
    index: int
    bytecode: bytes


def empty(index: int, kind: str = "Float") -> Tensor:
    """What ``tensor.new()`` saves: no dimensions, no storage."""
    return Tensor(index, kind)


def contiguous(sizes: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(sizes):
        strides.insert(0, acc)
        acc *= d
    return tuple(strides)


class T7:
    """``File.lua`` writeObject: binary (native little-endian, ``long_size`` longs) or ascii
    (``THDiskFile.c``: numbers as text, each batch ending in a newline; bytes raw)."""

    def __init__(self, long_size: int = 8, ascii: bool = False) -> None:
        self.long_size = long_size
        self.ascii = ascii
        self.out = bytearray()
        self.written: set[int] = set()

    def ints(self, values: Iterable[int], fmt: str) -> None:
        values = list(values)
        if self.ascii:
            if values:
                self.out += " ".join(str(int(v)) for v in values).encode() + b"\n"
        else:
            self.out += struct.pack(f"<{len(values)}{fmt}", *values)

    def int_(self, v: int) -> None:
        self.ints([v], "i")

    def longs(self, values: Iterable[int]) -> None:
        self.ints(values, "q" if self.long_size == 8 else "i")

    def double(self, x: float) -> None:
        self.out += b"%.17g\n" % x if self.ascii else struct.pack("<d", x)

    def chars(self, raw: bytes) -> None:
        self.out += raw + (b"\n" if self.ascii and raw else b"")

    def string(self, text: str | bytes) -> None:
        raw = text.encode() if isinstance(text, str) else text
        self.int_(len(raw))
        self.chars(raw)

    def head(self, tag: int, index: int) -> bool:
        """Type and index; ``False`` when the object was written before (a reference)."""
        self.int_(tag)
        self.int_(index)
        if index in self.written:
            return False
        self.written.add(index)
        return True

    def dump(self, obj: Any) -> bytes:
        stack = [obj]
        while stack:
            item = stack.pop()
            pending = self.one(item)
            stack.extend(reversed(pending))
        return bytes(self.out)

    def one(self, obj: Any) -> list[Any]:
        """Write one object's head; return its children in order."""
        if obj is None:
            self.int_(0)
        elif isinstance(obj, bool):
            self.int_(5)
            self.int_(int(obj))
        elif isinstance(obj, (int, float)):
            self.int_(1)
            self.double(float(obj))
        elif isinstance(obj, (str, bytes)):
            self.int_(2)
            self.string(obj)
        elif isinstance(obj, Table):
            if self.head(3, obj.index):
                self.int_(len(obj.items))
                return [x for kv in obj.items for x in kv]
        elif isinstance(obj, Module):
            if self.head(4, obj.index):
                self.string("V 1")
                self.string(obj.cls)
                return [obj.fields]
        elif isinstance(obj, Function):
            if self.head(8, obj.index):
                self.int_(len(obj.bytecode))
                self.chars(obj.bytecode)
                return [Table(obj.index + 1000)]
        elif isinstance(obj, Storage):
            if self.head(4, obj.index):
                self.string("V 1")
                self.string(f"torch.{obj.kind}Storage")
                self.longs([len(obj.values)])
                self.elements(obj)
        elif isinstance(obj, Tensor):
            if self.head(4, obj.index):
                self.string("V 1")
                self.string(f"torch.{obj.kind}Tensor")
                self.int_(len(obj.sizes))
                self.longs(obj.sizes)
                self.longs(obj.strides if obj.strides is not None else contiguous(obj.sizes))
                self.longs([obj.offset + 1])
                return [obj.storage]
        else:
            raise TypeError(type(obj))
        return []

    def elements(self, st: Storage) -> None:
        long = "<i8" if self.long_size == 8 else "<i4"
        dtype = long if st.kind == "Long" else KINDS[st.kind]
        arr = np.asarray(st.values, dtype=dtype)
        if self.ascii and arr.itemsize > 1:
            fmt = {"<f4": "%.9g", "<f8": "%.17g", "<f2": "%.9g"}.get(dtype, "%d")
            if len(arr):
                self.out += " ".join(fmt % v for v in arr.tolist()).encode() + b"\n"
        else:
            self.chars(arr.tobytes())


def dump(obj: Any, **kw: Any) -> bytes:
    return T7(**kw).dump(obj)


# -- an nn model saved without clearState() --------------------------------------------------

RNG = np.random.default_rng(7)
PARAMS = RNG.standard_normal(24)  # Linear(3->4) weight + bias, BatchNorm(4) weight + bias
GRADS = RNG.standard_normal(24)
RUNNING_MEAN = RNG.standard_normal(4)
RUNNING_VAR = RNG.random(4) + 0.5
BATCH = 5


def model(thin: bool = False, kind: str = "Float", kept: str | None = None) -> Module:
    """nn.Sequential(Linear(3, 4), BatchNormalization(4), ReLU(true), View(4)) after a
    forward and backward on a batch of 5, parameters flattened by getParameters().

    ``thin``: what ``clearState()`` (and dropping gradients) leaves: every cached tensor a
    ``new()`` of its class, the gradient and activation storages gone. ``kept``: the element
    type of the kept tensors (a cast).
    """
    kept = kept or kind

    def values(x: Any) -> Any:  # as the input holds them (a cast narrows these)
        return np.asarray(x, KINDS[kind])

    def act(index: int, sizes: tuple[int, ...], st: Storage | None, offset: int = 0) -> Tensor:
        return empty(index, kind) if thin else Tensor(index, kind, sizes, st, offset)

    def cache(index: int, n: int) -> Storage:
        return Storage(index, kind, RNG.standard_normal(n))

    params = Storage(7, kept, values(PARAMS))
    grads = None if thin else Storage(10, kind, GRADS)
    linear = Module(4, "nn.Linear", Table(5, [
        ("weight", Tensor(6, kept, (4, 3), params)),
        ("bias", Tensor(8, kept, (4,), params, 12)),
        ("gradWeight", act(9, (4, 3), grads)),
        ("gradBias", act(11, (4,), grads, 12)),
        ("output", act(12, (BATCH, 4), None if thin else cache(13, BATCH * 4))),
        ("gradInput", act(14, (BATCH, 3), None if thin else cache(15, BATCH * 3))),
        ("train", True),
        ("_type", "torch.FloatTensor"),
    ]))
    bn_out = None if thin else cache(31, BATCH * 4)
    bn = Module(16, "nn.BatchNormalization", Table(17, [
        ("weight", Tensor(18, kept, (4,), params, 16)),
        ("bias", Tensor(19, kept, (4,), params, 20)),
        ("gradWeight", act(20, (4,), grads, 16)),
        ("gradBias", act(21, (4,), grads, 20)),
        ("running_mean", Tensor(22, kept, (4,), Storage(23, kept, values(RUNNING_MEAN)))),
        ("running_var", Tensor(24, kept, (4,), Storage(25, kept, values(RUNNING_VAR)))),
        ("save_mean", act(26, (4,), None if thin else cache(27, 4))),
        ("save_std", act(28, (4,), None if thin else cache(29, 4))),
        ("output", act(30, (BATCH, 4), bn_out)),
        ("gradInput", act(32, (BATCH, 4), None if thin else cache(33, BATCH * 4))),
        ("eps", 1e-5), ("momentum", 0.1), ("affine", True), ("train", False),
    ]))
    relu_out = act(36, (BATCH, 4), bn_out)  # in place: the BatchNorm output's storage
    relu = Module(34, "nn.ReLU", Table(35, [
        ("inplace", True), ("threshold", 0), ("val", 0),
        ("output", relu_out), ("gradInput", empty(37, kind)),
    ]))
    view_out = act(41, (BATCH, 4), bn_out)
    view = Module(38, "nn.View", Table(39, [
        ("size", Storage(40, "Long", [4])), ("numElements", 4),
        ("output", view_out), ("gradInput", empty(42, kind)),
    ]))
    modules = Table(3, [(1, linear), (2, bn), (3, relu), (4, view)])
    return Module(1, "nn.Sequential", Table(2, [
        ("modules", modules), ("output", view_out), ("gradInput", linear.fields.items[5][1]),
        ("train", False), ("_type", "torch.FloatTensor"),
    ]))


def _data_bytes(kind: str = "Float") -> dict[str, int]:
    """Bytes by category of :func:`model`, counted from its description."""
    item = np.dtype(KINDS[kind]).itemsize
    acts = (BATCH * 4 + BATCH * 3 + 4 + 4 + BATCH * 4 + BATCH * 4) * item
    return {"weights": 24 * item, "buffers": 8 * item + 8, "gradients": 24 * item,
            "activations": acts}


def _write(tmp_path: Path, name: str, data: bytes) -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


def _load(path: Path) -> Any:
    return torchfile.load(str(path))


def same_storage(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether torchfile built both arrays on one storage (views of one base array)."""

    def root(x: Any) -> Any:
        while getattr(x, "base", None) is not None:
            x = x.base
        return x

    return root(a) is root(b)


# -- comparing two torchfile trees -------------------------------------------------------------


def compare(a: Any, b: Any) -> tuple[list[str], list[str]]:
    """Walk two torchfile trees side by side; every non-tensor value must be equal, every
    tensor equal or emptied. Returns (paths of equal non-empty tensors, paths emptied)."""
    kept: list[str] = []
    emptied: list[str] = []
    seen: set[tuple[int, int]] = set()
    stack: list[tuple[str, Any, Any]] = [("", a, b)]
    while stack:
        path, x, y = stack.pop()
        if isinstance(x, np.ndarray):
            assert isinstance(y, np.ndarray), path
            assert x.dtype == y.dtype or y.size == 0, (path, x.dtype, y.dtype)
            if x.size and not y.size:
                emptied.append(path)
            else:
                assert np.array_equal(x, y, equal_nan=True), path
                if x.size:
                    kept.append(path)
            continue
        if isinstance(x, (dict, list, torchfile.TorchObject)):
            if (id(x), id(y)) in seen:
                continue
            seen.add((id(x), id(y)))
        if isinstance(x, torchfile.TorchObject):
            assert isinstance(y, torchfile.TorchObject), path
            assert x.torch_typename() == y.torch_typename(), path
            stack.append((path, x._obj, y._obj))
        elif isinstance(x, dict):
            # Same file order on both sides; keys may be tables or objects (compared by walk).
            assert isinstance(y, dict) and len(x) == len(y), path
            for (kx, vx), (ky, vy) in zip(x.items(), y.items(), strict=True):
                name = kx.decode() if isinstance(kx, bytes) else type(kx).__name__
                if not isinstance(kx, (dict, torchfile.TorchObject)):
                    assert kx == ky, path
                    name = kx.decode() if isinstance(kx, bytes) else str(kx)
                else:
                    stack.append((f"{path}<key>", kx, ky))
                stack.append((f"{path}.{name}" if path else name, vx, vy))
        elif isinstance(x, list):
            assert isinstance(y, list) and len(x) == len(y), path
            pairs = enumerate(zip(x, y, strict=True))
            stack.extend((f"{path}[{i + 1}]", u, v) for i, (u, v) in pairs)
        else:
            assert x == y, (path, x, y)
    return sorted(kept), sorted(emptied)


# -- the encoder is what torch7 writes: torchfile reads it ----------------------------------


def test_fixture_encoder_is_read_by_torchfile(tmp_path: Path) -> None:
    seq = _load(_write(tmp_path, "m.t7", dump(model())))
    assert seq.torch_typename() == b"nn.Sequential"
    linear, bn, relu, view = seq.modules
    assert np.array_equal(linear.weight, PARAMS[:12].astype("f4").reshape(4, 3))
    assert np.array_equal(bn.bias, PARAMS[20:].astype("f4"))
    assert np.array_equal(bn.running_var, RUNNING_VAR.astype("f4"))
    assert same_storage(linear.weight, bn.weight)  # one flattened storage
    assert same_storage(relu.output, bn.output) and seq.output is view.output
    assert linear.gradWeight.shape == (4, 3) and relu.gradInput.shape == (0,)
    assert list(view.size) == [4]
    thin = _load(_write(tmp_path, "thin.t7", dump(model(thin=True))))
    assert thin.modules[0].output.shape == (0,) and thin.modules[1].running_mean.shape == (4,)


# -- the thin clone ------------------------------------------------------------------------


def test_thin_clone_is_what_clear_state_saves(tmp_path: Path) -> None:
    src = _write(tmp_path, "model.t7", dump(model()))
    before = modelsize.inspect(src).inventory.bytes_by_category
    expected_cats = _data_bytes()
    for cat, n in expected_cats.items():
        assert before[Category(cat)] == n, cat

    report = modelsize.slim(src)
    out = tmp_path / "model.slim.t7"
    assert out.read_bytes() == dump(model(thin=True))  # byte for byte
    assert report.verified and report.predicted_bytes == out.stat().st_size

    kept, emptied = compare(_load(src), _load(out))
    assert kept == ["modules[1].bias", "modules[1].weight", "modules[2].bias",
                    "modules[2].running_mean", "modules[2].running_var", "modules[2].weight",
                    "modules[4].size"]
    assert "modules[2].output" in emptied and "modules[1].gradWeight" in emptied
    assert "modules[2].save_mean" in emptied and "output" in emptied
    seq = _load(out)
    assert np.array_equal(seq.modules[1].running_mean, RUNNING_MEAN.astype("f4"))
    assert same_storage(seq.modules[0].weight, seq.modules[1].bias)  # still flattened


def test_inspect_of_the_output_has_no_activations_or_gradients(tmp_path: Path) -> None:
    src = _write(tmp_path, "model.t7", dump(model()))
    out = tmp_path / "thin.t7"
    modelsize.slim(src, out)
    rep = modelsize.inspect(out)
    cats = rep.inventory.bytes_by_category
    assert cats[Category.ACTIVATIONS] == cats[Category.GRADIENTS] == 0
    assert cats[Category.UNUSED_STORAGE] == cats[Category.DUPLICATES] == 0
    assert cats[Category.WEIGHTS] == 24 * 4 and cats[Category.BUFFERS] == 8 * 4 + 8
    assert not {f.kind for f in rep.findings} & {"activations", "gradients", "unused_storage"}
    before = modelsize.inspect(src).inventory.bytes_by_category
    assert cats[Category.GRAPH] == before[Category.GRAPH]  # the nn structure, untouched


def test_dry_run_predicts_the_exact_size(tmp_path: Path) -> None:
    src = _write(tmp_path, "model.t7", dump(model()))
    report = modelsize.slim(src, tmp_path / "o.t7", dry_run=True)
    assert not (tmp_path / "o.t7").exists()
    assert report.predicted_bytes == len(dump(model(thin=True)))
    assert {d.name for d in report.dropped} >= {"modules[1].gradWeight", "modules[2].output"}


def test_drop_only_gradients_keeps_the_cached_outputs(tmp_path: Path) -> None:
    src = _write(tmp_path, "model.t7", dump(model()))
    out = tmp_path / "o.t7"
    modelsize.slim(src, out, drop=["gradients"])
    _, emptied = compare(_load(src), _load(out))
    assert emptied == ["modules[1].gradBias", "modules[1].gradWeight", "modules[2].gradBias",
                       "modules[2].gradWeight"]
    seq = _load(out)
    assert same_storage(seq.modules[2].output, seq.modules[1].output)  # ReLU in place


def test_ascii_input_becomes_the_same_binary_file(tmp_path: Path) -> None:
    src = _write(tmp_path, "ascii.t7", dump(model(), ascii=True))
    report = modelsize.slim(src, tmp_path / "o.t7")
    assert (tmp_path / "o.t7").read_bytes() == dump(model(thin=True))
    assert any("ascii" in n for n in report.notes)
    seq = _load(tmp_path / "o.t7")
    assert np.array_equal(seq.modules[1].running_var, RUNNING_VAR.astype("f4"))


def test_ascii_storage_longer_than_a_text_chunk(tmp_path: Path) -> None:
    """Numbers cut by the 1 MiB text chunks of the decoder are put back together."""
    values = RNG.standard_normal(150_000) * 1e5
    table = Table(1, [("w", Tensor(2, "Double", (150_000,), Storage(3, "Double", values))),
                      ("n", Tensor(4, "Float", (3,), Storage(5, "Float", values[:7]), 2))])
    src = _write(tmp_path, "big_ascii.t7", dump(table, ascii=True))
    assert src.stat().st_size > 2 << 20
    modelsize.slim(src, tmp_path / "o.t7")
    out = _load(tmp_path / "o.t7")
    assert np.array_equal(out[b"w"], values) and out[b"w"].dtype == np.float64
    assert np.array_equal(out[b"n"], values[2:5].astype("f4"))


def test_four_byte_longs_become_eight(tmp_path: Path) -> None:
    src = _write(tmp_path, "win.t7", dump(model(), long_size=4))
    inv = modelsize.inspect(src).inventory
    assert inv.facts["t7.long_size"] == "4"
    assert inv.bytes_by_category[Category.BUFFERS] == 8 * 4 + 4  # a 4-byte LongStorage
    modelsize.slim(src, tmp_path / "o.t7")
    assert (tmp_path / "o.t7").read_bytes() == dump(model(thin=True))
    assert list(_load(tmp_path / "o.t7").modules[3].size) == [4]


def test_cast_double_model_to_float32(tmp_path: Path) -> None:
    src = _write(tmp_path, "double.t7", dump(model(kind="Double")))
    modelsize.slim(src, tmp_path / "o.t7", cast="float32",
                   drop=["gradients", "activations"])
    out = (tmp_path / "o.t7").read_bytes()
    assert out == dump(model(thin=True, kind="Double", kept="Float"))
    seq = _load(tmp_path / "o.t7")
    assert seq.modules[0].weight.dtype == np.float32
    assert np.array_equal(seq.modules[1].running_mean, RUNNING_MEAN.astype("f4"))


def test_cast_to_float16_gives_half_tensors(tmp_path: Path) -> None:
    src = _write(tmp_path, "model.t7", dump(model()))
    report = modelsize.slim(src, tmp_path / "o.t7", cast="float16",
                            drop=["gradients", "activations"])
    assert (tmp_path / "o.t7").read_bytes() == dump(model(thin=True, kept="Half"))
    assert report.verified  # torchfile cannot read HalfTensors; modelsize's reader did
    out = modelsize.inspect(tmp_path / "o.t7").inventory
    weights = [t for t in out.tensors if t.name == "modules[1].weight"]
    assert weights[0].dtype == "float16"


def test_to_safetensors(tmp_path: Path) -> None:
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    src = _write(tmp_path, "model.t7", dump(model()))
    modelsize.slim(src, tmp_path / "o.safetensors", to="safetensors")
    got = safetensors_numpy.load_file(str(tmp_path / "o.safetensors"))
    seq = _load(src)
    assert set(got) == {"modules[1].weight", "modules[1].bias", "modules[2].weight",
                        "modules[2].bias", "modules[2].running_mean", "modules[2].running_var",
                        "modules[4].size"}
    assert np.array_equal(got["modules[1].weight"], seq.modules[0].weight)
    assert np.array_equal(got["modules[2].running_var"], seq.modules[1].running_var)
    assert np.array_equal(got["modules[4].size"], [4])


# -- views: shared, partial, strided, overlapping, deduplicated --------------------------------


def _views(thin: bool) -> Table:
    """Tensors kept whole, partly, strided and overlapping, in a plain table (all weights)."""
    flat = Storage(3, "Float", np.arange(10))
    big = np.arange(100, 110)
    return Table(1, [
        ("params", Tensor(2, "Float", (10,), flat)),  # getParameters()' flat tensor
        ("a", Tensor(4, "Float", (2, 3), flat)),
        ("b", Tensor(5, "Float", (4,), flat, 6)),
        ("t", Tensor(6, "Float", (3, 2), Storage(7, "Float", np.arange(20, 26)), 0, (1, 3))),
        ("part", Tensor(8, "Float", (2,), Storage(9, "Float", big[3:5] if thin else big),
                        0 if thin else 3)),
        ("gap1", Tensor(11, "Float", (2,), gap := Storage(
            10, "Float", [200, 201, 206, 207] if thin else np.arange(200, 210)))),
        ("gap2", Tensor(12, "Float", (2,), gap, 2 if thin else 6)),
        ("every_other", Tensor(13, "Float", (3,), Storage(
            14, "Float", np.arange(301, 306) if thin else np.arange(300, 310)),
            0 if thin else 1, (2,))),
        ("nothing", Tensor(15, "Float", (0,), flat)),
        ("bytes", Tensor(16, "Byte", (3,), Storage(17, "Byte", [1, 2, 255]))),
    ])


@pytest.mark.parametrize("written", [{}, {"ascii": True}, {"long_size": 4}],
                         ids=["binary", "ascii", "4-byte-longs"])
def test_partial_strided_and_overlapping_views(tmp_path: Path, written: dict[str, Any]) -> None:
    src = _write(tmp_path, "views.t7", dump(_views(False), **written))
    before = modelsize.inspect(src).inventory.bytes_by_category
    if not written.get("ascii"):  # text cannot be split by element: the best view owns it
        assert before[Category.UNUSED_STORAGE] == (8 + 6 + 7) * 4
    report = modelsize.slim(src, tmp_path / "o.t7")
    assert (tmp_path / "o.t7").read_bytes() == dump(_views(True))
    assert report.predicted_bytes == (tmp_path / "o.t7").stat().st_size
    if written:
        return  # torchfile reads binary files with native longs only
    kept, emptied = compare(_load(src), _load(tmp_path / "o.t7"))
    assert emptied == [] and len(kept) == 9
    out = _load(tmp_path / "o.t7")
    assert same_storage(out[b"params"], out[b"b"])
    # The writer keeps a strided view's strides, so the two elements between its three stay
    # (Lua code may rely on the view's layout); everything else unreached is gone.
    assert modelsize.inspect(tmp_path / "o.t7").inventory.bytes_by_category[
        Category.UNUSED_STORAGE] == 2 * 4


def test_storage_first_met_in_a_dropped_tensor_moves_to_its_first_kept_use(
        tmp_path: Path) -> None:
    def saved(thin: bool) -> Table:
        st = Storage(4, "Float", np.arange(6) / 4)
        cached = empty(3) if thin else Tensor(3, "Float", (6,), st)
        return Table(1, [("net", Module(2, "nn.Foo", Table(5, [("output", cached)]))),
                         ("w", Tensor(6, "Float", (2, 3), st)),
                         ("again", Tensor(7, "Float", (3,), st, 3))])

    src = _write(tmp_path, "moved.t7", dump(saved(False)))
    modelsize.slim(src, tmp_path / "o.t7")
    assert (tmp_path / "o.t7").read_bytes() == dump(saved(True))
    out = _load(tmp_path / "o.t7")
    assert same_storage(out[b"w"], out[b"again"]) and out[b"net"].output.shape == (0,)


def test_dedupe_makes_the_copy_view_the_original(tmp_path: Path) -> None:
    w = RNG.standard_normal(6)

    def saved(thin: bool) -> Table:
        first = Tensor(3, "Float", (2, 3), Storage(4, "Float", w))
        copy_storage = Storage(4, "Float", w) if thin else Storage(6, "Float", w)
        return Table(1, [("model", Table(2, [("w", first)])),
                         ("best", Table(7, [("w", Tensor(5, "Float", (2, 3), copy_storage))]))])

    src = _write(tmp_path, "two.t7", dump(saved(False)))
    assert modelsize.inspect(src).inventory.bytes_by_category[Category.DUPLICATES] == 24
    modelsize.slim(src, tmp_path / "o.t7", dedupe=True)
    assert (tmp_path / "o.t7").read_bytes() == dump(saved(True))
    out = _load(tmp_path / "o.t7")
    assert same_storage(out[b"model"][b"w"], out[b"best"][b"w"])
    assert np.array_equal(out[b"best"][b"w"], w.astype("f4").reshape(2, 3))


# -- real Torch7 files -------------------------------------------------------------------------


def test_real_mlp_saved_without_clear_state(tmp_path: Path) -> None:
    src = shared_fixture("t7", "henlisp_DeepLearning_HW1_model.t7")
    out = tmp_path / "mlp.t7"
    report = modelsize.slim(src, out)
    assert report.predicted_bytes == out.stat().st_size
    kept, emptied = compare(_load(src), _load(out))
    assert kept == ["modules[1].size"] + [
        f"modules[{i}].{f}" for i in (2, 4, 6) for f in ("bias", "weight")]
    # 6 gradients + 17 activations; Sequential's output and gradInput are two of them again.
    assert len(emptied) == 25 and {"output", "modules[7].output"} <= set(emptied)
    cats = modelsize.inspect(out).inventory.bytes_by_category
    before = modelsize.inspect(src).inventory.bytes_by_category
    assert cats[Category.WEIGHTS] == 239_400 and cats[Category.BUFFERS] == 8  # PROVENANCE.md
    assert cats[Category.GRADIENTS] == cats[Category.ACTIVATIONS] == 0
    assert cats[Category.GRAPH] == before[Category.GRAPH]
    # Only data and the dropped tensors' headers went: 17 + 6 tensors x (3 dims -> 0).
    assert out.stat().st_size < 1_696_408 - 239_400 - 1_212_928
    seq = _load(out)
    assert same_storage(seq.modules[1].weight, seq.modules[5].bias)  # getParameters()


def test_real_nngraph_gmodule(tmp_path: Path) -> None:
    src = shared_fixture("t7", "torchfile_gmodule_with_linear_identity.t7")
    out = tmp_path / "g.t7"
    modelsize.slim(src, out)
    kept, emptied = compare(_load(src), _load(out))
    assert len(kept) == 2 and all(k.endswith(("weight", "bias")) for k in kept)
    assert len(emptied) == 2 and all(k.endswith(("gradWeight", "gradBias")) for k in emptied)
    assert src.stat().st_size - out.stat().st_size > 32  # the gradients' data and headers


@pytest.mark.parametrize("name", ["torchfile_floattensor.t7", "torchfile_doubletensor.t7"])
def test_real_bare_tensor_is_copied_unchanged(tmp_path: Path, name: str) -> None:
    src = shared_fixture("t7", name)
    modelsize.slim(src, tmp_path / name)
    assert (tmp_path / name).read_bytes() == src.read_bytes()


# -- what the writer refuses -------------------------------------------------------------------


def test_lua_function_is_refused_in_one_line(tmp_path: Path) -> None:
    data = dump(Table(1, [("w", Tensor(2, "Float", (2,), Storage(3, "Float", [1, 2]))),
                          ("hook", Function(4, b"\x1bLuaQ\x00os.execute"))]))
    src = _write(tmp_path, "hooked.t7", data)
    with pytest.raises(UsageError, match="Lua functions"):
        modelsize.slim(src, tmp_path / "o.t7")
    proc = run_cli("slim", str(src), "-o", str(tmp_path / "o.t7"))
    assert_one_line_error(proc, src)
    assert not (tmp_path / "o.t7").exists()
    modelsize.slim(src, tmp_path / "o.safetensors", to="safetensors")  # the way out


def test_negative_strides_are_refused(tmp_path: Path) -> None:
    st = Storage(3, "Float", [1, 2, 3, 4])
    src = _write(tmp_path, "flip.t7", dump(Table(1, [
        ("w", Tensor(2, "Float", (4,), st, 3, (-1,)))])))  # 4, 3, 2, 1: inside its storage
    with pytest.raises(UsageError, match="negative strides"):
        modelsize.slim(src, tmp_path / "o.t7")
    assert not (tmp_path / "o.t7").exists()


def test_view_before_its_storage_is_corrupt(tmp_path: Path) -> None:
    st = Storage(3, "Float", [1, 2, 3, 4])
    src = _write(tmp_path, "lying.t7", dump(Table(1, [
        ("w", Tensor(2, "Float", (2,), st, 0, (-1,)))])))  # elements 0 and -1
    assert_one_line_error(run_cli("slim", str(src), "-o", str(tmp_path / "o.t7")), src)
    assert_one_line_error(run_cli("slim", str(src), "--to", "safetensors"), src)


def test_bfloat16_is_refused(tmp_path: Path) -> None:
    src = _write(tmp_path, "model.t7", dump(model()))
    with pytest.raises(UsageError, match="no bfloat16"):
        modelsize.slim(src, tmp_path / "o.t7", cast="bfloat16")
    assert_one_line_error(run_cli("slim", str(src), "--cast", "bfloat16"), src)
