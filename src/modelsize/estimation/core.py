"""``estimate()``: trace the program, then read the peak and what it is made of."""

from __future__ import annotations

import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

from modelsize.errors import EstimateError, ModelSizeError, UsageError
from modelsize.estimation.device import device_estimate
from modelsize.estimation.optimizers import (
    Implementation,
    OptimizerName,
    OptimizerSpec,
    default_implementation,
    describe,
    parse_implementation,
    parse_name,
)
from modelsize.estimation.parallel import Parallel
from modelsize.estimation.result import (
    Estimate,
    MemoryCategory,
    PhaseSpan,
    Setup,
    Source,
    Verification,
)
from modelsize.estimation.saved import saved_for_backward
from modelsize.estimation.trace import Program, Trace, run_trace, user_code
from modelsize.estimation.tracker import Allocation, Origin
from modelsize.estimation.verify import RandomState, resize_batch, verify

_AMP = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
        "fp16": torch.float16, "float16": torch.float16, "half": torch.float16}
_MATMUL = ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product", "convolution")
TIMELINE_POINTS = 1000


def parse_amp(amp: str | torch.dtype | None) -> torch.dtype | None:
    """``"bf16"`` / ``"fp16"`` / a dtype / None to the autocast dtype."""
    if amp is None or isinstance(amp, torch.dtype):
        return amp
    try:
        return _AMP[amp.lower()]
    except KeyError:
        raise UsageError(f"unknown amp dtype {amp!r}: expected bf16 or fp16") from None


