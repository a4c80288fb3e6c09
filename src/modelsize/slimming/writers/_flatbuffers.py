"""FlatBuffers read into a tree and written back, driven by a schema; no flatbuffers package.

A flatbuffer is a root ``uoffset`` (and a 4-byte file identifier), then tables, vectors and
strings that point to each other with unsigned offsets relative to where each offset is
stored; a table starts with a signed offset to its *vtable* (``u16`` vtable size, ``u16``
table size, one ``u16`` position per field slot, 0 when the field is absent).

:func:`read` turns one into :class:`Table` objects (a table's present fields by name: ints for
integer scalars, the raw bytes of float scalars, ``bytes`` for strings and vectors of scalars,
lists for vectors of strings and tables, a :class:`Table` for a table or a union's value).
A table two offsets point to is one object: change a :meth:`Table.copy`, not the table.
A field the schema does not know (a newer schema) is :class:`Unsupported`: its width and
whether it points somewhere cannot be known, so it cannot be carried over. Vectors named in
``lazy`` are not read: they become :class:`Data` (their offset and size in the input).

:class:`Builder` writes a tree back *forward*: the root table first, each table after the one
that points to it (every uoffset points forward, as the format requires), then strings and
vectors of scalars, then the :class:`Data` vectors, each aligned to its ``force_align``
(buffer bytes: 16), and last the :class:`Data` placed outside the flatbuffer (at absolute file
offsets, for models past 2 GB), then a tail. Vtables that are equal are written once. Scalars
are aligned to their size relative to the start of the file, as the verifier checks. The
result is a :class:`Layout`: the bytes, with the places where data is to be streamed in.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

#: Largest flatbuffer (and largest uoffset) readers accept (``FLATBUFFERS_MAX_BUFFER_SIZE``).
MAX_FLATBUFFER = (1 << 31) - 1

_SCALAR_CODES = frozenset("bBhHiIqQfd?")
_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")
_U16 = struct.Struct("<H")


class FlatbufferError(Exception):
    """The input breaks the format: ``reason`` at byte ``offset``."""

    def __init__(self, reason: str, offset: int) -> None:
        super().__init__(reason)
        self.reason = reason
        self.offset = offset


class Unsupported(Exception):
    """The input uses something the schema does not describe (a newer schema)."""


@dataclass(frozen=True)
class FieldType:
    """The type of one field slot."""

    kind: str  # scalar, utype, string, vector, strings, table, tables, union
    fmt: str = ""  # struct code of a scalar or of a vector's elements
    ref: str = ""  # table or union name
    align: int = 0  # force_align of a vector's elements

    @property
    def width(self) -> int:
        """Bytes the field takes inside its table."""
        if self.kind == "scalar":
            return struct.calcsize("<" + self.fmt)
        return 1 if self.kind == "utype" else 4

    @property
    def elem(self) -> int:
        """Bytes per element of a vector of scalars."""
        return struct.calcsize("<" + self.fmt)


@dataclass(frozen=True)
class TableSchema:
    """A table's fields, in slot order."""

    name: str
    fields: tuple[tuple[str, FieldType], ...]

    @property
    def slots(self) -> dict[str, int]:
        """Field name -> slot."""
        return {name: i for i, (name, _) in enumerate(self.fields)}


@dataclass(frozen=True)
class Schema:
    """Tables and unions of one flatbuffer schema."""

    tables: Mapping[str, TableSchema]
    unions: Mapping[str, tuple[str, ...]]
    root: str
    identifier: bytes

    @classmethod
    def parse(cls, tables: Mapping[str, str], unions: Mapping[str, Iterable[str]], *,
              root: str, identifier: bytes) -> Schema:
        """Build from ``{table: "name:type name:type ..."}`` (see ``_tflite_schema``)."""
        out: dict[str, TableSchema] = {}
        for name, spec in tables.items():
            fields: list[tuple[str, FieldType]] = []
            for token in spec.split():
                fname, _, ftype = token.partition(":")
                if ftype.startswith("U:"):
                    fields.append((fname + "_type", FieldType("utype", "B")))
                    fields.append((fname, FieldType("union", ref=ftype[2:])))
                else:
                    fields.append((fname, _field_type(ftype, tables)))
            out[name] = TableSchema(name, tuple(fields))
        schema = cls(out, {k: tuple(v) for k, v in unions.items()}, root, identifier)
        for members in schema.unions.values():
            for member in members:
                if member not in out:
                    raise ValueError(f"union member {member} is no table of the schema")
        return schema


