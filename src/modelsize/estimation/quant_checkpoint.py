"""A quantized checkpoint's layers, built on the meta device from its ``quantization_config``.

``from_pretrained`` replaces the linear layers a quantized checkpoint holds with the
quantization library's layers before it loads the weights. :func:`build_layers` does the
same on the meta-device model of a model folder or Hub repository
(:mod:`modelsize.estimation.model_source`), so the trace runs each layer's kernel and counts
its allocations (the dequantized weight a GPTQ layer makes per call, bitsandbytes' scratch):

* ``bitsandbytes`` ``load_in_4bit``: ``Linear4bit`` with the config's ``bnb_4bit_quant_type``,
  ``bnb_4bit_use_double_quant``, ``bnb_4bit_compute_dtype`` and ``bnb_4bit_quant_storage``,
  blocks of 64; ``load_in_8bit``: ``Linear8bitLt`` (``llm_int8_threshold``), int8 weight and
  row scales (``SCB``); both skip ``llm_int8_skip_modules`` (else transformers' default);
* ``torchao``: the config's ``quant_type`` (``{"default": <torchao config dict>}``) applied by
  torchao's ``quantize_`` on the meta tensors;
* ``gptq`` and ``awq``: modelsize's :class:`~modelsize.estimation.quant_layers.GPTQLinear` and
  :class:`~modelsize.estimation.quant_layers.AWQLinear` (their libraries' torch kernels);

For GPTQ and AWQ the layers converted are those the checkpoint holds packed
(``<module>.qweight``), as loading finds them; for bitsandbytes and torchao, every linear
layer but the config's skip list (else transformers' default: the output embeddings);
* ``fp8`` (transformers' fine-grained fp8, ``weight_block_size``): for a CPU estimate the
  float8 weights dequantized to the model's dtype, as loading does on CPU (the layers stay
  ``nn.Linear``); for CUDA, :class:`~modelsize.estimation.quant_layers.FP8Linear`.

* ``compressed-tensors``: the library's own ``apply_quantization_config`` and
  ``compress_model`` on the meta model, then the decompression its first-forward hook does
  (the layout held from then on, on CPU and CUDA alike).

Other methods (``fbgemm_fp8``, ``hqq``, ...) are not built: their tensors are
held as stored (:func:`modelsize.estimation.model_source.plan_folder`), for the reason
:func:`build_layers` returns.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from modelsize.estimation import quantized


@dataclass(frozen=True)
class Built:
    """What :func:`build_layers` did: the layers made (``layer -> count``), or why not
    (``reason``; with layers made: a remark on them)."""

    method: str
    layers: dict[str, int]
    reason: str = ""
    dequantized: str = ""
    """Set where loading dequantizes the weights: when, to what, by what (words)."""

    @property
    def done(self) -> bool:
        """Whether quantized layers were built."""
        return bool(self.layers)

    def note(self) -> str:
        """One line for the report."""
        if not self.done:
            return f"quantized layers ({self.method}) not built: {self.reason}"
        made = ", ".join(f"{n} {k}" for k, n in self.layers.items())
        if self.dequantized:
            return f"quantized weights ({self.method}) dequantized {self.dequantized}: {made}"
        return (f"quantized layers built from quantization_config ({self.method}): {made}; "
                "their kernels' allocations are traced" + (f" ({self.reason})" if self.reason
                                                          else ""))


def build_layers(model: nn.Module, config: Mapping[str, Any],
                 tensors: Mapping[str, Any], dtype: str, device: str | None = None) -> Built:
    """Replace, in place, the linear layers of the meta-device ``model`` that the checkpoint
    (``tensors``: name -> info with ``dtype``) holds quantized by the layers its
    ``quantization_config`` (``config``) names; ``dtype``: the model's; ``device``: the
    device loading is for (``cpu`` or ``cuda``: fp8 checkpoints load differently; None:
    unknown, an fp8 checkpoint's tensors are then held as stored)."""
    method = str(config.get("quant_method", "")).lower()
    builder = _BUILDERS.get(method)
    if builder is None:
        return Built(method, {}, "no layer class for this method in modelsize (its tensors "
                     "are counted as stored)")
    try:
        return builder(model, config, tensors, dtype, device)
    except (ImportError, ValueError, RuntimeError, NotImplementedError, TypeError,
            KeyError) as exc:
        return Built(method, {}, f"{type(exc).__name__}: {exc}")


def _linears(model: nn.Module, want: Callable[[str, nn.Linear], bool]
             ) -> list[tuple[nn.Module, str, str, nn.Linear]]:
    out = []
    for prefix, parent in model.named_modules():
        for name, child in parent.named_children():
            full = f"{prefix}.{name}" if prefix else name
            if type(child) is nn.Linear and want(full, child):
                out.append((parent, name, full, child))
    return out


def _count(model: nn.Module, kinds: tuple[type, ...]) -> dict[str, int]:
    out: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, kinds):
            out[type(m).__name__] = out.get(type(m).__name__, 0) + 1
    return out


