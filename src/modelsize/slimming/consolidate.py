"""The model's full tensors, put back together from partitioned checkpoints.

slim's core asks :func:`logical_tensors` for the tensors a model loads when a checkpoint holds
them in pieces: one :class:`~modelsize.inventory.TensorRecord` per full tensor (named by its
state-dict key) and where its bytes are, in C order. Nothing is loaded: the pieces are byte
ranges of the rank files, read one after the other a chunk at a time.

DeepSpeed (the job of DeepSpeed's ``zero_to_fp32.py``, which writes the fp32 master weights):

* ZeRO 1/2 and the bf16 optimizer: each param group's fp32 master weights are flattened in
  ``param_shapes`` order (``param_alignment_paddings`` elements after each parameter, padding
  at the end to a multiple of 2 x world size) and cut into one contiguous partition per rank,
  ``single_partition_of_fp32_groups[g]`` of that rank's ``*_optim_states.pt``. A parameter is
  a run of the ranks' partitions laid end to end: a :class:`Concat` of ``FileRange`` s.
* ZeRO 3: each parameter is partitioned on its own: every rank holds ``ceil(numel / world)``
  of its elements (the last rank's padded) at the same offset of its ``fp32_flat_groups``
  (groups laid end to end). The parameter is the ranks' pieces in rank order, cut to numel.
* No optimizer partitions (no ZeRO, or a checkpoint saved without them): the module's weights
  as saved in ``mp_rank_00_model_states.pt`` (an fp32 copy kept by the optimizer is not named
  in the file, so it is not used).

Buffers come from the (rank 0) model file as saved, frozen parameters from
``frozen_param_fragments`` (ZeRO 3: partitioned like trainable ones), tied parameters
(``shared_params``) become duplicates of their original, which the default slim stores once.
The optimizer's other tensors (moments, step counters) are passed on as optimizer state, so
the default slim drops them. Tensor- or pipeline-parallel and expert-parallel checkpoints are
refused: their pieces are split along dimensions the files do not name.

``torch.distributed.checkpoint``: ``.metadata`` gives each tensor's size and the box
(offsets, sizes) of each of its chunks. Chunks that split only dimension 0 are laid end to
end (a :class:`Concat`); any other tiling is assembled in memory, bounded by the one tensor's
size. Non-tensor items are not tensors of the model and are left out.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from modelsize.categories import Category
from modelsize.dtypes import DTYPES
from modelsize.errors import CorruptFileError, UsageError
from modelsize.formats import deepspeed, torch_dcp
from modelsize.formats._pickle import Call
from modelsize.formats._torch_tree import global_name, mapping_items
from modelsize.inventory import Inventory, StorageRecord, TensorRecord
from modelsize.slimming.source import (
    CHUNK,
    Concat,
    Constant,
    FileRange,
    StorageDecoder,
    TensorSource,
    itemsize_of,
    tensor_source,
)

SourceOf = Callable[[TensorRecord], TensorSource]


class Consolidated(tuple):  # type: ignore[type-arg]  # core unpacks (records, source_of)
    """``(records, source_of)`` as slim's core unpacks it, with ``notes`` for the plan."""

    notes: list[str]

    def __new__(cls, records: Sequence[TensorRecord], source_of: SourceOf,
                notes: Sequence[str] = ()) -> Consolidated:
        obj = super().__new__(cls, (list(records), source_of))
        obj.notes = list(notes)
        return obj


def logical_tensors(inv: Inventory, decoder: StorageDecoder | None) -> Consolidated | None:
    """The full tensors of a partitioned checkpoint and their sources; ``None`` when the
    inventory's own tensors are already whole."""
    if inv.format == deepspeed.FORMAT:
        return _DeepSpeed(inv, decoder).run()
    if inv.format == torch_dcp.FORMAT:
        return _dcp(inv, decoder)
    return None


# -- reading byte ranges of the input -------------------------------------------------------


class _Slice:
    """Elements ``start .. start + count`` of a source that cannot be cut in place (an encoded
    or strided partition): the source is streamed and the rest skipped."""

    def __init__(self, source: TensorSource, start: int, count: int, itemsize: int) -> None:
        self.source = source
        self.skip = start * itemsize
        self.nbytes = count * itemsize

    def chunks(self) -> Iterator[bytes | memoryview]:
        """The wanted bytes, a chunk at a time (whole elements: offsets are in elements)."""
        skip, left = self.skip, self.nbytes
        for piece in self.source.chunks():
            if left <= 0:
                break
            if skip >= len(piece):
                skip -= len(piece)
                continue
            out = piece[skip : skip + left]
            skip = 0
            left -= len(out)
            yield out
        if left > 0:
            raise ValueError(f"partition ended {left} bytes early")


