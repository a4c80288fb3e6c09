"""What a slim will keep, drop, cast and rename, decided from the Inventory alone.

The rules, in order, for each tensor of the input:

1. a tensor a ``--keep`` glob matches is kept, whatever its category;
2. a tensor that holds no bytes in the file (a meta tensor, an object array) is dropped;
3. a second copy (``duplicates``) is kept as an *alias* of its original when duplicates are
   dropped: the writer stores the bytes once (a shared storage, a metadata alias...); a second
   name for the very same view of a storage (tied weights) is always such an alias;
4. a tensor of a dropped category is dropped (``ema`` drops tensors tagged as an EMA copy);
5. everything else is kept, cast to ``--cast`` if it is a wider floating type.

With no ``--drop``, ``--dedupe`` or ``--cast`` the dropped categories are those inference
does not need (:data:`~modelsize.categories.NOT_NEEDED_FOR_INFERENCE`) and ``other`` tensors
(RNG states, metric accumulators, counters: :data:`DEFAULT_DROP`). Storage bytes no tensor
reaches are never written by any writer, so ``unused_storage`` always goes.

Kept tensors are renamed to their state-dict keys when they all come from one container
(``model.fc1.weight`` of ``{"model": ..., "optimizer": ...}`` becomes ``fc1.weight``), unless
``--keep`` asks for more of the checkpoint's layout.

A plan that keeps every tensor as it is has nothing to slim (:func:`nothing_to_slim`): unless
the format's writer stores the same tensors in less space, the input is copied byte for byte.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from modelsize.categories import NOT_NEEDED_FOR_INFERENCE, Category
from modelsize.errors import UsageError, printable
from modelsize.inventory import Inventory, TensorRecord
from modelsize.slimming.cast import CASTABLE, should_cast
from modelsize.slimming.source import NoDataError, Sources, TensorSource

#: What ``--drop`` accepts besides categories: tensors tagged as an EMA copy of the model.
EMA = "ema"
#: ``--drop metadata``: a TFLite model's metadata entries (labels, TFLite Support's metadata).
#: Elsewhere the metadata category is the file's own structure, which no slim drops.
METADATA_ENTRIES = Category.METADATA.value
#: Formats whose writer drops named metadata entries.
_METADATA_FORMATS = frozenset({"tflite"})
#: What ``--quantize`` accepts (each format applies those it can).
QUANTIZE_CHOICES = ("int8", "float16", "dynamic")
#: What a slim with no ``--drop``, ``--dedupe`` or ``--cast`` drops.
DEFAULT_DROP: frozenset[str] = frozenset(
    {c.value for c in NOT_NEEDED_FOR_INFERENCE} | {Category.OTHER.value}
)
#: Categories that hold no tensors a slim could drop (they are the file's structure).
_STRUCTURE = frozenset({Category.GRAPH, Category.METADATA, Category.WEIGHTS})


def drop_choices() -> list[str]:
    """Everything ``--drop`` accepts, from the category vocabulary."""
    return [c.value for c in Category if c not in _STRUCTURE] + [EMA, METADATA_ENTRIES]


def parse_drop(values: Iterable[str]) -> frozenset[str]:
    """``--drop a,b --drop c`` -> the set of names; unknown names are a :class:`UsageError`."""
    out: set[str] = set()
    for value in values:
        for part in value.split(","):
            name = part.strip().lower()
            if not name:
                continue
            if name not in drop_choices():
                raise UsageError(
                    f"--drop {name!r}: expected one of {', '.join(drop_choices())}"
                )
            out.add(name)
    return frozenset(out)


@dataclass(frozen=True)
class SlimOptions:
    """What to slim. ``drop=None`` means the default (what inference does not need)."""

    drop: frozenset[str] | None = None
    dedupe: bool = False
    cast: str | None = None
    to: str = "same"
    keep: tuple[str, ...] = ()
    #: Graph passes (ONNX: folding, dead code, ...); on by default from the CLI.
    graph: bool = False
    #: ``int8``, ``float16`` or ``dynamic``: a quantization the input format applies.
    quantize: str | None = None
    #: Freeze variables into constants (graph formats that have variables).
    freeze: bool = False
    #: Largest relative output difference accepted by the graph verification (``None``: the
    #: bound documented for the passes applied).
    tolerance: float | None = None

    def __post_init__(self) -> None:
        if self.cast is not None and self.cast not in CASTABLE:
            raise UsageError(f"--cast {self.cast!r}: expected one of {', '.join(CASTABLE[1:])}")
        if self.quantize is not None and self.quantize not in QUANTIZE_CHOICES:
            raise UsageError(f"--quantize {self.quantize!r}: expected one of "
                             f"{', '.join(QUANTIZE_CHOICES)}")
        if self.tolerance is not None and not self.tolerance >= 0:
            raise UsageError(f"--tolerance {self.tolerance!r}: expected a number >= 0")

    @property
    def dropped(self) -> frozenset[str]:
        """The names actually dropped (defaults applied)."""
        if self.drop is None and not self.dedupe and self.cast is None:
            return DEFAULT_DROP
        out = set(self.drop or ())
        if self.dedupe:
            out.add(Category.DUPLICATES.value)
        out.add(Category.UNUSED_STORAGE.value)
        return frozenset(out)


class PlannedTensor:
    """One tensor of the output.

    ``record`` is the input's tensor (synthetic for consolidated checkpoints); ``source`` its
    bytes in the input dtype; ``dtype`` the output dtype. An alias (``alias_of`` set) shares
    the bytes of the named output tensor and has no bytes of its own.

    Slotted: a plan of a million tensors holds a million of them once a writer asks for
    :attr:`Plan.tensors`. ``source`` may be made on demand from the record (a
    :class:`~modelsize.slimming.source.Sources`): a plan does not hold a source object per
    tensor before a byte is written.
    """

    __slots__ = ("_source", "alias_of", "dtype", "name", "record")

    def __init__(self, record: TensorRecord, name: str, dtype: str,
                 source: TensorSource | Sources | None, alias_of: str | None = None) -> None:
        self.record = record
        self.name = name
        self.dtype = dtype
        self._source = source
        self.alias_of = alias_of

    @property
    def source(self) -> TensorSource | None:
        """Where the bytes come from (``None`` for an alias)."""
        s = self._source
        if isinstance(s, Sources):
            return s(self.record)
        return s

    @source.setter
    def source(self, value: TensorSource | None) -> None:
        self._source = value

    def source_nbytes(self) -> int:
        """Bytes of :attr:`source` (0 for an alias), without making a source that is made on
        demand."""
        s = self._source
        if s is None:
            return 0
        if isinstance(s, Sources):
            return s.nbytes(self.record)
        return s.nbytes

    @property
    def cast(self) -> bool:
        """Whether the output dtype differs from the input's."""
        return self.dtype != self.record.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        """The tensor's shape (unchanged by slim)."""
        return self.record.shape

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PlannedTensor):
            return NotImplemented
        return (self.record, self.name, self.dtype, self.alias_of, self._source) == (
            other.record, other.name, other.dtype, other.alias_of, other._source)

    __hash__ = None  # type: ignore[assignment]  # mutable, as the dataclass it replaces

    def __repr__(self) -> str:
        return (f"PlannedTensor(name={self.name!r}, dtype={self.dtype!r}, "
                f"record={self.record.name!r}, alias_of={self.alias_of!r})")


