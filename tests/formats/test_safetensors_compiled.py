"""The compiled header scanner (``modelsize._headers``) against the Python scanner alone.

The compiled scanner takes only the entries of a compact header whose every check passes and
stops before any other (see ``_headers.c``); the Python loop takes that one. These tests scan
every header both ways and compare all the scan leaves: the metadata (or the error), each
column (names, dtypes, shapes with their sharing, offsets), the dtypes met and the shapes
remembered. The inputs: headers the safetensors library writes (every dtype it has, metadata,
scalars, empty tensors, escaped and non-ASCII names), hand-made edge cases (whitespace, numbers
written oddly or too long, shapes past the data, sub-byte dtypes, metadata in the middle,
undecodable names, truncation at every byte), and a few thousand random mutations.
"""

from __future__ import annotations

import functools
import json
import random
import struct
from pathlib import Path
from typing import Any

import pytest

from modelsize.formats import safetensors as st
from modelsize.formats.safetensors import _Bad, _Columns, _scan_compact

pytestmark = pytest.mark.skipif(st._scan_entries is None, reason="modelsize._headers is not built")

_COMPILED = st._scan_entries


def scan(raw: bytes, data_size: int, compiled: bool) -> dict[str, Any]:
    """What ``_scan_compact`` leaves, one way: its result (or error) and every column."""
    cols = _Columns(data_size)
    saved = st._scan_entries
    st._scan_entries = _COMPILED if compiled else None
    out: dict[str, Any] = {}
    try:
        out["metadata"] = _scan_compact(raw, cols)
    except _Bad as exc:
        out["bad"] = (exc.name, exc.reason)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        out["error"] = (type(exc).__name__, str(exc))
    finally:
        st._scan_entries = saved
    ids: dict[int, int] = {}
    out["names"] = list(cols.names)
    out["dtypes"] = list(cols.dtypes)
    out["shapes"] = [(s, ids.setdefault(id(s), len(ids))) for s in cols.shapes]
    out["begins"] = list(cols.begins)
    out["ends"] = list(cols.ends)
    out["known"] = {k: v[0] for k, v in cols.known.items()}
    return out


def both(raw: bytes, data_size: int) -> dict[str, Any]:
    fast, slow = scan(raw, data_size, True), scan(raw, data_size, False)
    assert fast == slow, raw[:300]
    return fast


