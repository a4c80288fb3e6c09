"""A model directory slimmed file by file: torch shards, a Trainer's ``checkpoint-N``.

Each input file that keeps tensors is written again under the same name and in its own format
(a ``torch.save`` archive for ``.bin``/``.pt`` shards, safetensors for ``.safetensors``), each
with the keys it held; an index (``pytorch_model.bin.index.json``,
``model.safetensors.index.json``) is rewritten with the new weight map and total size. Files
whose every tensor was dropped (``optimizer.pt``, ``scheduler.pt``, ``rng_state.pth``) are not
written, nor are pickles without tensors (``training_args.bin``: it would run code on load) or
``trainer_state.json`` (it describes a training run the slim copy cannot resume). The
architecture and tokenizer files of the directory are copied as they are.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Protocol

from modelsize import inputs
from modelsize.formats.base import real_path
from modelsize.slimming.output import Output
from modelsize.slimming.plan import Plan, PlannedTensor
from modelsize.slimming.writers.base import Meter, Written

#: Files of a Trainer checkpoint that only resuming training needs.
_TRAINING_ONLY = frozenset({"trainer_state.json", "training_args.bin"})
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


class FilePart(Protocol):
    """One output file whose size is known before writing."""

    name: str

    @property
    def nbytes(self) -> int:
        """Exact size."""
        ...

    def write(self, fh: BinaryIO, meter: Meter, written: dict[str, Written]) -> None:
        """Write the file."""
        ...


@dataclass
class _SafetensorsPart:
    name: str
    layout: object

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes  # type: ignore[attr-defined,no-any-return]

    def write(self, fh: BinaryIO, meter: Meter, written: dict[str, Written]) -> None:
        from modelsize.slimming.writers.safetensors import write_file

        write_file(fh, self.layout, meter, written)  # type: ignore[arg-type]


@dataclass
class DirectoryJob:
    """Several files in a folder, the index written last."""

    files: list[str]
    main: str
    directory: bool
    predicted_bytes: int | None
    parts: list[FilePart]
    indexes: dict[str, bytes] = field(default_factory=dict)
    copies: list[tuple[Path, str]] = field(default_factory=list)

    def write(self, out: Output, meter: Meter) -> dict[str, Written]:
        """Every file, then the indexes, then the copies."""
        written: dict[str, Written] = {}
        for part in self.parts:
            part.write(out.open(part.name), meter, written)
        for name, data in self.indexes.items():
            out.open(name).write(data)
        for src, name in self.copies:
            with inputs.open_input(src) as fin:
                shutil.copyfileobj(fin, out.open(name), 1 << 20)
        return written

    def output_name(self, name: str) -> str:
        """Read back under the input's names (verification falls back to them)."""
        return name


def _relative(path: Path, base: Path) -> str:
    try:
        return path.relative_to(base).as_posix()
    except ValueError:
        return path.name


class DirectoryWriter:
    """A model directory of torch (or safetensors) weight files, kept file by file."""

    name = "directory"

    def default_target(self, plan: Plan, source: Path) -> Path:
        """``dir.slim/`` beside the input's folder."""
        folder = source if source.is_dir() else source.parent
        return folder.with_name(folder.name + ".slim")

    def prepare(self, plan: Plan, target: Path) -> DirectoryJob:
        """Lay out every file of the output folder."""
        return prepare_directory(plan, target)


def prepare_directory(plan: Plan, target: Path) -> DirectoryJob:
    """Lay out every file of the output folder."""
    from modelsize.slimming.writers.safetensors import layout
    from modelsize.slimming.writers.torch import torch_file

    inv = plan.inventory
    root = inv.path if inv.path.is_dir() else inv.path.parent
    storages = {s.key: s for s in inv.storages}
    planned = {t.name: t for t in plan.tensors}
    by_file: dict[int, list[PlannedTensor]] = {}
    for t in plan.tensors:
        holder = planned[t.alias_of] if t.alias_of is not None else t
        st = storages.get(holder.record.storage or "")
        by_file.setdefault(st.file if st is not None else 0, []).append(t)
    parts: list[FilePart] = []
    weight_maps: dict[str, dict[str, str]] = {".safetensors": {}, ".torch": {}}
    for file, tensors in sorted(by_file.items()):
        rel = _relative(inv.files[file].path, root)
        keys = {t.name: t.record.key for t in tensors}
        if rel.endswith(".safetensors"):
            renamed = [PlannedTensor(t.record, keys[t.name], t.dtype, t.source,
                                     keys.get(t.alias_of) if t.alias_of else None)
                       for t in tensors]
            aliases = {r.name: r.alias_of for r in renamed if r.alias_of is not None}
            parts.append(_SafetensorsPart(rel, layout(rel, renamed, {"format": "pt"}, aliases)))
            # Written under the key: the stream's CRC is filed under the plan name below.
            for r, t in zip(renamed, tensors, strict=True):
                r.name = t.name if r.alias_of is None else r.name
            weight_maps[".safetensors"].update({keys[t.name]: rel for t in tensors})
        else:
            parts.append(torch_file(rel, tensors, keys))
            weight_maps[".torch"].update({keys[t.name]: rel for t in tensors})
    indexes: dict[str, bytes] = {}
    written_names = {p.name for p in parts}
    for f in inv.files:
        rel = _relative(f.path, root)
        kind = ".safetensors" if rel.endswith(".safetensors.index.json") else (
            ".torch" if rel.endswith(".index.json") else None)
        if kind is None:
            continue
        total = sum(p.nbytes for p in parts if p.name in weight_maps[kind].values())
        doc = {"metadata": {"total_size": total}, "weight_map": weight_maps[kind]}
        indexes[rel] = (json.dumps(doc, indent=2) + "\n").encode("utf-8")
    covered = {real_path(f.path) for f in inv.files}
    copies: list[tuple[Path, str]] = []
    if inv.path.is_dir():
        for p in sorted(root.iterdir()):
            if not p.is_file() or p.name in written_names or p.name in indexes:
                continue
            if p.name in _TRAINING_ONLY:
                continue
            if real_path(p) in covered and (p.suffix in _PICKLE_SUFFIXES
                                           or p.name.endswith(".safetensors")):
                continue  # a file of the checkpoint whose tensors were all dropped
            copies.append((p, p.name))
    skipped = sorted(_relative(f.path, root) for f in inv.files
                     if _relative(f.path, root) not in written_names
                     and _relative(f.path, root) not in indexes
                     and all(c[1] != _relative(f.path, root) for c in copies))
    if skipped:
        plan.notes.append("not written (nothing inference needs): " + ", ".join(skipped))
    files = [p.name for p in parts] + list(indexes) + [name for _, name in copies]
    predicted = (sum(p.nbytes for p in parts) + sum(len(b) for b in indexes.values())
                 + sum(src.stat().st_size for src, _ in copies))
    main = next(iter(indexes), parts[-1].name if parts else "")
    return DirectoryJob(files, main, True, predicted, parts, indexes, copies)
