"""Files that lie about their size or are merely huge, written without holding them in memory.

Each ``make_*`` function writes one reproducer of issue 18's "hostile sizes" into a folder and
returns its path; the default sizes are the reporter's, a ``scale`` below 1 makes a smaller one
of the same kind (the tests use small ones, ``benchmarks/hostile.py`` the full ones). Zip
archives are written here by :class:`ZipOut`, with :mod:`struct` and :mod:`zlib` only (not with
modelsize's writer): runs of zeros become holes of a sparse file in a stored member, and
repeated fully-flushed deflate blocks in a deflated one, so a 4 GiB bomb costs a few MB and a
second to make. :func:`measure` runs a command and returns its exit code, seconds and peak RSS
(the ``VmHWM`` of that process).

Run as a script to write every reproducer into a folder::

    python tests/formats/hostile_sizes.py DIR [--scale 0.1]
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
KERAS_FIXTURE = HERE.parent / "fixtures" / "keras" / "model.keras"
MiB = 1 << 20
_Z64 = 0xFFFFFFFF


# -- zip archives written by hand ----------------------------------------------------------------


@dataclass(frozen=True)
class Zeros:
    """A run of ``n`` zero bytes in a member's content (a hole, or repeated deflate blocks)."""

    n: int


_ZERO_MIB = bytes(MiB)


def _crc_zeros(n: int, crc: int) -> int:
    while n:
        take = min(n, MiB)
        crc = zlib.crc32(memoryview(_ZERO_MIB)[:take], crc)
        n -= take
    return crc


class _Deflater:
    """Raw deflate in which every whole MiB of zeros is one cached, fully flushed block: after
    ``Z_FULL_FLUSH`` nothing refers back, so identical blocks can be repeated as they are."""

    def __init__(self) -> None:
        self.c = zlib.compressobj(6, zlib.DEFLATED, -15)
        probe = zlib.compressobj(6, zlib.DEFLATED, -15)
        self.zero_block = probe.compress(_ZERO_MIB) + probe.flush(zlib.Z_FULL_FLUSH)

    def data(self, raw: bytes) -> bytes:
        return self.c.compress(raw)

    def zeros(self, n: int) -> Iterator[bytes]:
        head = self.c.flush(zlib.Z_FULL_FLUSH)
        whole, rest = divmod(n, MiB)
        if head:
            yield head
        for _ in range(whole):
            yield self.zero_block
        if rest:
            yield self.c.compress(bytes(rest))

    def finish(self) -> bytes:
        return self.c.flush()


