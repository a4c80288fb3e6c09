"""NumPy .npy/.npz: real files written by numpy, crafted liars, and the picklescan samples.

Expected numbers come from the file (the header length in its preamble, :mod:`zipfile` member
sizes and offsets) or from the arrays saved (``ndarray.nbytes``), never from modelsize.
"""

from __future__ import annotations

import pickle
import struct
import zipfile
from pathlib import Path

import pytest

from modelsize.categories import Category
from modelsize.errors import CorruptFileError, InputError
from modelsize.formats import Registry, read
from modelsize.formats.numpy import NpyReader, NpzReader, parse_descr
from modelsize.inventory import Inventory
from tests.conftest import assert_one_line_error, run_cli, shared_fixture

np = pytest.importorskip("numpy")

ONLY_NUMPY = Registry([NpzReader(), NpyReader()])
PICKLESCAN = ("hostile", "picklescan", "data2")


def _read(path: Path) -> Inventory:
    return read(path, ONLY_NUMPY)


def _npy_header_nbytes(raw: bytes) -> int:
    """Magic + version + length field + header, from the preamble written by numpy."""
    if raw[6] == 1:
        return 10 + int(struct.unpack("<H", raw[8:10])[0])
    return 12 + int(struct.unpack("<I", raw[8:12])[0])


def _local_header_nbytes(path: Path, info: zipfile.ZipInfo) -> int:
    with open(path, "rb") as fh:
        fh.seek(info.header_offset)
        fixed = fh.read(30)
    name_len, extra_len = struct.unpack("<HH", fixed[26:30])
    return 30 + name_len + extra_len


# -- .npy ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("array", "dtype_name"),
    [
        (np.arange(12, dtype=np.float32).reshape(3, 4), "float32"),
        (np.arange(6, dtype=np.float16), "float16"),
        (np.arange(7, dtype=np.int64), "int64"),
        (np.array([True, False, True]), "bool"),
        (np.ones((2, 2), dtype=np.complex128), "complex128"),
        (np.asfortranarray(np.arange(6.0).reshape(2, 3)), "float64"),
        (np.array(["ab", "cde"]), "str96"),
        (np.array([b"xy", b"z"]), "bytes16"),
        (np.array(["2024-01-01"], dtype="datetime64[ns]"), "datetime64[ns]"),
        (np.zeros(3, dtype=[("x", "<f4"), ("y", "<i2", (3,))]), "void80"),
        (np.zeros((0, 5), dtype=np.float32), "float32"),
        (np.float64(3.5), "float64"),
    ],
)
def test_npy_exact_bytes(tmp_path: Path, array: object, dtype_name: str) -> None:
    path = tmp_path / "arr.npy"
    np.save(path, array)
    raw = path.read_bytes()
    arr = np.asarray(array)
    inv = _read(path)
    assert inv.format == "npy"
    (t,) = inv.tensors
    assert (t.name, t.dtype, t.shape) == ("arr", dtype_name, arr.shape)
    assert t.nbytes == t.stored_nbytes == arr.nbytes
    assert t.category is Category.WEIGHTS
    assert inv.bytes_by_category[Category.METADATA] == _npy_header_nbytes(raw)
    assert inv.bytes_by_category[Category.WEIGHTS] == arr.nbytes
    assert inv.file_bytes == len(raw)


@pytest.mark.parametrize("version", [(1, 0), (2, 0), (3, 0)])
def test_npy_format_versions(tmp_path: Path, version: tuple[int, int]) -> None:
    arr = np.arange(10, dtype=np.float32)
    path = tmp_path / "v.npy"
    with open(path, "wb") as fh:
        np.lib.format.write_array(fh, arr, version=version)
    raw = path.read_bytes()
    assert raw[6] == version[0]
    inv = _read(path)
    assert inv.bytes_by_category[Category.METADATA] == _npy_header_nbytes(raw)
    assert inv.bytes_by_category[Category.WEIGHTS] == arr.nbytes


def test_npy_trailing_bytes_are_other(tmp_path: Path) -> None:
    path = tmp_path / "tail.npy"
    np.save(path, np.arange(4, dtype=np.int32))
    with open(path, "ab") as fh:
        fh.write(b"extra")
    inv = _read(path)
    assert inv.bytes_by_category[Category.OTHER] == 5
    assert any("5 bytes after" in n for n in inv.notes)


@pytest.mark.parametrize("shape", [(2**59, 0), (2**60, 0), (0, 2**63 - 1), (2**64, 0),
                                   (3, 0, 2**62)], ids=str)
