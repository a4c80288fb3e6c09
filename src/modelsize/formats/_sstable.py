"""A read-only reader of LevelDB-style sorted tables, the format of TensorFlow's ``.index`` files.

A table is a run of blocks followed by a 48-byte footer::

    data block 0 | data block 1 | ... | metaindex block | index block | footer

The footer holds two block handles (varint offset, varint size) and the magic number. The
index block maps a separator key to the handle of each data block. Every block is a run of
prefix-compressed entries (``shared``, ``non_shared``, ``value_length`` varints, the key
suffix, the value), then an array of ``uint32`` restart offsets and their count, then a
5-byte trailer: a compression type byte and the masked CRC-32C of the block and that byte.

TensorFlow writes its bundle index uncompressed; a block whose type byte says otherwise is
refused with a clear reason rather than decoded. Every handle, length and restart count is
checked against the table size before it is used, and keys must come in increasing order,
so a hostile file cannot make the reader loop, jump outside the table or allocate by a lie.
"""

from __future__ import annotations

from collections.abc import Iterator

from modelsize._records import record
from modelsize.formats._protobuf import Buffer, ProtobufError, read_varint

__all__ = ["FOOTER_SIZE", "MAGIC", "BlockHandle", "SSTableError", "crc32c", "iter_table"]

#: ``kTableMagicNumber`` of LevelDB and TensorFlow's ``table_format``.
MAGIC = 0xDB4775248B80FB57
FOOTER_SIZE = 48
_TRAILER = 5
_NO_COMPRESSION = 0
_CRC_MASK_DELTA = 0xA282EAD8


class SSTableError(ValueError):
    """The table is truncated or inconsistent; ``offset`` is where the problem was seen."""

    def __init__(self, reason: str, offset: int) -> None:
        self.reason = reason
        self.offset = offset
        super().__init__(f"{reason} (at byte {offset})")


@record(frozen=True)
class BlockHandle:
    """Where one block lies in the table (its trailer follows it)."""

    offset: int
    size: int


def _make_crc_table() -> tuple[int, ...]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return tuple(table)


_CRC_TABLE = _make_crc_table()


def crc32c(data: bytes | bytearray | memoryview, crc: int = 0) -> int:
    """CRC-32C (Castagnoli) of ``data``, continuing from ``crc``."""
    table = _CRC_TABLE
    c = crc ^ 0xFFFFFFFF
    for byte in bytes(data):
        c = table[(c ^ byte) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def _unmask(masked: int) -> int:
    rot = (masked - _CRC_MASK_DELTA) & 0xFFFFFFFF
    return ((rot >> 17) | (rot << 15)) & 0xFFFFFFFF


def _handle(buf: Buffer, pos: int, end: int) -> tuple[BlockHandle, int]:
    offset, pos = read_varint(buf, pos, end)
    size, pos = read_varint(buf, pos, end)
    return BlockHandle(offset, size), pos


def read_footer(buf: Buffer) -> tuple[BlockHandle, BlockHandle]:
    """The (metaindex, index) block handles from the footer; checks the magic number."""
    size = len(buf)
    if size < FOOTER_SIZE:
        raise SSTableError(f"table is {size} bytes, shorter than its {FOOTER_SIZE}-byte footer", 0)
    start = size - FOOTER_SIZE
    magic = int.from_bytes(bytes(buf[size - 8 : size]), "little")
    if magic != MAGIC:
        raise SSTableError(
            f"footer magic is {magic:#018x}, expected {MAGIC:#018x} (truncated or not a table)",
            size - 8,
        )
    try:
        meta, pos = _handle(buf, start, size - 8)
        index, _ = _handle(buf, pos, size - 8)
    except ProtobufError as exc:
        raise SSTableError(f"footer block handles unreadable: {exc.reason}", start) from exc
    return meta, index


def _block(buf: Buffer, handle: BlockHandle, what: str, verify: bool) -> tuple[int, int]:
    """Check a block's bounds, type byte and checksum; return its (start, end of entries)."""
    limit = len(buf) - FOOTER_SIZE
    if handle.offset + handle.size + _TRAILER > limit:
        raise SSTableError(
            f"{what} claims bytes {handle.offset}..{handle.offset + handle.size + _TRAILER} "
            f"but the blocks end at {limit}",
            handle.offset,
        )
    end = handle.offset + handle.size
    kind = buf[end]
    if kind != _NO_COMPRESSION:
        raise SSTableError(
            f"{what} uses compression type {kind}; TensorFlow index blocks are uncompressed "
            "(type 0) and modelsize reads no other",
            end,
        )
    if verify:
        stored = _unmask(int.from_bytes(bytes(buf[end + 1 : end + 5]), "little"))
        actual = crc32c(buf[handle.offset : end + 1])
        if stored != actual:
            raise SSTableError(
                f"{what} checksum is {actual:#010x}, its trailer says {stored:#010x}", end + 1
            )
    if handle.size < 4:
        raise SSTableError(f"{what} is {handle.size} bytes, too short for its restart count", end)
    restarts = int.from_bytes(bytes(buf[end - 4 : end]), "little")
    if restarts * 4 + 4 > handle.size:
        raise SSTableError(
            f"{what} claims {restarts} restart points but holds only {handle.size} bytes", end - 4
        )
    return handle.offset, end - 4 - restarts * 4


def _entries(buf: Buffer, start: int, end: int) -> Iterator[tuple[bytes, int, int]]:
    """Yield ``(key, value_start, value_end)`` for each entry of one block."""
    key = b""
    pos = start
    while pos < end:
        entry = pos
        try:
            shared, pos = read_varint(buf, pos, end)
            non_shared, pos = read_varint(buf, pos, end)
            value_len, pos = read_varint(buf, pos, end)
        except ProtobufError as exc:
            raise SSTableError(f"block entry header unreadable: {exc.reason}", entry) from exc
        if shared > len(key):
            raise SSTableError(
                f"entry shares {shared} bytes with a previous key of {len(key)}", entry
            )
        if non_shared + value_len > end - pos:
            raise SSTableError(
                f"entry claims {non_shared + value_len} bytes but its block has {end - pos} left",
                entry,
            )
        key = key[:shared] + bytes(buf[pos : pos + non_shared])
        pos += non_shared
        yield key, pos, pos + value_len
        pos += value_len


def iter_table(buf: Buffer, *, verify: bool = True) -> Iterator[tuple[bytes, int, int]]:
    """Yield ``(key, value_start, value_end)`` for every entry of the table, in key order.

    Values are given as offsets into ``buf`` so callers copy only what they decode. With
    ``verify`` every block's CRC-32C is checked.
    """
    _, index = read_footer(buf)
    istart, iend = _block(buf, index, "index block", verify)
    previous: bytes | None = None
    for _, vstart, vend in _entries(buf, istart, iend):
        try:
            handle, _ = _handle(buf, vstart, vend)
        except ProtobufError as exc:
            raise SSTableError(f"index entry unreadable: {exc.reason}", vstart) from exc
        if handle.offset >= index.offset:
            raise SSTableError(
                f"data block at {handle.offset} lies at or after the index block "
                f"({index.offset})",
                vstart,
            )
        dstart, dend = _block(buf, handle, f"data block at {handle.offset}", verify)
        for key, a, b in _entries(buf, dstart, dend):
            if previous is not None and key <= previous:
                raise SSTableError(
                    f"key {key[:60]!r} is not after the previous key {previous[:60]!r}", a
                )
            previous = key
            yield key, a, b
