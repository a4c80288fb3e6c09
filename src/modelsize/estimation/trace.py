"""Run the program being estimated (inference, or training steps) on fake tensors.

The caller's model is left as it was found: its parameters and buffers are swapped for fake
copies only while the program runs (forward, backward, where checkpointed modules re-run, and
the optimizer step), the train/eval flag of every module is restored, the hooks we need are
global and removed, and checkpointed modules get their ``forward`` back.

The program, for ``mode="train"`` (each line is a phase)::

    for step in 1..steps:
        for micro in 1..accumulate:
            forward    out = model(*inputs); loss = loss_fn(out); del out
            backward   loss.backward(); del loss
        optimizer      optimizer.step()
        zero_grad      optimizer.zero_grad(set_to_none=True)

and for ``mode="infer"``: one ``forward`` in eval mode under ``torch.no_grad()``.
"""

from __future__ import annotations

import contextlib
import fnmatch
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from modelsize.errors import EstimateError, UsageError
from modelsize.estimation.optimizers import Implementation, OptimizerSpec, make_factory
from modelsize.estimation.tracker import Allocation, CountingFakeMode, Origin

LossFn = Callable[[Any], torch.Tensor]
ProgressFn = Callable[[str, int], None]


@dataclass
class Program:
    """What to trace: everything but the model and its inputs."""

    mode: str = "train"
    optimizer: OptimizerSpec = "adam"
    implementation: Implementation = Implementation.DEFAULT
    loss: LossFn | None = None
    amp: torch.dtype | None = None
    device: str = "cpu"
    steps: int = 2
    accumulate: int = 1
    checkpoint: Sequence[str] = ()
    scratch: bool = True


@dataclass
class Trace:
    """The raw result of one traced program: the counting mode and a few facts about it."""

    mode: CountingFakeMode
    parameter_count: int
    trainable_count: int
    seconds: float
    module_activations: dict[str, int] = field(default_factory=dict)


