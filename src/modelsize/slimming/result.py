"""What a slim did: :class:`SlimReport` (data only; rendering lives in ``modelsize.report``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modelsize.categories import Category
from modelsize.inventory import Inventory

if TYPE_CHECKING:
    from modelsize.slimming.plan import Plan


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
    kept: tuple[KeptTensor, ...]
    dropped: tuple[Dropped, ...]
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
        out: dict[Category, tuple[int, int]] = {}
        for d in self.dropped:
            n, b = out.get(d.category, (0, 0))
            out[d.category] = (n + 1, b + d.stored_nbytes)
        return out

    @property
    def cast(self) -> list[KeptTensor]:
        """The tensors whose dtype changed."""
        return [k for k in self.kept if k.dtype != k.source_dtype]

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
            "kept": [k.to_dict() for k in self.kept],
            "dropped": [d.to_dict() for d in self.dropped],
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
