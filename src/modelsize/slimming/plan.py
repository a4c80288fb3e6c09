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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from modelsize.categories import NOT_NEEDED_FOR_INFERENCE, Category
from modelsize.errors import UsageError, printable
from modelsize.inventory import Inventory, TensorRecord
from modelsize.slimming.cast import CASTABLE, should_cast
from modelsize.slimming.source import NoDataError, TensorSource

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


@dataclass
class PlannedTensor:
    """One tensor of the output.

    ``record`` is the input's tensor (synthetic for consolidated checkpoints); ``source`` its
    bytes in the input dtype; ``dtype`` the output dtype. An alias (``alias_of`` set) shares
    the bytes of the named output tensor and has no bytes of its own.
    """

    record: TensorRecord
    name: str
    dtype: str
    source: TensorSource | None
    alias_of: str | None = None

    @property
    def cast(self) -> bool:
        """Whether the output dtype differs from the input's."""
        return self.dtype != self.record.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        """The tensor's shape (unchanged by slim)."""
        return self.record.shape


@dataclass(frozen=True)
class DroppedTensor:
    """A tensor the output does not have, and why."""

    record: TensorRecord
    reason: str


@dataclass
class Plan:
    """The whole decision: output tensors in order, dropped tensors, and the renaming."""

    inventory: Inventory
    options: SlimOptions
    tensors: list[PlannedTensor]
    dropped: list[DroppedTensor]
    container: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def stored(self) -> list[PlannedTensor]:
        """The tensors with bytes of their own (not aliases)."""
        return [t for t in self.tensors if t.alias_of is None]

    @property
    def aliases(self) -> dict[str, str]:
        """``{alias name: name of the tensor holding its bytes}``."""
        return {t.name: t.alias_of for t in self.tensors if t.alias_of is not None}

    @property
    def data_bytes(self) -> int:
        """Tensor bytes the output will hold."""
        from modelsize.dtypes import DTYPES

        return sum(DTYPES[t.dtype].nbytes(t.record.numel) if t.dtype in DTYPES else
                   t.record.nbytes for t in self.stored)


def nothing_to_slim(plan: Plan) -> bool:
    """Whether slimming as planned changes nothing the user asked about: the input's format
    kept, no tensor dropped or cast, no copy turned into an alias, and no byte of the input in
    a category the slim drops (unused storage, non-tensor ``other`` data). Such an output can
    only be a rewrite of the same tensors, never smaller than the input by more than framing:
    slim copies the input byte for byte instead (issue 18: rewrites grew files by 0.1-40 kB).
    """
    if plan.options.to != "same" or plan.dropped:
        return False
    if any(t.cast or (t.alias_of is not None and t.record.category == Category.DUPLICATES)
           for t in plan.tensors):
        return False
    by = plan.inventory.bytes_by_category
    if any(by[c] for c in Category if c.value in plan.options.dropped):
        return False
    # An encoded storage (text, deflated) is charged whole to its best view: elements no view
    # reaches inside it are unused storage too, which a rewrite leaves out.
    return all(_reached(st.key, plan.tensors) >= st.logical_nbytes
               for st in plan.inventory.storages if st.compressed)


def _reached(key: str, tensors: Sequence[PlannedTensor]) -> int:
    """Bytes of storage ``key`` inside the span of some view of it."""
    from modelsize.dtypes import DTYPES

    spans = []
    for t in tensors:
        r = t.record
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
    ``tensors`` replaces the inventory's own tensors (consolidated checkpoints).
    """
    dropped_names = options.dropped
    if METADATA_ENTRIES in dropped_names and inv.format not in _METADATA_FORMATS:
        raise UsageError(
            f"{printable(str(inv.path))}: --drop metadata applies to TFLite models' metadata "
            f"entries; a {inv.format} file's metadata is its own structure, which slim rewrites "
            "as needed")
    records = list(inv.tensors if tensors is None else tensors)
    kept: list[TensorRecord] = []
    dropped: list[DroppedTensor] = []
    aliases: dict[str, str] = {}
    sources: dict[str, TensorSource] = {}
    by_name = {t.name: t for t in records}
    structure = (Category.METADATA, Category.GRAPH)
    for t in records:
        keep = matches(t.name, options.keep)
        if options.to != "same" and t.category in structure and not keep:
            # The input format's own bookkeeping (a TF object graph, a config string): the
            # output format has its own.
            dropped.append(DroppedTensor(t, f"{t.category.value} of the {inv.format} format"))
            continue
        if not keep:
            reason = None
            if t.category == Category.DUPLICATES:
                # A copy with no tensor viewing its original the same way keeps its bytes.
                if (Category.DUPLICATES.value in dropped_names and t.duplicate_of is not None
                        and t.duplicate_of in by_name):
                    aliases[t.name] = t.duplicate_of
                    kept.append(t)
                    continue
            elif t.category.value in dropped_names and t.category != Category.METADATA:
                reason = t.category.value
            elif EMA in dropped_names and EMA in t.tags:
                reason = EMA
            if reason is not None:
                dropped.append(DroppedTensor(t, reason))
                continue
        try:
            sources[t.name] = source_of(t)
        except NoDataError as exc:
            # A meta tensor or an object array: nothing to copy (never a decoding failure,
            # which stops the slim instead of losing the tensor).
            dropped.append(DroppedTensor(t, f"holds no data in the file ({exc})"))
            continue
        kept.append(t)

    # Two names for the very same view of the same storage (tied weights saved as one tensor)
    # stay one set of bytes in the output.
    first_view: dict[tuple[object, ...], str] = {}
    for t in kept:
        if t.name in aliases or t.storage is None:
            continue
        view = (t.storage, t.storage_offset, t.shape, t.strides, t.dtype)
        holder = first_view.setdefault(view, t.name)
        if holder != t.name:
            aliases[t.name] = holder

    # An alias whose original was dropped keeps its own bytes.
    kept_names = {t.name for t in kept}
    for copy, original in list(aliases.items()):
        if original not in kept_names or original in aliases:
            del aliases[copy]
            try:
                sources[copy] = source_of(by_name[copy])
            except NoDataError as exc:
                kept = [t for t in kept if t.name != copy]
                dropped.append(DroppedTensor(by_name[copy], f"holds no data ({exc})"))

    container = _common_container(kept) if not options.keep else ""
    planned: list[PlannedTensor] = []
    names: dict[str, str] = {}
    for t in kept:
        names[t.name] = t.key if container else t.name
    if len(set(names.values())) != len(names):
        container = ""
        names = {t.name: t.name for t in kept}
    cast_any = False
    for t in kept:
        alias = aliases.get(t.name)
        dtype: str = t.dtype
        if options.cast is not None and should_cast(t.dtype, options.cast):
            dtype = options.cast
            cast_any = True
        if alias is not None:
            source_dtype = by_name[alias].dtype
            narrowed = options.cast is not None and should_cast(source_dtype, options.cast)
            dtype = options.cast if narrowed and options.cast else source_dtype
        planned.append(PlannedTensor(
            t, names[t.name], dtype, None if alias else sources[t.name],
            names[alias] if alias else None,
        ))
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