class _Ranges:
    """Where each input tensor's bytes are, for cutting element ranges out of it."""

    def __init__(self, inv: Inventory, decoder: StorageDecoder | None) -> None:
        self.inv = inv
        self.decoder = decoder
        self.storages: dict[str, StorageRecord] = {s.key: s for s in inv.storages}

    def whole(self, t: TensorRecord) -> TensorSource:
        """All of a tensor's bytes."""
        return tensor_source(self.inv, t, self.decoder)

    def part(self, t: TensorRecord, start: int, count: int) -> TensorSource:
        """Elements ``start .. start + count`` of tensor ``t`` in C order."""
        itemsize = itemsize_of(t.dtype)
        st = self.storages.get(t.storage or "")
        if st is not None and not st.compressed and t.strides is None:
            return FileRange(self.inv.files[st.file].path,
                             st.offset + t.storage_offset + start * itemsize, count * itemsize,
                             itemsize)
        return _Slice(self.whole(t), start, count, itemsize)


def _record(name: str, dtype: str, shape: tuple[int, ...], category: Category,
            stored: int | None = None, tags: tuple[str, ...] = (), container: str = "",
            duplicate_of: str | None = None) -> TensorRecord:
    nbytes = DTYPES[dtype].nbytes(math.prod(shape)) if dtype in DTYPES else 0
    return TensorRecord(name, dtype, shape, category, nbytes,
                        nbytes if stored is None else stored, None, 0, tags, duplicate_of,
                        None, container)


# -- DeepSpeed ------------------------------------------------------------------------------


def _get(obj: object, key: str) -> Any:
    """``obj[key]`` of a parsed dict (or OrderedDict being rebuilt), else ``None``."""
    for k, v in mapping_items(obj) or ():
        if k == key:
            return v
    return None


def _shape(obj: object) -> tuple[int, ...] | None:
    if isinstance(obj, Call) and global_name(obj.func) == "torch.Size" and obj.args:
        obj = obj.args[0]
    if isinstance(obj, (tuple, list)) and all(type(d) is int and d >= 0 for d in obj):
        return tuple(obj)
    return None


def _ints(obj: object) -> list[int] | None:
    if isinstance(obj, (tuple, list)) and all(type(d) is int and d >= 0 for d in obj):
        return list(obj)
    return None


@dataclass(frozen=True)
class _Run:
    """``count`` elements from element ``start`` of one rank's partition tensor."""

    tensor: TensorRecord
    start: int
    count: int


