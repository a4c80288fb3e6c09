"""slim's fast paths: checksums on every core, tensors of 1 MiB and more copied in hand and
read back while the rest is written, casts on every core. Each gives what the plain path gives,
and verification still catches bytes that differ from the ones written."""

from __future__ import annotations

import os
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

import modelsize
from modelsize.errors import CorruptFileError, VerificationError
from modelsize.slimming import cast, checksum
from modelsize.slimming.output import OutputFile

safetensors_numpy = pytest.importorskip("safetensors.numpy")

BIG = (1024, 640)  # 2.5 MiB of float32: over the 1 MiB of the in-hand copy, several pieces


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    """A safetensors training checkpoint with large and small tensors, NaN, inf and values
    beyond float16 in it."""
    rng = np.random.default_rng(0)
    tensors = {f"layer{i}.weight": rng.standard_normal(BIG, dtype=np.float32) * 10.0 ** (i - 2)
               for i in range(4)}
    tensors["layer0.weight"][0, :4] = [np.nan, np.inf, -np.inf, 1e6]
    tensors["layer0.bias"] = rng.standard_normal(300, dtype=np.float32)
    tensors["layer1.weight.exp_avg"] = rng.standard_normal(BIG, dtype=np.float32)
    path = tmp_path_factory.mktemp("fast") / "train.safetensors"
    safetensors_numpy.save_file(tensors, str(path))
    return path, {k: v for k, v in tensors.items() if "exp_avg" not in k}


def test_crc32_combine_is_zlibs() -> None:
    rng = np.random.default_rng(1)
    for n1, n2 in [(0, 0), (0, 5), (5, 0), (1, 1), (1000, 3), (70_000, 1 << 20)]:
        a, b = rng.bytes(n1), rng.bytes(n2)
        assert checksum.crc32_combine(zlib.crc32(a), zlib.crc32(b), n2) == zlib.crc32(a + b)


def test_crc32_gives_zlibs_values_with_isal_and_without(monkeypatch: pytest.MonkeyPatch) -> None:
    """slim's ``crc32`` is ISA-L's where ``isal`` is installed (the slim extra), zlib's where
    it is not: the same values for any data, start value and buffer type."""
    rng = np.random.default_rng(3)
    cases = [(b"", 0), (b"a", 0), (rng.bytes(1000), 12345), (rng.bytes(3 << 20), 0xFFFFFFFF)]
    for data, start in cases:
        want = zlib.crc32(data, start)
        assert checksum.crc32(data, start) == want
        assert checksum.crc32(memoryview(data), start) == want
        assert checksum.crc32(bytearray(data), start) == want
    data = rng.bytes(70_000)  # random pieces: any alignment, lengths up to 70 KB
    for _ in range(300):
        start, n = (int(v) for v in rng.integers(0, 4096, 2))
        value = int(rng.integers(0, 1 << 32))
        piece = memoryview(data)[start : start + n * 17]
        assert checksum.crc32(piece, value) == zlib.crc32(piece, value), (start, n, value)
    monkeypatch.setitem(sys.modules, "isal.isal_zlib", None)  # as if not installed
    assert checksum._fastest_crc32() is zlib.crc32


def test_the_slim_extra_installs_isal() -> None:
    pytest.importorskip("isal", reason="isal has no wheel for this platform")
    from isal.isal_zlib import crc32

    assert checksum.crc32 is crc32


@pytest.mark.parametrize("cores", [1, 3])
def test_crc_ranges_in_any_order_overlapping_and_across_pieces(
        tmp_path: Path, cores: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checksum, "cores", lambda: cores)
    monkeypatch.setattr(checksum, "PIECE", 1 << 16)  # many pieces from a small file
    data = np.random.default_rng(2).bytes(600_000)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    ranges = [(500_000, 100_000), (0, 600_000), (10, 5), (16, 200_000), (16, 200_000),
              (599_999, 1), (300, 0), (70_000, 65_536), (3, 70_000)]
    fd = os.open(path, os.O_RDONLY)
    try:
        got = checksum.crc_ranges(fd, ranges, path)
        with pytest.raises(CorruptFileError, match="file ends before byte 600010"):
            checksum.crc_ranges(fd, [(599_990, 20)], path)
    finally:
        os.close(fd)
    assert got == [zlib.crc32(data[o : o + n]) for o, n in ranges]


