"""Keras and HDF5: real files written by Keras 3, tf_keras and h5py (committed with their
generator), the pure-Python HDF5 reader underneath, and files damaged to lie."""

from __future__ import annotations

import hashlib
import json
import mmap
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest

from modelsize.categories import Category
from modelsize.errors import CorruptFileError
from modelsize.formats import read, sniff_format
from modelsize.formats._hdf5 import BytesBlob, HDF5Error, read_hdf5
from modelsize.formats.keras import layer_classes
from tests.conftest import REPO, assert_one_line_error, cli_json, run_cli

FIXTURES = REPO / "tests" / "fixtures" / "keras"
MANIFEST = json.loads((FIXTURES / "MANIFEST.json").read_text())
CASES = {c["path"]: c for c in MANIFEST["cases"]}
EXACT = sorted(name for name, c in CASES.items() if c["categories"] is not None)


def _hdf5(path: Path) -> Any:
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        return read_hdf5(BytesBlob(mm))


# -- real files ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CASES))
def test_fixture_checksums(name: str) -> None:
    assert hashlib.sha256((FIXTURES / name).read_bytes()).hexdigest() == CASES[name]["sha256"]


@pytest.mark.parametrize("name", EXACT)
def test_fixture_bytes_match_keras(name: str) -> None:
    case = CASES[name]
    inv = read(FIXTURES / name)
    assert inv.format == ("keras" if name.endswith(".keras") else "keras-h5")
    assert inv.file_bytes == case["bytes"]
    assert inv.bytes_by_category == {Category(c): n for c, n in case["categories"].items()}
    ours = {t.name: t for t in inv.tensors}
    assert sorted(ours) == sorted(case["tensors"])
    for key, truth in case["tensors"].items():
        t = ours[key]
        assert (t.category.value, list(t.shape)) == (truth["category"], truth["shape"]), key
        chunks = [tag for tag in t.tags if tag.startswith("chunks=")]
        # A dataset in several chunks is charged through regions, not one storage.
        assert t.stored_nbytes == (0 if chunks else truth["bytes"]), key


def test_include_optimizer_false_keeps_the_optimizer_state() -> None:
    kept = CASES["model_include_optimizer_false.keras"]
    assert kept["optimizer_state_kept"] is True  # what Keras 3 did at generation time
    inv = read(FIXTURES / "model_include_optimizer_false.keras")
    assert inv.bytes_by_category[Category.OPTIMIZER_STATE] == (
        CASES["model.keras"]["categories"]["optimizer_state"]
    ) > 0


def test_save_weights_keeps_the_optimizer_state_too() -> None:
    inv = read(FIXTURES / "model.weights.h5")
    assert inv.facts["layout"] == "Keras 3 weights"
    assert inv.bytes_by_category[Category.OPTIMIZER_STATE] > 0


def test_batch_norm_statistics_are_buffers_in_keras3() -> None:
    inv = read(FIXTURES / "model.keras")
    t = {x.name: x.category for x in inv.tensors}
    assert t["layers/batch_normalization/vars/0"] is Category.WEIGHTS  # gamma
    assert t["layers/batch_normalization/vars/2"] is Category.BUFFERS  # moving_mean
    assert t["layers/normalization/vars/0"] is Category.BUFFERS  # adapted mean


def test_legacy_model_config_is_graph() -> None:
    inv = read(FIXTURES / "legacy.h5")
    assert inv.facts["layout"] == "legacy Keras model"
    assert inv.bytes_by_category[Category.GRAPH] == CASES["legacy.h5"]["categories"]["graph"]
    assert sniff_format(FIXTURES / "legacy_weights.h5") == "keras-h5"


def test_deflated_archive_is_read_in_place() -> None:
    case = CASES["model_deflated.keras"]
    inv = read(FIXTURES / "model_deflated.keras")
    assert inv.facts["weights_member"] == "deflated"
    assert inv.file_bytes == case["bytes"]
    assert inv.bytes_by_category[Category.GRAPH] == case["graph"]
    ours = {t.name: t for t in inv.tensors}
    for key, truth in case["tensors"].items():
        t = ours[key]
        assert t.category.value == truth["category"]
        assert t.nbytes == truth["bytes"]  # logical bytes, as in the stored archive
    charged = sum(t.stored_nbytes for t in inv.tensors)
    assert 0 < charged <= case["weights_member_compressed"]
    for cat in (Category.WEIGHTS, Category.BUFFERS, Category.OPTIMIZER_STATE):
        assert inv.bytes_by_category[cat] > 0
    assert inv.bytes_by_category[Category.DUPLICATES] == 0


def test_cli_json_matches_manifest() -> None:
    out = cli_json("inspect", str(FIXTURES / "model.keras"))
    assert out["format"] == "keras"
    assert out["bytes_by_category"] == CASES["model.keras"]["categories"]


# -- the HDF5 reader -----------------------------------------------------------------------