def _field_type(spec: str, tables: Mapping[str, str]) -> FieldType:
    align = 0
    if "/" in spec:
        spec, _, a = spec.partition("/")
        align = int(a)
    if spec.startswith("[") and spec.endswith("]"):
        inner = spec[1:-1]
        if inner in _SCALAR_CODES:
            return FieldType("vector", "B" if inner == "?" else inner, align=align)
        if inner == "str":
            return FieldType("strings")
        if inner in tables:
            return FieldType("tables", ref=inner)
    elif spec in _SCALAR_CODES:
        return FieldType("scalar", "B" if spec == "?" else spec)
    elif spec == "str":
        return FieldType("string")
    elif spec in tables:
        return FieldType("table", ref=spec)
    raise ValueError(f"unknown field type {spec!r}")


class Table:
    """One table: its schema and the values of the fields present, by name."""

    __slots__ = ("schema", "values")

    def __init__(self, schema: TableSchema, values: dict[str, Any] | None = None) -> None:
        self.schema = schema
        self.values: dict[str, Any] = values if values is not None else {}

    def get(self, name: str, default: Any = None) -> Any:
        """A field's value, ``default`` when absent."""
        return self.values.get(name, default)

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    def __setitem__(self, name: str, value: Any) -> None:
        if name not in self.schema.slots:
            raise KeyError(f"{self.schema.name} has no field {name}")
        self.values[name] = value

    def __contains__(self, name: str) -> bool:
        return name in self.values

    def pop(self, name: str) -> Any:
        """Remove a field (absent: the schema's default)."""
        return self.values.pop(name, None)

    def ints(self, name: str) -> list[int]:
        """A vector of integers as a list (empty when absent)."""
        raw = self.values.get(name)
        if not raw:
            return []
        ftype = dict(self.schema.fields)[name]
        return list(struct.unpack(f"<{len(raw) // ftype.elem}{ftype.fmt}", raw))

    def set_ints(self, name: str, values: Iterable[int]) -> None:
        """Set a vector of integers."""
        ftype = dict(self.schema.fields)[name]
        items = list(values)
        self[name] = struct.pack(f"<{len(items)}{ftype.fmt}", *items)

    def copy(self) -> Table:
        """A shallow copy (the field values are shared)."""
        return Table(self.schema, dict(self.values))


@dataclass(eq=False)
class Data:
    """Bytes the builder places but does not hold: a vector's elements, or (``external``)
    bytes after the flatbuffer found through :class:`DataOffset` and :class:`DataSize`.
    ``source`` is for the caller (where the bytes come from)."""

    nbytes: int
    align: int = 16
    source: Any = None
    external: bool = False
    elem: int = 1


@dataclass(frozen=True, eq=False)
class DataOffset:
    """A ``Q`` scalar that will hold the absolute file offset of an external :class:`Data`."""

    data: Data


@dataclass(frozen=True, eq=False)
class DataSize:
    """A ``Q`` scalar that will hold the size of a :class:`Data` (``nbytes``)."""

    data: Data


