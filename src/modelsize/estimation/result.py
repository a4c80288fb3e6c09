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
    and forward results recomputed by activation checkpointing during the backward."""
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

    def __post_init__(self) -> None:
        from modelsize.errors import AccountingError

        total = sum(self.categories.values())
        if total != self.peak_bytes:
            raise AccountingError(
                f"estimate categories add up to {total} bytes, the peak is {self.peak_bytes}"
            )

    def __repr__(self) -> str:
        s = self.setup
        what = "training step" if s.mode == "train" else "inference"
        return (f"<Estimate {s.model}: {what} on {s.device}, peak {self.peak_bytes:,} bytes in "
                f"{self.phase.name} of step {self.phase.step}>")

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
