"""The result of an estimate: plain dataclasses, no torch, ``to_dict()`` for JSON."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class MemoryCategory(str, Enum):
    """Where a byte live at the peak belongs. The order here is the display order."""

    PARAMETERS = "parameters"
    """The model's parameters (tied weights once)."""
    BUFFERS = "buffers"
    """Registered buffers: BatchNorm statistics, rotary tables..."""
    GRADIENTS = "gradients"
    """Tensors held as a parameter's ``.grad`` (from the op that produced them)."""
    OPTIMIZER_STATE = "optimizer_state"
    """Tensors held in ``optimizer.state``: moments, step counters."""
    ACTIVATIONS = "activations"
    """Forward results still alive when the forward ends (saved for backward, the loss),
    and forward results recomputed by activation checkpointing during the backward. In
    generation: what a step holds from an earlier step, other than the cache (the encoder's
    output, the ids generated so far, beam search's scores)."""
    KV_CACHE = "kv_cache"
    """Generation only: the tensors the model's cache object holds (its layers' keys and
    values, recurrent and convolution states), identified by owner."""
    TEMPORARIES = "temporaries"
    """Everything else: forward intermediates freed before the forward ends, gradients of
    activations, optimizer intermediates, and kernel scratch."""
    INPUTS = "inputs"
    """The input tensors of the model."""
    COMMUNICATION = "communication"
    """Buffers of collectives on a rank of a data-parallel program: FSDP2's all-gather
    outputs (the gathered parameters) and reduce-scatter inputs, DDP's gradient buckets."""

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class PhaseSpan:
    """A stretch of the traced program, in op indices (``end`` inclusive)."""

    name: str
    step: int
    micro_batch: int
    start: int
    end: int

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"name": self.name, "step": self.step, "micro_batch": self.micro_batch,
                "start": self.start, "end": self.end}


@dataclass(frozen=True)
class DeviceTerm:
    """One named term of a device estimate."""

    name: str
    nbytes: int
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"name": self.name, "bytes": self.nbytes, "note": self.note}


@dataclass(frozen=True)
class DeviceEstimate:
    """What the device would report, term by term, beyond the tensors the trace counts.

    ``allocated_bytes`` is the prediction of ``torch.cuda.max_memory_allocated()`` (or, on
    CPU, of the allocator peak the profiler reports); ``total_bytes`` adds what the allocator
    does not count (the CUDA context).
    """

    device: str
    terms: tuple[DeviceTerm, ...]
    validated: bool
    allocated_bytes: int
    total_bytes: int

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "device": self.device,
            "terms": [t.to_dict() for t in self.terms],
            "validated": self.validated,
            "allocated_bytes": self.allocated_bytes,
            "total_bytes": self.total_bytes,
        }


