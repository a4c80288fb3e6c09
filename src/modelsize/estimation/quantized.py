"""Quantized weights in a trace: tensor subclasses, bitsandbytes parameters, ``--quantize``.

A quantized weight is not one storage: a torchao ``Int8Tensor`` is a wrapper whose bytes are
its inner ``qdata`` and ``scale`` tensors, and a bitsandbytes ``Params4bit`` is a ``uint8``
tensor of packed nibbles whose ``quant_state`` holds the block scales (``absmax``, with a
second level of ``absmax``/``code``/``offset`` under double quantization) and the 16-value
codebook. What this module gives the trace and the real run:

* :func:`fake_copy`: the fake twin of a wrapper subclass, rebuilt from fake twins of its
  inner tensors (``__tensor_flatten__`` / ``__tensor_unflatten__``), so the subclass's own
  ``__torch_dispatch__`` runs on fake data and every op it makes is counted;
* :func:`carry_state`: a bitsandbytes parameter's quantization state copied onto its fake
  twin (fake tensors), so bitsandbytes' own ``forward`` runs unchanged in the trace (without
  it, ``Linear4bit.forward`` tries to rebuild a ``Params4bit`` around the fake tensor and
  fails);
* :func:`storages`: the plain tensors that hold a tensor's bytes, for counting (the trace's
  parameters, the real run's bytes before the program);
* :func:`quantize_model`: ``--quantize int8|int4|fp8|nf4`` applied to a model, by torchao or
  bitsandbytes, named in the result (:func:`scheme_label`).
"""

from __future__ import annotations

import contextlib
import copy
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from modelsize.errors import MissingDependencyError, UsageError


def is_wrapper(t: torch.Tensor) -> bool:
    """Whether ``t`` is a wrapper tensor subclass whose bytes live in inner tensors."""
    return bool(is_traceable_wrapper_subclass(t))