# -- reading ---------------------------------------------------------------------------------
class _Reader:
    def __init__(self, buf: Any, schema: Schema, lazy: frozenset[tuple[str, str]]) -> None:
        self.buf = buf
        self.size = len(buf)
        self.schema = schema
        self.lazy = lazy
        self.end = 8  # one past the last byte read
        #: Tables already read, by position: a table two offsets point to is one object (and
        #: a vector of a million offsets to one table costs a million references, not tables).
        self.seen: dict[tuple[int, str], Table] = {}

    def need(self, pos: int, n: int, what: str) -> None:
        if pos < 0 or n < 0 or pos + n > self.size:
            raise FlatbufferError(f"{what} claims bytes {pos}..{pos + n} but the file has "
                                  f"{self.size}", pos)
        if pos + n > self.end:
            self.end = pos + n

    def u32(self, pos: int, what: str) -> int:
        self.need(pos, 4, what)
        return int(_U32.unpack_from(self.buf, pos)[0])

    def deref(self, pos: int, what: str) -> int:
        target = pos + self.u32(pos, what)
        self.need(target, 4, what)
        return target

    def table(self, pos: int, ts: TableSchema, what: str) -> Table:
        seen = self.seen.get((pos, ts.name))
        if seen is not None:
            return seen
        self.need(pos, 4, what)
        vtable = pos - int(_I32.unpack_from(self.buf, pos)[0])
        self.need(vtable, 4, f"vtable of {what}")
        vt_size, inline = struct.unpack_from("<HH", self.buf, vtable)
        if vt_size < 4 or vt_size % 2 or inline < 4:
            raise FlatbufferError(f"{what} has a malformed vtable (size {vt_size}, table "
                                  f"{inline})", vtable)
        self.need(vtable, vt_size, f"vtable of {what}")
        self.need(pos, inline, what)
        n_slots = (vt_size - 4) // 2
        offsets = struct.unpack_from(f"<{n_slots}H", self.buf, vtable + 4)
        values: dict[str, Any] = {}
        for slot, off in enumerate(offsets):
            if off == 0:
                continue
            if slot >= len(ts.fields):
                raise Unsupported(f"{what} has field {slot}, which the TFLite schema modelsize "
                                  f"knows ({len(ts.fields)} fields of {ts.name}) has not: a "
                                  "newer schema")
            name, ftype = ts.fields[slot]
            if off + ftype.width > inline:
                raise FlatbufferError(f"field {name} of {what} lies outside its table", pos)
            values[name] = self.value(pos + off, ftype, ts, name, values, f"{what}.{name}")
        table = Table(ts, values)
        self.seen[(pos, ts.name)] = table
        return table

    def value(self, at: int, ftype: FieldType, ts: TableSchema, name: str,
              values: dict[str, Any], what: str) -> Any:
        kind = ftype.kind
        if kind in ("scalar", "utype"):
            if ftype.fmt in "fd":
                return bytes(self.buf[at:at + ftype.width])
            return struct.unpack_from("<" + ftype.fmt, self.buf, at)[0]
        target = self.deref(at, what)
        if kind == "string":
            n = self.u32(target, what)
            self.need(target + 4, n + 1, what)
            return bytes(self.buf[target + 4:target + 4 + n])
        if kind == "vector":
            n = self.u32(target, what)
            self.need(target + 4, n * ftype.elem, what)
            if (ts.name, name) in self.lazy:
                return Data(n * ftype.elem, max(ftype.align, ftype.elem), source=target + 4,
                            elem=ftype.elem)
            return bytes(self.buf[target + 4:target + 4 + n * ftype.elem])
        if kind == "table":
            return self.table(target, self.schema.tables[ftype.ref], what)
        if kind == "union":
            type_id = values.get(name + "_type", 0)
            members = self.schema.unions[ftype.ref]
            if not 1 <= type_id <= len(members):
                if type_id == 0:
                    return None
                raise Unsupported(f"{what} is a {ftype.ref} of type {type_id}, which the TFLite "
                                  f"schema modelsize knows ({len(members)} types) has not")
            return self.table(target, self.schema.tables[members[type_id - 1]], what)
        n = self.u32(target, what)
        self.need(target + 4, 4 * n, what)
        if kind == "tables":
            sub = self.schema.tables[ftype.ref]
            return [self.table(self.deref(target + 4 + 4 * i, what), sub, f"{what}[{i}]")
                    for i in range(n)]
        out = []  # strings
        for i in range(n):
            s = self.deref(target + 4 + 4 * i, what)
            k = self.u32(s, what)
            self.need(s + 4, k + 1, what)
            out.append(bytes(self.buf[s + 4:s + 4 + k]))
        return out


def read(buf: Any, schema: Schema, lazy: Iterable[tuple[str, str]] = ()) -> tuple[Table, int]:
    """The root table of ``buf`` and the end of the bytes it reaches (where a tail begins).

    ``lazy`` names ``(table, field)`` vectors left unread: :class:`Data` whose ``source`` is
    the input offset of their first element.
    """
    reader = _Reader(buf, schema, frozenset(lazy))
    if reader.size < 8 or bytes(buf[4:8]) != schema.identifier:
        raise FlatbufferError(f"no {schema.identifier.decode()} file identifier", 4)
    root = reader.table(reader.deref(0, "root offset"), schema.tables[schema.root],
                        schema.root)
    return root, reader.end