class ZipOut:
    """A zip archive written member by member: stored members may hold holes, deflated ones
    zero runs as repeated blocks; ZIP64 records where sizes, offsets or counts need them."""

    def __init__(self, path: Path) -> None:
        self.fh = open(path, "wb")  # noqa: SIM115 (closed by close())
        self.central: list[bytes] = []

    def add(self, name: str, content: Iterable[bytes | Zeros], size: int,
            deflate: bool = False) -> None:
        """One member of ``size`` logical bytes (``content`` must add up to it)."""
        fh = self.fh
        offset = fh.tell()
        raw_name = name.encode()
        z64 = size >= _Z64
        extra = struct.pack("<HHQQ", 1, 16, 0, 0) if z64 else b""
        header_len = 30 + len(raw_name) + len(extra)
        fh.seek(offset + header_len)
        crc, written, logical = 0, 0, 0
        deflater = _Deflater() if deflate else None
        for part in content:
            if isinstance(part, Zeros):
                crc = _crc_zeros(part.n, crc)
                logical += part.n
                if deflater is None:
                    fh.seek(part.n, os.SEEK_CUR)
                    written += part.n
                else:
                    for block in deflater.zeros(part.n):
                        fh.write(block)
                        written += len(block)
                continue
            crc = zlib.crc32(part, crc)
            logical += len(part)
            out = part if deflater is None else deflater.data(part)
            fh.write(out)
            written += len(out)
        if deflater is not None:
            tail = deflater.finish()
            fh.write(tail)
            written += len(tail)
        if logical != size:
            raise ValueError(f"{name}: {logical} bytes of content, {size} declared")
        end = fh.tell()
        if end < offset + header_len + written:  # a trailing hole: give the file its length
            fh.truncate(offset + header_len + written)
            end = offset + header_len + written
        method = 8 if deflate else 0
        version = 45 if z64 else 20
        if z64:
            extra = struct.pack("<HHQQ", 1, 16, size, written)
        fh.seek(offset)
        fh.write(struct.pack(
            "<IHHHHHIIIHH", 0x04034B50, version, 0, method, 0, 0x21, crc,
            _Z64 if z64 else written, _Z64 if z64 else size, len(raw_name), len(extra),
        ) + raw_name + extra)
        fh.seek(end)
        fields = b""
        if size >= _Z64:
            fields += struct.pack("<Q", size)
        if written >= _Z64:
            fields += struct.pack("<Q", written)
        if offset >= _Z64:
            fields += struct.pack("<Q", offset)
        cextra = struct.pack("<HH", 1, len(fields)) + fields if fields else b""
        self.central.append(struct.pack(
            "<IHHHHHHIIIHHHHHII", 0x02014B50, version, version, 0, method, 0, 0x21, crc,
            _Z64 if written >= _Z64 else written, _Z64 if size >= _Z64 else size,
            len(raw_name), len(cextra), 0, 0, 0, 0o644 << 16,
            _Z64 if offset >= _Z64 else offset,
        ) + raw_name + cextra)

    def add_bytes(self, name: str, data: bytes, deflate: bool = False) -> None:
        """A small member given whole."""
        self.add(name, [data], len(data), deflate)

    def close(self) -> None:
        """The central directory and the end records (ZIP64 ones where needed)."""
        fh = self.fh
        start = fh.tell()
        for entry in self.central:
            fh.write(entry)
        size = fh.tell() - start
        count = len(self.central)
        if count >= 0xFFFF or start >= _Z64 or size >= _Z64:
            at = fh.tell()
            fh.write(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, count, count,
                                 size, start))
            fh.write(struct.pack("<IIQI", 0x07064B50, 0, at, 1))
            fh.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, _Z64, _Z64, 0))
        else:
            fh.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, count, count, size, start, 0))
        fh.close()


def _fixture_members() -> dict[str, bytes]:
    with zipfile.ZipFile(KERAS_FIXTURE) as zf:
        return {i.filename: zf.read(i) for i in zf.infolist()}


def _pieces(unit: bytes, count: int, per_chunk: int = 1 << 16) -> Iterator[bytes]:
    """``unit`` repeated ``count`` times, in chunks of ``per_chunk`` units."""
    block = unit * per_chunk
    full, rest = divmod(count, per_chunk)
    for _ in range(full):
        yield block
    if rest:
        yield unit * rest


# -- the reproducers ---------------------------------------------------------------------------


def make_keras_config_lists(folder: Path, scale: float = 1.0) -> Path:
    """A ``.keras`` whose ``config.json`` is 63 MiB of nested lists (``[[],[],...]``)."""
    path = folder / "config_lists.keras"
    count = int(63 * MiB * scale) // 3
    members = _fixture_members()
    z = ZipOut(path)
    z.add_bytes("metadata.json", members["metadata.json"])
    z.add("config.json", [b"[", *_pieces(b"[],", count - 1), b"[]]"], 3 * count + 1)
    z.add_bytes("model.weights.h5", members["model.weights.h5"])
    z.close()
    return path


def make_keras_config_deep(folder: Path, scale: float = 1.0) -> Path:
    """A ``.keras`` whose ``config.json`` is 16 MiB of ``[[[[...]]]]``."""
    path = folder / "config_deep.keras"
    depth = int(8 * MiB * scale)
    members = _fixture_members()
    z = ZipOut(path)
    z.add_bytes("metadata.json", members["metadata.json"])
    z.add("config.json", [*_pieces(b"[", depth), *_pieces(b"]", depth)], 2 * depth)
    z.add_bytes("model.weights.h5", members["model.weights.h5"])
    z.close()
    return path


def _torch_records(z: ZipOut) -> None:
    z.add_bytes("archive/byteorder", b"little")
    z.add_bytes("archive/version", b"3\n")


