"""Estimates across many GPUs: what is asked (:class:`Parallel`) and the formulas beside the trace.

The traced strategies run the real engine on one CPU: ``torch.distributed``'s ``fake``
backend (every collective returns at once, touching nothing) for a process group of ``world``
ranks, a ``DeviceMesh``, and FSDP2's ``fully_shard`` or a tensor-parallel plan of DTensor
layers (:mod:`modelsize.estimation.parallel_trace`).
Each traced rank's peak is the peak of live tensor bytes of that rank's program, its
all-gather and reduce-scatter buffers included. ``fsdp+tp`` runs both on a 2D mesh
``(world / tp, tp)``. With ``amp``, FSDP2 runs its ``MixedPrecisionPolicy`` by default (as
torchtitan does) or ``torch.autocast`` around float32 parameters when asked
(:class:`FsdpPrecision`). CPU offload runs FSDP2's ``CPUOffloadPolicy`` too, but on the CPU
mesh its host-device copies are no-ops: the GPU's and the host's shares are accounted from
that trace.

The accounted strategies start from the traced single-GPU program and replay its
allocations: DDP adds the Reducer's gradient buckets (the fake backend's all-reduce future
yields nothing DDP accepts, so DDP cannot run on it as is); ZeRO-1 and ZeRO-2, which PyTorch
has no engine for, divide the optimizer step's allocations (and ZeRO-2 the gradients) by
``world``. The report says which numbers are traced and which accounted.

The formulas shown beside (:func:`zero_model_states`, :func:`deepspeed_zero2_gpu_bytes`,
:func:`deepspeed_zero3_gpu_bytes`) count model states only: parameters, gradients and
optimizer state, no activations, buffers or communication.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from modelsize.errors import UsageError
from modelsize.estimation.result import Comparison


class Strategy(str, Enum):
    """How the model is spread over the GPUs."""

    DDP = "ddp"
    """Every rank holds everything; gradients are all-reduced (accounted: + the Reducer's
    buckets; equal to real DDP on the fake process group in the tests)."""
    FSDP = "fsdp"
    """FSDP2 ``fully_shard`` on each block, then the root (traced)."""
    ZERO1 = "zero1"
    """Optimizer state sharded around full DDP parameters and gradients (accounted)."""
    ZERO2 = "zero2"
    """Optimizer state and gradients sharded around full DDP parameters (accounted)."""
    ZERO3 = "zero3"
    """Parameters, gradients and optimizer state sharded: FSDP2 (traced)."""
    TP = "tp"
    """Tensor parallelism over all ``world`` ranks: the model's plan (traced, DTensor)."""
    FSDP_TP = "fsdp+tp"
    """A 2D mesh ``(dp, tp) = (world / tp, tp)``: the model's tensor-parallel plan on the tp
    mesh, FSDP2 ``fully_shard`` on the dp mesh, as torchtitan does (traced)."""

    def __str__(self) -> str:
        return self.value


#: Strategies whose per-rank numbers come from a trace of the real engine.
TRACED = frozenset({Strategy.FSDP, Strategy.ZERO3, Strategy.TP, Strategy.FSDP_TP})
#: Strategies that run FSDP2 (mixed-precision policy, CPU offload).
SHARDED = frozenset({Strategy.FSDP, Strategy.ZERO3, Strategy.FSDP_TP})


