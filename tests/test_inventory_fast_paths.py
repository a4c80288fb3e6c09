"""InventoryBuilder's shortcuts where every storage is one tensor's whole (add_whole_tensors):
the charges and the duplicate candidates, pinned against the general path on varied inputs."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from modelsize.categories import Category
from modelsize.inventory import Inventory, InventoryBuilder

W, B = Category.WEIGHTS, Category.BUFFERS
#: (dtype, bytes per element) of the tensors drawn.
_KINDS = [("float32", 4), ("float16", 2), ("bfloat16", 2), ("int64", 8), ("uint8", 1)]


def _columns(specs: list[tuple[str, str, tuple[int, ...], bytes]]) -> dict[str, Any]:
    """Columns for add_whole_tensors from ``(name, dtype, shape, data)``, laid end to end."""
    begins, ends, pos = [], [], 0
    for _, _, _, data in specs:
        begins.append(pos)
        pos += len(data)
        ends.append(pos)
    return {"names": [s[0] for s in specs], "dtypes": [s[1] for s in specs],
            "shapes": [s[2] for s in specs], "begins": begins, "ends": ends}


def _build(path: Path, header: int, cols: dict[str, Any], *, general: bool) -> Inventory:
    builder = InventoryBuilder("safetensors", [path])
    builder.add_region(0, header, Category.METADATA, "header")
    n = len(cols["names"])
    classes = [(B if "buf" in name else W, ("t",) if i % 3 == 0 else ())
               for i, name in enumerate(cols["names"])]
    builder.add_whole_tensors(0, header, cols["names"], cols["names"], cols["dtypes"],
                              cols["shapes"], cols["begins"], cols["ends"], classes)
    assert builder._whole == n
    if general:
        builder._whole = -1  # the general path: every shortcut off
    return builder.build()


def _records(inv: Inventory) -> tuple[Any, ...]:
    return (inv.tensors, inv.storages, [dict(st.bytes_by_category) for st in inv.storages],
            inv.regions, inv.notes, inv.bytes_by_category)


def _check(tmp_path: Path, specs: list[tuple[str, str, tuple[int, ...], bytes]],
           tail: bytes = b"") -> Inventory:
    cols = _columns(specs)
    path = tmp_path / "t.safetensors"
    header = 16
    path.write_bytes(b"h" * header + b"".join(s[3] for s in specs) + tail)
    fast = _build(path, header, cols, general=False)
    slow = _build(path, header, cols, general=True)
    assert _records(fast) == _records(slow)
    return fast


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def test_duplicates_found_alike(tmp_path: Path) -> None:
    a, b = bytes(range(64)), bytes(range(64, 128))
    specs = [
        ("x.weight", "float32", (4, 4), a), ("y.weight", "float32", (4, 4), a),  # equal bytes
        ("z.weight", "float32", (4, 4), b),
        ("h.weight", "float16", (4, 8), a),  # same size, other dtype: not a candidate of x
        ("s.weight", "float32", (16,), a),  # same size, other shape
        ("w.weight", "float32", (4, 4), a),
        ("one.buf", "float32", (1,), b"\x01\x00\x00\x00"),  # one element: never a duplicate
        ("one2.buf", "float32", (1,), b"\x01\x00\x00\x00"),
        ("empty", "float32", (0,), b""), ("empty2", "float32", (0, 3), b""),
    ]
    inv = _check(tmp_path, specs)
    dups = {t.name: t.duplicate_of for t in inv.tensors if t.duplicate_of}
    assert dups == {"y.weight": "x.weight", "w.weight": "x.weight"}


def test_layout_parts_and_gaps(tmp_path: Path) -> None:
    table = bytes(range(32))
    specs = [
        ("l0.weight.quant_map", "float32", (8,), table),
        ("l1.weight.quant_map", "float32", (8,), table),
        ("l0.weight", "uint8", (32,), table), ("l1.weight", "uint8", (32,), table),
    ]
    inv = _check(tmp_path, specs, tail=b"stray bytes")
    assert {t.name for t in inv.tensors if t.duplicate_of} == {"l1.weight"}


def test_same_size_mixed_dtypes_and_shapes(tmp_path: Path) -> None:
    data = bytes(range(16))
    specs = [("a", "float32", (4,), data), ("b", "float16", (8,), data),
             ("c", "float32", (2, 2), data), ("d", "float16", (8,), data),
             ("e", "float32", (4,), data), ("f", "uint8", (16,), data),
             ("g", "float32", (2, 2), data)]
    inv = _check(tmp_path, specs)
    assert {t.name: t.duplicate_of for t in inv.tensors if t.duplicate_of} == {
        "d": "b", "e": "a", "g": "c"}


def test_no_tensors(tmp_path: Path) -> None:
    _check(tmp_path, [])


@pytest.mark.parametrize("seed", range(12))
def test_random_files(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    pool = [bytes(rng.randrange(256) for _ in range(48)) for _ in range(3)] + [bytes(48)]
    specs = []
    for i in range(rng.randrange(1, 60)):
        dtype, size = rng.choice(_KINDS)
        shape = rng.choice([(48 // size,), (2, 24 // size), (0,), (1,)])
        n = _numel(shape) * size
        data = rng.choice(pool)[:n] if rng.random() < 0.7 else bytes(
            rng.randrange(256) for _ in range(n))
        word = rng.choice(["weight", "bias", "buf", "weight_shape", "g_idx", "norm"])
        specs.append((f"m.{i}.{word}", dtype, shape, data))
    _check(tmp_path, specs, tail=b"x" * rng.randrange(3))


def test_two_files(tmp_path: Path) -> None:
    data = bytes(range(40))
    paths = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    for p in paths:
        p.write_bytes(b"h" * 8 + data + data)

    def build(general: bool) -> Inventory:
        builder = InventoryBuilder("safetensors", paths)
        for f in (0, 1):
            builder.add_region(0, 8, Category.METADATA, "header", f)
            names = [f"f{f}.a", f"f{f}.b"]
            builder.add_whole_tensors(f, 8, names, names, ["float32", "float32"], [(10,), (10,)],
                                      [0, 40], [40, 80], [(W, ()), (W, ())])
        if general:
            builder._whole = -1
        return builder.build()

    fast, slow = build(False), build(True)
    assert _records(fast) == _records(slow)
    assert [t.duplicate_of for t in fast.tensors] == [None, "f0.a", "f0.a", "f0.a"]


def test_other_declarations_take_the_general_path(tmp_path: Path) -> None:
    path = tmp_path / "m.bin"
    path.write_bytes(bytes(range(64)) * 2)
    builder = InventoryBuilder("x", [path])
    builder.add_whole_tensors(0, 0, ["a"], ["a"], ["float32"], [(16,)], [0], [64], [(W, ())])
    builder.add_storage("s", 64, 64)
    builder.add_tensor("b", "float32", (8,), W, storage="s")
    assert builder._whole != len(builder._storages)
    inv = builder.build()
    assert [t.stored_nbytes for t in inv.tensors] == [64, 32]
    assert dict(inv.storages[1].bytes_by_category) == {W: 32, Category.UNUSED_STORAGE: 32}