@dataclass(frozen=True, slots=True)
class DroppedTensor:
    """A tensor the output does not have, and why."""

    record: TensorRecord
    reason: str


class _Kept:
    """The output tensors of a plan as columns: what a million tensors cost before a writer
    needs them as :class:`PlannedTensor` objects (a pointer each, where the names and dtypes
    are the input's).

    ``records`` are the input tensors in output order; ``names`` their output names (``None``:
    the records' names); ``casts`` maps an input dtype to its output dtype where a cast
    changes it; ``aliases`` maps an index to the output name of the tensor holding its bytes
    and its dtype; ``sources`` makes a record's source when asked.
    """

    __slots__ = ("aliases", "casts", "names", "records", "sources")

    def __init__(self, records: list[TensorRecord], names: list[str] | None,
                 casts: dict[str, str], aliases: dict[int, tuple[str, str]],
                 sources: Sources) -> None:
        self.records = records
        self.names = names
        self.casts = casts
        self.aliases = aliases
        self.sources = sources

    def row(self, i: int) -> PlannedTensor:
        rec = self.records[i]
        name = rec.name if self.names is None else self.names[i]
        alias = self.aliases.get(i) if self.aliases else None
        if alias is not None:
            return PlannedTensor(rec, name, alias[1], None, alias[0])
        return PlannedTensor(rec, name, self.casts.get(rec.dtype, rec.dtype) if self.casts
                             else rec.dtype, self.sources)


