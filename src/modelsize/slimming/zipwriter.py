"""A streaming zip writer whose every byte is known before it writes one.

Members are stored (or deflated, for ``np.savez_compressed`` outputs), data optionally aligned
(torch aligns storages to 64 bytes with padding in the local header's extra field, as
PyTorch's own writer does), ZIP64 records used exactly where sizes or offsets need them. The
CRC-32 of a stored member is computed as its bytes stream through and patched into the local
header afterwards; :func:`plan_sizes` gives the archive's size for a dry run without writing.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

from modelsize.slimming.checksum import crc32

_LOCAL = struct.Struct("<IHHHHHIIIHH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_EOCD = struct.Struct("<IHHHHIIH")
_EOCD64 = struct.Struct("<IQHHIIQQQQ")
_LOCATOR64 = struct.Struct("<IIQI")
_Z64 = 0xFFFFFFFF
#: A fixed DOS date/time (1980-01-01 00:00), as torch writes: outputs are reproducible.
_DOS_TIME, _DOS_DATE = 0, (0 << 9) | (1 << 5) | 1
_PAD_ID = 0x4246  # "FB": the extra-field id PyTorch uses for alignment padding


@dataclass
class Member:
    """One member to write: ``nbytes`` of data (uncompressed), stored or deflated."""

    name: str
    nbytes: int
    align: int = 0
    deflate: bool = False
    # Filled while writing.
    header_offset: int = 0
    data_offset: int = 0
    compressed: int = 0
    crc: int = 0

    @property
    def encoded_name(self) -> bytes:
        """The name as stored (UTF-8)."""
        return self.name.encode("utf-8")


def _needs64(m: Member) -> bool:
    return m.nbytes >= _Z64 or m.compressed >= _Z64 or m.header_offset >= _Z64


def local_extra(m: Member, at: int) -> bytes:
    """Extra field of the local header written at offset ``at``: ZIP64 sizes, alignment."""
    extra = b""
    if m.nbytes >= _Z64 or (m.deflate and m.nbytes >= _Z64 // 2):
        extra += struct.pack("<HHQQ", 0x0001, 16, m.nbytes, 0)
    if m.align:
        start = at + _LOCAL.size + len(m.encoded_name) + len(extra)
        pad = (-(start + 4)) % m.align
        extra += struct.pack("<HH", _PAD_ID, pad) + b"Z" * pad
    return extra


def _central_extra(m: Member) -> bytes:
    fields = b""
    if m.nbytes >= _Z64:
        fields += struct.pack("<Q", m.nbytes)
    if m.compressed >= _Z64:
        fields += struct.pack("<Q", m.compressed)
    if m.header_offset >= _Z64:
        fields += struct.pack("<Q", m.header_offset)
    return struct.pack("<HH", 0x0001, len(fields)) + fields if fields else b""


class ZipWriter:
    """Writes members one after the other to a seekable binary file."""

    def __init__(self, fh: BinaryIO) -> None:
        self.fh = fh
        self.members: list[Member] = []
        self.pos = fh.tell()

    def write_member(self, member: Member, chunks: Iterable[bytes | memoryview] | None,
                     crc: Callable[[], int] | None = None,
                     fill: Callable[[BinaryIO], int] | None = None) -> Member:
        """Write one member's header and data; returns it with offsets, size and CRC filled.

        ``crc`` returns the data's CRC-32 once ``chunks`` are consumed, when the caller already
        computes it (a stored member's bytes are then checksummed once, not twice); with it,
        ``fill(fh)`` may write the data itself (and return its length) instead of ``chunks``.
        """
        m = member
        m.header_offset = self.pos
        extra = local_extra(m, m.header_offset)
        header = self.local_header(m, extra, crc=0, compressed=0)
        self.fh.write(header)
        m.data_offset = m.header_offset + len(header)
        value, written = 0, 0
        if m.deflate:
            comp = zlib.compressobj(6, zlib.DEFLATED, -15)
            out = 0
            for chunk in chunks or ():
                value = crc32(chunk, value)
                written += len(chunk)
                data = comp.compress(chunk)
                self.fh.write(data)
                out += len(data)
            data = comp.flush()
            self.fh.write(data)
            m.compressed = out + len(data)
        elif fill is not None and crc is not None:
            written = fill(self.fh)
            m.compressed = written
        elif crc is not None:
            for chunk in chunks or ():
                written += len(chunk)
                self.fh.write(chunk)
            m.compressed = written
        else:
            for chunk in chunks or ():
                value = crc32(chunk, value)
                written += len(chunk)
                self.fh.write(chunk)
            m.compressed = written
        if written != m.nbytes:
            raise ValueError(f"member {m.name}: planned {m.nbytes} bytes, wrote {written}")
        m.crc = crc() if crc is not None and not m.deflate else value
        crc_value = m.crc
        end = m.data_offset + m.compressed
        # Patch the CRC and sizes into the local header now that they are known.
        self.fh.seek(m.header_offset)
        self.fh.write(self.local_header(m, extra, crc=crc_value, compressed=m.compressed))
        self.fh.seek(end)
        self.pos = end
        self.members.append(m)
        return m

    def local_header(self, m: Member, extra: bytes, crc: int, compressed: int) -> bytes:
        z64 = bool(extra[:2] == b"\x01\x00")
        if z64:
            extra = struct.pack("<HHQQ", 0x0001, 16, m.nbytes, compressed) + extra[20:]
        version = 45 if z64 else 20
        return _LOCAL.pack(
            0x04034B50, version, 0x0800, 8 if m.deflate else 0, _DOS_TIME, _DOS_DATE, crc,
            _Z64 if z64 else compressed, _Z64 if z64 else m.nbytes,
            len(m.encoded_name), len(extra),
        ) + m.encoded_name + extra

    def close(self) -> None:
        """Write the central directory and its end records."""
        start = self.pos
        for m in self.members:
            extra = _central_extra(m)
            z64 = bool(extra)
            self.fh.write(_CENTRAL.pack(
                0x02014B50, 45 if z64 else 20, 45 if z64 else 20, 0x0800, 8 if m.deflate else 0,
                _DOS_TIME, _DOS_DATE, m.crc,
                _Z64 if m.compressed >= _Z64 else m.compressed,
                _Z64 if m.nbytes >= _Z64 else m.nbytes,
                len(m.encoded_name), len(extra), 0, 0, 0, 0o644 << 16,
                _Z64 if m.header_offset >= _Z64 else m.header_offset,
            ) + m.encoded_name + extra)
        end = self.fh.tell()
        self.fh.write(_end_records(len(self.members), end - start, start))
        self.pos = self.fh.tell()


def _end_records(count: int, cd_size: int, cd_start: int) -> bytes:
    out = b""
    if count >= 0xFFFF or cd_size >= _Z64 or cd_start >= _Z64:
        eocd64_at = cd_start + cd_size
        out += _EOCD64.pack(0x06064B50, 44, 45, 45, 0, 0, count, count, cd_size, cd_start)
        out += _LOCATOR64.pack(0x07064B50, 0, eocd64_at, 1)
        return out + _EOCD.pack(0x06054B50, 0, 0, min(count, 0xFFFF), min(count, 0xFFFF),
                                _Z64, _Z64, 0)
    return out + _EOCD.pack(0x06054B50, 0, 0, count, count, cd_size, cd_start, 0)


def plan_sizes(members: Iterable[Member]) -> int:
    """The archive's exact size for stored members (what :class:`ZipWriter` will write)."""
    pos = 0
    done: list[Member] = []
    for member in members:
        if member.deflate:
            raise ValueError("the size of a deflated member is not known before writing")
        m = Member(member.name, member.nbytes, member.align)
        m.header_offset = pos
        extra = local_extra(m, pos)
        m.compressed = m.nbytes
        pos += _LOCAL.size + len(m.encoded_name) + len(extra) + m.nbytes
        done.append(m)
    cd = sum(_CENTRAL.size + len(m.encoded_name) + len(_central_extra(m)) for m in done)
    return pos + cd + len(_end_records(len(done), cd, pos))


def chunks_of(data: bytes) -> Iterator[bytes]:
    """A small in-memory member's data as one chunk."""
    yield data