class _DeepSpeed:
    def __init__(self, inv: Inventory, decoder: StorageDecoder | None) -> None:
        self.inv = inv
        self.ranges = _Ranges(inv, decoder)
        self.by_name = {t.name: t for t in inv.tensors}
        self.records: list[TensorRecord] = []
        self.sources: dict[str, Callable[[], TensorSource]] = {}
        self.used: set[str] = set()
        self.notes: list[str] = []

    def bad(self, path: Path, reason: str) -> CorruptFileError:
        return CorruptFileError(path, deepspeed.FORMAT, reason)

    def run(self) -> Consolidated:
        files = deepspeed.states_files(self.inv)
        odd = [f for f in files if f.other or f.mp_rank]
        if odd:
            raise UsageError(
                f"{self.inv.path}: {odd[0].path.name} is a tensor/pipeline-parallel or expert "
                "part of the model; modelsize consolidates data-parallel (ZeRO) checkpoints "
                "only (convert it with DeepSpeed's ds_to_universal.py)")
        models = sorted((f for f in files if f.role == "model"),
                        key=lambda f: -1 if f.dp_rank is None else f.dp_rank)
        optims = sorted((f for f in files if f.role == "optim" and f.dp_rank is not None),
                        key=lambda f: f.dp_rank or 0)
        if not models:
            raise self.bad(self.inv.path, "no model states file")
        ranks = [f.dp_rank for f in optims]
        if len(set(ranks)) != len(ranks):
            raise UsageError(f"{self.inv.path}: two optimizer files for one rank (a bf16 and "
                             "a ZeRO one?): remove the stale ones")
        if ranks != list(range(len(ranks))):
            missing = next(i for i, r in enumerate(ranks) if r != i)
            raise self.bad(optims[0].path.parent, f"the optimizer file of rank {missing} is "
                                                  "missing")
        model = models[0]
        tree = deepspeed.states_tree(model.path)
        module = f"{model.label}:module."
        buffer_names = set(_get(tree, "buffer_names") or ())
        stage3 = any(f.dp_rank is not None for f in models)

        # Buffers first, as zero_to_fp32 orders them; then the parameters.
        for t in self.inv.tensors:
            if t.name.startswith(module) and t.name[len(module):] in buffer_names:
                self.take(t, t.name[len(module):], t.category)
        if optims:
            self.partitioned(tree, model, models, optims, stage3)
        elif stage3:
            raise UsageError(f"{self.inv.path}: a ZeRO-3 checkpoint without its "
                             "*_optim_states.pt files: its weights are in no file")
        else:
            self.notes.append(f"{model.path.name} holds no ZeRO partitions: the module's "
                              "weights as saved")
        self.shared(tree)
        # Module entries neither gathered, tied nor buffers (parameters the optimizer did not
        # hold): whole in a ZeRO 1/2 model file, so kept as saved; ZeRO-3 placeholders are not.
        for t in self.inv.tensors:
            if t.name.startswith(module) and t.name not in self.used:
                key = t.name[len(module):]
                if key not in self.sources and t.nbytes:
                    self.take(t, key, t.category)
        # What remains of the model files (other ranks' placeholders and copies) is not the
        # model's; what remains of the optimizer files is passed on as optimizer state.
        model_labels = tuple(f"{f.label}:" for f in models)
        for t in self.inv.tensors:
            mine = t.category in (Category.WEIGHTS, Category.BUFFERS) or (
                ":frozen_param_fragments." in t.name)
            if t.name in self.used or (t.name.startswith(model_labels) and mine):
                continue
            self.records.append(t)
        return Consolidated(self.records, self.source_of, self.notes)

    def source_of(self, t: TensorRecord) -> TensorSource:
        make = self.sources.get(t.name)
        if make is None:
            return self.ranges.whole(t)
        return make()

    def take(self, t: TensorRecord, key: str, category: Category) -> None:
        """A tensor of the model file kept whole under its state-dict key."""
        self.used.add(t.name)
        self.records.append(_record(key, t.dtype, t.shape, category, t.stored_nbytes, t.tags))
        self.sources[key] = lambda: self.ranges.whole(t)

    def gathered(self, name: str, dtype: str, shape: tuple[int, ...], runs: list[_Run],
                 category: Category = Category.WEIGHTS) -> None:
        numel = math.prod(shape)
        if sum(r.count for r in runs) != numel:
            raise AssertionError(f"{name}: {sum(r.count for r in runs)} elements gathered, "
                                 f"{numel} wanted")
        self.records.append(_record(name, dtype, shape, category))
        ranges = self.ranges

        def source() -> TensorSource:
            if not runs:
                return Constant(b"")
            return Concat([ranges.part(r.tensor, r.start, r.count) for r in runs])

        self.sources[name] = source

    def flat(self, label: str, key: str, path: Path) -> list[TensorRecord]:
        """``optimizer_state_dict.KEY.0``, ``.1``... of one optimizer file, in group order."""
        prefix = f"{label}:optimizer_state_dict.{key}."
        groups: dict[int, TensorRecord] = {}
        for t in self.inv.tensors:
            if t.name.startswith(prefix) and t.name[len(prefix):].isdigit():
                groups[int(t.name[len(prefix):])] = t
        if sorted(groups) != list(range(len(groups))):
            raise self.bad(path, f"{key} groups are {sorted(groups)}, expected 0..n-1")
        out = [groups[i] for i in range(len(groups))]
        for t in out:
            if len(t.shape) != 1:
                raise self.bad(path, f"{t.name} has shape {list(t.shape)}, expected a flat "
                                     "partition")
        return out

    def partitioned(self, tree: object, model: deepspeed.StatesFile,
                    models: list[deepspeed.StatesFile], optims: list[deepspeed.StatesFile],
                    stage3: bool) -> None:
        key = "fp32_flat_groups" if stage3 else "single_partition_of_fp32_groups"
        parts = [self.flat(f.label, key, f.path) for f in optims]
        if not parts[0]:
            raise UsageError(f"{self.inv.path}: the optimizer files hold no {key}: modelsize "
                             "cannot tell where the weights are")
        for f, p in zip(optims, parts, strict=True):
            if len(p) != len(parts[0]):
                raise self.bad(f.path, f"{len(p)} param groups, rank 0 has {len(parts[0])}")
            self.used.update(t.name for t in p)
        world = len(optims)
        optim0 = deepspeed.states_tree(optims[0].path)
        state = _get(optim0, "optimizer_state_dict")
        count = _get(state, "partition_count")
        counts = [count] if type(count) is int else _ints(count) or []
        if counts and max(counts) != world:
            raise self.bad(optims[0].path.parent,
                           f"the optimizer was partitioned over {max(counts)} ranks but "
                           f"{world} optimizer file(s) are here (one missing, or left over "
                           "from another save?)")
        shapes_by_group = []
        for g, group in enumerate(_get(tree, "param_shapes") or ()):
            shapes = {}
            for name, shape in mapping_items(group) or ():
                s = _shape(shape)
                if not isinstance(name, str) or s is None:
                    raise self.bad(model.path, f"param_shapes[{g}] has {name!r}: {shape!r}")
                shapes[name] = s
            shapes_by_group.append(shapes)
        if not shapes_by_group:
            raise self.bad(model.path, "no param_shapes: cannot tell which weights the "
                                       "optimizer partitions hold")
        dtype = parts[0][0].dtype
        self.frozen(tree, model, models, world, stage3)
        if stage3:
            self.stage3(shapes_by_group, parts, dtype, model.path)
        else:
            paddings = _get(state, "param_alignment_paddings")
            self.stage12(shapes_by_group, parts, dtype, model.path, paddings)
        self.notes.append(
            f"weights: the fp32 master weights of the ZeRO{'-3' if stage3 else ''} optimizer "
            f"partitions of {world} rank(s), gathered as DeepSpeed's zero_to_fp32.py does")

    def stage12(self, shapes_by_group: list[dict[str, tuple[int, ...]]],
                parts: list[list[TensorRecord]], dtype: str, path: Path,
                paddings: object) -> None:
        if len(shapes_by_group) != len(parts[0]):
            raise self.bad(path, f"param_shapes has {len(shapes_by_group)} groups, the "
                                 f"partitions {len(parts[0])}")
        world = len(parts)
        for g, shapes in enumerate(shapes_by_group):
            ranks = [p[g] for p in parts]
            starts = [0]
            for t in ranks:
                starts.append(starts[-1] + t.numel)
            pads = _ints(paddings[g]) if isinstance(paddings, list) and g < len(paddings) else None
            if pads is not None and len(pads) != len(shapes):
                raise self.bad(path, f"group {g}: {len(pads)} alignment paddings for "
                                     f"{len(shapes)} parameters")
            offset = 0
            for i, (name, shape) in enumerate(shapes.items()):
                n = math.prod(shape)
                if offset + n > starts[-1]:
                    raise self.bad(path, f"{name} ends at element {offset + n} of group {g}, "
                                         f"whose partitions hold {starts[-1]}")
                self.gathered(name, dtype, shape, _runs(ranks, starts, offset, n))
                offset += n + (pads[i] if pads else 0)
            align = 2 * world
            if -(-offset // align) != -(-starts[-1] // align):
                raise self.bad(path, f"group {g}: the parameters take {offset} elements of "
                                     f"the {starts[-1]} in its partitions")

    def stage3(self, shapes_by_group: list[dict[str, tuple[int, ...]]],
               parts: list[list[TensorRecord]], dtype: str, path: Path) -> None:
        world = len(parts)
        sizes = [t.numel for t in parts[0]]
        for p in parts[1:]:
            if [t.numel for t in p] != sizes:
                raise self.bad(path, "the ranks' fp32_flat_groups differ in size")
        starts = [0]
        for n in sizes:
            starts.append(starts[-1] + n)
        offset = 0
        for shapes in shapes_by_group:
            for name, shape in shapes.items():
                n = math.prod(shape)
                per = -(-n // world)
                if offset + per > starts[-1]:
                    raise self.bad(path, f"{name} needs elements {offset}..{offset + per} of "
                                         f"each rank's {starts[-1]}")
                runs: list[_Run] = []
                left = n
                for ranks in parts:
                    take = min(per, left)
                    runs += _runs(ranks, starts, offset, take)
                    left -= take
                self.gathered(name, dtype, shape, runs)
                offset += per
        if offset != starts[-1]:
            raise self.bad(path, f"the parameters take {offset} elements of each rank's "
                                 f"{starts[-1]}")

    def frozen(self, tree: object, model: deepspeed.StatesFile,
               models: list[deepspeed.StatesFile], world: int, stage3: bool) -> None:
        """Parameters without optimizer state: whole (ZeRO 1/2) or partitioned (ZeRO 3) in
        the model files' ``frozen_param_fragments``."""
        for name, shape in mapping_items(_get(tree, "frozen_param_shapes")) or ():
            s = _shape(shape)
            if not isinstance(name, str) or s is None:
                raise self.bad(model.path, f"frozen_param_shapes has {name!r}: {shape!r}")
            frags = [self.by_name.get(f"{m.label}:frozen_param_fragments.{name}")
                     for m in (models if stage3 else [model])]
            if any(f is None for f in frags):
                raise self.bad(model.path, f"frozen parameter {name} has no fragment")
            pieces = [f for f in frags if f is not None]
            self.used.update(f.name for f in pieces)
            n, left = math.prod(s), math.prod(s)
            runs = []
            for f in pieces:
                take = min(f.numel, left)
                if take:
                    runs.append(_Run(f, 0, take))
                left -= take
            if left:
                raise self.bad(model.path, f"frozen parameter {name}: {n - left} of {n} "
                                           "elements in its fragments")
            self.gathered(name, pieces[0].dtype, s, runs)

    def shared(self, tree: object) -> None:
        """Tied parameters: a second name for an original's bytes."""
        known = {r.name: r for r in self.records}
        for alias, original in mapping_items(_get(tree, "shared_params")) or ():
            src = known.get(original) if isinstance(original, str) else None
            if not isinstance(alias, str) or src is None or alias in known:
                continue
            self.records.append(replace(src, name=alias, category=Category.DUPLICATES,
                                        duplicate_of=src.name, stored_nbytes=0))
            self.sources[alias] = self.sources[src.name]
            known[alias] = self.records[-1]


def _runs(ranks: Sequence[TensorRecord], starts: Sequence[int], offset: int,
          count: int) -> list[_Run]:
    """Elements ``offset .. offset + count`` of partitions laid end to end (``starts[i]`` is
    where partition ``i`` begins), as runs of the partitions they lie in."""
    runs = []
    for t, begin, end in zip(ranks, starts, starts[1:], strict=False):
        a, b = max(offset, begin), min(offset + count, end)
        if a < b:
            runs.append(_Run(t, a - begin, b - a))
    return runs


# -- torch.distributed.checkpoint -----------------------------------------------------------

Box = tuple[tuple[int, ...], tuple[int, ...]]


def _dcp(inv: Inventory, decoder: StorageDecoder | None) -> Consolidated:
    ranges = _Ranges(inv, decoder)
    by_name = {t.name: t for t in inv.tensors}
    records: list[TensorRecord] = []
    sources: dict[str, Callable[[], TensorSource]] = {}
    used: set[str] = set()
    tensors = torch_dcp.chunked_tensors(inv)
    for full in tensors:
        chunks = [by_name.get(n) for n in full.names]
        if any(c is None for c in chunks):
            continue  # the reader refuses a chunk without data: not reached
        parts = [c for c in chunks if c is not None]
        used.update(c.name for c in parts)
        _check_tiling(inv, full)
        first = parts[0] if parts else None
        container = ".".join(full.path[:-1]) + "." if (
            len(full.path) > 1 and ".".join(full.path) == full.fqn) else ""
        records.append(_record(
            full.fqn, full.dtype, full.size,
            first.category if first else Category.WEIGHTS,
            sum(c.stored_nbytes for c in parts), first.tags if first else (), container,
        ))
        sources[full.fqn] = _chunks_source(ranges, full, parts)
    for t in inv.tensors:
        if t.name not in used:
            records.append(t)
    notes = []
    split = sum(1 for full in tensors if len(full.chunks) > 1 and full.fqn in sources)
    if split:
        notes.append(f"{split} tensor(s) saved in chunks across ranks were put back together")

    def source_of(t: TensorRecord) -> TensorSource:
        make = sources.get(t.name)
        return make() if make is not None else ranges.whole(t)

    return Consolidated(records, source_of, notes)


def _check_tiling(inv: Inventory, full: torch_dcp.ChunkedTensor) -> None:
    """Chunks must cover the tensor exactly once: no gap (read as zeros) and no overlap."""
    numel = math.prod(full.size)
    volume = sum(math.prod(s) for _, s in full.chunks)
    bad = None
    if volume != numel:
        bad = f"its chunks hold {volume} elements, the tensor {numel}"
    else:
        # Sweep along dimension 0: only chunks whose rows overlap can overlap.
        boxes = sorted(full.chunks, key=lambda b: b[0][:1])
        active: list[Box] = []
        for box in boxes:
            lo = box[0][0] if box[0] else 0
            active = [a for a in active if (a[0][0] + a[1][0] if a[0] else 1) > lo]
            hit = next((a for a in active if _overlap(a, box)), None)
            if hit is not None:
                bad = f"chunks at {list(hit[0])} and {list(box[0])} overlap"
                break
            active.append(box)
    if bad is not None:
        raise CorruptFileError(inv.files[0].path, torch_dcp.FORMAT,
                               f"tensor {full.fqn!r} cannot be put back together: {bad}")


def _overlap(a: Box, b: Box) -> bool:
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in
               zip(a[0], a[1], b[0], b[1], strict=True))


def _chunks_source(ranges: _Ranges, full: torch_dcp.ChunkedTensor,
                   parts: list[TensorRecord]) -> Callable[[], TensorSource]:
    itemsize = itemsize_of(full.dtype)
    boxes = list(zip(full.chunks, parts, strict=True))
    if not math.prod(full.size):
        return lambda: Constant(b"")
    rows_only = all(tuple(o[1:]) == (0,) * (len(full.size) - 1) and
                    tuple(s[1:]) == full.size[1:] for (o, s), _ in boxes)
    if rows_only or len(boxes) == 1:
        ordered = [t for _, t in sorted(boxes, key=lambda b: b[0][0][:1])]
        if len(ordered) == 1:
            return lambda: ranges.whole(ordered[0])
        return lambda: Concat([ranges.whole(t) for t in ordered])
    return lambda: _Assembled([(box, ranges.whole(t)) for box, t in boxes], full.size,
                              itemsize)


class _Assembled:
    """A tensor assembled in memory from chunks that are not whole rows (a split along a later
    dimension, a grid): at most the one tensor's bytes held, each chunk streamed into place."""

    def __init__(self, chunks: list[tuple[Box, TensorSource]], size: tuple[int, ...],
                 itemsize: int) -> None:
        self.parts = chunks
        self.size = size
        self.itemsize = itemsize
        self.nbytes = math.prod(size) * itemsize

    def chunks(self) -> Iterator[bytes | memoryview]:
        """The assembled tensor, in :data:`CHUNK` pieces."""
        buf = bytearray(self.nbytes)
        for box, source in self.parts:
            self._place(buf, box, source)
        view = memoryview(buf)
        for pos in range(0, self.nbytes, CHUNK):
            yield view[pos : pos + CHUNK]

    def _place(self, buf: bytearray, box: Box, source: TensorSource) -> None:
        offsets, sizes = box
        full = self.size
        ndim = len(full)
        strides = [math.prod(full[d + 1:]) for d in range(ndim)]
        # Dimensions after ``j`` are whole in the chunk: its runs are contiguous in the tensor.
        j = ndim - 1
        while j > 0 and offsets[j] == 0 and sizes[j] == full[j]:
            j -= 1
        run = math.prod(sizes[j:]) if ndim else 1
        outer = sizes[:j] if ndim else ()
        tail = offsets[j] * strides[j] if ndim else 0
        k, isz = 0, self.itemsize
        total = math.prod(sizes) if ndim else 1
        for piece in source.chunks():
            mv = memoryview(piece)
            pos, n = 0, len(mv) // isz
            while n:
                q, w = divmod(k, run)
                take = min(run - w, n)
                base = tail
                for d in range(len(outer) - 1, -1, -1):
                    q, i = divmod(q, outer[d])
                    base += (offsets[d] + i) * strides[d]
                at = (base + w) * isz
                buf[at : at + take * isz] = mv[pos * isz : (pos + take) * isz]
                k += take
                pos += take
                n -= take
        if k != total:
            raise ValueError(f"a chunk gave {k} elements, expected {total}")
