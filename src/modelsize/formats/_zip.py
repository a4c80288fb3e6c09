"""Zip archives read from their central directory, without trusting or extracting anything.

Shared by every zip-based format (PyTorch, NumPy ``.npz``, Keras ``.keras``). Member data is
located through each local header, checked against the file size, and read raw (a
data-descriptor flag does not hide a member's contents). A member flagged encrypted, strongly
encrypted or patched is refused: torch's miniz ("unsupported encryption") and Python's
:mod:`zipfile` (so ``np.load`` and Keras) refuse to read it.

Every member modelsize reads (:func:`read_member`) or charges to ``graph`` or ``metadata``
without reading it (:func:`check_members`) is checked against the CRC-32 of the central
directory: a flipped byte in a pickle or a JSON config would otherwise be reported as a
healthy file. Tensor payloads are never read, so never checked. A CRC of 0 on a non-empty
member means none was recorded (``torch.save`` with ``compute_crc32=False`` writes 0 for
every member, and torch loads such files): :func:`crc_recorded` tells readers to say so.
"""

from __future__ import annotations

import mmap
import os
import struct
import sys
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, NamedTuple

from modelsize._extensions import compiled
from modelsize.categories import Category
from modelsize.errors import CorruptFileError
from modelsize.formats import _limits
from modelsize.inventory import InventoryBuilder

if TYPE_CHECKING:
    from modelsize.formats._pickle import Data

_LOCAL = struct.Struct("<4sHHHHHIIIHH")
#: The end of central directory record: signature, disk numbers, entries on this disk and in
#: all, the directory's size and offset, the comment's length.
_EOCD = struct.Struct("<4sHHHHIIH")
#: The local header's name and extra field lengths (its last fields, at byte 26).
_NAME_EXTRA = struct.Struct("<HH")
_LOCAL_MAGIC = b"PK\x03\x04"
#: General-purpose flag bits no framework's zip reader reads past: encrypted (0), compressed
#: patched data (5), strong encryption (6), masked local headers (13).
_UNREADABLE_FLAGS = {0x1: "encrypted", 0x20: "compressed patched data",
                     0x40: "strongly encrypted", 0x2000: "with masked local headers"}
_UNREADABLE_MASK = sum(_UNREADABLE_FLAGS)
#: ``zipfile.ZIP_STORED`` and ``ZIP_DEFLATED`` (the zip format's numbers). :mod:`zipfile` is
#: imported only when an archive needs it (an error to raise, an unusual end record): with
#: shutil, bz2, lzma and threading it is 6 ms of an 0.15 s ``inspect``.
STORED = 0
DEFLATED = 8
#: Deflate cannot expand data more than ~1032:1; a member claiming more is lying.
_MAX_RATIO = 1100
#: Bytes read (or inflated) at a time when a member is only checked, not kept.
_CHUNK = 1 << 20


class Entry(NamedTuple):
    """One central directory record: the fields of :class:`zipfile.ZipInfo` modelsize reads,
    with the same names (a tuple, made ten times faster than a ``ZipInfo``, and a third of its
    memory: an archive of 100,000 members is read in half the time)."""

    filename: str
    orig_filename: str
    header_offset: int
    compress_size: int
    file_size: int
    compress_type: int
    CRC: int
    flag_bits: int
    volume: int


#: A central directory record's fixed part (``zipfile.structCentralDir``).
_CENTRAL = struct.Struct("<4s4B4HL2L5H2L")
#: ``zipfile.MAX_EXTRACT_VERSION`` (6.3; tests check it against this Python's zipfile).
_MAX_EXTRACT_VERSION = 63
_ZIP64_MASKED = (0xFFFF_FFFF_FFFF_FFFF, 0xFFFF_FFFF)


def directory(path: Path | str | IO[bytes]) -> list[Entry]:
    """The central directory of the zip archive at ``path`` (or in a seekable binary file),
    read as :mod:`zipfile` reads it.

    What ``zipfile.ZipFile(path).infolist()`` gives, record for record (the same end record
    search, the same "concat" offset for bytes before the archive, the same name decoding and
    truncation at a NUL, the same ZIP64 extra fields), and the same exceptions where it fails
    (:class:`zipfile.BadZipFile`, ``NotImplementedError`` on a version past what it reads,
    ``UnicodeDecodeError`` on a name that is not UTF-8). The end record is found by
    :func:`_end_record`, zipfile's search.
    """
    if not isinstance(path, (str, os.PathLike)):
        return _directory(path)
    with open(path, "rb") as fp:
        return _directory(fp)


