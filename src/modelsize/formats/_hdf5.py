"""A minimal, read-only HDF5 metadata reader: what h5py and Keras write, nothing more.

It walks the group tree from the superblock and reports, for every dataset, its dtype, shape
and where its raw data lies (contiguous, compact or chunked, with filters), and for every
object its attributes (decoded when they are small strings, located when they are large).
It never reads raw data. Supported: superblock versions 0-3, object header versions 1-2 with
continuation blocks, symbol-table groups (v1 B-tree, local heap, SNOD) and compact link
messages, data layout versions 1-3 (and 4 for contiguous and compact data), v1 B-trees of
chunks, filter pipelines, attributes with fixed or variable-length strings (global heap).
Dense (fractal-heap) link storage is refused with a clear reason: h5py writes it only for
``libver="latest"`` files with very large groups, which Keras does not make.

Every address and length is checked against the blob's size before it is used, object
headers already visited are not walked twice (cycles end), and loops are bounded by counts
derived from the blob's size, so a hostile file cannot hang or exhaust memory.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator
from typing import Protocol

from modelsize._records import field, record

__all__ = [
    "SIGNATURE",
    "Attribute",
    "Blob",
    "BytesBlob",
    "Dataset",
    "H5File",
    "HDF5Error",
    "find_superblock",
    "read_hdf5",
]

SIGNATURE = b"\x89HDF\r\n\x1a\n"
_UNDEFINED = -1
_DERIVED = -2
#: Objects (headers, tree nodes) walked before a file is called hostile.
_MAX_OBJECTS = 5_000_000
#: Attribute values decoded into Python strings when at most this many bytes.
_DECODE_LIMIT = 1 << 20

# Object header message types we read.
_DATASPACE, _LINK_INFO, _DATATYPE, _LINK, _LAYOUT = 0x01, 0x02, 0x03, 0x06, 0x08
_FILTERS, _ATTRIBUTE, _CONTINUATION, _SYMBOL_TABLE, _ATTRIBUTE_INFO = 0x0B, 0x0C, 0x10, 0x11, 0x15

FILTER_NAMES = {1: "gzip", 2: "shuffle", 3: "fletcher32", 4: "szip", 5: "nbit", 6: "scaleoffset",
                32001: "blosc", 32004: "lz4", 32015: "zstd", 307: "bzip2"}


#: (size, bit offset, precision, exponent location, exponent size, mantissa location, mantissa
#: size, exponent bias) of the floating types numpy (and Keras) read -> their dtype.
_FLOAT_LAYOUTS = {
    (2, 0, 16, 10, 5, 0, 10, 15): "float16",
    (2, 0, 16, 7, 8, 0, 7, 127): "bfloat16",
    (4, 0, 32, 23, 8, 0, 23, 127): "float32",
    (8, 0, 64, 52, 11, 0, 52, 1023): "float64",
}


class HDF5Error(ValueError):
    """The HDF5 structure is truncated or inconsistent; ``offset`` is where it was seen."""

    def __init__(self, reason: str, offset: int | None = None) -> None:
        self.reason = reason
        self.offset = offset
        super().__init__(reason if offset is None else f"{reason} (at byte {offset})")


class Blob(Protocol):
    """Random access to the bytes of one HDF5 file (a file, or a member of a zip)."""

    size: int

    def read(self, offset: int, nbytes: int) -> bytes:
        """Exactly ``nbytes`` bytes at ``offset`` (callers check the range first)."""
        ...


class BytesBlob:
    """A blob over an in-memory buffer or a slice of a memory map (no copy)."""

    def __init__(self, buf: bytes | memoryview | mmap.mmap, base: int = 0,
                 size: int | None = None) -> None:
        self.buf = buf
        self.base = base
        self.size = len(buf) - base if size is None else size

    def read(self, offset: int, nbytes: int) -> bytes:
        """Bytes ``offset..offset+nbytes`` of the blob."""
        start = self.base + offset
        return bytes(self.buf[start : start + nbytes])



@record(frozen=True)
class Attribute:
    """One attribute: its value when small and textual, and where its bytes lie."""

    name: str
    value: str | list[str] | None
    ranges: tuple[tuple[int, int], ...]  # (blob offset, nbytes) of the value's bytes


@record
class Dataset:
    """A dataset's type, shape and where its raw data lies in the blob."""

    path: str
    header: int
    dtype: str | None
    dtype_class: str
    itemsize: int
    shape: tuple[int, ...]
    layout: str  # "contiguous", "compact" or "chunked"
    pieces: list[tuple[int, int]] = field(default_factory=list)  # (blob offset, nbytes)
    filters: tuple[str, ...] = ()
    attrs: dict[str, Attribute] = field(default_factory=dict)

    @property
    def logical_nbytes(self) -> int:
        """Bytes the dataset holds once read: numel * itemsize."""
        n = self.itemsize
        for d in self.shape:
            n *= d
        return n

    @property
    def stored_nbytes(self) -> int:
        """Bytes its raw data occupies in the blob."""
        return sum(n for _, n in self.pieces)


