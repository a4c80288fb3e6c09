"""One rank of a data-parallel program, traced with the real engine on a fake process group.

``torch.distributed``'s ``fake`` backend (with a ``FakeStore``) makes a process group of any
size in this one process: collectives return at once and write nothing, which is all a trace
of fake tensors needs. On it, a CPU ``DeviceMesh`` and FSDP2's ``fully_shard`` (or
``parallelize_module`` with the model's tensor-parallel plan) shard a fake copy of the model
exactly as they would on ``world`` GPUs, and the program of
:mod:`modelsize.estimation.trace` (forward, loss, backward, optimizer step, zero_grad) runs
under the counting mode.

FSDP2 allocates and frees each gathered parameter by resizing its storage
(``UntypedStorage.resize_``), which no tensor op reports: the trace wraps FSDP2's
``alloc_storage`` / ``free_storage`` to count them, and its all-gather, copy-out and
reduce-scatter functions, and DTensor's redistribution (tensor parallelism's all-reduces),
to name what they allocate ``communication``. DTensor computes each op's output shape by
running it on fake tensors of the global shape in the current fake mode: that is left
uncounted. The wrappers are put back when the trace ends.

Known limitations: the program runs FSDP2's CPU path. With CPU offload that path makes
no host-device copies, so what the GPU holds is accounted from the trace
(:func:`offload_split`), not traced. On CUDA, FSDP2 gathers on a separate
stream and frees a buffer only once the compute stream has used it, which can keep one more
block's gathered parameters alive than a CPU run does; the CUDA caching allocator's rounding
is not modelled per rank.
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import math
import re
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any, overload

import torch
from torch import nn

from modelsize.errors import EstimateError, UsageError
from modelsize.estimation.optimizers import OptimizerName, make_factory, parse_name
from modelsize.estimation.parallel import (
    FsdpPrecision,
    Parallel,
    Strategy,
    comparisons,
    unsplit_heads,
)
from modelsize.estimation.result import (
    Comparison,
    DeviceEstimate,
    Estimate,
    MemoryCategory,
    ParallelInfo,
    RankPeak,
    Source,
    Verification,
)
from modelsize.estimation.trace import (
    Program,
    ProgressFn,
    RealValues,
    Trace,
    _fake_inputs,
    _FakeCopier,
    _module_names,
    _SavedScalars,
    caller,
    checkpointed,
    default_loss,
    heap_out_of_sight,
    hf_checkpointing,
    trace_program,
    training_flags,
)
from modelsize.estimation.tracker import Allocation, CountingFakeMode, Origin


@dataclass
class RankTrace:
    """A traced rank: the trace, and the allocations that are communication buffers."""

    trace: Trace
    rank: int
    units: tuple[str, ...]
    communication: set[int] = field(default_factory=set)
    """``id()`` of the :class:`Allocation` records made by FSDP2's collectives."""
    offload: _OffloadTicks | None = None
    """With CPU offload: where FSDP2 copies between host and GPU, in ticks."""