class Plan:
    """The whole decision: output tensors in order, dropped tensors, and the renaming.

    :attr:`tensors` is a list of :class:`PlannedTensor` that writers may change (a writer
    that cannot alias turns aliases into copies). Until a writer asks for it, a plan made by
    :func:`make_plan` keeps its tensors as columns, and :meth:`rows` makes each
    :class:`PlannedTensor` as it is iterated, kept by nobody: what the writers of the large
    formats, verification and the report walk.
    """

    def __init__(self, inventory: Inventory, options: SlimOptions,
                 tensors: list[PlannedTensor] | None, dropped: list[DroppedTensor],
                 container: str = "", notes: list[str] | None = None,
                 *, kept: _Kept | None = None) -> None:
        if (tensors is None) == (kept is None):
            raise ValueError("a plan has its tensors as a list or as columns, not both")
        self.inventory = inventory
        self.options = options
        self._tensors = tensors
        self._kept = kept
        self.dropped = dropped
        self.container = container
        self.notes: list[str] = [] if notes is None else notes

    @property
    def tensors(self) -> list[PlannedTensor]:
        """The output tensors in order, as objects a writer may change (made once, then the
        plan's own)."""
        if self._tensors is None:
            kept = self._kept
            assert kept is not None
            self._tensors = [kept.row(i) for i in range(len(kept.records))]
            self._kept = None
        return self._tensors

    @tensors.setter
    def tensors(self, value: list[PlannedTensor]) -> None:
        self._tensors, self._kept = value, None

    def __len__(self) -> int:
        """How many output tensors (aliases included)."""
        return len(self._tensors) if self._tensors is not None else len(
            self._kept.records)  # type: ignore[union-attr]

    def row(self, i: int) -> PlannedTensor:
        """Output tensor ``i`` (made from the columns, unless :attr:`tensors` was asked for)."""
        if self._tensors is not None:
            return self._tensors[i]
        return self._kept.row(i)  # type: ignore[union-attr]

    def rows(self) -> Iterator[PlannedTensor]:
        """The output tensors in order, without making the plan hold them."""
        if self._tensors is not None:
            yield from self._tensors
            return
        kept = self._kept
        assert kept is not None
        for i in range(len(kept.records)):
            yield kept.row(i)

    def described(self, indices: Iterable[int] | None = None
                  ) -> Iterator[tuple[int, TensorRecord, str, str, str | None]]:
        """``(index, input record, output name, output dtype, alias_of)`` of the output
        tensors ``indices`` (all, in order, by default), made from the columns: what the
        writers of large files and verification walk, a tuple at a time."""
        if self._tensors is not None:
            tensors = self._tensors
            for i in (range(len(tensors)) if indices is None else indices):
                t = tensors[i]
                yield i, t.record, t.name, t.dtype, t.alias_of
            return
        kept = self._kept
        assert kept is not None
        records, names, casts, aliases = kept.records, kept.names, kept.casts, kept.aliases
        for i in (range(len(records)) if indices is None else indices):
            r = records[i]
            name = r.name if names is None else names[i]
            if aliases:
                alias = aliases.get(i)
                if alias is not None:
                    yield i, r, name, alias[1], alias[0]
                    continue
            yield i, r, name, casts.get(r.dtype, r.dtype) if casts else r.dtype, None

    def sources(self) -> Sources | None:
        """What makes the sources of tensors kept as columns (``None`` once :attr:`tensors`
        was asked for: each tensor then has its own)."""
        return self._kept.sources if self._kept is not None else None

    def records(self) -> Sequence[TensorRecord]:
        """The input record of each output tensor, in order."""
        if self._tensors is not None:
            return [t.record for t in self._tensors]
        return self._kept.records  # type: ignore[union-attr]

    def alias_indices(self) -> dict[int, str]:
        """``{index: output name of the tensor holding its bytes}`` for every alias."""
        if self._tensors is not None:
            return {i: t.alias_of for i, t in enumerate(self._tensors)
                    if t.alias_of is not None}
        return {i: a[0] for i, a in self._kept.aliases.items()}  # type: ignore[union-attr]

    @property
    def casts_any(self) -> bool:
        """Whether some output tensor changes dtype."""
        if self._tensors is not None:
            return any(t.cast for t in self._tensors)
        kept = self._kept
        assert kept is not None
        if kept.aliases and any(kept.records[i].dtype != d
                                for i, (_, d) in kept.aliases.items()):
            return True
        if not kept.casts:
            return False
        return any(r.dtype in kept.casts for r in kept.records)

    @property
    def stored(self) -> list[PlannedTensor]:
        """The tensors with bytes of their own (not aliases): objects of :attr:`tensors`, which
        a writer may change."""
        return [t for t in self.tensors if t.alias_of is None]

    @property
    def stored_count(self) -> int:
        """How many output tensors have bytes of their own."""
        if self._tensors is not None:
            return sum(1 for t in self._tensors if t.alias_of is None)
        kept = self._kept
        assert kept is not None
        return len(kept.records) - len(kept.aliases)

    @property
    def aliases(self) -> dict[str, str]:
        """``{alias name: name of the tensor holding its bytes}``."""
        if self._tensors is not None:
            return {t.name: t.alias_of for t in self._tensors if t.alias_of is not None}
        kept = self._kept
        assert kept is not None
        names = kept.names
        return {(kept.records[i].name if names is None else names[i]): a[0]
                for i, a in kept.aliases.items()}

    @property
    def data_bytes(self) -> int:
        """Tensor bytes the output will hold."""
        from modelsize.dtypes import DTYPES

        return sum(DTYPES[t.dtype].nbytes(t.record.numel) if t.dtype in DTYPES else
                   t.record.nbytes for t in self.rows() if t.alias_of is None)

    def output_bytes(self) -> int:
        """Bytes the stored tensors hold in the output (after any cast), reading nothing."""
        from modelsize.dtypes import DTYPES

        total = 0
        kept = self._kept
        if kept is not None:  # from the columns: no tensor made
            casts, aliases, nbytes = kept.casts, kept.aliases, kept.sources.nbytes
            for i, r in enumerate(kept.records):
                if aliases and i in aliases:
                    continue
                dtype = casts.get(r.dtype) if casts else None
                if dtype is not None:
                    total += DTYPES[dtype].nbytes(r.numel)
                else:
                    total += r.nbytes if r.strides is None else nbytes(r)
            return total
        for t in self.rows():
            if t.alias_of is not None:
                continue
            if t.dtype != t.record.dtype:
                total += DTYPES[t.dtype].nbytes(t.record.numel)
            else:
                total += t.source_nbytes()
        return total

    def __repr__(self) -> str:
        return (f"<Plan of {self.inventory.path}: {len(self)} tensors, "
                f"{len(self.dropped)} dropped>")


