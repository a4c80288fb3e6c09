"""Repeated blocks of a training step: a block's forward under autograd and its backward,
recorded from real calls and replayed for its twins (the training half of
:mod:`modelsize.estimation.block_replay`).

A real call of a block is recorded as it ends (:func:`record_forward`): every tick (op, bytes
live relative to the call's start, scratch), every storage it allocated (size, lifetime,
origin, module, op, shape, dtype, what it derives from), and the autograd nodes it made, read
as :func:`~modelsize.estimation.tracker.record_savers` reads them (name, module, the tensors
each keeps, the nodes after it). Every storage the call made and that outlives it is either
the output or kept by those nodes (else the call is refused: a storage kept elsewhere, a
Python scalar autograd keeps, a saved-tensor hook, a node outside the block that keeps one
of its tensors). The block's backward is recorded between two pre-hooks
(:class:`BackwardWatch`): on the node that makes the block's output (the backward starts) and
on the node of its one input that requires grad (it has ended). In between, only the block's
nodes and its parameters' ``AccumulateGrad`` may run (the node log of the counting mode), and
the bytes must add up: what the backward allocated and left (its parameters' new gradients,
the input's gradient), minus the kept tensors it let go; the incoming gradient, which the
engine holds until a replayed block returns, may not be freed before the backward's last op.

A replayed call (:class:`ReplayedBlock`) is one custom autograd Function: its forward
advances the counting mode through the recorded ticks, appends the recorded allocation
records and makes, as fake tensors over new storages (no op dispatched), the storages that
outlive it: the output and the tensors its nodes keep, which it holds (the inputs it keeps
too) until its backward lets each go at the recorded tick. Its node stands, for
``record_savers``, for the block's recorded nodes (:class:`~modelsize.estimation.tracker.
VirtualNode`). Its backward advances through the recorded backward the same way, sets the
parameters' gradients and returns the input's gradient (the incoming one, where a real run
accumulates into it in place).

Backward records come from the last blocks (a backward runs the blocks in reverse): the
forward runs the first two blocks of a kind and the last three for real, and replays the
others; the backward of the last three is recorded, two equal records are the template, and
the next real one (the second block) must equal it, or the trace runs again without block
replay.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.autograd.function import BackwardCFunction

from modelsize.estimation.segments import (
    Refused,
    _materialize,
    _Opaque,
    _state_leaves,
    _TensorLeaf,
    allocations_of_call,
    denormalize,
    get,
    module_name,
    module_name_for,
    put,
    walk,
)
from modelsize.estimation.tracker import (
    VIRTUAL_GRAPH,
    Allocation,
    CountingFakeMode,
    VirtualNode,
    _checkpoint_frame,
    _saved_attrs,
)

#: The sequence number of every ``AccumulateGrad`` node.
_ACCUMULATE = 2**64 - 1

Target = tuple[Any, ...]  # ("int", allocation index) | ("in", input path) | ("p", name)


def input_tensors(inputs: Mapping[str, Any], state: Any = None
                  ) -> list[tuple[Any, torch.Tensor]]:
    """The tensors of a call's inputs, with their paths (as :func:`segments.walk` finds;
    ``state``, the cache, is not entered)."""
    leaves: list[tuple[Any, Any]] = []
    walk(inputs, (), leaves, state)
    return [(p, t) for p, t in leaves if isinstance(t, torch.Tensor)]


def grad_edge(t: torch.Tensor) -> tuple[Any, int]:
    """The node and output of a non-leaf (``get_gradient_edge`` would dispatch a view)."""
    if t.grad_fn is None:
        raise Refused("the input that requires grad is a leaf")
    return t.grad_fn, t.output_nr


def _view(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.dtype, t.device, tuple(t.shape), tuple(t.stride()), t.storage_offset())


def _fields(r: Allocation, t0: int, prefix: str, sources: tuple[Any, ...]) -> tuple[Any, ...]:
    """What a replayed record copies from ``r`` (ticks relative to ``t0``)."""
    return (r.created - t0, r.freed - t0 if r.freed >= 0 else -1, r.nbytes, r.origin,
            module_name(r.module, prefix), (r.is_grad, r.is_state, r.saved, r.recomputed),
            r.op, r.shape, r.dtype, r.state, sources)


def _new_record(mode: CountingFakeMode, f: tuple[Any, ...], t0: int, prefix: str,
                sources: tuple[Allocation, ...], rec: Allocation | None = None) -> Allocation:
    created, freed, nbytes, origin, module, flags, op, shape, dtype, state, _ = f
    if rec is None:
        rec = Allocation(nbytes, origin, t0 + created, len(mode.phases) - 1, "",
                         t0 + freed if freed >= 0 else -1)
        mode.allocations.append(rec)
    elif rec.nbytes != nbytes:
        mode.live_bytes += nbytes - rec.nbytes
        rec.nbytes = nbytes
    rec.module = module_name_for(module, prefix)
    rec.is_grad, rec.is_state, rec.saved, rec.recomputed = flags
    rec.op, rec.shape, rec.dtype, rec.state, rec.sources = op, shape, dtype, state, sources
    return rec


def _storages(mode: CountingFakeMode, nbytes: int, views: list[tuple[Any, ...]]
              ) -> list[torch.Tensor]:
    """Fake tensors over one new storage of ``nbytes``: the given views, else flat bytes."""
    return _materialize(mode, nbytes, views or [(torch.uint8, torch.device("cpu"), (nbytes,),
                                                 (1,), 0)])


def _ticks(mode: CountingFakeMode, t0: int, t1: int, base: int) -> tuple[Any, ...]:
    deltas = tuple(v - base for v in mode.timeline[t0:t1])
    scratch = tuple((s - t0, mode.scratch_at[s], mode.scratch_parts.get(s, ()))
                    for s in range(t0 + 1, t1 + 1) if s in mode.scratch_at)
    return tuple(mode.ops[t0:t1]), deltas, scratch


def _advance(mode: CountingFakeMode, ops: tuple[Any, ...], deltas: tuple[int, ...],
             scratch: Mapping[int, tuple[int, tuple[int, ...]]], start: int, j: int) -> None:
    """Tick ``j`` (1-based) of a replay: the op, its scratch and the bytes live after it."""
    mode.tick += 1
    tick = mode.tick
    op = ops[j - 1]
    mode.ops.append(op)
    extra, parts = scratch.get(j, (0, ()))
    if extra:
        mode.scratch_at[tick] = extra
        if parts:
            mode.scratch_parts[tick] = parts
    high = start + deltas[j - 1]
    mode.timeline.append(high)
    if high > mode.peak_bytes:
        mode.peak_bytes = high
        mode.peak_tick = tick
        mode.peak_scratch = extra
        mode.peak_scratch_op = str(op) if extra else ""
    if mode.progress is not None and not tick & 1023:
        mode.progress(tick)


# -- the forward -------------------------------------------------------------------------------


@dataclass
class Start:
    """The counting mode as a block call began."""

    tick: int
    allocs: int
    live_bytes: int
    seq: int
    first_calls: int
    host_rng: int
    grads: tuple[bool, ...]

    @classmethod
    def of(cls, mode: CountingFakeMode, params: list[nn.Parameter]) -> Start:
        return cls(mode.tick, len(mode.allocations), mode.live_bytes,
                   torch._C._autograd._get_sequence_nr(), len(mode.first_calls),
                   mode.host_rng_copies, tuple(p.grad is None for p in params))


@dataclass
class NodeSpec:
    label: str
    module: str
    custom: bool
    items: tuple[tuple[str, Target], ...]
    nexts: tuple[tuple[str, int], ...]  # ("n", node index) | ("x", 0): the input's node


@dataclass
class ForwardRecord:
    """One real block call under autograd, as a replay needs it."""

    ops: tuple[Any, ...]
    deltas: tuple[int, ...]
    scratch: tuple[tuple[int, int, tuple[int, ...]], ...]
    allocs: tuple[tuple[Any, ...], ...]
    materialized: tuple[int, ...]
    """The allocations a replay makes a storage for (the output's, the kept ones)."""
    held: tuple[Target, ...]
    """What the block's nodes keep (its own storages, its inputs), in the order first kept."""
    nodes: tuple[NodeSpec, ...]
    out: tuple[Any, ...]  # the output's structure: ("t",) | ("seq", type, items) | ("v", v)
    out_alloc: int
    out_view: tuple[Any, ...]
    grad_input: Any
    """The path of the one input that requires grad."""
    assigns: tuple[tuple[Any, int, tuple[Any, ...]], ...]
    """(path in the cache, with the index abstracted; allocation; view) of each tensor the
    call puts in its slot of the cache."""
    scalars: tuple[tuple[Any, Any], ...]
    end_delta: int

    def key(self) -> tuple[Any, ...]:
        return (self.ops, self.deltas, self.scratch, self.allocs, self.materialized, self.held,
                tuple((n.label, n.module, n.custom, n.items, n.nexts) for n in self.nodes),
                self.out, self.out_alloc, self.out_view, self.grad_input, self.assigns,
                self.scalars, self.end_delta)


def _saved_items(node: Any) -> Iterator[tuple[str, Any]]:
    """(label, tensor) for what ``node`` keeps, in :func:`record_savers`' order."""
    name = node.name()

    def saved(s: Any, label: str) -> Iterator[tuple[str, Any]]:
        if isinstance(s, (list, tuple)):
            for x in s:
                yield from saved(x, label)
            return
        if not isinstance(s, torch._C._autograd.SavedTensor):
            if isinstance(s, torch.Tensor):
                yield label, s
            return
        try:
            data = getattr(s, "data", None)
            hook = getattr(s, "unpack_hook", None)
        except RuntimeError:
            return
        if hook is not None and not isinstance(data, torch.Tensor):
            raise Refused("a saved tensor with hooks (checkpointing)")
        if _checkpoint_frame(hook) is not None:
            raise Refused("a checkpointed region")
        if isinstance(data, torch.Tensor):
            yield label, data

    def ctx(value: Any, label: str) -> Iterator[tuple[str, Any]]:
        if isinstance(value, torch.Tensor):
            yield label, value
        elif isinstance(value, (list, tuple)):
            for v in value:
                if isinstance(v, (torch.Tensor, list, tuple)):
                    yield from ctx(v, label)

    if isinstance(node, BackwardCFunction):
        yield from saved(node._raw_saved_tensors, name)
        for attr, value in vars(node).items():
            if isinstance(value, (torch.Tensor, list, tuple)):
                yield from ctx(value, f"{name}.{attr}")
    else:
        for attr in _saved_attrs(type(node)):
            try:
                value = getattr(node, attr)
            except RuntimeError:
                continue
            yield from saved(value, name)


def _output_spec(out: Any, found: list[torch.Tensor], depth: int = 0) -> tuple[Any, ...]:
    if isinstance(out, torch.Tensor):
        found.append(out)
        return ("t",)
    if out is None or isinstance(out, (bool, int, float, str)):
        return ("v", out)
    if depth < 2 and type(out) in (tuple, list):
        return ("seq", type(out), tuple(_output_spec(v, found, depth + 1) for v in out))
    raise Refused(f"the block returned a {type(out).__name__}")


def _rebuild(spec: tuple[Any, ...], t: torch.Tensor) -> Any:
    if spec[0] == "t":
        return t
    if spec[0] == "v":
        return spec[1]
    return spec[1](_rebuild(s, t) for s in spec[2])


def _slot_changes(mode: CountingFakeMode, root: Any, index: int | None,
                  slots: Any, before: list[tuple[Any, Any]], index_of: dict[int, int]
                  ) -> tuple[list[tuple[Any, int, tuple[Any, ...]]], list[tuple[Any, Any]]]:
    """The tensors and values the call put in its slot of the cache ``root``."""
    if root is None:
        return [], []
    post, _ = _state_leaves(mode, root, index, slots)
    old = dict(before)
    assigns: list[tuple[Any, int, tuple[Any, ...]]] = []
    scalars: list[tuple[Any, Any]] = []
    for path, v in post:
        prev = old.get(path)
        if isinstance(v, _TensorLeaf):
            now = v()
            if isinstance(prev, _TensorLeaf) and prev() is now:
                continue
            if prev is not None and not (isinstance(prev, tuple) or prev is None):
                raise Refused("the call replaced a value of the cache with a tensor")
            if isinstance(prev, _TensorLeaf):
                raise Refused("the call replaced a tensor of the cache")
            rec = mode.allocation_of(now) if now is not None else None
            if now is None or rec is None or id(rec) not in index_of:
                raise Refused("the cache holds a tensor the call did not make")
            assigns.append((path, index_of[id(rec)], _view(now)))
        elif isinstance(v, _Opaque):
            if not isinstance(prev, _Opaque) or prev.ident != v.ident:
                raise Refused("the cache's object changed")
        elif isinstance(v, tuple):
            if v != prev:
                raise Refused("the cache's containers changed")
        elif prev is None or v != prev or type(v) is not type(prev):
            if path[-1][0] != "a":
                raise Refused("the call changed the cache's layout")
            scalars.append((path, v))
    return assigns, scalars


def record_forward(mode: CountingFakeMode, block: nn.Module, prefix: str,
                   inputs: Mapping[str, Any], out: Any, start: Start, *, root: Any = None,
                   index: int | None = None, slots: Any = None,
                   before: list[tuple[Any, Any]] | None = None) -> ForwardRecord:
    """The record of a block call that began at ``start`` and returned ``out`` (raises
    :class:`Refused` where a replay could not repeat it exactly)."""
    t0, t1 = start.tick, mode.tick
    if len(mode.first_calls) != start.first_calls or mode.host_rng_copies != start.host_rng:
        raise Refused("a library's first call or an RNG copy in the call")
    internal = allocations_of_call(mode, start.allocs, t0, t1)
    index_of = {id(r): i for i, r in enumerate(internal)}
    found: list[torch.Tensor] = []
    spec = _output_spec(out, found)
    if len(found) != 1 or not found[0].requires_grad or found[0].layout is not torch.strided:
        raise Refused("the block's output is not one tensor that requires grad")
    output = found[0]
    out_rec = mode.allocation_of(output)
    if out_rec is None or id(out_rec) not in index_of:
        raise Refused("the block's output is not a storage it made")
    tensors = input_tensors(inputs, root)
    grad_inputs = [(p, t) for p, t in tensors if t.requires_grad]
    if len(grad_inputs) != 1:
        raise Refused("the block is not given exactly one input that requires grad")
    gin_path, gin = grad_inputs[0]
    exit_node = grad_edge(gin)[0]
    by_storage: dict[int, Target] = {}
    for p, t in tensors:
        if t.layout is torch.strided and isinstance(t, FakeTensor):
            by_storage.setdefault(t.untyped_storage()._cdata, ("in", p))
    input_recs = {id(mode.allocation_of(t)): ("in", p) for p, t in tensors
                  if t.layout is torch.strided and mode.allocation_of(t) is not None}
    owned = {id(p) for p in block.parameters()}
    for name, t in (*block.named_parameters(), *block.named_buffers()):
        if t.layout is torch.strided:
            by_storage.setdefault(t.untyped_storage()._cdata, ("p", name))

    def target(t: torch.Tensor) -> Target:
        if t.layout is not torch.strided or not isinstance(t, FakeTensor):
            raise Refused("a node keeps a tensor that is not a strided fake tensor")
        rec = mode.allocation_of(t)
        if rec is not None and id(rec) in index_of:
            return ("int", index_of[id(rec)])
        where = by_storage.get(t.untyped_storage()._cdata)
        if where is None:
            raise Refused("a node keeps a tensor from outside the block")
        return where

    seq0, seq1 = start.seq, torch._C._autograd._get_sequence_nr()
    entry = output.grad_fn
    if entry is None or not seq0 <= entry._sequence_nr() < seq1:
        raise Refused("the block's output was not made by the block")
    ids: dict[Any, int] = {entry: 0}
    order: list[Any] = [entry]
    specs: dict[int, NodeSpec] = {}
    held: dict[Target, int] = {}
    stack = [entry]
    exits = 0
    while stack:
        node = stack.pop()
        items = []
        for label, t in _saved_items(node):
            tgt = target(t)
            if tgt[0] != "p":
                held.setdefault(tgt, len(held))
            items.append((label, tgt))
        nexts: list[tuple[str, int]] = []
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            seq = nxt._sequence_nr()
            if nxt is exit_node:
                exits += 1
                nexts.append(("x", 0))
            elif seq == _ACCUMULATE:
                if id(getattr(nxt, "variable", None)) not in owned:
                    raise Refused("a gradient of a parameter outside the block")
            elif not seq0 <= seq < seq1:
                raise Refused("a node of the block leads outside it")
            else:
                if nxt not in ids:
                    ids[nxt] = len(order)
                    order.append(nxt)
                    stack.append(nxt)
                nexts.append(("n", ids[nxt]))
        custom = isinstance(node, BackwardCFunction)
        if custom and (node._forward_hooks if hasattr(node, "_forward_hooks") else False):
            raise Refused("a hook on a node")
        specs[ids[node]] = NodeSpec(node.name(), module_name(mode.module_of_node(node), prefix),
                                    custom, tuple(items), tuple(nexts))
    if not exits:
        raise Refused("the block's nodes do not lead to its input")
    keep = {tgt[1] for tgt in held if tgt[0] == "int"}
    out_alloc = index_of[id(out_rec)]
    assigns, scalars = _slot_changes(mode, root, index, slots, before or [], index_of)
    keep |= {i for _, i, _ in assigns}
    alive = {i for i, r in enumerate(internal) if r.freed < 0}
    if alive - keep - {out_alloc}:
        raise Refused("a storage the block made is kept outside its output and its nodes")
    if not keep | {out_alloc} <= alive:
        raise Refused("a kept storage freed in the call")
    if sum(internal[i].nbytes for i in alive) != mode.live_bytes - start.live_bytes:
        raise Refused("the call freed or resized a storage it did not make")
    allocs = []
    for r in internal:
        sources = []
        for s in r.sources:
            if id(s) in index_of:
                sources.append(("int", index_of[id(s)]))
            elif id(s) in input_recs:
                sources.append(input_recs[id(s)])
            else:
                raise Refused("a storage derives from a tensor outside the block")
        allocs.append(_fields(r, t0, prefix, tuple(sources)))
    ops, deltas, scratch = _ticks(mode, t0, t1, start.live_bytes)
    return ForwardRecord(
        ops, deltas, scratch, tuple(allocs), tuple(sorted(keep | {out_alloc})), tuple(held),
        tuple(specs[i] for i in range(len(order))), spec, out_alloc, _view(output),
        gin_path, tuple(assigns), tuple(scalars), mode.live_bytes - start.live_bytes)


# -- the backward --------------------------------------------------------------------------------


@dataclass
class BackwardRecord:
    """One real block's backward, as a replay needs it."""

    ops: tuple[Any, ...]
    deltas: tuple[int, ...]
    scratch: tuple[tuple[int, int, tuple[int, ...]], ...]
    allocs: tuple[tuple[Any, ...], ...]
    left: tuple[tuple[int, Any, tuple[Any, ...]], ...]
    """(allocation, parameter name or None for the input's gradient, view) of each storage
    the backward leaves."""
    drops: tuple[int, ...]
    """Per kept tensor (``ForwardRecord.held``): the tick it is let go at (-1: at the end)."""
    grad_view: tuple[Any, ...]
    incoming: bool
    """The input's gradient is the incoming gradient (accumulated into in place)."""
    end_delta: int

    def key(self) -> tuple[Any, ...]:
        return (self.ops, self.deltas, self.scratch, self.allocs, self.left, self.drops,
                self.grad_view, self.incoming, self.end_delta)


class BackwardWatch:
    """Records a real block's backward between two node pre-hooks (module docstring)."""

    def __init__(self, mode: CountingFakeMode, record: ForwardRecord, prefix: str,
                 block: nn.Module, held: list[Allocation], output: torch.Tensor,
                 gin: torch.Tensor, seqs: tuple[int, int],
                 done: Any) -> None:
        self.mode = mode
        self.record = record
        self.prefix = prefix
        self.params = list(block.named_parameters())
        self.held = held
        self.seqs = seqs
        self.done = done
        self.start: tuple[int, int, int, int] | None = None
        self.incoming: Allocation | None = None
        self.incoming_view: tuple[Any, ...] = ()
        self.grads: tuple[int, ...] = ()
        node, self.exit_nr = grad_edge(gin)
        assert output.grad_fn is not None
        self.handles = [output.grad_fn.register_prehook(self._entry),
                        node.register_prehook(self._exit)]

    def _entry(self, grads: tuple[Any, ...]) -> None:
        mode = self.mode
        if self.start is not None or mode.node_log is None:
            return
        self.start = (mode.tick, mode.live_bytes, len(mode.allocations), len(mode.node_log))
        g = grads[0] if grads else None
        if isinstance(g, FakeTensor) and g.layout is torch.strided:
            self.incoming = mode.allocation_of(g)
            self.incoming_view = _view(g)
        self.grads = tuple(id(p.grad) for _, p in self.params)

    def _exit(self, grads: tuple[Any, ...]) -> None:
        if self.start is None or not self.handles:
            return
        for h in self.handles:
            h.remove()
        self.handles = []
        try:
            record: BackwardRecord | str = self._record(grads)
        except Refused as exc:
            record = str(exc)
        self.done(self, record)

    def _record(self, grads: tuple[Any, ...]) -> BackwardRecord:
        mode = self.mode
        assert self.start is not None and mode.node_log is not None
        tb, live_b, ab, nb = self.start
        te = mode.tick
        lo, hi = self.seqs
        for tick, seq in mode.node_log[nb:]:
            # (a node that began at the last tick made no op before the hook: the bytes check)
            if tick < te and not (lo <= seq < hi or seq == _ACCUMULATE):
                raise Refused("another node ran during the block's backward")
        del mode.node_log[nb:]
        internal = mode.allocations[ab:]
        index_of = {id(r): i for i, r in enumerate(internal)}
        g = grads[self.exit_nr] if self.exit_nr < len(grads) else None
        if not isinstance(g, FakeTensor) or g.layout is not torch.strided:
            raise Refused("the input's gradient is not a strided fake tensor")
        left: list[tuple[int, Any, tuple[Any, ...]]] = []
        grad_rec = mode.allocation_of(g)
        incoming = grad_rec is not None and grad_rec is self.incoming
        if incoming:
            if _view(g) != self.incoming_view:
                raise Refused("the input's gradient is another view of the incoming one")
        elif grad_rec is None or id(grad_rec) not in index_of:
            raise Refused("the input's gradient was not made by the block's backward")
        else:
            left.append((index_of[id(grad_rec)], None, _view(g)))
        for (name, p), before in zip(self.params, self.grads, strict=True):
            if id(p.grad) == before:
                continue
            grad = p.grad
            rec = mode.allocation_of(grad) if grad is not None else None
            if grad is None or rec is None or id(rec) not in index_of:
                raise Refused("a parameter's gradient the backward did not make")
            left.append((index_of[id(rec)], name, _view(grad)))
        kept = {i for i, _, _ in left}
        for i, r in enumerate(internal):
            if r.freed < 0 and i not in kept:
                raise Refused("a storage the backward made outlives it elsewhere")
        if self.incoming is not None and 0 <= self.incoming.freed < te:
            raise Refused("the incoming gradient is freed before the backward's last op")
        drops = []
        freed = 0
        for rec in self.held:
            if rec.freed < 0:
                drops.append(-1)
            elif tb <= rec.freed <= te:
                drops.append(rec.freed - tb)
                freed += rec.nbytes
            else:
                raise Refused("a kept tensor was freed before the block's backward")
        if self.incoming is not None and self.incoming.freed == te and not incoming:
            freed += self.incoming.nbytes
        made = sum(r.nbytes for r in internal if r.freed < 0)
        if mode.live_bytes - live_b != made - freed:
            raise Refused("the bytes of the block's backward do not add up")
        allocs = tuple(_fields(r, tb, self.prefix, ()) for r in internal)
        if any(r.sources for r in internal):
            raise Refused("a backward storage with sources")
        ops, deltas, scratch = _ticks(mode, tb, te, live_b)
        return BackwardRecord(ops, deltas, scratch, allocs, tuple(left), tuple(drops),
                              _view(g), incoming, mode.live_bytes - live_b)


# -- replaying -----------------------------------------------------------------------------------


class _Held:
    """What a replayed block keeps for its backward (not a list: ``record_savers`` reads a
    custom node's list attributes as kept tensors)."""

    __slots__ = ("tensors",)

    def __init__(self) -> None:
        self.tensors: dict[int, torch.Tensor] = {}


class _Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, block: ReplayedBlock, gin: torch.Tensor) -> torch.Tensor:
        block.mode.counting = True
        try:
            out = block.forward_replay()
        finally:
            block.mode.counting = False
        setattr(ctx, VIRTUAL_GRAPH, block.entry)
        ctx.modelsize_block = block
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        block = ctx.modelsize_block
        ctx.modelsize_block = None
        return None, block.backward_replay(grad)


