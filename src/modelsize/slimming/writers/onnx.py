"""ONNX output: the input's ``ModelProto`` re-emitted at the protobuf wire level.

Written without the ``onnx`` package (which loads the whole model, weights included): every
field slim does not change is copied from the input byte for byte, and every kept tensor's
data is streamed into ``raw_data`` (or into the external data file) a chunk at a time. The
lengths protobuf puts before each nested message are computed from the plan before a byte is
written, so the output's size is known exactly (:mod:`._protowire`).

What changes, at the initializer level only:

* **unused initializers** (no node input, graph output or subgraph reads them, as the reader
  categorises them: ``unused_storage``) are removed, with their graph input and value_info
  entries;
* **duplicates** are stored once. The copy kept (the *holder*) is the initializer every other
  copy's graph can see (the outermost); each other copy is removed and every reference to its
  name, in its graph and in the subgraphs (``If``/``Loop``/``Scan`` bodies) that do not shadow
  the name, is renamed to the holder's; a copy that is an output of the model's graph is kept
  as that output by an ``Identity`` node instead, and a ``Constant`` node holding a copy
  becomes ``Identity(holder)``. A copy the holder cannot reach (an initializer of a sibling
  branch, a sparse tensor) keeps its own bytes, as the plan notes say;
* **--cast** stores a ``float32``/``float64`` initializer as ``NAME_float16`` (or
  ``_bfloat16``) and adds ``Cast(NAME_float16) -> NAME`` at the top of its graph, so every
  node still reads the original type; a ``Constant`` is cast the same way, its output renamed
  and the ``Cast`` right after it. The graph input of an overridable initializer is renamed
  and retyped with it.

A change never makes the file larger: a graph-output copy too small to pay for its
``Identity`` node keeps its own bytes, and an uncast tensor's typed fields (``int64_data`` of
small values: a byte or two an element where ``raw_data`` takes eight) are copied as they are
when smaller than ``raw_data`` would be. The graph passes (folding, dead code: the
:mod:`modelsize.slimming.graph` package) are not this writer's business.

Inline tensors stay inline. Tensors in external data files go to one file beside the output,
``OUT.data`` (``model.slim.onnx.data``), offsets rewritten, tensors of 1 MiB and more aligned
to 4096 bytes as onnxruntime aligns them, two tensors on the same bytes still sharing them.
"""

from __future__ import annotations

import os
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from modelsize import inputs
from modelsize.errors import UsageError, printable
from modelsize.formats import onnx as fmt
from modelsize.formats._protobuf import LEN, VARINT, Field, FileBuffer, iter_fields
from modelsize.formats.onnx import (
    GraphKind,
    GraphSite,
    NodeSite,
    Structure,
    TensorKind,
    TensorSite,
)
from modelsize.inventory import TensorRecord
from modelsize.slimming.loadable import refuse_unloadable
from modelsize.slimming.output import Output
from modelsize.slimming.plan import Plan, PlannedTensor, matches
from modelsize.slimming.writers._protowire import (
    Copy,
    Nested,
    Part,
    Parts,
    Raw,
    Sink,
    Streamed,
    bytes_field,
    key,
    varint,
    varint_field,
)
from modelsize.slimming.writers.base import Meter, Written, output_nbytes, slim_name, stream

#: canonical dtype -> ``TensorProto.DataType``.
ONNX_CODES: dict[str, int] = {name: code for code, name in fmt.ONNX_DTYPES.items()}
#: Tensors this large get an aligned offset in the external data file (onnxruntime's
#: ``align_threshold`` and ``on_disk_alignment_factor``: memory-mappable on every OS).
ALIGN_THRESHOLD = 1 << 20
ALIGN = 4096
#: Protobuf refuses messages of 2 GiB and more.
MAX_PROTO = (1 << 31) - 1
_CONSTANT_OPS = frozenset({"Constant", "ConstantOfShape"})
_DEFAULT_DOMAINS = frozenset({"", "ai.onnx"})
#: ``TensorProto`` fields that hold (or locate) the data.
_DATA_FIELDS = frozenset({4, 5, 6, 7, 9, 10, 11, 13, 14})
_EXTERNAL = 1
_ATTRIBUTE_INT = 2


