"""TensorFlow: real checkpoints and SavedModels written by TensorFlow (committed with their
generator), the sorted-table reader underneath, and bundles crafted byte by byte to lie."""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest

from modelsize.categories import Category
from modelsize.errors import CorruptFileError, UsageError
from modelsize.formats import read, sniff_format
from modelsize.formats._sstable import MAGIC, SSTableError, crc32c, iter_table
from modelsize.formats.tensorflow import decode_slice_key
from modelsize.inventory import Inventory
from tests.conftest import REPO, assert_one_line_error, cli_json, run_cli

FIXTURES = REPO / "tests" / "fixtures" / "tensorflow"
MANIFEST = json.loads((FIXTURES / "MANIFEST.json").read_text())
CASES = {c["path"]: c for c in MANIFEST["cases"]}


def _expected(case: dict[str, Any]) -> dict[Category, int]:
    return {Category(c): n for c, n in case["categories"].items()}


def _by_checkpoint_name(inv: Inventory) -> dict[str, tuple[str, int]]:
    """Our tensors keyed like ``tf.train.list_variables`` (slices summed into their variable)."""
    out: dict[str, tuple[str, int]] = {}
    for t in inv.tensors:
        base = re.sub(r"\[[^\]]*\]$", "", t.name)
        cat, n = out.get(base, (t.category.value, 0))
        assert cat == t.category.value, base
        out[base] = (cat, n + t.stored_nbytes)
    return out


# -- real checkpoints ----------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CASES))
def test_fixture_bytes_match_tensorflow(name: str) -> None:
    case = CASES[name]
    for rel, info in case["files"].items():
        assert hashlib.sha256((FIXTURES / rel).read_bytes()).hexdigest() == info["sha256"]
    inv = read(FIXTURES / name)
    assert inv.format == "tensorflow"
    assert sorted(f.path.relative_to(FIXTURES).as_posix() for f in inv.files) == sorted(
        case["files"]
    )
    assert inv.file_bytes == case["bytes"]
    assert inv.bytes_by_category == _expected(case)
    truth = {k: (v["category"], v["bytes"]) for k, v in case["tensors"].items()}
    assert _by_checkpoint_name(inv) == truth


@pytest.mark.parametrize(
    "given",
    ["tf1/model.ckpt", "tf1/model.ckpt.index", "tf1/model.ckpt.data-00000-of-00001",
     "tf1/model.ckpt.meta"],
)
def test_any_file_of_a_bundle_names_the_whole_checkpoint(given: str) -> None:
    inv = read(FIXTURES / given)
    assert inv.bytes_by_category == _expected(CASES["tf1/model.ckpt"])
    assert sniff_format(FIXTURES / given) == "tensorflow"


def test_directory_reads_the_checkpoint_its_state_file_names() -> None:
    inv = read(FIXTURES / "tf1")
    assert inv.facts["prefix"] == str(FIXTURES / "tf1" / "model.ckpt")
    state = (FIXTURES / "tf1" / "checkpoint").stat().st_size
    assert inv.bytes_by_category[Category.METADATA] == (
        CASES["tf1/model.ckpt"]["categories"]["metadata"] + state
    )


def test_tf1_slots_and_partitions() -> None:
    inv = read(FIXTURES / "tf1" / "model.ckpt")
    t = {x.name: x for x in inv.tensors}
    assert t["dense/kernel"].category is Category.WEIGHTS
    assert t["dense/kernel/Adam_1"].category is Category.OPTIMIZER_STATE
    assert t["beta1_power"].category is Category.OPTIMIZER_STATE
    assert t["global_step"].category is Category.OPTIMIZER_STATE
    assert (t["embedding[0:4,0:2]"].shape, t["embedding[4:8,0:2]"].nbytes) == ((4, 2), 32)
    assert "slice" in t["embedding/Adam[4:8,0:2]"].tags
    assert t["vocab"].category is Category.OTHER  # a string tensor: data, not a weight
    assert inv.facts["checkpoint"] == "name-based (TF1)"