class Source(str, Enum):
    """Where a setting of an estimate came from (the report prints it beside the setting)."""

    GIVEN = "given"
    """The caller chose it."""
    DEFAULT = "default"
    """The default of :func:`modelsize.estimate`."""
    CLI_DEFAULT = "cli-default"
    """The default of the ``modelsize estimate`` command, which estimates for a GPU."""
    CONFIG = "config"
    """The model's ``config.json`` (its ``dtype``)."""
    MODEL = "model"
    """The model as it was given (a factory's weights' dtype)."""

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Setup:
    """What was estimated.

    ``optimize_frozen``: the optimizer was built on every parameter, frozen ones included
    (by default only on those that require grad, as fine-tuning code does). ``sources``
    says where ``device``, ``optimizer`` and, from the CLI, ``dtype`` came from.
    """

    model: str
    mode: str
    device: str
    optimizer: str | None
    implementation: str | None
    amp: str | None
    accumulate: int
    checkpoint: tuple[str, ...]
    steps: int
    inputs: tuple[tuple[str, tuple[int, ...], str], ...]
    optimize_frozen: bool = False
    sources: dict[str, Source] = field(default_factory=dict)
    dtype: str = ""
    """The dtype of the model's floating-point weights (``bfloat16+float32`` when mixed)."""
    quantization: str = ""
    """Quantized weights and the library that made them (``nf4 (bitsandbytes Linear4bit)``)."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "model": self.model,
            "mode": self.mode,
            "device": self.device,
            "optimizer": self.optimizer,
            "implementation": self.implementation,
            "amp": self.amp,
            "accumulate": self.accumulate,
            "checkpoint": list(self.checkpoint),
            "steps": self.steps,
            "inputs": [{"name": n, "shape": list(s), "dtype": d} for n, s, d in self.inputs],
            "optimize_frozen": self.optimize_frozen,
            "dtype": self.dtype or None,
            "quantization": self.quantization or None,
            "sources": {k: str(v) for k, v in self.sources.items()},
        }


@dataclass(frozen=True)
class Verification:
    """The estimated program run for real on CPU, its peak read from the allocator's events.

    ``estimated_bytes`` is the CPU estimate of exactly the program that ran: at ``batch``
    when the run was reduced to fit ``budget_bytes`` (``requested_batch`` was asked for),
    and on CPU whatever the estimate's device. ``measured_bytes`` is None when nothing ran;
    ``reason`` then says why (or, for a reduced run, why it was reduced).
    """

    measured_bytes: int | None
    estimated_bytes: int
    batch: int | None
    requested_batch: int | None
    budget_bytes: int
    seconds: float
    reason: str = ""

    @property
    def difference(self) -> int | None:
        """``measured - estimated`` in bytes (None when nothing ran)."""
        if self.measured_bytes is None:
            return None
        return self.measured_bytes - self.estimated_bytes

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"measured_bytes": self.measured_bytes, "estimated_bytes": self.estimated_bytes,
                "difference_bytes": self.difference, "batch": self.batch,
                "requested_batch": self.requested_batch, "budget_bytes": self.budget_bytes,
                "seconds": round(self.seconds, 3), "reason": self.reason}


@dataclass(frozen=True)
class Comparison:
    """One number a formula gives for the same rank, beside the traced one."""

    name: str
    nbytes: int
    counts: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"name": self.name, "bytes": self.nbytes, "counts": self.counts}


@dataclass(frozen=True)
class RankPeak:
    """The peak of one traced (or accounted) rank."""

    rank: int
    peak_bytes: int
    phase: str
    step: int

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"rank": self.rank, "peak_bytes": self.peak_bytes, "phase": self.phase,
                "step": self.step}


@dataclass(frozen=True)
class ParallelInfo:
    """What an estimate across GPUs adds to the :class:`~modelsize.estimation.Estimate`.

    The estimate's peak, phase and categories are those of ``worst_rank``. ``method`` is
    ``"traced"`` (the real engine ran on a fake process group) or ``"accounted"`` (the
    single-GPU trace replayed with sharded terms divided by ``world``); ``accounted`` names
    the terms that were divided rather than traced.
    """

    world: int
    strategy: str
    method: str
    worst_rank: int
    ranks: tuple[RankPeak, ...]
    units: tuple[str, ...]
    reshard_after_forward: bool
    comparisons: tuple[Comparison, ...]
    accounted: tuple[str, ...] = field(default=())
    mesh: tuple[tuple[str, int], ...] = field(default=())
    """The device mesh, its dimensions named: ``(("dp", 4), ("tp", 2))``."""
    mixed_precision: str = ""
    """With ``amp`` and FSDP2: ``"policy"`` (``MixedPrecisionPolicy``) or ``"autocast"``."""
    cpu_offload: bool = False
    host_bytes: int | None = None
    """With ``cpu_offload``: the host memory of the worst rank at its GPU peak's moment."""
    host_peak_bytes: int | None = None
    """With ``cpu_offload``: the worst rank's host peak over the program."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"world": self.world, "strategy": self.strategy, "method": self.method,
                "worst_rank": self.worst_rank, "ranks": [r.to_dict() for r in self.ranks],
                "units": list(self.units), "reshard_after_forward": self.reshard_after_forward,
                "comparisons": [c.to_dict() for c in self.comparisons],
                "accounted": list(self.accounted),
                "mesh": {name: size for name, size in self.mesh},
                "mixed_precision": self.mixed_precision or None,
                "cpu_offload": self.cpu_offload, "host_bytes": self.host_bytes,
                "host_peak_bytes": self.host_peak_bytes}


class CacheKind(str, Enum):
    """What one group of a generation cache's layers holds, and how it grows."""

    FULL_ATTENTION = "full_attention"
    """Keys and values of every token: grows by the same bytes per token for ever."""
    SLIDING_WINDOW = "sliding_window"
    """Keys and values of the last tokens only: grows per token up to the window."""
    LATENT = "latent"
    """Multi-head latent attention (DeepSeek-V2/V3): one compressed vector per token and layer
    (``kv_lora_rank`` + ``qk_rope_head_dim``) instead of keys and values per head, where the
    model's cache code stores it so (transformers 5 does); it grows per token for ever."""
    RECURRENT = "recurrent"
    """Convolution and recurrent (SSM, linear attention) states: a constant per sequence."""
    CROSS_ATTENTION = "cross_attention"
    """An encoder-decoder's keys and values of the encoder output: per encoder token, fixed
    after the first step."""

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class CacheGroup:
    """The cache's layers of one :class:`CacheKind`, measured on the traced cache when the
    generation ended (all numbers per row of the cache: one sequence, or one beam)."""

    kind: CacheKind
    layers: int
    bytes_per_token: int
    """Bytes one more token adds to one row, summed over the group's layers (0: recurrent)."""
    bytes_per_sequence: int
    """Bytes one row holds whatever its length (recurrent state; 0 for attention)."""
    tokens: int
    """Tokens of one row the group's storages hold at the end (what the memory holds, which
    may exceed what attention reads: a sliding layer keeps a view of a longer storage)."""
    capacity: int | None
    """The most tokens the group's layers can hold: the window, a static cache's length;
    None when unbounded."""
    nbytes: int
    """Bytes the group's storages hold at the end, all rows."""
    latent_bytes_per_token: int | None = None
    """:attr:`CacheKind.LATENT` only: the compressed form's bytes per token from the config,
    ``(kv_lora_rank + qk_rope_head_dim) x layers x dtype`` (differs from ``bytes_per_token``
    where the cache code stores keys and values decompressed)."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"kind": self.kind.value, "layers": self.layers,
                "bytes_per_token": self.bytes_per_token,
                "bytes_per_sequence": self.bytes_per_sequence, "tokens": self.tokens,
                "capacity": self.capacity, "bytes": self.nbytes,
                "latent_bytes_per_token": self.latent_bytes_per_token}


@dataclass(frozen=True)
class GenerationInfo:
    """What ``mode="generate"`` adds to an :class:`Estimate`.

    The program was ``model.generate(**inputs, max_new_tokens=new_tokens,
    min_new_tokens=new_tokens, do_sample=False, **options)``: ``prefill_chunks`` forwards
    over the prompt (one unless chunked), then ``new_tokens - 1`` decode steps. The peak's
    phase is the estimate's ``phase`` (``prefill``, chunk ``micro_batch``; ``decode``, step
    ``step``). ``rows`` is the cache's batch: the batch times the beams.
    """

    new_tokens: int
    batch: int
    prompt_tokens: int
    beams: int
    rows: int
    prefill_chunks: int
    cache_class: str
    options: dict[str, str]
    prefill_cache_bytes: int
    """Bytes the cache holds when the prompt is done (before the first decode step)."""
    final_cache_bytes: int
    """Bytes the cache holds on the device after the last forward."""
    groups: tuple[CacheGroup, ...]
    token_values: str
    """How the ids the trace cannot know (each step's argmax) were chosen."""
    routing: str = ""
    """Where a value the weights decide (MoE routing) was bounded, and which bound."""
    host_cache_bytes: int = 0
    """An offloaded cache on CUDA: bytes of its layers in host memory after the last forward
    (not in the device estimate)."""
    decode_trace: str = ""
    """Which decode steps were traced op by op and which replayed from them."""

    @property
    def bytes_per_token(self) -> int:
        """Bytes one more token adds to one row, over every layer that grows per token."""
        return sum(g.bytes_per_token for g in self.groups
                   if g.kind is not CacheKind.CROSS_ATTENTION)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"new_tokens": self.new_tokens, "batch": self.batch,
                "prompt_tokens": self.prompt_tokens, "beams": self.beams, "rows": self.rows,
                "prefill_chunks": self.prefill_chunks, "cache_class": self.cache_class,
                "options": dict(self.options),
                "prefill_cache_bytes": self.prefill_cache_bytes,
                "final_cache_bytes": self.final_cache_bytes,
                "host_cache_bytes": self.host_cache_bytes,
                "bytes_per_token": self.bytes_per_token,
                "groups": [g.to_dict() for g in self.groups],
                "token_values": self.token_values, "routing": self.routing,
                "decode_trace": self.decode_trace}