@dataclass(eq=False)
class _Write:
    """The data one ``TensorProto`` of the output gets.

    ``source`` supplies the bytes (the original of a deduplicated group for its copies);
    ``record_as`` is the planned tensor whose CRC these bytes are (``None`` for a second copy
    the holder could not replace); ``name`` the new name of a cast tensor.
    """

    site: TensorSite
    source: PlannedTensor
    dtype: str
    record_as: str | None
    external: bool
    name: str = ""
    offset: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the data."""
        return output_nbytes(self.source)


@dataclass
class _Extent:
    """A range of the output data file and every tensor that points at it."""

    offset: int
    write: _Write
    shared: list[_Write] = field(default_factory=list)


def _cast_node(src: str, dst: str, dtype: str) -> bytes:
    """A ``NodeProto``: ``dst = Cast(src, to=dtype)``."""
    attr = bytes_field(1, "to") + varint_field(3, ONNX_CODES[dtype]) + varint_field(
        20, _ATTRIBUTE_INT)
    return (bytes_field(1, src) + bytes_field(2, dst) + bytes_field(3, f"modelsize/cast/{dst}")
            + bytes_field(4, "Cast") + bytes_field(5, attr))


def _identity_node(src: str, dst: str) -> bytes:
    """A ``NodeProto``: ``dst = Identity(src)``."""
    return (bytes_field(1, src) + bytes_field(2, dst)
            + bytes_field(3, f"modelsize/identity/{dst}") + bytes_field(4, "Identity"))


def _is_constant(site: TensorSite) -> bool:
    """Whether ``site`` is the value of a node whose one output is that value (``Constant``,
    ``ConstantOfShape``): casting it can rename the output and cast back."""
    node = site.node
    return (site.kind == TensorKind.NODE_TENSOR and node is not None
            and node.op_type in _CONSTANT_OPS and node.domain in _DEFAULT_DOMAINS
            and site.attribute == "value" and len(node.outputs) == 1 and bool(node.outputs[0]))


class _Rewrite:
    """Decides every change to the model, then lays out the output as parts."""

    def __init__(self, plan: Plan, structure: Structure, buf: FileBuffer) -> None:
        self.plan = plan
        self.structure = structure
        self.buf = buf
        self.records: dict[str, TensorRecord] = {t.name: t for t in plan.inventory.tensors}
        self.sites: dict[str, TensorSite] = {}
        ambiguous: set[str] = set()
        for site in structure.tensors.values():
            if site.name in self.sites:
                ambiguous.add(site.name)
            self.sites[site.name] = site
        self.ambiguous = ambiguous
        self.writes: dict[int, _Write] = {}
        self.removed: set[int] = set()
        self.identity: dict[int, str] = {}
        self.out_rename: dict[int, str] = {}
        self.cast_after: dict[int, bytes] = {}
        self.top_casts: dict[int, list[bytes]] = {}
        self.top_identities: dict[int, list[bytes]] = {}
        self.local_renames: dict[int, dict[str, str]] = {}
        self.drop_values: dict[int, set[str]] = {}
        self.retype: dict[int, dict[str, tuple[str, str]]] = {}
        self.renames: dict[int, dict[str, str]] = {}
        self.output_names: dict[str, str] = {}
        self.dirty: list[int] = []
        self._defines: dict[int, set[str]] = {}
        self.taken = self._all_names()
        self.training_reads = set().union(*(
            g.uses() - self.defines(g) for g in structure.graphs.values()
            if g.kind == GraphKind.TRAINING)) | structure.bindings
        self.counts = {"merged": 0, "copies": 0, "cast": 0, "unused": 0, "small": 0}
        #: Names of subgraph initializers that an enclosing graph also defines: runtimes
        #: disagree on which value they read, so slim neither renames nor casts them.
        self.shadowed = {name for g in structure.graphs.values() for name in g.initializers
                         if self._enclosing_defines(g, name)}
        #: Planned tensor name -> the site holding its bytes, for merged duplicates.
        self.holder_of: dict[str, TensorSite] = {}
        #: ``location`` of external tensors in the output.
        self.location = ""
        #: Writes whose typed data fields are copied (their CRC is computed, not streamed).
        self.verbatim: list[_Write] = []

    # -- names and scopes ----------------------------------------------------------------
    def defines(self, g: GraphSite) -> set[str]:
        """Names ``g`` defines (cached)."""
        names = self._defines.get(g.start)
        if names is None:
            names = self._defines[g.start] = g.defines()
        return names

    def _all_names(self) -> set[str]:
        names: set[str] = set()
        for g in self.structure.graphs.values():
            names |= g.defines() | set(g.outputs)
            for node in g.nodes:
                names.update(node.inputs)
        return names

    def _enclosing_defines(self, g: GraphSite, name: str) -> bool:
        at = g.parent
        while at is not None:
            if name in self.defines(at):
                return True
            at = at.parent
        return False

    def fresh(self, base: str) -> str:
        """A name no value of the model has."""
        name, n = base, 1
        while name in self.taken:
            n += 1
            name = f"{base}_{n}"
        self.taken.add(name)
        return name

    def site_of(self, name: str) -> TensorSite:
        """The tensor the inventory calls ``name``."""
        if name in self.ambiguous:
            raise self.refuse(f"it holds several tensors named {printable(name)!r}; slim cannot "
                              "tell them apart")
        site = self.sites.get(name)
        if site is None:
            raise self.refuse(f"no tensor {printable(name)!r} in the model")
        return site

    def refuse(self, reason: str) -> UsageError:
        """A :class:`UsageError` naming the model (raise it)."""
        return UsageError(f"{printable(str(self.plan.inventory.path))}: {reason}")

    def _region(self, g: GraphSite, name: str) -> Iterator[GraphSite]:
        """``g`` and its subgraphs where ``name`` still means ``g``'s value (not shadowed)."""
        yield g
        for node in g.nodes:
            for sub in node.subgraphs:
                if name not in self.defines(sub):
                    yield from self._region(sub, name)

    def _visible(self, holder: TensorSite, g: GraphSite) -> bool:
        """Whether the holder's name means the holder in graph ``g``."""
        if not holder.graph.encloses(g):
            return False
        at: GraphSite | None = g
        while at is not None and at is not holder.graph:
            # A training graph's view of the model's names is the runtime's business.
            if holder.bare in self.defines(at) or at.kind == GraphKind.TRAINING:
                return False
            at = at.parent
        return True

    # -- decisions -------------------------------------------------------------------------
    def decide(self) -> None:
        """Every change: merges of duplicates, casts, removals; checks what ONNX can hold."""
        plan = self.plan
        planned = {t.name: t for t in plan.tensors}
        groups: dict[str, list[PlannedTensor]] = {}
        for t in plan.tensors:
            if t.alias_of is not None:
                groups.setdefault(t.alias_of, [planned[t.alias_of]]).append(t)
        for t in plan.stored:
            if t.name not in groups:
                self._write(self.site_of(t.record.name), t, t.name)
        for members in groups.values():
            self._merge(members)
        self._drop()
        casts = [w for w in self.writes.values() if w.dtype != self.input_dtype(w.site)]
        if casts:
            self._check_opset(casts[0].dtype)
        for w in sorted(casts, key=lambda w: w.site.start):
            self._cast(w)
        self._propagate()
        self._name_outputs()
        self._notes()

    def input_dtype(self, site: TensorSite) -> str:
        """The dtype a tensor has in the input."""
        return self.records[site.name].dtype

    def _write(self, site: TensorSite, source: PlannedTensor, record_as: str | None) -> None:
        rec = self.records.get(site.name)
        external = rec is not None and "external" in rec.tags
        self.writes[site.start] = _Write(site, source, source.dtype, record_as, external)
        self.dirty.append(site.start)

    def _merge(self, members: list[PlannedTensor]) -> None:
        """One original and its duplicates: pick the holder, merge what can see it."""
        original = members[0]
        sites = [self.site_of(t.record.name) for t in members]
        candidates = [i for i, s in enumerate(sites) if s.kind == TensorKind.INITIALIZER]
        if _is_constant(sites[0]) and sites[0].node is not None \
                and sites[0].node.op_type == "Constant":
            candidates.append(0)
        best: tuple[int, list[str | None]] | None = None
        best_score: tuple[int, int, int, int] | None = None
        for i in candidates:
            how = [None if j == i else self._how(sites[j], sites[i]) for j in range(len(sites))]
            score = (sum(h is not None for h in how), sites[i].kind == TensorKind.INITIALIZER,
                     -sites[i].graph.depth, -i)
            if best_score is None or score > best_score:
                best, best_score = (i, how), score
        if best is None or best_score is None or best_score[0] == 0:
            best = (0, [None] * len(sites))
        holder, how = best
        hsite = sites[holder]
        original_merged = how[0] is not None or holder == 0
        self._write(hsite, original, original.name if original_merged else None)
        for j, (t, site) in enumerate(zip(members, sites, strict=True)):
            if j == holder:
                self.holder_of[t.name] = hsite
                continue
            mode = how[j]
            if mode == "identity" and site.kind != TensorKind.NODE_TENSOR \
                    and output_nbytes(original) <= len(_identity_node(hsite.bare,
                                                                      site.bare)) + 4:
                # An Identity node would cost more bytes than the copy it replaces.
                mode = None
                self.counts["small"] += 1
                self.counts["copies"] -= 1
            if mode is None:
                self._write(site, original, original.name if j == 0 else None)
                self.counts["copies"] += 1
                continue
            self.holder_of[t.name] = hsite
            self.counts["merged"] += 1
            if site.kind == TensorKind.NODE_TENSOR:
                assert site.node is not None
                self.identity[site.node.start] = hsite.bare
                self.dirty.append(site.node.start)
                continue
            self.removed.add(site.start)
            self.dirty.append(site.start)
            g = site.graph
            self.drop_values.setdefault(g.start, set()).add(site.bare)
            self.dirty.append(g.start)
            if mode == "identity":
                self.top_identities.setdefault(g.start, []).append(
                    _identity_node(hsite.bare, site.bare))
            else:
                self.local_renames.setdefault(g.start, {})[site.bare] = hsite.bare

    def _how(self, member: TensorSite, holder: TensorSite) -> str | None:
        """How ``member`` can give way to ``holder``: ``rename`` its uses, replace it by an
        ``identity`` node, or ``None`` (it keeps its own bytes)."""
        h, m = holder.bare, member.bare
        if not h or not m or h in self.shadowed or m in self.shadowed \
                or not self._visible(holder, member.graph):
            return None
        if member.kind == TensorKind.NODE_TENSOR:
            node = member.node
            ok = (_is_constant(member) and node is not None and node.op_type == "Constant")
            return "identity" if ok else None
        if member.kind != TensorKind.INITIALIZER or holder.kind != TensorKind.INITIALIZER:
            return None
        g = member.graph
        if g.kind == GraphKind.MAIN and m in self.training_reads:
            return None
        if g.kind != GraphKind.SUBGRAPH and m in g.outputs:
            return "identity"
        for sub in self._region(g, m):
            if sub is not g and h in self.defines(sub) and m in sub.uses():
                return None
        return "rename"

    def _drop(self) -> None:
        """Unused initializers go; a tensor the graph reads cannot be dropped."""
        plan = self.plan
        for d in plan.dropped:
            site = self.sites.get(d.record.name)
            if site is None or site.unused or d.record.name in self.ambiguous:
                continue
            if d.reason in plan.options.dropped:
                raise self.refuse(
                    f"the graph reads {printable(d.record.name)!r}, so the ONNX model cannot "
                    f"drop it (--drop {d.reason}); keep it with --keep "
                    f"{printable(d.record.name)!r} or drop less")
        removable = (TensorKind.INITIALIZER, TensorKind.SPARSE_VALUES)
        for site in self.structure.tensors.values():
            if not site.unused or site.kind not in removable or site.start in self.writes \
                    or matches(site.name, plan.options.keep):
                continue
            self.removed.add(site.start)
            self.dirty.append(site.start)
            self.drop_values.setdefault(site.graph.start, set()).add(site.bare)
            self.dirty.append(site.graph.start)
            self.counts["unused"] += 1

    def _check_opset(self, dtype: str) -> None:
        ops = self.structure.opsets
        version = ops.get("", ops.get("ai.onnx", 0))
        need = 13 if dtype == "bfloat16" else 6
        if version < need:
            raise self.refuse(
                f"--cast {dtype} adds Cast nodes, which need opset {need} or later for "
                f"{dtype}; the model imports opset {version}")

    def _cast(self, w: _Write) -> None:
        """Store ``w`` under a new name in the narrow type and cast it back for the graph."""
        site = w.site
        original = self.input_dtype(site)
        g = site.graph
        if site.kind in (TensorKind.INITIALIZER, TensorKind.SPARSE_VALUES):
            if g.kind == GraphKind.MAIN and site.bare in self.training_reads:
                raise self.refuse(f"its training graphs read {printable(site.name)!r}; slim "
                                  "cannot cast it")
            if site.bare in self.shadowed:
                raise self.refuse(
                    f"{printable(site.name)!r} shares its name with a value of another scope "
                    "(a subgraph initializer shadowing an enclosing name), which runtimes "
                    "resolve differently; slim cannot cast it without choosing one")
            w.name = self.fresh(f"{site.bare}_{w.dtype}")
            self.top_casts.setdefault(g.start, []).append(
                _cast_node(w.name, site.bare, original))
            if site.bare in g.inputs:
                self.retype.setdefault(g.start, {})[site.bare] = (w.name, w.dtype)
            self.dirty.append(g.start)
        elif _is_constant(site):
            node = site.node
            assert node is not None
            w.name = self.fresh(f"{node.outputs[0]}_{w.dtype}")
            self.out_rename[node.start] = w.name
            self.cast_after[node.start] = _cast_node(w.name, node.outputs[0], original)
            self.dirty.append(node.start)
        else:
            what = f"a {site.node.op_type} node's" if site.node is not None else "this"
            raise self.refuse(
                f"{printable(site.name)!r} is {what} {site.attribute or 'sparse'} tensor: "
                "casting it would change what the node computes; slim without --cast")
        self.counts["cast"] += 1

    def _propagate(self) -> None:
        """The renames in force in each graph: inherited unless shadowed, plus its own."""
        def visit(g: GraphSite, inherited: dict[str, str]) -> None:
            names = self.defines(g)
            here = {k: v for k, v in inherited.items() if k not in names}
            here.update(self.local_renames.get(g.start, {}))
            self.renames[g.start] = here
            if here:
                if g.kind == GraphKind.SUBGRAPH and any(o in here for o in g.outputs):
                    self.dirty.append(g.start)
                for node in g.nodes:
                    if any(i in here for i in node.inputs):
                        self.dirty.append(node.start)
            for node in g.nodes:
                for sub in node.subgraphs:
                    visit(sub, here)

        for g in self.structure.graphs.values():
            if g.kind != GraphKind.SUBGRAPH:
                visit(g, {})
        self.dirty.sort()

    def _output_name(self, site: TensorSite) -> str:
        """What the reader will call ``site``'s tensor in the output."""
        if site.kind == TensorKind.SPARSE_INDICES:
            values = self.sites.get(site.name[: -len(".indices")])
            if values is not None:
                return self._output_name(values) + ".indices"
            return site.name
        w = self.writes.get(site.start)
        if w is None or not w.name:
            return site.name
        if site.kind == TensorKind.NODE_TENSOR and site.own_name:
            return site.name
        return site.graph.scope + w.name

    def _name_outputs(self) -> None:
        for t in self.plan.tensors:
            site = self.holder_of.get(t.name) or self.site_of(t.record.name)
            self.output_names[t.name] = self._output_name(site)

    def _notes(self) -> None:
        c, notes = self.counts, self.plan.notes
        if c["merged"]:
            notes.append(f"onnx: {c['merged']} duplicate tensor(s) removed; their uses now read "
                         "the copy kept (renamed in nodes and subgraphs, or through an Identity "
                         "node)")
        if c["copies"]:
            notes.append(f"onnx: {c['copies']} duplicate(s) kept their own bytes: the copy kept "
                         "is out of their graph's reach (a sibling subgraph, a sparse or "
                         "attribute tensor)")
        if c["small"]:
            notes.append(f"onnx: {c['small']} small duplicate(s) kept their own bytes: the "
                         "Identity node replacing them would be larger")
        if c["unused"]:
            notes.append(f"onnx: {c['unused']} initializer(s) no node reads were removed")
        if c["cast"]:
            dtype = self.plan.options.cast
            notes.append(f"onnx: {c['cast']} tensor(s) stored as {dtype} under NAME_{dtype}, "
                         f"each with a Cast node back to its type and name (the graph still "
                         "computes in the original type)")

    # -- layout ----------------------------------------------------------------------------
    def is_dirty(self, start: int, end: int) -> bool:
        """Whether anything inside the payload ``start..end`` changes."""
        i = bisect_left(self.dirty, start)
        return i < len(self.dirty) and self.dirty[i] < end

    def message(self, f: Field, body: Callable[[int, int], Parts]) -> Part:
        """Field ``f`` copied, or its payload rebuilt by ``body`` if anything in it changes."""
        if not self.is_dirty(f.data_start, f.end):
            return Copy(f.start, f.end)
        return Nested(f.number, body(f.data_start, f.end))

    def model(self) -> Parts:
        """The whole ``ModelProto``."""
        parts = Parts()
        bodies = {fmt.MODEL_GRAPH: self.graph, fmt.MODEL_TRAINING: self.training,
                  fmt.MODEL_FUNCTIONS: self.function}
        for f in iter_fields(self.buf, 0, len(self.buf)):
            body = bodies.get(f.number)
            parts.add(self.message(f, body) if body and f.wire_type == LEN
                      else Copy(f.start, f.end))
        return parts

    def training(self, start: int, end: int) -> Parts:
        """A ``TrainingInfoProto``: its two graphs."""
        parts = Parts()
        for f in iter_fields(self.buf, start, end):
            parts.add(self.message(f, self.graph) if f.number in (1, 2)
                      else Copy(f.start, f.end))
        return parts

    def function(self, start: int, end: int) -> Parts:
        """A ``FunctionProto``: its nodes (field 7)."""
        parts = Parts()
        for f in iter_fields(self.buf, start, end):
            if f.number == 7:
                self.node_field(parts, f)
            else:
                parts.add(Copy(f.start, f.end))
        return parts

    def _name(self, f: Field) -> str:
        """The name (field 1) of a ``ValueInfoProto``."""
        for g in iter_fields(self.buf, f.data_start, f.end):
            if g.number == 1 and g.wire_type == LEN:
                return g.text(self.buf)
        return ""

    def graph(self, start: int, end: int) -> Parts:
        """A ``GraphProto``: new nodes first, then the input's fields, rewritten or copied."""
        g = self.structure.graphs[start]
        renames = self.renames.get(start, {})
        top = [*self.top_casts.get(start, ()), *self.top_identities.get(start, ())]
        drop = self.drop_values.get(start, set())
        retype = self.retype.get(start, {})
        parts = Parts()
        for f in iter_fields(self.buf, start, end):
            n = f.number
            if n == 1 and top:
                parts.extend(Raw(bytes_field(1, node)) for node in top)
                top = []
            if n == 1:
                self.node_field(parts, f)
            elif n == 5:
                if f.data_start not in self.removed:
                    parts.add(self.message(f, self.tensor))
            elif n == 15:
                values = next((v for v in iter_fields(self.buf, f.data_start, f.end)
                               if v.number == 1), None)
                if values is None or values.data_start not in self.removed:
                    parts.add(self.message(f, self.sparse))
            elif n in (11, 12, 13):
                name = self._name(f)
                if n != 12 and name in drop:
                    continue
                if n == 11 and name in retype:
                    parts.add(Nested(11, self.value_info(f, *retype[name])))
                elif n == 12 and g.kind == GraphKind.SUBGRAPH and name in renames:
                    parts.add(Nested(12, self.value_info(f, renames[name], None)))
                else:
                    parts.add(Copy(f.start, f.end))
            else:
                parts.add(Copy(f.start, f.end))
        parts.extend(Raw(bytes_field(1, node)) for node in top)
        return parts

    def value_info(self, f: Field, name: str, dtype: str | None) -> Parts:
        """A ``ValueInfoProto`` renamed (and, for ``dtype``, its tensor type changed)."""
        parts = Parts()
        for v in iter_fields(self.buf, f.data_start, f.end):
            if v.number == 1 and v.wire_type == LEN:
                parts.add(Raw(bytes_field(1, name)))
            elif v.number == 2 and v.wire_type == LEN and dtype is not None:
                parts.add(Nested(2, self._retyped(v, dtype)))
            else:
                parts.add(Copy(v.start, v.end))
        return parts

    def _retyped(self, type_field: Field, dtype: str) -> Parts:
        """A ``TypeProto`` whose ``tensor_type.elem_type`` is ``dtype``."""
        parts = Parts()
        for t in iter_fields(self.buf, type_field.data_start, type_field.end):
            if t.number == 1 and t.wire_type == LEN:
                inner = Parts()
                for e in iter_fields(self.buf, t.data_start, t.end):
                    inner.add(Raw(varint_field(1, ONNX_CODES[dtype])) if e.number == 1
                              else Copy(e.start, e.end))
                parts.add(Nested(1, inner))
            else:
                parts.add(Copy(t.start, t.end))
        return parts

    def node_field(self, parts: Parts, f: Field) -> None:
        """A node of a graph or function (field ``f.number``), and the Cast that follows a
        cast ``Constant``."""
        start = f.data_start
        if start in self.identity:
            parts.add(Nested(f.number, self.identity_node(f, self.identity[start])))
        else:
            parts.add(self.message(f, self.node))
        if start in self.cast_after:
            parts.add(Raw(bytes_field(f.number, self.cast_after[start])))

    def identity_node(self, f: Field, source: str) -> Parts:
        """The ``Constant`` node ``f`` as ``Identity(source)``: outputs, name, domain kept."""
        parts = Parts()
        parts.add(Raw(bytes_field(1, source)))
        for g in iter_fields(self.buf, f.data_start, f.end):
            if g.number in (2, 3):
                parts.add(Copy(g.start, g.end))
        parts.add(Raw(bytes_field(4, "Identity")))
        for g in iter_fields(self.buf, f.data_start, f.end):
            if g.number in (6, 7):
                parts.add(Copy(g.start, g.end))
        return parts

    def node(self, start: int, end: int) -> Parts:
        """A ``NodeProto``: inputs renamed, a cast Constant's output renamed, attributes."""
        node: NodeSite = self.structure.nodes[start]
        renames = self.renames.get(node.graph.start, {})
        new_output = self.out_rename.get(start)
        parts = Parts()
        for f in iter_fields(self.buf, start, end):
            if f.number == 1 and f.wire_type == LEN and renames:
                name = f.text(self.buf)
                parts.add(Raw(bytes_field(1, renames[name])) if name in renames
                          else Copy(f.start, f.end))
            elif f.number == 2 and f.wire_type == LEN and new_output is not None:
                parts.add(Raw(bytes_field(2, new_output)))
            elif f.number == 5 and f.wire_type == LEN:
                parts.add(self.message(f, self.attribute))
            else:
                parts.add(Copy(f.start, f.end))
        return parts

    def attribute(self, start: int, end: int) -> Parts:
        """An ``AttributeProto``: its tensors, sparse tensors and graphs."""
        bodies = {5: self.tensor, 10: self.tensor, 6: self.graph, 11: self.graph,
                  22: self.sparse, 23: self.sparse}
        parts = Parts()
        for f in iter_fields(self.buf, start, end):
            body = bodies.get(f.number)
            parts.add(self.message(f, body) if body and f.wire_type == LEN
                      else Copy(f.start, f.end))
        return parts

    def sparse(self, start: int, end: int) -> Parts:
        """A ``SparseTensorProto``: values and indices."""
        parts = Parts()
        for f in iter_fields(self.buf, start, end):
            parts.add(self.message(f, self.tensor) if f.number in (1, 2) and f.wire_type == LEN
                      else Copy(f.start, f.end))
        return parts

    def tensor(self, start: int, end: int) -> Parts:
        """A ``TensorProto`` with its data streamed (``raw_data`` or the external file), or
        its typed data fields copied when they are not larger than ``raw_data`` would be."""
        w = self.writes[start]
        parts = Parts()
        placed = False
        verbatim = self._keeps_typed(w, start, end)
        if verbatim:
            self.verbatim.append(w)
        for f in iter_fields(self.buf, start, end):
            if f.number in _DATA_FIELDS and verbatim:
                parts.add(Copy(f.start, f.end))
                placed = True
            elif f.number in _DATA_FIELDS:
                if not placed:
                    parts.extend(self.data(w))
                    placed = True
            elif f.number == 2 and f.wire_type == VARINT:
                parts.add(Raw(varint_field(2, ONNX_CODES[w.dtype])))
            elif f.number == 8 and f.wire_type == LEN and w.name:
                parts.add(Raw(bytes_field(8, w.name)))
            else:
                parts.add(Copy(f.start, f.end))
        if not placed:
            parts.extend(self.data(w))
        return parts

    def _keeps_typed(self, w: _Write, start: int, end: int) -> bool:
        """Whether an inline, uncast tensor keeps its typed fields (``int64_data`` of small
        values is a byte an element, ``raw_data`` eight)."""
        if w.external or w.dtype != self.input_dtype(w.site):
            return False
        fields = [f for f in iter_fields(self.buf, start, end) if f.number in _DATA_FIELDS]
        if not fields or any(f.number in (9, 13, 14) for f in fields):
            return False
        typed = sum(f.end - f.start for f in fields)
        return typed < len(key(9, LEN) + varint(w.nbytes)) + w.nbytes

    def data(self, w: _Write) -> list[Part]:
        """The data fields of a rewritten tensor: ``raw_data``, or where it is externally."""
        if w.external and w.nbytes:
            entries = b"".join(
                bytes_field(13, bytes_field(1, k) + bytes_field(2, v)) for k, v in (
                    ("location", self.location), ("offset", str(w.offset)),
                    ("length", str(w.nbytes))))
            return [Raw(entries + varint_field(14, _EXTERNAL))]
        return [Raw(key(9, LEN) + varint(w.nbytes)), Streamed(w.nbytes, _TensorChunks(w))]


