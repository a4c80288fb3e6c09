"""What a slim did: :class:`SlimReport` (data only; rendering lives in ``modelsize.report``)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, overload

from modelsize.categories import Category
from modelsize.inventory import Inventory
from modelsize.report.json_stream import Lazy, materialized

if TYPE_CHECKING:
    from modelsize.slimming.plan import DroppedTensor, Plan
    from modelsize.slimming.writers.base import Written

_Item = TypeVar("_Item")


@dataclass(frozen=True)
class KeptTensor:
    """One tensor of the output and where it came from.

    ``crc32`` is the CRC-32 of its bytes, equal in the source (or the cast of the source)
    and in the output when verified. ``max_abs_error``/``max_rel_error``/``overflow`` describe
    a cast (``None`` when not cast). An alias has no bytes of its own (``alias_of``).
    """

    name: str
    source_name: str
    dtype: str
    source_dtype: str
    shape: tuple[int, ...]
    nbytes: int
    crc32: int | None = None
    alias_of: str | None = None
    max_abs_error: float | None = None
    max_rel_error: float | None = None
    overflow: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "name": self.name, "source_name": self.source_name, "dtype": self.dtype,
            "source_dtype": self.source_dtype, "shape": list(self.shape), "nbytes": self.nbytes,
            "crc32": self.crc32, "alias_of": self.alias_of, "max_abs_error": self.max_abs_error,
            "max_rel_error": self.max_rel_error, "overflow": self.overflow,
        }


@dataclass(frozen=True)
class Dropped:
    """A tensor of the input that the output does not have."""

    name: str
    category: Category
    stored_nbytes: int
    reason: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"name": self.name, "category": self.category.value,
                "stored_nbytes": self.stored_nbytes, "reason": self.reason}


class _Table(Sequence[_Item]):
    """A read-only sequence whose items are made when asked for, equal to any sequence of
    equal items (``report.dropped == ()``)."""

    def __len__(self) -> int:
        raise NotImplementedError

    def _item(self, i: int) -> _Item:
        raise NotImplementedError

    @overload
    def __getitem__(self, i: int) -> _Item: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[_Item, ...]: ...
    def __getitem__(self, i: int | slice) -> _Item | tuple[_Item, ...]:
        if isinstance(i, slice):
            return tuple(self._item(j) for j in range(*i.indices(len(self))))
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("index out of range")
        return self._item(i)

    def __iter__(self) -> Iterator[_Item]:
        for i in range(len(self)):
            yield self._item(i)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other,
                                                                       strict=True))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        shown = ", ".join(repr(x) for x in self[:3])
        more = f", ... {len(self) - 3} more" if len(self) > 3 else ""
        return f"({shown}{more})"


class KeptTable(_Table[KeptTensor]):
    """The kept tensors of a slim, made from its plan and what was written when asked for:
    a report of a million kept tensors holds the plan's columns and a CRC per tensor, not a
    million :class:`KeptTensor` objects. The summaries a report prints (how many stored,
    their bytes, the aliases, the casts and their worst error) are computed without making
    them."""

    def __init__(self, plan: Plan, written: Mapping[str, Written], copied: bool) -> None:
        self.plan = plan
        self.written = written
        self.copied = copied

    def __len__(self) -> int:
        return len(self.plan)

    def _written(self, i: int, name: str) -> Written | None:
        from modelsize.slimming.writers.base import WrittenTable

        if isinstance(self.written, WrittenTable):
            return self.written.at(i)
        return self.written.get(name)

    def _item(self, i: int) -> KeptTensor:
        from modelsize.slimming.writers.base import output_nbytes

        t = self.plan.row(i)
        w = self._written(i, t.name)
        err = w.error if w is not None else None
        return KeptTensor(
            t.record.name if self.copied else t.name, t.record.name, t.dtype, t.record.dtype,
            t.shape, output_nbytes(t), w.crc if w is not None else None, t.alias_of,
            err.max_abs if err else None, err.max_rel if err else None,
            err.overflow if err else 0,
        )

    def stored(self) -> tuple[int, int]:
        """(tensors with bytes of their own, the bytes they hold in the output)."""
        return self.plan.stored_count, self.plan.output_bytes()

    def aliases(self) -> list[tuple[str, str]]:
        """``(alias, tensor holding its bytes)`` in order."""
        return [(self.plan.row(i).name if not self.copied else self.plan.row(i).record.name,
                 original) for i, original in sorted(self.plan.alias_indices().items())]

    def cast(self) -> list[KeptTensor]:
        """The tensors whose dtype changed."""
        if not self.plan.casts_any:
            return []
        return [self._item(i) for i, t in enumerate(self.plan.rows()) if t.cast]

    def with_errors(self) -> list[KeptTensor]:
        """The tensors a cast changed that have an error recorded (the written ones)."""
        from modelsize.slimming.writers.base import WrittenTable

        if isinstance(self.written, WrittenTable):
            return [self._item(i) for i in sorted(self.written.errors)]
        if not any(w.error is not None for w in self.written.values()):
            return []  # a copy writes no tensor, a cast-free rewrite no error
        return [k for k in self if k.max_rel_error is not None or k.overflow]


class DroppedTable(_Table[Dropped]):
    """The dropped tensors of a slim, each :class:`Dropped` made when asked for."""

    def __init__(self, dropped: Sequence[DroppedTensor]) -> None:
        self.dropped = dropped

    def __len__(self) -> int:
        return len(self.dropped)

    def _item(self, i: int) -> Dropped:
        d = self.dropped[i]
        return Dropped(d.record.name, d.record.category, d.record.stored_nbytes, d.reason)

    def by_category(self) -> dict[Category, tuple[int, int]]:
        """``{category: (tensors dropped, bytes they were charged)}``."""
        out: dict[Category, tuple[int, int]] = {}
        for d in self.dropped:
            r = d.record
            n, b = out.get(r.category, (0, 0))
            out[r.category] = (n + 1, b + r.stored_nbytes)
        return out


@dataclass(frozen=True)
class SlimReport:
    """The input, the output, what was kept, dropped and cast, and the verification.

    ``output`` is the output read back by modelsize's own reader (``None`` on a dry run);
    ``output_files`` the files as committed, with their sizes. ``predicted_bytes`` is the
    planned size (exact for safetensors, npz and torch zip outputs; ``None`` where the format
    only knows once written). ``copied``: there was nothing to slim, and the output is a
    byte-for-byte copy of the input.
    """

    source: Inventory
    target: Path
    output_format: str
    dry_run: bool
    predicted_bytes: int | None
    kept: Sequence[KeptTensor]
    dropped: Sequence[Dropped]
    notes: tuple[str, ...]
    output: Inventory | None = None
    output_files: tuple[tuple[Path, int], ...] = ()
    verified: bool = False
    #: Nothing to slim: the output is the input, byte for byte.
    copied: bool = False

    @property
    def source_bytes(self) -> int:
        """Bytes of the input."""
        return self.source.file_bytes

    @property
    def output_bytes(self) -> int | None:
        """Bytes of the output (planned on a dry run)."""
        if self.output_files:
            return sum(n for _, n in self.output_files)
        return self.predicted_bytes

    @property
    def saved_bytes(self) -> int | None:
        """Input bytes minus output bytes."""
        out = self.output_bytes
        return None if out is None else self.source_bytes - out

    def dropped_by_category(self) -> dict[Category, tuple[int, int]]:
        """``{category: (tensors dropped, bytes they were charged)}``."""
        if isinstance(self.dropped, DroppedTable):
            return self.dropped.by_category()
        out: dict[Category, tuple[int, int]] = {}
        for d in self.dropped:
            n, b = out.get(d.category, (0, 0))
            out[d.category] = (n + 1, b + d.stored_nbytes)
        return out

    @property
    def cast(self) -> list[KeptTensor]:
        """The tensors whose dtype changed."""
        if isinstance(self.kept, KeptTable):
            return self.kept.cast()
        return [k for k in self.kept if k.dtype != k.source_dtype]

    def stored(self) -> tuple[int, int]:
        """(kept tensors with bytes of their own, the bytes they hold in the output)."""
        if isinstance(self.kept, KeptTable):
            return self.kept.stored()
        stored = [k for k in self.kept if k.alias_of is None]
        return len(stored), sum(k.nbytes for k in stored)

    def aliases(self) -> list[tuple[str, str]]:
        """``(alias, tensor holding its bytes)`` for each kept alias, in order."""
        if isinstance(self.kept, KeptTable):
            return self.kept.aliases()
        return [(k.name, k.alias_of) for k in self.kept if k.alias_of is not None]

    def worst_cast(self) -> KeptTensor | None:
        """The cast tensor with the largest relative error (``None`` before writing)."""
        found = (self.kept.with_errors() if isinstance(self.kept, KeptTable)
                 else self.cast)
        with_error = [k for k in found if k.max_rel_error is not None]
        return max(with_error, key=lambda k: k.max_rel_error or 0.0) if with_error else None

    def __repr__(self) -> str:
        out = self.output_bytes
        size = f"{self.source_bytes:,} -> {out:,} bytes" if out is not None else "?"
        state = "dry run" if self.dry_run else ("verified" if self.verified else "not verified")
        return (f"<SlimReport {self.source.path} -> {self.target} ({self.output_format}): "
                f"{size}, {len(self.kept)} kept, {len(self.dropped)} dropped, {state}>")

    def _repr_html_(self) -> str:
        from modelsize.report.html import card_slim

        return card_slim(self)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (the schema in the README)."""
        out: dict[str, Any] = materialized(self._json())
        return out

    def to_json(self) -> dict[str, Any]:
        """:meth:`to_dict` with the kept and dropped lists made as they are written
        (:func:`modelsize.report.json_stream.dump`: the same text as ``json.dumps`` of
        :meth:`to_dict`). A report type that adds to :meth:`to_dict` gives its dict."""
        if type(self).to_dict is not SlimReport.to_dict:
            return self.to_dict()
        return self._json()

    def _json(self) -> dict[str, Any]:
        after = self.output.bytes_by_category if self.output is not None else None
        return {
            "input": str(self.source.path),
            "input_format": self.source.format,
            "output": str(self.target),
            "output_format": self.output_format,
            "dry_run": self.dry_run,
            "input_bytes": self.source_bytes,
            "output_bytes": self.output_bytes,
            "predicted_bytes": self.predicted_bytes,
            "saved_bytes": self.saved_bytes,
            "bytes_by_category": {
                c.value: {"before": self.source.bytes_by_category[c],
                          "after": None if after is None else after[c]}
                for c in Category
            },
            "files": [{"path": str(p), "bytes": n} for p, n in self.output_files],
            "verified": self.verified,
            "copied": self.copied,
            "kept": Lazy(k.to_dict() for k in self.kept),
            "dropped": Lazy(d.to_dict() for d in self.dropped),
            "dropped_by_category": {c.value: {"tensors": n, "bytes": b}
                                    for c, (n, b) in self.dropped_by_category().items()},
            "notes": list(self.notes),
        }