def make_torch_pickle_ops(folder: Path, scale: float = 1.0) -> Path:
    """A torch zip whose ``data.pkl`` is 960 MiB of opcodes: one list, appended 500 ints at a
    time (``MARK``, 500 x ``BININT1``, ``APPENDS``)."""
    path = folder / "pickle_ops.pt"
    block = b"(" + b"K\x01" * 500 + b"e"
    count = int(960 * MiB * scale) // len(block)
    z = ZipOut(path)
    z.add("archive/data.pkl", [b"\x80\x02]", *_pieces(block, count, 64), b"."],
          3 + len(block) * count + 1)
    _torch_records(z)
    z.close()
    return path


def make_torch_pickle_blob(folder: Path, scale: float = 1.0) -> Path:
    """A torch zip whose ``data.pkl`` is one 960 MiB ``BINBYTES8`` (a hole on disk)."""
    path = folder / "pickle_blob.pt"
    n = int(960 * MiB * scale)
    z = ZipOut(path)
    z.add("archive/data.pkl", [b"\x80\x04\x8e" + struct.pack("<Q", n), Zeros(n), b"."],
          3 + 8 + n + 1)
    _torch_records(z)
    z.close()
    return path


def _safetensors(path: Path, header: Iterable[bytes], header_len: int,
                 data: Iterable[bytes | Zeros] = ()) -> None:
    pad = -(8 + header_len) % 8
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", header_len + pad))
        n = 0
        for part in header:
            fh.write(part)
            n += len(part)
        if n != header_len:
            raise ValueError(f"header is {n} bytes, {header_len} declared")
        fh.write(b" " * pad)
        for part in data:
            if isinstance(part, Zeros):
                fh.seek(part.n, os.SEEK_CUR)
            else:
                fh.write(part)
        fh.truncate()


def _entries(count: int, entry: Callable[[int], bytes]) -> tuple[list[bytes], int]:
    """The JSON object of ``count`` entries, in pieces, and its length."""
    pieces, length, batch = [b"{"], 1, []
    for i in range(count):
        batch.append(entry(i))
        if len(batch) == 4096 or i == count - 1:
            piece = b",".join(batch) + (b"," if i < count - 1 else b"")
            pieces.append(piece)
            length += len(piece)
            batch = []
    pieces.append(b"}")
    return pieces, length + 1


def make_safetensors_header(folder: Path, scale: float = 1.0) -> Path:
    """A safetensors file whose 99 MB header lists 1.6M empty tensors (a legal file)."""
    path = folder / "header_empty_tensors.safetensors"
    count = int(1_650_000 * scale)
    pieces, length = _entries(count, lambda i: b'"t%07d":{"dtype":"F32","shape":[0],'
                                               b'"data_offsets":[0,0]}' % i)
    _safetensors(path, pieces, length)
    return path


def make_safetensors_header_lists(folder: Path, scale: float = 1.0) -> Path:
    """A safetensors file whose 99 MB header holds one tensor whose shape is nested lists."""
    path = folder / "header_lists.safetensors"
    count = int(99_000_000 * scale) // 3
    head = b'{"a":{"dtype":"F32","data_offsets":[0,0],"shape":['
    pieces = [head, *_pieces(b"[],", count - 1), b"[]]}}"]
    _safetensors(path, pieces, sum(map(len, pieces)))
    return path


def make_safetensors_many(folder: Path, scale: float = 1.0, dtype: str = "F32") -> Path:
    """A legal safetensors file of 1.2M tensors, each two float32 values of its own."""
    path = folder / "many_tensors.safetensors"
    count = int(1_200_000 * scale)
    pieces, length = _entries(
        count, lambda i: b'"w.%d":{"dtype":"%s","shape":[2],'
                         b'"data_offsets":[%d,%d]}' % (i, dtype.encode(), 8 * i, 8 * i + 8))
    data = (struct.pack(f"<{2 * n}f", *[float(v) for v in range(2 * a, 2 * (a + n))])
            for a, n in ((a, min(65536, count - a)) for a in range(0, count, 65536)))
    _safetensors(path, pieces, length, data)
    return path