@contextlib.contextmanager
def fake_process_group(world: int, rank: int, tp: int = 1) -> Iterator[Any]:
    """A fake process group of ``world`` ranks, this process being ``rank``; yields a CPU mesh:
    one dimension, or ``(world // tp, tp)`` named ``("dp", "tp")`` when ``tp > 1``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_available():
        raise EstimateError("this PyTorch build has no torch.distributed")
    if dist.is_initialized():
        raise UsageError("a process group is already initialized in this process; an estimate "
                         "across GPUs makes its own (fake) one: call it outside distributed code")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        if tp > 1:
            yield init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
        else:
            yield init_device_mesh("cpu", (world,))
    finally:
        dist.destroy_process_group()


def shard_units(model: nn.Module, patterns: Sequence[str] = ()) -> list[str]:
    """The names of the modules to ``fully_shard`` before the root.

    ``patterns`` (globs over module names, or class names) when given; else the classes a
    transformers model declares as blocks (``_no_split_modules``); else each element of the
    largest ``nn.ModuleList`` whose elements are all one class (the repeated blocks).
    """
    named = [(n, m) for n, m in model.named_modules() if n]
    if patterns:
        chosen = [n for n, m in named
                  if any(fnmatch.fnmatchcase(n, p) or type(m).__name__ == p for p in patterns)]
        if not chosen:
            raise UsageError(f"shard units {', '.join(patterns)}: no module matches")
        return _outermost(chosen)
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    chosen = [n for n, m in named if type(m).__name__ in blocks]
    if chosen:
        return _outermost(chosen)
    best: tuple[int, str, int] | None = None
    for n, m in named:
        if isinstance(m, nn.ModuleList) and len(m) > 1 and len({type(c) for c in m}) == 1:
            size = sum(p.numel() for p in m.parameters())
            if size and (best is None or size > best[0]):
                best = (size, n, len(m))
    if best is None:
        return []
    return [f"{best[1]}.{i}" for i in range(best[2])]


def _outermost(names: list[str]) -> list[str]:
    out: list[str] = []
    for n in names:
        if not any(n.startswith(o + ".") for o in out):
            out.append(n)
    return out


class _Collectives:
    """Wrap FSDP2's collectives and storage resizes to count them, and DTensor's shape
    propagation to leave it uncounted (all put back on exit)."""

    def __init__(self, mode: CountingFakeMode, comm: set[int]) -> None:
        self.mode = mode
        self.comm = comm
        self._saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> _Collectives:
        from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group
        from torch.distributed.tensor import _sharding_prop

        # DTensor works out each op's output shape by running it on fake tensors of the
        # *global* shape, in the fake mode it finds (ours): not memory a rank allocates. Under
        # a fake mode it also skips its cache, thinking it is being compiled.
        prop = _sharding_prop.ShardingPropagator
        self._patch(prop, "_propagate_tensor_meta_non_cached",
                    self._uncounted(prop._propagate_tensor_meta_non_cached))
        self._patch(_sharding_prop, "_are_we_tracing", lambda: False)
        # A foreach op's strategy has one child per tensor, and DTensor checks every child
        # against all the op's arguments (quadratic: 8.6 of 18 s of sharding propagation on
        # Llama-3-8B): the check is done once per op
        self._patch(_sharding_prop, "_propagate_use_strided_shard_flag",
                    _OncePerSchema(_sharding_prop._propagate_use_strided_shard_flag))
        # and expands each child's strategy to the whole mesh, though the children of equal
        # inputs share one strategy function: it is expanded once per function (on
        # Llama-3-70B FSDP2 x tensor parallelism, 5,076 expansions for 723 parameters)
        if hasattr(_sharding_prop, "_expand_single_dim_strategy_to_mesh"):
            from torch.distributed.tensor._ops import single_dim_strategy as _single_dim
            from torch.distributed.tensor._ops import utils as _op_utils

            children = _SameChildren(_sharding_prop._expand_single_dim_strategy_to_mesh,
                                     _op_utils.expand_to_full_mesh_op_strategy,
                                     _single_dim._PreparedSingleDimStrategy)
            self._patch(_sharding_prop, "_expand_single_dim_strategy_to_mesh",
                        children.expand_to_mesh)
            self._patch(_op_utils, "expand_to_full_mesh_op_strategy", children.expand_full)
            self._patch(_single_dim, "_PreparedSingleDimStrategy", children.prepare)

        # FSDP2 chunks every parameter into ``world`` views to pick this rank's: only the
        # chunks read are made (at world 1024, making the rest was most of the trace's time)
        self._patch(_fsdp_param, "_chunk_with_empty", _LazyChunks)
        for mod in (_fsdp_param, _fsdp_param_group):
            self._patch(mod, "alloc_storage", self._alloc)
        self._patch(_fsdp_param, "free_storage", self._free)
        for name in ("foreach_all_gather", "foreach_all_gather_copy_out", "foreach_reduce"):
            self._patch(_fsdp_param_group, name, self._collective(getattr(_fsdp_param_group,
                                                                          name)))
        from torch.distributed.tensor import _api, _dispatch, _redistribute

        for mod in (_api, _dispatch, _redistribute):  # tensor parallelism's collectives
            self._patch(mod, "redistribute_local_tensor",
                        self._collective(_redistribute.redistribute_local_tensor))
        return self

    def __exit__(self, *exc: object) -> None:
        for mod, name, orig in reversed(self._saved):
            setattr(mod, name, orig)
        self._saved.clear()

    def _patch(self, mod: Any, name: str, new: Any) -> None:
        self._saved.append((mod, name, getattr(mod, name)))
        setattr(mod, name, new)

    def _collective(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            first = len(self.mode.allocations)
            try:
                return orig(*args, **kwargs)
            finally:
                for rec in self.mode.allocations[first:]:
                    if rec.origin not in _STATE_ORIGINS:
                        self.comm.add(id(rec))

        return run

    def _uncounted(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            counting, self.mode.counting = self.mode.counting, False
            try:
                return orig(*args, **kwargs)
            finally:
                self.mode.counting = counting

        return run

    def _alloc(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        size = tensor.numel() * tensor.itemsize
        if storage.size() == size:
            return
        storage.resize_(size)
        mode = self.mode
        old = mode.live.pop(storage._cdata, None)
        if old is not None:  # counted at its former size: that stretch ends here
            old.freed = mode.tick
            mode.live_bytes -= old.nbytes
        rec = mode.track(tensor, mode.origin)
        rec.created = mode.tick + 1  # live from the next op, as a resize is no op
        self.comm.add(id(rec))

    def _free(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        if storage.size() == 0:
            return
        storage.resize_(0)
        mode = self.mode
        rec = mode.live.pop(storage._cdata, None)
        if rec is not None:
            rec.freed = mode.tick
            mode.live_bytes -= rec.nbytes


@contextlib.contextmanager
def _real_meshes() -> Iterator[None]:
    """Build device meshes outside the fake mode: FSDP2 joins a 2D mesh's dp and tp meshes
    (``DeviceMesh._concatenate``) inside ``fully_shard``, and a mesh finds its rank's
    coordinates from the values of its rank tensor, which a fake tensor does not have."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    init = DeviceMesh.__init__

    def real_init(self: Any, *args: Any, **kwargs: Any) -> None:
        with unset_fake_temporarily():
            init(self, *args, **kwargs)

    DeviceMesh.__init__ = real_init  # type: ignore[method-assign]
    try:
        yield
    finally:
        DeviceMesh.__init__ = init  # type: ignore[method-assign]