def bad_zip(message: str) -> Exception:
    """``zipfile.BadZipFile(message)`` (zipfile imported now: errors are rare)."""
    import zipfile

    return zipfile.BadZipFile(message)


class _NeverRaised(Exception):
    """Matches nothing: what :func:`bad_zip_class` gives before zipfile is imported."""


def bad_zip_class() -> type[Exception]:
    """``zipfile.BadZipFile`` for an ``except`` clause, without importing zipfile: until it is
    imported, nothing can have raised it."""
    module = sys.modules.get("zipfile")
    return _NeverRaised if module is None else module.BadZipFile  # type: ignore[no-any-return]


#: The ZIP64 end record's locator and the record (zipfile's ``structEndArchive64Locator`` and
#: ``structEndArchive64``); ``_EOCD`` is its ``structEndArchive``.
_ZIP64_LOCATOR = struct.Struct("<4sLQL")
_ZIP64_EOCD = struct.Struct("<4sQ2H2L4Q")


def _end_record(fp: IO[bytes]) -> list[Any] | None:
    """``zipfile._EndRecData(fp)`` without importing zipfile, for the archives every writer
    makes: the end record is the file's last 22 bytes (no comment), and a ZIP64 locator, if
    any, is just before it with a well-formed ZIP64 end record before that. Anything else
    (a comment, a truncated or spanned ZIP64 record, a file too short) goes to zipfile's own
    search, so every archive gets zipfile's answer (``test_zip_directory`` checks both on
    every fixture and on mutated archives)."""
    fp.seek(0, 2)
    filesize = fp.tell()
    eocd = _EOCD.size
    tail = _ZIP64_LOCATOR.size + _ZIP64_EOCD.size + eocd
    if filesize >= tail:
        fp.seek(filesize - tail)
        data = fp.read(tail)
        if len(data) == tail and data[-eocd:-eocd + 4] == b"PK\x05\x06" and data[-2:] == b"\0\0":
            endrec: list[Any] = list(_EOCD.unpack_from(data, tail - eocd))
            endrec.append(b"")
            endrec.append(filesize - eocd)
            loc = _ZIP64_LOCATOR.unpack_from(data, _ZIP64_EOCD.size)
            if loc[0] != b"PK\x06\x07":
                return endrec
            _sig, diskno, _reloff, disks = loc
            if diskno == 0 and disks <= 1:
                rec = _ZIP64_EOCD.unpack_from(data, 0)
                if rec[0] == b"PK\x06\x06":
                    # zipfile's update of the end record from the ZIP64 one.
                    endrec[0], endrec[1], endrec[2] = rec[0], rec[4], rec[5]
                    endrec[3], endrec[4], endrec[5], endrec[6] = rec[6], rec[7], rec[8], rec[9]
                    return endrec
    import zipfile

    found: list[Any] | None = zipfile._EndRecData(fp)  # type: ignore[attr-defined]
    return found