def test_sharded_bundle_counts_every_shard() -> None:
    inv = read(FIXTURES / "tf1_sharded")
    shards = [f for f in inv.files if ".data-" in f.path.name]
    assert [f.path.name[-20:] for f in shards] == [
        f".data-0000{i}-of-00003" for i in range(3)
    ]
    assert inv.facts["shards"] == "3"


def test_keras3_kernels_keyed_under_the_optimizer_are_weights() -> None:
    inv = read(FIXTURES / "tf2_keras3")
    keyed = [t for t in inv.tensors if t.name.startswith("optimizer/_trainable_variables/")]
    assert keyed and {t.category for t in keyed} == {Category.WEIGHTS}
    t = {x.name: x for x in inv.tensors}
    assert t["_CHECKPOINTABLE_OBJECT_GRAPH"].category is Category.METADATA
    assert t["optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"].category is (
        Category.OPTIMIZER_STATE
    )
    assert inv.facts["checkpoint"] == "object-based (TF2)"


def test_slot_variables_are_optimizer_state() -> None:
    inv = read(FIXTURES / "tf2_slots" / "weights")
    slots = [t for t in inv.tensors if "/.OPTIMIZER_SLOT/" in t.name]
    assert len(slots) == 2 * 6  # m and v for each trainable variable
    assert {t.category for t in slots} == {Category.OPTIMIZER_STATE}


def test_saved_model_export_stores_every_variable_twice() -> None:
    inv = read(FIXTURES / "saved_model")
    dups = [t for t in inv.tensors if t.category is Category.DUPLICATES]
    assert dups and all(t.duplicate_of for t in dups)
    assert inv.facts["layout"] == "saved_model"
    graph = (FIXTURES / "saved_model" / "saved_model.pb").stat().st_size
    assert inv.bytes_by_category[Category.GRAPH] == graph


def test_cli_json_matches_manifest() -> None:
    out = cli_json("inspect", str(FIXTURES / "tf2_keras3"))
    assert out["format"] == "tensorflow"
    assert out["bytes_by_category"] == CASES["tf2_keras3"]["categories"]


def test_directory_with_several_checkpoints_and_no_state_file(tmp_path: Path) -> None:
    for name in ("a", "b"):
        for f in (FIXTURES / "tf2_slots").iterdir():
            shutil.copy(f, tmp_path / f.name.replace("weights", name))
    with pytest.raises(UsageError, match="several checkpoints"):
        read(tmp_path)
    assert_one_line_error(run_cli("inspect", str(tmp_path)), tmp_path)


def test_directory_with_one_bundle_and_moved_absolute_state(tmp_path: Path) -> None:
    shutil.copytree(FIXTURES / "tf2_keras3", tmp_path / "run")
    state = tmp_path / "run" / "checkpoint"
    state.write_text('model_checkpoint_path: "/elsewhere/ckpt-1"\n')
    inv = read(tmp_path / "run")
    assert inv.facts["prefix"] == str(tmp_path / "run" / "ckpt-1")
    state.unlink()
    state_bytes = CASES["tf2_keras3"]["files"]["tf2_keras3/checkpoint"]["bytes"]
    assert read(tmp_path / "run").file_bytes == CASES["tf2_keras3"]["bytes"] - state_bytes


# -- the sorted table ----------------------------------------------------------------------


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _block(entries: list[tuple[bytes, bytes]], restart_every: int = 2) -> bytes:
    out, restarts, prev = bytearray(), [], b""
    for i, (key, value) in enumerate(entries):
        shared = 0
        if i % restart_every == 0:
            restarts.append(len(out))
        else:
            while shared < min(len(prev), len(key)) and prev[shared] == key[shared]:
                shared += 1
        out += _varint(shared) + _varint(len(key) - shared) + _varint(len(value))
        out += key[shared:] + value
        prev = key
    out += b"".join(struct.pack("<I", r) for r in restarts) + struct.pack("<I", len(restarts))
    return bytes(out)