def _packed(config: Mapping[str, Any], tensors: Mapping[str, Any], dtype: str,
            model: nn.Module, awq: bool) -> Built:
    from modelsize.estimation.quant_layers import AWQLinear, GPTQLinear

    bits = int(config.get("bits", config.get("w_bit", 4)))
    group = int(config.get("group_size", config.get("q_group_size", 128)))
    version = str(config.get("version", "gemm")).lower()
    method = "awq" if awq else "gptq"
    for parent, name, _, child in _linears(model, lambda n, _: f"{n}.qweight" in tensors):
        bias = child.bias is not None
        layer: nn.Module = (
            AWQLinear(bits, group, child.in_features, child.out_features, bias, version,
                      device="meta") if awq else
            GPTQLinear(bits, group, child.in_features, child.out_features, bias, device="meta"))
        layer.train(child.training)
        setattr(parent, name, layer)
    layers = _count(model, (AWQLinear, GPTQLinear))
    if not layers:
        raise ValueError(f"no <module>.qweight tensor in the checkpoint for {method}")
    model.__dict__["_modelsize_quantization"] = quantized.Quantization(
        f"int{bits}", "modelsize", next(iter(layers)), ())
    return Built(method, layers)


def _gptq(model: nn.Module, config: Mapping[str, Any], tensors: Mapping[str, Any],
          dtype: str, device: str | None = None) -> Built:
    return _packed(config, tensors, dtype, model, awq=False)


def _awq(model: nn.Module, config: Mapping[str, Any], tensors: Mapping[str, Any],
         dtype: str, device: str | None = None) -> Built:
    return _packed(config, tensors, dtype, model, awq=True)


def _skips(model: nn.Module, config: Mapping[str, Any], key: str) -> tuple[str, ...]:
    given = config.get(key)
    if given:
        return tuple(str(s) for s in given)
    return quantized.default_skips(model)


def _bitsandbytes(model: nn.Module, config: Mapping[str, Any], tensors: Mapping[str, Any],
                  dtype: str, device: str | None = None) -> Built:
    skip = _skips(model, config, "llm_int8_skip_modules")
    if config.get("load_in_4bit"):
        compute = config.get("bnb_4bit_compute_dtype") or "float32"
        storage = config.get("bnb_4bit_quant_storage") or "uint8"
        quantized.to_linear4bit(
            model, skip, quant_type=str(config.get("bnb_4bit_quant_type") or "fp4"),
            double_quant=bool(config.get("bnb_4bit_use_double_quant", False)),
            compute_dtype=getattr(torch, str(compute).removeprefix("torch.")),
            quant_storage=getattr(torch, str(storage).removeprefix("torch.")))
        kind = "Linear4bit"
    elif config.get("load_in_8bit"):
        quantized.to_linear8bit(model, skip, float(config.get("llm_int8_threshold", 6.0)))
        kind = "Linear8bitLt"
    else:
        raise ValueError("neither load_in_4bit nor load_in_8bit")
    layers = {kind: sum(1 for m in model.modules() if type(m).__name__ == kind)}
    return Built("bitsandbytes", layers)


def _torchao(model: nn.Module, config: Mapping[str, Any], tensors: Mapping[str, Any],
             dtype: str, device: str | None = None) -> Built:
    from torchao.core.config import config_from_dict

    quant_type = config.get("quant_type")
    if not isinstance(quant_type, Mapping) or set(quant_type) != {"default"}:
        raise ValueError("quant_type is not {'default': <torchao config>} (string and "
                         "per-module forms are not read)")
    ao_config = config_from_dict(dict(quant_type["default"]))
    skip = _skips(model, config, "modules_to_not_convert")
    quantized.quantize_with_torchao(model, ao_config, skip)
    made = sum(1 for m in model.modules()
               if any(quantized.is_wrapper(p) for p in m.parameters(recurse=False)))
    layers = {type(ao_config).__name__: made}
    if not any(layers.values()):
        raise ValueError(f"{type(ao_config).__name__} quantized no layer")
    return Built("torchao", layers)


def _skipped(name: str, skips: tuple[str, ...]) -> bool:
    return any(name == s or name.endswith("." + s) or name.startswith(s + ".") for s in skips)