def _entry(dtype: str, shape: list[int], begin: int, end: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def _compact(header: dict[str, Any]) -> bytes:
    return json.dumps(header, separators=(",", ":")).encode()


@functools.cache
def library_headers() -> list[tuple[bytes, int]]:
    """Headers written by the safetensors library: (header bytes, data size)."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save

    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
              torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
              torch.float8_e4m3fn, torch.float8_e5m2]
    cases: list[dict[str, Any]] = []
    cases.append({f"layer.{i}.weight": torch.zeros(3, 4) for i in range(50)})
    cases.append({f"t{i}": torch.zeros(2, i % 3 + 1, dtype=d) for i, d in enumerate(dtypes)})
    cases.append({"scalar": torch.tensor(1.0), "empty": torch.zeros(0, 5),
                  "wide": torch.zeros(1, 1, 1, 1, 1, 1, 7)})
    cases.append({'quote"d': torch.zeros(2), "back\\slash": torch.zeros(2),
                  "tab\tname": torch.zeros(2), "ünïcødé.权重": torch.zeros(2),
                  "emoji.😀": torch.zeros(1)})
    cases.append({f"h.{i}.{part}": torch.zeros(*shape, dtype=torch.bfloat16 if i % 2 else
                                               torch.float32)
                  for i in range(40) for part, shape in
                  (("attn.weight", (8, 8)), ("attn.bias", (8,)), ("mlp.weight", (16, 8)))})
    out = []
    for i, tensors in enumerate(cases):
        for metadata in (None, {"format": "pt", "note": f"case {i}"}):
            blob = save(tensors, metadata=metadata)
            n = struct.unpack_from("<Q", blob)[0]
            out.append((blob[8 : 8 + n], len(blob) - 8 - n))
    return out


def edge_cases() -> dict[str, tuple[bytes, int]]:
    good = {"a": _entry("F32", [2, 3], 0, 24), "b": _entry("F16", [4], 24, 32)}
    raw = _compact(good)
    cases: dict[str, tuple[bytes, int]] = {
        "good": (raw, 32),
        "empty": (b"{}", 0),
        "empty with spaces": (b"{ }", 0),
        "spaces between entries": (raw.replace(b",\"b\"", b", \"b\""), 32),
        "newlines": (json.dumps(good, indent=2).encode(), 32),
        "leading zero": (raw.replace(b"[0,24]", b"[00,24]"), 32),
        "19 digits": (_compact({"a": _entry("U8", [1000000000000000000], 0, 24)}), 24),
        "18 digits": (_compact({"a": _entry("U8", [999999999999999999], 0, 24)}), 24),
        "19 nines in a shape": (raw.replace(b"[2,3]", b"[9999999999999999999,3]"), 32),
        "19 nines as an offset": (raw.replace(b"[24,32]", b"[9999999999999999999,32]"), 32),
        "20-digit offset": (_compact({"a": _entry("U8", [1], 10**19, 10**19 + 1)}), 24),
        "product past the data": (_compact({"a": _entry("F32", [10**9, 10**9, 10**9], 0, 8)}),
                                  8),
        "product overflowing int64": (_compact({"a": _entry("U8", [10**17] * 8, 0, 8)}), 8),
        "zero in a huge shape": (_compact({"a": _entry("F32", [10**17, 0, 10**17], 0, 0)}), 8),
        "65 dimensions": (_compact({"a": _entry("U8", [1] * 65, 0, 1)}), 1),
        "64 dimensions": (_compact({"a": _entry("U8", [1] * 64, 0, 1)}), 1),
        "end before begin": (_compact({"a": _entry("U8", [1], 5, 4)}), 8),
        "end past the data": (_compact({"a": _entry("U8", [9], 0, 9)}), 8),
        "wrong byte count": (_compact({"a": _entry("F32", [2], 0, 4)}), 8),
        "unknown dtype": (_compact({"a": _entry("Q7", [2], 0, 4)}), 8),
        "41-character dtype": (_compact({"a": _entry("F" * 41, [2], 0, 4)}), 8),
        "sub-byte dtype": (_compact({"a": _entry("F4", [4], 0, 2), "b": _entry("F4", [4], 2, 4),
                                     "c": _entry("U8", [2], 4, 6)}), 6),
        "odd sub-byte count": (_compact({"a": _entry("F4", [3], 0, 2)}), 2),
        "metadata first": (_compact({"__metadata__": {"k": "v"}, **good}), 32),
        "metadata in the middle": (_compact({"a": good["a"], "__metadata__": {"k": "v"},
                                             "b": good["b"]}), 32),
        "metadata last": (_compact({**good, "__metadata__": {"k": "v"}}), 32),
        "metadata as a tensor": (_compact({"__metadata__": _entry("U8", [1], 0, 1)}), 1),
        "two metadata": (_compact(good)[:-1] + b',"__metadata__":{},"__metadata__":{}}', 32),
        "escaped metadata name": (raw.replace(b'"a"', b'"\\u005f_metadata__"'), 32),
        "duplicate names": (raw.replace(b'"b"', b'"a"'), 32),
        "escaped name": (raw.replace(b'"a"', b'"\\u00e9\\n"'), 32),
        "invalid UTF-8 name": (raw.replace(b'"a"', b'"\xff\xfe"'), 32),
        "surrogate name": (raw.replace(b'"a"', b'"\xed\xa0\x80"'), 32),
        "control byte in a name": (raw.replace(b'"a"', b'"a\x01"'), 32),
        "DEL and high bytes in a name": (raw.replace(b'"a"', b'"a\x7f\xc3\xa9"'), 32),
        "trailing garbage": (raw + b"x", 32),
        "trailing spaces": (raw + b"  ", 32),
        "missing close": (raw[:-1], 32),
        "entry ends with a colon": (raw[:-1] + b":", 32),
        "extra key": (raw.replace(b'"data_offsets":[24,32]', b'"data_offsets":[24,32],"x":1'),
                      32),
        "keys reordered": (raw.replace(b'{"dtype":"F16","shape":[4],',
                                       b'{"shape":[4],"dtype":"F16",'), 32),
        "negative number": (raw.replace(b"[0,24]", b"[-0,24]"), 32),
        "float number": (raw.replace(b"[2,3]", b"[2.0,3]"), 32),
        "nested list": (raw.replace(b"[2,3]", b"[[2],3]"), 32),
        "empty shape of a scalar": (_compact({"a": _entry("F32", [], 0, 4)}), 4),
        "comma after the shape list": (raw.replace(b"[2,3]", b"[2,3,]"), 32),
        "not an object": (b"[1,2]", 0),
        "a huge data area": (raw, 1 << 60),
    }
    many = {f"m.{i}": _entry("U8", [i % 7 + 1], 0, i % 7 + 1) for i in range(3000)}
    cases["many shapes"] = (_compact(many), 8)
    return cases


@pytest.mark.parametrize("index", range(10))
def test_library_headers_agree(index: int) -> None:
    raw, size = library_headers()[index]
    out = both(raw, size)
    assert "metadata" in out and out["metadata"] is not None


_EDGE = edge_cases()


@pytest.mark.parametrize("name", sorted(_EDGE))
def test_edge_cases_agree(name: str) -> None:
    raw, size = _EDGE[name]
    both(raw, size)


def test_every_truncation_agrees() -> None:
    raw, size = library_headers()[7]
    for n in range(len(raw) + 1):
        both(raw[:n], size)


def test_the_compiled_scanner_takes_the_common_entries(monkeypatch: pytest.MonkeyPatch) -> None:
    """A compact header's entries are scanned in C, but the first of each dtype (the Python
    loop meets it first) and those it must leave (here the escaped name)."""
    taken: list[int] = []

    def counting(raw: bytes, pos: int, *rest: Any) -> tuple[int, bool, bytes, bytes]:
        result = _COMPILED(raw, pos, *rest)  # type: ignore[misc]
        taken.append(len(result[2]) // 8)
        return result

    header = {f"w.{i}": _entry("F32", [2], 8 * i, 8 * i + 8) for i in range(1000)}
    header["x\\y"] = _entry("F32", [2], 8000, 8008)
    header.update({f"v.{i}": _entry("BF16", [4], 8008 + 8 * i, 8016 + 8 * i)
                   for i in range(1000)})
    monkeypatch.setattr(st, "_scan_entries", counting)
    cols = _Columns(16008)
    assert _scan_compact(_compact(header), cols) == {}
    assert len(cols.names) == 2001
    assert sum(taken) == 1998  # all but w.0 and v.0 (a new dtype each) and the escaped name
    assert cols.names[1000] == "x\\y"


def _mutate(rng: random.Random, raw: bytes) -> bytes:
    """A few random edits; most change one number or one byte, so that the header stays
    compact up to (and often past) the edit."""
    data = bytearray(raw)
    digits = [i for i, b in enumerate(data) if 48 <= b <= 57]
    for _ in range(rng.choice((1, 1, 1, 2, 4))):
        how = rng.random()
        at = rng.randrange(len(data) + 1)
        if how < 0.35 and digits:
            i = min(rng.choice(digits), len(data))
            data[i:i + 1] = rng.choice([b"0", b"1", b"7", b"00", b"9" * 19, b"18446744073709551616",
                                        str(rng.randrange(1 << 40)).encode()])
        elif how < 0.6 and data:
            data[min(at, len(data) - 1)] = rng.choice(b'0123456789,:[]{}"\\ x\x00\xff')
        elif how < 0.75:
            data[at:at] = bytes([rng.randrange(256)])
        elif how < 0.9 and data:
            del data[at : at + rng.randint(1, 8)]
        else:
            data[at:at] = rng.choice([b"0", b"9" * 19, b",", b'"', b"\\", b" ", b"]"])
    return bytes(data)


def mutation_seeds() -> list[tuple[bytes, int]]:
    return library_headers() + [v for v in _EDGE.values() if len(v[0]) < 20_000]


def test_random_mutations_agree() -> None:
    rng = random.Random(7)
    seeds = mutation_seeds()
    for _ in range(3000):
        raw, size = rng.choice(seeds)
        both(_mutate(rng, raw), rng.choice([size, size // 2, size + 8]))


def test_reading_files_agrees(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whole inventories (and the error of a bad file) are the same both ways."""
    import modelsize

    for i, (raw, size) in enumerate(library_headers()):
        blob = struct.pack("<Q", len(raw)) + raw + bytes(size)
        (tmp_path / f"f{i}.safetensors").write_bytes(blob)
    bad = _EDGE["wrong byte count"][0]
    (tmp_path / "bad.safetensors").write_bytes(struct.pack("<Q", len(bad)) + bad + bytes(8))

    def read_all() -> list[Any]:
        out: list[Any] = []
        for path in sorted(tmp_path.iterdir()):
            try:
                inv = modelsize.inspect(path).inventory
                out.append([t.to_dict() for t in inv.tensors])
                out.append({c.value: n for c, n in inv.bytes_by_category.items()})
            except modelsize.CorruptFileError as exc:
                out.append(str(exc))
        return out

    fast = read_all()
    monkeypatch.setattr(st, "_scan_entries", None)
    assert read_all() == fast
    assert any("needs 8 bytes but data_offsets [0, 4] hold 4" in str(x) for x in fast)