def _mask(crc: int) -> int:
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _table(blocks: list[list[tuple[bytes, bytes]]]) -> bytes:
    """A LevelDB table, as TensorFlow's ``TableBuilder`` lays it out."""
    data = bytearray()

    def put(block: bytes) -> bytes:
        handle = _varint(len(data)) + _varint(len(block))
        data.extend(block + b"\x00" + struct.pack("<I", _mask(crc32c(block + b"\x00"))))
        return handle

    index = [(entries[-1][0], put(_block(entries))) for entries in blocks]
    meta = put(_block([]))
    idx = put(_block(index, 1))
    footer = (meta + idx).ljust(40, b"\x00") + struct.pack("<Q", MAGIC)
    return bytes(data + footer)


def test_crc32c_known_value() -> None:
    assert crc32c(b"123456789") == 0xE3069283


def test_table_with_shared_prefixes_and_several_blocks() -> None:
    blocks = [
        [(b"", b"h"), (b"layer/bias", b"1"), (b"layer/kernel", b"22")],
        [(b"layer/kernel/Adam", b"333"), (b"layer/kernel/Adam_1", b"4444")],
    ]
    buf = _table(blocks)
    got = [(k, buf[a:b]) for k, a, b in iter_table(buf)]
    assert got == [kv for block in blocks for kv in block]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda b: b[:-1], "footer magic"),
        (lambda b: b[:20], "shorter than its 48-byte footer"),
        (lambda b: b[:3] + bytes([b[3] ^ 0xFF]) + b[4:], "checksum"),
        (lambda b: b"\x00" * 16 + b[16:], "checksum"),
    ],
)
def test_damaged_tables_are_refused(damage: Any, message: str) -> None:
    buf = _table([[(b"a", b"1"), (b"b", b"2")]])
    with pytest.raises(SSTableError, match=message):
        list(iter_table(damage(buf)))


def test_keys_out_of_order_are_refused() -> None:
    buf = _table([[(b"b", b"1")], [(b"a", b"2")]])
    with pytest.raises(SSTableError, match="not after"):
        list(iter_table(buf))


def test_slice_key_decoding() -> None:
    key = b"\x00part/Adam\x00\x01\x01\x02\x84\x84\x80\x82"
    assert decode_slice_key(key) == ("part/Adam", ((4, 4), (0, 2)))


# -- crafted bundles -----------------------------------------------------------------------


def _field(number: int, payload: bytes | int) -> bytes:
    if isinstance(payload, int):
        return _varint(number << 3) + _varint(payload)
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _entry(dtype: int, shape: list[int], offset: int, size: int, shard: int = 0) -> bytes:
    dims = b"".join(_field(2, _field(1, d)) for d in shape)
    return (_field(1, dtype) + _field(2, dims) + (_field(3, shard) if shard else b"")
            + _field(4, offset) + _field(5, size))


#: The slice key of ``w[0:4, 0:2]``: OrderedCode of the name, the rank, start and length.
_SLICE_KEY = b"\x00w\x00\x01\x01\x02\x80\x84\x80\x82"


def _partitioned(shape: list[int], *slices: list[tuple[int, int]]) -> bytes:
    """The full entry of a partitioned variable listing ``slices`` (extents per dimension)."""
    dims = b"".join(_field(2, _field(1, d)) for d in shape)
    listed = b"".join(
        _field(7, b"".join(_field(1, _field(1, a) + _field(2, n)) for a, n in extents))
        for extents in slices)
    return _field(1, 1) + _field(2, dims) + listed


def _bundle(tmp_path: Path, entries: list[tuple[bytes, bytes]], data: bytes,
            shards: int = 1) -> Path:
    header = _field(1, shards) + _field(3, _field(1, 1))
    prefix = tmp_path / "model.ckpt"
    (tmp_path / "model.ckpt.index").write_bytes(_table([[(b"", header), *entries]]))
    for i in range(shards):
        (tmp_path / f"model.ckpt.data-{i:05d}-of-{shards:05d}").write_bytes(data)
    return prefix


def test_crafted_bundle_accounts_exactly(tmp_path: Path) -> None:
    prefix = _bundle(tmp_path, [(b"w", _entry(1, [2, 3], 0, 24)),
                                (b"w/Momentum", _entry(1, [2, 3], 24, 24))], bytes(range(48)))
    inv = read(prefix)
    index = (tmp_path / "model.ckpt.index").stat().st_size
    assert inv.bytes_by_category[Category.WEIGHTS] == 24
    assert inv.bytes_by_category[Category.OPTIMIZER_STATE] == 24
    assert inv.bytes_by_category[Category.METADATA] == index


