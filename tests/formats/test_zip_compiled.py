"""The compiled zip loops (``modelsize._headers``: central directory records, the directory
walk, local headers) against ``_zip``'s Python loops alone.

The compiled loops take the records and headers that lie where they are read and pass every
check, and stop before any other (see ``_headers.c``); the Python loop takes that one, and says
what is wrong. These tests read every archive both ways and compare all that comes out: the
directory's entries (or the exception), and the members with and without the local-name check
(or the error): on archives zipfile, torch and NumPy write (ZIP64 extra fields, bytes before
the archive, names in UTF-8 and cp437, comments), hand-damaged ones, and a few thousand random
mutations of the directory and the local headers.
"""

from __future__ import annotations

import io
import random
import struct
import zipfile
from pathlib import Path
from typing import Any

import pytest

from modelsize.errors import CorruptFileError
from modelsize.formats import _zip
from modelsize.inventory import InventoryBuilder
from tests.formats.test_zip_directory import _archive

pytestmark = pytest.mark.skipif(_zip._local_headers is None,
                                reason="modelsize._headers is not built")

_HOOKS = ("_central_records", "_check_records", "_local_headers")
_COMPILED = {name: getattr(_zip, name) for name in _HOOKS}


def read(path: Path, compiled: bool) -> dict[str, Any]:
    """All ``_zip`` makes of ``path`` one way: entries, and members with and without names."""
    saved = {name: getattr(_zip, name) for name in _HOOKS}
    for name in _HOOKS:
        setattr(_zip, name, _COMPILED[name] if compiled else None)
    out: dict[str, Any] = {}
    try:
        try:
            out["directory"] = [tuple(e) for e in _zip.directory(path)]
        except (zipfile.BadZipFile, NotImplementedError, UnicodeDecodeError, ValueError,
                OSError) as exc:
            out["directory"] = (type(exc).__name__, str(exc))
        for names in (False, True):
            builder = InventoryBuilder("zip", [path])
            try:
                found = _zip.members(path, builder, names=names)
                out[f"members{names}"] = [tuple(m) for m in found]
                assert all(type(m) is _zip.Member for m in found)
            except CorruptFileError as exc:
                out[f"members{names}"] = str(exc)
            except (NotImplementedError, UnicodeDecodeError) as exc:
                # (what directory() raised: callers read the directory first, and say so)
                out[f"members{names}"] = (type(exc).__name__, str(exc))
    finally:
        for name, value in saved.items():
            setattr(_zip, name, value)
    return out


def both(path: Path) -> dict[str, Any]:
    fast, slow = read(path, True), read(path, False)
    assert fast == slow, path.read_bytes()[-300:]
    return fast


def _zip_bytes(members: list[tuple[str | zipfile.ZipInfo, bytes]], comment: bytes = b"",
               zip64: bool = False) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in members:
            if zip64:
                with z.open(name if isinstance(name, zipfile.ZipInfo) else zipfile.ZipInfo(name),
                            "w", force_zip64=True) as fh:
                    fh.write(data)
            else:
                z.writestr(name, data)
        z.comment = comment
    return buf.getvalue()