def unsafe_note(plan: Plan, copied: bool) -> list[str]:
    """What became of the callables the input's pickle would import and call."""
    unsafe = plan.inventory.unsafe_globals
    if not unsafe:
        return []
    names = f"{', '.join(unsafe[:4])}{', ...' if len(unsafe) > 4 else ''}"
    if copied:
        return [f"the copy is the input's pickle, which would import and call {len(unsafe)} "
                f"unsafe global(s) ({names}); --to safetensors writes its tensors alone"]
    return [f"the input's pickle would import and call {len(unsafe)} unsafe global(s) "
            f"({names}); the output holds the tensors and none of them (nothing from the input "
            "was run)"]


def growth_notes(plan: Plan, written_as: str, out: Inventory) -> list[str]:
    """Why an output is larger than its input, from the bytes by category on both sides
    (a rewrite that holds the same tensors in another framing)."""
    src = plan.inventory
    grew = out.file_bytes - src.file_bytes
    if grew <= 0:
        return []
    if plan.options.to != "same":
        why = f"converted to {out.format}, as --to {plan.options.to} asks"
    elif out.format != src.format:
        why = f"written as {out.format}: slim writes no {src.format} files"
    else:
        why = f"rewritten by modelsize's {written_as} writer"
    more = [f"{c.value} {src.bytes_by_category[c]:,} -> {out.bytes_by_category[c]:,} bytes"
            for c in Category if out.bytes_by_category[c] > src.bytes_by_category[c]]
    return [f"the output is {grew:,} bytes larger than the input ({why}): " + "; ".join(more)]