def default_loss(output: Any) -> torch.Tensor:
    """``output.loss`` when present, else ``.sum()`` of the first floating-point tensor."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    for t in _flat_tensors(output):
        if t.is_floating_point():
            return t.sum()
    raise EstimateError("the model's output holds no floating-point tensor to take a loss of")


def _flat_tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from _flat_tensors(v)
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            yield from _flat_tensors(v)
    elif hasattr(obj, "to_tuple"):  # transformers ModelOutput
        yield from _flat_tensors(obj.to_tuple())


class _FakeCopier:
    """Fake copies of real, meta or foreign-fake tensors: one fake storage per source storage.

    Tensors that share a storage (tied weights, views of a flat buffer) share the copy's
    storage, at the same offsets and strides; no data is read.
    """

    def __init__(self, mode: CountingFakeMode, device: torch.device) -> None:
        self.mode = mode
        self.device = device
        self._storages: dict[int, torch.UntypedStorage] = {}
        self._keep: list[torch.Tensor] = []  # keeps sources alive so storage ids stay unique

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """The fake twin of ``t`` (not a view: autocast caches casts of leaves only)."""
        st = t.untyped_storage()
        self._keep.append(t)
        storage = self._storages.get(st._cdata)
        if storage is None:
            storage = torch.empty(st.nbytes(), dtype=torch.uint8, device="meta").untyped_storage()
            self._storages[st._cdata] = storage
        meta = torch.empty(0, dtype=t.dtype, device="meta")
        meta.set_(storage, t.storage_offset(), t.shape, t.stride())
        return self.mode.fake_tensor_converter.from_meta_and_device(self.mode, meta, self.device)


@contextlib.contextmanager
def _module_names(mode: CountingFakeMode, model: nn.Module) -> Iterator[None]:
    names = {id(m): name for name, m in model.named_modules()}

    def pre(module: nn.Module, args: Any) -> None:
        mode.modules.append(names.get(id(module), type(module).__name__))

    def post(module: nn.Module, args: Any, output: Any) -> None:
        if mode.modules:
            mode.modules.pop()

    h1 = nn.modules.module.register_module_forward_pre_hook(pre)
    h2 = nn.modules.module.register_module_forward_hook(post, always_call=True)
    try:
        yield
    finally:
        h1.remove()
        h2.remove()


@contextlib.contextmanager
def _training_flags(model: nn.Module, training: bool) -> Iterator[None]:
    saved = [(m, m.training) for m in model.modules()]
    try:
        model.train(training)
        yield
    finally:
        for m, flag in saved:
            m.training = flag


@contextlib.contextmanager
def _checkpointed(model: nn.Module, patterns: Sequence[str]) -> Iterator[list[str]]:
    """Wrap the ``forward`` of the modules matching ``patterns`` in non-reentrant checkpoint.

    Checkpoint keeps a copy of the CPU RNG state (``torch.get_rng_state()``, a real tensor)
    until the region's backward is done. The wrapper stands a fake tensor of the same size in
    for it, held by the recomputation closure so that it lives exactly as long.
    """
    import torch.utils.checkpoint as cp

    rng_nbytes = torch.get_rng_state().nbytes
    matched: list[tuple[nn.Module, bool, Any]] = []
    names: list[str] = []
    for name, m in model.named_modules():
        if not name:
            continue
        if any(fnmatch.fnmatchcase(name, p) or type(m).__name__ == p for p in patterns):
            if any(name.startswith(n + ".") for n in names):
                continue  # already inside a checkpointed ancestor
            had = "forward" in m.__dict__
            orig = m.forward

            def wrapped(*args: Any, __orig: Any = orig, **kwargs: Any) -> Any:
                rng_state = torch.empty(rng_nbytes, dtype=torch.uint8)

                def run(*a: Any, __state: Any = rng_state, **k: Any) -> Any:
                    return __orig(*a, **k)

                del rng_state
                return cp.checkpoint(run, *args, use_reentrant=False, preserve_rng_state=False,
                                     **kwargs)

            m.forward = wrapped  # type: ignore[method-assign]
            matched.append((m, had, orig))
            names.append(name)
    if patterns and not matched:
        raise UsageError(f"checkpoint {', '.join(patterns)}: no module matches")
    try:
        yield names
    finally:
        for m, had, orig in matched:
            if had:
                m.forward = orig  # type: ignore[method-assign]
            else:
                del m.forward


@contextlib.contextmanager
def _swapped_state(model: nn.Module, state: dict[str, torch.Tensor]) -> Iterator[None]:
    """The model's parameters and buffers are the fake copies for the whole program.

    Not just during each forward: activation checkpointing re-runs module code inside the
    backward, and that code must see the fake parameters too.
    """
    from torch.nn.utils.stateless import _reparametrize_module

    with _reparametrize_module(model, state, tie_weights=True, strict=False):
        yield


def _states(
    model: nn.Module,
) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, torch.Tensor]]]:
    params = list(model.named_parameters(remove_duplicate=False))
    buffers = [(n, b) for n, b in model.named_buffers(remove_duplicate=False) if b is not None]
    return params, buffers


def run_trace(
    model: nn.Module,
    inputs: tuple[Any, ...] | Mapping[str, Any],
    program: Program,
    progress: ProgressFn | None = None,
) -> Trace:
    """Trace ``program`` on ``model`` with fake tensors and return the counting mode."""
    from modelsize.estimation import scratch as scratch_models

    if program.mode not in ("train", "infer"):
        raise UsageError(f"mode must be 'train' or 'infer', not {program.mode!r}")
    if program.accumulate < 1 or program.steps < 1:
        raise UsageError("steps and accumulate must be at least 1")
    device = torch.device(program.device)
    table = scratch_models.table(device.type) if program.scratch else None
    mode = CountingFakeMode(scratch=table)
    mode.counting = False
    copier = _FakeCopier(mode, torch.device("cpu"))
    params, buffers = _states(model)
    fakes: dict[int, torch.Tensor] = {}
    state: dict[str, torch.Tensor] = {}
    unique_params: list[torch.Tensor] = []
    for name, p in params:
        if id(p) not in fakes:
            fp = nn.Parameter(copier.copy(p.detach()), requires_grad=p.requires_grad)
            fakes[id(p)] = fp
            unique_params.append(fp)
            mode.track(fp, Origin.PARAMETER)
        state[name] = fakes[id(p)]
    for name, b in buffers:
        if id(b) not in fakes:
            fakes[id(b)] = copier.copy(b)
            mode.track(fakes[id(b)], Origin.BUFFER)
        state[name] = fakes[id(b)]
    args, kwargs = _fake_inputs(inputs, copier, fakes, mode)
    del fakes
    train = program.mode == "train"
    n_params = sum(p.numel() for p in unique_params)
    n_train = sum(p.numel() for p in unique_params if p.requires_grad)
    loss_fn = program.loss or default_loss
    start = time.perf_counter()
    module_acts: dict[str, int] = {}
    with contextlib.ExitStack() as stack:
        stack.enter_context(_training_flags(model, train))
        stack.enter_context(_swapped_state(model, state))
        stack.enter_context(_checkpointed(model, program.checkpoint if train else ()))
        stack.enter_context(_module_names(mode, model))
        stack.enter_context(mode)
        scalars = _SavedScalars(mode)
        if train and device.type == "cpu":
            stack.enter_context(scalars)
        if device.type == "cuda":
            from modelsize.estimation.cuda_kernels import CudaKernelChoices

            stack.enter_context(CudaKernelChoices())
        call = _caller(model, args, kwargs, program.amp)
        label = ["forward"]
        if progress is not None:
            mode.progress = lambda tick: progress(label[0], tick)
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
            factory = make_factory(program.optimizer, program.implementation, device.type)
            optimizer = factory(unique_params)
            for leaf in unique_params:
                if leaf.requires_grad:
                    leaf.register_post_accumulate_grad_hook(_grad_marker(mode))
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
    return Trace(mode, n_params, n_train, seconds, module_acts)


def _forward_loss(call: Callable[[], Any], loss_fn: LossFn) -> torch.Tensor:
    out = call()
    loss = loss_fn(out)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise EstimateError("the loss must be a one-element tensor")
    if not loss.requires_grad:
        raise EstimateError("the loss does not require grad: no parameter is trainable")
    return loss


def _caller(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
            amp: torch.dtype | None) -> Callable[[], Any]:
    def call() -> Any:
        # The trace runs CPU kernels whatever the target device, so CPU autocast it is.
        ctx = (torch.autocast("cpu", dtype=amp) if amp is not None
               else contextlib.nullcontext())
        with ctx:
            return model(*args, **kwargs)

    return call


def _fake_inputs(inputs: tuple[Any, ...] | Mapping[str, Any], copier: _FakeCopier,
                 memo: dict[int, torch.Tensor],
                 mode: CountingFakeMode) -> tuple[tuple[Any, ...], dict[str, Any]]:
    def conv(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            if id(v) not in memo:
                memo[id(v)] = copier.copy(v.detach())
                mode.track(memo[id(v)], Origin.INPUT)
            return memo[id(v)]
        if isinstance(v, (tuple, list)):
            return type(v)(conv(x) for x in v)
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        return v

    if isinstance(inputs, Mapping):
        return (), {k: conv(v) for k, v in inputs.items()}
    if isinstance(inputs, torch.Tensor):
        return (conv(inputs),), {}
    return tuple(conv(v) for v in inputs), {}


class _SavedScalars(TorchFunctionMode):
    """Count the Python numbers autograd keeps for the backward of ``x * 0.5`` and ``x / 2``.

    PyTorch wraps the number in an 8-byte CPU tensor and the backward node saves it until the
    node runs: real bytes of the CPU allocator that fake tensors never see (GPT-2's GELU keeps
    three per layer).
    """

    def __init__(self, mode: CountingFakeMode) -> None:
        super().__init__()
        self.mode = mode
        self.pending: list[Allocation] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in _SAVES_SCALAR and isinstance(out, torch.Tensor) and out.grad_fn is not None:
            numbers = [a for a in args if isinstance(a, (int, float, complex))
                       and not isinstance(a, bool)]
            if numbers and torch.is_grad_enabled():
                rec = self.mode.track_virtual(16 if isinstance(numbers[0], complex) else 8)
                self.pending.append(rec)
                out.grad_fn.register_hook(_release(self.mode, rec))
        return out

    def release_all(self) -> None:
        """The graph is gone after the backward: so are the scalars it held."""
        for rec in self.pending:
            self.mode.release(rec)
        self.pending.clear()


def _release(mode: CountingFakeMode, rec: Allocation) -> Callable[..., None]:
    def hook(*_: Any) -> None:
        mode.release(rec)

    return hook


_SAVES_SCALAR = {
    torch.mul, torch.Tensor.mul, torch.Tensor.mul_, torch.Tensor.__mul__, torch.Tensor.__rmul__,
    torch.Tensor.__imul__, torch.div, torch.Tensor.div, torch.Tensor.div_,
    torch.Tensor.__truediv__, torch.Tensor.__itruediv__, torch.true_divide,
}


def _grad_marker(mode: CountingFakeMode) -> Callable[[torch.Tensor], None]:
    def mark(p: torch.Tensor) -> None:
        if p.grad is not None:
            mode.track(p.grad, Origin.BACKWARD).is_grad = True

    return mark


def _mark_saved(mode: CountingFakeMode, scalars: _SavedScalars) -> None:
    """Forward-made storages still alive when the forward ends are activations."""
    for rec in (*mode.live.values(), *scalars.pending):
        if rec.origin is Origin.FORWARD and rec.freed < 0:
            rec.saved = True


def _module_bytes(mode: CountingFakeMode) -> dict[str, int]:
    out: dict[str, int] = {}
    for rec in mode.live.values():
        if rec.origin is Origin.FORWARD:
            out[rec.module] = out.get(rec.module, 0) + rec.nbytes
    return out


def _mark_state(mode: CountingFakeMode, optimizer: torch.optim.Optimizer) -> None:
    for st in optimizer.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                mode.track(v, Origin.OPTIMIZER).is_state = True
