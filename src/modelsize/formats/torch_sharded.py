"""Hugging Face model directories and sharded checkpoints whose weights are ``torch.save`` files.

Layouts read here (reader ``pytorch-sharded``)::

    pytorch_model.bin.index.json        {"metadata": {"total_size"}, "weight_map": {name: shard}}
    pytorch_model-00001-of-00003.bin    one torch.save state dict per shard
    config.json                         the architecture (graph); generation_config.json (metadata)

or a plain directory holding one ``pytorch_model.bin`` / ``model.pt`` (with its config), or a
``checkpoint-N`` directory of transformers' Trainer: the weights (torch or safetensors) plus
``optimizer.pt`` / ``scheduler.pt`` / ``scaler.pt`` (optimizer state), ``rng_state*.pth`` and
``training_args.bin`` (other) and ``trainer_state.json`` (metadata). Each
shard is read by the single-file PyTorch readers (zip or legacy format) and the per-file
inventories are merged into one (:func:`merge`), which the DeepSpeed reader reuses: every byte
of every file keeps the category its own reader gave it. Model directories that hold
safetensors weights (and are no Trainer checkpoint) belong to the safetensors readers
(``transformers`` loads those first).

Known limitation: identical tensors stored in two different shards are not flagged as
duplicates (duplicate detection runs per file).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path, PurePosixPath

from modelsize._records import field, record
from modelsize.categories import Category
from modelsize.errors import CorruptFileError, printable
from modelsize.formats._torch_tree import torch_storage_chunks
from modelsize.formats.base import Source, is_regular_file, real_path
from modelsize.formats.safetensors import read_index as safetensors_index
from modelsize.formats.safetensors import read_weight_map
from modelsize.formats.torch_legacy import TorchLegacyReader
from modelsize.formats.torch_zip import TorchZipReader
from modelsize.inventory import (
    FileInfo,
    Inventory,
    Region,
    StorageRecord,
    TensorRecord,
)

FORMAT = "pytorch-sharded"
#: An index is a JSON map of tensor names; even the largest models stay far below this.
INDEX_SUFFIXES = (".bin.index.json", ".pt.index.json", ".pth.index.json")
#: Single-file weights of a model directory, in the order transformers looks for them.
WEIGHT_NAMES = ("pytorch_model.bin", "model.pt", "model.pth", "pytorch_model.pt", "model.bin")
#: Files of a model directory counted with the weights, and their category.
SIDE_FILES: dict[str, Category] = {
    "config.json": Category.GRAPH,
    "generation_config.json": Category.METADATA,
}

#: Decides a tensor's category anew after its file's own reader classified it (None: keep).
Recategorize = Callable[[TensorRecord], Category | None]


# -- merging per-file inventories ------------------------------------------------------------


@record
class Part:
    """One file's inventory inside a multi-file checkpoint.

    ``label`` (the file's path relative to the checkpoint) makes storage keys unique and
    prefixes notes; ``name_prefix`` is put before every tensor name (empty for shards of one
    state dict, whose names are already unique).
    """

    inventory: Inventory
    label: str
    name_prefix: str = ""
    recategorize: Recategorize | None = None
    allowed_globals: frozenset[str] = frozenset()


@record
class SideFile:
    """A whole file counted in one category (an index, a config, a ``latest`` tag file)."""

    path: Path
    category: Category
    label: str


@record
class Merged:
    """What :func:`merge` needs besides the parts."""

    format: str
    root: Path
    side_files: list[SideFile] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    facts: dict[str, str] = field(default_factory=dict)


def read_torch_file(path: Path) -> Inventory:
    """One ``torch.save`` file (zip or legacy format), read by the single-file PyTorch readers."""
    source = Source.open(path)
    if source.kind != "file":
        raise CorruptFileError(path, "pytorch", "expected a torch.save file, found no file")
    for reader in (TorchZipReader(), TorchLegacyReader()):
        if reader.sniff(source):
            return reader.read(source)
    raise CorruptFileError(
        path, "pytorch",
        f"expected a torch.save file (zip archive or legacy pickle), found magic bytes "
        f"{source.head[:8]!r}",
    )


def _recategorized(
    storage: StorageRecord, viewers: list[tuple[TensorRecord, Category]]
) -> dict[Category, int]:
    """A storage's bytes moved to its viewers' new categories, where that is unambiguous."""
    moves: dict[Category, set[Category]] = {}
    for old, new in ((t.category, new) for t, new in viewers):
        moves.setdefault(old, set()).add(new)
    out: dict[Category, int] = {}
    for cat, n in storage.bytes_by_category.items():
        targets = moves.get(cat)
        target = next(iter(targets)) if targets is not None and len(targets) == 1 else cat
        out[target] = out.get(target, 0) + n
    return out


def _merge_part(
    part: Part, file_base: int
) -> tuple[list[TensorRecord], list[StorageRecord], list[Region]]:
    inv = part.inventory
    key = f"{part.label}:"
    new_cat: dict[int, Category] = {}
    if part.recategorize is not None:
        for i, t in enumerate(inv.tensors):
            cat = part.recategorize(t)
            if cat is not None and cat != t.category and t.category not in (
                Category.DUPLICATES, Category.UNUSED_STORAGE
            ):
                new_cat[i] = cat
    viewers: dict[str, list[tuple[TensorRecord, Category]]] = {}
    for i, t in enumerate(inv.tensors):
        if t.storage is not None:
            viewers.setdefault(t.storage, []).append((t, new_cat.get(i, t.category)))
    storages = []
    for s in inv.storages:
        totals = s.bytes_by_category
        if new_cat and any(new != t.category for t, new in viewers.get(s.key, [])):
            totals = _recategorized(s, viewers[s.key])
        storages.append(
            StorageRecord(
                key + s.key, file_base + s.file, s.offset, s.nbytes, s.logical_nbytes,
                s.compressed, s.dtype, totals,
                None if s.duplicate_of is None else key + s.duplicate_of,
            )
        )
    tensors = [
        TensorRecord(
            part.name_prefix + t.name, t.dtype, t.shape, new_cat.get(i, t.category), t.nbytes,
            t.stored_nbytes, None if t.storage is None else key + t.storage, t.storage_offset,
            t.tags, None if t.duplicate_of is None else part.name_prefix + t.duplicate_of,
            t.strides, part.name_prefix + t.container,
        )
        for i, t in enumerate(inv.tensors)
    ]
    regions = [
        Region(file_base + r.file, r.offset, r.nbytes, r.category, r.label) for r in inv.regions
    ]
    return tensors, storages, regions


def merge(spec: Merged, parts: Sequence[Part]) -> Inventory:
    """One :class:`Inventory` over several files: each part's bytes keep their categories.

    Side files are counted whole in their category. Unsafe globals are the union of the parts'
    (minus each part's ``allowed_globals``); notes are prefixed with the part's label; facts
    with the same key and different values are joined.
    """
    files: list[FileInfo] = []
    tensors: list[TensorRecord] = []
    storages: list[StorageRecord] = []
    regions: list[Region] = []
    unsafe: dict[str, None] = {}
    notes: list[str] = []
    facts: dict[str, str] = {}
    for part in parts:
        t, s, r = _merge_part(part, len(files))
        files.extend(part.inventory.files)
        tensors += t
        storages += s
        regions += r
        unsafe.update(
            dict.fromkeys(g for g in part.inventory.unsafe_globals if g not in part.allowed_globals)
        )
        notes += [f"{part.label}: {n}" for n in part.inventory.notes]
        for k, v in part.inventory.facts.items():
            if k == "path":
                continue
            old = facts.get(k)
            if old is None:
                facts[k] = v
            elif v not in old.split(", "):
                facts[k] = f"{old}, {v}"
    for side in spec.side_files:
        size = side.path.stat().st_size
        regions.append(Region(len(files), 0, size, side.category, side.label))
        files.append(FileInfo(side.path, size))
    facts.update(spec.facts)
    facts["path"] = str(spec.root)
    return Inventory(
        format=spec.format,
        files=tuple(files),
        tensors=tuple(tensors),
        storages=tuple(storages),
        regions=tuple(regions),
        unsafe_globals=tuple(unsafe),
        notes=tuple(dict.fromkeys([*spec.notes, *notes])),
        facts=facts,
    )


def bytes_by_file(inv: Inventory) -> list[dict[Category, int]]:
    """Bytes per category of each file of ``inv`` (same order as ``inv.files``)."""
    out: list[dict[Category, int]] = [{} for _ in inv.files]
    for r in inv.regions:
        out[r.file][r.category] = out[r.file].get(r.category, 0) + r.nbytes
    for s in inv.storages:
        for cat, n in s.bytes_by_category.items():
            out[s.file][cat] = out[s.file].get(cat, 0) + n
    return out


def split_facts(inv: Inventory, groups: dict[str, list[int]]) -> dict[str, str]:
    """``{group: "N bytes: a weights, b optimizer_state, ..."}`` for groups of file indices.

    How a multi-file checkpoint splits across ranks (or model and optimizer files).
    """
    per_file = bytes_by_file(inv)
    out = {}
    for label, indices in groups.items():
        totals: dict[Category, int] = {}
        for i in indices:
            for cat, n in per_file[i].items():
                totals[cat] = totals.get(cat, 0) + n
        parts = ", ".join(f"{totals[c]} {c.value}" for c in Category if totals.get(c))
        out[label] = f"{sum(totals.values())} bytes" + (f": {parts}" if parts else "")
    return out


def relative(path: Path, base: Path) -> str:
    """``path`` relative to ``base`` in POSIX form (the path itself if it is elsewhere)."""
    try:
        return path.relative_to(base).as_posix()
    except ValueError:
        return path.as_posix()


def inside(base: Path, name: str, owner: Path, fmt: str, what: str) -> Path:
    """``base/name`` for a file name read from a checkpoint, refused if it leaves ``base``.

    The check is on the name, not the resolved path: the Hugging Face cache links every file
    to a blob outside its snapshot directory.
    """
    rel = PurePosixPath(name.replace("\\", "/"))
    if not name or rel.is_absolute() or ".." in rel.parts or ":" in name or "\0" in name:
        raise CorruptFileError(
            owner, fmt, f"{what} {printable(name)!r} is not a file name inside {base.name or base}"
        )
    return base.joinpath(*rel.parts)


def left_out_note(root: Path, files: Iterable[Path]) -> str | None:
    """The note naming the files of a directory that were not counted."""
    names = sorted(p.name for p in files)
    if not names:
        return None
    return (
        f"{len(names)} other file(s) in {printable(root.name)} are not part of the checkpoint "
        "and were not counted: "
        + ", ".join(printable(n, 60) for n in names[:5])
        + (", ..." if len(names) > 5 else "")
    )


# -- the Hugging Face layout -----------------------------------------------------------------


def _is_index_name(name: str) -> bool:
    return name.endswith(INDEX_SUFFIXES)


def find_index(directory: Path) -> Path | None:
    """The torch shard index of a model directory (``pytorch_model.bin.index.json`` first)."""
    preferred = directory / "pytorch_model.bin.index.json"
    if preferred.is_file():
        return preferred
    found = sorted(p for p in directory.iterdir() if p.is_file() and _is_index_name(p.name))
    return found[0] if found else None


def find_weights(directory: Path) -> Path | None:
    """The single-file weights of a model directory, if any."""
    return next((directory / n for n in WEIGHT_NAMES if (directory / n).is_file()), None)


def _has_safetensors(directory: Path) -> bool:
    return any(p.name.endswith((".safetensors", ".safetensors.index.json"))
               for p in directory.iterdir())


def read_index(path: Path) -> dict[str, str]:
    """The weight map of an index file (tensor name -> shard file name), validated."""
    return read_weight_map(path, FORMAT)


def _total_size(index: Path) -> int | None:
    return safetensors_index(index, FORMAT).total_size


def read_model(
    root: Path, index: Path | None, weights: list[Path], directory: Path | None,
    extra: Sequence[Part] = (), extra_files: Sequence[Path] = (),
) -> Inventory:
    """One inventory over an optional index, its torch shards and a directory's config files.

    ``extra`` parts (a Trainer's optimizer, its safetensors weights...) are merged after the
    shards; ``extra_files`` are the files they and the side files cover.
    """
    spec = Merged(FORMAT, root)
    weight_map: dict[str, str] = {}
    shard_of: dict[str, Path] = {}
    if index is not None:
        weight_map = read_index(index)
        for shard in sorted(set(weight_map.values())):
            path = inside(index.parent, shard, index, FORMAT, "shard")
            if not is_regular_file(path):  # a FIFO shard is refused, not "missing"
                raise CorruptFileError(
                    index, FORMAT,
                    f"shard {printable(shard)!r} named in the index is missing "
                    f"(expected {printable(str(path))})",
                )
            shard_of[shard] = path
        weights = list(dict.fromkeys(shard_of.values()))
        spec.side_files.append(SideFile(index, Category.METADATA, "shard index"))
    base = index.parent if index is not None else (directory or weights[0].parent)
    parts = [Part(read_torch_file(p), relative(p, base)) for p in weights]

    names_in = {p: {t.name for t in part.inventory.tensors} for p, part in zip(weights, parts,
                                                                               strict=True)}
    seen: dict[str, str] = {}
    for part in parts:
        clash = [t.name for t in part.inventory.tensors if t.name in seen]
        if clash:
            part.name_prefix = f"{part.label}:"
            spec.notes.append(
                f"{len(clash)} tensor name(s) of {printable(part.label)} also appear in "
                f"{printable(seen[clash[0]])} (e.g. {printable(clash[0], 80)})"
            )
        seen.update(dict.fromkeys((t.name for t in part.inventory.tensors), part.label))
    if index is not None:
        for name, shard in weight_map.items():
            if name not in names_in[shard_of[shard]]:
                raise CorruptFileError(
                    index, FORMAT,
                    f"index places tensor {printable(name)!r} in {printable(shard)!r}, which "
                    "holds no such tensor",
                )
        unlisted = sum(len(names - set(weight_map)) for names in names_in.values())
        if unlisted:
            spec.notes.append(f"{unlisted} tensor(s) in the shards are not listed in the index")
        total = _total_size(index)
        logical = sum(s.logical_nbytes for part in parts for s in part.inventory.storages)
        if total is not None and total != logical:
            spec.notes.append(
                f"index metadata says total_size {total} bytes; the shards' storages hold "
                f"{logical} bytes"
            )
        spec.facts["shards"] = str(len(weights))

    if directory is not None:
        counted = {real_path(p) for p in [*weights, *extra_files]}
        if index is not None:
            counted.add(real_path(index))
        for name, cat in SIDE_FILES.items():
            if (directory / name).is_file():
                spec.side_files.append(SideFile(directory / name, cat, name))
                counted.add(real_path(directory / name))
        for side in trainer_side_files(directory, spec.facts):
            spec.side_files.append(side)
            counted.add(real_path(side.path))
        note = left_out_note(
            directory,
            (p for p in directory.iterdir() if p.is_file() and real_path(p) not in counted),
        )
        if note:
            spec.notes.append(note)
    parts += extra
    return merge(spec, parts)


# -- Hugging Face Trainer checkpoints (checkpoint-N/) ----------------------------------------

#: Files ``Trainer._save_checkpoint`` writes beside the weights, and what their tensors are.
TRAINER_FILES: dict[str, Category] = {
    "optimizer.pt": Category.OPTIMIZER_STATE,
    "optimizer.bin": Category.OPTIMIZER_STATE,
    "scheduler.pt": Category.OPTIMIZER_STATE,
    "scaler.pt": Category.OPTIMIZER_STATE,
    "training_args.bin": Category.OTHER,
}
TRAINER_STATE = "trainer_state.json"
_MAX_TRAINER_STATE = 1 << 26


def is_trainer_dir(directory: Path) -> bool:
    """A ``checkpoint-N`` directory written by transformers' Trainer."""
    return (directory / TRAINER_STATE).is_file() or any(
        (directory / n).is_file() for n in ("optimizer.pt", "optimizer.bin")
    )


def _trainer_files(directory: Path) -> list[tuple[Path, Category]]:
    found = [(directory / n, c) for n, c in TRAINER_FILES.items() if (directory / n).is_file()]
    found += [(p, Category.OTHER) for p in sorted(directory.glob("rng_state*.pth"))
              if p.is_file()]
    return found


def trainer_side_files(directory: Path, facts: dict[str, str]) -> list[SideFile]:
    """``trainer_state.json`` (metadata), with its global step as a fact."""
    path = directory / TRAINER_STATE
    if not path.is_file():
        return []
    if path.stat().st_size <= _MAX_TRAINER_STATE:
        try:
            step = json.loads(path.read_bytes().decode("utf-8")).get("global_step")
        except (ValueError, AttributeError, RecursionError):
            step = None
        if isinstance(step, int):
            facts["trainer_global_step"] = str(step)
    return [SideFile(path, Category.METADATA, TRAINER_STATE)]


def trainer_parts(directory: Path) -> tuple[list[Part], list[Path]]:
    """The Trainer's own files as parts: every tensor in them takes the file's category.

    ``optimizer.pt`` is the optimizer's state dict (torch's own classification would see plain
    float tensors), ``rng_state*.pth`` holds random generator states (other).
    """
    parts = []
    files = []
    for path, cat in _trainer_files(directory):

        def recategorize(t: TensorRecord, cat: Category = cat) -> Category:
            return cat

        parts.append(Part(read_torch_file(path), path.name, name_prefix=f"{path.name}:",
                          recategorize=recategorize))
        files.append(path)
    return parts, files


def safetensors_part(directory: Path) -> tuple[Part | None, list[Path]]:
    """The safetensors weights of a Trainer directory (index and shards), if any."""
    from modelsize.formats import safetensors

    index = directory / "model.safetensors.index.json"
    if not index.is_file():
        index = next(iter(sorted(directory.glob("*.safetensors.index.json"))), index)
    shards = [] if index.is_file() else sorted(directory.glob("*.safetensors"))
    if not index.is_file() and not shards:
        return None, []
    inv = safetensors.read_checkpoint(
        "safetensors", directory, index=index if index.is_file() else None, shards=shards,
        side_files=[], left_out=[],
    )
    return Part(inv, "safetensors"), [f.path for f in inv.files]


class TorchShardedReader:
    """``pytorch_model.bin.index.json`` + shards, or a model directory of torch weights."""

    name = FORMAT
    extensions = INDEX_SUFFIXES
    #: NumPy arrays pickled as latin-1 text (slim writes their bytes).
    storage_chunks = staticmethod(torch_storage_chunks)

    def sniff(self, source: Source) -> bool:
        """An index of torch shards, or a directory holding one (or one weights file)."""
        if source.kind == "dir":
            d = source.path
            if (d / ".metadata").is_file() or (d / "latest").is_file():
                return False
            if is_trainer_dir(d):
                return True
            if _has_safetensors(d):
                return False
            return find_index(d) is not None or find_weights(d) is not None
        if source.kind != "file" or source.head.lstrip()[:1] != b"{":
            return False
        return _is_index_name(source.path.name) or (
            source.suffix == ".json"
            and b'"weight_map"' in source.head
            and any(s in source.head for s in (b'.bin"', b'.pt"', b'.pth"'))
        )

    def read(self, source: Source) -> Inventory:
        """One inventory over every file of the checkpoint."""
        if source.kind == "dir":
            d = source.path
            index = find_index(d)
            found = find_weights(d) if index is None else None
            extra: list[Part] = []
            files: list[Path] = []
            if is_trainer_dir(d):
                extra, files = trainer_parts(d)
                if index is None and found is None:
                    part, covered = safetensors_part(d)
                    if part is not None:
                        extra.insert(0, part)
                        files += covered
            return read_model(d, index, [found] if found else [], d, extra, files)
        return read_model(source.path, source.path, [], None)