def test_empty_arrays_with_huge_dimensions_are_read_as_numpy_reads_them(
        tmp_path: Path, shape: tuple[int, ...]) -> None:
    # NumPy multiplies the nonzero dimensions by the item size: a 0 elsewhere does not make
    # an overflowing shape loadable (found by a fuzz campaign: slim wrote one on as .npz)
    import io

    np = pytest.importorskip("numpy")
    path = tmp_path / "huge.npy"
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "<f8", "fortran_order": False, "shape": shape})
    path.write_bytes(header.getvalue())
    try:
        loads = np.load(path).shape == shape
    except (ValueError, OverflowError):
        loads = False
    if loads:
        assert read(path).format == "npy"
    else:
        with pytest.raises(CorruptFileError, match="larger than NumPy's largest array"):
            read(path)
    assert loads == (shape in ((2**59, 0),))


def test_structured_descr_sizes() -> None:
    descr = np.lib.format.dtype_to_descr(np.dtype([("a", "<f8"), ("b", [("c", "<i2")], (2,))]))
    dt = parse_descr(descr)
    assert dt.itemsize == np.dtype([("a", "<f8"), ("b", [("c", "<i2")], (2,))]).itemsize
    assert not dt.has_object
    assert parse_descr([("o", "|O"), ("x", "<f4")]).has_object


# -- object arrays: scanned, never unpickled ------------------------------------------------------

UNPICKLED: list[str] = []


def _record_unpickling() -> str:
    UNPICKLED.append("called")
    return "side effect"


class _Tripwire:
    """Unpickling this calls :func:`_record_unpickling`: the test fails if modelsize ever does."""

    def __reduce__(self) -> tuple[object, tuple[()]]:
        return _record_unpickling, ()


def _object_array() -> object:
    arr = np.empty(2, dtype=object)
    arr[0] = _Tripwire()
    arr[1] = "plain"
    return arr


def test_object_npy_is_scanned_not_loaded(tmp_path: Path) -> None:
    path = tmp_path / "obj.npy"
    np.save(path, _object_array(), allow_pickle=True)
    raw = path.read_bytes()
    inv = _read(path)
    assert not UNPICKLED
    assert any(g.endswith("_record_unpickling") for g in inv.unsafe_globals), inv.unsafe_globals
    (t,) = inv.tensors
    assert (t.dtype, t.shape, t.stored_nbytes) == ("object", (2,), 0)
    header = _npy_header_nbytes(raw)
    assert inv.bytes_by_category[Category.METADATA] == header
    assert inv.bytes_by_category[Category.OTHER] == len(raw) - header


@pytest.mark.parametrize("compressed", [False, True])
def test_object_npz_is_scanned_not_loaded(tmp_path: Path, compressed: bool) -> None:
    path = tmp_path / "obj.npz"
    save = np.savez_compressed if compressed else np.savez
    save(path, objs=_object_array(), nums=np.arange(3.0))
    inv = _read(path)
    assert not UNPICKLED
    assert any(g.endswith("_record_unpickling") for g in inv.unsafe_globals)
    assert inv.bytes_by_category[Category.WEIGHTS] > 0
    assert sum(inv.bytes_by_category.values()) == path.stat().st_size


# -- .npz ----------------------------------------------------------------------------------------


def test_npz_stored_members(tmp_path: Path) -> None:
    arrays = {
        "layer.weight": np.random.default_rng(0).standard_normal((4, 5)).astype(np.float32),
        "tokens": np.arange(9, dtype=np.int32),
        "optimizer.exp_avg": np.ones(6, dtype=np.float64),
    }
    path = tmp_path / "arrays.npz"
    np.savez(path, **arrays)
    inv = _read(path)
    assert inv.format == "npz"
    by_name = {t.name: t for t in inv.tensors}
    assert set(by_name) == set(arrays)
    for name, arr in arrays.items():
        assert by_name[name].nbytes == by_name[name].stored_nbytes == arr.nbytes
        assert by_name[name].shape == arr.shape
    cats = inv.bytes_by_category
    assert cats[Category.WEIGHTS] == arrays["layer.weight"].nbytes
    assert cats[Category.BUFFERS] == arrays["tokens"].nbytes
    assert cats[Category.OPTIMIZER_STATE] == arrays["optimizer.exp_avg"].nbytes
    data = sum(a.nbytes for a in arrays.values())
    assert cats[Category.METADATA] == path.stat().st_size - data
    # Each member's npy header and local zip header are among those metadata bytes.
    with zipfile.ZipFile(path) as zf:
        infos = zf.infolist()
        npy_headers = sum(_npy_header_nbytes(zf.read(i)[:12]) for i in infos)
    local = sum(_local_header_nbytes(path, i) for i in infos)
    assert cats[Category.METADATA] >= npy_headers + local