LIARS: dict[str, tuple[list[tuple[bytes, bytes]], bytes, int, str]] = {
    "past_the_shard": ([(b"w", _entry(1, [4], 0, 16))], bytes(8), 1, "claims bytes 0..16"),
    "size_not_numel": ([(b"w", _entry(1, [4], 0, 8))], bytes(8), 1, "claims 8 bytes"),
    "shard_out_of_range": ([(b"w", _entry(1, [2], 0, 8, shard=3))], bytes(8), 1, "shard 3"),
    "overlapping": ([(b"a", _entry(1, [2], 0, 8)), (b"b", _entry(1, [2], 4, 8))], bytes(16), 1,
                    "overlaps"),
    "absurd_shard_count": ([(b"w", _entry(1, [2], 0, 8))], bytes(8), 100_000, "shards"),
    "bad_object_graph": ([(b"_CHECKPOINTABLE_OBJECT_GRAPH", _entry(7, [], 0, 8))],
                         b"\x03\x00\x00\x00\x00\xff\xff\xff", 1, "object graph"),
    "bad_entry_proto": ([(b"w", b"\x0a\xff\x01")], bytes(8), 1, "declares"),
    # Found by the fuzz target: a full entry listing a slice the bundle does not hold (TF's
    # reader then hands out the stored slice's raw key: UnicodeDecodeError), and slim wrote it.
    "slice_not_stored": ([(_SLICE_KEY, _entry(1, [4, 2], 0, 32)),
                          (b"w", _partitioned([4, 2], [(0, 4), (0, 1)]))], bytes(32), 1,
                         r"w lists the slice w\[0:4,0:1\], which the bundle does not hold"),
    "slices_not_covering": ([(_SLICE_KEY, _entry(1, [4, 2], 0, 32)),
                             (b"w", _partitioned([4, 3], [(0, 4), (0, 2)]))], bytes(32), 1,
                            r"partitioned variable w hold 8 elements, its shape \[4, 3\] 12"),
    "slice_outside": ([(_SLICE_KEY, _entry(1, [4, 2], 0, 32)),
                       (b"w", _partitioned([2, 4], [(0, 4), (0, 2)]))], bytes(32), 1,
                      r"w of shape \[2, 4\] lists the slice w\[0:4,0:2\], outside it"),
    "dtype_invalid": ([(b"w", _entry(0, [2], 0, 8))], bytes(8), 1,
                      "w has dtype 0, which is not a TensorFlow DataType"),
    "slice_not_listed": ([(_SLICE_KEY, _entry(1, [4, 2], 0, 32)),
                          (_SLICE_KEY[:-4] + b"\x84\x84\x80\x82", _entry(1, [4, 2], 32, 32)),
                          (b"w", _partitioned([8, 2], [(0, 4), (0, 2)]))], bytes(64), 1,
                         r"w does not list the slice w\[4:8,0:2\], which the bundle holds"),
}


@pytest.mark.parametrize("case", sorted(LIARS))
def test_lying_bundles_are_corrupt(tmp_path: Path, case: str) -> None:
    entries, data, shards, message = LIARS[case]
    if shards > 1000:
        header = _field(1, shards)
        (tmp_path / "model.ckpt.index").write_bytes(_table([[(b"", header), *entries]]))
        prefix = tmp_path / "model.ckpt"
    else:
        prefix = _bundle(tmp_path, entries, data, shards)
    with pytest.raises(CorruptFileError, match=message):
        read(prefix)
    assert_one_line_error(run_cli("inspect", str(prefix)), prefix)


def test_missing_shard_is_corrupt(tmp_path: Path) -> None:
    shutil.copytree(FIXTURES / "tf1_sharded", tmp_path / "ck")
    (tmp_path / "ck" / "model.ckpt.data-00001-of-00003").unlink()
    with pytest.raises(CorruptFileError, match="data-00001-of-00003 is missing"):
        read(tmp_path / "ck")
    assert_one_line_error(run_cli("inspect", str(tmp_path / "ck")), tmp_path / "ck")


