"""Writing the pieces of a TensorFlow bundle's ``.index``: protobuf fields and a sorted table.

The table is LevelDB's format as TensorFlow's ``table::TableBuilder`` writes it for bundles
(no compression): data blocks of prefix-compressed entries with a restart point every 16
entries, cut when a block reaches 256 KiB; an empty metaindex block; an index block holding,
per data block, the block's last key and its handle; the 48-byte footer. Every block is
followed by its type byte and the masked CRC-32C of both. :mod:`modelsize.formats._sstable`
reads it back.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

from modelsize.formats._sstable import FOOTER_SIZE, MAGIC
from modelsize.slimming.writers._tfcrc import crc32c, mask

__all__ = ["field_bytes", "field_fixed32", "field_varint", "table", "varint"]

BLOCK_SIZE = 256 << 10
RESTART_INTERVAL = 16
_NO_COMPRESSION = b"\x00"


def varint(value: int) -> bytes:
    """Protobuf base-128 varint (negative values as their 64-bit two's complement)."""
    value &= (1 << 64) - 1
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def field_varint(number: int, value: int) -> bytes:
    """A varint field (written even when zero)."""
    return varint(number << 3) + varint(value)


def field_bytes(number: int, payload: bytes) -> bytes:
    """A length-delimited field (bytes, string or sub-message)."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def field_fixed32(number: int, value: int) -> bytes:
    """A ``fixed32`` field."""
    return varint(number << 3 | 5) + struct.pack("<I", value)


class _Block:
    def __init__(self, restart_interval: int) -> None:
        self.interval = restart_interval
        self.buf = bytearray()
        self.restarts = [0]
        self.count = 0
        self.last = b""

    def add(self, key: bytes, value: bytes) -> None:
        shared = 0
        if self.count < self.interval:
            limit = min(len(key), len(self.last))
            while shared < limit and key[shared] == self.last[shared]:
                shared += 1
        else:
            self.restarts.append(len(self.buf))
            self.count = 0
        self.buf += varint(shared) + varint(len(key) - shared) + varint(len(value))
        self.buf += key[shared:] + value
        self.last = key
        self.count += 1

    def size(self) -> int:
        return len(self.buf) + 4 * len(self.restarts) + 4

    def finish(self) -> bytes:
        return bytes(self.buf) + b"".join(struct.pack("<I", r) for r in self.restarts) + \
            struct.pack("<I", len(self.restarts))


def table(entries: Iterable[tuple[bytes, bytes]], block_size: int = BLOCK_SIZE) -> bytes:
    """The table holding ``(key, value)`` pairs, given in strictly increasing key order."""
    out = bytearray()
    index = _Block(1)

    def emit(contents: bytes) -> bytes:
        """Append a block and its trailer; return its handle."""
        handle = varint(len(out)) + varint(len(contents))
        out.extend(contents)
        out.extend(_NO_COMPRESSION)
        out.extend(struct.pack("<I", mask(crc32c(_NO_COMPRESSION, crc32c(contents)))))
        return handle

    block = _Block(RESTART_INTERVAL)
    previous: bytes | None = None
    for key, value in entries:
        if previous is not None and key <= previous:
            raise ValueError(f"table keys out of order: {key[:60]!r} after {previous[:60]!r}")
        previous = key
        block.add(key, value)
        if block.size() >= block_size:
            index.add(block.last, emit(block.finish()))
            block = _Block(RESTART_INTERVAL)
    if block.count or previous is None:
        index.add(block.last, emit(block.finish()))
    metaindex = emit(_Block(1).finish())
    index_handle = emit(index.finish())
    footer = (metaindex + index_handle).ljust(FOOTER_SIZE - 8, b"\x00")
    out.extend(footer + struct.pack("<Q", MAGIC))
    return bytes(out)