class _OffloadTicks:
    """Record FSDP2's all-gathers and reduce-scatters (ticks, bytes) for the CPU-offload
    accounting: on a CPU mesh ``CPUOffloadPolicy``'s host-device copies are no-ops, so the
    trace has one memory; :func:`offload_split` divides it into the GPU's and the host's."""

    def __init__(self, mode: CountingFakeMode) -> None:
        self.mode = mode
        self.gathers: list[tuple[int, int, int, int]] = []
        """(first tick, last tick, bytes of the sharded parameters copied to the GPU, bytes of
        the largest one when they are cast on the GPU, else 0)."""
        self.reduces: list[tuple[int, int, int, int]] = []
        """(first allocation index, end allocation index, last tick, bytes of the sharded
        gradients copied to the host)."""
        self._saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> _OffloadTicks:
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group

        for name, wrap in (("foreach_all_gather", self._gather),
                           ("foreach_reduce", self._reduce)):
            orig = getattr(group, name)
            self._saved.append((group, name, orig))
            setattr(group, name, wrap(orig))
        return self

    def __exit__(self, *exc: object) -> None:
        for mod, name, orig in reversed(self._saved):
            setattr(mod, name, orig)
        self._saved.clear()

    def _gather(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

        def run(fsdp_params: list[Any], *args: Any, **kwargs: Any) -> Any:
            start = self.mode.tick + 1
            shards = [p._sharded_param_data for p in fsdp_params
                      if p.sharded_state is ShardedState.SHARDED]
            sizes = [t.numel() * t.element_size() for t in shards]
            cast = any(p.param_dtype not in (None, p.orig_dtype) for p in fsdp_params)
            try:
                return orig(fsdp_params, *args, **kwargs)
            finally:
                if sizes:
                    self.gathers.append((start, self.mode.tick,
                                         0 if cast else sum(sizes), max(sizes) if cast else 0))

        return run

    def _reduce(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def run(fsdp_params: list[Any], *args: Any, **kwargs: Any) -> Any:
            first = len(self.mode.allocations)
            grads = sum(math.prod(p.sharded_size) * p.orig_dtype.itemsize for p in fsdp_params)
            try:
                return orig(fsdp_params, *args, **kwargs)
            finally:
                self.reduces.append((first, len(self.mode.allocations), self.mode.tick, grads))

        return run


@dataclass
class OffloadSplit:
    """A traced rank's allocations divided between its GPU and the host (CPU offload)."""

    gpu: list[Allocation]
    gpu_scratch: dict[int, int]
    host: list[Allocation]
    host_scratch: dict[int, int]
    communication: set[int]
    """``id()`` of the GPU records that are communication buffers."""


def offload_split(rank: RankTrace) -> OffloadSplit:
    """What FSDP2's ``CPUOffloadPolicy`` keeps on the host and what the GPU holds (accounted).

    The host: the sharded parameters, the sharded gradients (FSDP2 copies each parameter's
    unpadded shard out of the reduce-scatter output), the optimizer state and the whole
    optimizer step. The GPU: everything else in the trace, plus FSDP2's GPU copies of the
    sharded parameters for each all-gather (alive through the all-gather: FSDP2 copies them
    in together; cast one by one when a mixed-precision policy casts them, which the trace
    has, and then the largest float32 copy is counted through the all-gather, a bound) and
    each reduce-scatter output until its gradients are copied out.
    """
    mode = rank.trace.mode
    ticks = rank.offload
    assert ticks is not None
    optimizer = [(p.start, p.end if p.end >= 0 else mode.tick)
                 for p in mode.phases if p.name == "optimizer"]

    def on_host(rec: Allocation) -> bool:
        return (rec.origin in (Origin.PARAMETER, Origin.OPTIMIZER) or rec.is_state
                or rec.is_grad)

    gpu = [r for r in mode.allocations if not on_host(r)]
    host = [r for r in mode.allocations if on_host(r) and not r.is_grad]
    comm = {id(r) for r in gpu if id(r) in rank.communication}
    for first, last, end, grads in ticks.reduces:
        made = [r for r in mode.allocations[first:last] if r.is_grad]
        for r in made:
            out = Allocation(r.nbytes, Origin.BACKWARD, r.created, r.phase, r.module, end)
            gpu.append(out)
            comm.add(id(out))
        if made:
            host.append(Allocation(grads, Origin.BACKWARD, end + 1, made[0].phase,
                                   made[0].module,
                                   -1 if any(r.freed < 0 for r in made)
                                   else max(r.freed for r in made),
                                   is_grad=True))
    for start, end, nbytes, largest in ticks.gathers:
        copy_in = Allocation(nbytes or largest, Origin.FORWARD, start, 0, "", end)
        gpu.append(copy_in)
        comm.add(id(copy_in))
    in_step = [t for t in mode.scratch_at if any(a <= t <= b for a, b in optimizer)]
    host_scratch = {t: mode.scratch_at[t] for t in in_step}
    gpu_scratch = {t: n for t, n in mode.scratch_at.items() if t not in host_scratch}
    return OffloadSplit(gpu, gpu_scratch, host, host_scratch, comm)


def live_bytes(allocations: Sequence[Allocation], scratch: Mapping[int, int],
               ticks: int) -> list[int]:
    """Live bytes after each op ``1..ticks`` (index ``t - 1``), scratch included."""
    delta = [0] * (ticks + 3)
    for rec in allocations:
        if rec.created > ticks:
            continue
        delta[max(rec.created, 0)] += rec.nbytes
        end = rec.freed + 1 if rec.freed >= 0 else ticks + 2
        delta[end] -= rec.nbytes
    out: list[int] = []
    live = delta[0]
    for t in range(1, ticks + 1):
        live += delta[t]
        out.append(live + scratch.get(t, 0))
    return out


_STATE_ORIGINS = frozenset({Origin.PARAMETER, Origin.BUFFER, Origin.INPUT})


class _OncePerSchema:
    """DTensor's ``_propagate_use_strided_shard_flag(op_strategy, op_schema)`` with its pass
    over ``op_schema``'s arguments made once per schema, not once per child strategy.

    The function reads from ``op_schema`` one value: the flag it agrees on over the arguments
    placed with ``_StridedShard`` (none: it does nothing); then it fixes up the specs of
    ``op_strategy`` to that flag. A foreach op's strategy has one child per tensor, each
    checked against all the op's arguments: quadratic (8.6 of 18 s of sharding propagation
    on Llama-3-8B FSDP2; on Llama-3-70B FSDP2 x tensor parallelism, whose parameters are all
    ``_StridedShard``, 69 of 235 profiled seconds). Here the flag is worked out once per
    schema (the last one, held so that its ``id`` stays its own), as the function works it
    out, and the function runs on each child with a stand-in schema of one argument that
    gives the same flag: its own fix-up code, in time proportional to the child.
    """

    def __init__(self, orig: Callable[[Any, Any], None]) -> None:
        self.orig = orig
        self._schema: Any = None
        self._stand_in: Any = None

    def __call__(self, op_strategy: Any, op_schema: Any) -> None:
        if op_schema is not self._schema:
            self._schema = op_schema
            self._stand_in = _strided_stand_in(op_schema)
        if self._stand_in is not None:
            self.orig(op_strategy, self._stand_in)


class _SameChildren:
    """DTensor's expansion of a single-dim strategy to the mesh, done once per strategy
    function of a foreach op, not once per child.

    ``_expand_single_dim_strategy_to_mesh(mesh, schema, info, meta)`` returns the function
    that makes an op's strategy; for a foreach op, one that makes a child's strategy function
    for each tensor (an ``lru_cache`` over the child's schema and output metadata, so that
    children of equal inputs get one function, holding one schema) and calls it: each call
    runs ``expand_to_full_mesh_op_strategy`` on that schema again, with the same arguments
    (723 parameters x 7 AdamW foreach ops: 32 of 188 profiled seconds on Llama-3-70B FSDP2 x
    tensor parallelism), after building the function's ``_PreparedSingleDimStrategy`` from
    that schema again (11.6 of 118 s once the expansions were shared). Here, while one op's
    strategy is made, a call whose schema is the very object of an earlier call (and whose
    other arguments are the same objects, or equal) returns that call's result, as DTensor's
    own caches share strategies among equal schemas. Nothing changes a child's strategy
    before all are made; then DTensor sets each child's strided-shard flag to the one value
    of the op's schema (twice on a shared one: the same), selects from it and copies the
    specs it keeps. A prepared strategy is only read.
    """

    def __init__(self, expand_to_mesh: Callable[..., Any], expand_full: Callable[..., Any],
                 prepare: Callable[..., Any]) -> None:
        self.orig_to_mesh = expand_to_mesh
        self.orig_full = expand_full
        self.orig_prepare = prepare
        self._memo: dict[Any, tuple[Any, ...]] | None = None

    def expand_to_mesh(self, *args: Any, **kwargs: Any) -> Callable[..., Any]:
        make = self.orig_to_mesh(*args, **kwargs)

        def run(*a: Any, **k: Any) -> Any:
            outer, self._memo = self._memo, {}
            try:
                return make(*a, **k)
            finally:
                self._memo = outer

        return run

    def expand_full(self, mesh: Any, op_schema: Any, strategies: Any, *args: Any,
                    **kwargs: Any) -> Any:
        memo = self._memo
        if memo is None or args:
            return self.orig_full(mesh, op_schema, strategies, *args, **kwargs)
        try:
            key = (id(mesh), id(op_schema), _frozen(strategies),
                   tuple(sorted((k, _frozen(v)) for k, v in kwargs.items())))
            hit = memo.get(key)
        except TypeError:  # unhashable (symbolic sizes): as DTensor does, no cache
            return self.orig_full(mesh, op_schema, strategies, **kwargs)
        if hit is not None and hit[0] is mesh and hit[1] is op_schema:
            return hit[2]
        out = self.orig_full(mesh, op_schema, strategies, **kwargs)
        memo[key] = (mesh, op_schema, out)  # held: their ids stay theirs
        return out

    def prepare(self, strategy_fn: Any, op_schema: Any, output_tensor_meta: Any,
                *args: Any, **kwargs: Any) -> Any:
        memo = self._memo
        if memo is None:
            return self.orig_prepare(strategy_fn, op_schema, output_tensor_meta, *args,
                                     **kwargs)
        try:
            key = ("prepare", id(strategy_fn), id(op_schema), id(output_tensor_meta),
                   _frozen(args), tuple(sorted((k, _frozen(v)) for k, v in kwargs.items())))
        except TypeError:
            return self.orig_prepare(strategy_fn, op_schema, output_tensor_meta, *args,
                                     **kwargs)
        hit = memo.get(key)
        if (hit is not None and hit[0] is strategy_fn and hit[1] is op_schema
                and hit[2] is output_tensor_meta):
            return hit[3]
        out = self.orig_prepare(strategy_fn, op_schema, output_tensor_meta, *args, **kwargs)
        memo[key] = (strategy_fn, op_schema, output_tensor_meta, out)
        return out


def _frozen(value: Any) -> Any:
    """``value`` to hash and compare: its lists and tuples (nested) made tuples, each other
    value with its type (``1 == True``; a placement's subclass may compare equal)."""
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_frozen(v) for v in value))
    hash(value)
    return (type(value), value)