def nothing_to_slim(plan: Plan) -> bool:
    """Whether slimming as planned changes nothing the user asked about: the input's format
    kept, no tensor dropped or cast, no copy turned into an alias, and no byte of the input in
    a category the slim drops (unused storage, non-tensor ``other`` data). Such an output can
    only be a rewrite of the same tensors, never smaller than the input by more than framing:
    slim copies the input byte for byte instead (issue 18: rewrites grew files by 0.1-40 kB).
    """
    if plan.options.to != "same" or plan.dropped:
        return False
    if plan.casts_any:
        return False
    records = plan.records()
    if any(records[i].category == Category.DUPLICATES for i in plan.alias_indices()):
        return False
    by = plan.inventory.bytes_by_category
    if any(by[c] for c in Category if c.value in plan.options.dropped):
        return False
    # An encoded storage (text, deflated) is charged whole to its best view: elements no view
    # reaches inside it are unused storage too, which a rewrite leaves out.
    compressed = {st.key: st.logical_nbytes for st in plan.inventory.storages if st.compressed}
    if not compressed:
        return True
    views: dict[str, list[TensorRecord]] = {key: [] for key in compressed}
    for r in records:
        if r.storage is not None and r.storage in views:
            views[r.storage].append(r)
    return all(_reached(key, views[key]) >= n for key, n in compressed.items())