class _TensorChunks:
    """The streamed bytes of one write; the sink records the CRC for verification."""

    def __init__(self, w: _Write) -> None:
        self.w = w

    def __call__(self, sink: Sink) -> Iterator[bytes | memoryview]:
        assert isinstance(sink, _OnnxSink)
        return sink.tensor(self.w)


class _OnnxSink(Sink):
    """A sink that streams tensors with progress and keeps what was written."""

    def __init__(self, out: BinaryIO, source_fd: int, meter: Meter,
                 written: dict[str, Written]) -> None:
        super().__init__(out, source_fd)
        self.meter = meter
        self.written = written

    def tensor(self, w: _Write) -> Iterator[bytes | memoryview]:
        """``w``'s bytes (a copy counts no progress: the plan has it as an alias)."""
        s = stream(w.source, self.meter if w.record_as else None)
        yield from s.chunks()
        if w.record_as is not None:
            self.written[w.record_as] = s.written


@dataclass
class OnnxJob:
    """The rewritten model and, when the input had external data, one data file."""

    files: list[str]
    main: str
    directory: bool
    predicted_bytes: int | None
    model_path: Path
    parts: Parts
    data_name: str | None
    extents: list[_Extent]
    names: dict[str, str]
    verbatim: list[_Write] = field(default_factory=list)

    def write(self, out: Output, meter: Meter) -> dict[str, Written]:
        """The model file, then the external data file."""
        written: dict[str, Written] = {}
        fd = inputs.open_fd(self.model_path)
        try:
            sink = _OnnxSink(out.open(self.main), fd, meter, written)
            self.parts.write(sink)
            for w in self.verbatim:
                for _ in sink.tensor(w):
                    pass
            if self.data_name is not None:
                sink.out = out.open(self.data_name)
                pos = 0
                for ext in self.extents:
                    if ext.offset > pos:
                        sink.out.write(bytes(ext.offset - pos))
                    for chunk in sink.tensor(ext.write):
                        sink.out.write(chunk)
                    pos = ext.offset + ext.write.nbytes
                    for other in ext.shared:
                        if other.record_as is not None:
                            self.share(written, ext, other, meter)
        finally:
            os.close(fd)
        return written

    @staticmethod
    def share(written: dict[str, Written], ext: _Extent, other: _Write, meter: Meter) -> None:
        """A tensor pointing at bytes another tensor's write put in the data file."""
        first = ext.write
        done = written.get(first.record_as) if first.record_as else None
        if done is None:
            raise ValueError("shared external data written without a record")
        assert other.record_as is not None
        written[other.record_as] = Written(done.crc, done.nbytes, done.error)
        meter.advance(other.nbytes)

    def output_name(self, name: str) -> str:
        """The reader's name for a planned tensor in the output (cast initializers are
        renamed, duplicates read back as the copy kept)."""
        return self.names.get(name, name)


