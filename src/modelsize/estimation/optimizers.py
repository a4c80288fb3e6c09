"""Optimizers by name, and the implementation choice (for-loop, foreach, fused) made explicit.

The implementation matters for memory: ``foreach`` kernels allocate parameter-sized
temporaries for a whole group at once where the for-loop allocates one parameter's worth at a
time. PyTorch picks the default from the parameters' device *and type* (fake tensors would
silently get the for-loop), so we resolve it from the device being estimated instead.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from enum import Enum
from typing import TYPE_CHECKING, Any, TypeAlias

from modelsize.errors import UsageError

if TYPE_CHECKING:
    import torch

OptimizerFactory = Callable[[Iterable[Any]], "torch.optim.Optimizer"]
OptimizerSpec: TypeAlias = "str | OptimizerFactory"


class OptimizerName(str, Enum):
    """The built-in optimizers (``momentum`` is SGD with momentum 0.9)."""

    SGD = "sgd"
    MOMENTUM = "momentum"
    ADAM = "adam"
    ADAMW = "adamw"
    ADAGRAD = "adagrad"
    RMSPROP = "rmsprop"
    ADAMW8BIT = "adamw8bit"
    """bitsandbytes' ``AdamW8bit``: 1-byte states with a float32 absmax per 256 elements."""
    PAGED_ADAMW8BIT = "paged_adamw8bit"
    """bitsandbytes' ``PagedAdamW8bit``: the same bytes, large states in CUDA unified memory."""

    def __str__(self) -> str:
        return self.value


class Implementation(str, Enum):
    """How an optimizer walks its parameters."""

    DEFAULT = "default"
    """What PyTorch picks for the device: foreach on CUDA, the for-loop on CPU."""
    FOR_LOOP = "for-loop"
    FOREACH = "foreach"
    FUSED = "fused"

    def __str__(self) -> str:
        return self.value


#: bitsandbytes' optimizers (one implementation each: ``--impl`` does not apply).
BITSANDBYTES = frozenset({OptimizerName.ADAMW8BIT, OptimizerName.PAGED_ADAMW8BIT})

_FUSED_CAPABLE = {OptimizerName.ADAM, OptimizerName.ADAMW, OptimizerName.SGD,
                  OptimizerName.MOMENTUM, OptimizerName.ADAGRAD}


def parse_name(name: str) -> OptimizerName:
    """Validate a user string as an :class:`OptimizerName`."""
    aliases = {"sgd-momentum": "momentum", "sgdm": "momentum", "sgd_momentum": "momentum",
               "adamw_8bit": "adamw8bit", "adamw-8bit": "adamw8bit",
               "paged_adamw_8bit": "paged_adamw8bit", "paged-adamw8bit": "paged_adamw8bit"}
    key = aliases.get(name.lower(), name.lower())
    try:
        return OptimizerName(key)
    except ValueError:
        known = ", ".join(o.value for o in OptimizerName)
        raise UsageError(f"unknown optimizer {name!r}: expected one of {known}") from None


def parse_implementation(name: str | Implementation | None) -> Implementation:
    """Validate a user string as an :class:`Implementation`."""
    if name is None:
        return Implementation.DEFAULT
    try:
        return Implementation(name)
    except ValueError:
        known = ", ".join(i.value for i in Implementation)
        raise UsageError(f"unknown optimizer implementation {name!r}: expected {known}") from None


def default_implementation(device_type: str) -> Implementation:
    """What ``torch.optim`` picks when neither ``foreach`` nor ``fused`` is given."""
    return Implementation.FOREACH if device_type == "cuda" else Implementation.FOR_LOOP


def make_factory(spec: OptimizerSpec, implementation: Implementation, device_type: str,
                 lr: float = 1e-3) -> OptimizerFactory:
    """A callable that builds the optimizer on a list of parameters.

    ``spec`` is a name or any callable (an optimizer class, a ``functools.partial``...). For a
    callable, the implementation is forced only where the caller left ``foreach`` unset.
    """
    impl = implementation
    if impl is Implementation.DEFAULT:
        impl = default_implementation(device_type)
    if not isinstance(spec, str):
        return _with_implementation(spec, impl)
    import torch

    name = parse_name(spec)
    if name in BITSANDBYTES:
        from modelsize.estimation.bnb_optim import factory

        return factory(name is OptimizerName.PAGED_ADAMW8BIT, lr)
    if impl is Implementation.FUSED and name not in _FUSED_CAPABLE:
        raise UsageError(f"{name} has no fused implementation in torch.optim")
    flags: dict[str, Any] = {"foreach": impl is Implementation.FOREACH}
    if impl is Implementation.FUSED:
        flags = {"fused": True}
    classes: dict[OptimizerName, tuple[Any, dict[str, Any]]] = {
        OptimizerName.SGD: (torch.optim.SGD, {"lr": lr}),
        OptimizerName.MOMENTUM: (torch.optim.SGD, {"lr": lr, "momentum": 0.9}),
        OptimizerName.ADAM: (torch.optim.Adam, {"lr": lr}),
        OptimizerName.ADAMW: (torch.optim.AdamW, {"lr": lr}),
        OptimizerName.ADAGRAD: (torch.optim.Adagrad, {"lr": lr}),
        OptimizerName.RMSPROP: (torch.optim.RMSprop, {"lr": lr}),
    }
    cls, kwargs = classes[name]
    return functools.partial(cls, **kwargs, **flags)


def _with_implementation(factory: OptimizerFactory, impl: Implementation) -> OptimizerFactory:
    def build(params: Iterable[Any]) -> torch.optim.Optimizer:
        opt = factory(params)
        for group in opt.param_groups:
            if group.get("fused"):
                continue
            if "foreach" in group and group["foreach"] is None:
                if impl is Implementation.FUSED and "fused" in group:
                    group["fused"] = True
                    group["foreach"] = False
                else:
                    group["foreach"] = impl is Implementation.FOREACH
        return opt

    return build


def describe(spec: OptimizerSpec) -> str:
    """A short name for reports."""
    if isinstance(spec, str):
        return str(parse_name(spec))
    func = getattr(spec, "func", spec)
    return getattr(func, "__name__", type(func).__name__)