def test_hdf5_layouts() -> None:
    h5 = _hdf5(FIXTURES / "layouts.h5")
    d = {x.path: x for x in h5.datasets}
    assert (d["/data/contiguous"].layout, d["/data/contiguous"].shape) == ("contiguous", (10, 10))
    assert d["/data/chunked"].layout == "chunked"
    assert len(d["/data/chunked"].pieces) == (60 // 30) * (40 // 20)
    assert d["/data/gzip_one_chunk"].filters == ("gzip",)
    assert d["/data/gzip_one_chunk"].logical_nbytes == 256 * 8
    assert d["/data/compact"].layout == "compact"
    assert d["/data/half"].dtype == "float16"
    assert d["/data/flags"].dtype == "bool"
    assert d["/data/never_written"].pieces == []
    root = h5.groups["/"]
    assert root["note"].value == "a variable-length string attribute"
    assert json.loads(str(root["model_config"].value)) == {"class_name": "Sequential"}


def test_hdf5_latest_format() -> None:
    h5 = _hdf5(FIXTURES / "layouts_latest.h5")
    assert h5.version == 3
    assert sorted(d.path for d in h5.datasets) == [
        "/layers/dense/bias", "/layers/dense/kernel", "/step",
    ]


def test_hdf5_legacy_attributes() -> None:
    h5 = _hdf5(FIXTURES / "legacy.h5")
    assert h5.groups["/model_weights"]["layer_names"].value == [
        "dense", "batch_normalization", "dense_1",
    ]


def test_layer_classes_from_config() -> None:
    config = {"class_name": "Functional", "config": {"name": "m", "layers": [
        {"class_name": "BatchNormalization", "config": {"name": "bn"}},
        {"class_name": "Sequential", "config": {"name": "inner", "layers": [
            {"class_name": "Dense", "config": {"name": "d"}}]}},
    ]}}
    assert layer_classes(config) == {
        "m": "Functional", "bn": "BatchNormalization", "inner": "Sequential", "d": "Dense",
    }


# -- damaged files -------------------------------------------------------------------------


def _copy(tmp_path: Path, name: str) -> Path:
    dst = tmp_path / name
    shutil.copy(FIXTURES / name, dst)
    dst.chmod(0o644)
    return dst


def _patch(path: Path, at: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[at : at + len(data)] = data
    path.write_bytes(bytes(raw))


def _contiguous_layout_at(path: Path, dataset: str) -> int:
    """Offset of the (address, size) pair of a dataset's v3 contiguous layout message."""
    d = {x.path: x for x in _hdf5(path).datasets}[dataset]
    raw = path.read_bytes()
    at = raw.find(struct.pack("<QQ", *d.pieces[0]))
    assert at > 0
    return at


@pytest.mark.parametrize("cut", [100, 2000, 9000, 30000])
def test_truncated_h5_is_corrupt(tmp_path: Path, cut: int) -> None:
    p = _copy(tmp_path, "legacy.h5")
    p.write_bytes(p.read_bytes()[:cut])
    with pytest.raises(CorruptFileError):
        read(p)
    assert_one_line_error(run_cli("inspect", str(p)), p)


def test_dataset_lying_about_its_size(tmp_path: Path) -> None:
    p = _copy(tmp_path, "model.weights.h5")
    at = _contiguous_layout_at(p, "/layers/dense/vars/0")
    _patch(p, at + 8, struct.pack("<Q", 10**12))
    with pytest.raises(CorruptFileError, match="claims bytes"):
        read(p)
    assert_one_line_error(run_cli("inspect", str(p)), p)


def test_root_object_header_past_the_end(tmp_path: Path) -> None:
    p = _copy(tmp_path, "legacy_weights.h5")
    # Superblock v0 with 8-byte offsets: the root symbol table entry's header address.
    _patch(p, 24 + 4 * 8 + 8, struct.pack("<Q", 10**9))
    with pytest.raises(CorruptFileError, match="object header"):
        read(p)


def test_unknown_superblock_version(tmp_path: Path) -> None:
    p = _copy(tmp_path, "layouts.h5")
    _patch(p, 8, b"\x07")
    with pytest.raises(CorruptFileError, match="superblock version 7"):
        read(p)


def test_group_linking_back_to_the_root_ends(tmp_path: Path) -> None:
    p = _copy(tmp_path, "legacy_weights.h5")
    raw = p.read_bytes()
    root = struct.unpack_from("<Q", raw, 24 + 4 * 8 + 8)[0]
    child = {x.path: x for x in _hdf5(p).datasets}["/dense/dense/kernel:0"].header
    at = raw.find(struct.pack("<Q", child))
    while at >= 0 and raw[at - 8 : at] == b"\x00" * 8:  # skip anything but an SNOD entry
        at = raw.find(struct.pack("<Q", child), at + 1)
    _patch(p, at, struct.pack("<Q", root))
    h5 = _hdf5(p)
    assert any("already seen" in n for n in h5.notes)


def test_hdf5_cycle_in_continuations_is_refused() -> None:
    # A v1 object header at 96 whose messages (at 112) continue into themselves.
    header = struct.pack("<BBHII", 1, 0, 1, 1, 24) + b"\x00" * 4
    msg = struct.pack("<HHB3x", 0x10, 16, 0) + struct.pack("<QQ", 112, 24)
    undefined = 2**64 - 1
    superblock = (
        b"\x89HDF\r\n\x1a\n" + bytes([0, 0, 0, 0, 0, 8, 8, 0]) + struct.pack("<HHI", 4, 16, 0)
        + struct.pack("<QQQQ", 0, undefined, 200, undefined)
        + struct.pack("<QQII", 0, 96, 0, 0) + b"\x00" * 16
    )
    blob = (superblock.ljust(96, b"\x00") + header + msg).ljust(200, b"\x00")
    with pytest.raises(HDF5Error, match="cycle"):
        read_hdf5(BytesBlob(blob))


def test_truncated_keras_archive(tmp_path: Path) -> None:
    p = _copy(tmp_path, "model.keras")
    p.write_bytes(p.read_bytes()[:20000])
    proc = run_cli("inspect", str(p))
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_deflated_member_with_a_wrong_crc(tmp_path: Path) -> None:
    p = _copy(tmp_path, "model_deflated.keras")
    raw = p.read_bytes()
    name = b"model.weights.h5"
    entry = raw.find(b"PK\x01\x02", raw.find(b"PK\x01\x02"))
    while raw[entry + 46 : entry + 46 + len(name)] != name:
        entry = raw.find(b"PK\x01\x02", entry + 4)
    crc = struct.unpack_from("<I", raw, entry + 16)[0]
    _patch(p, entry + 16, struct.pack("<I", crc ^ 1))  # the central directory's CRC
    with pytest.raises(CorruptFileError, match="CRC"):
        read(p)
    assert_one_line_error(run_cli("inspect", str(p)), p)


def test_variable_length_attribute_claiming_a_gigabyte_is_refused_in_little_memory(
        tmp_path: Path) -> None:
    """A variable-length string of ``layer_names`` whose length says 2**30 where its global heap
    object holds 5 bytes (one integer changed by the fuzz target): HDF5 allocates the claimed
    length before it checks, so slim (through h5py) peaked at 1.1 GB; the reader now compares
    the two first and refuses the file in one line."""
    h5py = pytest.importorskip("h5py")
    np = pytest.importorskip("numpy")
    from tests.formats.hostile_sizes import measure

    path = tmp_path / "legacy.h5"
    with h5py.File(path, "w") as f:
        f.attrs["layer_names"] = ["dense"]  # one variable-length string
        f.create_dataset("dense/kernel:0", data=np.ones((2, 2), np.float32))
    data = bytearray(path.read_bytes())
    heap = data.index(b"GCOL")
    # The inline value: length (4 bytes), the heap collection's address (8), the index (4).
    at = data.index(struct.pack("<IQ", 5, heap))
    struct.pack_into("<I", data, at, 1 << 30)
    path.write_bytes(bytes(data))
    with h5py.File(path) as f, pytest.raises(OSError, match="heap object size"):
        f.attrs["layer_names"]  # the read raises
    run = measure(["slim", str(path), "-o", str(tmp_path / "o.h5"), "--cast", "float16"], 120)
    assert run.returncode == 2, run.stderr
    assert len(run.stderr.splitlines()) == 1
    assert "variable-length value 0 claims 1073741824 bytes" in run.stderr
    assert run.maxrss < 256 << 20, run.maxrss


def test_variable_length_type_hdf5_does_not_define_is_refused(tmp_path: Path) -> None:
    """A variable-length string type whose kind reads 15 (one byte set to 0x7f by the fuzz
    target): h5py crashed the process (SIGSEGV) when slim copied the attribute. The reader
    refuses the datatype in one line before h5py opens the file."""
    import subprocess
    import sys

    h5py = pytest.importorskip("h5py")
    np = pytest.importorskip("numpy")
    path = tmp_path / "odd.weights.h5"
    with h5py.File(path, "w") as f:
        f.create_group("layers/dense/vars").attrs["name"] = "dense"
        f.create_dataset("layers/dense/vars/0", data=np.ones(3, np.float32))
    data = bytearray(path.read_bytes())
    at = data.index(b"\x19\x01\x01\x00", data.index(b"name\x00"))  # vlen UTF-8 string type
    data[at + 1] = 0x7F
    path.write_bytes(bytes(data))
    code = ("import h5py, sys; f = h5py.File(sys.argv[1]); "
            "print(f['layers/dense/vars'].attrs['name'])")
    crashed = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True)
    assert crashed.returncode != 0  # a segfault with h5py 3.16 / HDF5 1.14
    proc = run_cli("slim", str(path), "-o", str(tmp_path / "o.weights.h5"), "--cast", "float16")
    assert_one_line_error(proc, path)
    assert "vlen datatype with bit fields 0x17f, which HDF5 does not define" in proc.stderr
