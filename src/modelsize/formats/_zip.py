"""Zip archives read from their central directory, without trusting or extracting anything.

Shared by every zip-based format (PyTorch, NumPy ``.npz``, Keras ``.keras``). Member data is
located through each local header, checked against the file size, and read raw: encryption
or data-descriptor flags that would make :mod:`zipfile` refuse a member do not hide its
contents from us (loaders such as torch's ignore them too).
"""

from __future__ import annotations

import struct
import zipfile
import zlib
from pathlib import Path
from typing import NamedTuple

from modelsize.categories import Category
from modelsize.inventory import InventoryBuilder

_LOCAL = struct.Struct("<4sHHHHHIIIHH")
#: The local header's name and extra field lengths (its last fields, at byte 26).
_NAME_EXTRA = struct.Struct("<HH")
_LOCAL_MAGIC = b"PK\x03\x04"
STORED = zipfile.ZIP_STORED
DEFLATED = zipfile.ZIP_DEFLATED
#: Deflate cannot expand data more than ~1032:1; a member claiming more is lying.
_MAX_RATIO = 1100
#: Members we read whole (pickles, JSON headers) are never allowed past this.
MAX_READ = 1 << 30


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
    infos: list[zipfile.ZipInfo] | None = None,
) -> list[Member]:
    """All members with their data offsets, each checked to lie inside the file.

    ``infos`` is the central directory if the caller already parsed it
    (:meth:`~modelsize.formats.base.Source.zip_infos`); it is read from ``path`` otherwise.
    """
    size = builder.files[file].nbytes
    if infos is None:
        try:
            with zipfile.ZipFile(path) as zf:
                infos = zf.infolist()
        except zipfile.BadZipFile as exc:
            raise builder.corrupt(
                f"zip central directory unreadable ({exc})", None, file
            ) from exc
    out: list[Member] = []
    # Unbuffered: each header is one small read at a far offset, a buffer would only cost.
    with open(path, "rb", buffering=0) as fh:
        for info in infos:
            if not 0 <= info.header_offset <= size - _LOCAL.size:
                raise builder.corrupt(
                    f"member {info.filename!r} header at {info.header_offset} is outside "
                    f"the file ({size} bytes)", info.header_offset, file
                )
            fh.seek(info.header_offset)
            raw = fh.read(_LOCAL.size)
            if len(raw) < _LOCAL.size or raw[:4] != _LOCAL_MAGIC:
                raise builder.corrupt(
                    f"member {info.filename!r}: no local header at {info.header_offset}",
                    info.header_offset, file,
                )
            name_len, extra_len = _NAME_EXTRA.unpack_from(raw, 26)
            data_offset = info.header_offset + _LOCAL.size + name_len + extra_len
            if data_offset + info.compress_size > size:  # sizes from zipfile are never < 0
                builder.check_range(
                    data_offset, info.compress_size, f"member {info.filename!r}", file
                )
            if info.compress_type == STORED and info.file_size != info.compress_size:
                raise builder.corrupt(
                    f"stored member {info.filename!r} claims {info.file_size} bytes "
                    f"but occupies {info.compress_size}", info.header_offset, file,
                )
            if info.file_size > max(info.compress_size, 1) * _MAX_RATIO:
                raise builder.corrupt(
                    f"member {info.filename!r} claims to inflate {info.compress_size} bytes "
                    f"to {info.file_size}", info.header_offset, file,
                )
            out.append(
                Member(info.filename, info.header_offset, data_offset, info.compress_size,
                       info.file_size, info.compress_type, info.CRC)
            )
    return out


def read_member(
    path: Path, member: Member, builder: InventoryBuilder, limit: int = MAX_READ, file: int = 0
) -> bytes:
    """The uncompressed bytes of a member (stored or deflated), at most ``limit`` bytes."""
    if member.file_size > limit:
        raise builder.corrupt(
            f"member {member.name!r} is {member.file_size} bytes, more than the {limit} "
            "modelsize reads whole", member.header_offset, file,
        )
    with open(path, "rb") as fh:
        fh.seek(member.data_offset)
        raw = fh.read(member.compress_size)
    if member.method == STORED:
        return raw
    if member.method == DEFLATED:
        d = zlib.decompressobj(-15)
        data = d.decompress(raw, member.file_size + 1)
        if len(data) != member.file_size:
            raise builder.corrupt(
                f"member {member.name!r} inflates to {len(data)} bytes, header says "
                f"{member.file_size}", member.data_offset, file,
            )
        return data
    raise builder.corrupt(
        f"member {member.name!r} uses compression method {member.method}; modelsize reads "
        "stored and deflated members", member.header_offset, file,
    )


def account_headers(builder: InventoryBuilder, items: list[Member], file: int = 0) -> None:
    """Declare every local header as metadata (the central directory is left to gap filling)."""
    for m in items:
        builder.add_region(m.header_offset, m.header_nbytes, Category.METADATA,
                           f"zip header of {m.name}", file)
