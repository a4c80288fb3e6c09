"""The builder's accounting rules, on hand-made files whose layout the test itself decides."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from modelsize.categories import PRECEDENCE, Category
from modelsize.errors import AccountingError, CorruptFileError
from modelsize.inventory import FileInfo, Inventory, InventoryBuilder, element_runs


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


def test_strided_view_reaches_its_elements_only(tmp_path: Path) -> None:
    p = _file(tmp_path, bytes(4 * 12))
    b = InventoryBuilder("test", [p])
    b.add_storage("s", 0, 48)  # a 3x4 float32 matrix
    b.add_tensor("col0", "float32", (3,), Category.WEIGHTS, storage="s", strides=(4,))
    inv = b.build()
    assert inv.bytes_by_category[Category.WEIGHTS] == 3 * 4  # elements 0, 4 and 8
    assert inv.bytes_by_category[Category.UNUSED_STORAGE] == 48 - 12
    assert inv.tensors[0].stored_nbytes == 12


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


def test_large_zero_tensors_are_not_read_whole(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # 40 zero-initialised 1 MiB tensors, and two equal non-constant ones: only the samples of
    # the zero ones are read, the real duplicate is still found.
    n = 1 << 20
    rnd = random.Random(0).randbytes(n)
    p = _file(tmp_path, bytes(40 * n) + rnd + rnd)
    b = InventoryBuilder("test", [p])
    for i in range(42):
        b.add_storage(f"s{i}", i * n, n)
        b.add_tensor(f"t{i}", "float32", (n // 4,), Category.WEIGHTS, storage=f"s{i}")
    from modelsize import inventory as inv_mod

    read: list[int] = []
    original = inv_mod._FileReader.read

    def counting(self: object, key: str, start: int, stop: int) -> bytes:
        read.append(stop - start)
        return original(self, key, start, stop)  # type: ignore[arg-type]

    monkeypatch.setattr(inv_mod._FileReader, "read", counting)
    inv = b.build()
    assert [(t.name, t.duplicate_of) for t in inv.tensors if t.duplicate_of] == [("t41", "t40")]
    # the duplicate pair whole (and a first chunk again to see it is not constant), samples
    # of the rest
    assert sum(read) < 3 * n + 40 * 4 * 4096


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


# -- storages no tensor reaches ------------------------------------------------------------


def test_storages_without_any_tensor_are_a_parser_failure(tmp_path: Path) -> None:
    p = _file(tmp_path, bytes(100))
    b = InventoryBuilder("test", [p])
    b.add_storage("a", 0, 40)
    b.add_storage("b", 40, 40)
    with pytest.raises(CorruptFileError, match="found 2 storages but no tensor refers to them: "
                       "this looks like a file layout modelsize does not understand; "
                       "please report it"):
        b.build()


def test_storages_mostly_unreached_are_a_parser_failure(tmp_path: Path) -> None:
    p = _file(tmp_path, bytes(100))
    b = InventoryBuilder("test", [p])
    b.layout = "pickle"
    for i, key in enumerate("abc"):
        b.add_storage(key, 10 * i, 10)
    b.add_tensor("w", "uint8", (10,), Category.WEIGHTS, storage="a")
    with pytest.raises(CorruptFileError, match="found 3 storages but no tensor refers to 2 of "
                       "them: this looks like a pickle layout"):
        b.build()


def test_a_few_unreached_storages_among_reached_ones_are_unused(tmp_path: Path) -> None:
    p = _file(tmp_path, bytes(100))
    b = InventoryBuilder("test", [p])
    for i, key in enumerate("abc"):
        b.add_storage(key, 10 * i, 10)
    b.add_tensor("a", "uint8", (10,), Category.WEIGHTS, storage="a")
    b.add_tensor("b", "uint8", (2,), Category.WEIGHTS, storage="b")
    cats = b.build().bytes_by_category
    assert cats[Category.WEIGHTS] == 12 and cats[Category.UNUSED_STORAGE] == 8 + 10


def test_one_big_storage_and_a_small_slice_is_legitimate(tmp_path: Path) -> None:
    p = _file(tmp_path, bytes(1 << 20))
    b = InventoryBuilder("test", [p])
    b.add_storage("s", 0, 1 << 20)
    b.add_tensor("head", "float32", (4,), Category.WEIGHTS, storage="s", storage_offset=8)
    cats = b.build().bytes_by_category
    assert cats[Category.WEIGHTS] == 16 and cats[Category.UNUSED_STORAGE] == (1 << 20) - 16


# -- the bytes a strided view reaches ----------------------------------------------------------


def _elements(shape: tuple[int, ...], strides: tuple[int, ...], offset: int = 0) -> set[int]:
    """Every element index a view reaches, listed one by one (small views only)."""
    found = {offset}
    for d, s in zip(shape, strides, strict=True):
        found = {i + k * s for i in found for k in range(d)}
    return found if all(shape) else set()


def _runs_of(elements: set[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for i in sorted(elements):
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def test_element_runs_agree_with_listing_every_element() -> None:
    rng = random.Random(7)
    for _ in range(3000):
        ndim = rng.randint(1, 4)
        shape = tuple(rng.choice((0, 1, 2, 3, 4, 5, 7)) for _ in range(ndim))
        strides = tuple(rng.choice((-6, -1, 0, 1, 2, 3, 4, 5, 8, 12, 30)) for _ in range(ndim))
        expected = _elements(shape, strides)
        first, stop, runs, count, approximate = element_runs(shape, strides)
        assert not approximate
        assert count == len(expected), (shape, strides)
        assert runs == _runs_of(expected), (shape, strides)
        if expected:
            assert (first, stop) == (min(expected), max(expected) + 1)
        # With room for only a few runs the count stays exact unless elements repeat, and an
        # approximation only ever covers more.
        first, stop, few, count, approximate = element_runs(shape, strides, limit=3)
        if approximate:
            assert count >= len(expected)
            listed = few if few is not None else [(first, stop)]
            assert expected <= {i for a, b in listed for i in range(a, b)}
        else:
            assert count == len(expected), (shape, strides)
            assert few is None or few == _runs_of(expected)


_Views = dict[str, tuple[Category, tuple[int, ...], tuple[int, ...], int]]


def _views_build(tmp_path: Path, views: _Views, size: int) -> Inventory:
    p = _file(tmp_path, bytes(size * 4), "views.bin")
    b = InventoryBuilder("test", [p])
    b.add_storage("s", 0, size * 4)
    for name, (cat, shape, strides, offset) in views.items():
        b.add_tensor(name, "float32", shape, cat, storage="s", strides=strides,
                     storage_offset=offset)
    return b.build()


def test_views_of_one_storage_are_charged_their_union(tmp_path: Path) -> None:
    views = {  # a 20x30 float32 matrix seen five ways
        "cols": (Category.WEIGHTS, (20, 3), (30, 1), 4),
        "rows": (Category.WEIGHTS, (2, 30), (30, 1), 60),
        "steps": (Category.OPTIMIZER_STATE, (7, 5), (90, 7), 2),
        "t": (Category.ACTIVATIONS, (4, 6), (1, 30), 100),
        "overlapping": (Category.BUFFERS, (5, 3, 2), (1, 1, 2), 450),
    }
    inv = _views_build(tmp_path, views, 600)
    reached = {n: {4 * e + k for e in _elements(v[1], v[2], v[3]) for k in range(4)}
               for n, v in views.items()}
    order = sorted(views, key=lambda n: (PRECEDENCE.index(views[n][0]), list(views).index(n)))
    taken: set[int] = set()
    stored: dict[str, int] = {}
    for n in order:
        stored[n] = len(reached[n] - taken)
        taken |= reached[n]
    assert {t.name: t.stored_nbytes for t in inv.tensors} == stored
    cats = inv.bytes_by_category
    for cat in (Category.WEIGHTS, Category.OPTIMIZER_STATE, Category.ACTIVATIONS,
                Category.BUFFERS):
        assert cats[cat] == sum(stored[n] for n in views if views[n][0] is cat)
    assert cats[Category.UNUSED_STORAGE] == 600 * 4 - len(taken)
    assert not inv.notes


def test_huge_fake_views_are_counted_exactly(tmp_path: Path) -> None:
    """Metadata only: 10**9-element storages in a sparse file, each viewed by one huge view
    (3 columns of every row; 5 pairs of odd rows), and a slice beside one of them."""
    rows, cols = 10**6, 1000
    n = 4 * rows * cols
    p = tmp_path / "sparse.bin"
    with open(p, "wb") as fh:
        fh.truncate(2 * n)
    b = InventoryBuilder("test", [p])
    b.add_storage("a", 0, n)
    b.add_storage("b", n, n)
    b.add_tensor("w", "float32", (rows - 1, 3), Category.WEIGHTS, storage="a",
                 strides=(cols, 1))
    b.add_tensor("head", "float32", (5,), Category.WEIGHTS, storage="a",
                 storage_offset=(rows - 1) * cols)  # the last row: past w's span
    b.add_tensor("x", "float32", (rows // 2, 5, 2), Category.WEIGHTS, storage="b",
                 strides=(2 * cols, 100, 1), storage_offset=cols + 7)
    inv = b.build()
    stored = [4 * (rows - 1) * 3, 4 * 5, 4 * rows // 2 * 10]
    assert [t.stored_nbytes for t in inv.tensors] == stored
    assert inv.bytes_by_category[Category.WEIGHTS] == sum(stored)
    assert inv.bytes_by_category[Category.UNUSED_STORAGE] == 2 * n - sum(stored)
    assert not inv.notes


def test_huge_overlapping_views_are_merged_conservatively_with_a_note(tmp_path: Path) -> None:
    rows, cols = 10**6, 1000
    p = tmp_path / "sparse.bin"
    with open(p, "wb") as fh:
        fh.truncate(4 * rows * cols)
    b = InventoryBuilder("test", [p])
    b.add_storage("s", 0, 4 * rows * cols)
    b.add_tensor("w", "float32", (rows, 3), Category.WEIGHTS, storage="s", strides=(cols, 1))
    b.add_tensor("v", "float32", (rows, 3), Category.WEIGHTS, storage="s", strides=(cols, 1),
                 storage_offset=1)
    inv = b.build()
    weights = inv.bytes_by_category[Category.WEIGHTS]
    assert 4 * rows * 4 <= weights <= 4 * ((rows - 1) * cols + 4)  # exact <= charged <= span
    assert any("more than 65,536 separate runs" in n for n in inv.notes)


def test_large_candidates_are_read_past_their_start_only_where_starts_agree(
        tmp_path: Path, preads: list[int]) -> None:
    """inventory._FileReader.probe_groups: 24 trained layers of one shape differ in their
    first 4 KiB and are read there only (one read each); two that start alike and differ at
    the end are read further and told apart; a true copy is found."""
    np = pytest.importorskip("numpy")
    st = pytest.importorskip("safetensors.numpy")
    from modelsize import formats

    rng = np.random.default_rng(0)
    n = 16384  # 64 KiB of float32: sampled at its start, middle and end
    tensors = {f"layer.{i}": rng.standard_normal(n).astype(np.float32) for i in range(24)}
    alike = rng.standard_normal(n).astype(np.float32)
    other = alike.copy()
    other[-1] += 1
    tensors.update({"alike": alike, "other": other, "copy": tensors["layer.3"].copy()})
    path = tmp_path / "m.safetensors"
    st.save_file(tensors, path)
    inv = formats.read(path)
    dupes = {t.name for t in inv.tensors if t.category is Category.DUPLICATES}
    assert dupes in ({"copy"}, {"layer.3"})  # the later of the two in the file
    samples = [r for r in preads if r == 4096]
    # 27 starts; the middle and end of alike, other, layer.3 and copy; a few more for the
    # constant check of the equal pair (84 when every candidate's three samples were read)
    assert len(samples) <= 27 + 2 * 4 + 4
