"""GGUF: real files written by gguf-py (committed with their generator) and crafted liars."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest

from modelsize.categories import Category
from modelsize.errors import CorruptFileError
from modelsize.formats import Registry, read
from modelsize.formats.base import Source
from modelsize.formats.gguf import GgufReader
from modelsize.inventory import Inventory
from tests.conftest import REPO, assert_one_line_error, run_cli

FIXTURES = REPO / "tests" / "fixtures" / "gguf"
MANIFEST = json.loads((FIXTURES / "MANIFEST.json").read_text())
ONLY_GGUF = Registry([GgufReader()])


def _read(path: Path) -> Inventory:
    return read(path, ONLY_GGUF)


@pytest.mark.parametrize("name", sorted(MANIFEST["files"]))
def test_fixture_bytes_match_gguf_py(name: str) -> None:
    truth = MANIFEST["files"][name]
    path = FIXTURES / name
    assert hashlib.sha256(path.read_bytes()).hexdigest() == truth["sha256"]
    inv = _read(path)
    assert inv.file_bytes == truth["bytes"]
    expected = {c: 0 for c in Category}
    for cat, n in truth["categories"].items():
        expected[Category(cat)] = n
    assert inv.bytes_by_category == expected
    got = {t.name: (list(t.shape), t.nbytes) for t in inv.tensors}
    assert got == {t["name"]: (t["shape"], t["n_bytes"]) for t in truth["tensors"]}


def test_quantized_tensor_sizes_follow_ggml_blocks() -> None:
    inv = _read(FIXTURES / "tiny.gguf")
    by_name = {t.name: t for t in inv.tensors}
    q8 = by_name["blk.0.attn_q.weight"]
    assert (q8.dtype, q8.shape, q8.nbytes) == ("q8_0", (2, 64), 2 * (64 // 32) * 34)
    q4k = by_name["blk.0.ffn_up.weight"]
    assert (q4k.dtype, q4k.shape, q4k.nbytes) == ("q4_K", (1, 256), 144)
    assert by_name["token_embd.weight"].nbytes == 300 * 8 * 4


def test_tokenizer_and_kv_metadata_are_metadata() -> None:
    inv = _read(FIXTURES / "tiny.gguf")
    tokenizer = [r for r in inv.regions if r.label == "tokenizer"]
    assert tokenizer and all(r.category is Category.METADATA for r in tokenizer)
    # 300 tokens of "tokN" plus their 8-byte lengths at least: the vocab is all metadata.
    assert sum(r.nbytes for r in tokenizer) > 300 * 8
    assert inv.facts["gguf.architecture"] == "llama"


def test_duplicate_tensor_is_counted_as_duplicate() -> None:
    inv = _read(FIXTURES / "aligned_dup.gguf")
    dup = next(t for t in inv.tensors if t.name == "a_copy.weight")
    assert dup.category is Category.DUPLICATES
    assert dup.duplicate_of == "a.weight"


def test_big_endian_file() -> None:
    inv = _read(FIXTURES / "big_endian.gguf")
    assert inv.facts["gguf.byte_order"] == "big-endian"
    assert [(t.name, t.shape, t.nbytes) for t in inv.tensors] == [("x.weight", (2, 3), 24)]


def test_sniff_by_magic_not_extension(tmp_path: Path) -> None:
    p = tmp_path / "model.bin"
    p.write_bytes((FIXTURES / "tiny.gguf").read_bytes())
    assert GgufReader().sniff(Source.open(p))
    q = tmp_path / "x.gguf"
    q.write_bytes(b"PK\x03\x04" + bytes(40))
    assert not GgufReader().sniff(Source.open(q))


# -- crafted files -------------------------------------------------------------------------


def _s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _kv_u32(key: str, value: int) -> bytes:
    return _s(key) + struct.pack("<II", 4, value)


def _info(name: str, dims: tuple[int, ...], ggml_type: int, offset: int) -> bytes:
    return (
        _s(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
        + struct.pack("<IQ", ggml_type, offset)
    )


def _gguf(
    kvs: list[bytes], infos: list[bytes], data: bytes = b"", *, version: int = 3,
    tensor_count: int | None = None, kv_count: int | None = None, alignment: int = 32,
) -> bytes:
    head = b"GGUF" + struct.pack(
        "<IQQ", version, len(infos) if tensor_count is None else tensor_count,
        len(kvs) if kv_count is None else kv_count,
    )
    body = head + b"".join(kvs) + b"".join(infos)
    body += bytes(-len(body) % alignment)
    return body + data


def _write(tmp_path: Path, data: bytes, name: str = "bad.gguf") -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


def test_crafted_file_accounts_exactly(tmp_path: Path) -> None:
    data = bytes(range(64)) + bytes(32)  # f32 [4,4] then 32 bytes of padding/slack
    p = _write(tmp_path, _gguf([_kv_u32("general.alignment", 32)], [_info("w", (4, 4), 0, 0)],
                               data))
    inv = _read(p)
    assert inv.bytes_by_category[Category.WEIGHTS] == 64
    assert inv.bytes_by_category[Category.METADATA] == p.stat().st_size - 64


def test_unknown_ggml_type_takes_bytes_up_to_next_tensor(tmp_path: Path) -> None:
    infos = [_info("new", (64,), 99, 0), _info("old", (8,), 0, 64)]
    p = _write(tmp_path, _gguf([], infos, bytes(64) + bytes(range(32))))
    inv = _read(p)
    assert inv.bytes_by_category[Category.WEIGHTS] == 64 + 32
    assert any("ggml type 99" in n for n in inv.notes)


LIARS = {
    "tensor_count_2_63": lambda: _gguf([], [], tensor_count=2**63),
    "kv_count_2_63": lambda: _gguf([], [], kv_count=2**63),
    "key_length_past_eof": lambda: _gguf([struct.pack("<Q", 10**12) + b"k"], []),
    "string_value_past_eof": lambda: _gguf(
        [_s("general.name") + struct.pack("<IQ", 8, 2**40) + b"abc"], []
    ),
    "array_count_huge": lambda: _gguf(
        [_s("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 2**62)], []
    ),
    "nested_arrays_too_deep": lambda: _gguf(
        [_s("a") + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 20 + struct.pack("<IQ", 4, 0)],
        [],
    ),
    "unknown_value_type": lambda: _gguf([_s("a") + struct.pack("<II", 77, 0)], []),
    "alignment_not_power_of_two": lambda: _gguf([_kv_u32("general.alignment", 48)], []),
    "alignment_zero": lambda: _gguf([_kv_u32("general.alignment", 0)], []),
    "n_dims_huge": lambda: _gguf([], [_s("w") + struct.pack("<I", 2**31)]),
    "tensor_past_eof": lambda: _gguf([], [_info("w", (1024, 1024), 0, 0)], bytes(64)),
    "offset_past_eof": lambda: _gguf([], [_info("w", (4,), 0, 2**60)], bytes(64)),
    "misaligned_offset": lambda: _gguf([], [_info("w", (4,), 0, 3)], bytes(64)),
    "partial_block": lambda: _gguf([], [_info("w", (33,), 2, 0)], bytes(64)),
    "duplicate_names": lambda: _gguf([], [_info("w", (4,), 0, 0), _info("w", (4,), 0, 32)],
                                     bytes(64)),
    "overlapping_tensors": lambda: _gguf([], [_info("a", (16,), 0, 0), _info("b", (16,), 0, 32)],
                                         bytes(96)),
    "version_1": lambda: _gguf([], [], version=1),
    "version_99": lambda: _gguf([], [], version=99),
    "bad_utf8_name": lambda: _gguf([], [_info("w", (4,), 0, 0)], bytes(16)).replace(
        b"\x01\x00\x00\x00\x00\x00\x00\x00w", b"\x01\x00\x00\x00\x00\x00\x00\x00\xff"
    ),
    "header_only": lambda: b"GGUF\x03\x00\x00\x00",
}


@pytest.mark.parametrize("case", sorted(LIARS))
def test_lying_files_are_corrupt(tmp_path: Path, case: str) -> None:
    p = _write(tmp_path, LIARS[case]())
    with pytest.raises(CorruptFileError) as info:
        _read(p)
    assert info.value.format == "gguf"


@pytest.mark.parametrize("cut", [5, 20, 100, 2000, 7000, 7424, 9000, 17455])
def test_truncated_fixture_is_corrupt(tmp_path: Path, cut: int) -> None:
    p = _write(tmp_path, (FIXTURES / "tiny.gguf").read_bytes()[:cut])
    with pytest.raises(CorruptFileError):
        _read(p)


def test_cli_exit_2_one_line(tmp_path: Path) -> None:
    p = _write(tmp_path, LIARS["tensor_count_2_63"]())
    assert_one_line_error(run_cli("inspect", str(p)), p)
