"""The builder's accounting rules, on hand-made files whose layout the test itself decides."""

from __future__ import annotations

from pathlib import Path

import pytest

from modelsize.categories import Category
from modelsize.errors import AccountingError, CorruptFileError
from modelsize.inventory import FileInfo, Inventory, InventoryBuilder


def _file(tmp_path: Path, data: bytes, name: str = "f.bin") -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


def test_gaps_are_filled_with_the_default_and_sum_to_file_size(tmp_path: Path) -> None:
    p = _file(tmp_path, bytes(100))
    b = InventoryBuilder("test", [p])
    b.add_region(10, 20, Category.GRAPH, "pickle")
    b.add_storage("s", 40, 16)
    b.add_tensor("w", "float32", (4,), Category.WEIGHTS, storage="s")
    inv = b.build()
    assert inv.file_bytes == 100
    assert inv.bytes_by_category[Category.GRAPH] == 20
    assert inv.bytes_by_category[Category.WEIGHTS] == 16
    assert inv.bytes_by_category[Category.METADATA] == 100 - 20 - 16
    assert list(inv.bytes_by_category) == list(Category)
    assert inv.tensors[0].stored_nbytes == 16 and inv.tensors[0].nbytes == 16


def test_view_of_a_larger_storage_leaves_unused_bytes(tmp_path: Path) -> None:
    p = _file(tmp_path, bytes(1000))
    b = InventoryBuilder("test", [p])
    b.add_storage("s", 0, 400)  # 100 float32
    b.add_tensor("head", "float32", (10,), Category.WEIGHTS, storage="s", storage_offset=5)
    inv = b.build()
    assert inv.bytes_by_category[Category.WEIGHTS] == 40
    assert inv.bytes_by_category[Category.UNUSED_STORAGE] == 360
    assert inv.tensors[0].nbytes == 40


def test_shared_storage_counts_once_with_precedence(tmp_path: Path) -> None:
    p = _file(tmp_path, bytes(64))
    b = InventoryBuilder("test", [p])
    b.add_storage("s", 0, 64)
    b.add_tensor("cache", "float32", (16,), Category.ACTIVATIONS, storage="s")
    b.add_tensor("w", "float32", (4, 4), Category.WEIGHTS, storage="s")
    inv = b.build()
    assert inv.bytes_by_category[Category.WEIGHTS] == 64
    assert inv.bytes_by_category[Category.ACTIVATIONS] == 0
    assert [t.stored_nbytes for t in inv.tensors] == [0, 64]


def test_strided_view_spans_first_to_last_element(tmp_path: Path) -> None:
    p = _file(tmp_path, bytes(4 * 12))
    b = InventoryBuilder("test", [p])
    b.add_storage("s", 0, 48)  # a 3x4 float32 matrix
    b.add_tensor("col0", "float32", (3,), Category.WEIGHTS, storage="s", strides=(4,))
    inv = b.build()
    assert inv.bytes_by_category[Category.WEIGHTS] == (2 * 4 + 1) * 4
    assert inv.bytes_by_category[Category.UNUSED_STORAGE] == 48 - 36


def test_identical_storages_are_duplicates_but_constant_ones_are_not(tmp_path: Path) -> None:
    a = bytes(range(256)) * 4
    data = a + a + bytes(1024) + bytes(1024)
    p = _file(tmp_path, data)
    b = InventoryBuilder("test", [p])
    for i, key in enumerate("abcd"):
        b.add_storage(key, i * 1024, 1024)
        b.add_tensor(f"t{key}", "float32", (256,), Category.WEIGHTS, storage=key)
    inv = b.build()
    assert inv.bytes_by_category[Category.DUPLICATES] == 1024
    assert inv.bytes_by_category[Category.WEIGHTS] == 3 * 1024
    dup = [t for t in inv.tensors if t.category == Category.DUPLICATES]
    assert [(t.name, t.duplicate_of) for t in dup] == [("tb", "ta")]


def test_ranges_past_the_end_or_overlapping_are_corrupt(tmp_path: Path) -> None:
    p = _file(tmp_path, bytes(10))
    b = InventoryBuilder("test", [p])
    with pytest.raises(CorruptFileError, match=r"claims bytes 5\.\.20"):
        b.add_storage("s", 5, 15)
    b.add_region(0, 6, Category.METADATA, "header")
    b.add_region(4, 4, Category.METADATA, "index")
    with pytest.raises(CorruptFileError, match="overlaps"):
        b.build()


def test_inventory_refuses_totals_that_do_not_add_up(tmp_path: Path) -> None:
    with pytest.raises(AccountingError):
        Inventory("test", (FileInfo(tmp_path / "x", 10),), (), (), ())


def test_multi_file_checkpoints_account_each_file(tmp_path: Path) -> None:
    p1, p2 = _file(tmp_path, bytes(10), "a"), _file(tmp_path, bytes(30), "b")
    b = InventoryBuilder("test", [p1, p2])
    b.add_storage("s", 2, 8, file=1)
    b.add_tensor("w", "float16", (4,), Category.WEIGHTS, storage="s")
    inv = b.build()
    assert inv.file_bytes == 40
    assert inv.bytes_by_category[Category.WEIGHTS] == 8
    assert inv.bytes_by_category[Category.METADATA] == 32