def real_archives(folder: Path) -> list[Path]:
    import numpy as np
    import torch

    out = []
    torch.save({f"w{i}": torch.zeros(i + 1) for i in range(40)}, folder / "a.pt")
    torch.save({"w": torch.zeros(3000)}, folder / "big_members.pt")
    torch.save({f"w{i}": torch.zeros(1) for i in range(3000)}, folder / "many.pt")
    np.savez(folder / "b.npz", x=np.arange(10), y=np.zeros((3, 3)))
    np.savez_compressed(folder / "c.npz", x=np.arange(100))
    out += [folder / "a.pt", folder / "big_members.pt", folder / "many.pt", folder / "b.npz",
            folder / "c.npz"]
    utf8 = zipfile.ZipInfo("weights/é.bin")
    cp437 = zipfile.ZipInfo("old.bin")
    cases = {
        "zip64.zip": _zip_bytes([(f"m{i}", b"x" * (i + 1)) for i in range(5)], zip64=True),
        "names.zip": _zip_bytes([(utf8, b"1"), (cp437, b"22"), ("dir/", b"")], b"comment"),
        "deflated.zip": _zip_bytes([(zipfile.ZipInfo("d"), b"0" * 5000)]),
    }
    for name, data in cases.items():
        (folder / name).write_bytes(data)
        out.append(folder / name)
    (folder / "prefixed.zip").write_bytes(b"#!/bin/sh\n" * 3 + cases["names.zip"])
    out.append(folder / "prefixed.zip")
    with zipfile.ZipFile(folder / "deflated.zip", "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("d", b"0" * 5000)
        z.writestr("e", b"")
    return out


def test_real_archives_agree(tmp_path: Path) -> None:
    for path in real_archives(tmp_path):
        out = both(path)
        assert isinstance(out["membersTrue"], list), (path, out)


def _patched(data: bytes, find: bytes, at: int, value: bytes, nth: int = 0) -> bytes:
    """``data`` with ``value`` written ``at`` bytes past the ``nth`` occurrence of ``find``."""
    pos = -1
    for _ in range(nth + 1):
        pos = data.index(find, pos + 1)
    out = bytearray(data)
    out[pos + at : pos + at + len(value)] = value
    return bytes(out)


def _handmade(members: list[dict[str, Any]]) -> bytes:
    """An archive written field by field: each member a dict of ``name`` (bytes), ``data``,
    and any of ``method``, ``flags``, ``file_size``, ``compress_size``, ``offset`` (as the
    central directory records them, e.g. 0xFFFFFFFF) and ``extra`` (its central extra field,
    or a function of the member's true offset that makes it). A plain member comes first: the
    compiled loop takes the members after the one that reads the window in."""
    out = bytearray()
    records = bytearray()
    for m in [{"name": b"first", "data": b"0"}, *members]:
        extra = m.get("extra", b"")
        at = len(out)
        data, name = m["data"], m["name"]
        method, flags = m.get("method", 0), m.get("flags", 0)
        crc = zipfile.crc32(data) if "crc" not in m else m["crc"]
        out += struct.pack("<4s5H3I2H", b"PK\x03\x04", 20, flags, method, 0, 0, crc,
                           len(data), len(data), len(name), 0) + name + data
        records += struct.pack(
            "<4s4B4HL2L5H2L", b"PK\x01\x02", 20, 3, m.get("version", 20), 0, flags, method, 0,
            0, crc, m.get("compress_size", len(data)), m.get("file_size", len(data)), len(name),
            len(extra(at) if callable(extra) else extra), 0, 0, 0, 0, m.get("offset", at),
        ) + name + (extra(at) if callable(extra) else extra)
    start = len(out)
    out += records
    out += struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, len(members) + 1, len(members) + 1,
                       len(records), start, 0)
    return bytes(out)


def _zip64(*values: int) -> bytes:
    return struct.pack(f"<HH{len(values)}Q", 1, 8 * len(values), *values)


def edge_cases() -> dict[str, bytes]:
    good = _zip_bytes([("a", b"123"), ("b/c", b"4567"), ("d", b"")])
    cd = b"PK\x01\x02"
    local = b"PK\x03\x04"
    return {
        "good": good,
        "encrypted flag": _patched(good, cd, 8, b"\x01\x00", 1),
        "strong encryption flag in the directory": _patched(good, cd, 8, b"\x40\x00"),
        "version too high": _patched(good, cd, 6, b"\xff"),
        "NUL in a name": _patched(good, cd, 46, b"\x00", 1),
        "not UTF-8 with the UTF-8 flag": _patched(_patched(good, cd, 8, b"\x00\x08"), cd, 46,
                                                  b"\xff"),
        "cp437 high byte": _patched(_patched(good, cd, 46, b"\x82"), local, 30, b"\x82"),
        "local name differs": _patched(good, local, 30, b"z"),
        "local magic broken": _patched(good, local, 0, b"PX", 1),
        "header offset past the end": _patched(good, cd, 42, b"\xff\xff\x00\x00", 2),
        "header offset into the directory": _patched(good, cd, 42, struct.pack(
            "<I", good.index(cd)), 2),
        "stored sizes differ": _patched(good, cd, 24, b"\x09\x00\x00\x00", 1),
        "inflating too much": _patched(_patched(good, cd, 10, b"\x08\x00"), cd, 24,
                                       b"\xff\xff\xff\x00"),
        "compressed past the end": _patched(good, cd, 20, b"\xff\xff\x00\x00", 1),
        "long extra field": _patched(good, cd, 30, b"\xff\xff", 1),
        "long comment": _patched(good, cd, 32, b"\x10\x00", 2),
        "zip64 masked size without its field": _patched(good, cd, 24, b"\xff\xff\xff\xff"),
        "local extra length huge": _patched(good, local, 28, b"\xff\xff", 2),
        "directory record not where the last ended": _patched(good, cd, 0, b"PK\x01\x03", 2),
        "truncated": good[: len(good) - 30],
        "zip64 offset": _handmade([
            {"name": b"a", "data": b"12"},
            {"name": b"b", "data": b"345", "offset": 0xFFFFFFFF, "extra": _zip64}]),
        "zip64 sizes and offset": _handmade([
            {"name": b"a", "data": b"12"},
            {"name": b"b", "data": b"345", "offset": 0xFFFFFFFF, "file_size": 0xFFFFFFFF,
             "compress_size": 0xFFFFFFFF, "extra": lambda at: _zip64(3, 3, at)}]),
        "zip64 offset wrong": _handmade([
            {"name": b"a", "data": b"12"},
            {"name": b"b", "data": b"345", "offset": 0xFFFFFFFF, "extra": _zip64(0)}]),
        "zip64 field short": _handmade([
            {"name": b"b", "data": b"345", "offset": 0xFFFFFFFF, "file_size": 0xFFFFFFFF,
             "extra": _zip64(3)}]),
        "zip64 field twice": _handmade([
            {"name": b"b", "data": b"345", "file_size": 0xFFFFFFFF,
             "extra": _zip64(0xFFFFFFFFFFFFFFFF) + _zip64(3)}]),
        "zip64 value past 2**62": _handmade([
            {"name": b"b", "data": b"345", "file_size": 0xFFFFFFFF,
             "extra": _zip64(1 << 62)}]),
        "other extra fields": _handmade([
            {"name": b"b", "data": b"345", "extra": b"UT\x05\x00\x01abcd" + _zip64()}]),
        "extra field running past its end": _handmade([
            {"name": b"b", "data": b"345", "extra": b"UT\x09\x00\x01abcd"}]),
        "deflated at the inflate limit": _handmade([
            {"name": b"b", "data": b"345", "method": 8, "file_size": 3 * 1100}]),
        "deflated past the inflate limit": _handmade([
            {"name": b"b", "data": b"345", "method": 8, "file_size": 3 * 1100 + 1}]),
        "empty deflated claiming 1100": _handmade([
            {"name": b"b", "data": b"", "method": 8, "file_size": 1100}]),
        "empty deflated claiming 1101": _handmade([
            {"name": b"b", "data": b"", "method": 8, "file_size": 1101}]),
        "UTF-8 flag and name": _handmade([
            {"name": "é/ü".encode(), "data": b"1", "flags": 0x800}]),
    }