def _directory(fp: IO[bytes]) -> list[Entry]:
    try:
        endrec = _end_record(fp)
    except OSError:
        raise bad_zip("File is not a zip file") from None
    if not endrec:
        raise bad_zip("File is not a zip file")
    # zipfile's end record: [0] its signature, [5] the directory's size, [6] its offset,
    # [9] where the record lies.
    size_cd, offset_cd = endrec[5], endrec[6]
    concat = endrec[9] - size_cd - offset_cd
    if endrec[0] == b"PK\x06\x06":  # ZIP64: its end record (56 B) and locator (20 B)
        concat -= 56 + 20
    start_dir = offset_cd + concat
    if start_dir < 0:
        raise bad_zip("Bad offset for central directory")
    # Read as the walk goes, a few MiB at a time: what zipfile reads whole at once, so
    # a directory size that lies (3 GB claimed by a 3 GB file of zeros) costs the records
    # walked before it fails, not the bytes claimed.
    fp.seek(0, 2)
    have = max(0, min(size_cd, fp.tell() - start_dir))
    data, base = b"", 0  # the window: bytes base .. base + len(data) of the directory
    out: list[Entry] = []
    unpack = _CENTRAL.unpack_from
    fixed = _CENTRAL.size
    p = total = 0
    records = _central_records
    while total < size_cd:
        end = base + len(data)
        if end - p < _RECORD_MAX and end < have:
            fp.seek(start_dir + end)
            more = fp.read(min(max(_CD_CHUNK, _RECORD_MAX), have - end))
            data, base = data[p - base :] + more, p
            if not more:  # (the file shrank while it was read)
                have = end
        if records is not None:
            # The compiled loop takes the records that lie in the window and would not raise
            # (see _headers.c); this loop the one it stops before.
            q, took = records(data, p - base, have - base, size_cd - total, concat, out)
            p, total = base + q, total + took
            if total >= size_cd:
                break
            if took:
                continue
        if p + fixed > have:
            raise bad_zip("Truncated central directory")
        q = p - base
        (sig, _cv, _cs, extract_version, _r, flags, method, _t, _d, crc, compress_size,
         file_size, n, x, c, volume, _ia, _ea, header_offset) = unpack(data, q)
        if sig != b"PK\x01\x02":
            raise bad_zip("Bad magic number for central directory")
        q += fixed
        raw_name = data[q : q + n]
        orig = raw_name.decode("utf-8" if flags & 0x800 else "cp437")
        if extract_version > _MAX_EXTRACT_VERSION:
            raise NotImplementedError(f"zip file version {extract_version / 10:.1f}")
        if x:
            file_size, compress_size, header_offset = _zip64_extra(
                data[q + n : q + n + x], file_size, compress_size, header_offset)
        p = min(p + fixed + n + x + c, have)
        nul = orig.find("\0")
        name = orig if nul < 0 else orig[:nul]
        out.append(Entry(name, orig, header_offset + concat, compress_size, file_size,
                         method, crc, flags, volume))
        total += fixed + n + x + c
    return out


#: The longest central directory record: the fixed part and a name, an extra field and a
#: comment of 65,535 bytes each.
_RECORD_MAX = 46 + 3 * 0xFFFF
#: Bytes of a central directory read at a time.
_CD_CHUNK = 4 << 20


def _zip64_extra(extra: bytes, file_size: int, compress_size: int,
                 header_offset: int) -> tuple[int, int, int]:
    """The sizes and offset a ZIP64 extra field gives, as ``ZipInfo._decodeExtra`` reads them
    (every field walked: a field running past the extra is refused wherever it is)."""
    while len(extra) >= 4:
        tp, ln = _NAME_EXTRA.unpack_from(extra)
        if ln + 4 > len(extra):
            raise bad_zip(f"Corrupt extra field {tp:04x} (size={ln})")
        if tp == 0x0001:
            data = extra[4 : ln + 4]
            field = ""
            try:
                if file_size in _ZIP64_MASKED:
                    field = "File size"
                    (file_size,) = _U64.unpack(data[:8])
                    data = data[8:]
                if compress_size == 0xFFFF_FFFF:
                    field = "Compress size"
                    (compress_size,) = _U64.unpack(data[:8])
                    data = data[8:]
                if header_offset == 0xFFFF_FFFF:
                    field = "Header offset"
                    (header_offset,) = _U64.unpack(data[:8])
            except struct.error:
                raise bad_zip(
                    f"Corrupt zip64 extra field. {field} not found.") from None
        extra = extra[ln + 4 :]
    return file_size, compress_size, header_offset


_U64 = struct.Struct("<Q")

_compiled = compiled("_headers")
_central_records = _check_records = _local_headers = None


class Member(NamedTuple):
    """One archive member: where its header and data lie.

    A named tuple, not a dataclass: checkpoints have thousands of members, and a tuple is made
    several times faster.
    """

    name: str
    header_offset: int
    data_offset: int
    compress_size: int
    file_size: int
    method: int
    crc: int

    @property
    def header_nbytes(self) -> int:
        """Bytes of the local header (plus name and extra field)."""
        return self.data_offset - self.header_offset


