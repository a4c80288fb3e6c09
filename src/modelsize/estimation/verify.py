"""``--verify``: run the estimated program for real on CPU and measure its peak.

The measured side is independent of the tracer: the program runs on real tensors, and its
peak is read from the CPU allocator's own ``[memory]`` alloc/free events (``torch.profiler``
with ``profile_memory=True``), plus the bytes that were live before it started (parameters,
buffers and inputs, one count per storage). That is the number the estimate claims to equal.

The run costs real memory and time, so it happens at the requested size only when the CPU
estimate of that size fits a budget (half of this machine's available memory unless given),
and otherwise at the largest smaller batch that fits, which is estimated again so that both
sides describe the same program. An estimate for CUDA is compared through its CPU twin (same
program, same optimizer implementation): the CUDA terms themselves need a GPU to check.

The caller's model is not touched: the run uses a deep copy (materialized with zeros when the
model is on the meta device; meta inputs become zeros too), and the random states of torch,
NumPy and ``random`` are put back afterwards. Both sides start from the same random states,
so models that draw masks with NumPy (wav2vec2's time masking) take the same path.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import random
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from modelsize.estimation import quantized
from modelsize.estimation.fit import fit
from modelsize.estimation.optimizers import default_implementation, make_factory
from modelsize.estimation.result import Verification
from modelsize.estimation.scratch import quiet_stderr
from modelsize.estimation.trace import (
    Program,
    caller,
    checkpointed,
    default_loss,
    hf_checkpointing,
    map_inputs,
    training_flags,
)

#: The share of the machine's available memory a verification run may take by default.
BUDGET_FRACTION = 0.5

Inputs = tuple[Any, ...] | Mapping[str, Any]
EstimateAt = Callable[[Inputs], int]


def available_memory() -> int:
    """Bytes of memory available to a new allocation now (``MemAvailable`` on Linux)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def default_budget() -> int:
    """:data:`BUDGET_FRACTION` of :func:`available_memory`."""
    return int(available_memory() * BUDGET_FRACTION)