@record
class H5File:
    """What :func:`read_hdf5` found: groups (with attributes) and datasets, in walk order."""

    superblock: int
    version: int
    groups: dict[str, dict[str, Attribute]] = field(default_factory=dict)
    datasets: list[Dataset] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@record
class _Message:
    type: int
    offset: int
    size: int
    flags: int


def find_superblock(blob: Blob) -> int | None:
    """Offset of the superblock signature (0, 512, 1024, 2048, ...), or None."""
    offset = 0
    while offset + len(SIGNATURE) <= blob.size:
        if blob.read(offset, len(SIGNATURE)) == SIGNATURE:
            return offset
        offset = 512 if offset == 0 else offset * 2
    return None


class _Reader:
    def __init__(self, blob: Blob) -> None:
        self.blob = blob
        self.size = blob.size
        self.offset_size = 8
        self.length_size = 8
        self.base = 0
        self.visited: set[int] = set()
        self.objects = 0
        self.max_objects = min(_MAX_OBJECTS, max(16, blob.size // 8))

    # -- primitives --------------------------------------------------------------------
    def read(self, offset: int, nbytes: int, what: str) -> bytes:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise HDF5Error(
                f"{what} claims bytes {offset}..{offset + nbytes} but the file has {self.size}",
                offset,
            )
        return self.blob.read(offset, nbytes)

    def uint(self, data: bytes, pos: int, size: int, what: str) -> int:
        if pos + size > len(data):
            raise HDF5Error(f"{what} runs past the end of its structure")
        return int.from_bytes(data[pos : pos + size], "little")

    def addr(self, data: bytes, pos: int, what: str) -> int:
        """An address field made absolute (``_UNDEFINED`` for all-ones)."""
        raw = self.uint(data, pos, self.offset_size, what)
        if raw == (1 << (8 * self.offset_size)) - 1:
            return _UNDEFINED
        return self.base + raw

    def check(self, address: int, nbytes: int, what: str) -> None:
        if address < 0 or nbytes < 0 or address + nbytes > self.size:
            raise HDF5Error(
                f"{what} claims bytes {address}..{address + nbytes} but the file has {self.size}",
                address,
            )

    def count_object(self, address: int) -> None:
        self.objects += 1
        if self.objects > self.max_objects:
            raise HDF5Error(f"more than {self.max_objects} objects in a {self.size}-byte file",
                            address)

    # -- superblock --------------------------------------------------------------------
    def superblock(self, at: int) -> tuple[int, int]:
        """Parse the superblock at ``at``; return (version, root object header address)."""
        head = self.read(at, 16, "superblock")
        version = head[8]
        self.base = at
        if version in (0, 1):
            self.offset_size, self.length_size = head[13], head[14]
            self._check_sizes(at)
            fixed = 24 + (4 if version == 1 else 0)
            o = self.offset_size
            data = self.read(at, fixed + 4 * o + 2 * o + 8 + 16, "superblock")
            base = self.uint(data, fixed, o, "base address")
            self.base = base
            entry = fixed + 4 * o
            root = self.addr(data, entry + o, "root group object header address")
            return version, root
        if version in (2, 3):
            self.offset_size, self.length_size = head[9], head[10]
            self._check_sizes(at)
            o = self.offset_size
            data = self.read(at, 12 + 4 * o + 4, "superblock")
            self.base = self.uint(data, 12, o, "base address")
            root = self.addr(data, 12 + 3 * o, "root group object header address")
            return version, root
        raise HDF5Error(f"superblock version {version} is not one of 0, 1, 2, 3", at + 8)

    def _check_sizes(self, at: int) -> None:
        if self.offset_size not in (2, 4, 8) or self.length_size not in (2, 4, 8):
            raise HDF5Error(
                f"superblock declares {self.offset_size}-byte offsets and "
                f"{self.length_size}-byte lengths (expected 2, 4 or 8)", at + 13,
            )

    # -- object headers ----------------------------------------------------------------
    def messages(self, address: int) -> list[_Message]:
        """Every message of the object header at ``address``, continuations followed."""
        self.check(address, 16, "object header")
        first = self.read(address, 4, "object header")
        out: list[_Message] = []
        blocks: list[tuple[int, int]] = []
        seen_blocks: set[int] = set()
        if first == b"OHDR":
            head = self.read(address, 6, "object header")
            if head[4] != 2:
                raise HDF5Error(f"object header version {head[4]} (expected 2)", address + 4)
            flags = head[5]
            pos = address + 6 + (16 if flags & 0x20 else 0) + (4 if flags & 0x10 else 0)
            width = 1 << (flags & 3)
            chunk0 = int.from_bytes(self.read(pos, width, "object header size"), "little")
            pos += width
            self.check(pos, chunk0 + 4, "object header chunk")
            blocks.append((pos, pos + chunk0))
            creation_order = bool(flags & 0x04)
            while blocks:
                start, end = blocks.pop(0)
                out.extend(self._v2_messages(start, end, creation_order, blocks, seen_blocks))
            return out
        if first[0] != 1:
            raise HDF5Error(f"object header version {first[0]} (expected 1 or 2)", address)
        head = self.read(address, 16, "object header")
        count = int.from_bytes(head[2:4], "little")
        size = int.from_bytes(head[8:12], "little")
        self.check(address + 16, size, "object header")
        blocks.append((address + 16, address + 16 + size))
        while blocks:
            start, end = blocks.pop(0)
            out.extend(self._v1_messages(start, end, blocks, seen_blocks))
            if len(out) > count + 1024:
                raise HDF5Error(f"object header declares {count} messages but holds more",
                                address)
        return out

    def _continuation(self, msg: _Message, blocks: list[tuple[int, int]],
                      seen: set[int]) -> None:
        data = self.read(msg.offset, msg.size, "continuation message")
        where = self.addr(data, 0, "continuation address")
        length = self.uint(data, self.offset_size, self.length_size, "continuation length")
        self.check(where, length, "continuation block")
        if where in seen:
            raise HDF5Error("object header continuation blocks form a cycle", where)
        seen.add(where)
        self.count_object(where)
        blocks.append((where, where + length))

    def _v1_messages(self, start: int, end: int, blocks: list[tuple[int, int]],
                     seen: set[int]) -> Iterator[_Message]:
        data = self.read(start, end - start, "object header messages")
        pos = 0
        while pos + 8 <= len(data):
            mtype = int.from_bytes(data[pos : pos + 2], "little")
            size = int.from_bytes(data[pos + 2 : pos + 4], "little")
            flags = data[pos + 4]
            if pos + 8 + size > len(data):
                raise HDF5Error(f"object header message of {size} bytes runs past its block",
                                start + pos)
            msg = _Message(mtype, start + pos + 8, size, flags)
            if mtype == _CONTINUATION:
                self._continuation(msg, blocks, seen)
            elif mtype:
                yield msg
            pos += 8 + size

    def _v2_messages(self, start: int, end: int, creation_order: bool,
                     blocks: list[tuple[int, int]], seen: set[int]) -> Iterator[_Message]:
        data = self.read(start, end - start, "object header messages")
        pos = 0
        if data[:4] == b"OCHK":
            pos = 4
            data = data[:-4]  # the block's checksum
        prefix = 6 if creation_order else 4
        while pos + prefix <= len(data):
            mtype = data[pos]
            size = int.from_bytes(data[pos + 1 : pos + 3], "little")
            flags = data[pos + 3]
            if pos + prefix + size > len(data):
                raise HDF5Error(f"object header message of {size} bytes runs past its block",
                                start + pos)
            msg = _Message(mtype, start + pos + prefix, size, flags)
            if mtype == _CONTINUATION:
                self._continuation(msg, blocks, seen)
            elif mtype:
                yield msg
            pos += prefix + size

    # -- messages ----------------------------------------------------------------------
    def shared_target(self, msg: _Message) -> list[_Message]:
        """Messages of the object a shared message points to (committed datatypes)."""
        data = self.read(msg.offset, msg.size, "shared message")
        version = data[0] if data else 0
        if version == 1:
            address = self.addr(data, 8, "shared message address")
        elif version in (2, 3) and (version == 2 or data[1] == 2):
            address = self.addr(data, 2, "shared message address")
        else:
            raise HDF5Error("shared message in the shared-message heap is not supported",
                            msg.offset)
        self.count_object(address)
        return self.messages(address)

    def resolved(self, msg: _Message) -> _Message:
        if not msg.flags & 0x02:
            return msg
        for target in self.shared_target(msg):
            if target.type == msg.type:
                return target
        raise HDF5Error(f"shared message of type {msg.type} points at an object without one",
                        msg.offset)

    def datatype(self, data: bytes, where: int) -> tuple[str | None, str, int]:
        """(canonical dtype or None, HDF5 class name, element size)."""
        if len(data) < 8:
            raise HDF5Error("datatype message shorter than 8 bytes", where)
        cls = data[0] & 0x0F
        bits = data[1] | (data[2] << 8) | (data[3] << 16)
        size = int.from_bytes(data[4:8], "little")
        names = {0: "integer", 1: "float", 2: "time", 3: "string", 4: "bitfield", 5: "opaque",
                 6: "compound", 7: "reference", 8: "enum", 9: "vlen", 10: "array"}
        cname = names.get(cls)
        if cname is None:
            raise HDF5Error(f"datatype class {cls} is not an HDF5 class", where)
        # The bit fields HDF5 reads without checking (h5py crashed on a variable-length type
        # 15): a string's padding and character set, a variable-length type's kind.
        pad, cset = (bits & 0x0F, (bits >> 4) & 0x0F) if cls == 3 else (
            (bits >> 4) & 0x0F, (bits >> 8) & 0x0F)
        if (cls == 3 and (pad > 2 or cset > 1)) or (
                cls == 9 and (bits & 0x0F > 1 or (bits & 0x0F == 1 and (pad > 2 or cset > 1)))):
            raise HDF5Error(f"{cname} datatype with bit fields {bits:#x}, which HDF5 does not "
                            "define", where)
        if cls == 0 and size in (1, 2, 4, 8):
            signed = bool(bits & 0x08)
            return f"{'' if signed else 'u'}int{size * 8}", cname, size
        if cls == 1 and len(data) >= 20:
            # Bit offset, precision, exponent and mantissa places and the exponent bias: only
            # the IEEE layouts (and bfloat16) are the dtypes their size suggests; another float
            # is bytes of its own kind (h5py maps some to NumPy, refuses others).
            layout = (size, *struct.unpack_from("<HHBBBBI", data, 8))
            dtype = _FLOAT_LAYOUTS.get(layout)
            if dtype is not None:
                return dtype, cname, size
        if cls == 8 and size == 1:
            return "bool", cname, size  # how h5py stores numpy bools
        if cls == 6 and size in (8, 16):
            return f"complex{size * 8}", cname, size
        return None, cname, size

    def dataspace(self, data: bytes, where: int) -> tuple[int, ...]:
        if len(data) < 4:
            raise HDF5Error("dataspace message shorter than 4 bytes", where)
        version, rank = data[0], data[1]
        if rank > 32:
            raise HDF5Error(f"dataspace of rank {rank} (HDF5 allows 32)", where)
        if version == 1:
            pos = 8
        elif version == 2:
            if data[3] == 2:
                return (0,)  # a null dataspace holds no elements
            pos = 4
        else:
            raise HDF5Error(f"dataspace message version {version} (expected 1 or 2)", where)
        dims = tuple(
            self.uint(data, pos + i * self.length_size, self.length_size, "dataspace dimension")
            for i in range(rank)
        )
        return dims

    def layout(self, data: bytes, where: int) -> tuple[str, list[tuple[int, int]], int]:
        """(layout kind, pieces, chunk-tree rank): pieces are (offset, nbytes) in the blob.

        For chunked data the pieces are found later by walking the chunk B-tree, whose
        address is returned as the single piece ``(address, -1)``.
        """
        version = data[0] if data else 0
        o, ln = self.offset_size, self.length_size
        if version in (1, 2):
            rank, cls = data[1], data[2]
            pos = 8
            address = _UNDEFINED
            if cls != 0:
                address = self.addr(data, pos, "layout address")
                pos += o
            pos += 4 * rank
            if cls == 0:
                size = self.uint(data, pos, 4, "compact data size")
                self._fits(size, len(data) - pos - 4, where)
                return "compact", [(where + pos + 4, size)], 0
            if cls == 1:
                # v1/v2 give no byte size: read_hdf5 derives it from the dataspace and type.
                return "contiguous", [] if address == _UNDEFINED else [(address, _DERIVED)], 0
            if cls == 2:
                return "chunked", [] if address == _UNDEFINED else [(address, -1)], rank
        elif version == 3 or version == 4:
            cls = data[1]
            if cls == 0:
                size = self.uint(data, 2, 2, "compact data size")
                self._fits(size, len(data) - 4, where)
                return "compact", [(where + 4, size)], 0
            if cls == 1:
                address = self.addr(data, 2, "layout address")
                size = self.uint(data, 2 + o, ln, "contiguous data size")
                return "contiguous", [] if address == _UNDEFINED else [(address, size)], 0
            if cls == 2 and version == 3:
                rank = data[2]
                address = self.addr(data, 3, "chunk B-tree address")
                return "chunked", [] if address == _UNDEFINED else [(address, -1)], rank
            if cls == 2:
                raise HDF5Error("chunked layout version 4 (libver 'latest' chunk indexes) is "
                                "not supported", where)
            if cls == 3:
                raise HDF5Error("virtual datasets are not supported", where)
        raise HDF5Error(f"data layout message version {version} is not supported", where)

    @staticmethod
    def _fits(size: int, room: int, where: int) -> None:
        if size > room:
            raise HDF5Error(f"compact data of {size} bytes in a layout message with {room} left",
                            where)

    def filters(self, data: bytes, where: int) -> tuple[str, ...]:
        version, count = (data[0], data[1]) if len(data) >= 2 else (0, 0)
        if version not in (1, 2) or count > 32:
            raise HDF5Error(f"filter pipeline version {version} with {count} filters", where)
        pos = 8 if version == 1 else 2
        names = []
        for _ in range(count):
            fid = self.uint(data, pos, 2, "filter id")
            if version == 1 or fid >= 256:
                name_len = self.uint(data, pos + 2, 2, "filter name length")
                nvalues = self.uint(data, pos + 6, 2, "filter values")
                pos += 8
            else:
                name_len = 0
                nvalues = self.uint(data, pos + 4, 2, "filter values")
                pos += 6
            if version == 1:
                name_len = (name_len + 7) & ~7
            pos += name_len + 4 * nvalues
            if version == 1 and nvalues % 2:
                pos += 4
            names.append(FILTER_NAMES.get(fid, f"filter {fid}"))
        return tuple(names)

    def chunks(self, address: int, rank: int) -> list[tuple[int, int]]:
        """(address, nbytes) of every chunk under a v1 B-tree of raw data chunks."""
        out: list[tuple[int, int]] = []
        stack = [(address, -1)]
        seen: set[int] = set()
        key_size = 8 + 8 * rank
        o = self.offset_size
        while stack:
            node, expected_level = stack.pop()
            if node in seen:
                raise HDF5Error("chunk B-tree nodes form a cycle", node)
            seen.add(node)
            self.count_object(node)
            head = self.read(node, 8 + 2 * o, "chunk B-tree node")
            if head[:4] != b"TREE" or head[4] != 1:
                raise HDF5Error(f"expected a chunk B-tree node, found {head[:5]!r}", node)
            level, used = head[5], int.from_bytes(head[6:8], "little")
            if expected_level >= 0 and level != expected_level:
                raise HDF5Error(f"B-tree node at level {level}, expected {expected_level}", node)
            body = self.read(node + 8 + 2 * o, used * (key_size + o) + key_size,
                             "chunk B-tree entries")
            for i in range(used):
                pos = i * (key_size + o)
                size = self.uint(body, pos, 4, "chunk size")
                child = self.addr(body, pos + key_size, "chunk address")
                if level == 0:
                    self.check(child, size, "chunk")
                    out.append((child, size))
                else:
                    stack.append((child, level - 1))
        out.sort()
        return out

    def attribute(self, msg: _Message) -> Attribute:
        data = self.read(msg.offset, msg.size, "attribute message")
        if len(data) < 8:
            raise HDF5Error("attribute message shorter than 8 bytes", msg.offset)
        version = data[0]
        name_size = int.from_bytes(data[2:4], "little")
        dt_size = int.from_bytes(data[4:6], "little")
        ds_size = int.from_bytes(data[6:8], "little")
        if version == 1:
            pad = lambda n: (n + 7) & ~7  # noqa: E731 - v1 pads each part to 8 bytes
            pos = 8
        elif version in (2, 3):
            pad = lambda n: n  # noqa: E731
            pos = 8 if version == 2 else 9
        else:
            raise HDF5Error(f"attribute message version {version} (expected 1-3)", msg.offset)
        if pos + pad(name_size) + pad(dt_size) + pad(ds_size) > len(data):
            raise HDF5Error("attribute parts run past the attribute message", msg.offset)
        name = _utf8(data[pos : pos + name_size].split(b"\x00", 1)[0], "attribute name",
                     msg.offset)
        pos += pad(name_size)
        dt = data[pos : pos + dt_size]
        pos += pad(dt_size)
        if version >= 2 and data[1] & 0x01:
            dtmsg = self.resolved(_Message(_DATATYPE, msg.offset + pos - dt_size, dt_size, 2))
            dt = self.read(dtmsg.offset, dtmsg.size, "shared datatype")
        shape = self.dataspace(data[pos : pos + ds_size], msg.offset + pos)
        pos += pad(ds_size)
        _, cname, itemsize = self.datatype(dt, msg.offset)
        count = 1
        for d in shape:
            count *= d
        start = msg.offset + pos
        nbytes = count * itemsize
        if pos + nbytes > len(data):
            raise HDF5Error(f"attribute {name!r} value of {nbytes} bytes runs past its message",
                            msg.offset)
        if cname == "vlen":
            return self._vlen_attribute(name, data[pos : pos + nbytes], count, dt)
        value: str | list[str] | None = None
        if cname == "string" and nbytes <= _DECODE_LIMIT:
            raw = data[pos : pos + nbytes]
            items = [
                raw[i : i + itemsize].rstrip(b"\x00").decode("utf-8", "replace")
                for i in range(0, nbytes, max(1, itemsize))
            ]
            value = items[0] if not shape and items else items
        return Attribute(name, value, ((start, nbytes),) if nbytes else ())

    def _vlen_attribute(self, name: str, raw: bytes, count: int, dt: bytes) -> Attribute:
        """Variable-length strings live in global heap collections; find their bytes."""
        is_string = bool(dt) and (dt[1] & 0x0F) == 1
        # Bytes per element of the sequence: 1 for a string, the base type's size otherwise.
        base = 1 if is_string or len(dt) < 16 else int.from_bytes(dt[12:16], "little")
        step = 4 + self.offset_size + 4
        ranges: list[tuple[int, int]] = []
        texts: list[str] = []
        total = 0
        for i in range(count):
            pos = i * step
            length = self.uint(raw, pos, 4, "variable-length size")
            collection = self.addr(raw, pos + 4, "global heap address")
            index = self.uint(raw, pos + 4 + self.offset_size, 4, "global heap index")
            if collection == _UNDEFINED or length == 0:
                texts.append("")
                continue
            where, size = self._heap_object(collection, index)
            if length * base != size:  # HDF5 allocates length * base before it checks
                raise HDF5Error(f"attribute {name!r}: variable-length value {i} claims "
                                f"{length * base} bytes, its global heap object holds {size}",
                                collection)
            ranges.append((where, size))
            total += size
            if is_string and total <= _DECODE_LIMIT:
                texts.append(self.read(where, min(size, length), "string").decode(
                    "utf-8", "replace"))
        value: str | list[str] | None = None
        if is_string and total <= _DECODE_LIMIT:
            value = texts[0] if count == 1 and texts else texts
        return Attribute(name, value, tuple(ranges))

    def _heap_object(self, collection: int, index: int) -> tuple[int, int]:
        head = self.read(collection, 8 + self.length_size, "global heap collection")
        if head[:4] != b"GCOL":
            raise HDF5Error(f"expected a global heap collection, found {head[:4]!r}", collection)
        size = self.uint(head, 8, self.length_size, "global heap size")
        self.check(collection, size, "global heap collection")
        data = self.read(collection, size, "global heap collection")
        # Walked whole, as HDF5 walks a collection when it loads it (H5HG__cache_heap_
        # deserialize): an object advances by its header and aligned size, the free-space
        # object (index 0) by its size alone; a tail too short for a header is free space.
        found: tuple[int, int] | None = None
        pos = 8 + self.length_size
        header = 8 + self.length_size
        while pos < size:
            if pos + header > size:
                break
            obj = self.uint(data, pos, 2, "heap object index")
            length = self.uint(data, pos + 8, self.length_size, "heap object size")
            start = pos + header
            if obj == 0:
                if length == 0:  # HDF5 would read the same header again, forever (h5py hung)
                    raise HDF5Error("global heap free space of 0 bytes before the end of its "
                                    "collection (HDF5 never finishes reading it)",
                                    collection + pos)
                pos += length
                continue
            if start + length > size:
                raise HDF5Error("global heap object runs past its collection", collection + pos)
            if obj == index and found is None:
                found = (collection + start, length)
            pos = start + ((length + 7) & ~7)
        if found is None:
            raise HDF5Error(f"global heap object {index} not found", collection)
        return found

    # -- groups ------------------------------------------------------------------------
    def symbol_table_links(self, data: bytes) -> list[tuple[str, int]]:
        btree = self.addr(data, 0, "group B-tree address")
        heap = self.addr(data, self.offset_size, "local heap address")
        head = self.read(heap, 8 + 2 * self.length_size + self.offset_size, "local heap")
        if head[:4] != b"HEAP":
            raise HDF5Error(f"expected a local heap, found {head[:4]!r}", heap)
        heap_size = self.uint(head, 8, self.length_size, "local heap size")
        heap_data = self.addr(head, 8 + 2 * self.length_size, "local heap data address")
        names = self.read(heap_data, heap_size, "local heap data")
        links: list[tuple[str, int]] = []
        o = self.offset_size
        stack = [(btree, -1)]
        seen: set[int] = set()
        while stack:
            node, expected_level = stack.pop()
            if node in seen:
                raise HDF5Error("group B-tree nodes form a cycle", node)
            seen.add(node)
            self.count_object(node)
            head = self.read(node, 8 + 2 * o, "group B-tree node")
            if head[:4] != b"TREE" or head[4] != 0:
                raise HDF5Error(f"expected a group B-tree node, found {head[:5]!r}", node)
            level, used = head[5], int.from_bytes(head[6:8], "little")
            if expected_level >= 0 and level != expected_level:
                raise HDF5Error(f"B-tree node at level {level}, expected {expected_level}", node)
            key = self.length_size
            body = self.read(node + 8 + 2 * o, used * (key + o) + key, "group B-tree entries")
            children = [self.addr(body, i * (key + o) + key, "B-tree child") for i in range(used)]
            if level > 0:
                stack.extend((c, level - 1) for c in reversed(children))
                continue
            for snod in children:
                links.extend(self._snod(snod, names))
        return links

    def _snod(self, address: int, names: bytes) -> Iterator[tuple[str, int]]:
        self.count_object(address)
        head = self.read(address, 8, "symbol table node")
        if head[:4] != b"SNOD":
            raise HDF5Error(f"expected a symbol table node, found {head[:4]!r}", address)
        count = int.from_bytes(head[6:8], "little")
        entry = 2 * self.offset_size + 24
        body = self.read(address + 8, count * entry, "symbol table entries")
        for i in range(count):
            name_at = self.uint(body, i * entry, self.offset_size, "link name offset")
            header = self.addr(body, i * entry + self.offset_size, "object header address")
            cache = self.uint(body, i * entry + 2 * self.offset_size, 4, "cache type")
            if cache == 2:
                continue  # a soft link: a path, no object of its own (as for link messages)
            if name_at >= len(names):
                raise HDF5Error(f"link name offset {name_at} outside a {len(names)}-byte heap",
                                address)
            end = names.find(b"\x00", name_at)
            name = _utf8(names[name_at : end if end >= 0 else len(names)], "link name", address)
            yield name, header

    def link(self, data: bytes, where: int) -> tuple[str, int] | None:
        """(name, object header address) of a hard link message; None for soft/external."""
        if len(data) < 2 or data[0] != 1:
            raise HDF5Error("link message version is not 1", where)
        flags = data[1]
        pos = 2
        kind = 0
        if flags & 0x08:
            kind = data[pos]
            pos += 1
        if flags & 0x04:
            pos += 8
        if flags & 0x10:
            pos += 1
        width = 1 << (flags & 3)
        name_len = self.uint(data, pos, width, "link name length")
        pos += width
        if pos + name_len > len(data):
            raise HDF5Error("link name runs past its message", where)
        name = _utf8(data[pos : pos + name_len], "link name", where)
        pos += name_len
        if kind != 0:
            return None
        return name, self.addr(data, pos, "link address")


def _utf8(raw: bytes, what: str, where: int) -> str:
    """A name as HDF5 stores it (ASCII or UTF-8); h5py, and so every loader, refuses others."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise HDF5Error(f"{what} {raw[:40]!r} is not UTF-8 (h5py cannot open it)", where) from exc


def read_hdf5(blob: Blob) -> H5File:
    """Walk an HDF5 file's groups and datasets; never reads raw data."""
    r = _Reader(blob)
    at = find_superblock(blob)
    if at is None:
        raise HDF5Error("no HDF5 signature at byte 0, 512, 1024, ...", 0)
    version, root = r.superblock(at)
    result = H5File(at, version)
    queue: list[tuple[str, int]] = [("/", root)]
    while queue:
        path, address = queue.pop()
        if address == _UNDEFINED:
            raise HDF5Error(f"object {path!r} has an undefined address")
        if address in r.visited:
            result.notes.append(f"{path} links to an object already seen (not counted twice)")
            continue
        r.visited.add(address)
        r.count_object(address)
        messages = r.messages(address)
        attrs: dict[str, Attribute] = {}
        links: list[tuple[str, int]] = []
        dtype: tuple[str | None, str, int] | None = None
        shape: tuple[int, ...] | None = None
        layout: tuple[str, list[tuple[int, int]], int] | None = None
        filters: tuple[str, ...] = ()
        for msg in messages:
            t = msg.type
            if t in (_DATATYPE, _DATASPACE, _LAYOUT, _FILTERS, _SYMBOL_TABLE, _LINK, _LINK_INFO):
                m = r.resolved(msg)
                data = r.read(m.offset, m.size, "object header message")
                if t == _DATATYPE:
                    dtype = r.datatype(data, m.offset)
                elif t == _DATASPACE:
                    shape = r.dataspace(data, m.offset)
                elif t == _LAYOUT:
                    layout = r.layout(data, m.offset)
                elif t == _FILTERS:
                    filters = r.filters(data, m.offset)
                elif t == _SYMBOL_TABLE:
                    links.extend(r.symbol_table_links(data))
                elif t == _LINK:
                    found = r.link(data, m.offset)
                    if found is not None:
                        links.append(found)
                elif t == _LINK_INFO and len(data) >= 2 + r.offset_size:
                    pos = 2 + (8 if data[1] & 1 else 0)
                    if r.addr(data, pos, "fractal heap address") != _UNDEFINED:
                        raise HDF5Error(f"group {path!r} stores its links densely (fractal heap); "
                                        "modelsize reads compact and symbol-table groups",
                                        m.offset)
            elif t == _ATTRIBUTE:
                attr = r.attribute(msg)
                attrs[attr.name] = attr
            elif t == _ATTRIBUTE_INFO:
                data = r.read(msg.offset, msg.size, "attribute info message")
                pos = 2 + (2 if len(data) > 1 and data[1] & 1 else 0)
                if r.addr(data, pos, "dense attribute heap address") != _UNDEFINED:
                    result.notes.append(f"{path} keeps attributes in dense storage (not decoded)")
        if layout is not None:
            if dtype is None or shape is None:
                raise HDF5Error(f"dataset {path!r} lacks a datatype or dataspace", address)
            kind, pieces, rank = layout
            if kind == "chunked" and pieces:
                pieces = r.chunks(pieces[0][0], rank)
            elif kind == "contiguous" and pieces and pieces[0][1] == _DERIVED:
                size = dtype[2]
                for d in shape:
                    size *= d
                pieces = [(pieces[0][0], size)]
            for start, nbytes in pieces:
                r.check(start, nbytes, f"raw data of {path}")
            result.datasets.append(
                Dataset(path, address, dtype[0], dtype[1], dtype[2], shape, kind, pieces,
                        filters, attrs)
            )
            continue
        result.groups[path] = attrs
        prefix = "" if path == "/" else path
        queue.extend((f"{prefix}/{name}", child) for name, child in reversed(links))
    return result