def _strided_stand_in(op_schema: Any) -> Any:
    """A schema of one ``_StridedShard`` argument whose flag is the one DTensor's loop over
    ``op_schema.args_spec`` agrees on, or None where no argument is ``_StridedShard``."""
    from torch.distributed.tensor.placement_types import _StridedShard

    flag: Any = None
    first: Any = None
    for spec in op_schema.args_spec:  # the loop of _propagate_use_strided_shard_flag
        if any(isinstance(p, _StridedShard) for p in spec.placements):
            val = spec.use_strided_shard_as_shard_order
            flag = True if flag is not None and flag != val else val
            if first is None:
                first = spec
    if first is None:
        return None
    return SimpleNamespace(args_spec=(SimpleNamespace(
        placements=first.placements, use_strided_shard_as_shard_order=flag),))


class _LazyChunks(Sequence[torch.Tensor]):
    """FSDP2's ``_chunk_with_empty(tensor, num_chunks, dim)``, each chunk made when read.

    The same views as ``torch.chunk`` (ATen's ``chunk`` then ``split``: chunks of
    ``ceil(size / num_chunks)`` along ``dim``, the last one shorter), padded with empty
    tensors (``chunks[0].new_empty(0)``) up to ``num_chunks``.
    """

    def __init__(self, tensor: torch.Tensor, num_chunks: int, dim: int) -> None:
        self.tensor, self.num_chunks, self.dim = tensor, num_chunks, dim
        size = tensor.size(dim)
        self.step = -(-size // num_chunks)
        self.real = max(-(-size // self.step), 1) if self.step else num_chunks
        self._made: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return self.num_chunks

    @overload
    def __getitem__(self, i: int) -> torch.Tensor: ...
    @overload
    def __getitem__(self, i: slice) -> list[torch.Tensor]: ...

    def __getitem__(self, i: int | slice) -> torch.Tensor | list[torch.Tensor]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.num_chunks))]
        if i < 0:
            i += self.num_chunks
        if not 0 <= i < self.num_chunks:
            raise IndexError(i)
        made = self._made.get(i)
        if made is None:
            if i < self.real:
                start = i * self.step
                made = self.tensor.narrow(self.dim, start,
                                          min(self.step, self.tensor.size(self.dim) - start))
            else:
                made = self[0].new_empty(0)
            self._made[i] = made
        return made


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor, else ``t``."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def tp_plan(model: nn.Module, world: int) -> dict[str, Any]:
    """The tensor-parallel plan of a transformers model (its config's ``base_model_tp_plan``),
    as ``parallelize_module`` takes it: module patterns to Colwise / Rowwise styles."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    unsplit = unsplit_heads(model, world)
    if unsplit is not None:
        raise UsageError(f"tensor parallelism over {world} ranks splits attention heads: "
                         f"the model's {unsplit[0]} ({unsplit[1]}) must be a multiple of {world}")
    base = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and not hasattr(model, prefix):
        prefix = ""
    plan = {(f"{prefix}.{k}" if prefix else k): styles[v]()
            for k, v in base.items() if v in styles}
    if not plan:
        raise UsageError("tensor parallelism needs a plan: this model's config has no "
                         "base_model_tp_plan of colwise / rowwise layers (transformers models "
                         "such as Llama have one)")
    return plan


@dataclass
class _Layout:
    """How a rank's model is spread: the same for the trace and for the real run."""

    names: list[str]
    plan: dict[str, Any]
    tensor_parallel: bool
    tp: int
    shard_kwargs: dict[str, Any]

    @classmethod
    def of(cls, model: nn.Module, world: int, units: Sequence[str],
           reshard_after_forward: bool, tensor_parallel: bool, tp: int,
           mp_dtype: torch.dtype | None, cpu_offload: bool) -> _Layout:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

        if not 1 <= tp <= world or world % tp:
            raise UsageError(f"the tensor-parallel degree must divide {world}, not {tp}")
        two_d = tp > 1 and not tensor_parallel
        plan = (tp_plan(model, world) if tensor_parallel else tp_plan(model, tp) if two_d
                else {})
        kwargs: dict[str, Any] = {
            "reshard_after_forward": reshard_after_forward,
            "mp_policy": (MixedPrecisionPolicy(param_dtype=mp_dtype,
                                               reduce_dtype=torch.float32)
                          if mp_dtype is not None else MixedPrecisionPolicy()),
            "offload_policy": (CPUOffloadPolicy(pin_memory=False) if cpu_offload
                               else OffloadPolicy()),
        }
        names = [] if tensor_parallel else shard_units(model, units)
        return cls(names, plan, tensor_parallel, tp if two_d else 1, kwargs)

    @property
    def mesh_tp(self) -> int:
        """The tp size of a 2D mesh, or 1 for a 1D one."""
        return self.tp

    def apply(self, model: nn.Module, mesh: Any) -> list[str]:
        """Parallelize ``model`` on ``mesh`` (from :func:`fake_process_group`); the units."""
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import parallelize_module

        if self.tensor_parallel:
            parallelize_module(model, mesh, self.plan)
            return sorted(self.plan)
        if self.tp > 1:
            parallelize_module(model, mesh["tp"], self.plan)
            mesh = mesh["dp"]
        for name in self.names:
            fully_shard(model.get_submodule(name), mesh=mesh, **self.shard_kwargs)
        fully_shard(model, mesh=mesh, **self.shard_kwargs)
        return list(self.names)