# -- writing ---------------------------------------------------------------------------------
@dataclass
class Layout:
    """A written flatbuffer as pieces at increasing offsets: ``bytes`` (the tables, vectors and
    strings; each data vector's length) and :class:`Data` (to be streamed in by the caller);
    zero padding between them. ``size`` bytes in all, of which the first ``flatbuffer_size``
    are the flatbuffer (what follows is external data and the tail)."""

    pieces: list[tuple[int, bytes | Data]]
    size: int
    flatbuffer_size: int

    def stream(self) -> Iterator[bytes | Data]:
        """The pieces in file order with the padding between them, to write one by one."""
        pos = 0
        for at, piece in self.pieces:
            if at > pos:
                yield bytes(at - pos)
            yield piece
            pos = at + (piece.nbytes if isinstance(piece, Data) else len(piece))
        if self.size > pos:
            yield bytes(self.size - pos)


@dataclass
class _Pending:
    field_at: int  # where the uoffset goes
    value: Any
    ftype: FieldType


@dataclass
class Builder:
    """Writes a :class:`Table` tree as a flatbuffer (see the module docstring)."""

    schema: Schema
    out: bytearray = field(default_factory=bytearray)
    vtables: dict[bytes, int] = field(default_factory=dict)
    leaves: list[_Pending] = field(default_factory=list)
    inline_data: list[tuple[int, Data]] = field(default_factory=list)
    external: list[tuple[int, Any]] = field(default_factory=list)  # (field_at, DataOffset|Size)

    def build(self, root: Table, tail: Data | None = None) -> Layout:
        """Lay out ``root`` and everything it reaches, then external data, then ``tail``."""
        self.out = bytearray(8)
        self.out[4:8] = self.schema.identifier
        at = self._table(root)
        _U32.pack_into(self.out, 0, at)
        i = 0
        while i < len(self.leaves):  # vectors of strings add strings as they are written
            self._leaf(self.leaves[i])
            i += 1
        pieces: list[tuple[int, bytes | Data]] = []
        cursor = len(self.out)
        for field_at, data in self.inline_data:
            start = _align(cursor + 4, max(4, data.align))  # elements aligned, length before
            pieces.append((start - 4, _U32.pack(data.nbytes // data.elem)))
            pieces.append((start, data))
            self._offset(field_at, start - 4)
            cursor = start + data.nbytes
        flatbuffer_size = cursor
        if flatbuffer_size > MAX_FLATBUFFER:
            raise ValueError(f"the flatbuffer would be {flatbuffer_size} bytes, past the 2 GB "
                             "FlatBuffers limit")
        placed: dict[int, int] = {}
        for _, ref in self.external:
            data = ref.data
            if isinstance(ref, DataOffset) and not data.external:
                raise ValueError("a data offset names data inside the flatbuffer")
            if data.external and id(data) not in placed:
                start = _align(cursor, max(1, data.align))
                placed[id(data)] = start
                pieces.append((start, data))
                cursor = start + data.nbytes
        for field_at, ref in self.external:
            value = ref.data.nbytes if isinstance(ref, DataSize) else placed[id(ref.data)]
            struct.pack_into("<Q", self.out, field_at, value)
        if tail is not None and tail.nbytes:
            pieces.append((cursor, tail))
            cursor += tail.nbytes
        return Layout([(0, bytes(self.out)), *pieces], cursor, flatbuffer_size)

    def _grow(self, n: int) -> None:
        if len(self.out) < n:
            self.out.extend(bytes(n - len(self.out)))

    def _offset(self, field_at: int, target: int) -> None:
        rel = target - field_at
        if not 0 < rel <= MAX_FLATBUFFER:
            raise ValueError(f"uoffset {rel} at {field_at} does not point forward")
        _U32.pack_into(self.out, field_at, rel)

    def _table(self, table: Table) -> int:
        """Write ``table`` (vtable first when new), then the tables it points to."""
        ts = table.schema
        present: list[tuple[int, str, FieldType, Any]] = []
        for slot, (name, ftype) in enumerate(ts.fields):
            value = table.values.get(name)
            if value is None:
                continue
            if ftype.kind == "utype":
                union = table.values.get(name[: -len("_type")])
                if union is None:
                    continue
                value = self._union_id(ts.fields[slot + 1][1].ref, union)
            present.append((slot, name, ftype, value))
        # Widest fields first after the vtable offset; one 4-byte field fills the hole before
        # 8-byte ones.
        order = sorted(present, key=lambda p: -p[2].width)
        wide = [p for p in order if p[2].width == 8]
        if wide:
            four = next((p for p in order if p[2].width == 4), None)
            if four is not None:
                order.remove(four)
                order.insert(0, four)
        positions: dict[int, int] = {}
        cursor = 4
        for slot, _, ftype, _ in order:
            cursor = _align(cursor, ftype.width)
            positions[slot] = cursor
            cursor += ftype.width
        inline = max(cursor, 4)
        n_slots = max(positions) + 1 if positions else 0
        vt = struct.pack(f"<HH{n_slots}H", 4 + 2 * n_slots, inline,
                         *(positions.get(i, 0) for i in range(n_slots)))
        align = max(4, *(p[2].width for p in present)) if present else 4
        vt_at = self.vtables.get(vt)
        if vt_at is None:
            vt_at = _align(len(self.out), 2)
            self._grow(vt_at)
            self.out.extend(vt)
            self.vtables[vt] = vt_at
        at = _align(len(self.out), align)
        self._grow(at + inline)
        _I32.pack_into(self.out, at, at - vt_at)
        children: list[tuple[int, FieldType, Any]] = []
        for slot, _name, ftype, value in present:
            pos = at + positions[slot]
            if ftype.kind in ("scalar", "utype"):
                self._scalar(pos, ftype, value)
            else:
                children.append((pos, ftype, value))
        for pos, ftype, value in children:
            if ftype.kind in ("table", "union"):
                self._offset(pos, self._table(value))
            elif ftype.kind == "tables":
                self._offset(pos, self._tables(value))
            elif isinstance(value, Data):
                self.inline_data.append((pos, value))
            else:
                self.leaves.append(_Pending(pos, value, ftype))
        return at

    def _union_id(self, union: str, value: Table) -> int:
        return self.schema.unions[union].index(value.schema.name) + 1

    def _scalar(self, pos: int, ftype: FieldType, value: Any) -> None:
        if isinstance(value, (DataOffset, DataSize)):
            if ftype.fmt != "Q":
                raise ValueError("data offsets and sizes are ulong fields")
            self.external.append((pos, value))
        elif isinstance(value, bytes):
            if len(value) != ftype.width:
                raise ValueError(f"{len(value)} raw bytes for a {ftype.width}-byte field")
            self.out[pos:pos + ftype.width] = value
        else:
            struct.pack_into("<" + ftype.fmt, self.out, pos, value)

    def _tables(self, tables: list[Table]) -> int:
        at = _align(len(self.out), 4)
        self._grow(at + 4 + 4 * len(tables))
        _U32.pack_into(self.out, at, len(tables))
        for i, t in enumerate(tables):
            self._offset(at + 4 + 4 * i, self._table(t))
        return at

    def _leaf(self, p: _Pending) -> None:
        if p.ftype.kind == "string":
            at = _align(len(self.out), 4)
            self._grow(at)
            self.out += _U32.pack(len(p.value)) + p.value + b"\0"
        elif p.ftype.kind == "strings":
            at = _align(len(self.out), 4)
            self._grow(at + 4 + 4 * len(p.value))
            _U32.pack_into(self.out, at, len(p.value))
            for i, s in enumerate(p.value):
                self.leaves.append(_Pending(at + 4 + 4 * i, s, FieldType("string")))
        else:
            elem = p.ftype.elem
            if len(p.value) % elem:
                raise ValueError(f"a vector of {p.ftype.fmt} holds {len(p.value)} bytes")
            at = _align(len(self.out) + 4, max(4, elem, p.ftype.align)) - 4
            self._grow(at)
            self.out += _U32.pack(len(p.value) // elem) + p.value
        self._offset(p.field_at, at)


def _align(n: int, a: int) -> int:
    return -(-n // a) * a