@dataclass(frozen=True)
class SavedTensors:
    """Tensors of one kind that the training step keeps for the backward at the peak: made
    in ``module`` by ``op`` (the ATen op that allocated each storage), kept by the autograd
    nodes ``saved_by``, all of one ``dtype`` and ``shape`` (the tensor each storage was made
    for); ``count`` storages, ``nbytes`` in all."""

    module: str
    op: str
    saved_by: tuple[str, ...]
    """Node names (``MmBackward0``); a custom Function's ``ctx`` attribute as
    ``<node>.<attribute>``; ``checkpoint``: the inputs a checkpointed region keeps;
    ``recomputed``: a checkpointed region's forward run again in the backward; empty: alive
    but kept by no node (the loss, a model's own references)."""
    dtype: str
    shape: tuple[int, ...]
    count: int
    nbytes: int
    kept_in: tuple[str, ...] = ()
    """The modules whose forward made the nodes of ``saved_by``."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"module": self.module, "op": self.op, "saved_by": list(self.saved_by),
                "kept_in": list(self.kept_in), "dtype": self.dtype, "shape": list(self.shape),
                "count": self.count, "bytes": self.nbytes}


class SavedFindingKind(str, Enum):
    """What a :class:`SavedFinding` found among the tensors kept for the backward."""

    DEQUANTIZED_WEIGHT = "dequantized_weight"
    """A floating-point tensor computed from model state alone (no input), among it a
    quantized, packed weight (an integer or 1-byte float parameter or buffer): a
    dequantized copy of the weight, which the backward could make again from the packed
    one (bitsandbytes PR 1935)."""
    INPUT_FOR_FROZEN_WEIGHT = "input_for_frozen_weight"
    """An input activation kept only by a custom autograd Function that also keeps a
    quantized weight: in a linear layer the input serves only the weight's gradient, and a
    quantized weight gets none (bitsandbytes PR 1270)."""
    RECOMPUTABLE = "recomputable"
    """The output of a pointwise op (or a copy) whose input-derived arguments are all kept
    for the backward too, alive at the peak: the backward could compute it again from them."""

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class SavedFinding:
    """Bytes kept for the backward that need not be, and what to do about them."""

    kind: SavedFindingKind
    module: str
    """The module to change (one, or the first of several: ``modules`` counts them): where
    the dequantized copy or the recomputable tensor is made; for an input kept for a frozen
    weight, the module whose Function keeps it."""
    op: str
    saved_by: tuple[str, ...]
    count: int
    nbytes: int
    """Bytes at the peak that the change frees."""
    modules: int
    advice: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"kind": self.kind.value, "module": self.module, "op": self.op,
                "saved_by": list(self.saved_by), "count": self.count, "bytes": self.nbytes,
                "modules": self.modules, "advice": self.advice}


@dataclass(frozen=True)
class SavedForBackward:
    """What a training step keeps for the backward at its peak: the activations category,
    storage by storage, grouped (:class:`SavedTensors`, largest first; they add up to
    ``nbytes``, the activations at the peak, to the byte), and the findings on them."""

    rows: tuple[SavedTensors, ...]
    nbytes: int
    findings: tuple[SavedFinding, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"bytes": self.nbytes, "rows": [r.to_dict() for r in self.rows],
                "findings": [f.to_dict() for f in self.findings]}


@dataclass(frozen=True)
class Estimate:
    """The exact peak of live tensor bytes of a traced program, and what it is made of.

    ``categories`` add up to ``peak_bytes``. ``scratch_bytes`` (kernel buffers no tensor owns)
    is part of ``temporaries``. ``timeline`` holds ``(op index, live bytes)`` pairs,
    downsampled, always including the peak. ``verification`` is the measured real run when
    one was asked for (``verify=True``, ``--verify``).
    """

    setup: Setup
    peak_bytes: int
    phase: PhaseSpan
    categories: dict[MemoryCategory, int]
    scratch_bytes: int
    scratch_op: str
    module_activations: dict[str, int]
    timeline: tuple[tuple[int, int], ...]
    phases: tuple[PhaseSpan, ...]
    parameter_count: int
    trainable_count: int
    op_count: int
    trace_seconds: float
    device_estimate: DeviceEstimate
    notes: tuple[str, ...] = field(default=())
    verification: Verification | None = None
    parallel: ParallelInfo | None = None
    generation: GenerationInfo | None = None
    """``mode="generate"``: the cache by layer kind, the peak's step, how unknown values were
    chosen (:class:`GenerationInfo`)."""
    saved_for_backward: SavedForBackward | None = None
    """Training: the activations at the peak by module, op and the autograd node that keeps
    them, with findings (:class:`SavedForBackward`)."""

    def __post_init__(self) -> None:
        from modelsize.errors import AccountingError

        total = sum(self.categories.values())
        if total != self.peak_bytes:
            raise AccountingError(
                f"estimate categories add up to {total} bytes, the peak is {self.peak_bytes}"
            )
        saved = self.saved_for_backward
        if saved is not None:
            acts = self.categories.get(MemoryCategory.ACTIVATIONS, 0)
            rows = sum(r.nbytes for r in saved.rows)
            if rows != saved.nbytes or saved.nbytes != acts:
                raise AccountingError(
                    f"saved-for-backward rows add up to {rows} bytes, the activations at the "
                    f"peak are {acts}")

    def __repr__(self) -> str:
        s = self.setup
        what = {"train": "training step", "generate": "generation"}.get(s.mode, "inference")
        where = f"{self.phase.name} of step {self.phase.step}"
        if s.mode == "generate":
            where = (f"decode step {self.phase.step}" if self.phase.name == "decode"
                     else self.phase.name)
        return (f"<Estimate {s.model}: {what} on {s.device}, peak {self.peak_bytes:,} bytes in "
                f"{where}>")

    def _repr_html_(self) -> str:
        from modelsize.report.html import card_estimate

        return card_estimate(self)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form: byte counts are ints, keys are the enum values."""
        return {
            "setup": self.setup.to_dict(),
            "peak_bytes": self.peak_bytes,
            "phase": self.phase.to_dict(),
            "categories": {str(k): v for k, v in self.categories.items()},
            "scratch_bytes": self.scratch_bytes,
            "scratch_op": self.scratch_op,
            "module_activations": dict(self.module_activations),
            "timeline": [list(p) for p in self.timeline],
            "phases": [p.to_dict() for p in self.phases],
            "parameter_count": self.parameter_count,
            "trainable_count": self.trainable_count,
            "op_count": self.op_count,
            "trace_seconds": round(self.trace_seconds, 3),
            "device_estimate": self.device_estimate.to_dict(),
            "notes": list(self.notes),
            "verification": self.verification.to_dict() if self.verification else None,
            "parallel": self.parallel.to_dict() if self.parallel else None,
            "generation": self.generation.to_dict() if self.generation else None,
            "saved_for_backward": (self.saved_for_backward.to_dict()
                                   if self.saved_for_backward else None),
        }


