"""Repeated parameters of a for-loop optimizer step, traced once and replayed exactly.

``torch.optim``'s for-loop step (``_single_tensor_adam``) runs the same few ops for each
parameter, and a model of repeated blocks gives it a periodic parameter list: a Llama layer's
nine tensors, eighty times. The ops of one parameter depend on its tensors' metadata (param,
gradient, state: shape, stride, dtype) and on the step counter's value, and the only thing an
iteration leaves to the next is what its Python locals still hold (``denom``), which the next
iteration frees when it assigns them again.

So where the parameters' signatures repeat with period ``P`` for ``R >= 4`` units, the step
runs units 0 and 1 and the last one for real and skips the others: when unit ``R - 1`` starts
(a hook in the iteration over ``params``), unit 1's ticks are the template, checked first
(what it allocated is freed in it or left to the next unit, what it freed is exactly what unit
0 left, and unit 0 left the same as unit 1 does). Each skipped unit appends the template's
ticks and allocation records; the first frees unit 1's leftovers, and the storages of those
leftovers, which the locals still hold, stand for the last skipped unit's leftovers from then
on, so the next real iteration frees them where a real run would. The skipped parameters'
state changes only in place; a step counter's real value (the twin that
:class:`~modelsize.estimation.trace.RealValues` keeps) is copied from unit 1's.

Anything else (a template that does not check out) raises :class:`OptimizerRetrace` and the
trace runs again without this replay.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes

from modelsize.estimation.tracker import Allocation, CountingFakeMode
from modelsize.estimation.train_replay import _advance, _ticks

#: Units needed before replay pays: two real ones to learn from, one real last one.
MIN_UNITS = 4
MAX_PERIOD = 64


class OptimizerRetrace(Exception):
    """A replayed optimizer template did not check out: trace again without it."""


class _Hooked(list):  # type: ignore[type-arg]
    """A parameter list that calls a hook as the loop over it reaches some positions."""

    hooks: dict[int, Callable[[], None]]

    def __iter__(self) -> Iterator[Any]:
        hooks = self.hooks
        for k, item in enumerate(list.__iter__(self)):
            hook = hooks.pop(k, None)
            if hook is not None:
                hook()
            yield item


def _signature(t: Any, values: Any) -> Any:
    """What one iteration's ops depend on in ``t``, or a fresh object (equal to nothing)."""
    if type(t) is not FakeTensor or t.layout is not torch.strided:
        return object()
    twin = random = None
    if values is not None:
        twin = values.value_of(t)
        random = t in values.random
        if twin is not None:
            with _disable_current_modes():
                flat = twin.detach().contiguous().reshape(-1).view(torch.uint8)
                twin = (twin.dtype, tuple(twin.shape), flat.numpy().tobytes())
    return (tuple(t.shape), t.stride(), t.dtype, t.storage_offset(), t.requires_grad,
            t.untyped_storage().nbytes(), twin, random)


