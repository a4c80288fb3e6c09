"""A minimal, bounded protobuf wire-format decoder (no schema, no ``protobuf`` package).

Shared by the ONNX and TensorFlow readers. It walks the fields of one message inside a
buffer (``bytes``, ``memoryview`` or an ``mmap``) between two offsets and yields each
:class:`Field` with the byte range it occupies, so readers can charge every byte of a file
to a category without copying payloads: a 2 GB ``raw_data`` field is skipped by its length
prefix, never read. Every length is checked against the enclosing message before use;
groups (wire types 3 and 4, deprecated since proto2) are rejected.

Typical use::

    for f in iter_fields(buf, start, end):
        if f.number == 1 and f.wire_type == LEN:
            name = f.text(buf)
        elif f.number == 2 and f.wire_type == VARINT:
            version = f.value
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = [
    "I32",
    "I64",
    "LEN",
    "VARINT",
    "Buffer",
    "Field",
    "ProtobufError",
    "iter_fields",
    "packed_fixed",
    "packed_varints",
    "read_varint",
    "signed32",
    "signed64",
    "zigzag",
]

#: Anything indexable as bytes: ``buf[i]`` is an int, ``buf[a:b]`` bytes-like.
Buffer = bytes | bytearray | memoryview | mmap.mmap

VARINT = 0
I64 = 1
LEN = 2
I32 = 5
_GROUP_START = 3
_GROUP_END = 4
_MAX_VARINT_BYTES = 10
_MAX_FIELD_NUMBER = (1 << 29) - 1
_F32 = struct.Struct("<f")
_F64 = struct.Struct("<d")


class ProtobufError(ValueError):
    """The bytes are not a valid protobuf message; ``offset`` is where decoding failed."""

    def __init__(self, reason: str, offset: int) -> None:
        self.reason = reason
        self.offset = offset
        super().__init__(f"{reason} (at byte {offset})")


@dataclass(frozen=True)
class Field:
    """One field of a message, with the bytes it occupies.

    ``start`` is the offset of the tag, ``end`` one past the last byte of the field.
    For ``VARINT`` fields ``value`` is the decoded unsigned integer; for ``I32``/``I64`` the
    little-endian unsigned integer; for ``LEN`` the payload length, the payload being
    ``buf[data_start:end]``.
    """

    number: int
    wire_type: int
    value: int
    start: int
    data_start: int
    end: int

    @property
    def nbytes(self) -> int:
        """Bytes of the whole field: tag, length prefix and payload."""
        return self.end - self.start

    def bytes(self, buf: Buffer) -> bytes:
        """The payload of a ``LEN`` field (copied: use only for small fields)."""
        return bytes(buf[self.data_start : self.end])

    def text(self, buf: Buffer) -> str:
        """The payload of a ``LEN`` field decoded as UTF-8 (``UnicodeDecodeError`` if not)."""
        return bytes(buf[self.data_start : self.end]).decode("utf-8")

    def as_float(self) -> float:
        """An ``I32`` field as an IEEE float."""
        return float(_F32.unpack(self.value.to_bytes(4, "little"))[0])

    def as_double(self) -> float:
        """An ``I64`` field as an IEEE double."""
        return float(_F64.unpack(self.value.to_bytes(8, "little"))[0])

    def as_int64(self) -> int:
        """A ``VARINT`` or ``I64`` field read as a two's-complement int64."""
        return signed64(self.value)


def read_varint(buf: Buffer, pos: int, end: int) -> tuple[int, int]:
    """Decode the varint at ``pos``; return ``(value, position after it)``.

    Refuses varints that run past ``end``, are longer than 10 bytes or exceed 64 bits.
    """
    result = 0
    shift = 0
    start = pos
    while True:
        if pos >= end:
            raise ProtobufError("varint runs past the end of its message", start)
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            break
        shift += 7
        if pos - start >= _MAX_VARINT_BYTES:
            raise ProtobufError("varint longer than 10 bytes", start)
    if result >> 64:
        raise ProtobufError("varint exceeds 64 bits", start)
    return result, pos


def iter_fields(buf: Buffer, start: int = 0, end: int | None = None) -> Iterator[Field]:
    """Yield the fields of the message occupying ``buf[start:end]``, in file order.

    Payloads are not read, only their length prefixes, so the cost is proportional to the
    number of fields, not the size of the message. Nested messages are walked by calling
    ``iter_fields(buf, field.data_start, field.end)``.
    """
    stop = len(buf) if end is None else end
    if start < 0 or stop > len(buf) or start > stop:
        raise ProtobufError(f"message range {start}..{stop} outside a buffer of {len(buf)}", start)
    pos = start
    while pos < stop:
        field_start = pos
        key, pos = read_varint(buf, pos, stop)
        number, wire_type = key >> 3, key & 7
        if number == 0 or number > _MAX_FIELD_NUMBER:
            raise ProtobufError(f"invalid field number {number}", field_start)
        if wire_type == VARINT:
            value, pos = read_varint(buf, pos, stop)
            yield Field(number, wire_type, value, field_start, field_start, pos)
            continue
        if wire_type == LEN:
            length, data_start = read_varint(buf, pos, stop)
            if length > stop - data_start:
                raise ProtobufError(
                    f"field {number} declares {length} bytes but its message has "
                    f"{stop - data_start} left",
                    field_start,
                )
            pos = data_start + length
            yield Field(number, wire_type, length, field_start, data_start, pos)
            continue
        if wire_type in (I64, I32):
            size = 8 if wire_type == I64 else 4
            if pos + size > stop:
                raise ProtobufError(f"fixed{size * 8} field {number} runs past its message", pos)
            value = int.from_bytes(bytes(buf[pos : pos + size]), "little")
            yield Field(number, wire_type, value, field_start, pos, pos + size)
            pos += size
            continue
        if wire_type in (_GROUP_START, _GROUP_END):
            raise ProtobufError(f"field {number} is a group (unsupported wire type)", field_start)
        raise ProtobufError(f"field {number} has invalid wire type {wire_type}", field_start)


def packed_varints(buf: Buffer, start: int, end: int) -> Iterator[int]:
    """Decode a packed repeated varint payload (``buf[start:end]``)."""
    pos = start
    while pos < end:
        value, pos = read_varint(buf, pos, end)
        yield value


def packed_fixed(buf: Buffer, start: int, end: int, size: int) -> Iterator[int]:
    """Decode a packed repeated fixed32 (``size=4``) or fixed64 (``size=8``) payload."""
    if (end - start) % size:
        raise ProtobufError(f"packed fixed{size * 8} payload of {end - start} bytes", start)
    for pos in range(start, end, size):
        yield int.from_bytes(bytes(buf[pos : pos + size]), "little")


def signed64(value: int) -> int:
    """Reinterpret an unsigned 64-bit value as two's-complement (``int64`` fields)."""
    return value - (1 << 64) if value >> 63 else value


def signed32(value: int) -> int:
    """Reinterpret the low 32 bits as two's-complement (``int32`` fields, sign-extended)."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >> 31 else value


def zigzag(value: int) -> int:
    """Decode a zigzag-encoded ``sint32``/``sint64`` value."""
    return (value >> 1) ^ -(value & 1)