def run_rank_trace(
    model: nn.Module,
    inputs: tuple[Any, ...] | Mapping[str, Any],
    program: Program,
    world: int,
    rank: int,
    *,
    units: Sequence[str] = (),
    reshard_after_forward: bool = True,
    tensor_parallel: bool = False,
    progress: ProgressFn | None = None,
    tp: int = 1,
    mp_dtype: torch.dtype | None = None,
    cpu_offload: bool = False,
) -> RankTrace:
    """Trace ``program`` as rank ``rank`` of ``world`` running FSDP2 on a fake copy of ``model``
    (``tensor_parallel``: the model's tensor-parallel plan instead, over ``world`` ranks).

    ``tp`` above 1 (a divisor of ``world``): a 2D mesh ``(world // tp, tp)``, the
    tensor-parallel plan on its tp dimension and FSDP2 on its dp dimension. ``mp_dtype``: FSDP2's
    ``MixedPrecisionPolicy(param_dtype=mp_dtype, reduce_dtype=float32)`` on every
    ``fully_shard`` and no autocast (``program.amp`` is then not used). ``cpu_offload``:
    FSDP2's ``CPUOffloadPolicy`` (on the CPU mesh its host-device copies are no-ops).
    ``model`` is not touched: a deep copy holding fake twins of its parameters and buffers is
    sharded (each unit of :func:`shard_units`, then the root) and traced.
    """
    from modelsize.estimation import scratch as scratch_models

    if program.mode not in ("train", "infer"):
        raise UsageError(f"mode must be 'train' or 'infer', not {program.mode!r}")
    if program.accumulate < 1 or program.steps < 1:
        raise UsageError("steps and accumulate must be at least 1")
    device = torch.device(program.device)
    table = scratch_models.table(device.type) if program.scratch else None
    mode = CountingFakeMode(scratch=table)
    mode.counting = False
    cpu = torch.device("cpu")
    copier = _FakeCopier(mode, cpu)
    comm: set[int] = set()
    memo: dict[int, Any] = {}
    for p in model.parameters():
        if id(p) not in memo:
            memo[id(p)] = nn.Parameter(copier.copy(p.detach()), requires_grad=p.requires_grad)
    for b in model.buffers():
        if id(b) not in memo:
            memo[id(b)] = copier.copy(b)
    n_params = sum(p.numel() for p in model.parameters())
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    work = copy.deepcopy(model, memo)  # the fake twins stand in for the tensors
    del memo
    layout = _Layout.of(work, world, units, reshard_after_forward, tensor_parallel, tp,
                        mp_dtype, cpu_offload)
    amp = None if mp_dtype is not None and not tensor_parallel else program.amp
    train = program.mode == "train"
    if train and not n_train:
        raise EstimateError("the loss does not require grad: no parameter is trainable")
    loss_fn = program.loss or default_loss
    # outside the fake mode: an input's real twin (RealValues) must stay a real tensor
    values = RealValues()
    mode.real_values = values
    args, kwargs = _fake_inputs(inputs, copier, {}, mode, values)
    with contextlib.ExitStack() as stack:
        stack.enter_context(heap_out_of_sight())
        mesh = stack.enter_context(fake_process_group(world, rank, layout.mesh_tp))
        if layout.mesh_tp > 1:
            stack.enter_context(_real_meshes())
        stack.enter_context(warnings.catch_warnings())
        # FSDP2 warns when a wrapped module returns a view (an LM head's reshape): harmless
        warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
        stack.enter_context(training_flags(work, train))
        stack.enter_context(checkpointed(work, program.checkpoint if train else ()))
        stack.enter_context(hf_checkpointing(work, program.gradient_checkpointing
                                             if train else None))
        stack.enter_context(_Collectives(mode, comm))
        offload = stack.enter_context(_OffloadTicks(mode)) if cpu_offload else None
        stack.enter_context(mode)
        names = layout.apply(work, mesh)
        params = list(work.parameters())
        for p in params:
            mode.track(_local(p), Origin.PARAMETER)
        for b in work.buffers():
            mode.track(b, Origin.BUFFER)
        stack.enter_context(_module_names(mode, work))
        stack.enter_context(values)
        scalars = _SavedScalars(mode, enabled=train and device.type == "cpu")
        if device.type == "cuda":
            from modelsize.estimation.cuda_kernels import CudaKernelChoices

            stack.enter_context(CudaKernelChoices())
        call = caller(work, args, kwargs, amp)
        start = time.perf_counter()
        module_acts = trace_program(
            mode, program, call, loss_fn, scalars, progress,
            lambda: make_factory(program.optimizer, program.implementation, device.type)(
                [p for p in params if program.optimize_frozen or p.requires_grad]),
            after_backward=lambda: _mark_grads(mode, params), local=_local)
        mode.counting = False
        mode.end_program()
        seconds = time.perf_counter() - start
    trace = Trace(mode, n_params, n_train, seconds, module_acts)
    return RankTrace(trace, rank, tuple(names), comm, offload)


