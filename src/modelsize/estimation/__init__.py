"""``modelsize estimate``: the exact memory a PyTorch model needs, by tracing it with fake tensors.

The model runs for real, op by op, on fake tensors (shapes, dtypes and strides, no data), so
the estimate of a 70B model costs what the trace of a small one costs. A counter keeps the
bytes of every live storage; the peak, and what is live at the peak, is the answer.

Modules: ``tracker`` (the counting fake-tensor mode), ``trace`` (the program: forward, loss,
backward, optimizer step), ``generate`` (the program ``model.generate()``, its cache found by
owner; ``generate_fit`` its ``--fit``, ``sdpa_cuda`` its attention on a GPU),
``scratch`` (kernel buffers no tensor owns), ``device`` (allocator
rounding and workspaces), ``result`` (the :class:`Estimate`), ``zoo`` (built-in models),
``fit`` (largest batch under a budget), ``targets`` (what the CLI traces: built-in
models, ``config.json`` files, factories, and weights: model folders, GGUF files, Hub
repositories, read by ``model_source``), ``engine_vllm`` (vLLM's start-up memory plan from
its rules and a traced profile run), ``verify`` (the same program run for real on CPU
under the allocator's profiler).

Importing this package does not import torch: :func:`estimate` does, when called.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from modelsize.errors import MissingDependencyError
from modelsize.estimation.lora import LoraSpec
from modelsize.estimation.parallel import Parallel, Strategy
from modelsize.estimation.result import (
    CacheGroup,
    CacheKind,
    DeviceEstimate,
    DeviceTerm,
    Estimate,
    GenerationInfo,
    MemoryCategory,
    PhaseSpan,
    Setup,
    Source,
    Verification,
)

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "CacheGroup",
    "CacheKind",
    "DeviceEstimate",
    "DeviceTerm",
    "Estimate",
    "GenerationInfo",
    "LoraSpec",
    "MemoryCategory",
    "Parallel",
    "PhaseSpan",
    "Setup",
    "Source",
    "Strategy",
    "Verification",
    "estimate",
]


def require_torch(what: str = "modelsize estimate") -> None:
    """Raise :class:`MissingDependencyError` when torch is not installed."""
    try:
        import torch  # noqa: F401
    except ImportError as exc:
        raise MissingDependencyError("torch", what, extra="estimate") from exc


def estimate(
    model: nn.Module,
    inputs: Any,
    *,
    mode: str = "train",
    optimizer: str | Callable[..., torch.optim.Optimizer] | None = None,
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
    lora: str | LoraSpec | None = None,
    gradient_checkpointing: bool | Mapping[str, Any] = False,
) -> Estimate:
    """The exact peak memory of running ``model`` on ``inputs``, without allocating it.

    ``inputs`` is a tuple of positional arguments or a dict of keyword arguments (tensors,
    real, meta or fake; other values pass through). ``model`` may be real, on the meta
    device, or fake; it is left exactly as it was (weights, ``.grad``, hooks, train/eval
    flags, ``requires_grad``).

    ``mode="infer"``: one eval-mode forward under ``torch.no_grad()``. ``mode="train"``:
    ``steps`` (default 2) steps of forward, loss, backward (``accumulate`` micro-batches each),
    ``optimizer.step()`` and ``zero_grad(set_to_none=True)``; the peak is the maximum over
    them (Adam-like optimizers create their state inside the first step). The loss is
    ``loss(output)``, by default ``output.loss`` or else ``.sum()`` of the first floating
    point tensor of the output; the output is released before the backward.

    ``mode="generate"``: exactly ``model.generate(**inputs, max_new_tokens=new_tokens,
    min_new_tokens=new_tokens, do_sample=False, **generation)`` in eval mode under
    ``no_grad``, traced with the model's own cache code (``generation``: more ``generate()``
    keyword arguments, ``{"cache_implementation": "static"}``, ``{"num_beams": 4}``,
    ``{"prefill_chunk_size": 512}``...). ``inputs`` is the dict of ``generate()`` tensors
    (``input_ids``, ``attention_mask``; ``input_features`` for Whisper). The cache's bytes are
    the ``kv_cache`` category; ``Estimate.generation`` gives the peak's step, the cache at the
    prefill and at the end, and its bytes per token by layer kind. Token ids the trace cannot
    know (each step's argmax) and MoE routing the model's code reads are chosen as
    :mod:`modelsize.estimation.generate` says, and named in ``Estimate.generation``.

    ``optimizer`` (default ``adamw``): ``sgd``, ``momentum``, ``adam``, ``adamw``, ``adagrad``,
    ``rmsprop``, bitsandbytes' ``adamw8bit`` / ``paged_adamw8bit`` (its own optimizer, traced:
    :mod:`modelsize.estimation.bnb_optim`), or a callable taking the parameters
    (``torch.optim.AdamW``, a ``functools.partial``...). It is built on the parameters that
    require grad, as fine-tuning code does
    (``AdamW(p for p in model.parameters() if p.requires_grad)``); ``optimize_frozen=True``
    builds it on all of them (``AdamW(model.parameters())``), which costs state for frozen
    parameters with optimizers that make it up front (Adagrad).
    ``implementation``: ``for-loop``, ``foreach``, ``fused`` or None for PyTorch's default on
    ``device``. ``amp``: ``"bf16"``/``"fp16"`` autocast around the forward and the loss.
    ``checkpoint``: module names (glob patterns) or class names whose forward runs under
    non-reentrant activation checkpointing. ``gradient_checkpointing``: checkpointing as
    transformers switches it on (``activation_checkpointing_enable``; ``True`` with its
    default arguments, or a dict of them such as ``{"use_reentrant": True}``), on a
    transformers model or the one a peft model wraps, for the program only.

    ``lora``: ``"r=16,alpha=32,targets=q_proj,v_proj"`` (``targets=all-linear``, optional
    ``dropout=0.05``) or a :class:`LoraSpec`: peft's ``get_peft_model(model, LoraConfig(...))``
    applied to a copy of the model whose parameters are meta tensors (the caller's model is
    not touched): the base frozen, the adapters trainable (named in ``Estimate.notes``).

    ``device`` (default ``cpu``): ``"cpu"`` (validated to the byte against the CPU profiler)
    or ``"cuda"`` (CUDA's kernel choices, the caching allocator's blocks, the cuBLAS
    workspaces and the CUDA context as named terms; checked on an H100 and an H200 with
    PyTorch 2.11 within 0.07% of ``max_memory_allocated``).
    ``Estimate.setup.sources`` says which settings were defaults.

    Values the model reads from tensors (``if labels.max() >= vocab:``, ``x[mask]``) are
    computed from the real input tensors, when they are real; a value that depends on the
    weights or on random numbers stops the trace with an :class:`EstimateError` naming the
    line of the model that reads it.

    ``verify=True`` also runs the program for real on CPU (on a copy of the model) under the
    allocator's profiler and stores the measured peak beside the CPU estimate of the same
    program in ``Estimate.verification``: at full size when that estimate fits
    ``verify_budget`` bytes (default: half of the available memory), else at the largest
    smaller batch (first dimension of the inputs) that fits, estimated again at that batch.

    ``parallel=Parallel(world=N, strategy=...)``: the peak of one rank of a data-parallel
    program of ``N`` GPUs, the worst of the ranks traced (``Estimate.parallel`` says which,
    and what the ZeRO paper's formula and DeepSpeed's estimators would say). ``fsdp`` /
    ``zero3`` trace the real engine: FSDP2's ``fully_shard`` (each repeated block, then the
    root) on a fake process group, collectives' buffers counted as ``communication``.
    ``ddp``, ``zero1`` and ``zero2`` are accounted from the single-GPU trace (DDP's gradient
    buckets added; the optimizer step, and for ZeRO-2 the gradients, divided by ``N``).
    ``fsdp+tp`` (``Parallel(tp=...)``) applies the model's tensor-parallel plan on a
    ``(dp, tp)`` mesh and FSDP2 over ``dp``; ``--amp`` with FSDP2 is its
    ``MixedPrecisionPolicy`` unless ``Parallel(mixed_precision="autocast")``;
    ``cpu_offload=True`` splits the rank's bytes between GPU and host (accounted). With
    ``verify=True`` the traced rank is also run for real on the fake process group and
    measured (at full size only).

    ``quantize`` (``"int8"``, ``"int4"``, ``"fp8"``, ``"nf4"``): estimate a copy of ``model``
    whose ``nn.Linear`` weights are quantized (weight-only) by torchao (int8, int4, fp8) or
    bitsandbytes (nf4): see :func:`modelsize.estimation.quantized.quantize_model`; the
    caller's model is not changed. ``Estimate.setup.quantization`` names the scheme and
    library, as it does for a model that arrives quantized (torchao tensor subclasses,
    bitsandbytes ``Linear4bit``/``Linear8bitLt``, :mod:`modelsize.estimation.gptq` layers).
    """
    require_torch()
    from modelsize.estimation import core

    return core.estimate(
        model, inputs, mode=mode, optimizer=optimizer, loss=loss, amp=amp, device=device,
        implementation=implementation, accumulate=accumulate, checkpoint=checkpoint,
        steps=steps, optimize_frozen=optimize_frozen, verify=verify,
        verify_budget=verify_budget, name=name, progress=progress, parallel=parallel,
        new_tokens=new_tokens, generation=generation, quantize=quantize, lora=lora,
        gradient_checkpointing=gradient_checkpointing,
    )