@dataclass(frozen=True)
class RandomState:
    """The random states of torch (CPU), NumPy and ``random``, to start both sides alike."""

    torch_state: torch.Tensor
    numpy_state: Any
    python_state: Any

    @classmethod
    def capture(cls) -> RandomState:
        """The states now (NumPy's only if NumPy is already imported)."""
        np = sys.modules.get("numpy")
        return cls(torch.get_rng_state(), np.random.get_state() if np else None,
                   random.getstate())

    def restore(self) -> None:
        """Put these states back."""
        torch.set_rng_state(self.torch_state)
        np = sys.modules.get("numpy")
        if np is not None and self.numpy_state is not None:
            np.random.set_state(self.numpy_state)
        random.setstate(self.python_state)

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Run a block from these states, then put back the states found on entry."""
        found = RandomState.capture()
        self.restore()
        try:
            yield
        finally:
            found.restore()


def verify(
    model: nn.Module,
    inputs: Inputs,
    program: Program,
    estimate_at: EstimateAt,
    *,
    estimated: int | None = None,
    batch: int | None = None,
    resize: Callable[[int], Inputs] | None = None,
    budget: int | None = None,
    start: RandomState | None = None,
    measure_with: Callable[[nn.Module, Inputs], int] | None = None,
) -> Verification:
    """Run ``program`` on ``model`` for real on CPU; compare with its CPU estimate.

    ``estimate_at(inputs)`` is the CPU estimate's peak for other inputs (``estimated`` the one
    for ``inputs``, when already known). ``resize(n)`` gives the inputs at batch ``n`` (of
    ``batch``); without it the run happens at full size or not at all. ``measure_with``
    measures a program :func:`measure` does not run (generation).
    """
    budget = default_budget() if budget is None else budget
    start = start or RandomState.capture()
    began = time.perf_counter()

    def cpu_estimate(inp: Inputs) -> int:
        with start.applied():
            return estimate_at(inp)

    def result(estimated_bytes: int, measured: int | None, ran_batch: int | None,
               reason: str) -> Verification:
        return Verification(measured, estimated_bytes, ran_batch, batch, budget,
                            time.perf_counter() - began, reason)

    def run(inp: Inputs) -> tuple[int | None, str]:
        try:
            with start.applied():
                if measure_with is not None:
                    return measure_with(model, inp), ""
                return measure(model, inp, program), ""
        except (RuntimeError, MemoryError, TypeError, ValueError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            return None, f"the real run failed: {first}"

    if estimated is None:
        estimated = cpu_estimate(inputs)
    unrunnable = _unrunnable(model, inputs)
    if unrunnable:
        return result(estimated, None, None, unrunnable)
    if estimated <= budget:
        measured, failed = run(inputs)
        return result(estimated, measured, None, failed)
    what = f"batch {batch}" if batch else "the program"
    over = f"{what} needs {estimated:,} bytes, over the {budget:,}-byte budget"
    if resize is None or batch is None or batch <= 1:
        return result(estimated, None, None, over)
    found = fit(lambda n: cpu_estimate(resize(n)), budget, limit=batch - 1)
    if found.best == 0:
        return result(estimated, None, None, f"even batch 1 needs "
                      f"{dict(found.probes)[1]:,} bytes, over the {budget:,}-byte budget")
    measured, failed = run(resize(found.best))
    return result(found.best_bytes, measured, found.best, failed or over)


def _unrunnable(model: nn.Module, inputs: Inputs) -> str:
    values = inputs.values() if isinstance(inputs, Mapping) else inputs
    if isinstance(values, torch.Tensor):
        values = (values,)
    tensors = [*model.parameters(), *model.buffers(),
               *(v for v in values if isinstance(v, torch.Tensor))]
    if any(isinstance(t, FakeTensor) for t in tensors):
        return "the model or its inputs are fake tensors, which hold no data to run"
    return ""


def measure(model: nn.Module, inputs: Inputs, program: Program) -> int:
    """The real CPU peak, in bytes, of ``program`` on a copy of ``model``."""
    work = _real_copy(model)
    args, kwargs = _real_inputs(inputs)
    train = program.mode == "train"
    params = list(work.parameters())
    tensors = [*params, *work.buffers(), *quantized.layer_state_tensors(work),
               *(v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor))]
    before = storage_bytes(tensors)
    loss_fn = program.loss or default_loss
    impl = program.implementation
    if str(impl) == "default":
        impl = default_implementation(program.device)
    with contextlib.ExitStack() as stack:
        stack.enter_context(training_flags(work, train))
        stack.enter_context(checkpointed(work, program.checkpoint if train else (), real=True))
        stack.enter_context(hf_checkpointing(work, program.gradient_checkpointing
                                             if train else None))
        call = caller(work, args, kwargs, program.amp)
        events = stack.enter_context(allocator_events())
        run_program(call, params, program, loss_fn, impl)
    return before + peak_of(events)


def run_program(call: Callable[[], Any], params: list[nn.Parameter], program: Program,
                loss_fn: Callable[[Any], torch.Tensor], implementation: Any) -> None:
    """``program`` on real tensors: one forward under ``no_grad``, or its training steps
    (forward, loss, backward per micro-batch, then the optimizer's step and zero_grad)."""
    if program.mode != "train":
        with torch.no_grad():
            out = call()
        del out
        return
    chosen = params if program.optimize_frozen else [p for p in params if p.requires_grad]
    optimizer = make_factory(program.optimizer, implementation, "cpu")(chosen)
    for _ in range(program.steps):
        for _ in range(program.accumulate):
            loss = loss_fn(call())
            loss.backward()
            del loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    del optimizer


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen: dict[int, int] = {}
    for t in (p for whole in tensors for p in quantized.storages(whole)):
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


@contextlib.contextmanager
def allocator_events() -> Iterator[list[int]]:
    """The CPU allocator's alloc (+) / free (-) sizes, in order, filled when the block ends."""
    from torch.profiler import ProfilerActivity, profile

    events: list[int] = []
    # Garbage of what ran before (a trace's real tensors) must not be freed inside the window:
    # a free of bytes allocated before it lowers the running sum (seen: 128 to 8,192 bytes
    # under the estimate, at random, when the cycle collector ran mid-program).
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    prof: Any = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with quiet_stderr():
        prof.__enter__()
    try:
        yield events
    finally:
        with quiet_stderr():
            prof.__exit__(None, None, None)
        if gc_was_enabled:
            gc.enable()
    events.extend(e.nbytes() for e in prof.profiler.kineto_results.events()
                  if e.name() == "[memory]")


def peak_of(events: list[int]) -> int:
    """The highest running sum of ``events``."""
    cur = high = 0
    for n in events:
        cur += n
        high = max(high, cur)
    return high


def _real_copy(model: nn.Module) -> nn.Module:
    """A deep copy on CPU without ``.grad``; a meta model is materialized with zeros."""
    work = copy.deepcopy(model, quantized.materialized_memo(model))
    if any(t.is_meta for t in (*work.parameters(), *work.buffers())):
        _materialize(work)
    elif any(t.device.type != "cpu" for t in (*work.parameters(), *work.buffers())):
        work = work.to("cpu")
    for p in work.parameters():
        p.grad = None
    return work


def _materialize(model: nn.Module) -> None:
    """Zero-filled CPU tensors for the meta ones, one per meta tensor: tied weights stay tied
    (``Module.to_empty`` would untie them, and the real run would hold them twice)."""
    made: dict[int, torch.Tensor] = {}

    def real(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            new = torch.zeros(t.shape, dtype=t.dtype)
            if isinstance(t, nn.Parameter):
                new = nn.Parameter(new, requires_grad=t.requires_grad)
            made[id(t)] = new
        return made[id(t)]

    for m in model.modules():
        for name, p in m._parameters.items():
            if p is not None and p.is_meta:
                m._parameters[name] = cast(nn.Parameter, real(p))
        for name, b in m._buffers.items():
            if b is not None and b.is_meta:
                m._buffers[name] = real(b)


def _real_inputs(inputs: Inputs) -> tuple[tuple[Any, ...], dict[str, Any]]:
    def leaf(v: torch.Tensor) -> torch.Tensor:
        return torch.zeros(v.shape, dtype=v.dtype) if v.is_meta else v.detach().to("cpu")

    return map_inputs(inputs, leaf)


def resize_batch(inputs: Inputs) -> tuple[int | None, Callable[[int], Inputs] | None]:
    """The batch of ``inputs`` (the first tensor's first dimension) and a way to shrink it.

    Every tensor whose first dimension equals that batch is cut to ``n`` rows (a copy, so
    the smaller inputs own their memory); other values are kept.
    """
    values = list(inputs.values()) if isinstance(inputs, Mapping) else (
        [inputs] if isinstance(inputs, torch.Tensor) else list(inputs))
    first = next((v for v in values if isinstance(v, torch.Tensor) and v.dim()), None)
    if first is None:
        return None, None
    batch = int(first.shape[0])

    def cut(v: Any, n: int) -> Any:
        if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == batch:
            return v[:n].clone()
        return v

    def resize(n: int) -> Inputs:
        if isinstance(inputs, Mapping):
            return {k: cut(v, n) for k, v in inputs.items()}
        if isinstance(inputs, torch.Tensor):
            return (cut(inputs, n),)
        return tuple(cut(v, n) for v in inputs)

    return batch, resize