@dataclass(frozen=True)
class Suggestion:
    """One change that would shrink the peak, with the peak a re-trace gave for it."""

    label: str
    change: str
    peak_bytes: int
    device_bytes: int

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"label": self.label, "change": self.change, "peak_bytes": self.peak_bytes,
                "device_bytes": self.device_bytes}


@dataclass(frozen=True)
class FitResult:
    """The largest value of ``dimension`` whose traced peak fits ``budget_bytes``.

    ``best`` is 0 when even 1 does not fit. ``probes`` lists every traced value and its
    measured bytes; ``best`` fits and ``best + 1`` was traced and does not (unless ``best``
    hit ``limit``).
    """

    dimension: str
    budget_bytes: int
    measure: str
    best: int
    best_bytes: int
    limit: int
    probes: tuple[tuple[int, int], ...]
    smallest: bool = False
    """The search was for the smallest value that fits (GPUs: the peak falls as it grows):
    ``best - 1`` was traced and does not fit (unless ``best`` is the first value searched)."""
    label: str = ""
    """What differs from the estimate's own settings, e.g. "with checkpointing on X"."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"dimension": self.dimension, "budget_bytes": self.budget_bytes,
                "measure": self.measure, "best": self.best, "best_bytes": self.best_bytes,
                "limit": self.limit, "probes": [list(p) for p in self.probes],
                "smallest": self.smallest, "label": self.label}


@dataclass(frozen=True)
class GenerationFit:
    """``--fit`` with ``--generate``: the largest batch, or context (prompt plus new tokens),
    whose traced generation fits, and the plan at that answer (the answer's own trace).

    ``fit.best`` is a batch or a context length; ``estimate`` is the trace of the answer
    (None when nothing fits); the value above it was traced too and does not fit
    (``fit.probes``).
    """

    fit: FitResult
    batch: int
    prompt_tokens: int
    new_tokens: int
    estimate: Estimate | None

    @property
    def context_tokens(self) -> int:
        """Prompt plus new tokens at the answer."""
        return self.prompt_tokens + self.new_tokens

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form: the search, and the numbers at the answer."""
        plan: dict[str, Any] | None = None
        est = self.estimate
        if est is not None:
            dev = est.device_estimate
            plan = {"batch": self.batch, "prompt_tokens": self.prompt_tokens,
                    "new_tokens": self.new_tokens, "context_tokens": self.context_tokens,
                    "device": est.setup.device, "peak_bytes": est.peak_bytes,
                    "allocated_bytes": dev.allocated_bytes,
                    "device_total_bytes": dev.total_bytes,
                    "kv_cache_bytes": est.categories[MemoryCategory.KV_CACHE],
                    "categories": {str(k): v for k, v in est.categories.items()},
                    "peak_phase": est.phase.to_dict(),
                    "cache": est.generation.to_dict() if est.generation else None}
        traced = dict(self.fit.probes)
        above = self.fit.best + 1
        return {"fit": self.fit.to_dict(), "plan": plan,
                "above": ({"value": above, "bytes": traced[above]} if above in traced
                          else None)}
