"""Protobuf wire-format encoding for writers that re-emit a message they did not load.

A message is written as a list of parts whose sizes are all known before a byte is written:
runs of the input file copied as they are (:class:`Copy`), literal bytes (:class:`Raw`),
nested length-delimited fields (:class:`Nested`, whose length prefix is the sum of its parts)
and payloads streamed from elsewhere (:class:`Streamed`: a tensor's bytes, a chunk at a time).
Protobuf needs every length before the bytes it covers; building the parts first gives them,
and the size of the whole output, without holding any payload in memory.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import BinaryIO, TypeAlias

from modelsize.formats._protobuf import LEN, VARINT

#: Bytes copied from the input at a time.
COPY_CHUNK = 8 << 20


def varint(value: int) -> bytes:
    """``value`` (unsigned, or int64 as two's complement) as a base-128 varint."""
    if value < 0:
        value += 1 << 64
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def key(number: int, wire_type: int) -> bytes:
    """The tag of field ``number``."""
    return varint(number << 3 | wire_type)


def varint_field(number: int, value: int) -> bytes:
    """A whole varint field."""
    return key(number, VARINT) + varint(value)


def bytes_field(number: int, payload: bytes | str) -> bytes:
    """A whole length-delimited field holding ``payload`` (a string is UTF-8 encoded)."""
    data = payload.encode("utf-8") if isinstance(payload, str) else payload
    return key(number, LEN) + varint(len(data)) + data


class Sink:
    """Where parts are written: the output file, and the input file they copy from."""

    def __init__(self, out: BinaryIO, source_fd: int) -> None:
        self.out = out
        self.source_fd = source_fd

    def copy(self, start: int, end: int) -> None:
        """Copy input bytes ``start..end``."""
        pos = start
        while pos < end:
            data = os.pread(self.source_fd, min(COPY_CHUNK, end - pos), pos)
            if not data:
                raise ValueError(f"input ends at byte {pos}, before {end}")
            self.out.write(data)
            pos += len(data)


@dataclass
class Copy:
    """Input bytes ``start..end``, as they are."""

    start: int
    end: int

    @property
    def size(self) -> int:
        """Bytes written."""
        return self.end - self.start

    def write(self, sink: Sink) -> None:
        """Copy the bytes."""
        sink.copy(self.start, self.end)


@dataclass
class Raw:
    """Literal bytes."""

    data: bytes

    @property
    def size(self) -> int:
        """Bytes written."""
        return len(self.data)

    def write(self, sink: Sink) -> None:
        """Write the bytes."""
        sink.out.write(self.data)


@dataclass
class Streamed:
    """``size`` bytes from ``chunks(sink)`` (called once, when written)."""

    size: int
    chunks: Callable[[Sink], Iterator[bytes | memoryview]]

    def write(self, sink: Sink) -> None:
        """Write the chunks, checking their total."""
        n = 0
        for chunk in self.chunks(sink):
            sink.out.write(chunk)
            n += len(chunk)
        if n != self.size:
            raise ValueError(f"a streamed payload gave {n} bytes, {self.size} were planned")


@dataclass
class Parts:
    """A message body being built: adjacent copies and literals are merged as they come."""

    items: list[Part] = field(default_factory=list)
    size: int = 0

    def add(self, part: Part) -> None:
        """Append a part (an empty one is dropped)."""
        if part.size == 0 and not isinstance(part, Nested):
            return
        last = self.items[-1] if self.items else None
        if isinstance(part, Copy) and isinstance(last, Copy) and last.end == part.start:
            last.end = part.end
        elif isinstance(part, Raw) and isinstance(last, Raw):
            last.data += part.data
        elif isinstance(part, Copy):  # a fresh one: merging must not change the caller's
            self.items.append(Copy(part.start, part.end))
        elif isinstance(part, Raw):
            self.items.append(Raw(part.data))
        else:
            self.items.append(part)
        self.size += part.size

    def extend(self, parts: Iterable[Part]) -> None:
        """Append several parts."""
        for part in parts:
            self.add(part)

    def write(self, sink: Sink) -> None:
        """Write every part in order."""
        for part in self.items:
            part.write(sink)


@dataclass
class Nested:
    """A length-delimited field (field ``number``) whose payload is ``body``."""

    number: int
    body: Parts

    @property
    def head(self) -> bytes:
        """Tag and length prefix."""
        return key(self.number, LEN) + varint(self.body.size)

    @property
    def size(self) -> int:
        """Bytes written: tag, length prefix and payload."""
        return len(self.head) + self.body.size

    def write(self, sink: Sink) -> None:
        """Write the tag, the length, then the payload."""
        sink.out.write(self.head)
        self.body.write(sink)


#: Anything a message body is made of.
Part: TypeAlias = Copy | Raw | Streamed | Nested