def estimate(
    model: nn.Module,
    inputs: Any,
    *,
    mode: str = "train",
    optimizer: OptimizerSpec | None = None,
    loss: Callable[[Any], torch.Tensor] | None = None,
    amp: str | torch.dtype | None = None,
    device: str | None = None,
    implementation: str | None = None,
    accumulate: int = 1,
    checkpoint: Sequence[str] = (),
    steps: int | None = None,
    optimize_frozen: bool = False,
    verify: bool = False,
    verify_budget: int | None = None,
    name: str | None = None,
    progress: Callable[[str, int], None] | None = None,
    parallel: Parallel | None = None,
    new_tokens: int | None = None,
    generation: Mapping[str, Any] | None = None,
    quantize: str | None = None,
    lora: Any = None,
    gradient_checkpointing: bool | Mapping[str, Any] | None = False,
) -> Estimate:
    """See :func:`modelsize.estimation.estimate`."""
    if not isinstance(model, nn.Module):
        raise UsageError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    from modelsize.estimation.quantized import kernels_for, quantize_copy

    if quantize is not None:
        model = quantize_copy(model, quantize)
    extra_notes: list[str] = []
    if lora is not None:
        from modelsize.estimation import lora as lora_mod

        spec = lora_mod.parse_lora(lora)
        name = name or type(model).__name__
        model = lora_mod.adapted_copy(model, spec)
        extra_notes.append(lora_mod.describe(model, spec))
    if mode == "generate" or new_tokens is not None or generation is not None:
        from modelsize.estimation.generate import estimate_api

        with kernels_for(model, device):
            est = estimate_api(
                model, inputs, mode=mode, new_tokens=new_tokens, generation=generation,
                device=device, amp=parse_amp(amp), verify=verify, verify_budget=verify_budget,
                name=name, progress=progress,
                unused={"optimizer": optimizer is not None, "loss": loss is not None,
                        "implementation": implementation is not None,
                        "accumulate": accumulate != 1, "checkpoint": bool(checkpoint),
                        "steps": steps is not None, "optimize_frozen": optimize_frozen,
                        "parallel": parallel is not None,
                        "gradient_checkpointing": bool(gradient_checkpointing)})
        return with_quantization_notes(est, model, device)
    sources = {"device": Source.DEFAULT if device is None else Source.GIVEN,
               "optimizer": Source.DEFAULT if optimizer is None else Source.GIVEN}
    settings = Settings(
        mode=mode, optimizer=DEFAULT_OPTIMIZER if optimizer is None else optimizer, loss=loss,
        amp=amp, device=DEFAULT_DEVICE if device is None else device,
        implementation=implementation, accumulate=accumulate,
        checkpoint=(checkpoint,) if isinstance(checkpoint, str) else tuple(checkpoint),
        steps=steps, optimize_frozen=optimize_frozen,
        gradient_checkpointing=_hf_checkpointing_kwargs(gradient_checkpointing),
    )
    program = settings.program()
    if (program.mode == "train" and program.device == "cuda"
            and isinstance(program.optimizer, str)
            and parse_name(program.optimizer) is OptimizerName.PAGED_ADAMW8BIT):
        from modelsize.estimation.bnb_optim import paged_note

        extra_notes.append(paged_note(p.numel() for p in model.parameters()
                                      if optimize_frozen or p.requires_grad))
    if program.gradient_checkpointing is not None and program.mode == "train":
        args = ", ".join(f"{k}={v!r}" for k, v in program.gradient_checkpointing.items())
        extra_notes.append(f"activation checkpointing as transformers switches it on: "
                           f"activation_checkpointing_enable({args or 'its defaults'})")
    described = _describe_inputs(inputs)
    start = RandomState.capture()  # model code may draw from NumPy or random: put them back
    label = name or type(model).__name__
    if parallel is not None:
        if not isinstance(parallel, Parallel):
            raise UsageError(f"parallel must be a Parallel, not {type(parallel).__name__}")
        if verify:
            from modelsize.estimation.parallel_trace import check_verifiable

            check_verifiable(parallel)
    try:
        if parallel is not None:
            from modelsize.estimation.parallel_trace import estimate_parallel, verify_rank

            with kernels_for(model, settings.device):
                est = estimate_parallel(model, inputs, program, parallel, label, described,
                                        sources, progress)
            if verify:
                est = replace(est, verification=verify_rank(model, inputs, settings, parallel,
                                                            est, verify_budget))
            return _noted(with_quantization_notes(replace(est, setup=replace(
                est.setup, dtype=weights_dtype(model),
                quantization=quantization_label(model))), model, settings.device), extra_notes)
        with kernels_for(model, settings.device):
            trace = run_trace(model, inputs, program, progress)
    except ModelSizeError:
        raise
    except (DataDependentOutputException, DynamicOutputShapeException) as exc:
        where = user_code(traceback.extract_tb(exc.__traceback__))
        raise EstimateError(f"tracing {label} failed: the model needs tensor values "
                            f"({exc.func}) at {where}, which the trace does not have") from exc
    except (RuntimeError, TypeError, ValueError, NotImplementedError, AttributeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise EstimateError(f"tracing {label} failed: {first}") from exc
    finally:
        start.restore()
    est = summarize(trace, program, label, described, sources)
    est = with_quantization_notes(replace(est, setup=replace(
        est.setup, dtype=weights_dtype(model), quantization=quantization_label(model))),
        model, settings.device)
    if verify:
        batch, resize = resize_batch(inputs)
        known = est.peak_bytes if settings.device == "cpu" else None
        est = replace(est, verification=verification(
            model, inputs, settings, estimated=known, batch=batch, resize=resize,
            budget=verify_budget, start=start))
    return _noted(est, extra_notes)


def _noted(est: Estimate, notes: list[str]) -> Estimate:
    return replace(est, notes=(*est.notes, *notes)) if notes else est


def _hf_checkpointing_kwargs(value: bool | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``gradient_checkpointing``: False/None off, True transformers' defaults, a mapping
    the checkpoint kwargs (``{"use_reentrant": True}``)."""
    if value is None or value is False:
        return None
    if value is True:
        return {}
    if isinstance(value, Mapping):
        return dict(value)
    raise UsageError("gradient_checkpointing must be True, False or a dict of checkpoint "
                     f"arguments, not {type(value).__name__}")


DEFAULT_DEVICE = "cpu"
DEFAULT_OPTIMIZER = "adamw"


def quantization_label(model: nn.Module) -> str:
    """What :func:`modelsize.estimation.quantized.quantization_of` says of ``model``, as
    the report shows it (``""`` when no weight is quantized)."""
    from modelsize.estimation.quantized import quantization_of

    found = quantization_of(model)
    return found.label() if found is not None else ""


def with_quantization_notes(est: Estimate, model: nn.Module, device: str | None) -> Estimate:
    """``est`` with :func:`modelsize.estimation.quantized.notes` of ``model`` added."""
    from modelsize.estimation.quantized import notes

    more = notes(model, device)
    setup = replace(est.setup, quantization=est.setup.quantization or quantization_label(model))
    return replace(est, setup=setup, notes=(*est.notes, *more))


def weights_dtype(model: nn.Module) -> str:
    """The dtype of ``model``'s floating-point parameters: one name, or the names joined by
    ``+`` (most elements first) when they differ; ``""`` when it has none."""
    counts: dict[str, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            name = str(p.dtype).removeprefix("torch.")
            counts[name] = counts.get(name, 0) + p.numel()
    return "+".join(sorted(counts, key=lambda k: -counts[k]))


@dataclass(frozen=True)
class Settings:
    """The arguments of :func:`estimate` that define the program, defaults resolved."""

    mode: str
    optimizer: OptimizerSpec
    loss: Callable[[Any], torch.Tensor] | None
    amp: str | torch.dtype | None
    device: str
    implementation: str | None
    accumulate: int
    checkpoint: tuple[str, ...]
    steps: int | None
    optimize_frozen: bool
    gradient_checkpointing: Mapping[str, Any] | None = None

    def program(self) -> Program:
        """The validated :class:`Program`."""
        if self.device not in ("cpu", "cuda"):
            raise UsageError(f"device must be 'cpu' or 'cuda', not {self.device!r}")
        return Program(
            mode=self.mode,
            optimizer=self.optimizer,
            implementation=parse_implementation(self.implementation),
            loss=self.loss,
            amp=parse_amp(self.amp),
            device=self.device,
            steps=self.steps if self.steps is not None else (2 if self.mode == "train" else 1),
            accumulate=self.accumulate,
            checkpoint=self.checkpoint,
            optimize_frozen=self.optimize_frozen,
            gradient_checkpointing=self.gradient_checkpointing,
        )

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments that make :func:`estimate` trace this program again."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def verification(model: nn.Module, inputs: Any, settings: Settings, *,
                 estimated: int | None = None, batch: int | None = None,
                 resize: Callable[[int], Any] | None = None, budget: int | None = None,
                 start: RandomState | None = None) -> Verification:
    """Run the program of ``settings`` for real on CPU and compare it with its CPU estimate.

    An estimate for CUDA is compared through the same program traced for CPU, with the
    optimizer implementation CUDA would use; ``estimated`` is that CPU estimate's peak for
    ``inputs`` when already known (see :func:`modelsize.estimation.verify.verify`).
    """
    program = settings.program()
    impl = program.implementation
    if impl is Implementation.DEFAULT:
        impl = default_implementation(settings.device)
    cpu = replace(settings, device="cpu", implementation=str(impl))

    def estimate_at(inp: Any) -> int:
        return estimate(model, inp, **cpu.kwargs()).peak_bytes

    return verify(model, inputs, cpu.program(), estimate_at, estimated=estimated, batch=batch,
                  resize=resize, budget=budget, start=start)


def classify(rec: Allocation) -> MemoryCategory:
    """The category of one storage live at the peak."""
    if rec.origin is Origin.PARAMETER:
        return MemoryCategory.PARAMETERS
    if rec.origin is Origin.BUFFER:
        return MemoryCategory.BUFFERS
    if rec.origin is Origin.INPUT:
        return MemoryCategory.INPUTS
    if rec.is_grad:
        return MemoryCategory.GRADIENTS
    if rec.is_state:
        return MemoryCategory.OPTIMIZER_STATE
    if (rec.origin is Origin.FORWARD and rec.saved) or rec.recomputed:
        return MemoryCategory.ACTIVATIONS
    return MemoryCategory.TEMPORARIES


def summarize(trace: Trace, program: Program, name: str,
              inputs: tuple[tuple[str, tuple[int, ...], str], ...],
              sources: dict[str, Source] | None = None,
              communication: Callable[[Allocation], bool] | None = None,
              category: Callable[[Allocation], MemoryCategory | None] | None = None,
              ) -> Estimate:
    """Turn a finished trace into an :class:`Estimate`.

    ``communication`` tells the allocations that are communication buffers (a traced rank
    of a data-parallel program, :mod:`modelsize.estimation.parallel_trace`); ``category``,
    where it returns one, overrides :func:`classify` (generation: the cache by owner).
    """
    mode = trace.mode
    peak, tick = mode.peak_bytes, mode.peak_tick
    cats = dict.fromkeys(MemoryCategory, 0)
    live: list[Allocation] = []
    acts: list[Allocation] = []
    for rec in mode.allocations:
        if rec.live_at(tick):
            live.append(rec)
            if communication is not None and communication(rec):
                cats[MemoryCategory.COMMUNICATION] += rec.nbytes
            else:
                cat = (category(rec) if category else None) or classify(rec)
                cats[cat] += rec.nbytes
                if cat is MemoryCategory.ACTIVATIONS:
                    acts.append(rec)
    cats[MemoryCategory.TEMPORARIES] += mode.peak_scratch
    phases = tuple(
        PhaseSpan(p.name, p.step, p.micro_batch, p.start, p.end if p.end >= 0 else mode.tick)
        for p in mode.phases
    )
    phase = next((p for p in phases if p.start <= tick <= p.end),
                 PhaseSpan("setup", 0, 0, 0, 0))
    uses_matmul = any(any(k in str(op) for k in _MATMUL) for op in set(mode.ops))
    dev = device_estimate(program.device, peak, mode.peak_scratch, mode.allocations,
                          mode.scratch_at, mode.tick, uses_matmul, first_calls=mode.first_calls,
                          scratch_parts=mode.scratch_parts)
    notes = list(mode.scratch.notes) if mode.scratch is not None else []
    if program.device == "cuda":
        from modelsize.estimation.cuda_kernels import cuda_notes

        notes.extend(cuda_notes(mode.ops))
        if mode.host_rng_copies:
            from modelsize.estimation.rng import host_note

            notes.append(host_note(mode.host_rng_copies))
    train = program.mode == "train"
    setup = Setup(
        model=name,
        mode=program.mode,
        device=program.device,
        optimizer=describe(program.optimizer) if train else None,
        implementation=str(program.implementation) if train else None,
        amp=str(program.amp).replace("torch.", "") if program.amp is not None else None,
        accumulate=program.accumulate,
        checkpoint=tuple(program.checkpoint),
        steps=program.steps,
        inputs=inputs,
        optimize_frozen=program.optimize_frozen and train,
        sources=dict(sources or {}),
    )
    modules = {(k or "<model>"): v for k, v in
               sorted(trace.module_activations.items(), key=lambda kv: -kv[1])}
    return Estimate(
        setup=setup,
        peak_bytes=peak,
        phase=phase,
        categories=cats,
        scratch_bytes=mode.peak_scratch,
        scratch_op=mode.peak_scratch_op,
        module_activations=modules,
        timeline=downsample(mode.timeline, TIMELINE_POINTS),
        phases=phases,
        parameter_count=trace.parameter_count,
        trainable_count=trace.trainable_count,
        op_count=mode.tick,
        trace_seconds=trace.seconds,
        device_estimate=dev,
        notes=tuple(notes),
        saved_for_backward=(saved_for_backward(acts, live, mode.packed_keepers)
                            if train else None),
    )


def downsample(values: Sequence[int], points: int) -> tuple[tuple[int, int], ...]:
    """``(index, value)`` pairs, at most about ``points``, keeping each bucket's maximum."""
    n = len(values)
    if n <= points:
        return tuple((i + 1, v) for i, v in enumerate(values))
    out: list[tuple[int, int]] = []
    step = n / points
    for b in range(points):
        lo, hi = int(b * step), int((b + 1) * step)
        if hi <= lo:
            continue
        best = max(range(lo, hi), key=values.__getitem__)
        out.append((best + 1, values[best]))
    return tuple(out)


def _describe_inputs(inputs: Any) -> tuple[tuple[str, tuple[int, ...], str], ...]:
    items: list[tuple[str, Any]]
    if isinstance(inputs, Mapping):
        items = list(inputs.items())
    elif isinstance(inputs, torch.Tensor):
        items = [("0", inputs)]
    elif isinstance(inputs, (tuple, list)):
        items = [(str(i), v) for i, v in enumerate(inputs)]
    else:
        kind = type(inputs).__name__
        raise UsageError(f"inputs must be a tuple or a dict of tensors, not {kind}")
    return tuple((k, tuple(v.shape), str(v.dtype).replace("torch.", ""))
                 for k, v in items if isinstance(v, torch.Tensor))