class FsdpPrecision(str, Enum):
    """How FSDP2 runs a mixed-precision (``amp``) program."""

    POLICY = "policy"
    """``fully_shard(mp_policy=MixedPrecisionPolicy(param_dtype=amp, reduce_dtype=float32))``
    on every unit and the root, no autocast: what torchtitan and the FSDP2 docs do."""
    AUTOCAST = "autocast"
    """``torch.autocast`` around the FSDP2 model, fp32 parameters gathered: autocast keeps a
    low-precision copy of every gathered parameter until the forward ends."""

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Parallel:
    """The data-parallel layout to estimate one rank of.

    ``world``: the number of ranks (GPUs). ``strategy``: a :class:`Strategy` or its name.
    ``reshard_after_forward``: FSDP2 frees each block's gathered parameters after its forward
    (and gathers them again in the backward); False keeps them until the backward.
    ``units``: module names (glob patterns) or class names to ``fully_shard`` before the
    root; by default each block of the model's largest ``nn.ModuleList`` of repeated blocks.
    ``ranks``: the ranks to trace (default rank 0, the worst: :meth:`ranks_to_trace`); the
    worst of them is reported.
    ``tp``: the tensor-parallel degree. ``fsdp+tp`` needs it (a divisor of ``world``: the mesh
    is ``(world // tp, tp)``); ``tp`` takes it as ``world`` (a smaller one is refused: tp over
    part of the ranks with replicas is ``fsdp+tp``'s job); other strategies have 1.
    ``mixed_precision``: with ``amp``, how FSDP2 runs it (:class:`FsdpPrecision`; default its
    ``MixedPrecisionPolicy``). ``cpu_offload``: FSDP2's ``CPUOffloadPolicy`` (sharded
    parameters, gradients and the optimizer step on the host).
    """

    world: int
    strategy: Strategy | str = Strategy.FSDP
    reshard_after_forward: bool = True
    units: tuple[str, ...] = ()
    ranks: tuple[int, ...] | None = None
    tp: int | None = None
    mixed_precision: FsdpPrecision | str = FsdpPrecision.POLICY
    cpu_offload: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.world, int) or self.world < 1:
            raise UsageError(f"parallel world must be a positive number of GPUs, not "
                             f"{self.world!r}")
        try:
            object.__setattr__(self, "strategy", Strategy(str(self.strategy).lower()))
        except ValueError:
            names = ", ".join(s.value for s in Strategy)
            raise UsageError(f"unknown parallel strategy {self.strategy!r}: expected one of "
                             f"{names}") from None
        if isinstance(self.units, str):
            object.__setattr__(self, "units", (self.units,))
        try:
            object.__setattr__(self, "mixed_precision",
                               FsdpPrecision(str(self.mixed_precision).lower()))
        except ValueError:
            raise UsageError(f"unknown FSDP mixed precision {self.mixed_precision!r}: expected "
                             "policy or autocast") from None
        object.__setattr__(self, "tp", self._tp_degree())
        if self.cpu_offload and self.strategy not in SHARDED:
            raise UsageError(f"CPU offload is FSDP2's: it needs strategy fsdp, zero3 or "
                             f"fsdp+tp, not {self.strategy}")
        if self.ranks is not None:
            bad = [r for r in self.ranks if not 0 <= r < self.world]
            if bad or not self.ranks:
                raise UsageError(f"parallel ranks must lie in 0..{self.world - 1}, not "
                                 f"{list(self.ranks)}")

    def _tp_degree(self) -> int:
        tp, world = self.tp, self.world
        if tp is not None and (not isinstance(tp, int) or tp < 1):
            raise UsageError(f"the tensor-parallel degree must be a positive number of GPUs, "
                             f"not {tp!r}")
        if tp is not None and tp > world:
            raise UsageError(f"the tensor-parallel degree ({tp}) cannot exceed the number of "
                             f"GPUs ({world})")
        if self.strategy is Strategy.FSDP_TP:
            if tp is None:
                raise UsageError("strategy fsdp+tp needs a tensor-parallel degree (--tp N)")
            if world % tp:
                raise UsageError(f"fsdp+tp on {world} GPUs needs a tensor-parallel degree that "
                                 f"divides {world}, not {tp}: the mesh is (world / tp, tp)")
            return tp
        if self.strategy is Strategy.TP:
            if tp is not None and tp != world:
                raise UsageError(f"strategy tp spreads the model over all {world} GPUs; for tp "
                                 f"over {tp} with FSDP2 over the {world // tp} groups use "
                                 "strategy fsdp+tp (--strategy fsdp+tp --tp N)")
            return world
        if tp not in (None, 1):
            raise UsageError(f"a tensor-parallel degree applies to strategies tp and fsdp+tp, "
                             f"not {self.strategy}")
        return 1

    @property
    def dp(self) -> int:
        """The data-parallel degree: ``world // tp`` (1 for tensor parallelism alone)."""
        return 1 if self.strategy is Strategy.TP else self.world // (self.tp or 1)

    @property
    def mesh(self) -> tuple[tuple[str, int], ...]:
        """The device mesh's dimensions, named: ``(("dp", 4), ("tp", 2))`` for fsdp+tp."""
        if self.strategy is Strategy.FSDP_TP:
            return (("dp", self.dp), ("tp", self.tp or 1))
        if self.strategy is Strategy.TP:
            return (("tp", self.world),)
        return (("dp", self.world),)

    @property
    def traced(self) -> bool:
        """Whether the per-rank numbers come from a trace of the real engine."""
        return self.strategy in TRACED

    def ranks_to_trace(self) -> tuple[int, ...]:
        """The ranks traced: as given, else rank 0.

        Rank 0 is the worst rank of FSDP2 and of the accounted strategies: every shard is
        ``torch.chunk``'s, whose chunks never grow with the rank (FSDP2 pads them all to the
        first one's size; optimizer state follows the unpadded ones), and rank 0 holds the
        root's parameters as every rank does.
        """
        if self.ranks is not None:
            return tuple(sorted(set(self.ranks)))
        return (0,)


