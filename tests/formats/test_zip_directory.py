"""``_zip.directory`` reads a central directory as :mod:`zipfile` does, record for record and
failure for failure: on real archives (a torch checkpoint past 4 GiB offsets by ZIP64 is in
the benchmarks) and on thousands of randomly damaged ones."""

from __future__ import annotations

import io
import random
import warnings
import zipfile
from pathlib import Path

import pytest

from modelsize.formats import _zip


def _zipfile(path: Path) -> object:
    try:
        with zipfile.ZipFile(path) as zf:
            return [(i.filename, i.orig_filename, i.header_offset, i.compress_size, i.file_size,
                     i.compress_type, i.CRC, i.flag_bits, i.volume) for i in zf.infolist()]
    except Exception as exc:
        return (type(exc).__name__, str(exc))


def _ours(path: Path) -> object:
    try:
        return [tuple(e) for e in _zip.directory(path)]
    except Exception as exc:
        return (type(exc).__name__, str(exc))


def _archive(rng: random.Random) -> bytearray:
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # duplicate names are among the cases
        with zipfile.ZipFile(buf, "w") as z:
            for i in range(rng.randint(0, 5)):
                name = rng.choice(["a", "data.pkl", "arch/data/0", "é.txt", "x\0y", "d/"])
                info = zipfile.ZipInfo(name + str(i) if rng.random() < 0.8 else name)
                info.compress_type = rng.choice([zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED])
                z.writestr(info, rng.randbytes(rng.randint(0, 50)))
            if rng.random() < 0.3:
                z.comment = b"c" * rng.randint(0, 300)
    data = bytearray(buf.getvalue())
    if rng.random() < 0.3:  # bytes before the archive ("concat")
        data = bytearray(rng.randbytes(rng.randint(1, 40))) + data
    return data


def test_real_archives_read_as_zipfile_reads_them(tmp_path: Path) -> None:
    import numpy as np
    import torch

    torch.save({"w": torch.zeros(3), "b": torch.ones(2, dtype=torch.float64)}, tmp_path / "a.pt")
    np.savez_compressed(tmp_path / "b.npz", x=np.arange(10))
    big = tmp_path / "zip64.zip"
    with zipfile.ZipFile(big, "w") as z:  # ZIP64 extra fields forced on small members
        for i in range(3):
            with z.open(f"m{i}", "w", force_zip64=True) as fh:
                fh.write(b"x" * (i + 1))
    for path in (tmp_path / "a.pt", tmp_path / "b.npz", big):
        assert _ours(path) == _zipfile(path)
        assert isinstance(_ours(path), list)
        with open(path, "rb") as fh:  # an open binary file reads the same (DCP's items)
            assert _zip.directory(fh) == _zip.directory(path)


@pytest.mark.parametrize("seed", range(4))
def test_damaged_archives_fail_as_zipfile_fails(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    path = tmp_path / "z.zip"
    kinds: set[str] = set()
    for _ in range(400):
        data = _archive(rng)
        directory = data.rfind(b"PK\x01\x02")
        for _ in range(rng.randint(1, 4)):  # mostly in the directory and the end record
            lo = max(0, directory - 200) if directory > 0 and rng.random() < 0.7 else 0
            data[rng.randrange(lo, len(data))] = rng.randrange(256)
        if rng.random() < 0.1:
            data = data[: rng.randrange(len(data) + 1)]
        path.write_bytes(bytes(data))
        want = _zipfile(path)
        assert _ours(path) == want, bytes(data)
        kinds.add(want[0] if isinstance(want, tuple) else "ok")
    assert {"ok", "BadZipFile"} <= kinds


def test_the_format_numbers_are_zipfiles() -> None:
    assert (_zip.STORED, _zip.DEFLATED) == (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED)
    assert _zip._MAX_EXTRACT_VERSION == zipfile.MAX_EXTRACT_VERSION


def _with_zip64_end(data: bytes, rng: random.Random) -> bytes:
    """``data`` (an archive without a comment) with a ZIP64 end record and locator put before
    its end record: well-formed, or damaged in one of the ways zipfile tells apart."""
    eocd = data[-22:]
    count, size, offset = (int.from_bytes(eocd[10:12], "little"),
                           int.from_bytes(eocd[12:16], "little"),
                           int.from_bytes(eocd[16:20], "little"))
    body = data[:-22]
    sig64 = b"PK\x06\x06" if rng.random() < 0.8 else b"PK\x06\x05"
    disk = 0 if rng.random() < 0.8 else rng.choice([1, 7])
    record = (sig64 + (44).to_bytes(8, "little") + (45).to_bytes(2, "little") * 2
              + bytes(8) + count.to_bytes(8, "little") * 2 + size.to_bytes(8, "little")
              + offset.to_bytes(8, "little"))
    loc_sig = b"PK\x06\x07" if rng.random() < 0.85 else b"PK\x06\x08"
    disks = 1 if rng.random() < 0.85 else rng.choice([0, 2])
    locator = (loc_sig + disk.to_bytes(4, "little") + len(body).to_bytes(8, "little")
               + disks.to_bytes(4, "little"))
    if rng.random() < 0.2:
        record = record[: rng.randrange(len(record))]
    return body + record + locator + eocd


@pytest.mark.parametrize("seed", range(3))
def test_end_records_are_found_as_zipfile_finds_them(tmp_path: Path, seed: int) -> None:
    """``_end_record`` reads the common end records itself (zipfile not imported) and hands
    every other one to zipfile: the same list, or the same failure, either way."""
    rng = random.Random(seed)
    path = tmp_path / "z.zip"
    for i in range(300):
        data = bytes(_archive(rng))
        if i % 3 and data[-2:] == b"\0\0":
            data = _with_zip64_end(data, rng)
        if rng.random() < 0.2:
            data = data[: rng.randrange(len(data) + 1)]
        with io.BytesIO(data) as fh:
            try:
                want: object = zipfile._EndRecData(fh)  # type: ignore[attr-defined]
            except Exception as exc:
                want = (type(exc).__name__, str(exc))
        with io.BytesIO(data) as fh:
            try:
                got: object = _zip._end_record(fh)
            except Exception as exc:
                got = (type(exc).__name__, str(exc))
        assert got == want, data[-120:]
        path.write_bytes(data)
        assert _ours(path) == _zipfile(path), data[-120:]


def test_a_torch_checkpoint_is_read_without_zipfile(tmp_path: Path) -> None:
    """A torch checkpoint is read without importing zipfile (nor shutil, bz2, lzma)."""
    import subprocess
    import sys

    import torch

    torch.save({"w": torch.zeros(3)}, tmp_path / "a.pt")
    code = ("import sys\nimport modelsize\nmodelsize.inspect(sys.argv[1])\n"
            "print('zipfile' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "a.pt")],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
