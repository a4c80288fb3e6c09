"""Repeated blocks traced once: the decoder layers of a forward replayed from their twins.

A transformer's forward calls the same block class once per layer (80 times for a 70B
Llama), on inputs of the same shapes, each layer updating its own slot of the cache. Where
two blocks are the same (class, parameter and buffer shapes, dtypes and strides, every
attribute of every submodule but the layer's index: values compared, other objects by
identity; no hook inside) and are given the same
(the shapes, dtypes and storage sharing of every input, and of their slot of the cache), they
allocate the same bytes at the same ticks. So within one forward (one phase of the trace),
:class:`BlockReplay` runs the first two calls of each such block for real and records them
(:mod:`modelsize.estimation.segments`, with the layer's index and name abstracted); when the
two records are equal, the next calls are replayed from them: the same ticks and records,
under the replayed layer's module names, and the cache slot's new tensors made and put in the
replayed layer's own slot (``cache.layers[i]``). The last block of each kind in its list runs
for real and must equal the records, or the trace runs again without block replay
(:class:`BlockRetrace`). A block whose structure or inputs differ (sliding and full
attention layers, MoE and dense layers, the first layer's relative attention bias) has a
different signature and its own records.

What the check of the last block cannot see is excluded beforehand, never guessed: a block
whose code (any method of its modules' classes but ``__init__``) uses its index for anything
but addressing the cache (``if self.layer_idx == 3``, ``config.layer_types[self.layer_idx]``
read in ``forward``) always runs for real (:func:`index_uses`), and so does a block whose
call forgets a real value (the trace's :class:`~modelsize.estimation.trace.RealValues`:
a tensor with a value written in place; a replay would not forget it). Inputs with real
values are part of a call's key by the identity of their value: a block replayed from
another was given the same values (the same mask, the same positions).

Blocks are the children of every ``nn.ModuleList`` of three or more modules. Only calls under
``no_grad`` are replayed (a training step's blocks keep their autograd graph), and only where
the block's cache slot is found by its index attribute (``layer_idx``).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import textwrap
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from modelsize.estimation import train_replay
from modelsize.estimation.segments import (
    Mismatch,
    Path,
    Recorder,
    Refused,
    Segment,
    replay,
    slots_of,
)
from modelsize.estimation.tracker import CountingFakeMode, FunctionModesOff, Origin

#: Attribute names that hold a block's index (its slot in the cache).
INDEX_NAMES = frozenset({"layer_idx", "layer_id", "layer_index", "layer_number", "block_idx"})


class BlockRetrace(Exception):
    """A block run for real differed from the records it was replayed from."""


@dataclass
class _Block:
    """What is fixed about one block: where it is and what it is."""

    name: str
    index: int | None
    signature: tuple[Any, ...]
    last: bool
    """The last block of its signature in its list (always run for real, as a check)."""
    refused: str = ""
    """Why the block always runs for real ("" where it may be replayed)."""
    tail: int = 0
    """How many blocks of its signature follow it in its list."""


@dataclass
class _Template:
    first: Segment
    confirmed: bool = False
    pending: list[str] = field(default_factory=list)
    """Blocks replayed since the last real check."""
    keep: list[Any] = field(default_factory=list)
    """The real values the key names by identity."""


@dataclass
class BlockSummary:
    """How many block calls ran for real and how many were replayed."""

    real: int = 0
    replayed: int = 0
    refused: list[str] = field(default_factory=list)
    """Why blocks were never replayed (their code uses their index)."""

    def describe(self) -> str:
        """One line for the estimate."""
        refused = f" (traced: {'; '.join(self.refused)})" if self.refused else ""
        if not self.replayed:
            return f"no repeated block replayed{refused}" if refused else ""
        return (f"{self.replayed} of {self.real + self.replayed} repeated-block calls "
                f"replayed from identical ones{refused}")


#: Names a module's code gives its cache object: the only things the layer index may address.
_CACHE_WORDS = ("cache", "past")


def _root_name(node: ast.expr) -> str:
    """The name an attribute or subscript chain starts from (``past_key_values`` for
    ``past_key_values.layers[i].keys``), or ""."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else ""