def members(
    path: Path,
    builder: InventoryBuilder,
    file: int = 0,
    infos: list[Entry] | None = None,
    names: bool = False,
) -> list[Member]:
    """All members with their data offsets, each checked to lie inside the file.

    ``infos`` is the central directory if the caller already parsed it
    (:meth:`~modelsize.formats.base.Source.zip_infos`); it is read from ``path`` otherwise.
    With ``names``, each local header must name its member as the central directory does:
    Python's :mod:`zipfile` (so ``np.load`` and Keras) refuses to open a member otherwise.
    """
    size = builder.files[file].nbytes
    if infos is None:
        try:
            infos = directory(path)
        except bad_zip_class() as exc:
            raise builder.corrupt(
                f"zip central directory unreadable ({exc})", None, file
            ) from exc
    out: list[Member] = []
    local_size = _LOCAL.size
    with open(path, "rb", buffering=0) as fh:
        fd = fh.fileno()
        _check_directory(fd, size, len(infos), builder, file)
        window = _Window(fd, [info.header_offset for info in infos])
        headers = _local_headers if type(infos) is list else None
        i = 0
        while i < len(infos):
            if headers is not None:
                # The members whose local headers lie in the window and pass every check below,
                # compiled (_headers.c); this loop takes the one it stops before.
                i = headers(window.buf, window.start, infos, i, size, names, _UNREADABLE_MASK,
                            out, fd)
                if i == len(infos):
                    break
            info = infos[i]
            i += 1
            header = info.header_offset
            if info.flag_bits & _UNREADABLE_MASK:
                flagged = [w for bit, w in _UNREADABLE_FLAGS.items() if info.flag_bits & bit]
                raise builder.corrupt(
                    f"member {info.filename!r} is marked {flagged[0]} (flags "
                    f"{info.flag_bits:#06x}): its framework's zip reader refuses it", header, file,
                )
            if not 0 <= header <= size - local_size:
                raise builder.corrupt(
                    f"member {info.filename!r} header at {header} is outside "
                    f"the file ({size} bytes)", header, file
                )
            raw = window.read(i - 1, local_size)
            if len(raw) < local_size or raw[:4] != _LOCAL_MAGIC:
                raise builder.corrupt(
                    f"member {info.filename!r}: no local header at {header}", header, file,
                )
            name_len, extra_len = _NAME_EXTRA.unpack_from(raw, 26)
            data_offset = header + local_size + name_len + extra_len
            if names:
                _check_local_name(window.read(i - 1, local_size + name_len)[local_size:], info,
                                  builder, file)
            compress_size, file_size, method = (
                info.compress_size, info.file_size, info.compress_type
            )
            if data_offset + compress_size > size:  # sizes from zipfile are never < 0
                builder.check_range(
                    data_offset, compress_size, f"member {info.filename!r}", file
                )
            if method == STORED and file_size != compress_size:
                raise builder.corrupt(
                    f"stored member {info.filename!r} claims {file_size} bytes "
                    f"but occupies {compress_size}", header, file,
                )
            if file_size > max(compress_size, 1) * _MAX_RATIO:
                raise builder.corrupt(
                    f"member {info.filename!r} claims to inflate {compress_size} bytes "
                    f"to {file_size}", header, file,
                )
            out.append(
                Member(info.filename, header, data_offset, compress_size, file_size, method,
                       info.CRC)
            )
    return out


def _check_directory(fd: int, size: int, count: int, builder: InventoryBuilder,
                     file: int) -> None:
    """Each central directory record, its name, extra field and comment included, lies inside
    the directory: torch's miniz refuses the archive otherwise ("invalid header or archive is
    corrupted"), where :mod:`zipfile` reads a short name and goes on."""
    room = min(size, _EOCD.size + 0xFFFF + 20)
    tail = os.pread(fd, room, size - room)
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or at + _EOCD.size > len(tail):
        return  # zipfile found the directory another way: nothing to add
    end = size - room + at
    cd_size = _EOCD.unpack_from(tail, at)[5]
    locator = tail.rfind(b"PK\x06\x07", 0, at)
    if locator >= 0 and at - locator == 20:  # zip64: the directory ends at its end record
        end = int.from_bytes(tail[locator + 8 : locator + 16], "little")
        record = os.pread(fd, 56, end) if 0 <= end <= size - 56 else b""
        if record[:4] != b"PK\x06\x06":
            return
        cd_size = int.from_bytes(record[40:48], "little")
    if not 0 <= cd_size <= end:
        return
    # Read as the walk goes (the sizes of this end record are not the ones zipfile used, and
    # may lie): what is read is what the records walked cover, a few MiB ahead.
    start = end - cd_size
    raw, base = b"", 0  # the window: bytes base .. base + len(raw) of the directory
    p = 0
    i = 0
    walk = _check_records
    while i < count:
        if base + len(raw) - p < _RECORD_MAX and base + len(raw) < cd_size:
            at = base + len(raw)
            raw = raw[p - base :] + os.pread(fd, min(max(_CD_CHUNK, _RECORD_MAX), cd_size - at),
                                             start + at)
            base = p
        q = p - base
        if walk is not None:  # the records that lie in the window, compiled (_headers.c)
            q, walked = walk(raw, q, count - i)
            p, i = base + q, i + walked
            if i == count:
                break
            if walked:
                continue
        if q + 46 > len(raw) or raw[q : q + 4] != b"PK\x01\x02":
            raise builder.corrupt(f"central directory record {i} is not where the one before "
                                  "it ends (torch's zip reader refuses the archive)",
                                  start + p, file)
        n, x, c = struct.unpack_from("<HHH", raw, q + 28)
        if q + 46 + n + x + c > len(raw):
            name = raw[q + 46 : q + 46 + min(n, 80)]
            raise builder.corrupt(
                f"central directory record of {name!r} declares a {n}-byte name, a {x}-byte "
                f"extra field and a {c}-byte comment, past the directory's end (torch's zip "
                "reader refuses the archive)", start + p, file)
        p += 46 + n + x + c
        i += 1


