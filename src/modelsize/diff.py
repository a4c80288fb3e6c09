"""``modelsize diff A B``: two checkpoints side by side, by category and by tensor.

Both sides are read like ``inspect`` reads them (metadata only, any format). Tensors are
matched by name; names that differ only by a file label (``mp0.model:``, ``shard:``) or a
wrapper prefix (``module.`` of DDP/DeepSpeed, ``_orig_mod.`` of ``torch.compile``) are
matched too when that leaves no ambiguity, so a DeepSpeed checkpoint compares with the state
dict exported from it; so are names inside a training checkpoint's container
(``model_state_dict.fc1.weight``) and the same key in a weights-only file (``fc1.weight``),
also when the checkpoint holds that key twice (``model.fc1.weight`` and ``grads.fc1.weight``):
then the tensor of the same category is its pair.
A matched tensor whose dtype, shape or category differs is *changed*; values are never read.

A quantized checkpoint stores a weight as other tensors (``q_proj.qweight``, ``scales``...):
each quantized weight is also paired with the weight of the other side that has its logical
name and shape (:func:`modelsize.quantization.paired`), so ``diff`` shows a bfloat16 source
beside its 4-bit copy.

Two files of different formats rarely share names: a SavedModel says
``variables/3/.ATTRIBUTES/VARIABLE_VALUE`` where its TFLite export says
``functional_1/fc1_1/MatMul``. Between formats, the weights and buffers left unmatched are
then matched by layout, and only where that leaves no ambiguity: first by dtype and shape,
then by the shape's dimensions in any order (a converter transposes kernels: HWIO becomes
OHWI) whatever the dtype (a quantized export stores int8). A layout shared by two tensors of
one side matches nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modelsize.categories import Category
from modelsize.inventory import Inventory, TensorRecord
from modelsize.quantization import QuantizedWeight, analyze, config_for, paired

#: Prefixes that wrappers add to every parameter name (DDP / DeepSpeed, torch.compile).
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


@dataclass(frozen=True)
class TensorChange:
    """One tensor present on both sides whose dtype, shape or category differs."""

    name: str
    a: TensorRecord
    b: TensorRecord

    @property
    def changes(self) -> tuple[str, ...]:
        """What differs: any of ``dtype``, ``shape``, ``category``."""
        out = []
        if self.a.dtype != self.b.dtype:
            out.append("dtype")
        if self.a.shape != self.b.shape:
            out.append("shape")
        if self.a.category != self.b.category:
            out.append("category")
        return tuple(out)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "name": self.name,
            "b_name": self.b.name if self.b.name != self.name else None,
            "changes": list(self.changes),
            "a": _brief(self.a),
            "b": _brief(self.b),
        }


@dataclass(frozen=True)
class QuantizedPair:
    """One logical weight on both sides, quantized on at least one."""

    name: str
    a: QuantizedWeight
    b: QuantizedWeight

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""

        def side(w: QuantizedWeight) -> dict[str, Any]:
            return {"layout": w.layout, "label": w.label, "shape": list(w.shape),
                    "parameters": w.parameters, "counted_bytes": w.counted_bytes,
                    "bits_per_weight": round(w.bits_per_weight, 4), "tensors": list(w.tensors)}

        return {"name": self.name, "a": side(self.a), "b": side(self.b)}


def _brief(t: TensorRecord) -> dict[str, Any]:
    return {"dtype": t.dtype, "shape": list(t.shape), "nbytes": t.nbytes,
            "category": t.category.value}


@dataclass(frozen=True)
class Diff:
    """Two inventories compared: bytes per category and tensors added, removed, changed."""

    a: Inventory
    b: Inventory
    added: tuple[TensorRecord, ...]
    removed: tuple[TensorRecord, ...]
    changed: tuple[TensorChange, ...]
    unchanged: int
    renamed: int = 0
    by_layout: int = 0
    """Pairs matched by layout, not by name (files of different formats)."""
    quantized: tuple[QuantizedPair, ...] = ()
    """Quantized weights beside their other side's weight of the same logical name and shape."""

    def category_delta(self) -> dict[Category, tuple[int, int]]:
        """``{category: (bytes in A, bytes in B)}`` for every category, in display order."""
        return {c: (self.a.bytes_by_category[c], self.b.bytes_by_category[c]) for c in Category}

    @property
    def identical_layout(self) -> bool:
        """No tensor added, removed or changed (values may still differ)."""
        return not (self.added or self.removed or self.changed)

    def __repr__(self) -> str:
        return (f"<Diff {self.a.path} ({self.a.file_bytes:,} bytes) vs {self.b.path} "
                f"({self.b.file_bytes:,} bytes): {len(self.added)} added, {len(self.removed)} "
                f"removed, {len(self.changed)} changed, {self.unchanged} unchanged>")

    def _repr_html_(self) -> str:
        from modelsize.report.html import card_diff

        return card_diff(self)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form of the comparison."""

        def side(inv: Inventory) -> dict[str, Any]:
            return {"path": str(inv.path), "format": inv.format, "file_bytes": inv.file_bytes,
                    "files": len(inv.files), "tensor_count": len(inv.tensors)}

        return {
            "a": side(self.a),
            "b": side(self.b),
            "file_bytes": {"a": self.a.file_bytes, "b": self.b.file_bytes,
                           "delta": self.b.file_bytes - self.a.file_bytes},
            "bytes_by_category": {
                c.value: {"a": x, "b": y, "delta": y - x}
                for c, (x, y) in self.category_delta().items()
            },
            "tensors": {"unchanged": self.unchanged, "changed": len(self.changed),
                        "added": len(self.added), "removed": len(self.removed),
                        "matched_by_stripped_name": self.renamed,
                        "matched_by_layout": self.by_layout},
            "added": [t.to_dict() for t in self.added],
            "removed": [t.to_dict() for t in self.removed],
            "changed": [c.to_dict() for c in self.changed],
            "quantized": [q.to_dict() for q in self.quantized],
        }


def _stripped(t: TensorRecord) -> str:
    """The name without its container (``model.`` of a training checkpoint), a file label
    (``label:``) and wrapper prefixes: the key the model loads."""
    bare = t.key.rsplit(":", 1)[-1]
    changed = True
    while changed:
        changed = False
        for prefix in _WRAPPER_PREFIXES:
            if bare.startswith(prefix):
                bare, changed = bare[len(prefix):], True
    return bare


def _first_by_name(tensors: Iterable[TensorRecord]) -> dict[str, TensorRecord]:
    out: dict[str, TensorRecord] = {}
    for t in tensors:
        out.setdefault(t.name, t)
    return out


def _by_stripped(tensors: Iterable[TensorRecord]) -> dict[str, list[TensorRecord]]:
    groups: dict[str, list[TensorRecord]] = {}
    for t in tensors:
        groups.setdefault(_stripped(t), []).append(t)
    return groups


#: What tells apart tensors of one key in a training checkpoint (``model.fc.weight``,
#: ``grads.fc.weight``, ``ema.fc.weight``), tried in turn: everything, then the category.
_KIN_KEYS: tuple[Callable[[TensorRecord], tuple[Any, ...]], ...] = (
    lambda t: (t.category, "ema" in t.tags, t.dtype, t.shape),
    lambda t: (t.category, "ema" in t.tags),
)


def _match_stripped(a: list[TensorRecord], b: list[TensorRecord],
                    ) -> list[tuple[TensorRecord, TensorRecord]]:
    """Pairs of tensors with the same key once containers, file labels and wrapper prefixes
    are stripped. A key held by one tensor on each side pairs them; a key several tensors of
    one side share (a checkpoint's ``model.fc.weight`` and ``grads.fc.weight`` beside
    ``fc.weight``) pairs those whose category (EMA tag, dtype, shape) is unique to one tensor
    on each side within the key: a slimmed copy keeps the weights, never the gradients."""
    left, right = _by_stripped(a), _by_stripped(b)
    pairs: list[tuple[TensorRecord, TensorRecord]] = []
    for key, xs in left.items():
        ys = right.get(key)
        if ys is None:
            continue
        if len(xs) == 1 and len(ys) == 1:
            pairs.append((xs[0], ys[0]))
            continue
        for kin in _KIN_KEYS:
            groups: dict[tuple[Any, ...], tuple[list[TensorRecord], list[TensorRecord]]] = {}
            for side, tensors in enumerate((xs, ys)):
                for t in tensors:
                    groups.setdefault(kin(t), ([], []))[side].append(t)
            found = [(x[0], y[0]) for x, y in groups.values() if len(x) == 1 and len(y) == 1]
            pairs += found
            taken = {id(t) for pair in found for t in pair}
            xs = [t for t in xs if id(t) not in taken]
            ys = [t for t in ys if id(t) not in taken]
    return pairs


def compare(a: Inventory, b: Inventory) -> Diff:
    """The :class:`Diff` of two inventories already read."""
    left, right = _first_by_name(a.tensors), _first_by_name(b.tensors)
    pairs = [(name, left[name], right[name]) for name in left if name in right]
    only_a = [t for n, t in left.items() if n not in right]
    only_b = [t for n, t in right.items() if n not in left]
    renamed = 0
    if only_a and only_b:
        matched = _match_stripped(only_a, only_b)
        pairs += [(x.name, x, y) for x, y in matched]
        renamed = len(matched)
        taken = {id(t) for pair in matched for t in pair}
        only_a = [t for t in only_a if id(t) not in taken]
        only_b = [t for t in only_b if id(t) not in taken]
    by_layout = 0
    if only_a and only_b and a.format != b.format:
        for x, y in _match_by_layout(only_a, only_b):
            pairs.append((x.name, x, y))
            by_layout += 1
        taken = {id(t) for _, x, y in pairs for t in (x, y)}
        only_a = [t for t in only_a if id(t) not in taken]
        only_b = [t for t in only_b if id(t) not in taken]
    changes = [TensorChange(name, x, y) for name, x, y in pairs]
    changed = tuple(c for c in changes if c.changes)
    return Diff(a, b, tuple(only_b), tuple(only_a), changed, len(changes) - len(changed),
                renamed, by_layout, _quantized_pairs(a, b))


def _quantized_pairs(a: Inventory, b: Inventory) -> tuple[QuantizedPair, ...]:
    """Each side's weights as :mod:`modelsize.quantization` reads them, paired by logical name
    where one of the two is quantized."""
    left = analyze(a, config_for(a)[0]).every_weight()
    right = analyze(b, config_for(b)[0]).every_weight()
    return tuple(QuantizedPair(x.name, x, y) for x, y in paired(left, right))


#: Keys tensors of two formats are matched by, in turn: the same layout, then the same
#: dimensions in any order and any dtype (transposed, quantized or cast by a converter).
_LAYOUT_KEYS: tuple[Callable[[TensorRecord], tuple[Any, ...]], ...] = (
    lambda t: (t.dtype, t.shape),
    lambda t: tuple(sorted(t.shape)),
)
_MATCHABLE = frozenset({Category.WEIGHTS, Category.BUFFERS})


def _match_by_layout(a: list[TensorRecord], b: list[TensorRecord],
                     ) -> list[tuple[TensorRecord, TensorRecord]]:
    """Pairs of weights or buffers whose layout is unique on both sides (see the module
    docstring); scalars and one-element tensors are never matched."""
    left = [t for t in a if t.category in _MATCHABLE and t.numel > 1]
    right = [t for t in b if t.category in _MATCHABLE and t.numel > 1]
    pairs: list[tuple[TensorRecord, TensorRecord]] = []
    for key in _LAYOUT_KEYS:
        groups: dict[tuple[Any, ...], tuple[list[TensorRecord], list[TensorRecord]]] = {}
        for side, tensors in enumerate((left, right)):
            for t in tensors:
                groups.setdefault(key(t), ([], []))[side].append(t)
        found = [(x[0], y[0]) for x, y in groups.values() if len(x) == 1 and len(y) == 1]
        pairs += found
        taken = {id(t) for pair in found for t in pair}
        left = [t for t in left if id(t) not in taken]
        right = [t for t in right if id(t) not in taken]
    return pairs


def diff(a: str | Path | Inventory, b: str | Path | Inventory) -> Diff:
    """Compare two checkpoints (paths of any format modelsize reads, or inventories).

    Raises the same :class:`~modelsize.errors.InputError` subclasses as ``inspect``.
    """
    from modelsize import formats

    left = a if isinstance(a, Inventory) else formats.read(a)
    right = b if isinstance(b, Inventory) else formats.read(b)
    return compare(left, right)