def _addresses_cache(node: ast.expr) -> bool:
    root = _root_name(node).lower()
    return any(w in root for w in _CACHE_WORDS)


_INDEX_USES: dict[type, str] = {}


def index_uses(cls: type) -> str:
    """Where the code of ``cls`` (its methods but ``__init__``, through its bases up to
    ``nn.Module``) uses a layer index for anything but addressing the cache
    (``past_key_values.update(k, v, self.layer_idx)``, ``cache_params.conv_states[
    self.layer_idx]``): "" where nowhere, else the first such use. Code that cannot be read
    counts as such a use: a block whose behaviour may depend on its index is never replayed
    from another's record."""
    if cls not in _INDEX_USES:
        _INDEX_USES[cls] = _index_uses(cls)
    return _INDEX_USES[cls]


def _index_uses(cls: type) -> str:
    for base in cls.__mro__:
        if base in (nn.Module, object) or base.__module__.startswith("torch."):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(base)))
        except (OSError, TypeError, SyntaxError):
            return f"the source of {base.__qualname__} cannot be read"
        parents: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                parents[child] = node
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr in INDEX_NAMES):
                continue
            if isinstance(node.ctx, ast.Store):
                continue
            scope = parents.get(node)
            while scope is not None and not isinstance(scope, (ast.FunctionDef,
                                                               ast.AsyncFunctionDef)):
                scope = parents.get(scope)
            if isinstance(scope, ast.FunctionDef) and scope.name == "__init__":
                continue
            parent = parents.get(node)
            if isinstance(parent, ast.keyword):
                parent = parents.get(parent)
            if isinstance(parent, ast.Call) and node is not parent.func \
                    and isinstance(parent.func, ast.Attribute) and _addresses_cache(parent.func):
                continue
            if isinstance(parent, ast.Subscript) and parent.slice is node \
                    and _addresses_cache(parent.value):
                continue
            return f"{base.__qualname__} uses .{node.attr} (line {node.lineno} of its source)"
    return ""


