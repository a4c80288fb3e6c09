"""A seeded mutation engine for model files: byte-level and structure-aware mutations.

Generic mutations work on any bytes: bit flips, bytes set to boundary values, integers of 2, 4
or 8 bytes overwritten, truncation, extension, chunks duplicated, deleted or copied over others.
Structure-aware ones find the integers a reader trusts and set one to a boundary value (0, 1,
all ones, the signed limits, the file size and its neighbours, huge sizes):

=============  ==============================================================================
family         fields found
=============  ==============================================================================
zip            end-of-central-directory counts, sizes and offset; each entry's method, CRC,
               sizes, name and extra lengths and local offset, in the central directory and
               the local header; names made equal to another entry's; and a member's own
               content mutated by its family with the CRCs fixed (in place when stored and
               the length is kept, else the archive is rebuilt)
pickle         every length-prefixed argument (strings, bytes, frames), integers, memo indices;
               opcodes replaced, deleted or repeated; a string argument replaced by another
safetensors    the header length; numbers, dtypes and names in the JSON header (the length
               prefix kept consistent, so the mutation reaches the reader's parser)
npy            numbers, ``descr`` and ``fortran_order`` in the header dict; the header length
json           numbers and strings of a JSON document (an index, a config)
protobuf       varints and lengths of every field, nested messages walked (ONNX, ``.pb``)
sstable        TF checkpoint ``.index``: varints of entries and handles, the protobuf values,
               with the block CRC recomputed
gguf           counts, string lengths, value types, array counts, dims, tensor types, offsets
hdf5, t7,      integers of 4 and 8 bytes whose value could be an address, a length or a count
flatbuffer     (flatbuffer: 4-aligned offsets and 2-aligned vtable entries)
=============  ==============================================================================

Everything here is the standard library only and deterministic for a given ``random.Random``:
each mutation returns a description that, with the seed file, reproduces it.
"""

from __future__ import annotations

import io
import json
import pickletools
import random
import re
import struct
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass

#: Values each byte is set to by :func:`set_byte`.
BOUNDARY_BYTES = (0x00, 0xFF, 0x7F, 0x80, 0x01, 0xFE)


@dataclass(frozen=True)
class Field:
    """An integer a reader trusts: ``width`` bytes at ``offset``, or a varint (``width`` 0,
    ``size`` its encoded length)."""

    offset: int
    width: int
    label: str
    big_endian: bool = False
    size: int = 0
    signed: bool = False


def boundary_values(width: int, current: int, file_size: int, rng: random.Random) -> list[int]:
    """Values worth trying for an integer field of ``width`` bytes (0: a varint of 64 bits)."""
    bits = 64 if width == 0 else 8 * width
    top = (1 << bits) - 1
    values = [0, 1, top, top >> 1, (top >> 1) + 1, top - 1, current + 1, max(current - 1, 0),
              current * 2, current >> 1, file_size, file_size + 1, max(file_size - 1, 0),
              rng.randrange(0, max(file_size, 2))]
    if bits > 16:
        values += [0xFFFF, 0x10000, 1 << 31, (1 << 31) - 1, 1 << 30]
    if bits > 32:
        values += [1 << 32, (1 << 32) - 1, 1 << 40, 1 << 62, (1 << 63) - 1]
    return [v & top for v in values]


# -- generic byte mutations --------------------------------------------------------------------


def _pos(data: bytes | bytearray, rng: random.Random) -> int:
    """A position, biased towards where structure lives: the start and the end of the file."""
    n = len(data)
    r = rng.random()
    if r < 0.4:
        return rng.randrange(min(n, 4096))
    if r < 0.6:
        return max(0, n - 1 - rng.randrange(min(n, 1024)))
    return rng.randrange(n)