class _Window:
    """The local headers of a zip's members, read in few syscalls where they lie close together.

    One ``pread`` per header costs 0.3 s at 100,000 small members (a ``torch.save`` of many
    small tensors). Where the next headers start within :data:`_GAP` bytes of each other, one
    read takes them all (and the few bytes of data between them), up to :data:`_SPAN` bytes;
    a header far from the next one is read alone, as before: what is read beyond the headers
    is bounded by ``_GAP`` a member, never a large tensor's bytes.
    """

    def __init__(self, fd: int, offsets: list[int]) -> None:
        self.fd = fd
        self.offsets = offsets
        self.start = -1
        self.stop = -1
        self.buf = b""

    def read(self, i: int, n: int) -> bytes:
        """``n`` bytes at the ``i``-th member's local header."""
        at = self.offsets[i]
        start = self.start
        if start <= at and at + n <= self.stop:
            return self.buf[at - start : at - start + n]
        end = at + max(n, _HEAD)
        offsets = self.offsets
        j = i + 1
        while (j < len(offsets) and 0 <= offsets[j] - offsets[j - 1] <= _GAP
               and offsets[j] + _HEAD - at <= _SPAN):
            end = offsets[j] + _HEAD
            j += 1
        self.start, self.buf = at, os.pread(self.fd, end - at, at)
        self.stop = at + len(self.buf)
        return self.buf[:n]


#: Bytes read at a header: the fixed part and a name of up to 226 bytes (torch's member names
#: are ``archive/data/123``); a longer name is read again by itself.
_HEAD = 256
#: Headers closer than this to the one before are read together...
_GAP = 4096
#: ...in reads of at most this many bytes.
_SPAN = 1 << 20


def _check_local_name(local: bytes, info: Entry,
                      builder: InventoryBuilder, file: int) -> None:
    """Refuse a local header whose name is not the central directory's (as zipfile does)."""
    encoding = "utf-8" if info.flag_bits & 0x800 else "cp437"
    try:
        same = local.decode(encoding) == info.orig_filename
    except UnicodeDecodeError:
        same = False
    if not same:
        raise builder.corrupt(
            f"member {info.filename!r} is named {local[:80]!r} in its local header: zipfile "
            "(and so its framework's loader) refuses to open it", info.header_offset, file,
        )


def crc_recorded(member: Member) -> bool:
    """Whether the archive records a CRC-32 for ``member`` (0 on a non-empty member: none)."""
    return member.crc != 0 or member.file_size == 0


def _check_crc(member: Member, crc: int, builder: InventoryBuilder, file: int) -> None:
    if crc != member.crc and crc_recorded(member):
        raise builder.corrupt(
            f"member {member.name!r} is corrupted: its bytes have CRC-32 {crc:#010x} where the "
            f"archive records {member.crc:#010x} (the file was damaged after it was written: "
            "copy or download it again)", member.data_offset, file,
        )


def _unsupported(member: Member, builder: InventoryBuilder, file: int) -> CorruptFileError:
    return builder.corrupt(
        f"member {member.name!r} uses compression method {member.method}; modelsize reads "
        "stored and deflated members", member.header_offset, file,
    )


def _bad_size(member: Member, size: int, builder: InventoryBuilder, file: int) -> CorruptFileError:
    return builder.corrupt(
        f"member {member.name!r} inflates to {size} bytes, header says {member.file_size}",
        member.data_offset, file,
    )