def measure_rank(model: nn.Module, inputs: tuple[Any, ...] | Mapping[str, Any],
                 program: Program, parallel: Parallel, rank: int) -> int:
    """The real CPU peak of rank ``rank`` of ``parallel``: the program :func:`run_rank_trace`
    traces, run on real tensors (a copy of ``model``, zeros for meta tensors) on the fake
    process group, read from the allocator's events plus the bytes live before it started."""
    from modelsize.estimation.verify import (
        _real_copy,
        _real_inputs,
        allocator_events,
        peak_of,
        run_program,
        storage_bytes,
    )

    work = _real_copy(model)
    args, kwargs = _real_inputs(inputs)
    train = program.mode == "train"
    tensor_parallel = parallel.strategy is Strategy.TP
    policy = (not tensor_parallel and program.amp is not None
              and parallel.mixed_precision is FsdpPrecision.POLICY)
    layout = _Layout.of(work, parallel.world, parallel.units, parallel.reshard_after_forward,
                        tensor_parallel, 1 if tensor_parallel else parallel.tp or 1,
                        program.amp if policy else None, parallel.cpu_offload)
    loss_fn = program.loss or default_loss
    with contextlib.ExitStack() as stack:
        mesh = stack.enter_context(fake_process_group(parallel.world, rank, layout.mesh_tp))
        stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
        stack.enter_context(training_flags(work, train))
        stack.enter_context(checkpointed(work, program.checkpoint if train else (), real=True))
        stack.enter_context(hf_checkpointing(work, program.gradient_checkpointing
                                             if train else None))
        layout.apply(work, mesh)
        params = list(work.parameters())
        before = storage_bytes([_local(p) for p in params] + list(work.buffers())
                               + [v for v in (*args, *kwargs.values())
                                  if isinstance(v, torch.Tensor)])
        call = caller(work, args, kwargs, None if policy else program.amp)
        events = stack.enter_context(allocator_events())
        run_program(call, params, program, loss_fn, program.implementation)
    return before + peak_of(events)


def check_verifiable(parallel: Parallel) -> None:
    """Refuse (:class:`UsageError`) to verify what was accounted rather than traced."""
    if not parallel.traced or parallel.cpu_offload:
        what = "with CPU offload" if parallel.cpu_offload else f"of {parallel.strategy}"
        raise UsageError(f"--verify checks a traced rank against the same program run for "
                         f"real; the per-rank numbers {what} are accounted, not traced")


def _unshardable(exc: NotImplementedError, strategy: Strategy) -> UsageError | None:
    """The one line for a weight subclass that lacks an op FSDP2 or DTensor needs
    (torchao's weight-only ``Int8Tensor`` / ``Float8Tensor``: ``aten.new_zeros``,
    ``aten.split``), which a real run of the same program meets too (checked on CPU for
    torchao 0.18 under FSDP2); None for any other error."""
    text = str(exc)
    found = re.search(r"(\w+) dispatch: attempting to run unimplemented operator/function: "
                      r"func=<OpOverload\(op='([\w.]+)'", text)
    if found is None:
        return None
    cls, op = found.groups()
    return UsageError(f"--strategy {strategy.value}: {cls} weights cannot be sharded: it does "
                      f"not implement {op}, which the sharding needs, and a real run fails the "
                      "same way; use --strategy ddp, or --quantize nf4 with --strategy fsdp "
                      "(FSDP-QLoRA)")


def verify_rank(model: nn.Module, inputs: tuple[Any, ...] | Mapping[str, Any],
                settings: Any, parallel: Parallel, est: Estimate,
                budget: int | None = None) -> Verification:
    """``--verify`` across GPUs: the worst traced rank of ``est`` run for real on CPU on the
    fake process group (:func:`measure_rank`), beside the CPU estimate of that same rank.

    ``settings``: the :class:`~modelsize.estimation.core.Settings` of ``est``. The run holds
    the whole model before sharding it, so it happens only when the model's bytes plus the
    rank's estimate fit ``budget`` (half of the available memory unless given).
    """
    from modelsize.estimation.core import estimate
    from modelsize.estimation.optimizers import default_implementation
    from modelsize.estimation.verify import _unrunnable, default_budget

    check_verifiable(parallel)
    began = time.perf_counter()
    budget = default_budget() if budget is None else budget
    assert est.parallel is not None
    rank = est.parallel.worst_rank
    program = settings.program()
    impl = program.implementation
    if str(impl) == "default":
        impl = default_implementation(settings.device)
    cpu = replace(settings, device="cpu", implementation=str(impl))
    estimated = est.peak_bytes
    if settings.device != "cpu":  # on CPU, "default" is the implementation the trace used
        estimated = estimate(model, inputs, **cpu.kwargs(),
                             parallel=replace(parallel, ranks=(rank,))).peak_bytes
    whole = sum(t.numel() * t.element_size() for t in
                {id(t): t for t in (*model.parameters(), *model.buffers())}.values())
    reason = _unrunnable(model, inputs)
    if not reason and whole + estimated > budget:
        reason = (f"the real run holds the whole model ({whole:,} bytes) before sharding it, "
                  f"plus the rank's {estimated:,}: over the {budget:,}-byte budget")
    measured = None
    if not reason:
        try:
            measured = measure_rank(model, inputs, cpu.program(), parallel, rank)
        except (RuntimeError, MemoryError, TypeError, ValueError) as exc:
            reason = "the real run failed: " + (str(exc).strip().splitlines()
                                                 or [type(exc).__name__])[0]
    return Verification(measured, estimated, None, None, budget, time.perf_counter() - began,
                        reason)


def _mark_grads(mode: CountingFakeMode, params: list[nn.Parameter]) -> None:
    for p in params:
        if p.grad is not None:
            rec = mode.allocation_of(_local(p.grad))
            if rec is not None:
                rec.is_grad = True


def is_communication(rank: RankTrace) -> Callable[[Allocation], bool]:
    """Whether an allocation of ``rank`` is a communication buffer (not a gradient)."""
    return lambda rec: id(rec) in rank.communication and not rec.is_grad


# -- the estimate of a rank ----------------------------------------------------------------