@pytest.mark.parametrize("name", sorted(edge_cases()))
def test_edge_cases_agree(tmp_path: Path, name: str) -> None:
    path = tmp_path / "z.zip"
    path.write_bytes(edge_cases()[name])
    both(path)


def test_every_truncation_of_the_directory_agrees(tmp_path: Path) -> None:
    data = _zip_bytes([(f"m{i}", b"x" * i) for i in range(6)], b"note", zip64=True)
    path = tmp_path / "z.zip"
    for n in range(data.index(b"PK\x01\x02") - 40, len(data) + 1):
        path.write_bytes(data[:n])
        both(path)


def test_the_compiled_loops_take_the_common_members(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch checkpoint's records and headers are read in C, but for the first member of
    each window (the Python loop reads the window in)."""
    import torch

    calls: dict[str, int] = {"records": 0, "headers": 0}
    records, headers = _zip._central_records, _zip._local_headers
    assert records is not None and headers is not None

    def counting_records(*args: Any) -> Any:
        q, took = records(*args)
        calls["records"] += took
        return q, took

    def counting_headers(window: bytes, start: int, infos: list[Any], i: int,
                         *rest: Any) -> int:
        j = headers(window, start, infos, i, *rest)
        calls["headers"] += j - i
        return j

    torch.save({f"w{i}": torch.zeros(2) for i in range(500)}, tmp_path / "a.pt")
    monkeypatch.setattr(_zip, "_central_records", counting_records)
    monkeypatch.setattr(_zip, "_local_headers", counting_headers)
    found = _zip.members(tmp_path / "a.pt", InventoryBuilder("zip", [tmp_path / "a.pt"]))
    assert len(found) >= 500
    assert calls["records"] > 0
    assert calls["headers"] >= len(found) - 1


def _mutate_zip(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    targets = [i for i in range(len(out)) if out[i : i + 4] in (b"PK\x01\x02", b"PK\x03\x04")]
    for _ in range(rng.choice((1, 1, 2, 3))):
        base = rng.choice(targets) if targets and rng.random() < 0.8 else rng.randrange(len(out))
        at = min(len(out) - 1, base + rng.randrange(48))
        how = rng.random()
        if how < 0.6:
            out[at] = rng.choice([0, 1, 0x7F, 0x80, 0xFF, rng.randrange(256)])
        elif how < 0.8:
            out[at : at + 4] = rng.choice([b"\xff\xff\xff\xff", b"\x00\x00\x00\x00",
                                           struct.pack("<I", rng.randrange(len(out) + 64))])
        elif how < 0.9:
            del out[at : at + rng.randint(1, 8)]
        else:
            out[at:at] = rng.randbytes(rng.randint(1, 8))
    return bytes(out[: len(data) + 64])


def mutation_seeds(rng: random.Random) -> list[bytes]:
    seeds = [bytes(_archive(rng)) for _ in range(30)]
    seeds += [v for v in edge_cases().values()]
    seeds.append(_zip_bytes([(f"m{i}", b"x" * i) for i in range(6)], b"note", zip64=True))
    return seeds


def test_random_mutations_agree(tmp_path: Path) -> None:
    rng = random.Random(3)
    seeds = mutation_seeds(rng)
    path = tmp_path / "z.zip"
    for _ in range(1500):
        path.write_bytes(_mutate_zip(rng, rng.choice(seeds)))
        both(path)
