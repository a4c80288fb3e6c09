"""A model directory slimmed file by file: torch shards, a Trainer's ``checkpoint-N``.

A file the slim does not touch (every tensor kept as it is: a Trainer's ``rng_state.pth`` under
``--drop optimizer_state``, a shard that holds no optimizer state) passes through as it is, byte
for byte. Each other input file that keeps tensors is written again under the same name and in
its own format (a ``torch.save`` archive for ``.bin``/``.pt`` shards, safetensors for
``.safetensors``), each with the keys it held; an index (``pytorch_model.bin.index.json``,
``model.safetensors.index.json``) is rewritten with the new weight map and total size. Files
whose every tensor was dropped (``optimizer.pt``, ``scheduler.pt``, ``rng_state.pth``) are not
written, nor are pickles without tensors (``training_args.bin``: it would run code on load).
``trainer_state.json`` goes with them, unless a file only resuming reads is kept (then the
output is still a Trainer checkpoint, resumed with a fresh optimizer). The architecture and
tokenizer files of the directory are copied as they are.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Protocol

from modelsize import inputs
from modelsize.categories import Category
from modelsize.formats.base import real_path
from modelsize.inventory import Inventory
from modelsize.slimming.output import Output
from modelsize.slimming.plan import Plan, PlannedTensor
from modelsize.slimming.writers.base import Meter, Written, stream

#: Files of a Trainer checkpoint that only resuming training needs.
_TRAINING_ONLY = frozenset({"trainer_state.json", "training_args.bin"})
#: A Trainer checkpoint's files that resuming reads besides the weights.
_RESUME_FILES = ("optimizer.pt", "optimizer.bin", "scheduler.pt", "scaler.pt", "rng_state")
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
    #: Tensors of the files that pass through as they are, by file name.
    passed: dict[str, list[PlannedTensor]] = field(default_factory=dict)

    def write(self, out: Output, meter: Meter) -> dict[str, Written]:
        """Every file, then the indexes, then the copies (the tensors of a file passed through
        are read from the input for their CRC-32, which verification compares)."""
        written: dict[str, Written] = {}
        for part in self.parts:
            part.write(out.open(part.name), meter, written)
        for name, data in self.indexes.items():
            out.open(name).write(data)
        for src, name in self.copies:
            _copy_file(src, out.open(name))
            for t in self.passed.get(name, ()):
                s = stream(t, meter)
                for _ in s.chunks():
                    pass
                written[t.name] = s.written
        return written

    def output_name(self, name: str) -> str:
        """Read back under the input's names (verification falls back to them)."""
        return name


def _copy_file(src: Path, fh: BinaryIO) -> None:
    """``src`` byte for byte at ``fh``'s position, through the kernel where it can."""
    fh.flush()
    with inputs.open_input(src) as fin:
        size = os.fstat(fin.fileno()).st_size
        done = 0
        try:
            while done < size:
                n = os.copy_file_range(fin.fileno(), fh.fileno(), size - done)
                if n <= 0:
                    break
                done += n
        except OSError:
            pass  # the kernel cannot copy between these files: Python copies the rest
        fin.seek(done)
        fh.seek(0, os.SEEK_END)
        shutil.copyfileobj(fin, fh, 1 << 20)


def _untouched(plan: Plan, inv: Inventory, file: int, tensors: list[PlannedTensor]) -> bool:
    """Whether the slim keeps input file ``file`` as it is: every tensor in it kept, none cast
    or turned into an alias of a copy, no byte of it in a category the slim drops."""
    in_file = {s.key for s in inv.storages if s.file == file}
    mine = [t for t in inv.tensors if t.storage in in_file]
    names = {t.record.name for t in tensors}
    if len(mine) != len(tensors) or any(t.name not in names for t in mine):
        return False
    if any(t.cast or (t.alias_of is not None and t.record.category == Category.DUPLICATES)
           for t in tensors):
        return False
    dropped = {c for c in Category if c.value in plan.options.dropped}
    return not any(r.file == file and r.category in dropped and r.nbytes for r in inv.regions) \
        and not any(s.file == file and any(s.bytes_by_category.get(c) for c in dropped)
                    for s in inv.storages)


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
    passed: dict[str, list[PlannedTensor]] = {}
    for file, tensors in sorted(by_file.items()):
        rel = _relative(inv.files[file].path, root)
        keys = {t.name: t.record.key for t in tensors}
        if inv.path.is_dir() and _untouched(plan, inv, file, tensors):
            passed[rel] = tensors
            family = ".safetensors" if rel.endswith(".safetensors") else ".torch"
            weight_maps[family].update({keys[t.name]: rel for t in tensors})
            continue
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
    sizes = {p.name: p.nbytes for p in parts}
    sizes.update({rel: (root / rel).stat().st_size for rel in passed})
    written_names = set(sizes)
    for f in inv.files:
        rel = _relative(f.path, root)
        kind = ".safetensors" if rel.endswith(".safetensors.index.json") else (
            ".torch" if rel.endswith(".index.json") else None)
        if kind is None:
            continue
        total = sum(n for name, n in sizes.items() if name in weight_maps[kind].values())
        doc = {"metadata": {"total_size": total}, "weight_map": weight_maps[kind]}
        indexes[rel] = (json.dumps(doc, indent=2) + "\n").encode("utf-8")
    covered = {real_path(f.path) for f in inv.files}
    copies: list[tuple[Path, str]] = [(root / rel, rel) for rel in passed]
    resumable = any(n.startswith(_RESUME_FILES) for n in written_names)
    if inv.path.is_dir():
        for p in sorted(root.iterdir()):
            if not p.is_file() or p.name in written_names or p.name in indexes:
                continue
            if p.name in _TRAINING_ONLY and not (resumable and p.name.endswith(".json")):
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
    if passed:
        plan.notes.append("passed through as they are (nothing in them changes): "
                          + ", ".join(sorted(passed)))
    files = [p.name for p in parts] + list(indexes) + [name for _, name in copies]
    predicted = (sum(p.nbytes for p in parts) + sum(len(b) for b in indexes.values())
                 + sum(src.stat().st_size for src, _ in copies))
    main = next(iter(indexes), parts[-1].name if parts else files[0] if files else "")
    return DirectoryJob(files, main, True, predicted, parts, indexes, copies, passed)