def estimate_parallel(model: nn.Module, inputs: tuple[Any, ...] | Mapping[str, Any],
                      program: Program, parallel: Parallel, name: str,
                      described: tuple[tuple[str, tuple[int, ...], str], ...],
                      sources: dict[str, Source],
                      progress: ProgressFn | None = None) -> Estimate:
    """The :class:`Estimate` of the worst rank of ``parallel`` (see :mod:`.parallel`)."""
    from modelsize.estimation.core import summarize
    from modelsize.estimation.quantized import fsdp_weights, has_4bit_layers

    if parallel.traced:
        strategy = parallel.strategy
        fsdp = strategy is not Strategy.TP
        if (fsdp and program.mode == "train" and isinstance(program.optimizer, str)
                and parse_name(program.optimizer) in (OptimizerName.ADAMW8BIT,
                                                      OptimizerName.PAGED_ADAMW8BIT)):
            raise UsageError(
                f"--strategy {Strategy(strategy).value} with --optimizer "
                f"{program.optimizer}: bitsandbytes' 8-bit optimizers do not take FSDP2's "
                "sharded (DTensor) parameters, and a real run fails in its first step ('got "
                "mixed torch.Tensor and DTensor', bitsandbytes 0.50 on CPU); use --optimizer "
                "adamw, or --strategy ddp")
        if (strategy is Strategy.TP or (parallel.tp or 1) > 1) and has_4bit_layers(model):
            raise UsageError(
                f"--strategy {Strategy(strategy).value}: tensor parallelism cannot split "
                "bitsandbytes' 4-bit layers (each weight is packed into one column of bytes, "
                "and their forward rewraps it as Params4bit, which a DTensor cannot be); use "
                "--strategy fsdp (FSDP-QLoRA), zero3 or ddp")
        policy = fsdp and program.amp is not None and (
            parallel.mixed_precision is FsdpPrecision.POLICY)
        worst: Estimate | None = None
        peaks: list[RankPeak] = []
        units: tuple[str, ...] = ()
        worst_host: tuple[int, int] | None = None
        for rank in parallel.ranks_to_trace():
            try:
                with fsdp_weights():
                    rt = run_rank_trace(model, inputs, program, parallel.world, rank,
                                        units=parallel.units,
                                        reshard_after_forward=parallel.reshard_after_forward,
                                        tensor_parallel=strategy is Strategy.TP,
                                        progress=progress, tp=(parallel.tp or 1) if fsdp else 1,
                                        mp_dtype=program.amp if policy else None,
                                        cpu_offload=parallel.cpu_offload)
            except NotImplementedError as exc:
                refused = _unshardable(exc, Strategy(strategy))
                if refused is None:
                    raise
                raise refused from exc
            est = summarize(rt.trace, program, name, described, sources, is_communication(rt))
            host: tuple[int, int] | None = None
            if rt.offload is not None:
                est, host = _offloaded(est, rt, program)
            units = rt.units
            peaks.append(RankPeak(rank, est.peak_bytes, est.phase.name, est.phase.step))
            if worst is None or est.peak_bytes > worst.peak_bytes:
                worst, worst_rank, worst_host = est, rank, host
        assert worst is not None
        notes = (*worst.notes, _traced_note(parallel, worst_rank))
        if fsdp and has_4bit_layers(model):
            notes += ("FSDP with bitsandbytes 4-bit layers: each gathered weight is given its "
                      "4-bit state as bitsandbytes' forward gives it back (Params4bit, the "
                      "same storage); equal to the real ranks run on CPU "
                      "(tests/estimation/test_quantized.py)",)
        precision = ""
        if fsdp and program.amp is not None:
            precision = str(parallel.mixed_precision)
            notes += (_precision_note(parallel, program.amp),)
        if parallel.cpu_offload:
            notes += ("accounted, not traced: CPU offload. FSDP2 ran with CPUOffloadPolicy on "
                      "the CPU mesh, where its host-device copies are no-ops; the GPU's share "
                      "is the trace less what the policy keeps on the host (sharded "
                      "parameters, sharded gradients, optimizer state, the optimizer step), "
                      "plus the GPU copies of each all-gather's sharded parameters and each "
                      "reduce-scatter output until its gradients are copied out. Pinned "
                      "memory and the copies' overlap are not modelled",)
        if not units and fsdp:
            notes += ("no repeated blocks found: only the root was sharded, so each forward "
                      "gathers every parameter at once",)
        info = ParallelInfo(parallel.world, str(strategy), "traced", worst_rank,
                            tuple(peaks), units, parallel.reshard_after_forward,
                            _comparisons(model, program, parallel.world), mesh=parallel.mesh,
                            mixed_precision=precision, cpu_offload=parallel.cpu_offload,
                            accounted=(("CPU offload: the GPU's and the host's shares",)
                                       if parallel.cpu_offload else ()),
                            host_bytes=worst_host[0] if worst_host else None,
                            host_peak_bytes=worst_host[1] if worst_host else None)
        return replace(worst, parallel=info, notes=notes)
    return _accounted(model, inputs, program, parallel, name, described, sources, progress)


def _offloaded(est: Estimate, rank: RankTrace, program: Program
               ) -> tuple[Estimate, tuple[int, int]]:
    """``est`` of the GPU alone under CPU offload (:func:`offload_split`), and the host's
    bytes at the GPU's peak and at the host's own peak."""
    from modelsize.estimation.core import TIMELINE_POINTS, classify, downsample
    from modelsize.estimation.device import device_estimate

    split = offload_split(rank)
    ticks = rank.trace.mode.tick
    gpu = live_bytes(split.gpu, split.gpu_scratch, ticks)
    host = live_bytes(split.host, split.host_scratch, ticks)
    at = max(range(len(gpu)), key=gpu.__getitem__) + 1 if gpu else 0
    peak = gpu[at - 1] if at else 0
    cats = dict.fromkeys(MemoryCategory, 0)
    for rec in split.gpu:
        if rec.live_at(at):
            cat = (MemoryCategory.COMMUNICATION if id(rec) in split.communication
                   else classify(rec))
            cats[cat] += rec.nbytes
    scratch = split.gpu_scratch.get(at, 0)
    cats[MemoryCategory.TEMPORARIES] += scratch
    phase = next((p for p in est.phases if p.start <= at <= p.end), est.phase)
    dev = device_estimate(program.device, peak, scratch, split.gpu, split.gpu_scratch, ticks,
                          any(d.name == "cublas_workspace" and d.nbytes
                              for d in est.device_estimate.terms))
    out = replace(est, peak_bytes=peak, phase=phase, categories=cats, scratch_bytes=scratch,
                  timeline=downsample(gpu, TIMELINE_POINTS), device_estimate=dev,
                  saved_for_backward=None)
    return out, (host[at - 1] if at else 0, max(host, default=0))


def _traced_note(parallel: Parallel, rank: int) -> str:
    world = parallel.world
    if parallel.strategy is Strategy.TP:
        return ("traced: the model's tensor-parallel plan applied with parallelize_module on a "
                f"fake process group of {world} ranks")
    where = f"a fake process group of {world} ranks"
    if parallel.strategy is Strategy.FSDP_TP:
        tp = parallel.tp or 1
        where = (f"the dp dimension of a 2D mesh (dp {parallel.dp}, tp {tp}) of {world} fake "
                 f"ranks, after the model's tensor-parallel plan on its tp dimension; rank "
                 f"{rank} is (dp {rank // tp}, tp {rank % tp})")
    return (f"traced: FSDP2 fully_shard on {where} (CPU path; on CUDA a separate all-gather "
            "stream can keep one more block's gathered parameters alive)")