def test_npz_compressed_members_keep_stored_and_logical_sizes(tmp_path: Path) -> None:
    arrays = {"w": np.zeros((64, 64), dtype=np.float32), "idx": np.arange(1000)}
    path = tmp_path / "small.npz"
    np.savez_compressed(path, **arrays)
    with zipfile.ZipFile(path) as zf:
        infos = {i.filename.removesuffix(".npy"): i for i in zf.infolist()}
    inv = _read(path)
    by_name = {t.name: t for t in inv.tensors}
    storages = {s.key: s for s in inv.storages}
    for name, arr in arrays.items():
        info = infos[name]
        assert info.compress_type == zipfile.ZIP_DEFLATED
        assert by_name[name].nbytes == arr.nbytes
        assert by_name[name].stored_nbytes == info.compress_size
        assert storages[name].compressed
        assert storages[name].logical_nbytes == arr.nbytes
        assert storages[name].nbytes == info.compress_size
    assert inv.bytes_by_category[Category.WEIGHTS] == infos["w"].compress_size
    assert inv.bytes_by_category[Category.BUFFERS] == infos["idx"].compress_size
    assert sum(inv.bytes_by_category.values()) == path.stat().st_size


def test_npz_numeric_members_are_never_inflated_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from modelsize.formats import _zip

    def refuse(*args: object, **kwargs: object) -> bytes:
        raise AssertionError("array data was decompressed")

    monkeypatch.setattr(_zip, "read_member", refuse)
    path = tmp_path / "big.npz"
    np.savez_compressed(path, w=np.zeros(200_000, dtype=np.float32))
    assert _read(path).tensors[0].nbytes == 800_000


# -- liars ---------------------------------------------------------------------------------------


def _npy_bytes(header: str, data: bytes = b"", version: int = 1) -> bytes:
    raw = header.encode("latin1")
    if version == 1:
        return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(raw)) + raw + data
    return b"\x93NUMPY" + bytes([version, 0]) + struct.pack("<I", len(raw)) + raw + data


NPY_LIARS: dict[str, tuple[bytes, str]] = {
    "truncated_data": (
        _npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (10,), }\n", bytes(20)),
        "needs 40 bytes",
    ),
    "huge_shape": (
        _npy_bytes("{'descr': '<f8', 'fortran_order': False, 'shape': (10**30,), }\n", bytes(8)),
        "Python literal",
    ),
    "huge_literal_shape": (
        _npy_bytes(
            "{'descr': '<f8', 'fortran_order': False, 'shape': (2**40, 2**40), }\n"
            .replace("2**40", str(2**40)), bytes(8),
        ),
        "largest array",
    ),
    "header_past_end": (b"\x93NUMPY\x01\x00\xff\xff{'descr'", "runs past the end"),
    "code_in_header": (
        _npy_bytes("__import__('os').system('echo pwned')"), "Python literal",
    ),
    "missing_keys": (_npy_bytes("{'descr': '<f4'}"), "expected a dict"),
    "bad_descr": (
        _npy_bytes("{'descr': '<q9', 'fortran_order': False, 'shape': (1,), }"), "type string",
    ),
    "bad_version": (b"\x93NUMPY\x09\x00" + bytes(20), "version"),
    "negative_dim": (
        _npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (-1,), }"),
        "non-negative",
    ),
    "too_many_dims": (
        _npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (%s), }" % ("9," * 65)),
        "65 dimensions",
    ),
    "deep_nesting": (_npy_bytes("[" * 5000 + "]" * 5000), "Python literal"),
    "huge_header_v2": (
        b"\x93NUMPY\x02\x00" + struct.pack("<I", 2**31) + bytes(16), "runs past the end",
    ),
}


@pytest.mark.parametrize("case", sorted(NPY_LIARS))
def test_lying_npy_is_corrupt(tmp_path: Path, case: str) -> None:
    raw, message = NPY_LIARS[case]
    path = tmp_path / f"{case}.npy"
    path.write_bytes(raw)
    with pytest.raises(CorruptFileError, match=message):
        _read(path)


def test_truncated_npz_is_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "cut.npz"
    np.savez(path, a=np.arange(100.0), b=np.arange(50))
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(InputError):
        _read(path)


