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
import os
import struct
from collections import OrderedDict
from collections.abc import Iterator
from typing import overload

from modelsize._records import record

__all__ = [
    "I32",
    "I64",
    "LEN",
    "VARINT",
    "Buffer",
    "Field",
    "FileBuffer",
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

class FileBuffer:
    """A read-only view of a file read lazily by blocks: ``len(b)``, ``b[i]``, ``b[a:b]``.

    For formats whose headers are scattered between gigabytes of tensor data (ONNX
    initializers, Lua Torch storages). Unlike ``mmap``, touching one header byte does not
    map a whole page-cache folio (up to 2 MB on recent kernels) into the process, so peak
    RSS stays at the size of the few blocks kept here, whatever the file size.
    """

    def __init__(self, fd: int, size: int, block: int = 1 << 16, keep: int = 64) -> None:
        self._fd = fd
        self._size = size
        self._block = block
        self._keep = keep
        self._blocks: OrderedDict[int, bytes] = OrderedDict()

    def __len__(self) -> int:
        return self._size

    def _get(self, index: int) -> bytes:
        data = self._blocks.get(index)
        if data is None:
            data = os.pread(self._fd, self._block, index * self._block)
            self._blocks[index] = data
            if len(self._blocks) > self._keep:
                self._blocks.popitem(last=False)
        else:
            self._blocks.move_to_end(index)
        return data

    @overload
    def __getitem__(self, key: int) -> int: ...

    @overload
    def __getitem__(self, key: slice) -> bytes: ...

    def __getitem__(self, key: int | slice) -> int | bytes:
        if isinstance(key, slice):
            start, stop, step = key.indices(self._size)
            if step != 1:
                raise ValueError("FileBuffer slices must be contiguous")
            if stop <= start:
                return b""
            first, last = start // self._block, (stop - 1) // self._block
            base = first * self._block
            if first == last:
                return self._get(first)[start - base : stop - base]
            if last - first > 4:  # a large read: do not churn the block cache
                return os.pread(self._fd, stop - start, start)
            data = b"".join(self._get(i) for i in range(first, last + 1))
            return data[start - base : stop - base]
        if not 0 <= key < self._size:
            raise IndexError(f"byte {key} outside a file of {self._size}")
        return self._get(key // self._block)[key % self._block]


#: Anything indexable as bytes: ``buf[i]`` is an int, ``buf[a:b]`` bytes-like.
Buffer = bytes | bytearray | memoryview | mmap.mmap | FileBuffer

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


@record(frozen=True)
class Field:
    """One field of a message, with the bytes it occupies.

    ``start`` is the offset of the tag, ``end`` one past the last byte of the field.
    ``data_start`` is where the value begins (after the tag, and for ``LEN`` after the length
    prefix). For ``VARINT`` fields ``value`` is the decoded unsigned integer; for
    ``I32``/``I64`` the little-endian unsigned integer; for ``LEN`` the payload length, the
    payload being ``buf[data_start:end]``.
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
    chunk = buf[pos : min(pos + _MAX_VARINT_BYTES, end)]
    result = 0
    shift = 0
    for i, byte in enumerate(chunk):
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            if result >> 64:
                raise ProtobufError("varint exceeds 64 bits", pos)
            return result, pos + i + 1
        shift += 7
    if len(chunk) == _MAX_VARINT_BYTES:
        raise ProtobufError("varint longer than 10 bytes", pos)
    raise ProtobufError("varint runs past the end of its message", pos)


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
        # One read per field: a key and a value varint take at most 20 bytes.
        head = bytes(buf[pos : min(pos + 2 * _MAX_VARINT_BYTES, stop)])
        try:
            field = _decode_field(head, pos, stop)
        except ProtobufError as exc:
            raise ProtobufError(exc.reason, pos + exc.offset) from None
        yield field
        pos = field.end


def _decode_field(head: bytes, pos: int, stop: int) -> Field:
    """The field whose first bytes are ``head`` (offsets in errors are relative to ``head``)."""
    key, k = read_varint(head, 0, len(head))
    number, wire_type = key >> 3, key & 7
    if number == 0 or number > _MAX_FIELD_NUMBER:
        raise ProtobufError(f"invalid field number {number}", 0)
    if wire_type == VARINT:
        value, v = read_varint(head, k, len(head))
        return Field(number, wire_type, value, pos, pos + k, pos + v)
    if wire_type == LEN:
        length, v = read_varint(head, k, len(head))
        data_start = pos + v
        if length > stop - data_start:
            raise ProtobufError(
                f"field {number} declares {length} bytes but its message has "
                f"{stop - data_start} left",
                0,
            )
        return Field(number, wire_type, length, pos, data_start, data_start + length)
    if wire_type in (I64, I32):
        size = 8 if wire_type == I64 else 4
        if pos + k + size > stop:
            raise ProtobufError(f"fixed{size * 8} field {number} runs past its message", k)
        value = int.from_bytes(head[k : k + size], "little")
        return Field(number, wire_type, value, pos, pos + k, pos + k + size)
    if wire_type in (_GROUP_START, _GROUP_END):
        raise ProtobufError(f"field {number} is a group (unsupported wire type)", 0)
    raise ProtobufError(f"field {number} has invalid wire type {wire_type}", 0)


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