def read_member(
    path: Path, member: Member, builder: InventoryBuilder,
    limit: _limits.Limit = _limits.READ_BYTES, file: int = 0,
) -> bytes:
    """The uncompressed bytes of a member (stored or deflated), checked against the member's
    CRC-32; one larger than ``limit`` is refused (the message names how to raise it)."""
    limit.check(builder.files[file].path, member.file_size, f"member {member.name!r}")
    if member.method not in (STORED, DEFLATED):
        raise _unsupported(member, builder, file)
    if member.method == DEFLATED:
        _limits.check_inflate(builder.files[file].path, member.name, member.compress_size,
                              member.file_size)
    with open(path, "rb") as fh:
        fh.seek(member.data_offset)
        data = fh.read(member.compress_size)
    if member.method == DEFLATED:
        d = zlib.decompressobj(-15)
        try:
            data = d.decompress(data, member.file_size + 1)
        except zlib.error as exc:
            raise builder.corrupt(
                f"member {member.name!r} does not inflate ({exc})", member.data_offset, file
            ) from exc
        if len(data) != member.file_size:
            raise _bad_size(member, len(data), builder, file)
    _check_crc(member, zlib.crc32(data), builder, file)
    return data


def pickle_data(path: Path, member: Member, builder: InventoryBuilder, file: int = 0,
                ) -> tuple[Data, int, int]:
    """A pickle member to parse: ``(data, start, end)``, the pickle being ``data[start:end]``.

    A stored member is parsed in place, in a read-only map of the file (offsets in it are the
    file's; nothing is copied, and only the pages the parser touches are read); a deflated one
    is inflated to memory, up to ``MODELSIZE_MAX_READ_BYTES``. A stored member is checked
    against its CRC-32 a chunk at a time, as members charged but not read are.
    """
    if member.method == STORED:
        check_members(path, [member], builder, file)
        with open(path, "rb") as fh:
            if member.compress_size == 0:
                return b"", 0, 0
            mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        return mm, member.data_offset, member.data_offset + member.compress_size
    data = read_member(path, member, builder, file=file)
    return data, 0, len(data)


def refuse_duplicates(items: list[Member], builder: InventoryBuilder, why: str,
                      file: int = 0) -> None:
    """Refuse an archive that holds two members of one name (``why``: what its loader does)."""
    seen: set[str] = set()
    for m in items:
        if m.name in seen:
            raise builder.corrupt(f"member {m.name!r} appears twice in the archive ({why})",
                                  m.header_offset, file)
        seen.add(m.name)


def check_members(
    path: Path, items: Iterable[Member], builder: InventoryBuilder, file: int = 0
) -> None:
    """Check members that are charged but not read (code, records, JSON) against their CRC-32,
    a chunk at a time: nothing of them is kept."""
    todo = [m for m in items if crc_recorded(m)]
    if not todo:
        return
    with open(path, "rb") as fh:
        for m in todo:
            if m.method not in (STORED, DEFLATED):
                raise _unsupported(m, builder, file)
            if m.method == DEFLATED:
                _limits.check_inflate(builder.files[file].path, m.name, m.compress_size,
                                      m.file_size)
            fh.seek(m.data_offset)
            crc = size = 0
            left = m.compress_size
            d = zlib.decompressobj(-15)
            try:
                while left:
                    raw = fh.read(min(left, _CHUNK))
                    if not raw:
                        break
                    left -= len(raw)
                    while raw:
                        if m.method == STORED:
                            data, raw = raw, b""
                        else:
                            data = d.decompress(raw, _CHUNK)
                            raw = d.unconsumed_tail
                        size += len(data)
                        if size > m.file_size:
                            raise _bad_size(m, size, builder, file)
                        crc = zlib.crc32(data, crc)
            except zlib.error as exc:
                raise builder.corrupt(
                    f"member {m.name!r} does not inflate ({exc})", m.data_offset, file
                ) from exc
            if size != m.file_size:
                raise _bad_size(m, size, builder, file)
            _check_crc(m, crc, builder, file)


def account_headers(builder: InventoryBuilder, items: list[Member], file: int = 0) -> None:
    """Declare every local header as metadata (the central directory is left to gap filling)."""
    metadata = Category.METADATA
    builder.add_regions(file, ((m.header_offset, m.data_offset - m.header_offset, metadata,
                                f"zip header of {m.name}") for m in items))


if _compiled is not None and hasattr(_compiled, "setup_zip"):  # (not an older build of it)
    _compiled.setup_zip(Entry, Member, _MAX_EXTRACT_VERSION)
    _central_records = _compiled.central_records
    _check_records = _compiled.check_records
    _local_headers = _compiled.local_headers