def _bf16(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, rounded to nearest-even, NaN kept quiet (torch's rounding),
    written here independently of modelsize's cast."""
    u = a.astype(np.float32).view(np.uint32).astype(np.uint64)
    out = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(a)
    out[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return out


@pytest.mark.parametrize("cores", [1, 2])
@pytest.mark.parametrize(("dtype", "compiled"),
                         [("bfloat16", True), ("bfloat16", False), ("float16", True),
                          ("float16", False)])
def test_cast_on_every_core_gives_the_values_and_errors_of_one(
        ckpt: tuple[Path, dict[str, np.ndarray]], tmp_path: Path, cores: int, dtype: str,
        compiled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """With and without the compiled casts (``modelsize._speedups``, where built)."""
    if compiled and cast._speedups is None:
        pytest.skip("the C extension is not built")
    if not compiled:
        monkeypatch.setattr(cast, "_speedups", None)
    monkeypatch.setattr(checksum, "cores", lambda: cores)
    src, want = ckpt
    out = tmp_path / "out.safetensors"
    report = modelsize.slim(src, out, cast=dtype)
    assert report.verified
    header = _header(out)
    kept = {k.name: k for k in report.kept}
    for name, a in want.items():
        info = header[name]
        start, stop = info["data_offsets"]
        raw = _data(out, header)[start:stop]
        if dtype == "float16":
            with np.errstate(over="ignore"):
                expect = a.astype(np.float16)
            got = np.frombuffer(raw, np.float16).reshape(a.shape)
            assert np.array_equal(got, expect, equal_nan=True), name
            back = expect.astype(np.float64)
        else:
            bits = _bf16(a)
            got16 = np.frombuffer(raw, np.uint16).reshape(a.shape)
            assert np.array_equal(got16, bits), name
            back = (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        exact = a.astype(np.float64)
        finite = np.isfinite(exact) & np.isfinite(back)
        diff = np.abs(exact[finite] - back[finite])
        with np.errstate(invalid="ignore", divide="ignore"):
            rel = diff / np.abs(exact[finite])
        k = kept[name]
        assert k.crc32 == zlib.crc32(raw), name
        assert k.max_abs_error == pytest.approx(diff.max(), rel=1e-6), name
        assert k.max_rel_error == pytest.approx(np.nanmax(rel), rel=1e-6), name
        assert k.overflow == int(np.count_nonzero(np.isinf(back) & np.isfinite(exact))), name


def _header(path: Path) -> dict[str, dict[str, object]]:
    import json

    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        return json.loads(fh.read(n))  # type: ignore[no-any-return]


def _data(path: Path, header: object) -> bytes:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return raw[8 + n :]


@pytest.mark.parametrize("cores", [1, 2])
@pytest.mark.parametrize("to", ["same", "pytorch"])
def test_large_tensors_copied_in_hand_read_back_early(
        ckpt: tuple[Path, dict[str, np.ndarray]], tmp_path: Path, cores: int, to: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checksum, "cores", lambda: cores)
    early: list[int] = []
    real = OutputFile.read_back

    def read_back(self: OutputFile, offset: int, nbytes: int) -> int | None:
        crc = real(self, offset, nbytes)
        if crc is not None:
            early.append(nbytes)
        return crc

    monkeypatch.setattr(OutputFile, "read_back", read_back)
    src, want = ckpt
    out = tmp_path / ("out.safetensors" if to == "same" else "out.pt")
    assert modelsize.slim(src, out, to=to).verified
    # Every tensor of 1 MiB and more was read back while the rest was written (not on one
    # core: nothing to overlap with there).
    assert sorted(early) == ([] if cores == 1 else [BIG[0] * BIG[1] * 4] * 4)
    if to == "same":
        got = safetensors_numpy.load_file(str(out))
    else:
        torch = pytest.importorskip("torch")
        got = {k: v.numpy() for k, v in torch.load(out, weights_only=True).items()}
    assert sorted(got) == sorted(want)
    for k, a in want.items():
        assert np.array_equal(got[k], a, equal_nan=True), k


@pytest.mark.parametrize("to", ["same", "pytorch"])
def test_bytes_written_again_after_the_early_read_back_are_caught(
        ckpt: tuple[Path, dict[str, np.ndarray]], tmp_path: Path, to: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A writer bug that, once a large tensor is written and reported, seeks back into it and
    # changes a byte: its early CRC must not vouch for it.
    monkeypatch.setattr(checksum, "cores", lambda: 2)
    real = OutputFile.wrote
    done: list[bool] = []

    def wrote(self: OutputFile, offset: int, nbytes: int) -> None:
        real(self, offset, nbytes)
        if not done:
            done.append(True)
            assert self.early.crc(offset, nbytes) is not None  # read back before the change
            end = self.tell()
            self.seek(offset + nbytes // 2)
            self.write(b"\xff")
            self.seek(end)

    monkeypatch.setattr(OutputFile, "wrote", wrote)
    src, _ = ckpt
    out = tmp_path / ("out.safetensors" if to == "same" else "out.pt")
    with pytest.raises(VerificationError, match="read back differ from the bytes written"):
        modelsize.slim(src, out, to=to)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_rewrites_are_tracked_to_the_byte(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checksum, "cores", lambda: 2)
    fh = OutputFile(__import__("io").FileIO(tmp_path / "f", "w+"))
    try:
        fh.write(b"h" * 10)
        fh.flush()
        os.write(fh.fileno(), b"d" * 100)  # as an in-hand copy writes
        fh.seek(110)
        fh.wrote(10, 100)
        fh.seek(2)
        fh.write(b"H" * 8)  # a header patched: ends where the data starts
        fh.seek(110)
        assert fh.read_back(10, 100) == zlib.crc32(b"d" * 100)
        assert fh.read_back(10, 99) is None  # never read back as such
        fh.seek(109)
        fh.write(b"x")
        assert fh.read_back(10, 100) is None  # its last byte written again
    finally:
        fh.close()


def test_disk_full_during_an_in_hand_copy_is_one_line(
        ckpt: tuple[Path, dict[str, np.ndarray]], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import errno

    from modelsize.cli import main

    real = os.write
    calls: list[int] = []

    def write(fd: int, data: bytes) -> int:
        calls.append(len(data))
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)
    src, _ = ckpt
    out = tmp_path / "out.safetensors"
    assert main(["slim", str(src), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"modelsize: {out}: cannot write it: no space left on the device")
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == []
