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

The optimizer is built on the parameters that require grad (``Program.optimize_frozen``: on
all of them). Values the model reads from tensors are computed from real twins of its real
inputs (:class:`RealValues`); :mod:`modelsize.estimation.verify` runs this same program for
real, with the helpers here (:func:`caller`, :func:`checkpointed`, :func:`training_flags`).
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import gc
import os
import sys
import sysconfig
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
)
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_map
from torch.utils.weak import WeakIdKeyDictionary

from modelsize.errors import EstimateError, UsageError
from modelsize.estimation import quantized
from modelsize.estimation.optimizers import Implementation, OptimizerSpec, make_factory
from modelsize.estimation.tracker import (
    _META_QUERIES,
    Allocation,
    CountingFakeMode,
    Origin,
    parts,
    record_savers,
)

_ATEN = torch.ops.aten
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
    optimize_frozen: bool = False
    """Build the optimizer on every parameter, not only those that require grad."""
    gradient_checkpointing: Mapping[str, Any] | None = None
    """transformers' ``activation_checkpointing_enable(kwargs)`` (``gradient_checkpointing_enable``
    before 5.0) for the program, with these kwargs (``{}``: transformers' defaults)."""
    replay_blocks: bool = True
    """Replay repeated blocks from their real twins (:mod:`.block_replay`; exact, or the
    trace runs again without)."""
    replay_optimizer: bool = True
    """Replay the for-loop optimizer step of periodic parameters (:mod:`.optim_replay`;
    exact, or the trace runs again without)."""


@dataclass
class Trace:
    """The raw result of one traced program: the counting mode and a few facts about it."""

    mode: CountingFakeMode
    parameter_count: int
    trainable_count: int
    seconds: float
    module_activations: dict[str, int] = field(default_factory=dict)
    blocks: str = ""
    """How repeated blocks were traced (:class:`.block_replay.BlockSummary`)."""
    optimizer_replay: str = ""
    """How many parameters' optimizer steps were replayed (:mod:`.optim_replay`)."""


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
        if quantized.is_wrapper(t):  # a quantized weight's subclass: its inner tensors
            return quantized.fake_copy(t, self.copy)
        st = t.untyped_storage()
        self._keep.append(t)
        storage = self._storages.get(st._cdata)
        if storage is None:
            storage = torch.empty(st.nbytes(), dtype=torch.uint8, device="meta").untyped_storage()
            self._storages[st._cdata] = storage
        meta = torch.empty(0, dtype=t.dtype, device="meta")
        meta.set_(storage, t.storage_offset(), t.shape, t.stride())
        return self.mode.new_fake(meta, self.device)


@contextlib.contextmanager
def _module_names(mode: CountingFakeMode, model: nn.Module) -> Iterator[None]:
    names = {id(m): name for name, m in model.named_modules()}

    def pre(module: nn.Module, args: Any) -> None:
        mode.enter_module(names.get(id(module), type(module).__name__))

    def post(module: nn.Module, args: Any, output: Any) -> None:
        if mode.modules:
            mode.exit_module()

    h1 = nn.modules.module.register_module_forward_pre_hook(pre)
    h2 = nn.modules.module.register_module_forward_hook(post, always_call=True)
    try:
        yield
    finally:
        h1.remove()
        h2.remove()


@contextlib.contextmanager
def training_flags(model: nn.Module, training: bool) -> Iterator[None]:
    """``model.train(training)`` for the block; every module's own flag back afterwards."""
    saved = [(m, m.training) for m in model.modules()]
    try:
        model.train(training)
        yield
    finally:
        for m, flag in saved:
            m.training = flag


@contextlib.contextmanager
def checkpointed(model: nn.Module, patterns: Sequence[str],
                 real: bool = False) -> Iterator[list[str]]:
    """Wrap the ``forward`` of the modules matching ``patterns`` in non-reentrant checkpoint.

    Checkpoint keeps a copy of the CPU RNG state (``torch.get_rng_state()``) until the
    region's backward is done; a trace counts it through :mod:`modelsize.estimation.rng`, a
    real run (``real``) allocates it.
    """
    import torch.utils.checkpoint as cp

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
                return cp.checkpoint(__orig, *args, use_reentrant=False, **kwargs)

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


def uses_bitsandbytes(optimizer: OptimizerSpec) -> bool:
    """Whether ``optimizer`` names one of bitsandbytes' optimizers."""
    from modelsize.estimation.optimizers import BITSANDBYTES, parse_name

    return isinstance(optimizer, str) and parse_name(optimizer) in BITSANDBYTES


def transformers_model(model: nn.Module) -> nn.Module | None:
    """The outermost transformers ``PreTrainedModel`` in ``model`` (itself, or the model a
    peft ``PeftModel`` wraps), or None."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    return next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)


@contextlib.contextmanager
def hf_checkpointing(model: nn.Module, kwargs: Mapping[str, Any] | None) -> Iterator[None]:
    """Activation checkpointing switched on as transformers switches it on, for the block.

    ``activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)`` (transformers
    5; ``gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)`` before) on the
    transformers model in ``model``: each ``GradientCheckpointingLayer`` runs under
    ``torch.utils.checkpoint.checkpoint(**kwargs)`` (transformers' default when ``kwargs`` is
    empty: ``use_reentrant=False`` since 5.0, ``True`` before), and a model that takes
    ``input_ids`` gets ``enable_input_require_grads()`` (its embeddings' output requires grad,
    as a reentrant checkpoint needs for a frozen embedding). Every module's attributes and
    forward hooks are put back afterwards. ``kwargs`` None: nothing is done.
    """
    if kwargs is None:
        yield
        return
    hf = transformers_model(model)
    if hf is None or not getattr(hf, "supports_gradient_checkpointing", False):
        what = type(hf or model).__name__
        raise UsageError(f"gradient checkpointing: {what} is not a transformers model that "
                         "supports it; checkpoint its blocks with --checkpoint MODULES")
    saved: list[tuple[nn.Module, dict[str, Any], list[dict[Any, Any]]]] = [
        (m, dict(vars(m)), [dict(getattr(m, h)) for h in _HOOK_DICTS]) for m in model.modules()]
    enable: Any = getattr(hf, "activation_checkpointing_enable", None)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # the deprecated names, pre-5.0
            if enable is not None:
                enable(activation_checkpointing_kwargs=dict(kwargs) or None)
            else:
                old: Any = hf.gradient_checkpointing_enable
                old(gradient_checkpointing_kwargs=dict(kwargs) or None)
        yield
    finally:
        for m, attrs, hooks in saved:
            now = vars(m)
            for key in [k for k in now if k not in attrs]:
                del now[key]
            now.update(attrs)
            for name, before in zip(_HOOK_DICTS, hooks, strict=True):
                d = getattr(m, name)
                d.clear()
                d.update(before)


_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_forward_pre_hooks")


@contextlib.contextmanager
def real_run_branches(values: RealValues) -> Iterator[None]:
    """transformers' ``is_tracing(tensor)`` false for fake tensors whose values the trace
    knows (:class:`RealValues`).

    transformers takes any fake tensor for a compile or export trace and then takes branches a
    real run does not: it builds the packed-sequence ids and a causal mask that SDPA's
    ``is_causal`` would skip (8,192 bytes for a batch of 2 x 64 tokens). Harmless while the
    mask dies before the peak; a checkpointed layer keeps it as an input until its backward.
    Where the value is known, the real run's branch is traced (its test reads the twins);
    where it is not (meta inputs), transformers' traced branch stays.
    """
    with transformers_sees_real(lambda x: values.value_of(x) is not None):
        yield


@contextlib.contextmanager
def transformers_sees_real(real: Callable[[FakeTensor], bool]) -> Iterator[None]:
    """transformers' ``is_fake_tensor`` (behind ``is_tracing``) false for the fake tensors
    ``real`` accepts, as it is for the real run's tensors; unchanged for any other. Only
    where transformers is imported already (a model of its own imported it): importing it for
    another model's trace would cost a second."""
    import_utils: Any = sys.modules.get("transformers.utils.import_utils")
    if import_utils is None:
        yield
        return
    original = getattr(import_utils, "is_fake_tensor", None)
    if original is None:
        yield
        return

    def is_fake_tensor(x: Any) -> bool:
        if isinstance(x, FakeTensor) and real(x):
            return False
        return bool(original(x))

    import_utils.is_fake_tensor = is_fake_tensor
    try:
        yield
    finally:
        import_utils.is_fake_tensor = original


@contextlib.contextmanager
def _swapped_state(model: nn.Module, state: dict[str, torch.Tensor]) -> Iterator[None]:
    """The model's parameters and buffers are the fake copies for the whole program.

    Not just during each forward: activation checkpointing re-runs module code inside the
    backward, and that code must see the fake parameters too.
    """
    from torch.nn.utils.stateless import _reparametrize_module

    with _reparametrize_module(model, state, tie_weights=True, strict=False):
        yield


def fake_state(model: nn.Module, copier: _FakeCopier, mode: CountingFakeMode
               ) -> tuple[dict[int, torch.Tensor], dict[str, torch.Tensor], list[torch.Tensor]]:
    """Fake twins of ``model``'s parameters and buffers, tracked by ``mode`` (a tensor shared
    under several names gets one twin): the twins by the real tensor's id, the state dict to
    swap in, and the parameters once each, in order."""
    params, buffers = _states(model)
    fakes: dict[int, torch.Tensor] = {}
    state: dict[str, torch.Tensor] = {}
    unique: list[torch.Tensor] = []
    for name, p in params:
        if id(p) not in fakes:
            fp = _parameter(copier.copy(p.detach()), p.requires_grad)
            fakes[id(p)] = fp
            unique.append(fp)
            mode.track(fp, Origin.PARAMETER)
            for t in quantized.carry_state(p, fp, copier.copy):  # bitsandbytes' quant_state
                mode.track(t, Origin.PARAMETER)
        state[name] = fakes[id(p)]
    for name, b in buffers:
        if id(b) not in fakes:
            fakes[id(b)] = copier.copy(b)
            mode.track(fakes[id(b)], Origin.BUFFER)
        state[name] = fakes[id(b)]
    return fakes, state, unique


def _parameter(fake: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """``nn.Parameter(fake, requires_grad)`` for a fake tensor made for it alone.

    For a tensor subclass, ``nn.Parameter`` dispatches ``detach`` and sets ``_is_param`` on
    the alias (a Llama-3-70B's 723 parameters: 0.7 s through the fake mode); a new fake
    tensor no one else holds can take the flag itself: the same type, metadata, storage and
    attributes.
    """
    if type(fake) is not FakeTensor:  # a quantized weight's wrapper: its own detach
        return nn.Parameter(fake, requires_grad=requires_grad)
    fake.requires_grad_(requires_grad)
    fake._is_param = True  # what makes isinstance(fake, nn.Parameter) hold
    return fake


def _states(
    model: nn.Module,
) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, torch.Tensor]]]:
    params = list(model.named_parameters(remove_duplicate=False))
    buffers = [(n, b) for n, b in model.named_buffers(remove_duplicate=False) if b is not None]
    return params, buffers


@contextlib.contextmanager
def heap_out_of_sight() -> Iterator[None]:
    """What lives before a trace (the imports, the caller's objects) kept out of the cycle
    collector's passes during it (``gc.freeze``) and handed back after: a 70B trace makes
    millions of objects, and every full pass would walk torch's and transformers' modules
    again (0.9 s of its 10). Nothing is collected less: what the trace leaves in cycles is
    new, and the frozen objects are collected as usual once thawed. A caller that froze the
    heap itself keeps it frozen."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def run_trace(
    model: nn.Module,
    inputs: tuple[Any, ...] | Mapping[str, Any],
    program: Program,
    progress: ProgressFn | None = None,
) -> Trace:
    """Trace ``program`` on ``model`` with fake tensors and return the counting mode."""
    from modelsize.estimation.block_replay import BlockRetrace
    from modelsize.estimation.optim_replay import OptimizerRetrace

    blocks = (program.replay_blocks and not program.checkpoint
              and program.gradient_checkpointing is None)
    optim = program.replay_optimizer and program.mode == "train"
    start = time.perf_counter()
    block_note = optim_note = ""
    while True:
        try:
            with heap_out_of_sight():
                trace = _run_trace(model, inputs, program, progress, blocks, optim)
            break
        except BlockRetrace as exc:
            if not blocks:
                raise
            blocks = False
            block_note = f"traced again without block replay: {exc}"
        except OptimizerRetrace as exc:
            if not optim:
                raise
            optim = False
            optim_note = f"traced again without optimizer replay: {exc}"
    if block_note or optim_note:
        trace.seconds = time.perf_counter() - start
    if block_note:
        trace.blocks = block_note
    if optim_note:
        trace.optimizer_replay = optim_note
    return trace


def _run_trace(model: nn.Module, inputs: tuple[Any, ...] | Mapping[str, Any],
               program: Program, progress: ProgressFn | None, blocks: bool,
               optim: bool = False) -> Trace:
    from modelsize.estimation import scratch as scratch_models
    from modelsize.estimation.block_replay import BlockReplay, find_cache
    from modelsize.estimation.optim_replay import OptimizerReplay

    if program.mode not in ("train", "infer"):
        raise UsageError(f"mode must be 'train' or 'infer', not {program.mode!r}")
    if program.accumulate < 1 or program.steps < 1:
        raise UsageError("steps and accumulate must be at least 1")
    device = torch.device(program.device)
    table = scratch_models.table(device.type) if program.scratch else None
    mode = CountingFakeMode(scratch=table)
    mode.counting = False
    copier = _FakeCopier(mode, torch.device("cpu"))
    fakes, state, unique_params = fake_state(model, copier, mode)
    values = RealValues()
    mode.real_values = values
    args, kwargs = _fake_inputs(inputs, copier, fakes, mode, values)
    del fakes
    train = program.mode == "train"
    n_params = sum(p.numel() for p in unique_params)
    n_train = sum(p.numel() for p in unique_params if p.requires_grad)
    optimized = [p for p in unique_params if program.optimize_frozen or p.requires_grad]
    if train and not any(p.requires_grad for p in unique_params):
        raise EstimateError("the loss does not require grad: no parameter is trainable")
    loss_fn = program.loss or default_loss
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        stack.enter_context(training_flags(model, train))
        stack.enter_context(_swapped_state(model, state))
        stack.enter_context(quantized.layer_states(
            model, copier.copy, lambda t: mode.track(t, Origin.PARAMETER)))
        stack.enter_context(checkpointed(model, program.checkpoint if train else ()))
        stack.enter_context(hf_checkpointing(model, program.gradient_checkpointing
                                             if train else None))
        stack.enter_context(_module_names(mode, model))
        stack.enter_context(mode)
        stack.enter_context(values)
        stack.enter_context(real_run_branches(values))
        scalars = _SavedScalars(mode, enabled=train and device.type == "cpu")
        if train and device.type == "cpu":
            from modelsize.estimation.bnb_optim import cpu_kernels

            stack.enter_context(cpu_kernels(uses_bitsandbytes(program.optimizer)))
        if device.type == "cuda":
            from modelsize.estimation.cuda_kernels import CudaKernelChoices

            stack.enter_context(CudaKernelChoices())
            if program.amp is not None:
                from modelsize.estimation.cuda_autocast import cuda_policy

                stack.enter_context(cuda_policy())
        call = caller(model, args, kwargs, program.amp)
        if train:
            for leaf in unique_params:
                if leaf.requires_grad:
                    leaf.register_post_accumulate_grad_hook(_grad_marker(mode))
        # (the no_grad replay of generation keeps only what a generation estimate reads:
        # not the op, shape and sources of a record freed inside a block)
        repeated = BlockReplay(mode, model, values=values, cache_of=find_cache,
                               enabled=blocks and train, training=train)
        stack.enter_context(repeated.installed())
        steps = OptimizerReplay(mode)
        if optim and train:
            stack.enter_context(steps.installed())
        module_acts = trace_program(
            mode, program, call, loss_fn, scalars, progress,
            lambda: make_factory(program.optimizer, program.implementation,
                                 device.type)(optimized),
            after_backward=repeated.finish_backward)
        if not train:
            repeated.finish()
        mode.counting = False
        mode.end_program()
    seconds = time.perf_counter() - start
    trace = Trace(mode, n_params, n_train, seconds, module_acts)
    trace.blocks = repeated.summary.describe()
    if steps.skipped:
        trace.optimizer_replay = (f"the optimizer step of {steps.skipped} parameters "
                                  "replayed")
    return trace


def trace_program(mode: CountingFakeMode, program: Program, call: Callable[[], Any],
                  loss_fn: LossFn, scalars: _SavedScalars, progress: ProgressFn | None,
                  make_optimizer: Callable[[], torch.optim.Optimizer], *,
                  after_backward: Callable[[], None] = lambda: None,
                  local: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
                  ) -> dict[str, int]:
    """Run ``program`` under ``mode``, counting: one forward under ``no_grad``, or its
    training steps (forward and loss, backward and ``after_backward`` per micro-batch, then
    the optimizer's step and ``zero_grad``), each a phase. Returns the forward activations by
    module. ``local`` maps an optimizer state tensor to the tensor it allocates (a DTensor's
    local shard)."""
    label = ["forward"]
    if progress is not None:
        mode.progress = lambda tick: progress(label[0], tick)
    mode.counting = True
    module_acts: dict[str, int] = {}
    if program.mode != "train":
        mode.begin_phase("forward", 1)
        mode.origin = Origin.FORWARD
        with torch.no_grad():
            out = call()
        _mark_saved(mode, scalars)
        module_acts = _module_bytes(mode)
        del out
        mode.end_phase()
        return module_acts
    optimizer = make_optimizer()
    for step in range(1, program.steps + 1):
        for micro in range(1, program.accumulate + 1):
            label[0] = f"step {step}/{program.steps}"
            mode.begin_phase("forward", step, micro)
            mode.origin = Origin.FORWARD
            with scalars.counting():
                loss = _forward_loss(call, loss_fn)
            _mark_saved(mode, scalars, loss)
            if step == 1 and micro == 1:
                module_acts = _module_bytes(mode)
            mode.begin_phase("backward", step, micro)
            mode.origin = Origin.BACKWARD
            loss.backward()
            del loss
            scalars.release_all()
            after_backward()
        mode.begin_phase("optimizer", step)
        mode.origin = Origin.OPTIMIZER
        optimizer.step()
        _mark_state(mode, optimizer, local)
        mode.begin_phase("zero_grad", step)
        optimizer.zero_grad(set_to_none=True)
        mode.end_phase()
    del optimizer
    return module_acts


def _forward_loss(call: Callable[[], Any], loss_fn: LossFn) -> torch.Tensor:
    out = call()
    loss = loss_fn(out)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise EstimateError("the loss must be a one-element tensor")
    if not loss.requires_grad:
        raise EstimateError("the loss does not require grad: no parameter is trainable")
    return loss


def caller(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
           amp: torch.dtype | None) -> Callable[[], Any]:
    """``model(*args, **kwargs)`` as a thunk, under CPU autocast to ``amp`` when given."""
    def call() -> Any:
        # The trace runs CPU kernels whatever the target device, so CPU autocast it is (with
        # CUDA's op lists in a trace for CUDA: cuda_autocast.cuda_policy).
        ctx = (torch.autocast("cpu", dtype=amp) if amp is not None
               else contextlib.nullcontext())
        with ctx:
            return model(*args, **kwargs)

    return call


def map_inputs(inputs: Any, leaf: Callable[[torch.Tensor], Any]
               ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` of the model call, each tensor in ``inputs`` (nested in tuples, lists
    and dicts) replaced by ``leaf(tensor)``, once per tensor object (a tensor passed twice stays
    one tensor)."""
    memo: dict[int, Any] = {}

    def conv(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            if id(v) not in memo:
                memo[id(v)] = leaf(v)
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


def _fake_inputs(inputs: tuple[Any, ...] | Mapping[str, Any], copier: _FakeCopier,
                 memo: dict[int, torch.Tensor], mode: CountingFakeMode,
                 values: RealValues) -> tuple[tuple[Any, ...], dict[str, Any]]:
    def leaf(v: torch.Tensor) -> torch.Tensor:
        if id(v) not in memo:  # an input that is also a parameter or buffer keeps its fake
            memo[id(v)] = copier.copy(v.detach())
            mode.track(memo[id(v)], Origin.INPUT)
            if not isinstance(v, FakeTensor):
                values.add(memo[id(v)], v)
        return memo[id(v)]

    return map_inputs(inputs, leaf)


class _SavedScalars(TorchFunctionMode):
    """Count the Python numbers autograd keeps for the backward of ``x * 0.5`` and ``x / 2``.

    PyTorch wraps the number in an 8-byte CPU tensor and the backward node saves it until the
    node runs: real bytes of the CPU allocator that fake tensors never see (GPT-2's GELU keeps
    three per layer).

    Active only around a training step's forward and loss (:meth:`counting`): nothing after
    it records a graph (the backward without ``create_graph``, the optimizer step and
    ``zero_grad`` run without grad), and a torch-function mode costs a call into Python for
    every torch function and tensor attribute read, the trace's own bookkeeping included
    (0.85 s of a 7 s Llama-3-70B estimate when the mode spanned the whole program).
    """

    def __init__(self, mode: CountingFakeMode, enabled: bool = True) -> None:
        super().__init__()
        self.mode = mode
        self.enabled = enabled
        self.pending: list[Allocation] = []

    def counting(self) -> contextlib.AbstractContextManager[Any]:
        """This mode, entered for a forward and loss where enabled (else nothing)."""
        return self if self.enabled else contextlib.nullcontext()

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in _SAVES_SCALAR and isinstance(out, torch.Tensor) and out.grad_fn is not None:
            numbers = [a for a in args if isinstance(a, (int, float, complex))
                       and not isinstance(a, bool)]
            if numbers and torch.is_grad_enabled():
                rec = self.mode.track_virtual(16 if isinstance(numbers[0], complex) else 8)
                rec.op, rec.saved_by = "wrapped scalar", (out.grad_fn.name(),)
                rec.dtype = torch.complex128 if rec.nbytes == 16 else torch.float64
                self.pending.append(rec)
                out.grad_fn.register_hook(_release(self.mode, rec))
        return out

    def release_all(self) -> None:
        """The graph is gone after the backward: so are the scalars it held."""
        for rec in self.pending:
            self.mode.release(rec)
        self.pending.clear()


def _storage_keys(t: torch.Tensor) -> set[int]:
    """The storages holding ``t`` (a sparse tensor's indices and values: two)."""
    return {p.untyped_storage()._cdata for p in parts(t)}


class ValueReadError(RuntimeError):
    """The model read a tensor's value that the trace cannot know (one line, user's code named)."""


#: Ops that make a tensor from nothing but their arguments, with values a real run would give.
_VALUE_FACTORIES = frozenset({
    _ATEN.arange, _ATEN.full, _ATEN.zeros, _ATEN.ones, _ATEN.scalar_tensor, _ATEN.linspace,
    _ATEN.eye, _ATEN.lift_fresh, _ATEN.lift_fresh_copy, _ATEN.zeros_like, _ATEN.ones_like,
    _ATEN.full_like,
})


class _NoTwin(Exception):
    """A tensor argument has no real twin."""


def leaves(x: Any) -> list[Any]:
    """The leaves of an op's arguments or outputs (nested tuples, lists and dicts), in
    order: :func:`torch.utils._pytree.tree_leaves` for what ops take and return, without
    its generic node lookups (a trace calls this for most ops)."""
    t = type(x)
    if t is tuple or t is list or t is torch.Size:
        out: list[Any] = []
        for y in x:
            ty = type(y)
            if ty is tuple or ty is list or ty is dict or ty is torch.Size:
                out += leaves(y)
            elif y is not None:
                out.append(y)
        return out
    if isinstance(x, dict):
        return leaves(tuple(x.values()))
    return [] if x is None else [x]


#: A real twin is computed for an op only while its outputs stay under this many bytes.
VALUE_LIMIT = 16 * 2**20


class RealValues(TorchDispatchMode):
    """The values of the tensors that derive only from the caller's real inputs.

    Fake tensors have shapes, not values, so ``if labels.max() >= vocab_size:`` (a
    ``_local_scalar_dense``) or ``labels.masked_select(mask)`` (an output shape that depends
    on the data) cannot run on them. This mode sits above the counting mode and keeps a real
    twin of every fake tensor computed only from real inputs and constants (``arange``,
    ``full``...): each such op runs a second time, for real, on the twins. Reads are answered
    from the twins, and data-dependent shapes come from the real result. Twins are real
    memory, so an op whose outputs exceed :data:`VALUE_LIMIT` gets none, nor do random ops
    (the caller's RNG is left alone). The counting mode never sees the twins.

    A value the twins cannot give raises :class:`ValueReadError` naming the model's line.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # as CountingFakeMode: no wrapper around __torch_dispatch__

    def __init__(self) -> None:
        super().__init__()
        self.values: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.random: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.real_inputs = 0
        self.value_limit = VALUE_LIMIT  # a program with larger real inputs raises it
        self._ops: dict[Any, tuple[bool, bool, tuple[int, ...]]] = {}
        self._storages: set[int] = set()  # fake storages some twin belongs to

    def add(self, fake: torch.Tensor, real: torch.Tensor) -> None:
        """Give ``fake`` the value ``real`` (a private copy: twins may be written in place)."""
        if real.device.type != "meta" and real.nbytes <= self.value_limit:
            self._set(fake, real.detach().to("cpu", copy=True))
            self.real_inputs += 1

    def _set(self, fake: torch.Tensor, real: torch.Tensor) -> None:
        self.values[fake] = real
        self._storages.update(_storage_keys(fake))

    def value_of(self, t: Any) -> torch.Tensor | None:
        """The real value behind ``t``, or None."""
        if isinstance(t, FakeTensor):
            return self.values.get(t)
        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and not (
                quantized.is_wrapper(t) and any(isinstance(v, FakeTensor)
                                                for v in quantized.inner_tensors(t))):
            # a real constant the program made outside the fake mode (not a quantized
            # weight's fake twin: running an op on it again would count its kernel twice)
            return t
        return None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        query = _META_QUERIES.get(func)
        if query is not None:  # a fake tensor's device, sizes, ...: no value to follow
            if len(args) == 1 and type(args[0]) is FakeTensor and not kwargs:
                return query(args)  # FakeTensorMode's answer, without the modes below
            return func(*args, **(kwargs or {}))
        kwargs = kwargs or {}
        if func is _ATEN._local_scalar_dense.default:
            real = self.value_of(args[0])
            if real is not None:
                with _disable_current_modes():
                    return real.item()
        try:
            out = func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            return self._data_dependent(func, args, kwargs)
        self._follow(func, args, kwargs, out)
        return out

    # -- twins ------------------------------------------------------------------------------

    def _op(self, func: Any) -> tuple[bool, bool, tuple[int, ...]]:
        """Whether ``func`` draws random numbers, whether it makes values from nothing, and
        the arguments it writes (read once per op from its tags and schema)."""
        info = self._ops.get(func)
        if info is None:
            info = (torch.Tag.nondeterministic_seeded in func.tags,
                    func.overloadpacket in _VALUE_FACTORIES,
                    tuple(i for i, a in enumerate(func._schema.arguments)
                          if a.alias_info is not None and a.alias_info.is_write))
            self._ops[func] = info
        return info

    def _real_args(self, func: Any, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        """``args`` and ``kwargs`` with every tensor replaced by its twin, or None."""
        seeded, factory, _ = self._op(func)
        if seeded:
            return None
        values = self.values
        for x in args:  # fast path: most ops take an activation or a weight first
            if isinstance(x, FakeTensor) and (not values or x not in values):
                return None
            if isinstance(x, (list, tuple)):  # a foreach op's tensor list
                for y in x:
                    if isinstance(y, FakeTensor) and (not values or y not in values):
                        return None
        found = 0
        value_of = self.value_of

        def real(x: Any) -> Any:  # x with its tensors' twins (tree_map, for op arguments)
            nonlocal found
            t = type(x)
            if t is tuple or t is list:
                return t(real(y) for y in x)
            if t is dict:
                return {k: real(y) for k, y in x.items()}
            if isinstance(x, torch.Tensor):
                v = value_of(x)
                if v is None:
                    raise _NoTwin
                found += 1
                return v
            return x

        try:
            out = real(args), real(dict(kwargs))
        except _NoTwin:
            return None
        if not found and not factory:
            return None
        return out

    def _run_real(self, func: Any, real: tuple[Any, Any]) -> Any:
        args, kwargs = real
        if "device" in kwargs:
            kwargs = {**kwargs, "device": torch.device("cpu")}
        with _disable_current_modes(), torch.no_grad(), torch.autocast("cpu", enabled=False):
            return func(*args, **kwargs)

    def _follow(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        real = self._real_args(func, args, kwargs)
        if real is not None and sum(p.untyped_storage().nbytes() for t in leaves(out)
                                    if isinstance(t, FakeTensor) for p in parts(t)
                                    ) > self.value_limit:
            real = None
        if real is None:
            written = self._written(func, args, kwargs)
            for t in written:
                self._forget(t)
            if self._random(func, args, kwargs):
                fakes = [t for t in leaves(out) if isinstance(t, FakeTensor)]
                for t in (*fakes, *written):
                    self.random[t] = True
            return
        real_out = self._run_real(func, real)
        for f, r in zip(leaves(out), leaves(real_out), strict=False):
            if isinstance(f, FakeTensor) and isinstance(r, torch.Tensor):
                self._set(f, r)

    def _random(self, func: Any, args: Any, kwargs: Any) -> bool:
        """Whether the op's outputs are random numbers, or computed from them and real values."""
        seeded = self._op(func)[0]
        if not seeded and not self.random:
            return False
        fakes = [x for x in leaves((args, kwargs)) if isinstance(x, FakeTensor)]
        if not seeded and not any(
                x in self.random for x in fakes):
            return False
        return all(x in self.random or x in self.values for x in fakes)

    def _written(self, func: Any, args: Any, kwargs: Any) -> list[torch.Tensor]:
        idx = self._op(func)[2]
        if not idx or not self._storages:
            return []
        names = [a.name for a in func._schema.arguments]
        out: list[torch.Tensor] = []
        for i in idx:
            v = args[i] if i < len(args) else kwargs.get(names[i])
            out += [t for t in leaves(v) if isinstance(t, FakeTensor)]
        return out

    def _forget(self, t: torch.Tensor) -> None:
        """``t`` was written with values we do not have: it and its aliases lose their twins."""
        keys = _storage_keys(t)
        if not keys & self._storages:
            return
        for k in list(self.values.keys()):
            if _storage_keys(k) & keys:
                del self.values[k]

    # -- data-dependent ops -----------------------------------------------------------------

    def _data_dependent(self, func: Any, args: Any, kwargs: Any) -> Any:
        real = self._real_args(func, args, kwargs)
        if real is not None:
            real_out = self._run_real(func, real)
            return tree_map(self._fake_of, real_out)
        if func in _INDEX_OPS and self._masks_known(args[1]):
            return func(args[0], self._mask_indices(args[1]), *args[2:], **kwargs)
        sibling = _int_list_overload(func)
        if sibling is not None:
            op, positions = sibling
            lists = [self.value_of(args[i]) if i < len(args) else None for i in positions]
            if all(v is not None and v.dim() == 1 for v in lists):
                new = list(args)
                for i, v in zip(positions, lists, strict=True):
                    assert v is not None
                    with _disable_current_modes():
                        new[i] = v.tolist()
                if torch.Tag.dynamic_output_shape in op.tags:
                    return self._via_meta(op, new, kwargs)
                return op(*new, **kwargs)
        raise ValueReadError(self._message(func, args))

    def _via_meta(self, func: Any, args: Any, kwargs: Any) -> Any:
        """Outputs shaped by ``func``'s meta kernel (the fake mode refuses any op tagged
        with a dynamic output shape, even one whose shape its arguments now fix)."""
        def meta(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
            return x

        with _disable_current_modes():
            out = func(*tree_map(meta, args), **tree_map(meta, kwargs))
        return tree_map(self._fake_of, out)

    def _fake_of(self, r: Any) -> Any:
        """A fake tensor (counted) shaped like ``r``; a real ``r`` becomes its twin."""
        if not isinstance(r, torch.Tensor):
            return r
        fake = torch.empty_strided(r.shape, r.stride(), dtype=r.dtype, device="cpu")
        if r.device.type == "cpu":
            self._set(fake, r)
        return fake

    def _masks_known(self, indices: Sequence[Any]) -> bool:
        masks = [i for i in indices if isinstance(i, torch.Tensor)
                 and i.dtype in (torch.bool, torch.uint8)]
        return bool(masks) and all(self.value_of(m) is not None for m in masks)

    def _mask_indices(self, indices: Sequence[Any]) -> list[Any]:
        """Boolean masks replaced by the long indices ATen makes of them (``nonzero``)."""
        out: list[Any] = []
        for i in indices:
            if isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8):
                real = self.value_of(i)
                assert real is not None
                nz = self._fake_of(self._run_real(_ATEN.nonzero.default, ((real,), {})))
                out += list(nz.unbind(1))
            else:
                out.append(i)
        return out

    def _message(self, func: Any, args: Any) -> str:
        where = user_code()
        what = ("reads a tensor's value" if func is _ATEN._local_scalar_dense.default
                else f"calls {func.overloadpacket.__name__}, whose output shape depends on "
                "tensor values,")
        if any(isinstance(a, FakeTensor) and a in self.random for a in args):
            why = ("that value is random (a random draw decides, as in LayerDrop), so no "
                   "trace knows it; make it deterministic for the estimate (with LayerDrop "
                   "off every layer runs: the largest peak)")
        elif self.real_inputs:
            why = ("that value depends on the weights or activations, which a trace does not "
                   "compute (only values derived from the real inputs are); make the branch "
                   "independent of tensor values, or estimate each branch separately")
        else:
            why = ("the inputs are meta or fake tensors, so no value is known; pass real "
                   "input tensors (modelsize.estimate(model, inputs) with your data) and "
                   "modelsize computes values derived from them")
        return f"the model {what} at {where}: {why}"


_INDEX_OPS = frozenset({_ATEN.index.Tensor, _ATEN.index_put.default, _ATEN.index_put_.default,
                        _ATEN._unsafe_index_put.default})


@functools.cache
def _int_list_overload(func: Any) -> tuple[Any, tuple[int, ...]] | None:
    """The overload of ``func`` that takes ``int[]`` where ``func`` takes a Tensor of values.

    ``_ctc_loss.Tensor`` has no fake implementation; ``_ctc_loss.default``, which takes the
    lengths as lists, has one, and the real kernel makes the same lists of the tensors.
    """
    packet = func.overloadpacket
    ours = func._schema.arguments
    for name in packet.overloads():
        other = getattr(packet, name)
        theirs = other._schema.arguments
        if other is func or len(theirs) != len(ours):
            continue
        positions = []
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            if a.name != b.name:
                break
            if str(a.type) == str(b.type):
                continue
            if str(a.type) == "Tensor" and str(b.type) == "List[int]":
                positions.append(i)
                continue
            break
        else:
            if positions:
                return other, tuple(positions)
    return None


def user_code(frames: Sequence[traceback.FrameSummary] | None = None) -> str:
    """``file:line (`code`)`` of the innermost frame outside torch, modelsize and Python."""
    if frames is None:
        frames = traceback.extract_stack()
    skip = (str(Path(torch.__file__).parent) + os.sep, str(Path(__file__).parents[1]) + os.sep)
    stdlib = sysconfig.get_paths()["stdlib"] + os.sep
    for f in reversed(frames):
        if f.filename.startswith(skip) or f.filename.startswith("<"):
            continue
        if f.filename.startswith(stdlib) and "-packages" + os.sep not in f.filename:
            continue
        code = f" (`{f.line.strip()}`)" if f.line else ""
        return f"{f.filename}:{f.lineno}{code}"
    return "an unknown line"


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
            mode.track(p.grad, Origin.BACKWARD)
            for rec in mode.allocations_of(p.grad):  # a sparse gradient's indices and values
                rec.is_grad = True

    return mark


def _mark_saved(mode: CountingFakeMode, scalars: _SavedScalars,
                loss: torch.Tensor | None = None) -> None:
    """Forward-made storages still alive when the forward ends are activations; with the
    ``loss``, each gets the autograd nodes that keep it (:func:`record_savers`)."""
    for rec in (*mode.live.values(), *scalars.pending):
        if rec.origin is Origin.FORWARD and rec.freed < 0:
            rec.saved = True
    if loss is not None:
        record_savers(mode, (loss,))


def _module_bytes(mode: CountingFakeMode) -> dict[str, int]:
    out: dict[str, int] = {}
    for rec in mode.live.values():
        if rec.origin is Origin.FORWARD:
            out[rec.module] = out.get(rec.module, 0) + rec.nbytes
    return out


def _mark_state(mode: CountingFakeMode, optimizer: torch.optim.Optimizer,
                local: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> None:
    for st in optimizer.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                mode.track(local(v), Origin.OPTIMIZER)
                for rec in mode.allocations_of(local(v)):
                    rec.is_state = True
