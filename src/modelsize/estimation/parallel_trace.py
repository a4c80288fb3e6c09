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

Known limitations: the program runs FSDP2's CPU path. On CUDA, FSDP2 gathers on a separate
stream and frees a buffer only once the compute stream has used it, which can keep one more
block's gathered parameters alive than a CPU run does; the CUDA caching allocator's rounding
is not modelled per rank.
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from modelsize.errors import EstimateError, UsageError
from modelsize.estimation.optimizers import make_factory
from modelsize.estimation.parallel import Parallel, Strategy, comparisons
from modelsize.estimation.result import (
    Comparison,
    Estimate,
    MemoryCategory,
    ParallelInfo,
    RankPeak,
    Source,
)
from modelsize.estimation.trace import (
    Program,
    ProgressFn,
    RealValues,
    Trace,
    _fake_inputs,
    _FakeCopier,
    _forward_loss,
    _mark_saved,
    _module_bytes,
    _module_names,
    _SavedScalars,
    caller,
    checkpointed,
    default_loss,
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


@contextlib.contextmanager
def fake_process_group(world: int, rank: int) -> Iterator[Any]:
    """A fake process group of ``world`` ranks, this process being ``rank``; yields a CPU mesh."""
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


_STATE_ORIGINS = frozenset({Origin.PARAMETER, Origin.BUFFER, Origin.INPUT})


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor, else ``t``."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def tp_plan(model: nn.Module, world: int) -> dict[str, Any]:
    """The tensor-parallel plan of a transformers model (its config's ``base_model_tp_plan``),
    as ``parallelize_module`` takes it: module patterns to Colwise / Rowwise styles."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    config = getattr(model, "config", None)
    for attr in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, attr, None)
        if isinstance(heads, int) and heads % world:
            raise UsageError(f"tensor parallelism over {world} ranks splits attention heads: "
                             f"the model's {attr} ({heads}) must be a multiple of {world}")
    base = getattr(config, "base_model_tp_plan", None) or {}
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
) -> RankTrace:
    """Trace ``program`` as rank ``rank`` of ``world`` running FSDP2 on a fake copy of ``model``
    (``tensor_parallel``: the model's tensor-parallel plan instead, over ``world`` ranks).

    ``model`` is not touched: a deep copy holding fake twins of its parameters and buffers is
    sharded (each unit of :func:`shard_units`, then the root) and traced.
    """
    from torch.distributed.fsdp import fully_shard

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
    names = [] if tensor_parallel else shard_units(work, units)
    plan = tp_plan(work, world) if tensor_parallel else {}
    train = program.mode == "train"
    if train and not n_train:
        raise EstimateError("the loss does not require grad: no parameter is trainable")
    loss_fn = program.loss or default_loss
    module_acts: dict[str, int] = {}
    with contextlib.ExitStack() as stack:
        mesh = stack.enter_context(fake_process_group(world, rank))
        stack.enter_context(warnings.catch_warnings())
        # FSDP2 warns when a wrapped module returns a view (an LM head's reshape): harmless
        warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
        stack.enter_context(training_flags(work, train))
        stack.enter_context(checkpointed(work, program.checkpoint if train else ()))
        stack.enter_context(_Collectives(mode, comm))
        stack.enter_context(mode)
        if tensor_parallel:
            from torch.distributed.tensor.parallel import parallelize_module

            parallelize_module(work, mesh, plan)
            names = sorted(plan)
        else:
            for name in names:
                fully_shard(work.get_submodule(name), mesh=mesh,
                            reshard_after_forward=reshard_after_forward)
            fully_shard(work, mesh=mesh, reshard_after_forward=reshard_after_forward)
        params = list(work.parameters())
        for p in params:
            mode.track(_local(p), Origin.PARAMETER)
        for b in work.buffers():
            mode.track(b, Origin.BUFFER)
        values = RealValues()
        args, kwargs = _fake_inputs(inputs, copier, {}, mode, values)
        stack.enter_context(_module_names(mode, work))
        stack.enter_context(values)
        scalars = _SavedScalars(mode)
        if train and device.type == "cpu":
            stack.enter_context(scalars)
        if device.type == "cuda":
            from modelsize.estimation.cuda_kernels import CudaKernelChoices

            stack.enter_context(CudaKernelChoices())
        call = caller(work, args, kwargs, program.amp)
        label = ["forward"]
        if progress is not None:
            mode.progress = lambda tick: progress(label[0], tick)
        start = time.perf_counter()
        mode.counting = True
        if not train:
            mode.begin_phase("forward", 1)
            mode.origin = Origin.FORWARD
            with torch.no_grad():
                out = call()
            _mark_saved(mode, scalars)
            module_acts = _module_bytes(mode)
            del out
            mode.end_phase()
        else:
            optimized = [p for p in params if program.optimize_frozen or p.requires_grad]
            optimizer = make_factory(program.optimizer, program.implementation,
                                     device.type)(optimized)
            for step in range(1, program.steps + 1):
                for micro in range(1, program.accumulate + 1):
                    label[0] = f"step {step}/{program.steps}"
                    mode.begin_phase("forward", step, micro)
                    mode.origin = Origin.FORWARD
                    loss = _forward_loss(call, loss_fn)
                    _mark_saved(mode, scalars)
                    if step == 1 and micro == 1:
                        module_acts = _module_bytes(mode)
                    mode.begin_phase("backward", step, micro)
                    mode.origin = Origin.BACKWARD
                    loss.backward()
                    del loss
                    scalars.release_all()
                    _mark_grads(mode, params)
                mode.begin_phase("optimizer", step)
                mode.origin = Origin.OPTIMIZER
                optimizer.step()
                _mark_state(mode, optimizer)
                mode.begin_phase("zero_grad", step)
                optimizer.zero_grad(set_to_none=True)
                mode.end_phase()
            del optimizer
        mode.counting = False
        seconds = time.perf_counter() - start
    trace = Trace(mode, n_params, n_train, seconds, module_acts)
    return RankTrace(trace, rank, tuple(names), comm)


def _mark_grads(mode: CountingFakeMode, params: list[nn.Parameter]) -> None:
    for p in params:
        if p.grad is not None:
            rec = mode.allocation_of(_local(p.grad))
            if rec is not None:
                rec.is_grad = True


def _mark_state(mode: CountingFakeMode, optimizer: torch.optim.Optimizer) -> None:
    for st in optimizer.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                mode.track(_local(v), Origin.OPTIMIZER).is_state = True


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

    if parallel.traced:
        worst: Estimate | None = None
        peaks: list[RankPeak] = []
        units: tuple[str, ...] = ()
        for rank in parallel.ranks_to_trace():
            rt = run_rank_trace(model, inputs, program, parallel.world, rank,
                                units=parallel.units,
                                reshard_after_forward=parallel.reshard_after_forward,
                                tensor_parallel=parallel.strategy is Strategy.TP,
                                progress=progress)
            est = summarize(rt.trace, program, name, described, sources, is_communication(rt))
            units = rt.units
            peaks.append(RankPeak(rank, est.peak_bytes, est.phase.name, est.phase.step))
            if worst is None or est.peak_bytes > worst.peak_bytes:
                worst, worst_rank = est, rank
        assert worst is not None
        if parallel.strategy is Strategy.TP:
            notes = (*worst.notes, "traced: the model's tensor-parallel plan applied with "
                     f"parallelize_module on a fake process group of {parallel.world} ranks")
        else:
            notes = (*worst.notes, "traced: FSDP2 fully_shard on a fake process group of "
                     f"{parallel.world} ranks (CPU path; on CUDA a separate all-gather stream "
                     "can keep one more block's gathered parameters alive)")
        if not units and parallel.strategy is not Strategy.TP:
            notes += ("no repeated blocks found: only the root was sharded, so each forward "
                      "gathers every parameter at once",)
        info = ParallelInfo(parallel.world, str(parallel.strategy), "traced", worst_rank,
                            tuple(peaks), units, parallel.reshard_after_forward,
                            _comparisons(model, program, parallel.world))
        return replace(worst, parallel=info, notes=notes)
    return _accounted(model, inputs, program, parallel, name, described, sources, progress)


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
    return replace(base, peak_bytes=peak + buckets, phase=phase, categories=cats,
                   scratch_bytes=mode.scratch_at.get(tick, 0), parallel=info,
                   notes=(*base.notes, note))


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