def make_safetensors_index(folder: Path, scale: float = 1.0) -> Path:
    """A 99 MB ``model.safetensors.index.json`` naming 2.2M tensors, beside a small shard."""
    sub = folder / "big_index"
    sub.mkdir(exist_ok=True)
    header = b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
    _safetensors(sub / "model.safetensors", [header], len(header), [bytes(8)])
    count = int(2_200_000 * scale)
    pieces, _ = _entries(count, lambda i: b'"model.layers.%07d.w":"model.safetensors"' % i)
    with open(sub / "model.safetensors.index.json", "wb") as fh:
        fh.write(b'{"metadata":{"total_size":8},"weight_map":')
        for p in pieces:
            fh.write(p)
        fh.write(b"}")
    return sub / "model.safetensors.index.json"


def make_npz_members(folder: Path, scale: float = 1.0) -> Path:
    """An ``.npz`` of 200k stored members, each a float32 array of 2 values."""
    path = folder / "many_members.npz"
    header = b"{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }"
    header = header + b" " * (-(10 + len(header) + 1) % 64) + b"\n"
    npy = b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header
    z = ZipOut(path)
    for i in range(int(200_000 * scale)):
        z.add_bytes(f"a{i}.npy", npy + struct.pack("<2f", i, -i))
    z.close()
    return path


def make_keras_bomb_member(folder: Path, scale: float = 1.0) -> Path:
    """A ``.keras`` holding a deflated ``assets/zeros.bin`` that inflates to 4 GiB."""
    path = folder / "bomb_member.keras"
    n = int((4 << 30) * scale)
    members = _fixture_members()
    z = ZipOut(path)
    for name, data in members.items():
        z.add_bytes(name, data)
    z.add("assets/zeros.bin", [Zeros(n)], n, deflate=True)
    z.close()
    return path


def make_keras_bomb_metadata(folder: Path, scale: float = 1.0) -> Path:
    """A ``.keras`` whose deflated ``metadata.json`` inflates to 4 GiB (of zero bytes)."""
    path = folder / "bomb_metadata.keras"
    n = int((4 << 30) * scale)
    members = _fixture_members()
    z = ZipOut(path)
    z.add("metadata.json", [Zeros(n)], n, deflate=True)
    z.add_bytes("config.json", members["config.json"])
    z.add_bytes("model.weights.h5", members["model.weights.h5"])
    z.close()
    return path


def make_keras_bomb_weights(folder: Path, scale: float = 1.0) -> Path:
    """A ``.keras`` whose deflated ``model.weights.h5`` holds a 4 GiB dataset of zeros (made
    with h5py: a contiguous dataset allocated and never written is a hole)."""
    import h5py

    path = folder / "bomb_weights.keras"
    members = _fixture_members()
    h5 = folder / "bomb_weights.h5"
    h5.write_bytes(members["model.weights.h5"])
    n = int((4 << 30) * scale) // 4
    with h5py.File(h5, "a") as f:
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_layout(h5py.h5d.CONTIGUOUS)
        dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
        dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
        group = f.require_group("layers/zeros/vars")
        ds = h5py.h5d.create(group.id, b"0", h5py.h5t.IEEE_F32LE, h5py.h5s.create_simple((n,)),
                             dcpl=dcpl)
        start, nbytes = ds.get_offset(), ds.get_storage_size()
    size = h5.stat().st_size
    with open(h5, "rb") as fh:
        before = fh.read(start)
        fh.seek(start + nbytes)
        after = fh.read()
    h5.unlink()
    z = ZipOut(path)
    z.add_bytes("metadata.json", members["metadata.json"])
    z.add_bytes("config.json", members["config.json"])
    z.add("model.weights.h5", [before, Zeros(nbytes), after], size, deflate=True)
    z.close()
    return path