@pytest.mark.parametrize("method", [zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED])
def test_npz_member_shorter_than_its_header_says(tmp_path: Path, method: int) -> None:
    path = tmp_path / "liar.npz"
    member = _npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (1000,), }\n", bytes(40))
    with zipfile.ZipFile(path, "w", compression=method) as zf:
        zf.writestr("w.npy", member)
    with pytest.raises(CorruptFileError, match="4000"):
        _read(path)


def test_npz_member_header_claiming_huge_shape(tmp_path: Path) -> None:
    path = tmp_path / "huge.npz"
    header = f"{{'descr': '<f8', 'fortran_order': False, 'shape': ({2**62},), }}\n"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("w.npy", _npy_bytes(header, bytes(64)))
    with pytest.raises(CorruptFileError, match="largest array"):
        _read(path)


def test_cli_reports_one_line(tmp_path: Path) -> None:
    path = tmp_path / "liar.npy"
    path.write_bytes(NPY_LIARS["truncated_data"][0])
    assert_one_line_error(run_cli("inspect", str(path)), path)


# -- the picklescan samples ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["int_array.npy", "int_arrays.npz", "int_arrays_compressed.npz"])
def test_benign_picklescan_samples_read_clean(name: str) -> None:
    path = shared_fixture(*PICKLESCAN, name)
    inv = _read(path)
    assert not inv.unsafe_globals
    assert inv.file_bytes == path.stat().st_size
    loaded = np.load(path)  # benign int arrays: no pickle involved
    arrays = {"int_array": loaded} if name.endswith(".npy") else dict(loaded)
    assert {t.name: (t.dtype, t.shape, t.nbytes) for t in inv.tensors} == {
        k: (str(a.dtype), a.shape, a.nbytes) for k, a in arrays.items()
    }


def test_dns_exfiltration_sample_is_flagged() -> None:
    path = shared_fixture(*PICKLESCAN, "dns_exfiltration.npy")
    try:
        inv = _read(path)
    except InputError:
        return
    assert any("ssl" in g for g in inv.unsafe_globals), inv.unsafe_globals


@pytest.mark.parametrize(
    "name", ["object_array.npy", "object_arrays.npz", "object_arrays_compressed.npz"]
)
def test_object_array_samples_are_scanned(name: str) -> None:
    path = shared_fixture(*PICKLESCAN, name)
    inv = _read(path)
    assert inv.file_bytes == path.stat().st_size
    assert all(t.dtype == "object" and t.stored_nbytes == 0 for t in inv.tensors)
    assert inv.bytes_by_category[Category.OTHER] > 0
    # Only numpy's own rebuild functions, but np.load must be told allow_pickle=True to run
    # them, and then the pickle runs with full powers: what it calls is reported.
    assert "numpy.core.multiarray._reconstruct" in inv.unsafe_globals
    assert any("allow_pickle" in n for n in inv.notes)


@pytest.mark.parametrize("protocol", [2, 3])
def test_object_npy_holding_arrays_itemizes_them(tmp_path: Path, protocol: int) -> None:
    rng = np.random.default_rng(1)
    weights = {"conv": rng.standard_normal((2, 3)).astype(np.float32),
               "bias": np.arange(4, dtype=np.int64)}
    holder = np.empty((), dtype=object)
    holder[()] = weights
    path = tmp_path / "weights.npy"
    with open(path, "wb") as fh:  # np.save, at the pickle protocol given
        np.lib.format.write_array_header_1_0(fh, np.lib.format.header_data_from_array_1_0(holder))
        pickle.dump(holder, fh, protocol=protocol)
    inv = _read(path)
    by_name = {t.name: t for t in inv.tensors}
    assert {n: (t.dtype, t.shape) for n, t in by_name.items()} == {
        f"weights.{n}": (str(a.dtype), a.shape) for n, a in weights.items()}

    def stored(a: object) -> int:  # protocol 2: the data is latin-1 text, UTF-8 on disk
        raw = a.tobytes()  # type: ignore[attr-defined]
        return len(raw.decode("latin-1").encode("utf-8")) if protocol == 2 else len(raw)

    assert inv.bytes_by_category[Category.WEIGHTS] == stored(weights["conv"])
    assert inv.bytes_by_category[Category.BUFFERS] == stored(weights["bias"])
    assert inv.bytes_by_category[Category.OTHER] == 0
    assert sum(inv.bytes_by_category.values()) == path.stat().st_size
    for t in inv.tensors:
        st = next(s for s in inv.storages if s.key == t.storage)
        data = b"".join(NpyReader.storage_chunks(inv, st)) if st.compressed else (
            path.read_bytes()[st.offset : st.offset + st.nbytes])
        assert data == weights[t.name.split(".")[1]].tobytes()
