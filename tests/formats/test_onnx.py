"""ONNX: real models written by the ``onnx`` package (committed with their generator), files
crafted byte by byte to lie, and the protobuf decoder underneath."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from pathlib import Path

import pytest

from modelsize.categories import Category
from modelsize.errors import CorruptFileError, UnknownFormatError
from modelsize.formats import Registry, read
from modelsize.formats._protobuf import (
    I32,
    I64,
    LEN,
    VARINT,
    FileBuffer,
    ProtobufError,
    iter_fields,
    packed_fixed,
    packed_varints,
    read_varint,
    signed64,
    zigzag,
)
from modelsize.formats.base import Source
from modelsize.formats.onnx import OnnxReader
from modelsize.inventory import Inventory
from tests.conftest import REPO, assert_one_line_error, run_cli

FIXTURES = REPO / "tests" / "fixtures" / "onnx"
MANIFEST = json.loads((FIXTURES / "MANIFEST.json").read_text())
ONLY_ONNX = Registry([OnnxReader()])


def _read(path: Path) -> Inventory:
    return read(path, ONLY_ONNX)


# -- real models ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(MANIFEST["models"]))
def test_fixture_bytes_match_ground_truth(name: str) -> None:
    truth = MANIFEST["models"][name]
    for fname, info in truth["files"].items():
        assert hashlib.sha256((FIXTURES / fname).read_bytes()).hexdigest() == info["sha256"]
    inv = _read(FIXTURES / name)
    assert [f.path.name for f in inv.files] == list(truth["files"])
    assert inv.file_bytes == truth["bytes"]
    expected = {c: 0 for c in Category}
    for cat, n in truth["categories"].items():
        expected[Category(cat)] = n
    assert inv.bytes_by_category == expected


def test_mlp_tensors() -> None:
    inv = _read(FIXTURES / "mlp.onnx")
    t = {x.name: x for x in inv.tensors}
    assert (t["W1"].dtype, t["W1"].shape, t["W1"].nbytes) == ("float32", (8, 16), 8 * 16 * 4)
    assert t["shape"].category is Category.BUFFERS
    assert t["C"].category is Category.WEIGHTS  # the Constant node's value
    assert t["W2_copy"].category is Category.DUPLICATES
    assert t["W2_copy"].duplicate_of == "W2"
    assert inv.facts["onnx.producer"] == "modelsize-fixtures"
    assert inv.facts["onnx.opset"] == "ai.onnx 17"


def test_typed_fields_subgraphs_and_sparse() -> None:
    inv = _read(FIXTURES / "typed.onnx")
    t = {x.name: x for x in inv.tensors}
    assert t["f_data"].nbytes == t["f_data"].stored_nbytes == 6 * 4
    assert t["d_data"].stored_nbytes == 3 * 8
    assert t["i64_data"].nbytes == 5 * 8  # logical size; the varints take less in the file
    assert t["Y.then_branch/then_bias"].category is Category.WEIGHTS
    assert t["cond"].category is Category.BUFFERS
    # No node reads these initializers (the model only shows how values can be stored).
    for name in ("f_data", "d_data", "h_data", "i64_data", "sp", "sp.indices"):
        assert t[name].category is Category.UNUSED_STORAGE, name


def test_shared_external_bytes_count_once_and_unused_bytes() -> None:
    inv = _read(FIXTURES / "shared_external.onnx")
    t = {x.name: x for x in inv.tensors}
    assert t["A"].stored_nbytes == 64 and t["A_alias"].stored_nbytes == 0
    assert t["B"].stored_nbytes == 32
    assert inv.bytes_by_category[Category.UNUSED_STORAGE] == 100
    assert all("external" in x.tags for x in inv.tensors)


def test_external_alignment_padding_is_metadata(tmp_path: Path) -> None:
    (tmp_path / "w.bin").write_bytes(bytes(4096) + bytes(range(16)) + bytes(7))
    node = _f(1, LEN, _f(1, LEN, b"w") + _f(2, LEN, b"y") + _f(4, LEN, b"Relu"))
    p = _write(tmp_path, _model(node, _init(_tensor(
        "w", [4], external={"location": "w.bin", "offset": "4096", "length": "16"}))))
    inv = _read(p)
    assert inv.bytes_by_category[Category.WEIGHTS] == 16
    assert inv.bytes_by_category[Category.UNUSED_STORAGE] == 7  # the tail is not padding
    assert inv.bytes_by_category[Category.METADATA] == 4096 + p.stat().st_size - len(node)


def test_sniff_without_extension(tmp_path: Path) -> None:
    p = tmp_path / "model.bin"
    shutil.copy(FIXTURES / "mlp.onnx", p)
    assert OnnxReader().sniff(Source.open(p))
    assert _read(p).bytes_by_category[Category.WEIGHTS] == 848
    for head in (b"\x80\x02}q\x00", b"PK\x03\x04", b"GGUF\x03\x00", b"\x08\x01\x12\x00",
                 struct.pack("<Q", 80) + b'{"a"'):
        q = tmp_path / "x.bin"
        q.write_bytes(head + bytes(64))
        assert not OnnxReader().sniff(Source.open(q)), head


def test_empty_onnx_file_is_not_claimed(tmp_path: Path) -> None:
    p = tmp_path / "empty.onnx"
    p.write_bytes(b"")
    with pytest.raises(UnknownFormatError):
        _read(p)


def test_huge_raw_data_is_skipped_not_read(tmp_path: Path) -> None:
    """A 2.5 GB initializer in a sparse file: only its length prefix is decoded."""
    n = 5 * 2**29 // 4  # float32 elements: 2.5 GiB
    tensor = _f(1, VARINT, n) + _f(2, VARINT, 1) + _f(8, LEN, b"big")
    tensor += _key(9, LEN) + _varint(4 * n)
    node = _f(1, LEN, _f(1, LEN, b"big") + _f(2, LEN, b"y") + _f(4, LEN, b"Relu"))
    graph_head = node + _key(5, LEN) + _varint(len(tensor) + 4 * n)
    model_head = _f(1, VARINT, 8) + _key(7, LEN) + _varint(len(graph_head) + len(tensor) + 4 * n)
    p = tmp_path / "big.onnx"
    with open(p, "wb") as fh:
        fh.write(model_head + graph_head + tensor)
        fh.truncate(len(model_head + graph_head + tensor) + 4 * n)
    inv = _read(p)
    assert inv.bytes_by_category[Category.WEIGHTS] == 4 * n
    assert inv.file_bytes == p.stat().st_size


# -- crafted files -------------------------------------------------------------------------


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _key(number: int, wire: int) -> bytes:
    return _varint(number << 3 | wire)


def _f(number: int, wire: int, value: int | bytes) -> bytes:
    if wire == VARINT:
        assert isinstance(value, int)
        return _key(number, wire) + _varint(value)
    assert isinstance(value, bytes)
    return _key(number, LEN) + _varint(len(value)) + value


def _tensor(name: str, dims: list[int], data_type: int = 1, raw: bytes | None = None,
            external: dict[str, str] | None = None) -> bytes:
    out = b"".join(_f(1, VARINT, d) for d in dims) + _f(2, VARINT, data_type) + _f(8, LEN,
                                                                                   name.encode())
    if raw is not None:
        out += _f(9, LEN, raw)
    if external is not None:
        for k, v in external.items():
            out += _f(13, LEN, _f(1, LEN, k.encode()) + _f(2, LEN, v.encode()))
        out += _f(14, VARINT, 1)
    return out


def _model(*graph_fields: bytes) -> bytes:
    return _f(1, VARINT, 8) + _f(7, LEN, b"".join(graph_fields))


def _init(t: bytes) -> bytes:
    return _f(5, LEN, t)


def _write(tmp_path: Path, data: bytes, name: str = "bad.onnx") -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


def test_crafted_model_accounts_exactly(tmp_path: Path) -> None:
    raw = bytes(range(24))
    node = _f(1, LEN, _f(1, LEN, b"w") + _f(2, LEN, b"y") + _f(4, LEN, b"Relu"))
    p = _write(tmp_path, _model(node, _init(_tensor("w", [2, 3], raw=raw))))
    inv = _read(p)
    assert inv.bytes_by_category[Category.WEIGHTS] == 24
    assert inv.bytes_by_category[Category.GRAPH] == len(node)
    assert inv.bytes_by_category[Category.METADATA] == p.stat().st_size - 24 - len(node)


def test_initializers_no_node_reads_are_unused(tmp_path: Path) -> None:
    """An initializer no node input, graph output or subgraph reads is unused_storage."""
    node = _f(1, LEN, _f(1, LEN, b"w") + _f(2, LEN, b"y") + _f(4, LEN, b"Relu"))
    p = _write(tmp_path, _model(node, _init(_tensor("w", [2], raw=bytes(8))),
                                _init(_tensor("v", [3], raw=bytes(range(12))))))
    t = {x.name: x for x in _read(p).tensors}
    assert t["w"].category is Category.WEIGHTS
    assert t["v"].category is Category.UNUSED_STORAGE
    assert _read(p).bytes_by_category[Category.UNUSED_STORAGE] == 12


def _deep_subgraphs(depth: int) -> bytes:
    graph = b""
    for _ in range(depth):
        attr = _f(1, LEN, b"body") + _f(6, LEN, graph)
        graph = _f(1, LEN, _f(4, LEN, b"Loop") + _f(5, LEN, attr))
    return _model(graph)


def _external_model(tmp_path: Path, entries: dict[str, str], data: bytes = bytes(64)) -> bytes:
    (tmp_path / "w.bin").write_bytes(data)
    return _model(_init(_tensor("w", [4], external=entries)))


def _output_with_type(type_proto: bytes) -> bytes:
    """A model whose graph output ``y`` has the given ``TypeProto`` bytes."""
    node = _f(1, LEN, _f(1, LEN, b"w") + _f(2, LEN, b"y") + _f(4, LEN, b"Relu"))
    return _model(node, _init(_tensor("w", [2], raw=bytes(8))),
                  _f(12, LEN, _f(1, LEN, b"y") + _f(2, LEN, type_proto)))


#: ``TypeProto.tensor_type`` (elem_type float, shape [2]) whose length says 65535: found by the
#: fuzz target (protobuf refuses the file: "Wire format was corrupt"; slim wrote it on).
_TENSOR_TYPE = _f(1, VARINT, 1) + _f(2, LEN, _f(1, LEN, _f(1, VARINT, 2)))
_BAD_TYPE = _key(1, LEN) + _varint(65535) + _TENSOR_TYPE


#: ``metadata_props`` whose value's length (9) runs past its entry: found by the fuzz target.
_BAD_ENTRY = _f(1, LEN, b"k") + _key(2, LEN) + _varint(9) + b"v"


def _with_metadata(entry: bytes, number: int = 14) -> bytes:
    """A valid model with one ``metadata_props`` entry (ModelProto field 14)."""
    return _output_with_type(_f(1, LEN, _TENSOR_TYPE)) + _f(number, LEN, entry)


LIARS = {
    "garbage": lambda tmp: b"\xff" * 40,
    "metadata_props_value_length": lambda tmp: _with_metadata(_BAD_ENTRY),
    # Found by the fuzz target; the checker refuses both ("does not have an ir_version set
    # properly", "should contain one and only one value field").
    "ir_version_0": lambda tmp: _f(1, VARINT, 0) + _model(
        _init(_tensor("w", [2], raw=bytes(8))))[2:],
    "data_location_unknown": lambda tmp: _model(_init(
        _tensor("w", [4], external={"location": "w.bin", "offset": "0", "length": "16"})
        .replace(_f(14, VARINT, 1), _f(14, VARINT, 2)))),
    "output_type_length": lambda tmp: _output_with_type(_BAD_TYPE),
    "output_shape_length": lambda tmp: _output_with_type(
        _f(1, LEN, _f(1, VARINT, 1) + _key(2, LEN) + _varint(200) + _f(1, LEN, b""))),
    "group_wire_type": lambda tmp: _f(1, VARINT, 8) + _key(7, 3) + b"\x00",
    "length_past_eof": lambda tmp: _f(1, VARINT, 8) + _key(7, LEN) + _varint(10**9) + b"abc",
    "varint_too_long": lambda tmp: _f(1, VARINT, 8) + _key(5, VARINT) + b"\xff" * 11,
    "graph_not_length_delimited": lambda tmp: _f(1, VARINT, 8) + _f(7, VARINT, 3),
    "raw_data_wrong_size": lambda tmp: _model(_init(_tensor("w", [2, 3], raw=bytes(20)))),
    "dims_lie_about_size": lambda tmp: _model(_init(_tensor("w", [2**40, 2**40],
                                                            raw=bytes(8)))),
    "negative_dim": lambda tmp: _model(_init(_tensor("w", [2**64 - 1], raw=b""))),
    "unknown_data_type": lambda tmp: _model(_init(_tensor("w", [1], 99, raw=bytes(4)))),
    "no_model_fields": lambda tmp: _f(30, VARINT, 1),
    "subgraphs_too_deep": lambda tmp: _deep_subgraphs(40),
    "external_outside_folder": lambda tmp: _external_model(
        tmp, {"location": "../../etc/passwd", "offset": "0", "length": "16"}),
    "external_absolute": lambda tmp: _external_model(
        tmp, {"location": "/etc/passwd", "offset": "0", "length": "16"}),
    "external_missing": lambda tmp: _external_model(
        tmp, {"location": "nope.bin", "offset": "0", "length": "16"}),
    "external_is_model_itself": lambda tmp: _external_model(
        tmp, {"location": "bad.onnx", "offset": "0", "length": "16"}),
    "external_past_eof": lambda tmp: _external_model(
        tmp, {"location": "w.bin", "offset": "60", "length": "16"}),
    "external_offset_not_int": lambda tmp: _external_model(
        tmp, {"location": "w.bin", "offset": "zero", "length": "16"}),
    "external_length_mismatch": lambda tmp: _external_model(
        tmp, {"location": "w.bin", "offset": "0", "length": "12"}),
    "external_no_location": lambda tmp: _external_model(tmp, {"offset": "0", "length": "16"}),
    "bad_utf8_name": lambda tmp: _model(_init(_tensor("w", [1], raw=bytes(4)))).replace(
        b"\x42\x01w", b"\x42\x01\xff"),
}


@pytest.mark.parametrize("case", sorted(LIARS))
def test_lying_files_are_corrupt(tmp_path: Path, case: str) -> None:
    p = _write(tmp_path, LIARS[case](tmp_path))
    with pytest.raises(CorruptFileError) as info:
        _read(p)
    assert info.value.format == "onnx"
    assert "Traceback" not in str(info.value)


def test_output_types_parse_as_onnx_parses_them(tmp_path: Path) -> None:
    onnx = pytest.importorskip("onnx")
    good = _output_with_type(_f(1, LEN, _TENSOR_TYPE))
    assert onnx.load_from_string(good).graph.output[0].type.tensor_type.elem_type == 1
    assert _read(_write(tmp_path, good, "good.onnx")).file_bytes == len(good)
    for bad in (_output_with_type(_BAD_TYPE), _with_metadata(_BAD_ENTRY)):
        with pytest.raises(Exception, match=r"(?i)wire format|error parsing|protobuf"):
            onnx.load_from_string(bad)
    good = _with_metadata(_f(1, LEN, b"k") + _f(2, LEN, b"v"))
    assert onnx.load_from_string(good).metadata_props[0].value == "v"
    assert _read(_write(tmp_path, good, "meta.onnx")).file_bytes == len(good)


@pytest.mark.parametrize("case", ["ir_version_0", "data_location_unknown"])
def test_the_onnx_checker_refuses_them_too(tmp_path: Path, case: str) -> None:
    onnx = pytest.importorskip("onnx")
    p = _write(tmp_path, LIARS[case](tmp_path))
    (tmp_path / "w.bin").write_bytes(bytes(16))
    with pytest.raises(onnx.checker.ValidationError):
        onnx.checker.check_model(onnx.load(str(p), load_external_data=False))


def test_a_tensor_of_no_elements_holds_no_data(tmp_path: Path) -> None:
    p = _write(tmp_path, _model(_init(_tensor("w", [0, 3]))))
    assert [(t.name, t.shape, t.nbytes) for t in _read(p).tensors] == [("w", (0, 3), 0)]


def test_nested_subgraphs_within_limit(tmp_path: Path) -> None:
    p = _write(tmp_path, _deep_subgraphs(20))
    assert _read(p).file_bytes == p.stat().st_size


@pytest.mark.parametrize("cut", [1, 3, 10, 50, 200, 700, 1200, 1586])
def test_truncated_fixture_is_corrupt(tmp_path: Path, cut: int) -> None:
    p = _write(tmp_path, (FIXTURES / "mlp.onnx").read_bytes()[:cut])
    with pytest.raises(CorruptFileError):
        _read(p)


def test_truncated_external_data_is_corrupt(tmp_path: Path) -> None:
    shutil.copy(FIXTURES / "external.onnx", tmp_path / "external.onnx")
    data = (FIXTURES / "external.onnx.data").read_bytes()
    (tmp_path / "external.onnx.data").write_bytes(data[:-1])
    with pytest.raises(CorruptFileError):
        _read(tmp_path / "external.onnx")


def test_cli_exit_2_one_line(tmp_path: Path) -> None:
    p = _write(tmp_path, LIARS["raw_data_wrong_size"](tmp_path))
    assert_one_line_error(run_cli("inspect", str(p)), p)


# -- the protobuf decoder ------------------------------------------------------------------


def test_iter_fields_reports_values_and_ranges() -> None:
    msg = (_f(1, VARINT, 300) + _f(2, LEN, b"hello") + _key(3, I32) + struct.pack("<f", 1.5)
           + _key(4, I64) + struct.pack("<d", -2.0) + _f(5, VARINT, 2**64 - 3))
    fields = list(iter_fields(msg))
    assert [(f.number, f.wire_type) for f in fields] == [
        (1, VARINT), (2, LEN), (3, I32), (4, I64), (5, VARINT)
    ]
    assert fields[0].value == 300 and (fields[0].start, fields[0].end) == (0, 3)
    assert fields[1].text(msg) == "hello" and fields[1].nbytes == 7
    assert msg[fields[1].data_start : fields[1].end] == b"hello"
    assert fields[2].as_float() == 1.5 and fields[3].as_double() == -2.0
    assert fields[4].as_int64() == -3
    assert fields[-1].end == len(msg)


def test_iter_fields_on_a_sub_range() -> None:
    inner = _f(1, VARINT, 7)
    msg = _f(9, LEN, inner) + _f(2, VARINT, 1)
    outer = next(iter_fields(msg))
    (f,) = iter_fields(msg, outer.data_start, outer.end)
    assert (f.number, f.value) == (1, 7)


@pytest.mark.parametrize(
    "data",
    [b"\x08", b"\x08\xff", b"\x12\x05abc", b"\x0b", b"\x0c", b"\x0e\x00", b"\x00\x01",
     b"\x08" + b"\xff" * 10 + b"\x01", b"\x0d\x00\x00", b"\x09\x00"],
)
def test_iter_fields_rejects_bad_messages(data: bytes) -> None:
    with pytest.raises(ProtobufError):
        list(iter_fields(data))


def test_packed_helpers() -> None:
    payload = _varint(1) + _varint(300) + _varint(2**63)
    assert list(packed_varints(payload, 0, len(payload))) == [1, 300, 2**63]
    assert signed64(2**64 - 1) == -1 and zigzag(3) == -2 and zigzag(4) == 2
    assert list(packed_fixed(struct.pack("<II", 5, 6), 0, 8, 4)) == [5, 6]
    with pytest.raises(ProtobufError):
        list(packed_fixed(b"\x00" * 5, 0, 5, 4))
    assert read_varint(b"\xac\x02", 0, 2) == (300, 2)


def test_file_buffer_reads_like_bytes(tmp_path: Path) -> None:
    data = bytes(range(256)) * 40 + (FIXTURES / "mlp.onnx").read_bytes()
    p = tmp_path / "blob"
    p.write_bytes(data)
    with open(p, "rb") as fh:
        fb = FileBuffer(fh.fileno(), len(data), block=64, keep=3)
        assert len(fb) == len(data)
        for i in (0, 63, 64, 1000, len(data) - 1):
            assert fb[i] == data[i]
        for a, b in ((0, 10), (60, 70), (5, 500), (100, 100), (len(data) - 5, len(data) + 9)):
            assert fb[a:b] == data[a:b]
        with pytest.raises(IndexError):
            fb[len(data)]
        start = 256 * 40
        assert [(f.number, f.start, f.end) for f in iter_fields(fb, start, len(data))] == [
            (f.number, f.start + start, f.end + start) for f in iter_fields(data[start:])
        ]