def inner_tensors(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The plain tensors inside the wrapper ``t`` (recursively), in flatten order."""
    names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
    for name in names:
        inner = getattr(t, name)
        if is_wrapper(inner):
            yield from inner_tensors(inner)
        else:
            yield inner


def _quant_state(t: torch.Tensor) -> Any:
    """A bitsandbytes ``QuantState`` attached to ``t``, or None (no import of bitsandbytes)."""
    return t.__dict__.get("quant_state") if hasattr(t, "__dict__") else None


def _state_tensors(state: Any) -> Iterator[torch.Tensor]:
    for name in ("absmax", "code", "offset"):
        v = getattr(state, name, None)
        if isinstance(v, torch.Tensor):
            yield v
    state2 = getattr(state, "state2", None)
    if state2 is not None:
        yield from _state_tensors(state2)


def storages(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``t``'s bytes: the inner tensors of a wrapper subclass; a
    bitsandbytes parameter and its quantization state (4-bit ``quant_state``, 8-bit ``SCB``
    and ``CB`` where they are not the data itself); else ``t``."""
    if is_wrapper(t):
        return list(inner_tensors(t))
    out = [t]
    state = _quant_state(t)
    if state is not None:
        out += list(_state_tensors(state))
    for name in ("SCB", "CB"):
        v = t.__dict__.get(name) if hasattr(t, "__dict__") else None
        if isinstance(v, torch.Tensor):
            out.append(v)
    return out


def fake_copy(t: torch.Tensor, copy_plain: Callable[[torch.Tensor], torch.Tensor]
              ) -> torch.Tensor:
    """The fake twin of the wrapper subclass ``t``: the same subclass around fake twins
    (made by ``copy_plain``) of its inner tensors."""
    names, ctx = t.__tensor_flatten__()  # type: ignore[attr-defined]
    inner = {}
    for name in names:
        v = getattr(t, name)
        inner[name] = fake_copy(v, copy_plain) if is_wrapper(v) else copy_plain(v)
    return type(t).__tensor_unflatten__(  # type: ignore[attr-defined, no-any-return]
        inner, ctx, t.size(), t.stride())


def carry_state(real: torch.Tensor, fake: torch.Tensor,
                copy_plain: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    """Give the fake twin ``fake`` of a bitsandbytes parameter ``real`` its quantization
    state, with fake twins of the state's tensors; returns those twins (to be counted).
    A plain parameter gets nothing."""
    made: list[torch.Tensor] = []
    if not hasattr(real, "__dict__"):
        return made
    state = _quant_state(real)
    if state is not None:
        fake.quant_state = _fake_state(state, copy_plain, made)  # type: ignore[attr-defined]
        for name in ("blocksize", "compress_statistics", "quant_type", "quant_storage",
                     "bnb_quantized", "module"):
            if name in real.__dict__:
                setattr(fake, name, real.__dict__[name])
    for name in ("SCB", "CB"):
        v = real.__dict__.get(name)
        if isinstance(v, torch.Tensor):
            twin = fake if v.untyped_storage()._cdata == real.untyped_storage()._cdata \
                else copy_plain(v)
            setattr(fake, name, twin)
            made.append(twin)
    return made


def _fake_state(state: Any, copy_plain: Callable[[torch.Tensor], torch.Tensor],
                made: list[torch.Tensor]) -> Any:
    twin = copy.copy(state)
    for name in ("absmax", "code", "offset"):
        v = getattr(state, name, None)
        if isinstance(v, torch.Tensor):
            setattr(twin, name, copy_plain(v))
            made.append(getattr(twin, name))
    if getattr(state, "state2", None) is not None:
        twin.state2 = _fake_state(state.state2, copy_plain, made)
    return twin


class Scheme(str, Enum):
    """``--quantize``: weight-only quantization of a model's linear layers."""

    INT8 = "int8"
    INT4 = "int4"
    FP8 = "fp8"
    NF4 = "nf4"


@dataclass(frozen=True)
class Quantization:
    """How a model's weights were quantized, for the report; ``kept``: the linear layers
    left unquantized, each with why (``lm_head (transformers' default)``)."""

    scheme: str
    library: str
    layer: str
    kept: tuple[str, ...] = ()

    def label(self) -> str:
        """``nf4 (bitsandbytes Linear4bit)``."""
        return f"{self.scheme} ({self.library} {self.layer})"


def parse_scheme(scheme: str | Scheme) -> Scheme:
    """A user string to a :class:`Scheme` (one clean error otherwise)."""
    if isinstance(scheme, Scheme):
        return scheme
    try:
        return Scheme(str(scheme).lower())
    except ValueError:
        choices = ", ".join(s.value for s in Scheme)
        raise UsageError(f"unknown quantization {scheme!r}: expected one of {choices}") from None


def _require(module: str, scheme: Scheme) -> None:
    try:
        __import__(module)
    except ImportError as exc:
        raise MissingDependencyError(module, f"--quantize {scheme.value}", extra="quant") from exc


def quantize_model(model: nn.Module, scheme: str | Scheme,
                   skip: Sequence[str] | None = None) -> nn.Module:
    """``model`` with the weights of its ``nn.Linear`` layers quantized (weight-only), in
    place, and returned; what was applied is :func:`quantization_of` the result.

    ``int8``, ``int4``, ``fp8``: torchao's ``quantize_`` with ``Int8WeightOnlyConfig``,
    ``IntxWeightOnlyConfig(int4, PerGroup(128))`` (the int4 layout whose kernel runs on CPU:
    int4 values kept one per byte, torchao 0.18's packed ``Int4WeightOnlyConfig`` layouts
    need CUDA or mslk; a layer whose input features are not a multiple of 128 stays
    unquantized, as torchao cannot group it) and
    ``Float8WeightOnlyConfig``: each weight becomes a torchao tensor subclass. ``nf4``:
    each ``nn.Linear`` becomes a bitsandbytes ``Linear4bit`` (NF4, blocks of 64, double
    quantization and the compute dtype of the original weight, as transformers'
    ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
    bnb_4bit_use_double_quant=True)`` builds it).

    The layers ``skip`` names (transformers' ``should_convert_module`` patterns) stay
    unquantized; by default none of a plain module, and for a transformers model what
    ``from_pretrained`` keeps: the output embeddings, tied weights and the last module
    (``get_keys_to_not_convert``). A model on the meta device is quantized on meta: the
    quantizers' own code runs on meta tensors, so the packed data and every scale have the
    shapes and dtypes a real model's would, with no values and no memory.
    Works on its own: LoRA adapters (``estimation.lora``) can be applied on the result.
    """
    s = parse_scheme(scheme)
    patterns, why = (tuple(skip), "not converted") if skip is not None else (
        default_skips(model), "transformers' default")
    kept = [f"{name} ({why})" for name, m in model.named_modules()
            if type(m) is nn.Linear and not _converts(name, patterns)]
    if s is Scheme.NF4:
        _require("bitsandbytes", s)
        to_linear4bit(model, patterns)
        quant = Quantization(s.value, "bitsandbytes", "Linear4bit", tuple(kept))
    else:
        _require("torchao", s)
        from torchao.quantization import quantize_
        from torchao.quantization.quant_api import _is_linear

        groups = 128 if s is Scheme.INT4 else 0
        ungrouped = [f"{name} ({m.in_features} input features, not a multiple of {groups})"
                     for name, m in model.named_modules()
                     if groups and type(m) is nn.Linear and _converts(name, patterns)
                     and m.in_features % groups]

        def wanted(m: nn.Module, fqn: str) -> bool:
            return bool(_is_linear(m)) and _converts(fqn, patterns) and not (
                groups and isinstance(m, nn.Linear) and m.in_features % groups)

        quantize_(model, _torchao_config(s), filter_fn=wanted)
        layer = {Scheme.INT8: "Int8WeightOnlyConfig", Scheme.INT4: "IntxWeightOnlyConfig",
                 Scheme.FP8: "Float8WeightOnlyConfig"}[s]
        quant = Quantization(s.value, "torchao", layer, (*kept, *ungrouped))
    model.__dict__["_modelsize_quantization"] = quant
    return model


def default_skips(model: nn.Module) -> tuple[str, ...]:
    """The modules ``from_pretrained`` leaves unquantized in a transformers model
    (``transformers.quantizers.base.get_keys_to_not_convert``); none for another module."""
    if not loaded("transformers"):
        return ()
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        return ()
    from transformers.quantizers.base import get_keys_to_not_convert

    return tuple(sorted(get_keys_to_not_convert(model)))


def _converts(name: str, patterns: Sequence[str]) -> bool:
    """transformers' ``should_convert_module`` (``quantizers/quantizers_utils.py``): a
    pattern matches from the start up to a module boundary, as a regex, or as a suffix."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return not any(re.match(rf"(?:{key}){boundary}", name) or name.endswith(key)
                   for key in patterns)


def quantization_of(model: nn.Module) -> Quantization | None:
    """What :func:`quantize_model` applied to ``model``, or what its layers show (torchao
    subclasses, bitsandbytes layers), or None for a model with no quantized weight."""
    given = model.__dict__.get("_modelsize_quantization")
    if isinstance(given, Quantization):
        return given
    for m in model.modules():
        kind = type(m).__name__
        if kind in FOUR_BIT_LAYERS:
            qtype = getattr(getattr(m, "weight", None), "quant_type", "4bit")
            return Quantization(str(qtype), "bitsandbytes", kind)
        if kind == "Linear8bitLt":
            return Quantization("int8", "bitsandbytes", kind)
        if kind in _OWN_LAYERS:
            return Quantization(f"int{getattr(m, 'bits', 4)}", "modelsize", kind)
        w = m.__dict__.get("_parameters", {}).get("weight")
        if isinstance(w, torch.Tensor) and is_wrapper(w):
            return Quantization(_subclass_scheme(w), "torchao", type(w).__name__)
    return None


_OWN_LAYERS = ("GPTQLinear", "AWQLinear")
#: bitsandbytes' 4-bit layers (and peft's LoRA layers around them, of the same names).
FOUR_BIT_LAYERS = ("Linear4bit", "LinearNF4", "LinearFP4")


def has_4bit_layers(model: nn.Module) -> bool:
    """Whether ``model``'s quantized layers are bitsandbytes' 4-bit ones."""
    found = quantization_of(model)
    return (found is not None and found.library == "bitsandbytes"
            and found.layer in FOUR_BIT_LAYERS)


def _subclass_scheme(w: torch.Tensor) -> str:
    target = getattr(w, "target_dtype", None)  # torchao's Intx tensors: the logical dtype
    if isinstance(target, torch.dtype):
        return str(target).removeprefix("torch.")
    name = type(w).__name__
    if "Float8" in name:
        return "fp8"
    if "Int4" in name:
        return "int4"
    dtypes = {t.dtype for t in inner_tensors(w)}
    return "int8" if torch.int8 in dtypes else name


def _torchao_config(s: Scheme) -> Any:
    from torchao.quantization import (
        Float8WeightOnlyConfig,
        Int8WeightOnlyConfig,
        IntxWeightOnlyConfig,
    )
    from torchao.quantization.granularity import PerGroup

    if s is Scheme.INT8:
        return Int8WeightOnlyConfig()
    if s is Scheme.INT4:
        return IntxWeightOnlyConfig(weight_dtype=torch.int4,  # type: ignore[attr-defined]
                                     granularity=PerGroup(128))
    return Float8WeightOnlyConfig()


def to_linear4bit(model: nn.Module, skip: Sequence[str], quant_type: str = "nf4",
                  double_quant: bool = True, compute_dtype: torch.dtype | None = None,
                  quant_storage: torch.dtype = torch.uint8) -> None:
    """Each ``nn.Linear`` of ``model`` not in ``skip`` becomes a bitsandbytes ``Linear4bit``
    (blocks of 64), quantized where its weight is (the meta device included), as
    transformers' ``BitsAndBytesConfig(load_in_4bit=True, ...)`` builds it; the compute dtype
    defaults to the weight's."""
    import bitsandbytes as bnb
    from bitsandbytes import functional

    # quantize_blockwise caches its dynamic map on the device of the first call: made on
    # meta, every later real quantization in the process would fail to copy it
    if "dynamic" not in functional.name2qmap:
        functional.name2qmap["dynamic"] = functional.create_dynamic_map()
    for parent, name, child in _linears(model, skip):
        w = child.weight
        device = "meta" if w.is_meta else "cpu"
        layer = bnb.nn.Linear4bit(
            child.in_features, child.out_features, bias=child.bias is not None,
            compute_dtype=compute_dtype or w.dtype, compress_statistics=double_quant,
            quant_type=quant_type, quant_storage=quant_storage, device=device)
        layer.weight = bnb.nn.Params4bit(
            w.detach().to(device), requires_grad=False, compress_statistics=double_quant,
            quant_type=quant_type, quant_storage=quant_storage, blocksize=64,
            module=layer)
        if child.bias is not None:
            layer.bias = nn.Parameter(child.bias.detach().clone(),
                                      requires_grad=child.bias.requires_grad)
        layer.weight = layer.weight._quantize(device)
        layer.quant_state = layer.weight.quant_state  # type: ignore[attr-defined]
        layer.train(child.training)
        setattr(parent, name, layer)


def _linears(model: nn.Module, skip: Sequence[str]) -> list[tuple[nn.Module, str, nn.Linear]]:
    """Every plain ``nn.Linear`` of ``model`` not in ``skip``: (its parent, its name, it)."""
    out = []
    for prefix, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and _converts(f"{prefix}.{name}" if prefix else name,
                                                      skip):
                out.append((parent, name, child))
    return out


def to_linear8bit(model: nn.Module, skip: Sequence[str], threshold: float = 6.0) -> None:
    """Each ``nn.Linear`` of ``model`` not in ``skip`` becomes a bitsandbytes
    ``Linear8bitLt`` with int8 weights and float32 row scales (``has_fp16_weights=False``,
    ``threshold``: transformers' ``load_in_8bit`` layer), quantized where its weight is."""
    import bitsandbytes as bnb

    for parent, name, child in _linears(model, skip):
        w = child.weight
        device = "meta" if w.is_meta else "cpu"
        layer = bnb.nn.Linear8bitLt(child.in_features, child.out_features,
                                    bias=child.bias is not None, has_fp16_weights=False,
                                    threshold=threshold, device=device)
        layer.weight = bnb.nn.Int8Params(w.detach().to(device), requires_grad=False,
                                         has_fp16_weights=False)
        layer.weight = layer.weight._quantize(device)
        if child.bias is not None:
            layer.bias = nn.Parameter(child.bias.detach().clone(),
                                      requires_grad=child.bias.requires_grad)
        layer.train(child.training)
        setattr(parent, name, layer)


def quantize_with_torchao(model: nn.Module, config: Any, skip: Sequence[str]) -> None:
    """torchao's ``quantize_`` with the torchao ``config`` on the linear layers of ``model``
    not in ``skip`` (on the meta device too)."""
    from torchao.quantization import quantize_
    from torchao.quantization.quant_api import _is_linear

    def wanted(m: nn.Module, fqn: str) -> bool:
        return bool(_is_linear(m)) and _converts(fqn, skip)

    quantize_(model, config, filter_fn=wanted)


def loaded(name: str) -> bool:
    """Whether the module ``name`` is already imported (we never import a quantization
    library just to look for its types)."""
    return name in sys.modules


@contextlib.contextmanager
def layer_states(model: nn.Module, copy_plain: Callable[[torch.Tensor], torch.Tensor],
                 track: Callable[[torch.Tensor], Any]) -> Iterator[None]:
    """For the trace, each bitsandbytes ``Linear8bitLt`` gets a copy of its ``state``
    (``MatmulLtState``) whose int8 weight ``CB`` and row scales ``SCB`` are fake twins
    (counted with ``track``); the layer's own state is put back afterwards.

    The layer's first forward moves ``weight.CB``/``weight.SCB`` into ``self.state``
    (``init_8bit_state``) and reads them from there: left alone, the trace would store fake
    tensors in the caller's model (and a real run of it would then read a fake tensor's
    data pointer).
    """
    saved: list[tuple[nn.Module, Any]] = []
    for m in model.modules():
        state = m.__dict__.get("state")
        if type(state).__name__ != "MatmulLtState":
            continue
        twin = copy.copy(state)
        for name in ("CB", "SCB"):
            v = getattr(state, name, None)
            if isinstance(v, torch.Tensor):
                fake = copy_plain(v)
                track(fake)
                setattr(twin, name, fake)
        saved.append((m, state))
        m.__dict__["state"] = twin
    try:
        yield
    finally:
        for m, old in saved:
            m.__dict__["state"] = old


def layer_state_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The tensors bitsandbytes 8-bit layers keep in ``state`` (not parameters, not
    buffers): the int8 weight and its row scales once the first forward moved them there."""
    out: list[torch.Tensor] = []
    for m in model.modules():
        state = m.__dict__.get("state")
        if type(state).__name__ == "MatmulLtState":
            out += [v for v in (getattr(state, n, None) for n in ("CB", "SCB"))
                    if isinstance(v, torch.Tensor)]
    return out


def quantize_copy(model: nn.Module, scheme: str | Scheme) -> nn.Module:
    """:func:`quantize_model` on a deep copy of ``model`` (the caller's model untouched)."""
    s = parse_scheme(scheme)
    return quantize_model(copy.deepcopy(model), s)


def quantize_target(target: Any, scheme: str | Scheme) -> Any:
    """A CLI target (``estimation.targets.Target``) whose model is quantized by
    :func:`quantize_model` (``--quantize``). A model built on the meta device (a built-in or
    config.json model) is quantized there: the quantizers run on meta tensors, so the
    quantized layers get the packed data and scales of the real layout, with no values and
    no memory."""
    import dataclasses

    plan = getattr(target, "weights", None)
    if plan is not None and (plan.quant_method or plan.stored):
        raise UsageError(f"--quantize {scheme}: {target.name} is already quantized "
                         f"({plan.quant_method or 'stored tensors'}); its own layout is "
                         "estimated without --quantize")
    return dataclasses.replace(target, model=quantize_model(target.model, scheme))


def notes(model: nn.Module, device: str | None) -> tuple[str, ...]:
    """What the report says of ``model``'s quantized layers: the linear layers kept
    unquantized, and for a CUDA estimate of bitsandbytes layers what the trace's kernels were
    checked against: ``Linear4bit`` on an H100 (``benchmarks/gpu/validate_quantized.py``),
    ``Linear8bitLt`` never (its CPU and default kernels' allocations are counted,
    :mod:`modelsize.estimation.quant_kernels`)."""
    found = quantization_of(model)
    if found is None:
        return ()
    out: list[str] = []
    if found.kept:
        shown = ", ".join(found.kept[:4]) + (f" and {len(found.kept) - 4} more"
                                            if len(found.kept) > 4 else "")
        out.append(f"--quantize {found.scheme}: {len(found.kept)} linear layers kept "
                   f"unquantized: {shown}")
    if (device or "cpu").startswith("cuda") and found.library == "bitsandbytes":
        if found.layer in FOUR_BIT_LAYERS:
            out.append("bitsandbytes on CUDA: its 4-bit layers follow gemm_4bit's CUDA kernel "
                       "(fused below the batch its heuristic sets for an H100, else the weight "
                       "dequantized), checked on an H100 with bitsandbytes 0.50.2 within "
                       "0.012% of max_memory_allocated for inference, QLoRA and 8-bit AdamW "
                       "(benchmarks/RESULTS.md); other versions and GPUs are not")
        else:
            out.append("bitsandbytes on CUDA: unvalidated; the trace counts the allocations of "
                       f"bitsandbytes' CPU and default kernels for {found.layer} "
                       "(backends/cpu, backends/default), its CUDA kernels were not checked "
                       "against a GPU run")
    return tuple(out)


def is_quantized(t: torch.Tensor) -> bool:
    """Whether ``t`` is a quantized weight: a wrapper subclass or a bitsandbytes parameter
    with a 4-bit quantization state."""
    return is_wrapper(t) or _quant_state(t) is not None


def materialized(t: torch.Tensor) -> torch.Tensor:
    """A real CPU twin of the quantized weight ``t`` (one made on the meta device by
    :func:`quantize_model`), zero-filled: the same subclass and layout, every inner tensor
    and quantization-state tensor a zero tensor of its shape and dtype, so a real run
    (``verify``) allocates what a quantized model's run allocates."""

    def zeros(v: torch.Tensor) -> torch.Tensor:
        return torch.zeros(v.shape, dtype=v.dtype) if v.is_meta else v.detach().to("cpu")

    if is_wrapper(t):
        return fake_copy(t, zeros)
    return _bnb_twin(t, zeros)


def meta_twin(t: torch.Tensor) -> torch.Tensor:
    """A copy of the bitsandbytes parameter ``t`` on the meta device (``Params4bit`` with its
    quantization state, or ``Int8Params`` with its ``SCB``), every inner tensor a new meta
    tensor of its shape, stride and dtype: what ``copy.deepcopy`` cannot make (bitsandbytes'
    ``__deepcopy__`` sets meta data on a CPU tensor and fails)."""

    def empty(v: torch.Tensor) -> torch.Tensor:
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")

    return _bnb_twin(t, empty)


def _bnb_twin(t: torch.Tensor, copy_plain: Callable[[torch.Tensor], torch.Tensor]
              ) -> torch.Tensor:
    """The bitsandbytes parameter ``t`` remade with ``copy_plain`` of each inner tensor."""
    scb = t.__dict__.get("SCB") if hasattr(t, "__dict__") else None
    if isinstance(scb, torch.Tensor):  # bitsandbytes Int8Params: the data is its CB
        data = copy_plain(t.data)
        return type(t).__new__(type(t), data, requires_grad=False,  # type: ignore[no-any-return]
                               has_fp16_weights=t.__dict__.get("has_fp16_weights", False),
                               CB=data, SCB=copy_plain(scb))
    state = _quant_state(t)
    made: list[torch.Tensor] = []
    twin = type(t).__new__(type(t), copy_plain(t.data), requires_grad=t.requires_grad,
                           quant_state=_fake_state(state, copy_plain, made),
                           blocksize=t.__dict__.get("blocksize"),
                           compress_statistics=t.__dict__.get("compress_statistics", True),
                           quant_type=t.__dict__.get("quant_type", "nf4"),
                           quant_storage=t.__dict__.get("quant_storage", torch.uint8),
                           module=t.__dict__.get("module"), bnb_quantized=True)
    return twin  # type: ignore[no-any-return]


def materialized_memo(model: nn.Module) -> dict[int, Any]:
    """A ``copy.deepcopy`` memo that puts a :func:`materialized` twin in place of each
    quantized parameter of ``model`` on the meta device (bitsandbytes' ``Params4bit``
    cannot be deep-copied on meta: its ``__deepcopy__`` sets meta data on a CPU tensor), and
    the twin's quantization state in place of the parameter's wherever else it is held."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        if id(p) in memo:
            continue
        if p.is_meta and (is_quantized(p) or "SCB" in p.__dict__):
            twin = materialized(p)
            same_state(memo, p, twin)
        elif is_wrapper(p) and not p.is_meta:  # optimum-quanto's QTensors: no deepcopy
            twin = fake_copy(p, lambda v: v.detach().clone())
        else:
            continue
        memo[id(p)] = twin if isinstance(twin, nn.Parameter) else nn.Parameter(
            twin, requires_grad=p.requires_grad)
    return memo


def same_state(memo: dict[int, Any], p: torch.Tensor, twin: torch.Tensor) -> None:
    """Put ``twin``'s 4-bit state in a ``copy.deepcopy`` memo in place of ``p``'s: the layer
    holds the same state (``Linear4bit.quant_state``, which bitsandbytes gives back to
    FSDP's gathered weight), and a deep copy of it apart from the twin's would stay on meta
    (a real run through it would allocate nothing)."""
    state = _quant_state(p)
    if state is not None:
        memo[id(state)] = _quant_state(twin)


@contextlib.contextmanager
def fsdp_weights() -> Iterator[None]:
    """bitsandbytes' ``Linear4bit`` under FSDP in the trace: FSDP2 hands the layer its
    gathered weight as a plain parameter, and bitsandbytes' forward gives it back its 4-bit
    state by wrapping it in ``Params4bit`` (``fix_4bit_weight_quant_state_from_module``),
    which shares the storage (``Tensor._make_subclass``) and allocates nothing. A fake tensor
    cannot be wrapped so, so here the state is set on the gathered weight itself: the same
    storage and state for the forward, no bytes more or less."""
    modules = sys.modules.get("bitsandbytes.nn.modules")
    original = getattr(modules, "fix_4bit_weight_quant_state_from_module", None)
    if original is None:
        yield
        return

    def fix(module: Any) -> None:
        weight = module.weight
        if (getattr(weight, "quant_state", None) is None
                and isinstance(weight, torch._subclasses.FakeTensor)
                and not type(weight).__name__.startswith("Params4bit")
                and getattr(module, "quant_state", None) is not None):
            weight.quant_state = module.quant_state  # type: ignore[attr-defined]
            return
        original(module)

    modules.fix_4bit_weight_quant_state_from_module = fix  # type: ignore[union-attr]
    try:
        yield
    finally:
        modules.fix_4bit_weight_quant_state_from_module = original  # type: ignore[union-attr]


@contextlib.contextmanager
def kernels_for(model: nn.Module, device: str | None) -> Iterator[None]:
    """For an estimate on CUDA, bitsandbytes ``Linear4bit`` layers take their CUDA path in
    the trace (whose fake tensors are CPU tensors): without this, on a CPU with AVX512-BF16
    their first inference forward repacks the weight for the CPU kernel
    (``_convert_weight_packed_for_cpu``, a bfloat16 ``absmax``) and runs ``gemv_4bit``, which
    the CUDA kernels never do. The layers' flag is put back afterwards."""
    changed: list[nn.Module] = []
    if (device or "cpu").startswith("cuda"):
        for m in model.modules():
            if m.__dict__.get("support_avx512bf16_for_cpu"):
                m.__dict__["support_avx512bf16_for_cpu"] = False
                changed.append(m)
    try:
        yield
    finally:
        for m in changed:
            m.__dict__["support_avx512bf16_for_cpu"] = True