def _saved_tensor_hooks() -> bool:
    """Whether saved-tensor hooks are on (a checkpointed region, offloading)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(False) is not None


def find_cache(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    """The transformers cache a block is given, if any (under whatever name)."""
    for v in (*args, *kwargs.values()):
        if any(c.__name__ == "Cache" and c.__module__.startswith("transformers")
               for c in type(v).__mro__):
            return v
    return None


def _plain(v: Any) -> bool:
    return isinstance(v, (int, float, str, bool, torch.dtype, torch.device)) or v is None


#: Marks the ``forward`` wrappers :class:`BlockReplay` installs (not part of a signature).
_WRAPPER = "_modelsize_block_wrapper"
#: The attributes every ``nn.Module`` has (hooks, parameters, submodules: compared apart).
_MODULE_INTERNALS = frozenset(vars(nn.Module())) - {"training"}


def _attribute(v: Any) -> Any:
    """What two blocks' attribute must share for them to be the same: a value, a tensor's
    shape and dtype, a function itself; any other object its identity (a config shared by
    every layer is one object; per-layer objects keep the layers apart)."""
    if _plain(v):
        return v
    if isinstance(v, torch.Tensor):
        return ("tensor", tuple(v.shape), tuple(v.stride()), v.dtype)
    if isinstance(v, (list, tuple)) and all(_plain(x) for x in v):
        return (type(v), tuple(v))
    if isinstance(v, dict) and all(isinstance(k, str) and _plain(x) for k, x in v.items()):
        return (dict, tuple(sorted(v.items())))
    if isinstance(v, functools.partial):
        return ("partial", _attribute(v.func), _attribute(v.args), _attribute(v.keywords))
    if isinstance(v, (types.FunctionType, types.BuiltinFunctionType)):
        return v
    return ("object", type(v), id(v))


def _signature(block: nn.Module) -> tuple[tuple[Any, ...], int | None, str]:
    """A block's static signature, its index (None where none or several are found), and why
    it is never replayed ("" where it may be: its code uses no index but to address the
    cache, see :func:`index_uses`, and no hook is inside it)."""
    items: list[Any] = [type(block)]
    indices: set[int] = set()
    for rel, m in block.named_modules():
        why = index_uses(type(m))
        if why:
            return (), None, why
        if m is not block and bool(m._forward_hooks or m._forward_pre_hooks
                                   or m._backward_hooks or m._backward_pre_hooks):
            return (), None, f"a hook on {type(m).__name__} inside the block"
        attrs: list[Any] = []
        for k, v in vars(m).items():
            if k in INDEX_NAMES and isinstance(v, int):
                indices.add(v)
            elif k not in _MODULE_INTERNALS and not getattr(v, _WRAPPER, False):
                attrs.append((k, _attribute(v)))
        params = tuple((n, tuple(p.shape), tuple(p.stride()), p.dtype, p.requires_grad)
                       for n, p in m._parameters.items() if p is not None)
        buffers = tuple((n, tuple(b.shape), tuple(b.stride()), b.dtype)
                        for n, b in m._buffers.items() if b is not None)
        items.append((rel, type(m), tuple(attrs), params, buffers))
    index = next(iter(indices)) if len(indices) == 1 else None
    return tuple(items), index, ""


#: A real value of at most this many bytes is compared by its bytes, a larger one by identity.
_VALUE_BYTES = 4096


def _value_key(v: torch.Tensor) -> Any:
    if v.layout is torch.strided and v.nbytes <= _VALUE_BYTES:
        with _disable_current_modes():  # real tensors: nothing reaches the counting mode
            data = v.detach().contiguous().reshape(-1).view(torch.uint8)
            return (v.dtype, tuple(v.shape), bytes(data.numpy()))
    return ("id", id(v))


class BlockReplay:
    """Wraps every repeated block's ``forward`` (see the module docstring)."""

    def __init__(self, mode: CountingFakeMode, model: nn.Module, *, values: Any = None,
                 cache_of: Callable[[tuple[Any, ...], Mapping[str, Any]], Any] | None = None,
                 enabled: bool = True, training: bool = False) -> None:
        self.mode = mode
        self.training = training
        self.train_templates: dict[Any, train_replay.TrainTemplate] = {}
        self.model = model
        self.values = values
        self.cache_of = cache_of or (lambda args, kwargs: None)
        self.enabled = enabled
        self.recorder = Recorder(mode, values)
        self.templates: dict[Any, _Template] = {}
        self.blocks: dict[int, _Block] = {}
        self.slots: dict[Any, tuple[Path, ...]] = {}  # (phase, signature) -> cache slots
        self.summary = BlockSummary()
        self.value_events = 0
        self.phase = -1

    def _lists(self) -> list[tuple[str, nn.ModuleList]]:
        return [(name, m) for name, m in self.model.named_modules()
                if isinstance(m, nn.ModuleList) and len(m) >= 3]

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Every repeated block's ``forward`` goes through :meth:`call` for the block."""
        if not self.enabled:
            yield
            return
        wrapped: list[tuple[nn.Module, bool, Any]] = []
        watched = self._watch_values()
        if self.training:
            self.mode.node_log = []
        try:
            for list_name, blocks in self._lists():
                for block in blocks:
                    had = "forward" in vars(block)
                    original = block.forward

                    @functools.wraps(original)
                    def forward(*args: Any, __block: nn.Module = block, __name: str = list_name,
                                __list: nn.ModuleList = blocks, __orig: Any = original,
                                **kwargs: Any) -> Any:
                        return self.call(__block, __name, __list, __orig, args, kwargs)

                    setattr(forward, _WRAPPER, True)
                    vars(block)["forward"] = forward
                    wrapped.append((block, had, original))
            yield
        finally:
            self.mode.node_log = None
            for name in watched:
                del vars(self.values)[name]
            for block, had, original in reversed(wrapped):
                if had:
                    vars(block)["forward"] = original
                else:
                    del vars(block)["forward"]

    def _watch_values(self) -> list[str]:
        """Count the real values the real-values mode forgets (a tensor with a value written
        in place): a replay would not forget them, so a block call that does is never a
        record to replay from. Returns the names of the methods wrapped."""
        values = self.values
        method = getattr(values, "_forget", None)
        if method is None or "_forget" in vars(values):
            return []

        def forget(t: torch.Tensor) -> None:
            n = len(values.values)
            method(t)
            if len(values.values) != n:
                self.value_events += 1

        vars(values)["_forget"] = forget
        return ["_forget"]

    def _valued(self, entry: Any) -> tuple[tuple[Any, ...], list[Any]]:
        """The inputs and state leaves of a call that have real values, each by its value
        (a small one) or the identity of its value (kept alive in the returned list, so that
        no identity is reused): two calls replayed one from the other were given the same
        values, so the values the block computes from them, and anything it decides on
        them, are the same."""
        value_of = getattr(self.values, "value_of", None)
        if value_of is None:
            return (), []
        key: list[Any] = []
        keep: list[Any] = []
        for n, (_, leaf) in enumerate((*entry.inputs, *entry.state)):
            t = leaf() if callable(leaf) and not isinstance(leaf, torch.Tensor) else leaf
            if isinstance(t, torch.Tensor):
                v = value_of(t)
                if v is not None:
                    key.append((n, _value_key(v)))
                    keep.append(v)
        return tuple(key), keep

    def _block(self, block: nn.Module, list_name: str, blocks: nn.ModuleList) -> _Block:
        """The block's name, index and signature (worked out for its whole list at once)."""
        info = self.blocks.get(id(block))
        if info is None:
            signatures = [_signature(b) for b in blocks]
            for pos, (b, (sig, index, why)) in enumerate(zip(blocks, signatures, strict=True)):
                tail = sum(1 for s, _, _ in signatures[pos + 1:] if s == sig)
                name = f"{list_name}.{pos}" if list_name else str(pos)
                self.blocks[id(b)] = _Block(name, index, sig, not tail, why, tail)
                if why and why not in self.summary.refused:
                    self.summary.refused.append(why)
            info = self.blocks[id(block)]
        return info

    def call(self, block: nn.Module, list_name: str, blocks: nn.ModuleList,
             original: Callable[..., Any], args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> Any:
        """One block call, run for real (and recorded) or replayed."""
        mode = self.mode
        if torch.is_grad_enabled() and self.training:
            return self._train_call(block, list_name, blocks, original, args, kwargs)
        if torch.is_grad_enabled() or mode.depth or not mode.counting:
            return original(*args, **kwargs)
        info = self._block(block, list_name, blocks)
        cache = self.cache_of(args, kwargs)
        if info.refused or (cache is not None and info.index is None):
            return original(*args, **kwargs)
        inputs = {"args": args, "kwargs": kwargs}
        phase = len(mode.phases)
        if phase != self.phase:  # records are per phase: the last one's are done with
            self.finish()
            self.templates.clear()
            self.slots.clear()
            self.phase = phase
        with FunctionModesOff():
            entry = self.recorder.enter(inputs, cache, index=info.index, full=False,
                                        slots=self.slots.get((phase, info.signature)))
            pre, pre_shape = self.recorder.pre(entry)
            valued, keep = self._valued(entry)
            del entry
        key = (phase, info.signature, pre_shape, tuple(pre), valued)
        template = self.templates.get(key)
        if template is not None and template.confirmed and not info.last:
            plan = template.first.plan
            assert plan is not None
            try:
                with FunctionModesOff():
                    out = replay(mode, plan, template.first.body, inputs=inputs, root=cache,
                                 index=info.index, prefix=info.name, values=self.values)
            except Mismatch as exc:
                raise BlockRetrace(f"{info.name}: {exc}") from None
            template.pending.append(info.name)
            self.summary.replayed += 1
            return out
        modules = list(block.modules())
        with FunctionModesOff():
            entry = self.recorder.enter(inputs, cache, index=info.index, modules=modules)
        events = self.value_events
        out = original(*args, **kwargs)
        with FunctionModesOff():
            segment = self.recorder.record(entry, cache, out, index=info.index,
                                           prefix=info.name, modules=modules)
        del entry
        self.summary.real += 1
        if self.value_events != events:
            why = f"{type(block).__name__} writes into a tensor with a real value"
            if why not in self.summary.refused:
                self.summary.refused.append(why)
            segment.refused = why
        if segment.refused:
            if template is not None and template.pending:
                raise BlockRetrace(f"{info.name} cannot be compared with the blocks replayed "
                                   f"before it: {segment.refused}")
            return out
        if template is None:
            self.templates[key] = _Template(segment, keep=keep)
            if cache is not None and info.index is not None:
                self.slots.setdefault((phase, info.signature), slots_of(cache, info.index))
        elif not template.confirmed:
            template.confirmed = segment.same_as(template.first)
        elif not segment.same_as(template.first):
            if template.pending:
                raise BlockRetrace(f"{info.name} differs from the blocks replayed before it "
                                   f"({template.pending[0]}...)")
        else:
            template.pending.clear()
        return out

    def _train_call(self, block: nn.Module, list_name: str, blocks: nn.ModuleList,
                    original: Callable[..., Any], args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
        """One block call of a training forward (train_replay's docstring)."""
        mode = self.mode
        current = mode.phases[-1] if mode.phases else None
        if (mode.depth or not mode.counting or current is None or current.name != "forward"
                or mode.origin is not Origin.FORWARD or _saved_tensor_hooks()):
            return original(*args, **kwargs)
        info = self._block(block, list_name, blocks)
        cache = self.cache_of(args, kwargs)
        if info.refused or (cache is not None and info.index is None):
            return original(*args, **kwargs)
        inputs = {"args": args, "kwargs": kwargs}
        phase = len(mode.phases)
        if phase != self.phase:
            self.finish()
            self.templates.clear()
            self.train_templates.clear()
            self.slots.clear()
            self.phase = phase
        slots = self.slots.get((phase, info.signature))
        with FunctionModesOff():
            entry = self.recorder.enter(inputs, cache, index=info.index, full=False,
                                        slots=slots)
            pre, pre_shape = self.recorder.pre(entry)
            valued, _keep = self._valued(entry)
            before = entry.state
            del entry
            params = list(block.parameters())
            grads = tuple(p.grad is None for p in params)
        key = ("train", phase, info.signature, pre_shape, tuple(pre), valued, grads)
        tpl = self.train_templates.get(key)
        if tpl is not None and tpl.confirmed and info.tail >= 3:
            replayed = train_replay.ReplayedBlock(
                mode, tpl.forward, block, info.name, inputs,
                functools.partial(self._backward_of, tpl, info.name), root=cache,
                index=info.index)
            try:
                with FunctionModesOff():
                    out = replayed.run()
            except train_replay.Mismatch as exc:
                raise BlockRetrace(f"{info.name}: {exc}") from None
            tpl.pending.append(info.name)
            self.summary.replayed += 1
            return out
        start = train_replay.Start.of(mode, params)
        events = self.value_events
        out = original(*args, **kwargs)
        self.summary.real += 1
        try:
            if self.value_events != events:
                raise Refused(f"{type(block).__name__} writes into a tensor with a real value")
            with FunctionModesOff():
                rec = train_replay.record_forward(mode, block, info.name, inputs, out, start,
                                                  root=cache, index=info.index, slots=slots,
                                                  before=before)
        except Refused as exc:
            why = f"{type(block).__name__}: {exc}"
            if why not in self.summary.refused:
                self.summary.refused.append(why)
            if tpl is not None and tpl.pending:
                raise BlockRetrace(f"{info.name} cannot be compared with the blocks replayed "
                                   f"before it: {exc}") from None
            return out
        if tpl is None:
            tpl = self.train_templates[key] = train_replay.TrainTemplate(rec)
            if cache is not None and info.index is not None:
                self.slots.setdefault((phase, info.signature), slots_of(cache, info.index))
        elif not tpl.confirmed:
            tpl.confirmed = rec.key() == tpl.forward.key()
            tpl.forward = rec
        elif rec.key() != tpl.forward.key():
            if tpl.pending:
                raise BlockRetrace(f"{info.name} differs from the blocks replayed before it "
                                   f"({tpl.pending[0]}...)")
        else:
            tpl.pending.clear()
        self._watch_backward(tpl, rec, block, info.name, inputs, out, start)
        return out

    def _watch_backward(self, tpl: train_replay.TrainTemplate,
                        rec: train_replay.ForwardRecord, block: nn.Module, name: str,
                        inputs: Mapping[str, Any], out: Any,
                        start: train_replay.Start) -> None:
        """Record the backward of a block that ran for real (its twins replay it)."""
        mode = self.mode
        found: list[torch.Tensor] = []
        train_replay._output_spec(out, found)
        segments_get = train_replay.get
        held = []
        for tgt in rec.held:
            if tgt[0] == "int":
                held.append(mode.allocations[start.allocs + tgt[1]])
            else:
                r = mode.allocation_of(segments_get(inputs, tgt[1]))
                assert r is not None
                held.append(r)
        seqs = (start.seq, torch._C._autograd._get_sequence_nr())

        def done(watch: train_replay.BackwardWatch,
                 record: train_replay.BackwardRecord | str) -> None:
            self._backward_done(tpl, name, record)

        train_replay.BackwardWatch(mode, rec, name, block, held, found[0],
                                   segments_get(inputs, rec.grad_input), seqs, done)

    def _backward_done(self, tpl: train_replay.TrainTemplate, name: str,
                       record: train_replay.BackwardRecord | str) -> None:
        if isinstance(record, str):
            if tpl.backward_pending and not tpl.failed:
                tpl.failed = f"{name}'s backward cannot be compared: {record}"
            tpl.backward.clear()
            return
        if tpl.backward_template is None:
            if tpl.backward and tpl.backward[-1].key() == record.key():
                tpl.backward_template = record
            tpl.backward[:] = [record]
        elif record.key() != tpl.backward_template.key():
            if tpl.backward_pending and not tpl.failed:
                tpl.failed = (f"{name}'s backward differs from the replayed ones "
                              f"({tpl.backward_pending[0]}...)")
        else:
            tpl.backward_pending.clear()

    def _backward_of(self, tpl: train_replay.TrainTemplate,
                     name: str) -> train_replay.BackwardRecord:
        if tpl.backward_template is None:
            raise BlockRetrace(f"{name}: no backward of a real twin to replay")
        tpl.backward_pending.append(name)
        return tpl.backward_template

    def finish_backward(self) -> None:
        """Replayed forwards and backwards that no real block confirmed: trace again."""
        for tpl in self.train_templates.values():
            if tpl.failed:
                raise BlockRetrace(tpl.failed)
            if tpl.pending or tpl.backward_pending:
                names = tpl.pending or tpl.backward_pending
                raise BlockRetrace(f"{names[0]} and the blocks replayed with it were never "
                                   "confirmed by a real one")

    def finish(self) -> None:
        """Replayed blocks that no real one confirmed: the trace runs again without them."""
        for template in self.templates.values():
            if template.pending:
                raise BlockRetrace(f"{template.pending[0]} and the blocks replayed with it "
                                   "were never confirmed by a real one")
