"""``modelsize.inspect(path) -> Report``: account for every byte of a saved model."""

from __future__ import annotations

import heapq
import operator
from pathlib import Path
from typing import Any

from modelsize import formats, inputs
from modelsize._records import field, record, replace
from modelsize.findings import Finding, explain, find
from modelsize.inventory import Inventory, TensorRecord
from modelsize.quantization import Quantization, analyze, config_for
from modelsize.report.json_stream import Lazy, materialized

_stored = operator.attrgetter("stored_nbytes")


@record(frozen=True)
class Report:
    """An inventory with its findings and the one-paragraph explanation."""

    inventory: Inventory
    findings: tuple[Finding, ...]
    summary: str
    _quantization: list[Quantization] = field(default_factory=list, repr=False, compare=False)

    @property
    def quantization(self) -> Quantization:
        """Parameters and bits per weight, overall and per group of weights stored alike
        (worked out on first use: a report of a million tensors may never need it)."""
        if not self._quantization:
            config, notes = config_for(self.inventory)
            found = analyze(self.inventory, config)
            if notes:
                found = replace(found, notes=notes)
            self._quantization.append(found)
        return self._quantization[0]

    @property
    def parameters(self) -> int:
        """The logical parameter count: packed weights counted as the elements they unpack
        to; scales, zero points and quant states not counted."""
        return self.quantization.parameters

    @property
    def bits_per_weight(self) -> float:
        """Stored bits of the weights (with their scales and zero points) per parameter."""
        return self.quantization.bits_per_weight

    @property
    def format(self) -> str:
        """Name of the reader that read the file."""
        return self.inventory.format

    @property
    def file_bytes(self) -> int:
        """Bytes of all files of the checkpoint."""
        return self.inventory.file_bytes

    def largest(self, n: int) -> list[TensorRecord]:
        """The ``n`` tensors charged with the most file bytes (ties in file order), found
        without sorting them all."""
        return heapq.nlargest(n, self.inventory.tensors, key=_stored)

    def __repr__(self) -> str:
        inv = self.inventory
        kinds = ", ".join(f.kind.value for f in self.findings) or "no findings"
        return (f"<Report {inv.path} ({inv.format}): {inv.file_bytes:,} bytes, "
                f"{len(inv.tensors):,} tensors; {kinds}>")

    def _repr_html_(self) -> str:
        from modelsize.report.html import card_inspect

        return card_inspect(self)

    def to_dict(self, top: int | None = None) -> dict[str, Any]:
        """The JSON schema documented in the README (``top`` limits the tensor list)."""
        out: dict[str, Any] = materialized(self.to_json(top))
        return out

    def to_json(self, top: int | None = None) -> dict[str, Any]:
        """:meth:`to_dict` with the tensor list made as it is written
        (:func:`modelsize.report.json_stream.dump` writes it, byte for byte what
        ``json.dumps(to_dict())`` gives, holding a batch of tensors at a time)."""
        inv = self.inventory
        tensors = self.largest(top) if top is not None else inv.tensors
        return {
            "path": str(inv.path),
            "format": inv.format,
            "file_bytes": inv.file_bytes,
            "files": [{"path": str(f.path), "bytes": f.nbytes} for f in inv.files],
            "bytes_by_category": {c.value: n for c, n in inv.bytes_by_category.items()},
            "summary": self.summary,
            "parameters": self.parameters,
            "bits_per_weight": round(self.bits_per_weight, 4),
            "quantization": self.quantization.to_dict(),
            "findings": [f.to_dict() for f in self.findings],
            "unsafe_globals": list(inv.unsafe_globals),
            "tensor_count": len(inv.tensors),
            "tensors": Lazy(t.to_dict() for t in tensors),
            "facts": dict(inv.facts),
            "notes": list(inv.notes),
        }


def report_for(inventory: Inventory) -> Report:
    """Findings and explanation for an inventory already read."""
    found = find(inventory)
    return Report(inventory, tuple(found), explain(inventory, found))


def inspect(path: str | Path) -> Report:
    """Read a checkpoint's metadata (never its tensor data, never its code) and explain it.

    ``path`` may be a file, a directory holding a checkpoint, or a multi-file prefix.
    Raises :class:`~modelsize.errors.InputError` subclasses on unreadable input, and when a
    file of it changed while it was being read (a sum over two versions would be wrong).
    """
    with inputs.watch(path, "inspect") as files:
        inventory = formats.read(path)
        files.confirm(f.path for f in inventory.files)
    return report_for(inventory)