def _reached(key: str, records: Iterable[TensorRecord]) -> int:
    """Bytes of storage ``key`` inside the span of some view of it."""
    from modelsize.dtypes import DTYPES

    spans = []
    for r in records:
        if r.storage != key or not r.numel:
            continue
        if r.strides is None:
            spans.append((r.storage_offset, r.storage_offset + r.nbytes))
        else:
            item = DTYPES[r.dtype].block_bytes if r.dtype in DTYPES else 1
            reach = sum((d - 1) * abs(st) for d, st in zip(r.shape, r.strides, strict=False))
            spans.append((r.storage_offset, r.storage_offset + (reach + 1) * item))
    covered, end = 0, 0
    for a, b in sorted(spans):
        a = max(a, end)
        if b > a:
            covered += b - a
            end = b
    return covered


def matches(name: str, patterns: Sequence[str]) -> bool:
    """Whether a dotted name (or its first component, or its last) matches a glob."""
    if not patterns:
        return False
    candidates = {name, name.split(".", 1)[0], name.split("/", 1)[0]}
    return any(fnmatch.fnmatchcase(c, p) for p in patterns for c in candidates)


def make_plan(
    inv: Inventory,
    options: SlimOptions,
    source_of: Callable[[TensorRecord], TensorSource],
    tensors: Sequence[TensorRecord] | None = None,
) -> Plan:
    """Decide the output of slimming ``inv`` with ``options``.

    ``source_of(record)`` returns a record's bytes, or raises
    :class:`~modelsize.slimming.source.NoDataError` when it holds none in the file;
    ``tensors`` replaces the inventory's own tensors (consolidated checkpoints). With a
    :class:`~modelsize.slimming.source.Sources` (an inventory's own tensors), sources are
    checked now and made when a writer streams them; the plan keeps its tensors as columns.
    """
    dropped_names = options.dropped
    if METADATA_ENTRIES in dropped_names and inv.format not in _METADATA_FORMATS:
        raise UsageError(
            f"{printable(str(inv.path))}: --drop metadata applies to TFLite models' metadata "
            f"entries; a {inv.format} file's metadata is its own structure, which slim rewrites "
            "as needed")
    records: Sequence[TensorRecord] = inv.tensors if tensors is None else tensors
    lazy = source_of if type(source_of) is Sources else None
    kept: list[TensorRecord] = []
    dropped: list[DroppedTensor] = []
    aliases: dict[str, str] = {}
    sources: dict[str, TensorSource] = {}  # made now: sources that are not made on demand
    by_name: dict[str, TensorRecord] | None = None  # made when a duplicate needs it
    structure = (Category.METADATA, Category.GRAPH)
    convert = options.to != "same"
    dedupe = Category.DUPLICATES.value in dropped_names
    ema = EMA in dropped_names
    keep_globs = options.keep
    # Categories whose tensors are dropped (metadata never is: it is the file's structure).
    drop_categories = {c for c in Category if c.value in dropped_names
                       and c not in (Category.METADATA, Category.DUPLICATES)}
    for t in records:
        category = t.category
        keep = bool(keep_globs) and matches(t.name, keep_globs)
        if not keep:
            if convert and category in structure:
                # The input format's own bookkeeping (a TF object graph, a config string):
                # the output format has its own.
                dropped.append(DroppedTensor(t, f"{category.value} of the {inv.format} format"))
                continue
            if category == Category.DUPLICATES:
                # A copy with no tensor viewing its original the same way keeps its bytes.
                if dedupe and t.duplicate_of is not None:
                    if by_name is None:
                        by_name = {r.name: r for r in records}
                    if t.duplicate_of in by_name:
                        aliases[t.name] = t.duplicate_of
                        kept.append(t)
                        continue
            elif category in drop_categories:
                dropped.append(DroppedTensor(t, category.value))
                continue
            elif ema and EMA in t.tags:
                dropped.append(DroppedTensor(t, EMA))
                continue
        try:
            if lazy is not None:
                lazy.check(t)
            else:
                sources[t.name] = source_of(t)
        except NoDataError as exc:
            # A meta tensor or an object array: nothing to copy (never a decoding failure,
            # which stops the slim instead of losing the tensor).
            dropped.append(DroppedTensor(t, f"holds no data in the file ({exc})"))
            continue
        kept.append(t)

    # Two names for the very same view of the same storage (tied weights saved as one tensor)
    # stay one set of bytes in the output. Only storages with several views can have them.
    seen: set[str] = set()
    shared: set[str] = set()
    for t in kept:
        key = t.storage
        if key is not None:
            if key in seen:
                shared.add(key)
            else:
                seen.add(key)
    del seen
    if shared:
        first_view: dict[tuple[object, ...], str] = {}
        for t in kept:
            if t.storage not in shared or t.name in aliases:
                continue
            view = (t.storage, t.storage_offset, t.shape, t.strides, t.dtype)
            holder = first_view.setdefault(view, t.name)
            if holder != t.name:
                aliases[t.name] = holder

    # An alias whose original was dropped keeps its own bytes.
    if aliases:
        if by_name is None:
            by_name = {r.name: r for r in records}
        kept_names = {t.name for t in kept}
        for copy, original in list(aliases.items()):
            if original not in kept_names or original in aliases:
                del aliases[copy]
                try:
                    if lazy is not None:
                        lazy.check(by_name[copy])
                    else:
                        sources[copy] = source_of(by_name[copy])
                except NoDataError as exc:
                    kept = [t for t in kept if t.name != copy]
                    dropped.append(DroppedTensor(by_name[copy], f"holds no data ({exc})"))

    container = _common_container(kept) if not options.keep else ""
    names: list[str] | None = None
    if container:
        names = [t.key for t in kept]
        if len(set(names)) != len(names):
            container, names = "", None
    casts: dict[str, str] = {}
    if options.cast is not None:
        for dtype in {t.dtype for t in kept}:
            if should_cast(dtype, options.cast):
                casts[dtype] = options.cast
    cast_any = bool(casts)
    alias_at: dict[int, tuple[str, str]] = {}
    if aliases:
        assert by_name is not None
        index = {t.name: i for i, t in enumerate(kept) if t.name in aliases
                 or t.name in aliases.values()}
        for copy, original in aliases.items():
            source_dtype = by_name[original].dtype
            dtype = casts.get(source_dtype, source_dtype)
            alias_at[index[copy]] = (
                original if names is None else names[index[original]], dtype)
    if lazy is not None:
        plan = Plan(inv, options, None, dropped, container,
                    kept=_Kept(kept, names, casts, alias_at, lazy))
    else:
        planned = []
        for i, t in enumerate(kept):
            alias = alias_at.get(i)
            name = t.name if names is None else names[i]
            if alias is not None:
                planned.append(PlannedTensor(t, name, alias[1], None, alias[0]))
            else:
                planned.append(PlannedTensor(t, name, casts.get(t.dtype, t.dtype),
                                             sources[t.name]))
        plan = Plan(inv, options, planned, dropped, container)
    if options.cast and not cast_any:
        plan.notes.append(f"--cast {options.cast}: no floating tensor is wider than "
                          f"{options.cast}; nothing was cast")
    if container:
        plan.notes.append(f"tensors renamed to their state-dict keys ({container}X -> X)")
    return plan


def _common_container(kept: Sequence[TensorRecord]) -> str:
    containers = {t.container for t in kept}
    if len(containers) == 1:
        return next(iter(containers))
    return ""
