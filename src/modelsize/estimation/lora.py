"""LoRA adapters, as peft makes them: ``--lora r=16,alpha=32,targets=q_proj,v_proj``.

The estimate traces peft's own ``get_peft_model(model, LoraConfig(...))``: the frozen base
layers, the trainable ``lora_A`` / ``lora_B`` pairs, the dropout and the scaling exactly as
peft's forward runs them, so the activations each adapter keeps for the backward are the ones
a training run keeps. :func:`apply_lora` works on any ``nn.Module`` peft can wrap, quantized
ones included (peft has LoRA layers for bitsandbytes ``Linear4bit`` and ``Linear8bitLt``):
QLoRA is a quantization step, then :func:`apply_lora`.

:func:`adapted_copy` is what ``estimate(..., lora=...)`` traces: a copy of the caller's model
whose plain parameters are meta tensors (no data is copied), with the adapters applied; the
caller's model is left as it was.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from modelsize.errors import MissingDependencyError, UsageError

if TYPE_CHECKING:
    from torch import nn

    from modelsize.estimation.result import Estimate

#: ``targets=all-linear``: peft's shorthand for every linear layer but the output head.
ALL_LINEAR = "all-linear"
_KEYS = ("r", "alpha", "targets", "dropout")


@dataclass(frozen=True)
class LoraSpec:
    """The LoRA settings that change memory: rank, scaling, the layers adapted, dropout.

    ``targets`` are module names as peft matches them (``q_proj`` matches every
    ``...q_proj``), or ``("all-linear",)``. ``alpha`` None is peft's default ``lora_alpha``;
    ``dropout`` 0 is peft's default ``lora_dropout`` (no dropout layer runs).
    """

    r: int
    targets: tuple[str, ...]
    alpha: float | None = None
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.r < 1:
            raise UsageError(f"--lora: r must be at least 1, not {self.r}")
        if not self.targets or any(not t for t in self.targets):
            raise UsageError("--lora: targets must name modules, e.g. targets=q_proj,v_proj")
        if not 0.0 <= self.dropout < 1.0:
            raise UsageError(f"--lora: dropout must be in [0, 1), not {self.dropout}")

    def __str__(self) -> str:
        parts = [f"r={self.r}"]
        if self.alpha is not None:
            parts.append(f"alpha={self.alpha:g}")
        parts.append("targets=" + ",".join(self.targets))
        if self.dropout:
            parts.append(f"dropout={self.dropout:g}")
        return ",".join(parts)

    def config(self) -> Any:
        """peft's ``LoraConfig`` of these settings (everything else at peft's defaults)."""
        try:
            from peft import LoraConfig
        except ImportError as exc:
            raise MissingDependencyError("peft", "--lora", extra="estimate") from exc
        kwargs: dict[str, Any] = {"r": self.r, "lora_dropout": self.dropout}
        kwargs["target_modules"] = (ALL_LINEAR if self.targets == (ALL_LINEAR,)
                                    else list(self.targets))
        if self.alpha is not None:
            kwargs["lora_alpha"] = self.alpha
        return LoraConfig(**kwargs)


def parse_lora(text: str | LoraSpec) -> LoraSpec:
    """``r=16,alpha=32,targets=q_proj,v_proj[,dropout=0.05]`` (or ``targets=all-linear``) as
    a :class:`LoraSpec`; a bad string is one :class:`UsageError` line."""
    if isinstance(text, LoraSpec):
        return text
    if not isinstance(text, str):
        raise UsageError(f"lora must be a string or a LoraSpec, not {type(text).__name__}")
    values: dict[str, list[str]] = {}
    key = ""
    for item in (s.strip() for s in text.split(",")):
        if "=" in item:
            key, _, value = item.partition("=")
            key = key.strip().lower()
            if key not in _KEYS:
                raise UsageError(f"--lora {text!r}: unknown key {key!r}: expected "
                                 + ", ".join(_KEYS))
            if key in values:
                raise UsageError(f"--lora {text!r}: {key} given twice")
            values[key] = [value.strip()]
        elif key == "targets" and item:
            values[key].append(item)
        elif item or not key:
            raise UsageError(f"--lora {text!r}: expected key=value, found {item!r} "
                             "(only targets takes a comma-separated list)")
    for needed in ("r", "targets"):
        if needed not in values:
            raise UsageError(f"--lora {text!r}: {needed}= is required, e.g. "
                             "r=16,alpha=32,targets=q_proj,v_proj")
    return LoraSpec(
        r=_number(text, "r", values["r"][0], int),
        targets=tuple(values["targets"]),
        alpha=_number(text, "alpha", values["alpha"][0], float) if "alpha" in values else None,
        dropout=(_number(text, "dropout", values["dropout"][0], float)
                 if "dropout" in values else 0.0),
    )


def _number(text: str, key: str, value: str, kind: type[int] | type[float]) -> Any:
    try:
        return kind(value)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise UsageError(f"--lora {text!r}: {key} must be {what}, not {value!r}") from None


def apply_lora(model: nn.Module, spec: LoraSpec | str) -> nn.Module:
    """``peft.get_peft_model(model, LoraConfig(...))``: ``model`` is changed in place (its
    targeted layers become peft's LoRA layers, every base parameter frozen) and the returned
    ``PeftModel`` wraps it. Any module peft can adapt works, bitsandbytes' quantized linears
    included. A target that matches nothing is a :class:`UsageError`."""
    spec = parse_lora(spec)
    config = spec.config()
    from peft import get_peft_model

    _flag_quantized(model)

    try:
        with warnings.catch_warnings():
            # peft reads transformers' deprecated ``is_gradient_checkpointing`` and warns where
            # it fixes a setting itself (``fan_in_fan_out`` for GPT-2's Conv1D): its notices.
            warnings.simplefilter("ignore")
            return get_peft_model(model, config)
    except ValueError as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UsageError(f"--lora {spec}: {first}") from None


def _flag_quantized(model: nn.Module) -> None:
    """``is_loaded_in_4bit`` / ``is_loaded_in_8bit`` on a model with bitsandbytes layers, as
    transformers sets them when it loads one: peft picks its bitsandbytes LoRA layers
    (``peft.tuners.lora.bnb``) only for a model so flagged, the generic one otherwise."""
    kinds = {type(m).__name__ for m in model.modules()
             if type(m).__module__.startswith("bitsandbytes")}
    for cls, flag in (("Linear4bit", "is_loaded_in_4bit"), ("Linear8bitLt", "is_loaded_in_8bit")):
        if cls in kinds and not getattr(model, flag, False):
            setattr(model, flag, True)


def adapted_copy(model: nn.Module, spec: LoraSpec | str) -> nn.Module:
    """:func:`apply_lora` on a copy of ``model`` whose plain parameters are meta tensors of
    the same shapes, dtypes and ``requires_grad`` (tied ones stay tied); bitsandbytes
    parameters on the meta device are remade there (:func:`~modelsize.estimation.quantized.
    meta_twin`); buffers and other parameters (quantized ones) are deep-copied. ``model`` is
    not touched."""
    import torch
    from torch import nn

    from modelsize.estimation.quantized import is_wrapper, meta_twin, same_state

    memo: dict[int, Any] = {}
    twins: list[tuple[Any, Any]] = []
    for p in model.parameters():
        if type(p) is nn.Parameter or isinstance(p, torch._subclasses.FakeTensor):
            meta = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device="meta")
            memo[id(p)] = nn.Parameter(meta, requires_grad=p.requires_grad)
        elif p.is_meta and not is_wrapper(p) and id(p) not in memo:
            twins.append((p, meta_twin(p)))  # bitsandbytes' own deepcopy fails on meta
            memo[id(p)] = twins[-1][1]
            same_state(memo, p, twins[-1][1])
    work = copy.deepcopy(model, memo)
    for p, twin in twins:  # Params4bit.module: the copy's layer, as deepcopy would set it
        owner = p.__dict__.get("module")
        if owner is not None:
            twin.module = memo.get(id(owner), owner)  # type: ignore[attr-defined]
    return apply_lora(work, spec)


def lora_note(est: Estimate, model: nn.Module, spec: LoraSpec) -> Estimate:
    """``est`` with the note of :func:`describe` added."""
    from dataclasses import replace

    return replace(est, notes=(*est.notes, describe(model, spec)))


def describe(model: nn.Module, spec: LoraSpec) -> str:
    """The note of a LoRA estimate: the settings and what peft adapted."""
    from torch import nn

    adapted = sum(1 for m in model.modules()
                  if isinstance(getattr(m, "lora_A", None), nn.ModuleDict))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return (f"LoRA {spec} (peft get_peft_model): {adapted:,} layers adapted, "
            f"{trainable:,} trainable parameters, the base frozen")
