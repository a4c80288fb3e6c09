"""The measured side of the tests: run the same program for real on CPU under the profiler.

Independent of the estimator: the peak is read from the allocator's own ``[memory]``
alloc/free events (``torch.profiler`` with ``profile_memory=True``), plus the bytes that were
live before the program started (parameters, buffers and inputs, one count per storage).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def first_float_sum(out: Any) -> torch.Tensor:
    """The default loss of the estimator, written again: ``.loss`` or the first float's sum."""
    if getattr(out, "loss", None) is not None:
        return out.loss
    if isinstance(out, torch.Tensor):
        return out.sum()
    items = out.to_tuple() if hasattr(out, "to_tuple") else out
    for x in items:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.sum()
    raise AssertionError("no float output")


@contextlib.contextmanager
def allocator_events() -> Iterator[list[int]]:
    """Collect the CPU allocator's alloc (+) / free (-) sizes, in order."""
    events: list[int] = []
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield events
    events.extend(e.nbytes() for e in prof.profiler.kineto_results.events()
                  if e.name() == "[memory]")


def peak_of(events: list[int]) -> int:
    """Highest running sum of the events."""
    cur = high = 0
    for n in events:
        cur += n
        high = max(high, cur)
    return high


def measure(
    model: nn.Module,
    inputs: tuple[Any, ...] | Mapping[str, Any],
    *,
    mode: str = "train",
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
    steps: int = 2,
    accumulate: int = 1,
    amp: torch.dtype | None = None,
    loss: Callable[[Any], torch.Tensor] = first_float_sum,
) -> int:
    """The real CPU peak, in bytes, of the program the estimator traces."""
    args, kwargs = ((), dict(inputs)) if isinstance(inputs, Mapping) else (tuple(inputs), {})
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
    before = storage_bytes(tensors)

    def forward_loss() -> torch.Tensor:
        ctx = torch.autocast("cpu", dtype=amp) if amp is not None else contextlib.nullcontext()
        with ctx:
            return loss(model(*args, **kwargs))

    was_training = model.training
    with allocator_events() as events:
        if mode == "infer":
            model.eval()
            ctx = torch.autocast("cpu", dtype=amp) if amp is not None else contextlib.nullcontext()
            with torch.no_grad(), ctx:
                out = model(*args, **kwargs)
            del out
        else:
            model.train()
            assert optimizer is not None
            opt = optimizer(model.parameters())
            for _ in range(steps):
                for _ in range(accumulate):
                    value = forward_loss()
                    value.backward()
                    del value
                opt.step()
                opt.zero_grad(set_to_none=True)
            del opt
    model.train(was_training)
    return before + peak_of(events)