#: name -> (maker, what it is). The order is the issue's.
REPRODUCERS: dict[str, tuple[Callable[[Path, float], Path], str]] = {
    "keras-config-lists": (make_keras_config_lists, ".keras, config.json of 63 MiB of lists"),
    "keras-config-deep": (make_keras_config_deep, ".keras, config.json 8M lists deep"),
    "torch-pickle-ops": (make_torch_pickle_ops, "torch zip, data.pkl of 960 MiB of opcodes"),
    "torch-pickle-blob": (make_torch_pickle_blob, "torch zip, data.pkl one 960 MiB bytes"),
    "safetensors-header": (make_safetensors_header, "99 MB header of 1.65M empty tensors"),
    "safetensors-header-lists": (make_safetensors_header_lists,
                                 "99 MB header of nested lists"),
    "safetensors-index": (make_safetensors_index, "99 MB model.safetensors.index.json"),
    "safetensors-1.2M": (make_safetensors_many, "1.2M tensors (legal)"),
    "npz-200k": (make_npz_members, ".npz of 200k members"),
    "keras-bomb-member": (make_keras_bomb_member, ".keras, 4 GiB deflate bomb member"),
    "keras-bomb-metadata": (make_keras_bomb_metadata, ".keras, 4 GiB deflated metadata.json"),
    "keras-bomb-weights": (make_keras_bomb_weights, ".keras, 4 GiB zero dataset, deflated"),
}


# -- measuring a run -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """One finished command: exit code (-9 if killed at the timeout), seconds, peak RSS."""

    returncode: int
    seconds: float
    maxrss: int
    stdout: str
    stderr: str

    @property
    def timed_out(self) -> bool:
        """Whether it was killed at its timeout."""
        return self.returncode == -signal.SIGKILL


#: Runs ``modelsize ARGS`` and, at exit, writes the process's own peak RSS (``VmHWM``: Linux
#: carries ``ru_maxrss`` over from the parent across fork and exec) to the file named by
#: ``MODELSIZE_HWM_FILE``.
_CLI = """
import atexit, os, sys
def _hwm():
    try:
        with open("/proc/self/status") as fh:
            kib = next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return
    with open(os.environ["MODELSIZE_HWM_FILE"], "w") as out:
        out.write(str(kib * 1024))
atexit.register(_hwm)
from modelsize.cli import main
sys.exit(main(sys.argv[1:]))
"""


def measure(args: list[str], timeout: float, env: dict[str, str] | None = None) -> Run:
    """Run ``modelsize ARGS`` in a fresh Python; its peak RSS is its own ``VmHWM`` (or, where
    there is no ``/proc``, ``ru_maxrss`` from ``os.wait4``)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="modelsize-measure-") as tmp:
        hwm = Path(tmp) / "hwm"
        child_env = dict(os.environ if env is None else env, MODELSIZE_HWM_FILE=str(hwm))
        with open(Path(tmp) / "out", "w+b") as out, open(Path(tmp) / "err", "w+b") as err:
            t0 = time.perf_counter()
            proc = subprocess.Popen([sys.executable, "-c", _CLI, *args], stdout=out,
                                    stderr=err, env=child_env)
            deadline = t0 + timeout
            while True:
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    break
                if time.perf_counter() > deadline:
                    proc.kill()
                    pid, status, usage = os.wait4(proc.pid, 0)
                    break
                time.sleep(0.02)
            seconds = time.perf_counter() - t0
            proc.returncode = os.waitstatus_to_exitcode(status)  # Popen must not wait again
            maxrss = int(hwm.read_text()) if hwm.exists() else usage.ru_maxrss * 1024
            out.seek(0)
            err.seek(0)
            return Run(proc.returncode, seconds, maxrss, out.read().decode("utf-8", "replace"),
                       err.read().decode("utf-8", "replace"))


def main(argv: list[str] | None = None) -> int:
    """Write every reproducer into a folder."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--only", action="append", choices=sorted(REPRODUCERS))
    args = parser.parse_args(argv)
    args.folder.mkdir(parents=True, exist_ok=True)
    for name, (make, what) in REPRODUCERS.items():
        if args.only and name not in args.only:
            continue
        t0 = time.perf_counter()
        path = make(args.folder, args.scale)
        size = (sum(p.stat().st_size for p in path.parent.iterdir())
                if path.parent != args.folder else path.stat().st_size)
        print(json.dumps({"case": name, "path": str(path), "bytes": size,
                          "seconds": round(time.perf_counter() - t0, 2), "what": what}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