def unsplit_heads(model: object, degree: int) -> tuple[str, int] | None:
    """The first of the model config's attention head counts (``num_attention_heads``,
    ``num_key_value_heads``) that tensor parallelism of ``degree`` cannot split, with its
    value; None when both split (or the model has no such config)."""
    config = getattr(model, "config", None)
    for attr in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, attr, None)
        if isinstance(heads, int) and heads % degree:
            return attr, heads
    return None


@dataclass(frozen=True)
class ModelStates:
    """Bytes of model states per rank, as the ZeRO paper counts them."""

    parameters: int
    gradients: int
    optimizer_state: int

    @property
    def total(self) -> int:
        """All three."""
        return self.parameters + self.gradients + self.optimizer_state


def zero_model_states(params: int, world: int, stage: int, *, param_bytes: int = 2,
                      grad_bytes: int = 2, state_bytes: int = 12) -> ModelStates:
    """Model states per rank by the ZeRO paper's formula (Rajbhandari et al. 2020, fig. 1).

    ``stage`` 0 is plain data parallelism, 1 shards the optimizer state, 2 the gradients too,
    3 the parameters too. The defaults are the paper's mixed-precision Adam: fp16 parameters
    and gradients (2 + 2 bytes) and ``K = 12`` bytes of optimizer state per parameter (fp32
    master weights, momentum and variance). A shard is ``ceil(params / world)`` parameters.
    """
    if stage not in (0, 1, 2, 3):
        raise UsageError(f"ZeRO stage must be 0, 1, 2 or 3, not {stage}")
    shard = math.ceil(params / world)
    return ModelStates(
        parameters=(shard if stage >= 3 else params) * param_bytes,
        gradients=(shard if stage >= 2 else params) * grad_bytes,
        optimizer_state=(shard if stage >= 1 else params) * state_bytes,
    )


def deepspeed_zero2_gpu_bytes(total_params: int, gpus_per_node: int = 1, nodes: int = 1,
                              cpu_offload: bool = False) -> int:
    """GPU bytes per rank by DeepSpeed's ``estimate_zero2_model_states_mem_needs``.

    The same arithmetic as ``deepspeed.runtime.zero.stage_1_and_2`` (model states only).
    """
    total_gpus = gpus_per_node * nodes
    if cpu_offload:
        return int(2 * total_params)
    return int(4 * total_params + int(16 * total_params / total_gpus))


def deepspeed_zero3_gpu_bytes(total_params: int, largest_layer_params: int,
                              gpus_per_node: int = 1, nodes: int = 1, cpu_offload: bool = False,
                              cpu_offload_params: bool = False) -> int:
    """GPU bytes per rank by DeepSpeed's ``estimate_zero3_model_states_mem_needs``.

    The same arithmetic as ``deepspeed.runtime.zero.stage3`` (model states only, plus the
    largest layer's parameters in fp32).
    """
    total_gpus = gpus_per_node * nodes
    largest = 4 * largest_layer_params
    if cpu_offload:
        if cpu_offload_params:
            return int(largest)
        return int(largest + int(2 * total_params / total_gpus))
    return int(largest + int(18 * total_params / total_gpus))


def comparisons(params: int, largest_layer_params: int, world: int, *, param_bytes: int,
                mixed: bool) -> tuple[Comparison, ...]:
    """The ZeRO paper's formula (stages 0-3) and DeepSpeed's estimators for ``world`` GPUs.

    ``mixed``: the paper's mixed-precision Adam (2 + 2 + 12 bytes a parameter); otherwise
    full precision Adam on ``param_bytes`` weights (4 + 4 + 8 for fp32).
    """
    if mixed:
        pb, gb, k = 2, 2, 12
    else:
        pb, gb, k = param_bytes, param_bytes, 2 * param_bytes
    what = f"model states only, {pb}+{gb}+{k} bytes a parameter"
    out = [Comparison(f"ZeRO formula, stage {s}",
                      zero_model_states(params, world, s, param_bytes=pb, grad_bytes=gb,
                                        state_bytes=k).total, what)
           for s in (0, 1, 2, 3)]
    out.append(Comparison("DeepSpeed estimate_zero2 (no offload)",
                          deepspeed_zero2_gpu_bytes(params, world), "model states only"))
    out.append(Comparison("DeepSpeed estimate_zero3 (no offload)",
                          deepspeed_zero3_gpu_bytes(params, largest_layer_params, world),
                          "model states + the largest layer in fp32"))
    return tuple(out)