def _precision_note(parallel: Parallel, amp: torch.dtype) -> str:
    dtype = str(amp).removeprefix("torch.")
    if parallel.mixed_precision is FsdpPrecision.POLICY:
        return (f"mixed precision: FSDP2's MixedPrecisionPolicy(param_dtype={dtype}, "
                "reduce_dtype=float32) on every fully_shard, no autocast: parameters are "
                f"gathered in {dtype}, gradients reduced in float32 (--fsdp-mp autocast traces "
                "torch.autocast around fp32 FSDP2 instead)")
    return (f"mixed precision: torch.autocast({dtype}) around FSDP2 with float32 parameters. "
            f"Autocast caches a {dtype} copy of each float32 parameter it casts until the "
            "autocast region ends, so every gathered parameter's copy stays alive through the "
            "whole forward even after FSDP2 frees the gathered parameter; FSDP2's "
            "MixedPrecisionPolicy (--fsdp-mp policy, the default) gathers in low precision "
            "instead")


def _accounted(model: nn.Module, inputs: tuple[Any, ...] | Mapping[str, Any],
               program: Program, parallel: Parallel, name: str,
               described: tuple[tuple[str, tuple[int, ...], str], ...],
               sources: dict[str, Source], progress: ProgressFn | None) -> Estimate:
    """DDP / ZeRO-1 / ZeRO-2: the single-GPU trace replayed with sharded terms divided."""
    from modelsize.estimation.core import classify, summarize
    from modelsize.estimation.trace import run_trace

    trace = run_trace(model, inputs, program, progress)
    base = summarize(trace, program, name, described, sources)
    world, strategy = parallel.world, parallel.strategy
    divided: list[str] = []
    if strategy in (Strategy.ZERO1, Strategy.ZERO2):
        divided.append("optimizer step (its state and intermediates)")
    if strategy is Strategy.ZERO2:
        divided.append("gradients")

    def share(rec: Allocation) -> int:
        if strategy in (Strategy.ZERO1, Strategy.ZERO2) and rec.origin is Origin.OPTIMIZER:
            return -(-rec.nbytes // world)
        if strategy is Strategy.ZERO2 and rec.is_grad:
            return -(-rec.nbytes // world)
        return rec.nbytes

    buckets = 0
    if strategy is Strategy.DDP:  # the Reducer's flat buckets: one gradient copy, from init
        buckets = sum(p.numel() * p.element_size() for p in
                      {id(p): p for p in model.parameters() if p.requires_grad}.values())
    mode = trace.mode
    peak, tick = replay(mode, share)
    cats = dict.fromkeys(MemoryCategory, 0)
    for rec in mode.allocations:
        if rec.live_at(tick):
            cats[classify(rec)] += share(rec)
    cats[MemoryCategory.TEMPORARIES] += mode.scratch_at.get(tick, 0)
    cats[MemoryCategory.COMMUNICATION] += buckets
    phase = next((p for p in base.phases if p.start <= tick <= p.end), base.phase)
    accounted = tuple(divided) + (("DDP gradient buckets (all trainable parameters' bytes, "
                                   "gradient_as_bucket_view=False)",) if buckets else ())
    info = ParallelInfo(world, str(strategy), "accounted", 0,
                        (RankPeak(0, peak + buckets, phase.name, phase.step),), (),
                        parallel.reshard_after_forward,
                        _comparisons(model, program, world), accounted)
    note = ("accounted, not traced: the single-GPU program's allocations replayed with "
            + ("; ".join(divided) + f" divided by {world}" if divided else "nothing divided")
            + (" and DDP's gradient buckets added" if buckets else "")
            + "; ZeRO's own buckets and prefetching are not modelled")
    scratch = mode.scratch_at.get(tick, 0)
    return replace(base, peak_bytes=peak + buckets, phase=phase, categories=cats,
                   scratch_bytes=scratch, parallel=info, notes=(*base.notes, note),
                   saved_for_backward=None,
                   device_estimate=_accounted_device(base.device_estimate, mode, share,
                                                     peak + buckets, scratch, buckets))


def _accounted_device(single: DeviceEstimate, mode: CountingFakeMode,
                      share: Callable[[Allocation], int], peak: int, scratch: int,
                      extra: int) -> DeviceEstimate:
    """The device terms of an accounted rank: the single-GPU terms with the tensors and the
    allocator's rounding of the rank's own (divided) allocations."""
    from modelsize.estimation.device import CUDA_BLOCK, round_up

    if single.device != "cuda":
        return replace(single, terms=tuple(
            replace(t, nbytes={"tensors": peak - scratch, "kernel_scratch": scratch}.get(
                t.name, t.nbytes)) for t in single.terms), allocated_bytes=peak,
            total_bytes=peak)
    rounded = replay(mode, lambda rec: round_up(share(rec), CUDA_BLOCK))[0]
    rounded += round_up(extra, CUDA_BLOCK)
    terms = {t.name: t for t in single.terms}
    named = [replace(terms["tensors"], nbytes=peak - scratch),
             replace(terms["kernel_scratch"], nbytes=scratch),
             replace(terms["allocator_rounding"], nbytes=max(rounded - peak, 0))]
    rest = tuple(t for t in single.terms if t.name not in {"tensors", "kernel_scratch",
                                                           "allocator_rounding",
                                                           "peak_moment"})
    allocated = peak + named[2].nbytes + sum(t.nbytes for t in rest
                                             if t.name == "cublas_workspace")
    return replace(single, terms=(*named, *rest), allocated_bytes=allocated,
                   total_bytes=allocated + sum(t.nbytes for t in rest
                                               if t.name == "cuda_context"))


def replay(mode: CountingFakeMode, size: Callable[[Allocation], int]) -> tuple[int, int]:
    """The peak (bytes, tick) of a finished trace with each allocation's bytes ``size(rec)``.

    ``size = lambda rec: rec.nbytes`` gives back the trace's own peak.
    """
    delta = [0] * (mode.tick + 3)
    for rec in mode.allocations:
        if rec.created > mode.tick:
            continue
        n = size(rec)
        delta[max(rec.created, 0)] += n
        end = rec.freed + 1 if rec.freed >= 0 else mode.tick + 2
        delta[end] -= n
    live = peak = 0
    peak_tick = 0
    for t in range(mode.tick + 1):
        live += delta[t]
        high = live + mode.scratch_at.get(t, 0)
        if t >= 1 and high > peak:
            peak, peak_tick = high, t
    return peak, peak_tick


def _comparisons(model: nn.Module, program: Program, world: int) -> tuple[Comparison, ...]:
    unique = {id(p): p for p in model.parameters()}.values()
    params = sum(p.numel() for p in unique)
    largest = max((sum(p.numel() for p in m.parameters(recurse=False))
                   for m in model.modules()), default=0)
    first = next(iter(unique), None)
    return comparisons(params, largest, world,
                       param_bytes=first.element_size() if first is not None else 4,
                       mixed=program.amp is not None)