@pytest.mark.parametrize("cut", [1, 30, 200])
def test_truncated_index_is_corrupt(tmp_path: Path, cut: int) -> None:
    shutil.copytree(FIXTURES / "tf2_keras3", tmp_path / "ck")
    index = tmp_path / "ck" / "ckpt-1.index"
    index.write_bytes(index.read_bytes()[:-cut])
    proc = run_cli("inspect", str(index))
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "Traceback" not in proc.stderr


def test_flipped_byte_in_index_is_caught_by_its_checksum(tmp_path: Path) -> None:
    shutil.copytree(FIXTURES / "tf1", tmp_path / "ck")
    index = tmp_path / "ck" / "model.ckpt.index"
    raw = bytearray(index.read_bytes())
    raw[40] ^= 0x01
    index.write_bytes(bytes(raw))
    with pytest.raises(CorruptFileError, match="checksum"):
        read(index)


def test_truncated_shard_is_corrupt(tmp_path: Path) -> None:
    shutil.copytree(FIXTURES / "tf2_keras3", tmp_path / "ck")
    data = tmp_path / "ck" / "ckpt-1.data-00000-of-00001"
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(CorruptFileError, match="claims bytes"):
        read(tmp_path / "ck")


# -- an empty prefix -----------------------------------------------------------------------


def _empty_prefix_bundle(folder: Path, state: bool) -> Path:
    """TensorFlow's tf1 fixture renamed to ``.index``, ``.data-00000-of-00001``, ``.meta``
    (an empty prefix, as one published package ships its checkpoint), with a stale state
    file naming the prefix it was saved under when ``state``."""
    folder.mkdir()
    for f in (FIXTURES / "tf1").glob("model.ckpt.*"):
        shutil.copy(f, folder / f.name[len("model.ckpt"):])
    if state:
        (folder / "checkpoint").write_text('model_checkpoint_path: "model.ckpt"\n')
    return folder


@pytest.mark.parametrize("state", [False, True], ids=["no-state-file", "stale-state-file"])
def test_bundle_with_an_empty_prefix_reads_like_any_prefix(tmp_path: Path, state: bool) -> None:
    folder = _empty_prefix_bundle(tmp_path / "pkg", state)
    expected = _expected(CASES["tf1/model.ckpt"])
    for given in (folder, folder / ".index", folder / ".data-00000-of-00001",
                  folder / ".meta", f"{folder}/"):
        inv = read(given)
        assert inv.bytes_by_category == expected, given
        assert sorted(f.path.name for f in inv.files) == [
            ".data-00000-of-00001", ".index", ".meta"]
        assert inv.facts["prefix"] == f"{folder}/"
        assert sniff_format(given) == "tensorflow"
    truth = {k: (v["category"], v["bytes"]) for k, v in CASES["tf1/model.ckpt"]["tensors"].items()}
    assert _by_checkpoint_name(read(folder)) == truth


def test_bundle_with_an_empty_prefix_slims(tmp_path: Path) -> None:
    folder = _empty_prefix_bundle(tmp_path / "pkg", state=False)
    proc = run_cli("inspect", "pkg", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    proc = run_cli("slim", "pkg", "--drop", "optimizer_state", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = read(tmp_path / "pkg.slim")
    assert out.bytes_by_category[Category.OPTIMIZER_STATE] == 0
    weights = {k: v["bytes"] for k, v in CASES["tf1/model.ckpt"]["tensors"].items()
               if v["category"] == "weights"}
    got = {k: n for k, (c, n) in _by_checkpoint_name(out).items() if c == "weights"}
    assert got == weights
    assert sorted(p.name for p in folder.iterdir()) == [
        ".data-00000-of-00001", ".index", ".meta"]
    # one file of the bundle given: the fix inspect prints runs as printed
    proc = run_cli("inspect", "pkg/.index", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (action,) = [f["action"] for f in json.loads(proc.stdout)["findings"]]
    proc = run_cli(*shlex.split(action)[1:], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out_prefix = shlex.split(action)[-1]
    out = read(tmp_path / f"{out_prefix}.index")
    assert {k: n for k, (c, n) in _by_checkpoint_name(out).items() if c == "weights"} == weights