class Mismatch(Exception):
    """A replayed block did not end as its record says."""


class ReplayedBlock:
    """One block call replayed from a :class:`ForwardRecord`; its backward from the
    template's :class:`BackwardRecord` (got through ``backward_of``)."""

    def __init__(self, mode: CountingFakeMode, record: ForwardRecord, block: nn.Module,
                 prefix: str, inputs: Mapping[str, Any], backward_of: Any, *,
                 root: Any = None, index: int | None = None) -> None:
        self.mode = mode
        self.root = root
        self.index = index
        self.record = record
        self.prefix = prefix
        self.params = dict(block.named_parameters())
        self.block: nn.Module | None = block
        self.inputs = inputs
        self.backward_of = backward_of
        self.held = _Held()
        self.recs: list[Allocation] = []
        self.entry: VirtualNode | None = None

    def run(self) -> Any:
        """The block's output, its node standing for the block's nodes."""
        record = self.record
        gin = get(self.inputs, record.grad_input)
        try:
            exit_node = grad_edge(gin)[0]
        except Refused as exc:
            raise Mismatch(str(exc)) from None
        params = self.params
        assert self.block is not None
        buffers: dict[str, torch.Tensor] = dict(self.block.named_buffers())
        nodes = [VirtualNode(n.label, module_name_for(n.module, self.prefix), n.custom,
                             self._items(n.items, buffers)) for n in record.nodes]
        for vn, spec in zip(nodes, record.nodes, strict=True):
            vn.nexts = [exit_node if kind == "x" else nodes[i] for kind, i in spec.nexts]
        self.entry = nodes[0]
        del params
        # what autograd dispatches around the Function (an alias of its output) is no op of
        # the block's
        self.mode.counting = False
        try:
            out = _Function.apply(self, gin)
        finally:
            self.mode.counting = True
        self.inputs = {}
        self.root = None
        self.block = None
        return _rebuild(record.out, out)

    def _items(self, items: tuple[tuple[str, Target], ...],
               buffers: dict[str, torch.Tensor]) -> Any:
        held = self.held
        index = {t: i for i, t in enumerate(self.record.held)}
        named = {**self.params, **buffers}

        def resolve() -> Iterator[tuple[str, Any]]:
            for label, tgt in items:
                if tgt[0] == "p":
                    yield label, named[tgt[1]]
                else:
                    kept = held.tensors.get(index[tgt])
                    if kept is not None:
                        yield label, kept

        return resolve

    def forward_replay(self) -> torch.Tensor:
        mode, record = self.mode, self.record
        t0, start = mode.tick, mode.live_bytes
        views: dict[int, list[tuple[Any, ...]]] = {k: [] for k in record.materialized}
        views[record.out_alloc].append(record.out_view)
        for _, k, view in record.assigns:
            views[k].append(view)
        recs: list[Allocation] = []
        held_index = {t: i for i, t in enumerate(record.held)}
        made: dict[int, list[torch.Tensor]] = {}
        for tgt, i in held_index.items():
            if tgt[0] == "in":
                self.held.tensors[i] = get(self.inputs, tgt[1])
        scratch = {j: (e, p) for j, e, p in record.scratch}
        k = 0
        allocs = record.allocs
        for j in range(1, len(record.ops) + 1):
            _advance(mode, record.ops, record.deltas, scratch, start, j)
            while k < len(allocs) and allocs[k][0] == j:
                f = allocs[k]
                sources = tuple(recs[s[1]] if s[0] == "int"
                                else mode.allocation_of(get(self.inputs, s[1]))
                                for s in f[10])
                if k in views:
                    made[k] = _storages(mode, f[2], views[k])
                    rec = _new_record(mode, f, t0, self.prefix, sources,  # type: ignore[arg-type]
                                      mode.track(made[k][0], f[3]))
                else:
                    rec = _new_record(mode, f, t0, self.prefix, sources)  # type: ignore[arg-type]
                recs.append(rec)
                k += 1
        if k != len(allocs):
            raise Mismatch("a replay did not place every allocation")
        for tgt, i in held_index.items():
            if tgt[0] == "int":
                self.held.tensors[i] = made[tgt[1]][0]
        out = made[record.out_alloc][0]
        used = {record.out_alloc: 1}
        for path, k, _ in record.assigns:
            n = used.get(k, 0)
            used[k] = n + 1
            put(self.root, denormalize(path, self.index), made[k][n])
        for path, value in record.scalars:
            put(self.root, denormalize(path, self.index), value)
        del made
        if mode.live_bytes - start != record.end_delta:
            raise Mismatch("a replayed block did not end with the recorded live bytes")
        return out

    def backward_replay(self, grad: torch.Tensor) -> torch.Tensor:
        mode = self.mode
        bwd = self.backward_of()
        held = self.held.tensors
        t0, start = mode.tick, mode.live_bytes
        drops: dict[int, list[int]] = {}
        for i, at in enumerate(bwd.drops):
            drops.setdefault(at, []).append(i)
        for i in drops.get(0, ()):
            held.pop(i, None)
        scratch = {j: (e, p) for j, e, p in bwd.scratch}
        left = {i: (name, view) for i, name, view in bwd.left}
        made: dict[int, torch.Tensor] = {}
        k = 0
        allocs = bwd.allocs
        for j in range(1, len(bwd.ops) + 1):
            _advance(mode, bwd.ops, bwd.deltas, scratch, start, j)
            while k < len(allocs) and allocs[k][0] == j:
                f = allocs[k]
                if k in left:
                    t = _storages(mode, f[2], [left[k][1]])[0]
                    made[k] = t
                    _new_record(mode, f, t0, self.prefix, (), mode.track(t, f[3]))
                else:
                    _new_record(mode, f, t0, self.prefix, ())
                k += 1
            for i in drops.get(j, ()):
                held.pop(i, None)
        if k != len(allocs):
            raise Mismatch("a replayed backward did not place every allocation")
        out = grad
        if bwd.incoming and _view(grad) != bwd.grad_view:
            raise Mismatch("the incoming gradient is not the recorded one")
        for i, (name, _) in left.items():
            if name is None:
                out = made[i]
            else:
                self.params[name].grad = made[i]
        held.clear()
        del made
        self.params = {}
        return out


@dataclass
class TrainTemplate:
    """The records of one kind of block call in one forward."""

    forward: ForwardRecord
    confirmed: bool = False
    pending: list[str] = field(default_factory=list)
    backward: list[BackwardRecord] = field(default_factory=list)
    backward_template: BackwardRecord | None = None
    backward_pending: list[str] = field(default_factory=list)
    failed: str = ""