def find_period(sigs: list[Any]) -> tuple[int, int, int] | None:
    """The (start, period, units) of the periodic run of ``sigs`` that skips the most."""
    n = len(sigs)
    best: tuple[int, int, int] | None = None
    for period in range(1, min(MAX_PERIOD, n // MIN_UNITS) + 1):
        start = 0
        while start + MIN_UNITS * period <= n:
            unit = sigs[start:start + period]
            units = 1
            while (start + (units + 1) * period <= n
                   and sigs[start + units * period:start + (units + 1) * period] == unit):
                units += 1
            if units >= MIN_UNITS and (best is None
                                       or (units - 3) * period > (best[2] - 3) * best[1]):
                best = (start, period, units)
            start += (units - 1) * period + 1
    return best


@dataclass
class _Mark:
    tick: int
    allocs: int
    live: int
    live_bytes: int
    left: list[Allocation]


class OptimizerReplay:
    """Installs the replay on torch.optim's for-loop Adam (and AdamW) while ``mode`` counts."""

    def __init__(self, mode: CountingFakeMode) -> None:
        self.mode = mode
        self.skipped = 0

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Route ``_single_tensor_adam`` through :meth:`_step` (restored on exit)."""
        import torch.optim.adam as adam_module

        original = adam_module._single_tensor_adam

        def step(*args: Any, **kwargs: Any) -> None:
            return self._step(original, args, kwargs)

        adam_module._single_tensor_adam = step  # type: ignore[assignment]
        try:
            yield
        finally:
            adam_module._single_tensor_adam = original

    def _step(self, original: Callable[..., None], args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> None:
        mode = self.mode
        params = args[0]
        n = len(params)
        if not mode.counting or mode.depth or n < MIN_UNITS or not isinstance(params, list):
            return original(*args, **kwargs)
        lists = [i for i, a in enumerate(args) if isinstance(a, list) and len(a) == n]
        if any(isinstance(a, (list, tuple)) and a and i not in lists
               for i, a in enumerate(args)):
            return original(*args, **kwargs)
        values = mode.real_values
        sigs = [tuple(_signature(args[i][k], values) for i in lists) for k in range(n)]
        found = find_period(sigs)
        if found is None:
            return original(*args, **kwargs)
        a, period, units = found
        cut, resume = a + 2 * period, a + (units - 1) * period
        reduced = list(args)
        for i in lists:
            reduced[i] = args[i][:cut] + args[i][resume:]
        marks: list[_Mark] = []

        def mark() -> None:
            start = marks[-1].allocs if marks else len(mode.allocations)
            left = [r for r in mode.allocations[start:] if r.freed < 0] if marks else []
            marks.append(_Mark(mode.tick, len(mode.allocations), len(mode.live),
                               mode.live_bytes, left))

        def splice() -> None:
            if len(marks) != 2:
                raise OptimizerRetrace("the optimizer's loop did not reach its units in order")
            self._replay(marks[0], marks[1], units - 3)
            for i in lists:  # the skipped ones' twins: unit 1's, as a real run gives
                whole = args[i]
                for j in range(period):
                    src = whole[a + period + j]
                    for u in range(2, units - 1):
                        _copy_twin(values, src, whole[a + u * period + j])
            self.skipped += (units - 3) * period

        hooked = _Hooked(reduced[0])
        hooked.hooks = {a: mark, a + period: mark, cut: splice}
        reduced[0] = hooked
        return original(*reduced, **kwargs)

    def _replay(self, m0: _Mark, m1: _Mark, copies: int) -> None:
        """Append ``copies`` units like the one that ran since ``m1`` (after ``m0``'s)."""
        mode = self.mode
        t0, t1 = m1.tick, mode.tick
        made1 = mode.allocations[m1.allocs:]
        left0 = m1.left
        left1 = [r for r in made1 if r.freed < 0]
        if any(r.freed < 0 or r.freed > t1 for r in left0):
            raise OptimizerRetrace("a unit's leftover outlived the next unit")
        if len(mode.live) != m1.live - len(left0) + len(left1):
            raise OptimizerRetrace("a unit freed storages it did not inherit")
        phase = len(mode.phases) - 1
        if any(r.sources or r.saved_by or r.kept_in or r.host or r.is_state or r.phase != phase
               for r in made1):
            raise OptimizerRetrace("a unit's records carry links")

        def shape_of(r: Allocation, base: int) -> tuple[Any, ...]:
            return (r.created - base, r.nbytes, r.origin, r.module, r.op, r.shape, r.dtype,
                    r.state, r.is_grad, r.saved, r.recomputed)

        if [shape_of(r, m0.tick) for r in left0] != [shape_of(r, t0) for r in left1]:
            raise OptimizerRetrace("unit 0 left other storages than unit 1")
        keys = {id(r): key for key, r in mode.live.items() if any(r is x for x in left1)}
        if len(keys) != len(left1):
            raise OptimizerRetrace("a leftover has no storage of its own")
        ops, deltas, scratch_list = _ticks(mode, t0, t1, m1.live_bytes)
        scratch = {j: (extra, parts) for j, extra, parts in scratch_list}
        frees0 = [r.freed - t0 for r in left0]
        inner = [(shape_of(r, t0), r.freed - t0 if r.freed >= 0 else -1) for r in made1]
        net = mode.live_bytes - m1.live_bytes
        prev = left1
        for _ in range(copies):
            start_tick, start_live = mode.tick, mode.live_bytes
            fresh: list[Allocation] = []
            for (created, nbytes, origin, module, op, shape, dtype, state, is_grad, saved,
                 recomputed), freed in inner:
                rec = Allocation(nbytes, origin, start_tick + created, phase, module,
                                 start_tick + freed if freed >= 0 else -1)
                rec.op, rec.shape, rec.dtype, rec.state = op, shape, dtype, state
                rec.is_grad, rec.saved, rec.recomputed = is_grad, saved, recomputed
                fresh.append(rec)
            mode.allocations.extend(fresh)
            for r, off in zip(prev, frees0, strict=True):
                r.freed = start_tick + off
            for j in range(1, len(ops) + 1):
                _advance(mode, ops, deltas, scratch, start_live, j)
            mode.live_bytes = start_live + net
            prev = [r for r, (_, freed) in zip(fresh, inner, strict=True) if freed < 0]
        for old, new in zip(left1, prev, strict=True):  # the locals' storages: the last unit's
            mode.live[keys[id(old)]] = new


def _copy_twin(values: Any, src: Any, dst: Any) -> None:
    if values is None or not isinstance(src, FakeTensor):
        return
    twin = values.value_of(src)
    if twin is not None:
        with _disable_current_modes():
            values._set(dst, twin.clone())
    elif values.value_of(dst) is not None:
        values._forget(dst)
    if src in values.random:
        values.random[dst] = True
    elif dst in values.random:
        del values.random[dst]
