"""Lua Torch .t7: real files written by Torch7 (../shared/fixtures/t7, ground truth from its
PROVENANCE.md) and files built here byte by byte in torch7's ``File.lua`` layout."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from modelsize.categories import Category
from modelsize.errors import CorruptFileError
from modelsize.formats import Registry, read
from modelsize.formats.base import Source
from modelsize.formats.t7 import T7Reader
from modelsize.inventory import Inventory
from tests.conftest import assert_one_line_error, run_cli, shared_fixture

ONLY_T7 = Registry([T7Reader()])


def _read(path: Path) -> Inventory:
    return read(path, ONLY_T7)


def _cats(inv: Inventory) -> dict[Category, int]:
    return {c: n for c, n in inv.bytes_by_category.items() if n}


# -- real Torch7 files: numbers from PROVENANCE.md -----------------------------------------


def test_mlp_saved_without_clear_state() -> None:
    inv = _read(shared_fixture("t7", "henlisp_DeepLearning_HW1_model.t7"))
    assert inv.file_bytes == 1_696_408
    cats = inv.bytes_by_category
    assert cats[Category.WEIGHTS] == 239_400
    assert cats[Category.GRADIENTS] == 239_400
    assert cats[Category.ACTIVATIONS] == 1_212_928
    assert cats[Category.BUFFERS] == 8  # nn.View's size LongStorage
    assert cats[Category.UNUSED_STORAGE] == cats[Category.DUPLICATES] == 0
    rest = cats[Category.GRAPH] + cats[Category.METADATA]
    assert rest == 1_696_408 - 239_400 - 239_400 - 1_212_928 - 8
    # One flattened getParameters() storage viewed by the 6 weight/bias tensors.
    weights = inv.tensors_in(Category.WEIGHTS)
    assert len(weights) == 6 and len({t.storage for t in weights}) == 1
    assert sum(t.nbytes for t in weights) == 239_400 == sum(t.stored_nbytes for t in weights)
    assert {t.dtype for t in weights} == {"float32"}  # CudaTensor


def test_gmodule_with_linear() -> None:
    inv = _read(shared_fixture("t7", "torchfile_gmodule_with_linear_identity.t7"))
    assert inv.file_bytes == 10_300
    cats = inv.bytes_by_category
    assert cats[Category.WEIGHTS] == 32 and cats[Category.GRADIENTS] == 32
    assert cats[Category.ACTIVATIONS] == 0
    assert cats[Category.GRAPH] + cats[Category.METADATA] == 10_300 - 64
    assert {t.dtype for t in inv.tensors_in(Category.WEIGHTS)} == {"float64"}


@pytest.mark.parametrize(
    ("name", "size", "dtype", "shape", "data"),
    [
        ("torchfile_floattensor.t7", 237, "float32", (2, 3, 4), 96),
        ("torchfile_doubletensor.t7", 175, "float64", (2, 3), 48),
    ],
)
def test_bare_tensors(name: str, size: int, dtype: str, shape: tuple[int, ...], data: int) -> None:
    inv = _read(shared_fixture("t7", name))
    assert _cats(inv) == {Category.WEIGHTS: data, Category.METADATA: size - data}
    (t,) = inv.tensors
    assert (t.dtype, t.shape, t.nbytes) == (dtype, shape, data)


def test_nngraph_node_without_tensors() -> None:
    inv = _read(shared_fixture("t7", "torchfile_nngraph_node.t7"))
    assert _cats(inv) == {Category.GRAPH: 335}
    assert inv.tensors == ()


def test_sniffed_by_structure(tmp_path: Path) -> None:
    p = tmp_path / "model.bin"
    p.write_bytes(shared_fixture("t7", "torchfile_floattensor.t7").read_bytes())
    assert T7Reader().sniff(Source.open(p))
    for name in ("other.bin", "ckpt.t7"):  # pytorch-cifar style: a torch pickle named .t7
        q = tmp_path / name
        q.write_bytes(b"\x80\x02" + bytes(30))
        assert not T7Reader().sniff(Source.open(q))


@pytest.mark.parametrize("cut", [3, 10, 40, 5000, 1_000_000, 1_696_000, 1_696_407])
def test_truncated_real_file_is_corrupt(tmp_path: Path, cut: int) -> None:
    data = shared_fixture("t7", "henlisp_DeepLearning_HW1_model.t7").read_bytes()
    p = tmp_path / "cut.t7"
    p.write_bytes(data[:cut])
    with pytest.raises(CorruptFileError):
        _read(p)


# -- files written here in torch7's binary layout ------------------------------------------


class W:
    """A tiny torch7 binary serializer (File.lua writeObject), longs 8 or 4 bytes."""

    def __init__(self, long_size: int = 8) -> None:
        self.lfmt = "<q" if long_size == 8 else "<i"

    @staticmethod
    def i(v: int) -> bytes:
        return struct.pack("<i", v)

    def longs(self, *vs: int) -> bytes:
        return b"".join(struct.pack(self.lfmt, v) for v in vs)

    def s(self, text: str) -> bytes:
        raw = text.encode()
        return self.i(2) + self.i(len(raw)) + raw

    def num(self, x: float) -> bytes:
        return self.i(1) + struct.pack("<d", x)

    def table(self, idx: int, pairs: list[tuple[bytes, bytes]]) -> bytes:
        return self.i(3) + self.i(idx) + self.i(len(pairs)) + b"".join(k + v for k, v in pairs)

    def torch(self, idx: int, cls: str, body: bytes) -> bytes:
        return self.i(4) + self.i(idx) + self.i(3) + b"V 1" + self.i(len(cls)) + cls.encode() + body

    def storage(self, idx: int, kind: str, values: bytes, n: int) -> bytes:
        return self.torch(idx, f"torch.{kind}Storage", self.longs(n) + values)

    def tensor(self, idx: int, kind: str, sizes: tuple[int, ...], offset: int,
               storage: bytes) -> bytes:
        strides, acc = [], 1
        for d in reversed(sizes):
            strides.insert(0, acc)
            acc *= d
        body = self.i(len(sizes)) + self.longs(*sizes) + self.longs(*strides)
        return self.torch(idx, f"torch.{kind}Tensor", body + self.longs(offset + 1) + storage)

    def ref(self, typeidx: int, idx: int) -> bytes:
        return self.i(typeidx) + self.i(idx)

    @staticmethod
    def function(idx: int | None, bytecode: bytes, upvalues: bytes) -> bytes:
        head = W.i(8) + W.i(idx) if idx is not None else W.i(6)
        return head + W.i(len(bytecode)) + bytecode + upvalues


def _linear_file(w: W) -> tuple[bytes, dict[Category, int]]:
    """nn.Linear(3 -> 2) after getParameters(): weight and bias view one storage of 8 floats,
    gradWeight/gradBias another; output caches a batch of 4; an optimizer state and a Lua
    function ride along in the top-level table."""
    params = bytes(range(32))
    grads = bytes(range(32, 64))
    out = bytes(range(100, 132))
    st_p = w.storage(3, "Float", params, 8)
    st_g = w.storage(6, "Float", grads, 8)
    fields = w.table(2, [
        (w.s("weight"), w.tensor(4, "Float", (2, 3), 0, st_p)),
        (w.s("bias"), w.tensor(5, "Float", (2,), 6, w.ref(4, 3))),
        (w.s("gradWeight"), w.tensor(7, "Float", (2, 3), 0, st_g)),
        (w.s("gradBias"), w.tensor(8, "Float", (2,), 6, w.ref(4, 6))),
        (w.s("output"), w.tensor(9, "Float", (4, 2), 0, w.storage(10, "Float", out, 8))),
        (w.s("gradInput"), w.tensor(11, "Float", (), 0, w.i(0))),
        (w.s("train"), w.i(5) + w.i(1)),
    ])
    module = w.torch(1, "nn.Linear", fields)
    moments = w.tensor(14, "Double", (2,), 0, w.storage(15, "Double", bytes(range(16)), 2))
    optim = w.table(13, [(w.s("m"), moments), (w.s("t"), w.num(3))])
    fn = w.function(17, b"\x1bLuaQ-bytecode", w.table(18, []))
    top = w.table(12, [
        (w.s("model"), module), (w.s("optimState"), optim), (w.s("model_again"), w.ref(4, 1)),
        (w.s("hook"), fn),
    ])
    return top, {
        Category.WEIGHTS: 32, Category.GRADIENTS: 32, Category.ACTIVATIONS: 32,
        Category.OPTIMIZER_STATE: 16,
    }


@pytest.mark.parametrize("long_size", [8, 4])
def test_module_fields_shared_storages_and_functions(tmp_path: Path, long_size: int) -> None:
    data, expected = _linear_file(W(long_size))
    p = tmp_path / "linear.t7"
    p.write_bytes(data)
    inv = _read(p)
    cats = inv.bytes_by_category
    for cat, n in expected.items():
        assert cats[cat] == n, cat
    assert cats[Category.UNUSED_STORAGE] == cats[Category.DUPLICATES] == 0
    assert sum(cats.values()) == len(data)
    t = {x.name: x for x in inv.tensors}
    assert t["model.bias"].storage == t["model.weight"].storage
    assert t["model.bias"].stored_nbytes == 8 and t["model.weight"].stored_nbytes == 24
    assert t["optimState.m"].category is Category.OPTIMIZER_STATE
    assert t["model.gradInput"].shape == (0,)
    assert inv.unsafe_globals == ("lua function",)
    assert ("written with 4-byte longs" in " ".join(inv.notes)) == (long_size == 4)


def test_view_reaching_part_of_a_storage_leaves_unused_bytes(tmp_path: Path) -> None:
    w = W()
    data = w.tensor(1, "Float", (2,), 1, w.storage(2, "Float", bytes(range(40)), 10))
    p = tmp_path / "narrow.t7"
    p.write_bytes(data)
    cats = _read(p).bytes_by_category
    assert cats[Category.WEIGHTS] == 8 and cats[Category.UNUSED_STORAGE] == 32


def test_ascii_mode(tmp_path: Path) -> None:
    """torch.save(f, t, 'ascii'): every number is text ending in a newline (THDiskFile.c)."""
    text = (b"4\n1\n3\nV 1\n17\ntorch.FloatTensor\n2\n2 3\n3 1\n1\n"
            b"4\n2\n3\nV 1\n18\ntorch.FloatStorage\n6\n0.5 1 2 3 4 5.25\n")
    p = tmp_path / "ascii.t7"
    p.write_bytes(text)
    inv = _read(p)
    (t,) = inv.tensors
    assert (t.dtype, t.shape, t.nbytes) == ("float32", (2, 3), 24)
    assert inv.bytes_by_category[Category.WEIGHTS] == len(b"0.5 1 2 3 4 5.25")
    assert inv.facts["t7.mode"] == "ascii"


def _nested_tables(depth: int) -> bytes:
    """``{[1] = {[1] = ... {[1] = nil}}}``: each level is a one-entry table header and key."""
    w = W()
    return b"".join(w.table(idx, [(w.num(1), b"")]) for idx in range(1, depth + 1)) + w.i(0)


def test_deep_nesting_within_limit(tmp_path: Path) -> None:
    p = tmp_path / "deep.t7"
    p.write_bytes(_nested_tables(5000))  # far past Python's recursion limit
    assert _read(p).bytes_by_category == {c: (p.stat().st_size if c is Category.GRAPH else 0)
                                          for c in Category}


def _liars() -> dict[str, bytes]:
    w = W()
    fl = w.storage(2, "Float", bytes(8), 2)
    return {
        "unknown_type": w.i(3) + w.i(1) + w.i(1) + w.i(42),
        "storage_size_huge": w.storage(1, "Float", bytes(8), 2**60),
        "storage_size_negative": w.storage(1, "Float", b"", -5),
        "string_length_past_eof": w.i(2) + w.i(10**9) + b"abc",
        "table_size_huge": w.i(3) + w.i(1) + w.i(2**30),
        "table_size_negative": w.i(3) + w.i(1) + w.i(-1),
        "ndim_huge": w.torch(1, "torch.FloatTensor", w.i(10**6)),
        "ndim_negative": w.torch(1, "torch.FloatTensor", w.i(-2)),
        "view_past_storage": w.tensor(1, "Float", (3,), 0, fl),
        "negative_size": w.tensor(1, "Float", (-3,), 0, fl),
        "wrong_storage_type": w.tensor(1, "Double", (2,), 0, fl),
        "storage_is_a_number": w.tensor(1, "Float", (2,), 0, w.num(4)),
        "missing_storage": w.tensor(1, "Float", (2,), 0, w.i(0)),
        "trailing_bytes": w.num(1) + b"junk",
        "too_deep": _nested_tables(20_000),
        "function_length_past_eof": W.function(None, b"", b"")[:-4] + w.i(2**30),
        "no_class_name": w.i(4) + w.i(1) + w.i(3) + b"V 1" + w.i(0),
        # Found by the fuzz target: File.lua takes "V \x80" for a class name (its version is
        # not a number), which no Torch class has; torchfile fails too; slim wrote it on.
        "version_not_a_number": w.torch(1, "torch.FloatStorage", w.longs(0)).replace(
            b"V 1", b"V \x80"),
    }


@pytest.mark.parametrize("case", sorted(_liars()))
def test_lying_files_are_corrupt(tmp_path: Path, case: str) -> None:
    p = tmp_path / "bad.t7"
    p.write_bytes(_liars()[case])
    with pytest.raises(CorruptFileError) as info:
        _read(p)
    assert info.value.format == "t7"


def test_cli_exit_2_one_line(tmp_path: Path) -> None:
    p = tmp_path / "bad.t7"
    p.write_bytes(_liars()["storage_size_huge"])
    assert_one_line_error(run_cli("inspect", str(p)), p)
