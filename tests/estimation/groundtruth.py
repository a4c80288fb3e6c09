"""The measured side of the tests: run the same program for real on CPU under the profiler.

Independent of the estimator: the peak is read from the allocator's own ``[memory]``
alloc/free events (``torch.profiler`` with ``profile_memory=True``), plus the bytes that were
live before the program started (parameters, buffers and inputs, one count per storage).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import warnings
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
    # No garbage of earlier work freed inside the window (it would lower the running sum).
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            yield events
    finally:
        if gc_was_enabled:
            gc.enable()
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


# -- one rank of a data-parallel program, on a fake process group ---------------------------


def llama_tp_plan() -> dict[str, Any]:
    """Llama's tensor-parallel plan written out: q, k, v, gate, up column-wise; o, down row-wise."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {f"model.layers.*.{name}": ColwiseParallel() for name in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
        "mlp.up_proj")}
    plan |= {f"model.layers.*.{name}": RowwiseParallel() for name in (
        "self_attn.o_proj", "mlp.down_proj")}
    return plan


def measured(model: nn.Module, inputs: dict[str, Any] | tuple[Any, ...], world: int,
             rank: int, units: list[str], *, tp: int = 1, mp: torch.dtype | None = None,
             autocast: torch.dtype | None = None, cache: bool = True, offload: bool = False,
             checkpoint: tuple[str, ...] = (), forward_only: bool = False,
             reshard: bool = True) -> int:
    """Rank ``rank``'s real CPU peak: FSDP2 (on the dp dimension of a ``(world // tp, tp)`` mesh
    after Llama's tensor-parallel plan when ``tp > 1``) on real tensors, a fake process group,
    two AdamW steps (or one forward), read from the allocator's events."""
    import torch.distributed as dist
    import torch.utils.checkpoint as cp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    work = copy.deepcopy(model)
    for name in checkpoint:
        block = work.get_submodule(name)
        block.forward = functools.partial(cp.checkpoint, block.forward, use_reentrant=False)
    args, kwargs = (((), inputs) if isinstance(inputs, dict) else (inputs, {}))
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        if tp > 1:
            mesh2 = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
            parallelize_module(work, mesh2["tp"], llama_tp_plan())
            mesh = mesh2["dp"]
        else:
            mesh = init_device_mesh("cpu", (world,))
        policy = (MixedPrecisionPolicy(param_dtype=mp, reduce_dtype=torch.float32)
                  if mp is not None else MixedPrecisionPolicy())
        offloading = CPUOffloadPolicy(pin_memory=False) if offload else OffloadPolicy()
        for name in units:
            fully_shard(work.get_submodule(name), mesh=mesh, mp_policy=policy,
                        offload_policy=offloading, reshard_after_forward=reshard)
        fully_shard(work, mesh=mesh, mp_policy=policy, offload_policy=offloading,
                    reshard_after_forward=reshard)
        params = list(work.parameters())
        before = storage_bytes([p._local_tensor for p in params] + list(work.buffers())
                               + [v for v in (*args, *kwargs.values())])

        def forward() -> Any:
            ctx = (torch.autocast("cpu", dtype=autocast, cache_enabled=cache)
                   if autocast is not None else contextlib.nullcontext())
            with ctx:
                return work(*args, **kwargs)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # FSDP2: "returned a view tensor"
            with allocator_events() as events:
                if forward_only:
                    out = forward()
                    del out
                else:
                    opt = torch.optim.AdamW(params)
                    for _ in range(2):
                        loss = first_float_sum(forward())
                        loss.backward()
                        del loss
                        opt.step()
                        opt.zero_grad(set_to_none=True)
                    del opt
    finally:
        dist.destroy_process_group()
    return before + peak_of(events)