def bit_flip(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    out = bytearray(data)
    flips = []
    for _ in range(rng.choice((1, 1, 2, 4, 8))):
        p, b = _pos(out, rng), rng.randrange(8)
        out[p] ^= 1 << b
        flips.append(f"{p}.{b}")
    return bytes(out), "bit flip " + ",".join(flips)


def set_byte(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    out = bytearray(data)
    p, v = _pos(out, rng), rng.choice(BOUNDARY_BYTES)
    out[p] = v
    return bytes(out), f"byte {p} = {v:#x}"


def set_int(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    width = rng.choice((2, 4, 8))
    if len(data) < width:
        return set_byte(data, rng)
    p = min(_pos(data, rng), len(data) - width)
    big = rng.random() < 0.2
    cur = int.from_bytes(data[p:p + width], "big" if big else "little")
    v = rng.choice(boundary_values(width, cur, len(data), rng))
    return (data[:p] + v.to_bytes(width, "big" if big else "little") + data[p + width:],
            f"int{8 * width}{'be' if big else ''} at {p} = {v}")


def truncate(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    r = rng.random()
    if r < 0.3:
        n = rng.randrange(len(data))
    elif r < 0.6:
        n = max(0, len(data) - rng.randrange(1, min(len(data), 64) + 1))
    else:
        n = rng.randrange(min(len(data), 4096))
    return data[:n], f"truncated to {n}"


def extend(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    n = rng.choice((1, 7, 64, 1000, 4096))
    kind = rng.choice(("zeros", "ff", "random", "copy"))
    tail = {"zeros": bytes(n), "ff": b"\xff" * n,
            "random": bytes(rng.randrange(256) for _ in range(n)),
            "copy": data[:n]}[kind]
    return data + tail, f"extended by {len(tail)} {kind}"


def chunk_dup(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    a = _pos(data, rng)
    n = rng.choice((1, 4, 8, 16, 64, 256))
    at = _pos(data, rng)
    return data[:at] + data[a:a + n] + data[at:], f"chunk {a}+{n} inserted at {at}"


def chunk_del(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    a = _pos(data, rng)
    n = rng.choice((1, 4, 8, 16, 64, 256))
    return data[:a] + data[a + n:], f"deleted {a}+{n}"


def chunk_copy(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    a, b = _pos(data, rng), _pos(data, rng)
    n = rng.choice((4, 8, 16, 64))
    piece = data[a:a + n]
    return data[:b] + piece + data[b + len(piece):], f"copied {a}+{n} over {b}"


GENERIC: tuple[Callable[[bytes, random.Random], tuple[bytes, str]], ...] = (
    bit_flip, set_byte, set_int, truncate, extend, chunk_dup, chunk_del, chunk_copy)


def generic(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    """One generic mutation (an empty input grows)."""
    if not data:
        return extend(data, rng)
    return rng.choice(GENERIC)(data, rng)


# -- integer fields ------------------------------------------------------------------------------


def _varint(data: bytes, p: int, end: int) -> tuple[int, int] | None:
    value = shift = 0
    while p < end and shift < 70:
        b = data[p]
        value |= (b & 0x7F) << shift
        p += 1
        if not b & 0x80:
            return value, p
        shift += 7
    return None


def encode_varint(value: int, size: int = 0) -> bytes:
    """``value`` as a varint; in exactly ``size`` bytes (non-minimal) when it fits there."""
    value &= (1 << 64) - 1
    if size and value < (1 << (7 * size)):
        return bytes(((value >> (7 * i)) & 0x7F) | (0x80 if i < size - 1 else 0)
                     for i in range(size))
    out = bytearray()
    while True:
        b = value & 0x7F
        value >>= 7
        out.append(b | (0x80 if value else 0))
        if not value:
            return bytes(out)


def set_field(data: bytes, f: Field, value: int) -> bytes:
    """``data`` with field ``f`` set to ``value`` (a varint may change length)."""
    if f.width == 0:
        return data[:f.offset] + encode_varint(value, f.size) + data[f.offset + f.size:]
    raw = (value & ((1 << (8 * f.width)) - 1)).to_bytes(f.width, "big" if f.big_endian else
                                                       "little")
    return data[:f.offset] + raw + data[f.offset + f.width:]


def field_value(data: bytes, f: Field) -> int:
    if f.width == 0:
        got = _varint(data, f.offset, len(data))
        return got[0] if got else 0
    return int.from_bytes(data[f.offset:f.offset + f.width], "big" if f.big_endian else "little")


def mutate_field(data: bytes, fields: list[Field], rng: random.Random, family: str
                 ) -> tuple[bytes, str]:
    f = rng.choice(fields)
    cur = field_value(data, f)
    v = rng.choice(boundary_values(f.width, cur, len(data), rng))
    return set_field(data, f, v), f"{family} {f.label} at {f.offset}: {cur} -> {v}"


def plausible_ints(data: bytes, widths: tuple[int, ...] = (4, 8), step: int = 1,
                   limit: int = 1 << 16) -> list[Field]:
    """Integers of 4/8 bytes whose value is below the file size (an address, a length, a
    count), at every ``step`` position of the first ``limit`` bytes (HDF5, t7, flatbuffers)."""
    size = len(data)
    out = []
    for w in widths:
        for p in range(0, min(size, limit) - w + 1, step):
            v = int.from_bytes(data[p:p + w], "little")
            if 0 < v < size:
                out.append(Field(p, w, f"int{8 * w}"))
    return out


# -- zip ---------------------------------------------------------------------------------------


@dataclass
class ZipEntry:
    name: bytes
    central: int  # offset of its central directory record
    local: int  # offset of its local header
    method: int
    crc: int
    csize: int
    usize: int


def zip_entries(data: bytes) -> tuple[int, list[ZipEntry]] | None:
    """(EOCD offset, entries) from the central directory, or None when there is none."""
    eocd = data.rfind(b"PK\x05\x06")
    if eocd < 0 or eocd + 22 > len(data):
        return None
    count, _cd_size, cd_off = struct.unpack_from("<HII", data, eocd + 10)
    z64 = data.rfind(b"PK\x06\x06", 0, eocd)
    if cd_off == 0xFFFFFFFF and z64 >= 0:
        count, _cd_size, cd_off = struct.unpack_from("<QQQ", data, z64 + 32)
    entries = []
    p = cd_off
    for _ in range(count):
        if data[p:p + 4] != b"PK\x01\x02" or p + 46 > len(data):
            break
        method, _t, _d, crc, csize, usize, nlen, xlen, clen = struct.unpack_from(
            "<HHHIIIHHH", data, p + 10)
        local = struct.unpack_from("<I", data, p + 42)[0]
        name = data[p + 46:p + 46 + nlen]
        extra = data[p + 46 + nlen:p + 46 + nlen + xlen]
        q = 0
        while q + 4 <= len(extra):  # zip64 sizes and offset
            hid, hlen = struct.unpack_from("<HH", extra, q)
            if hid == 1:
                vals = list(struct.unpack_from(f"<{hlen // 8}Q", extra, q + 4))
                if usize == 0xFFFFFFFF and vals:
                    usize = vals.pop(0)
                if csize == 0xFFFFFFFF and vals:
                    csize = vals.pop(0)
                if local == 0xFFFFFFFF and vals:
                    local = vals.pop(0)
            q += 4 + hlen
        entries.append(ZipEntry(name, p, local, method, crc, csize, usize))
        p += 46 + nlen + xlen + clen
    return eocd, entries


def zip_fields(data: bytes) -> list[Field]:
    found = zip_entries(data)
    if found is None:
        return []
    eocd, entries = found
    fields = [Field(eocd + 8, 2, "eocd entries on disk"), Field(eocd + 10, 2, "eocd entries"),
              Field(eocd + 12, 4, "eocd cd size"), Field(eocd + 16, 4, "eocd cd offset"),
              Field(eocd + 20, 2, "eocd comment length")]
    for e in entries:
        c, n = e.central, e.name.decode("utf-8", "replace")
        fields += [Field(c + 8, 2, f"{n} central flags"), Field(c + 10, 2, f"{n} central method"),
                   Field(c + 16, 4, f"{n} central crc"), Field(c + 20, 4, f"{n} central csize"),
                   Field(c + 24, 4, f"{n} central usize"), Field(c + 28, 2, f"{n} central nlen"),
                   Field(c + 30, 2, f"{n} central xlen"), Field(c + 42, 4, f"{n} local offset")]
        lo = e.local
        if data[lo:lo + 4] == b"PK\x03\x04":
            fields += [Field(lo + 6, 2, f"{n} local flags"), Field(lo + 8, 2, f"{n} local method"),
                       Field(lo + 14, 4, f"{n} local crc"), Field(lo + 18, 4, f"{n} local csize"),
                       Field(lo + 22, 4, f"{n} local usize"), Field(lo + 26, 2, f"{n} local nlen"),
                       Field(lo + 28, 2, f"{n} local xlen")]
    return fields


def zip_rename(data: bytes, rng: random.Random) -> tuple[bytes, str] | None:
    """One entry's name made another's (same length: a duplicate), or one character changed,
    in the central directory, the local header or both."""
    found = zip_entries(data)
    if not found or not found[1]:
        return None
    entries = found[1]
    e = rng.choice(entries)
    same = [o for o in entries if o is not e and len(o.name) == len(e.name)]
    if same and rng.random() < 0.6:
        new = rng.choice(same).name
    else:
        i = rng.randrange(len(e.name)) if e.name else 0
        new = e.name[:i] + bytes([rng.choice(b"/\\.\x00aZ0")]) + e.name[i + 1:]
    where = rng.choice(("central", "local", "both"))
    out = bytearray(data)
    if where in ("central", "both"):
        out[e.central + 46:e.central + 46 + len(new)] = new
    if where in ("local", "both") and data[e.local:e.local + 4] == b"PK\x03\x04":
        out[e.local + 30:e.local + 30 + len(new)] = new
    return bytes(out), f"zip name {e.name!r} -> {new!r} ({where})"


def zip_member(data: bytes, rng: random.Random, depth: int) -> tuple[bytes, str] | None:
    """One member's content mutated by its own family, the CRCs (and sizes) made right."""
    found = zip_entries(data)
    if not found:
        return None
    entries = [e for e in found[1] if e.usize and not e.name.endswith(b"/")]
    if not entries:
        return None
    e = rng.choice(entries)
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            content = zf.read(e.name.decode("utf-8"))
    except Exception:  # the archive is already broken; mutate it otherwise
        return None
    name = e.name.decode("utf-8", "replace")
    new, desc = mutate(content, family_of(name, content), rng, depth + 1)
    crc = zlib.crc32(new)
    lo = e.local
    if (e.method == 0 and len(new) == len(content) and data[lo:lo + 4] == b"PK\x03\x04"):
        nlen, xlen = struct.unpack_from("<HH", data, lo + 26)
        start = lo + 30 + nlen + xlen
        out = bytearray(data)
        out[start:start + len(new)] = new
        struct.pack_into("<I", out, lo + 14, crc)
        struct.pack_into("<I", out, e.central + 16, crc)
        return bytes(out), f"member {name}: {desc} (crc fixed)"
    return (_rebuild_zip(data, e.name, new),
            f"member {name}: {desc} (archive rebuilt)")


def _rebuild_zip(data: bytes, name: bytes, content: bytes) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(buf, "w") as dst:
        for info in src.infolist():
            raw = content if info.filename.encode() == name else src.read(info)
            zi = zipfile.ZipInfo(info.filename, info.date_time)
            zi.compress_type = info.compress_type
            dst.writestr(zi, raw)
    return buf.getvalue()


# -- pickle ------------------------------------------------------------------------------------

#: opcode name -> (width of its length/integer argument, label); the argument follows the
#: opcode byte.
_PICKLE_ARGS = {
    "BINUNICODE": (4, "str length"), "SHORT_BINUNICODE": (1, "str length"),
    "BINUNICODE8": (8, "str length"), "BINBYTES": (4, "bytes length"),
    "SHORT_BINBYTES": (1, "bytes length"), "BINBYTES8": (8, "bytes length"),
    "BYTEARRAY8": (8, "bytearray length"), "SHORT_BINSTRING": (1, "string length"),
    "BINSTRING": (4, "string length"), "FRAME": (8, "frame length"),
    "BININT": (4, "int"), "BININT1": (1, "int"), "BININT2": (2, "int"),
    "LONG1": (1, "long length"), "LONG4": (4, "long length"),
    "BINGET": (1, "memo get"), "LONG_BINGET": (4, "memo get"),
    "BINPUT": (1, "memo put"), "LONG_BINPUT": (4, "memo put"), "PROTO": (1, "protocol"),
}
_STRINGS = ("BINUNICODE", "SHORT_BINUNICODE")
#: Opcodes a replacement picks from: those that build and those that call.
_OPCODES = b"().0JKMNRX]abcdeghjlpqrstuQ}\x85\x86\x87\x88\x89\x8c\x93\x94\x95"


def pickle_ops(data: bytes, start: int = 0) -> list[tuple[str, int, object]]:
    """(opcode name, position, argument) of the pickle at ``start`` (as far as it parses)."""
    ops = []
    try:
        for op, arg, pos in pickletools.genops(io.BytesIO(data[start:])):
            ops.append((op.name, start + (pos or 0), arg))
    except Exception:  # a broken pickle: the opcodes before the break
        pass
    return ops


def pickle_fields(data: bytes) -> list[Field]:
    return [Field(p + 1, _PICKLE_ARGS[n][0], f"pickle {n} {_PICKLE_ARGS[n][1]}",
                  signed=n == "BININT")
            for n, p, _ in pickle_ops(data) if n in _PICKLE_ARGS]


def pickle_opcode(data: bytes, rng: random.Random) -> tuple[bytes, str] | None:
    """An opcode replaced, deleted, repeated, or a string argument made another's."""
    ops = pickle_ops(data)
    if not ops:
        return None
    kind = rng.choice(("replace", "delete", "repeat", "string"))
    name, p, _arg = rng.choice(ops)
    if kind == "string":
        strings = [(n, q, a) for n, q, a in ops if n in _STRINGS and isinstance(a, str)]
        if len(strings) >= 2:
            (n1, q1, a1), (_n2, _q2, a2) = rng.sample(strings, 2)
            new = a2.encode("utf-8")
            old_len = len(a1.encode("utf-8")) + (5 if n1 == "BINUNICODE" else 2)
            enc = (b"X" + struct.pack("<I", len(new)) + new if len(new) > 255
                   else b"\x8c" + bytes([len(new)]) + new)
            return data[:q1] + enc + data[q1 + old_len:], f"pickle string {a1!r} -> {a2!r}"
        kind = "replace"
    if kind == "replace":
        b = rng.choice(_OPCODES)
        return data[:p] + bytes([b]) + data[p + 1:], f"pickle opcode {name} at {p} -> {b:#x}"
    nxt = next((q for _n, q, _a in ops if q > p), len(data))
    if kind == "delete":
        return data[:p] + data[nxt:], f"pickle {name} at {p} deleted"
    return data[:nxt] + data[p:nxt] + data[nxt:], f"pickle {name} at {p} repeated"


# -- JSON-headed formats -------------------------------------------------------------------------

_NUMBER = re.compile(rb"-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?")
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_NUMBERS_TRIED = (b"0", b"1", b"-1", b"2147483648", b"4294967296", b"9223372036854775807",
                  b"9223372036854775808", b"18446744073709551616", b"1e309", b"99999999999",
                  b"1.5", b"-9223372036854775809", b"00", b"1e2")
_STRINGS_TRIED = (b'"F16"', b'"BF16"', b'"F64"', b'"I8"', b'"U8"', b'"BOOL"', b'"F8_E4M3"',
                  b'"XX"', b'""', b'"<f4"', b'"<U99999999999"', b'"|O"', b'"|V8"', b'">i4"',
                  b'"<c16"', b'"|S0"', b'"<M8[s]"', b'"\\u0000"', b'"../x"', b'"a/../../b"',
                  b'[]', b'{}', b'null', b'true', b'[[[[[[[[1]]]]]]]]', b'[1, [2]]')


def json_text(doc: bytes, rng: random.Random) -> tuple[bytes, str]:
    """A number or a string of a JSON text replaced by a boundary one, or by another of the
    same text (a name made another's: duplicate keys), or an element deleted."""
    r = rng.random()
    if r < 0.45:
        spots = list(_NUMBER.finditer(doc))
        if spots:
            m = rng.choice(spots)
            new = rng.choice(_NUMBERS_TRIED)
            return doc[:m.start()] + new + doc[m.end():], (
                f"json number {m.group().decode()!r} at {m.start()} -> {new.decode()}")
    spots = list(_STRING.finditer(doc))
    if not spots:
        return generic(doc, rng)
    m = rng.choice(spots)
    if r < 0.75:
        new = rng.choice(_STRINGS_TRIED)
    elif r < 0.9:
        new = rng.choice(spots).group()
    else:  # an element out: the string and what follows it up to the next comma
        end = doc.find(b",", m.end())
        end = len(doc) - 1 if end < 0 else end + 1
        return doc[:m.start()] + doc[end:], f"json element at {m.start()} deleted"
    return doc[:m.start()] + new + doc[m.end():], (
        f"json string {m.group()[:40].decode('utf-8', 'replace')!r} -> "
        f"{new[:40].decode('utf-8', 'replace')}")


def safetensors_mutation(data: bytes, rng: random.Random) -> tuple[bytes, str] | None:
    if len(data) < 8:
        return None
    n = int.from_bytes(data[:8], "little")
    if rng.random() < 0.15 or n > len(data) - 8:
        return mutate_field(data, [Field(0, 8, "header length")], rng, "safetensors")
    header, rest = data[8:8 + n], data[8 + n:]
    new, desc = json_text(header, rng)
    if len(new) < len(header) and rng.random() < 0.7:
        new += b" " * (len(header) - len(new))  # the data stays where it was
    return len(new).to_bytes(8, "little") + new + rest, f"safetensors header: {desc}"


def npy_mutation(data: bytes, rng: random.Random) -> tuple[bytes, str] | None:
    if data[:6] != b"\x93NUMPY" or len(data) < 10:
        return None
    pre = 10 if data[6] == 1 else 12
    n = int.from_bytes(data[8:pre], "little")
    if rng.random() < 0.15:
        return mutate_field(data, [Field(8, pre - 8, "header length")], rng, "npy")
    header, rest = data[pre:pre + n], data[pre + n:]
    r = rng.random()
    if r < 0.15 and b"False" in header:
        new, desc = header.replace(b"False", b"True ", 1), "fortran_order True"
    else:
        new, desc = json_text(header, rng)
    if len(new) <= len(header):
        new = new[:-1] + b" " * (len(header) - len(new)) + new[-1:]
    return (data[:8] + len(new).to_bytes(pre - 8, "little") + new + rest,
            f"npy header: {desc}")


# -- protobuf, sstable -------------------------------------------------------------------------


def protobuf_fields(data: bytes, start: int = 0, end: int | None = None,
                    depth: int = 0) -> list[Field] | None:
    """The varints and lengths of a protobuf message (nested messages walked); None when
    ``data[start:end]`` is not one."""
    end = len(data) if end is None else end
    fields: list[Field] = []
    p = start
    while p < end:
        got = _varint(data, p, end)
        if got is None or got[0] >> 3 == 0:
            return None
        tag, q = got
        wt = tag & 7
        if wt == 0:
            got = _varint(data, q, end)
            if got is None:
                return None
            fields.append(Field(q, 0, f"pb field {tag >> 3} varint", size=got[1] - q))
            p = got[1]
        elif wt == 1:
            p = q + 8
        elif wt == 5:
            p = q + 4
        elif wt == 2:
            got = _varint(data, q, end)
            if got is None or got[1] + got[0] > end:
                return None
            fields.append(Field(q, 0, f"pb field {tag >> 3} length", size=got[1] - q))
            if depth < 12 and got[0]:
                inner = protobuf_fields(data, got[1], got[1] + got[0], depth + 1)
                if inner:
                    fields += inner
            p = got[1] + got[0]
        else:
            return None
    return fields if p == end else None


def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC32C = _crc32c_table()


def crc32c(data: bytes) -> int:
    c = 0xFFFFFFFF
    for b in data:
        c = _CRC32C[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    c = crc32c(data)
    return ((((c >> 15) | (c << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def _sstable_blocks(data: bytes) -> list[tuple[int, int]]:
    """(offset, size) of the data blocks and the index block of a LevelDB-format table."""
    if len(data) < 48:
        return []
    footer = len(data) - 48
    got = _varint(data, footer, len(data))
    blocks = []
    try:
        assert got is not None
        _meta_off, p = got
        got = _varint(data, p, len(data))
        assert got is not None
        _meta_size, p = got
        got = _varint(data, p, len(data))
        assert got is not None
        idx_off, p = got
        got = _varint(data, p, len(data))
        assert got is not None
        idx_size, p = got
    except AssertionError:
        return []
    blocks.append((idx_off, idx_size))
    for _key, value, _vpos in _block_entries(data, idx_off, idx_size):
        g1 = _varint(value, 0, len(value))
        if g1:
            g2 = _varint(value, g1[1], len(value))
            if g2:
                blocks.append((g1[0], g2[0]))
    return blocks


def _block_entries(data: bytes, off: int, size: int) -> list[tuple[bytes, bytes, int]]:
    end = off + size
    if end + 5 > len(data) or size < 4:
        return []
    nrest = int.from_bytes(data[end - 4:end], "little")
    limit = end - 4 - 4 * nrest
    out = []
    p, key = off, b""
    while p < limit:
        vals = []
        for _ in range(3):
            got = _varint(data, p, limit)
            if got is None:
                return out
            vals.append(got[0])
            p = got[1]
        shared, non_shared, vlen = vals
        key = key[:shared] + data[p:p + non_shared]
        p += non_shared
        out.append((key, data[p:p + vlen], p))
        p += vlen
    return out


def sstable_mutation(data: bytes, rng: random.Random) -> tuple[bytes, str] | None:
    """A varint of an entry or of a value's protobuf changed, the block's CRC recomputed."""
    blocks = [(o, s) for o, s in _sstable_blocks(data) if o + s + 5 <= len(data)]
    if not blocks:
        return None
    off, size = rng.choice(blocks)
    fields: list[Field] = []
    for _key, value, vpos in _block_entries(data, off, size):
        inner = protobuf_fields(value) or []
        fields += [Field(vpos + f.offset, 0, "entry " + f.label, size=f.size) for f in inner]
    p = off
    if not fields:  # the entry headers themselves
        got = _varint(data, p, off + size)
        if got:
            fields.append(Field(p, 0, "entry shared", size=got[1] - p))
    if not fields:
        return None
    f = rng.choice(fields)
    cur = field_value(data, f)
    v = rng.choice(boundary_values(0, cur, len(data), rng))
    enc = encode_varint(v, f.size)
    if len(enc) != f.size:
        enc = encode_varint(cur, f.size)  # keep the block's length: try another value
        v = cur ^ 1
        enc = encode_varint(v, f.size)
    out = bytearray(data[:f.offset] + enc + data[f.offset + f.size:])
    struct.pack_into("<I", out, off + size + 1, masked_crc32c(bytes(out[off:off + size + 1])))
    return bytes(out), f"sstable {f.label} at {f.offset}: {cur} -> {v} (block crc fixed)"


# -- gguf --------------------------------------------------------------------------------------

_GGUF_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def gguf_fields(data: bytes) -> list[Field]:
    """Every count, length, type, dim and offset of a little-endian GGUF header."""
    if data[:4] != b"GGUF" or len(data) < 24:
        return []
    fields = [Field(4, 4, "version"), Field(8, 8, "tensor count"), Field(16, 8, "kv count")]
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    p = 24

    def string(label: str) -> None:
        nonlocal p
        fields.append(Field(p, 8, label + " length"))
        p += 8 + int.from_bytes(data[p:p + 8], "little")

    def value(t: int, label: str, depth: int = 0) -> None:
        nonlocal p
        if t in _GGUF_SCALAR:
            p += _GGUF_SCALAR[t]
        elif t == 8:
            string(label)
        elif t == 9 and depth < 3:
            fields.append(Field(p, 4, label + " array type"))
            fields.append(Field(p + 4, 8, label + " array count"))
            it, count = struct.unpack_from("<IQ", data, p)
            p += 12
            if count > 100_000:
                raise ValueError
            for i in range(count):
                if i < 3 or it not in _GGUF_SCALAR:
                    value(it, f"{label}[{i}]", depth + 1)
                else:
                    p += _GGUF_SCALAR[it] * (count - i)
                    break
        else:
            raise ValueError

    try:
        for i in range(min(n_kv, 10_000)):
            string(f"kv{i} key")
            fields.append(Field(p, 4, f"kv{i} type"))
            t = int.from_bytes(data[p:p + 4], "little")
            p += 4
            value(t, f"kv{i}")
        for i in range(min(n_tensors, 10_000)):
            string(f"tensor{i} name")
            fields.append(Field(p, 4, f"tensor{i} n_dims"))
            nd = int.from_bytes(data[p:p + 4], "little")
            p += 4
            for d in range(min(nd, 8)):
                fields.append(Field(p + 8 * d, 8, f"tensor{i} dim{d}"))
            p += 8 * nd
            fields.append(Field(p, 4, f"tensor{i} type"))
            fields.append(Field(p + 4, 8, f"tensor{i} offset"))
            p += 12
            if p > len(data):
                break
    except (ValueError, struct.error):
        pass
    return [f for f in fields if f.offset + f.width <= len(data)]


# -- dispatch ----------------------------------------------------------------------------------


def family_of(name: str, data: bytes) -> str:
    """The family of a file (or zip member) from its magic bytes, else its name."""
    if data[:4] == b"PK\x03\x04" or data[:4] == b"PK\x05\x06":
        return "zip"
    if data[:6] == b"\x93NUMPY":
        return "npy"
    if data[:4] == b"GGUF":
        return "gguf"
    if data[:8] == b"\x89HDF\r\n\x1a\n":
        return "hdf5"
    if data[4:8] == b"TFL3":
        return "flatbuffer"
    if len(data) > 9 and data[8:9] == b"{" and int.from_bytes(data[:8], "little") < len(data):
        return "safetensors"
    if data[:1] == b"\x80" or name.endswith((".pkl", "data.pkl", ".metadata")):
        return "pickle"
    if name.endswith(".json") or data[:1] in (b"{", b"["):
        return "json"
    if name.endswith((".onnx", ".pb", ".meta")):
        return "protobuf"
    if name.endswith(".index"):
        return "sstable"
    if name.endswith(".t7"):
        return "t7"
    return "bytes"


def _structured(data: bytes, family: str, rng: random.Random, depth: int
                ) -> tuple[bytes, str] | None:
    if family == "zip":
        if depth < 2 and rng.random() < 0.5:
            got = zip_member(data, rng, depth)
            if got:
                return got
        if rng.random() < 0.2:
            return zip_rename(data, rng)
        fields = zip_fields(data)
        return mutate_field(data, fields, rng, "zip") if fields else None
    if family == "pickle":
        if rng.random() < 0.4:
            return pickle_opcode(data, rng)
        fields = pickle_fields(data)
        return mutate_field(data, fields, rng, "") if fields else None
    if family == "safetensors":
        return safetensors_mutation(data, rng)
    if family == "npy":
        return npy_mutation(data, rng)
    if family == "json":
        return json_text(data, rng)
    if family == "protobuf":
        fields = protobuf_fields(data)
        return mutate_field(data, fields, rng, "protobuf") if fields else None
    if family == "sstable":
        return sstable_mutation(data, rng)
    if family == "gguf":
        fields = gguf_fields(data)
        return mutate_field(data, fields, rng, "gguf") if fields else None
    if family in ("hdf5", "t7"):
        fields = plausible_ints(data)
        return mutate_field(data, fields, rng, family) if fields else None
    if family == "flatbuffer":
        fields = plausible_ints(data, (4,), 4) + [
            Field(f.offset, 2, "vtable u16") for f in plausible_ints(data, (2,), 2)
            if int.from_bytes(data[f.offset:f.offset + 2], "little") < 256]
        return mutate_field(data, fields, rng, "flatbuffer") if fields else None
    return None


def mutate(data: bytes, family: str, rng: random.Random, depth: int = 0) -> tuple[bytes, str]:
    """One mutation of ``data`` (of ``family``): structure-aware two times in three where the
    family has one, else generic. Returns the bytes and a description."""
    if family != "bytes" and rng.random() < 0.67:
        try:
            got = _structured(data, family, rng, depth)
        except Exception:  # a structure already broken by an earlier mutation
            got = None
        if got is not None and got[0] != data:
            return got
    return generic(data, rng)


def mutate_many(data: bytes, family: str, rng: random.Random) -> tuple[bytes, list[str]]:
    """One to three mutations stacked (mostly one)."""
    steps = []
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        data, desc = mutate(data, family, rng)
        steps.append(desc)
    return data, steps


def describe(value: object) -> str:
    """JSON text of a description (for reproducer files)."""
    return json.dumps(value, indent=1)
