"""Repeated blocks traced once: the decoder layers of a forward replayed from their twins.

A transformer's forward calls the same block class once per layer (80 times for a 70B
Llama), on inputs of the same shapes, each layer updating its own slot of the cache. Where
two blocks are the same (class, parameter and buffer shapes, dtypes and strides, every plain
attribute of every submodule but the layer's index, no hook inside) and are given the same
(the shapes, dtypes and storage sharing of every input, and of their slot of the cache), they
allocate the same bytes at the same ticks. So within one forward (one phase of the trace),
:class:`BlockReplay` runs the first two calls of each such block for real and records them
(:mod:`modelsize.estimation.segments`, with the layer's index and name abstracted); when the
two records are equal, the next calls are replayed from them: the same ticks and records,
under the replayed layer's module names, and the cache slot's new tensors made and put in the
replayed layer's own slot (``cache.layers[i]``). The last block of each kind in its list runs
for real and must equal the records, or the trace runs again without block replay
(:class:`~modelsize.estimation.decode_replay.Retrace`). A block whose structure or inputs
differ (sliding and full attention layers, MoE and dense layers, the first layer's relative
attention bias) has a different signature and its own records.

Blocks are the children of every ``nn.ModuleList`` of three or more modules. Only calls under
``no_grad`` are replayed (a training step's blocks keep their autograd graph), and only where
the block's cache slot is found by its index attribute (``layer_idx``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from modelsize.estimation.segments import Mismatch, Path, Recorder, Segment, replay, slots_of
from modelsize.estimation.tracker import CountingFakeMode

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


@dataclass
class _Template:
    first: Segment
    confirmed: bool = False
    pending: list[str] = field(default_factory=list)
    """Blocks replayed since the last real check."""


@dataclass
class BlockSummary:
    """How many block calls ran for real and how many were replayed."""

    real: int = 0
    replayed: int = 0

    def describe(self) -> str:
        """One line for the estimate."""
        if not self.replayed:
            return ""
        return (f"{self.replayed} of {self.real + self.replayed} repeated-block calls "
                "replayed from identical ones")


def _signature(block: nn.Module) -> tuple[tuple[Any, ...], int | None]:
    """A block's static signature, and its index (None where none or several are found)."""
    items: list[Any] = [type(block)]
    indices: set[int] = set()
    for rel, m in block.named_modules():
        hooked = m is not block and bool(m._forward_hooks or m._forward_pre_hooks
                                         or m._backward_hooks or m._backward_pre_hooks)
        attrs: list[Any] = []
        for k, v in vars(m).items():
            if k in INDEX_NAMES and isinstance(v, int):
                indices.add(v)
            elif isinstance(v, (int, float, str, bool)) or v is None:
                attrs.append((k, v))
            elif isinstance(v, torch.Tensor):
                attrs.append((k, tuple(v.shape), v.dtype))
        params = tuple((n, tuple(p.shape), tuple(p.stride()), p.dtype, p.requires_grad)
                       for n, p in m._parameters.items() if p is not None)
        buffers = tuple((n, tuple(b.shape), tuple(b.stride()), b.dtype)
                        for n, b in m._buffers.items() if b is not None)
        items.append((rel, type(m), hooked, tuple(attrs), params, buffers))
    index = next(iter(indices)) if len(indices) == 1 else None
    return tuple(items), index


class BlockReplay:
    """Wraps every repeated block's ``forward`` (see the module docstring)."""

    def __init__(self, mode: CountingFakeMode, model: nn.Module, *, values: Any = None,
                 cache_of: Callable[[Mapping[str, Any]], Any] | None = None,
                 enabled: bool = True) -> None:
        self.mode = mode
        self.model = model
        self.values = values
        self.cache_of = cache_of or (lambda kwargs: None)
        self.enabled = enabled
        self.recorder = Recorder(mode, values)
        self.templates: dict[Any, _Template] = {}
        self.blocks: dict[int, _Block] = {}
        self.slots: dict[Any, tuple[Path, ...]] = {}  # (phase, signature) -> cache slots
        self.summary = BlockSummary()

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

                    vars(block)["forward"] = forward
                    wrapped.append((block, had, original))
            yield
        finally:
            for block, had, original in reversed(wrapped):
                if had:
                    vars(block)["forward"] = original
                else:
                    del vars(block)["forward"]

    def _block(self, block: nn.Module, list_name: str, blocks: nn.ModuleList) -> _Block:
        """The block's name, index and signature (worked out for its whole list at once)."""
        info = self.blocks.get(id(block))
        if info is None:
            signatures = [_signature(b) for b in blocks]
            for pos, (b, (sig, index)) in enumerate(zip(blocks, signatures, strict=True)):
                last = all(s != sig for s, _ in signatures[pos + 1:])
                name = f"{list_name}.{pos}" if list_name else str(pos)
                self.blocks[id(b)] = _Block(name, index, sig, last)
            info = self.blocks[id(block)]
        return info

    def call(self, block: nn.Module, list_name: str, blocks: nn.ModuleList,
             original: Callable[..., Any], args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> Any:
        """One block call, run for real (and recorded) or replayed."""
        mode = self.mode
        if torch.is_grad_enabled() or mode.depth or not mode.counting:
            return original(*args, **kwargs)
        info = self._block(block, list_name, blocks)
        cache = self.cache_of(kwargs)
        if cache is not None and info.index is None:
            return original(*args, **kwargs)
        inputs = {"args": args, "kwargs": kwargs}
        phase = len(mode.phases)
        entry = self.recorder.enter(inputs, cache, index=info.index, full=False,
                                    slots=self.slots.get((phase, info.signature)))
        pre, pre_shape = self.recorder.pre(entry)
        del entry
        key = (phase, info.signature, pre_shape, tuple(pre))
        template = self.templates.get(key)
        if template is not None and template.confirmed and not info.last:
            plan = template.first.plan
            assert plan is not None
            try:
                out = replay(mode, plan, template.first.body, inputs=inputs, root=cache,
                             index=info.index, prefix=info.name, values=self.values)
            except Mismatch as exc:
                raise BlockRetrace(f"{info.name}: {exc}") from None
            template.pending.append(info.name)
            self.summary.replayed += 1
            return out
        modules = list(block.modules())
        entry = self.recorder.enter(inputs, cache, index=info.index, modules=modules)
        out = original(*args, **kwargs)
        segment = self.recorder.record(entry, cache, out, index=info.index, prefix=info.name,
                                       modules=modules)
        del entry
        self.summary.real += 1
        if segment.refused:
            return out
        if template is None:
            self.templates[key] = _Template(segment)
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

    def finish(self) -> None:
        """Replayed blocks that no real one confirmed: the trace runs again without them."""
        for template in self.templates.values():
            if template.pending:
                raise BlockRetrace(f"{template.pending[0]} and the blocks replayed with it "
                                   "were never confirmed by a real one")