class OnnxWriter:
    """``.onnx`` models, inline or with external data."""

    name = "onnx"

    def default_target(self, plan: Plan, source: Path) -> Path:
        """``model.slim.onnx``."""
        return slim_name(source)

    def prepare(self, plan: Plan, target: Path) -> OnnxJob:
        """Decide every change and lay out both files before writing."""
        inv = plan.inventory
        if inv.format != "onnx":
            raise UsageError(f"{printable(str(inv.path))}: slim writes ONNX models only from "
                             f"ONNX input, not {inv.format}")
        refuse_unloadable(inv)
        path = inv.files[0].path
        structure = fmt.read_structure(path)
        fd = inputs.open_fd(path)
        try:
            rw = _Rewrite(plan, structure, FileBuffer(fd, path.stat().st_size))
            rw.decide()
            data_name = f"{target.name}.data"
            extents = _layout(rw.writes.values())
            rw.location = data_name
            parts = rw.model()
        finally:
            os.close(fd)
        if parts.size > MAX_PROTO >= inv.files[0].nbytes:
            raise UsageError(
                f"{printable(str(inv.path))}: the slimmed model would be {parts.size} bytes, "
                "over protobuf's 2 GiB limit (typed fields widened to raw_data)")
        files = [target.name]
        data_bytes = 0
        if extents:
            files.append(data_name)
            last = extents[-1]
            data_bytes = last.offset + last.write.nbytes
        return OnnxJob(files, target.name, False, parts.size + data_bytes, path, parts,
                       data_name if extents else None, extents, rw.output_names, rw.verbatim)


def _layout(writes: Iterable[_Write]) -> list[_Extent]:
    """Offsets in the output data file of every external write, in model order; writes of
    the same input bytes in the same dtype share one range."""
    extents: list[_Extent] = []
    by_source: dict[tuple[object, ...], _Extent] = {}
    pos = 0
    for w in sorted((w for w in writes if w.external and w.nbytes), key=lambda w: w.site.start):
        r = w.source.record
        ident = (r.storage, r.storage_offset, r.nbytes, tuple(r.shape), w.dtype)
        ext = by_source.get(ident)
        if ext is not None:
            w.offset = ext.offset
            if w.record_as is not None and ext.write.record_as is None:
                ext.shared.append(ext.write)
                ext.write = w
            else:
                ext.shared.append(w)
            continue
        if w.nbytes >= ALIGN_THRESHOLD:
            pos += -pos % ALIGN
        w.offset = pos
        ext = by_source[ident] = _Extent(pos, w)
        extents.append(ext)
        pos += w.nbytes
    return extents