def _fp8(model: nn.Module, config: Mapping[str, Any], tensors: Mapping[str, Any],
         dtype: str, device: str | None = None) -> Built:
    """transformers' ``FineGrainedFP8HfQuantizer``: with no CUDA (or XPU) device
    ``validate_environment`` sets ``dequantize=True`` for a pre-quantized checkpoint, so
    ``replace_with_fp8_linear`` replaces nothing and ``Fp8Dequantize`` turns each float8
    weight and its ``weight_scale_inv`` into a weight of the model's dtype: the layers stay
    ``nn.Linear``. On CUDA (compute capability 8.9 or more assumed) every ``nn.Linear`` but
    ``modules_to_not_convert`` and the output embeddings becomes ``FP8Linear``."""
    from modelsize.estimation.quant_layers import FP8Linear

    if device is None and not config.get("dequantize"):
        raise ValueError("what loading builds depends on the device (CPU: the weights "
                         "dequantized; CUDA: FP8Linear), and none was given")
    if config.get("dequantize") or device != "cuda":
        n = sum(1 for name, _ in model.named_modules()
                if tensors.get(f"{name}.weight") is not None
                and str(tensors[f"{name}.weight"].dtype).startswith("float8")
                and f"{name}.weight_scale_inv" in tensors)
        if not n:
            raise ValueError("no float8 <module>.weight with a weight_scale_inv in the checkpoint")
        return Built("fp8", {"nn.Linear (float8 weights dequantized)": n},
                     dequantized=f"at load to {dtype}, as transformers does on CPU or with "
                     "dequantize: true (its FP8 quantizer's Fp8Dequantize)")
    block = config.get("weight_block_size")
    block_size = (int(block[0]), int(block[1])) if block else None
    skips = (*(str(s) for s in config.get("modules_to_not_convert") or ()),
             *quantized.default_skips(model))
    weights_dtype = getattr(torch, dtype)
    for parent, name, _, child in _linears(model, lambda n, _: not _skipped(n, skips)):
        layer = FP8Linear(child.in_features, child.out_features, block_size,
                          child.bias is not None, weights_dtype,
                          str(config.get("activation_scheme", "dynamic")), device="meta")
        layer.train(child.training)
        setattr(parent, name, layer)
    layers = _count(model, (FP8Linear,))
    if not layers:
        raise ValueError("no linear layer to convert")
    model.__dict__["_modelsize_quantization"] = quantized.Quantization(
        "fp8", "modelsize", "FP8Linear", ())
    return Built("fp8", layers, "as the source of the Triton fp8 kernel path allocates; "
                 "unvalidated on CUDA")


def _compressed_tensors(model: nn.Module, config: Mapping[str, Any],
                        tensors: Mapping[str, Any], dtype: str,
                        device: str | None = None) -> Built:
    """transformers' ``CompressedTensorsHfQuantizer`` (``dequantize`` false, no
    ``use_optimized_inference``: the same on CPU and CUDA): compressed-tensors'
    ``apply_quantization_config`` and ``ModelCompressor.compress_model`` make the layout the
    checkpoint loads into, and the decompression pre-hook ``compress_model`` registers turns
    every quantized module back into a dense weight (with its quantization parameters kept)
    on the first forward. Built here by the library itself on the meta model, the layout
    held from the first forward on; the forward is the library's ``quantized_forward``."""
    import contextlib
    import io
    from copy import deepcopy

    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.compressors.base import decompress_module
    from compressed_tensors.quantization import apply_quantization_config
    from compressed_tensors.quantization.utils import is_module_quantized
    from transformers.utils.quantization_config import CompressedTensorsConfig

    ct = CompressedTensorsConfig.from_dict(dict(config))
    if ct.dequantize:
        raise ValueError("dequantize: true (the weights dequantized at load) is not modelled")
    if ct.use_optimized_inference:
        raise ValueError("use_optimized_inference (transformers' CompressedTensorsFP8Linear) "
                         "is not modelled")
    compressor = ModelCompressor.from_compression_config(ct)
    if compressor is None or compressor.quantization_config is None:
        raise ValueError("no quantization config_groups")
    with contextlib.redirect_stderr(io.StringIO()):  # the library's progress bars
        apply_quantization_config(model, deepcopy(compressor.quantization_config),
                                  run_compressed=False)
        if ct.is_quantization_compressed:
            compressor.compress_model(model=model)
        modules = [m for m in model.modules() if is_module_quantized(m)]
        for module in modules:  # what the first forward's ct_decompress_hook does
            decompress_module(module, compressor.force_compression_format)
        compressor.remove_decompression_hook(model)
    if not modules:
        raise ValueError("the config_groups quantize no module of the model")
    fmt = str(config.get("format") or "")
    return Built("compressed-tensors", {f"{type(modules[0]).__name__} ({fmt})": len(modules)},
                 dequantized=f"to {dtype} on the first forward (compressed-tensors' decompression "
                 "hook; the quantization parameters kept)")


_BUILDERS: dict[str, Callable[..., Built]] = {
    "gptq": _gptq,
    "awq": _awq,
    "bitsandbytes": _bitsandbytes,
    "torchao": _torchao,
    "fp8": _fp8,
    "compressed-tensors": _compressed_tensors,
}
