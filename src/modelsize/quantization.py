"""Parameters and bits per weight, whatever the packing.

A quantized checkpoint stores one weight as several tensors: int32 words holding eight 4-bit
values, scales, zero points, group indices, codebooks, serialized quant states. Counting their
elements gives the numbers people are misled by (an 8B GPTQ model shown as 2B parameters).
Here each known layout is recognised from its tensors' names, dtypes and shapes, helped by the
model's ``quantization_config`` when one sits beside the file, and each weight is turned into:

- **parameters**: the elements the packed weight unpacks to. Scales, zero points, ``g_idx``,
  ``absmax`` and quant states are not parameters.
- **counted bytes**: the stored bytes of the quantized weight with its scales, zero points and
  second-level scales. Not counted: ``g_idx``, codebooks (bitsandbytes' ``quant_map``),
  serialized quant-state blobs, stored shapes and format tags, activation scales. So
  bitsandbytes nf4 with double quantization gives QLoRA's published 4.127 bits.

``bits_per_weight`` is counted bytes x 8 over parameters, for each weight, each group of
weights stored alike, and the whole model. Tensors no layout claims count at their own dtype
(a bfloat16 embedding: 16 bits; a GGUF ``q4_K`` tensor: 4.5 bits, from ggml's block table).

Only weights count: tensors of the ``weights`` category (and a layout's parts found among
buffers). Optimizer state, gradients and buffers such as BatchNorm statistics are not
parameters. A storage viewed twice (tied weights) or stored twice (a duplicate) counts once.

Layouts live in one explicit registry (:data:`LAYOUTS`), each keyed by the name suffix of the
tensor that identifies it (its *anchor*). Nothing here reads tensor data or imports a framework.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from modelsize._records import field, record
from modelsize.categories import Category
from modelsize.dtypes import DTYPES, canonical, numel
from modelsize.inventory import Inventory, TensorRecord

#: The categories a layout's parts are looked for in (a reader may file ``g_idx`` as a buffer).
_LOOKED_AT = (Category.WEIGHTS, Category.BUFFERS)
#: Dtypes a layout's anchor never has when it is named ``*.weight`` (its packs are integers or
#: 8-bit floats): such a weight is skipped unmatched.
_WIDE = frozenset({"float16", "bfloat16", "float32", "float64"})
#: Largest ``config.json`` read for a ``quantization_config``.
_CONFIG_LIMIT = 4 << 20


@record(frozen=True, slots=True)
class QuantizedWeight:
    """One logical weight and the stored tensors that make it."""

    name: str
    """The weight's logical name (``model.layers.0.mlp.down_proj.weight``)."""
    layout: str
    """The layout's key in :data:`LAYOUTS` (``gptq``, ``bnb-nf4``...), or the dtype of an
    unquantized tensor."""
    label: str
    """How people call it: ``4-bit GPTQ, group 128``."""
    shape: tuple[int, ...]
    """The logical (unpacked) shape, ``()`` where the file does not say it."""
    parameters: int
    counted_bytes: int
    tensors: tuple[str, ...]
    """Every stored tensor claimed by this weight, counted or not."""

    @property
    def bits_per_weight(self) -> float:
        """Counted bytes x 8 over parameters."""
        return self.counted_bytes * 8 / self.parameters if self.parameters else 0.0


@record(frozen=True, slots=True)
class WeightGroup:
    """The weights stored alike (one layout and label), summed."""

    label: str
    layout: str
    weights: int
    parameters: int
    counted_bytes: int
    quantized: bool

    @property
    def bits_per_weight(self) -> float:
        """Counted bytes x 8 over parameters."""
        return self.counted_bytes * 8 / self.parameters if self.parameters else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"label": self.label, "layout": self.layout, "weights": self.weights,
                "parameters": self.parameters, "counted_bytes": self.counted_bytes,
                "bits_per_weight": round(self.bits_per_weight, 4),
                "quantized": self.quantized}


@record(frozen=True)
class Quantization:
    """Parameters and bits per weight of a checkpoint, overall and per group."""

    weights: tuple[QuantizedWeight, ...]
    notes: tuple[str, ...] = ()
    config: Mapping[str, Any] = field(default_factory=dict)
    title: str = ""
    """The file's own name for its quantization (``GGUF Q4_K_M``), when it says one."""
    parameters: int = field(init=False)
    counted_bytes: int = field(init=False)
    groups: tuple[WeightGroup, ...] = field(init=False)

    plain: tuple[TensorRecord, ...] = ()
    """The weights no layout claims, each counted at its own dtype (kept as records: a
    million of them cost no object each until :meth:`every_weight` is asked for)."""

    def __post_init__(self) -> None:
        sums: dict[tuple[str, str], list[int]] = {}
        quantized: set[tuple[str, str]] = set()
        for w in self.weights:
            key = (w.layout, w.label)
            acc = sums.setdefault(key, [0, 0, 0])
            acc[0] += 1
            acc[1] += w.parameters
            acc[2] += w.counted_bytes
            if is_quantized(w.layout):
                quantized.add(key)
        by_dtype: dict[str, list[int]] = {}
        prod = math.prod
        for t in self.plain:
            tally = by_dtype.get(t.dtype)
            if tally is None:
                tally = by_dtype[t.dtype] = [0, 0, 0]
            tally[0] += 1
            tally[1] += prod(t.shape)
            tally[2] += t.nbytes
        for dtype, (n, p, b) in by_dtype.items():
            key = (_plain_layout(dtype), _dtype_label(dtype))
            acc = sums.setdefault(key, [0, 0, 0])
            acc[0] += n
            acc[1] += p
            acc[2] += b
            if is_quantized(key[0]):
                quantized.add(key)
        groups = sorted(
            (WeightGroup(label, layout, n, p, b, (layout, label) in quantized)
             for (layout, label), (n, p, b) in sums.items()),
            key=lambda g: (-g.parameters, g.label))
        object.__setattr__(self, "groups", tuple(groups))
        object.__setattr__(self, "parameters", sum(g.parameters for g in groups))
        object.__setattr__(self, "counted_bytes", sum(g.counted_bytes for g in groups))

    def every_weight(self) -> list[QuantizedWeight]:
        """Every weight: those in a quantized layout, then the others at their dtype."""
        return [*self.weights, *(
            QuantizedWeight(t.name, _plain_layout(t.dtype), _dtype_label(t.dtype), t.shape,
                            numel(t.shape), _tensor_bytes(t), (t.name,)) for t in self.plain)]

    @property
    def bits_per_weight(self) -> float:
        """Counted bytes x 8 over parameters, for the whole model."""
        return self.counted_bytes * 8 / self.parameters if self.parameters else 0.0

    @property
    def quantized(self) -> tuple[WeightGroup, ...]:
        """The groups stored in a quantized layout."""
        return tuple(g for g in self.groups if g.quantized)

    def headline(self) -> str:
        """``8.03B parameters, 4.56 bits per weight (4-bit GPTQ, group 128)``."""
        if not self.parameters:
            return "no parameters"
        main = self.quantized[0] if self.quantized else self.groups[0]
        more = len(self.quantized) - 1 if self.quantized else 0
        what = self.title or main.label + (
            f" and {more} more quantized layout{'s' * (more > 1)}" if more > 0 else "")
        return (f"{count(self.parameters)} parameters, {self.bits_per_weight:.2f} bits per "
                f"weight ({what})")

    def by_name(self) -> dict[str, QuantizedWeight]:
        """Each weight by its logical name."""
        return {w.name: w for w in self.every_weight()}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (per weight lists are left to :meth:`by_name`)."""
        return {"parameters": self.parameters, "counted_bytes": self.counted_bytes,
                "bits_per_weight": round(self.bits_per_weight, 4),
                "headline": self.headline(), "title": self.title,
                "groups": [g.to_dict() for g in self.groups],
                "config": dict(self.config), "notes": list(self.notes)}


def count(n: int) -> str:
    """``8.03B``, ``124.4M``, ``3.2K``, ``512``: a parameter count as people say it."""
    for unit, scale in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            value = n / scale
            digits = 2 if value < 10 else 1 if value < 100 else 0
            return f"{value:.{digits}f}{unit}"
    return str(n)


# ---------------------------------------------------------------------------------------------
# Layouts


# Siblings, Found and Layout are plain slotted classes, not dataclasses: they are internal and
# never changed once made, and defining a dataclass costs about a millisecond of every inspect
# (this module is imported by it).


class Siblings:
    """The tensors around an anchor: ``get("scales")`` is the record named base + "scales"."""

    __slots__ = ("base", "config", "records")

    def __init__(self, base: str, records: Mapping[str, TensorRecord],
                 config: Mapping[str, Any]) -> None:
        self.base = base
        self.records = records
        self.config = config

    def get(self, suffix: str) -> TensorRecord | None:
        """The record named ``base + suffix``, if any."""
        return self.records.get(self.base + suffix)

    def module(self) -> str:
        """The module name (the base without its trailing dot)."""
        return self.base[:-1] if self.base.endswith(".") else self.base


class Found:
    """What a layout's matcher returns: the weight, and which of its tensors are counted."""

    __slots__ = ("counted", "label", "name", "parameters", "shape", "uncounted")

    def __init__(self, name: str, label: str, shape: tuple[int, ...], parameters: int,
                 counted: tuple[TensorRecord, ...],
                 uncounted: tuple[TensorRecord, ...] = ()) -> None:
        self.name = name
        self.label = label
        self.shape = shape
        self.parameters = parameters
        self.counted = counted
        self.uncounted = uncounted


Matcher = Callable[[TensorRecord, Siblings], "Found | None"]


class Layout:
    """A quantized layout: the suffix of the tensor that identifies it, and its matcher."""

    __slots__ = ("anchor", "key", "match", "spec")

    def __init__(self, key: str, anchor: str, match: Matcher, spec: str) -> None:
        self.key = key
        self.anchor = anchor
        self.match = match
        #: Where the layout is defined (a file in the tool's source).
        self.spec = spec


def _tensor_bytes(t: TensorRecord) -> int:
    """A tensor's own bytes (its logical size, not what it was charged with)."""
    return t.nbytes


def _bits_from_config(config: Mapping[str, Any], default: int | None = None) -> int | None:
    for key in ("bits", "w_bit", "num_bits", "weight_bits"):
        value = config.get(key)
        if isinstance(value, int) and 1 <= value <= 16:
            return value
    return default


def _group_from_config(config: Mapping[str, Any]) -> int | None:
    for key in ("group_size", "q_group_size", "groupsize"):
        value = config.get(key)
        if isinstance(value, int):
            return value
    return None


# --- layouts: GPTQ, AWQ, compressed-tensors, MLX (qlay1)

#: Bits of one storage word, by the dtype a packed weight is stored in.
_WORD_BITS = {"int8": 8, "uint8": 8, "int16": 16, "uint16": 16, "int32": 32, "uint32": 32,
              "int64": 64, "uint64": 64}
#: Activation quantization parameters stored beside a weight: claimed, not counted, not
#: parameters (compressed-tensors ``QuantizationScheme.input_activations``/``output_...``).
_ACTIVATION_PARAMS = ("input_scale", "input_zero_point", "input_global_scale", "output_scale",
                      "output_zero_point")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _method(config: Mapping[str, Any]) -> str:
    value = config.get("quant_method")
    return value.lower() if isinstance(value, str) else ""


def _gptq_format(config: Mapping[str, Any]) -> str:
    for key in ("checkpoint_format", "format"):
        value = config.get(key)
        if isinstance(value, str):
            return value.lower()
    return ""


def _group_text(group: int | None, in_features: int) -> str:
    if group is None or group <= 0 or group >= in_features:
        return "per-channel"
    return f"group {group}"


_GPTQ_SPEC = ("GPTQModel gptqmodel/nn_modules/qlinear/__init__.py: "
              "PackedGroupedQuantLinear._register_gptq_buffers (shapes), pack_original "
              "(packing); gptqmodel/quantization/config.py FORMAT (gptq, gptq_v2)")


def _gptq(qweight: TensorRecord, s: Siblings) -> Found | None:
    """GPTQ (AutoGPTQ, GPTQModel ``QuantLinear``; ``checkpoint_format`` ``gptq`` or
    ``gptq_v2``, which differ only in what the stored zero points mean, not in their shapes).

    GPTQModel ``PackedGroupedQuantLinear._register_gptq_buffers``: ``qweight``
    ``[ceil(in * bits / word), out]``, ``qzeros`` ``[ceil(in / group), ceil(out * bits / word)]``
    and ``scales`` float16 ``[ceil(in / group), out]``, ``g_idx`` int32 ``[in]`` (the group of
    each input row; act-order permutes it), where the word is the ``pack_dtype`` (int32 by
    default; int8/16/64 in GPTQModel). ``pack_original`` packs consecutive input rows, low bits
    first (3 bits: 32 values in three words)."""
    scales, qzeros, g_idx = s.get("scales"), s.get("qzeros"), s.get("g_idx")
    word = _WORD_BITS.get(qweight.dtype)
    if (scales is None or qzeros is None or word is None or len(qweight.shape) != 2
            or len(scales.shape) != 2 or len(qzeros.shape) != 2 or qzeros.dtype != qweight.dtype
            or _method(s.config) in ("awq", "compressed-tensors")):
        return None
    groups, out = scales.shape
    if qweight.shape[1] != out or not out or qzeros.shape[0] != groups:
        return None  # AWQ packs along the output dimension
    if g_idx is not None and len(g_idx.shape) != 1:
        g_idx = None
    bits = _bits_from_config(s.config)
    candidates = [bits] if bits else [2, 4, 8, 3]
    for b in candidates:
        in_features = g_idx.shape[0] if g_idx is not None else qweight.shape[0] * word // b
        if (_ceil_div(out * b, word) == qzeros.shape[1]
                and _ceil_div(in_features * b, word) == qweight.shape[0]):
            bits = b
            break
    else:
        return None
    group = _group_from_config(s.config)
    if group is None or group <= 0:
        group = _ceil_div(in_features, groups) if groups > 1 else -1
    version = " v2" if _gptq_format(s.config) == "gptq_v2" else ""
    order = ", act-order" if s.config.get("desc_act") is True else ""
    label = f"{bits}-bit GPTQ{version}, {_group_text(group, in_features)}{order}"
    extra = (g_idx,) if g_idx is not None else ()
    return Found(s.base + "weight", label, (out, in_features), out * in_features,
                 (qweight, qzeros, scales), extra)


def _awq_version(config: Mapping[str, Any]) -> str:
    value = config.get("version")
    return value.lower() if isinstance(value, str) else ""


_AWQ_GEMM_SPEC = ("AutoAWQ awq/modules/linear/gemm.py: WQLinear_GEMM.__init__ (shapes), "
                  "WQLinear_GEMM.from_linear (packing, order_map [0, 2, 4, 6, 1, 3, 5, 7])")


def _awq_gemm(qweight: TensorRecord, s: Siblings) -> Found | None:
    """AWQ, GEMM packing (AutoAWQ ``WQLinear_GEMM``, also GPTQModel's ``format: gemm``):
    ``qweight`` int32 ``[in, out * bits / 32]`` (eight 4-bit output columns a word, in the
    order 0, 2, 4, 6, 1, 3, 5, 7), ``qzeros`` int32 ``[in / group, out * bits / 32]``,
    ``scales`` float16 ``[in / group, out]``."""
    scales, qzeros = s.get("scales"), s.get("qzeros")
    if (scales is None or qzeros is None or len(qweight.shape) != 2 or len(scales.shape) != 2
            or len(qzeros.shape) != 2 or qweight.dtype not in ("int32", "uint32")
            or _awq_version(s.config) in ("gemv", "gemv_fast")
            or _method(s.config) in ("gptq", "compressed-tensors")):
        return None
    groups, out = scales.shape
    in_features, cols = qweight.shape
    if not cols or out % cols or qzeros.shape != (groups, cols) or not groups:
        return None
    bits = 32 * cols // out
    if bits not in (2, 3, 4, 8) or in_features % groups:
        return None
    group = _group_from_config(s.config) or in_features // groups
    return Found(s.base + "weight", f"{bits}-bit AWQ GEMM, {_group_text(group, in_features)}",
                 (out, in_features), out * in_features, (qweight, qzeros, scales))


_AWQ_GEMV_SPEC = ("AutoAWQ awq/modules/linear/gemv.py: WQLinear_GEMV.__init__ (shapes), "
                  "calculate_zeros_width (padded group columns), WQLinear_GEMV.from_linear")


def _awq_zeros_width(in_features: int, group: int) -> int | None:
    """AutoAWQ ``calculate_zeros_width``: the group count, padded to whole words of eight and
    to a multiple of 128 / group words."""
    multiplier = {32: 4, 64: 2}.get(group, 1 if group >= 128 else 0)
    if not multiplier or in_features % group:
        return None
    width = _ceil_div(in_features // group, 8)
    return _ceil_div(width, multiplier) * multiplier


def _awq_gemv(qweight: TensorRecord, s: Siblings) -> Found | None:
    """AWQ, GEMV packing (AutoAWQ ``WQLinear_GEMV``): ``qweight`` int32 ``[out, in / 8]``
    (eight consecutive input columns a word, in order), ``qzeros`` int32 ``[out, width]`` and
    ``scales`` float16 ``[out, width * 8]``, where ``width`` is ``calculate_zeros_width(in,
    group)``: the groups padded to whole words. The padding is stored, so it is counted."""
    scales, qzeros = s.get("scales"), s.get("qzeros")
    if (scales is None or qzeros is None or len(qweight.shape) != 2 or len(scales.shape) != 2
            or len(qzeros.shape) != 2 or qweight.dtype not in ("int32", "uint32")
            or _awq_version(s.config) not in ("", "gemv")
            or _method(s.config) in ("gptq", "compressed-tensors")):
        return None
    out, cols = qweight.shape
    width = qzeros.shape[1]
    if not out or scales.shape != (out, width * 8) or qzeros.shape[0] != out:
        return None
    in_features = cols * 8
    configured = _group_from_config(s.config)
    sizes = [configured] if configured else [128, 64, 32, 256]
    group = next((g for g in sizes if g and _awq_zeros_width(in_features, g) == width), None)
    if group is None:
        return None
    return Found(s.base + "weight", f"4-bit AWQ GEMV, {_group_text(group, in_features)}",
                 (out, in_features), out * in_features, (qweight, qzeros, scales))


# compressed-tensors: each quantized module's tensors, named by the compressor of its format.

_CT_PACK_SPEC = ("compressed-tensors compressed_tensors/compressors/pack_quantized/base.py: "
                 "PackedQuantizationCompressor.compression_param_names, compress "
                 "(pack_to_int32 in pack_quantized/helpers.py)")
_CT_FP4_SPEC = ("compressed-tensors compressed_tensors/compressors/nvfp4/base.py: "
                "NVFP4PackedCompressor; compressors/mxfp4/base.py: MXFP4PackedCompressor")
_CT_NAIVE_SPEC = ("compressed-tensors compressed_tensors/compressors/naive_quantized/base.py: "
                  "the int-quantized, float-quantized and naive-quantized formats")


def _ct_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The compressed-tensors settings: older checkpoints nest them in ``compression_config``
    as ``{"quantization_config": {...}, "sparsity_config": {...}}``."""
    inner = config.get("quantization_config")
    return inner if isinstance(inner, Mapping) and "config_groups" in inner else config


def _ct_method_ok(config: Mapping[str, Any], required: bool = False) -> bool:
    method = _method(_ct_config(config))
    return method == "compressed-tensors" or (not required and method == "")


def _ct_weights_args(config: Mapping[str, Any], module: str,
                     formats: tuple[str, ...]) -> Mapping[str, Any]:
    """The ``weights`` arguments of the ``config_groups`` entry that stores ``module`` in one
    of ``formats``: a group whose ``re:`` target matches the module, else the only group of
    those formats, else those groups' common settings; empty when the config does not say."""
    config = _ct_config(config)
    if not _ct_method_ok(config) or not isinstance(config.get("config_groups"), Mapping):
        return {}
    top = config.get("format")
    picked: list[Mapping[str, Any]] = []
    for group in config["config_groups"].values():
        if not isinstance(group, Mapping) or not isinstance(group.get("weights"), Mapping):
            continue
        fmt = group.get("format") or top
        if fmt not in formats and not (fmt == "mixed-precision" or fmt is None):
            continue
        targets = group.get("targets") or []
        for target in targets if isinstance(targets, list) else []:
            if isinstance(target, str) and target.startswith("re:"):
                try:
                    if re.match(target[3:], module):
                        return group["weights"]
                except re.error:
                    continue
        picked.append(group["weights"])
    if len(picked) == 1:
        return picked[0]
    common = {k: v for k, v in picked[0].items() if all(p.get(k) == v for p in picked)} \
        if picked else {}
    return common


def _ct_granularity(scale: TensorRecord, out: int, in_features: int,
                    args: Mapping[str, Any]) -> str:
    """How a compressed-tensors scale covers its weight (``QuantizationStrategy``)."""
    shape = scale.shape
    strategy = args.get("strategy")
    if numel(shape) == 1 or strategy == "tensor":
        return "per-tensor"
    if strategy == "block" or (len(shape) == 2 and shape[0] not in (out, 1)):
        block = args.get("block_structure")
        if isinstance(block, list) and len(block) == 2:
            return f"block {block[0]}x{block[1]}"
        if len(shape) == 2 and shape[0] and shape[1]:
            return f"block {_ceil_div(out, shape[0])}x{_ceil_div(in_features, shape[1])}"
    if len(shape) == 2 and shape[1] > 1:
        group = args.get("group_size")
        return f"group {group if isinstance(group, int) else in_features // shape[1]}"
    return "per-channel"


def _ct_activations(s: Siblings) -> tuple[TensorRecord, ...]:
    return tuple(t for t in (s.get(n) for n in _ACTIVATION_PARAMS) if t is not None)


def _ct_pack_quantized(packed: TensorRecord, s: Siblings) -> Found | None:
    """compressed-tensors ``pack-quantized`` (``PackedQuantizationCompressor``): integer weights
    of 1 to 8 bits packed into int32 ``weight_packed`` ``[out, ceil(in * bits / 32)]``,
    ``weight_scale`` ``[out, in / group]`` (or ``[out, 1]`` per channel), a packed
    ``weight_zero_point`` ``[ceil(out * bits / 32), groups]`` when asymmetric, ``weight_shape``
    (the logical shape as data: not read, not counted) and ``weight_g_idx`` with act-order (not
    counted). The bits come from ``config_groups``; without a config from ``weight_g_idx``,
    else 4 is assumed and said in the label."""
    scale = s.get("weight_scale")
    if (scale is None or packed.dtype != "int32" or len(packed.shape) != 2
            or not _ct_method_ok(s.config)):
        return None
    out, cols = packed.shape
    args = _ct_weights_args(s.config, s.module(), ("pack-quantized",))
    g_idx = s.get("weight_g_idx")
    bits = args.get("num_bits") if isinstance(args.get("num_bits"), int) else None
    group = args.get("group_size") if isinstance(args.get("group_size"), int) else None
    assumed = ""
    if g_idx is not None and len(g_idx.shape) == 1:
        in_features = g_idx.shape[0]
        bits = bits or _ceil_div(cols * 32, in_features)
    elif (bits and group and group > 0 and len(scale.shape) == 2 and scale.shape[1] > 1
          and args.get("strategy") in ("group", "tensor_group")):
        in_features = scale.shape[1] * group  # exact: cols only bounds it for odd bits
    else:
        if not bits:
            bits, assumed = 4, " (bits assumed: no quantization_config)"
        in_features = cols * 32 // bits
    if not bits or not in_features or _ceil_div(in_features * bits, 32) > cols:
        return None
    zero = s.get("weight_zero_point")
    counted = (packed, scale) + ((zero,) if zero is not None else ())
    uncounted = tuple(t for t in (s.get("weight_shape"), g_idx) if t is not None)
    grain = _ct_granularity(scale, out, in_features, args)
    order = ", act-order" if g_idx is not None or args.get("actorder") else ""
    label = f"{bits}-bit compressed-tensors pack-quantized, {grain}{order}{assumed}"
    return Found(s.base + "weight", label, (out, in_features), out * in_features, counted,
                 uncounted + _ct_activations(s))


def _ct_fp4_packed(packed: TensorRecord, s: Siblings) -> Found | None:
    """compressed-tensors ``nvfp4-pack-quantized`` and ``mxfp4-pack-quantized``: two FP4 (e2m1)
    values a byte in uint8 ``weight_packed`` ``[out, in / 2]``; ``weight_scale``
    ``[out, in / group]``: float8_e4m3fn for NVFP4 (group 16) with a float32
    ``weight_global_scale`` (a second-level scale: counted), uint8 (e8m0 exponents) for MXFP4
    (group 32)."""
    scale = s.get("weight_scale")
    if (scale is None or packed.dtype != "uint8" or len(packed.shape) != 2
            or len(scale.shape) != 2 or scale.shape[0] != packed.shape[0] or not scale.shape[1]
            or not _ct_method_ok(s.config)):
        return None
    out, cols = packed.shape
    in_features = cols * 2
    group = in_features // scale.shape[1]
    global_scale = s.get("weight_global_scale")
    if scale.dtype.startswith("float8_e4m3") and global_scale is not None:
        kind = "NVFP4"
    elif scale.dtype in ("uint8", "float8_e8m0fnu"):
        kind = "MXFP4"
    else:
        return None
    counted = (packed, scale) + ((global_scale,) if global_scale is not None else ())
    label = f"{kind} compressed-tensors {kind.lower()}-pack-quantized, group {group}"
    return Found(s.base + "weight", label, (out, in_features), out * in_features, counted,
                 _ct_activations(s))


def _ct_naive(weight: TensorRecord, s: Siblings, kind: str) -> Found | None:
    scale = s.get("weight_scale")
    if scale is None or len(weight.shape) != 2:
        return None
    out, in_features = weight.shape
    args = _ct_weights_args(s.config, s.module(), (f"{kind}-quantized", "naive-quantized"))
    zero = s.get("weight_zero_point")
    counted = (weight, scale) + ((zero,) if zero is not None else ())
    grain = _ct_granularity(scale, out, in_features, args)
    if kind == "int":
        what = "8-bit compressed-tensors int-quantized"
    else:
        what = f"fp8 {weight.dtype.removeprefix('float8_')} compressed-tensors float-quantized"
    return Found(s.base + "weight", f"{what}, {grain}", (out, in_features), out * in_features,
                 counted, _ct_activations(s))


def _ct_int_quantized(weight: TensorRecord, s: Siblings) -> Found | None:
    """compressed-tensors ``int-quantized`` (``naive-quantized``): int8 ``weight`` with
    ``weight_scale`` per tensor, channel ``[out, 1]`` or group, and ``weight_zero_point``
    when asymmetric. Needs no config: an int8 weight with a ``weight_scale`` is no other
    layout's (bitsandbytes int8 keeps ``SCB``)."""
    if weight.dtype != "int8" or not _ct_method_ok(s.config):
        return None
    return _ct_naive(weight, s, "int")


def _ct_float_quantized(weight: TensorRecord, s: Siblings) -> Found | None:
    """compressed-tensors ``float-quantized``: float8 ``weight`` with ``weight_scale`` per
    tensor ``[1]``, channel ``[out, 1]`` or block ``[out / 128, in / 128]``. Only with a
    compressed-tensors config: the bytes are those of any fp8 checkpoint, which the generic
    fp8 layout counts alike; this one names the format."""
    if not weight.dtype.startswith("float8_") or not _ct_method_ok(s.config, required=True):
        return None
    return _ct_naive(weight, s, "float")


_MLX_SPEC = ("MLX python/mlx/nn/layers/quantized.py (QuantizedLinear, QuantizedEmbedding: "
             "weight, scales, biases) and mlx.core.quantize's table of modes; mlx-lm "
             "mlx_lm/utils.py quantize_model (config.json 'quantization', per-layer entries)")
#: MLX's modes without biases: (bits x group size) -> (mode, bits, group).
_MLX_FP_MODES = {4 * 32: ("mxfp4", 4, 32), 4 * 16: ("nvfp4", 4, 16), 8 * 32: ("mxfp8", 8, 32)}


def _mlx(scales: TensorRecord, s: Siblings) -> Found | None:
    """MLX (``mlx.nn.QuantizedLinear``/``QuantizedEmbedding``): uint32 ``weight``
    ``[out, in * bits / 32]``, ``scales`` ``[out, in / group]`` and, in the ``affine`` mode,
    ``biases`` of the same shape, both in the model's float dtype; the ``mxfp4``/``nvfp4``/
    ``mxfp8`` modes keep uint8 scales and no biases. Bits and group size from config.json's
    ``quantization`` (mlx-lm), whose per-layer entries (keyed by module path) override it;
    without one only bits x group size is known, and the likeliest pair (4 bits first, then
    8; group 64 first) is assumed and the label says so."""
    weight, biases = s.get("weight"), s.get("biases")
    if (weight is None or weight.dtype != "uint32" or len(weight.shape) != 2
            or len(scales.shape) != 2 or scales.shape[0] != weight.shape[0]
            or not scales.shape[1]):
        return None
    if biases is not None and biases.shape != scales.shape:
        return None
    out, cols = weight.shape
    bits_x_group, rest = divmod(cols * 32, scales.shape[1])
    if rest:
        return None
    layer = s.config.get(s.module())
    settings = layer if isinstance(layer, Mapping) else s.config
    bits, group = _bits_from_config(settings), _group_from_config(settings)
    mode = settings.get("mode") if isinstance(settings.get("mode"), str) else None
    assumed = ""
    if biases is not None:
        mode = "affine"
        if not (bits and group and bits * group == bits_x_group):
            # Only bits x group is in the shapes: the likeliest pair is assumed, and said.
            options = [(b, bits_x_group // b) for b in (4, 8, 6, 3, 2, 5, 1)
                       if bits_x_group % b == 0 and bits_x_group // b in (64, 32, 128)]
            if not options:
                return None
            (bits, group), assumed = options[0], " (bits assumed: no quantization config)"
    else:
        if scales.dtype != "uint8" or bits_x_group not in _MLX_FP_MODES:
            return None
        mode, bits, group = _MLX_FP_MODES[bits_x_group]
    in_features = cols * 32 // bits
    what = f"{bits}-bit MLX affine" if mode == "affine" else f"{mode.upper()} MLX"
    counted = (weight, scales) + ((biases,) if biases is not None else ())
    return Found(s.base + "weight", f"{what}, group {group}{assumed}", (out, in_features),
                 out * in_features, counted)


# --- layouts: bitsandbytes, fp8, MXFP4, torchao, GGUF (qlay2)


def _bnb4(blob: TensorRecord, s: Siblings) -> Found | None:
    """bitsandbytes 4-bit (``Linear4bit`` / ``Params4bit``, nf4 or fp4), as
    ``QuantState.as_dict(packed=True)`` saves it (bitsandbytes/functional.py): ``weight`` uint8
    holding two 4-bit codes a byte, ``weight.absmax`` one scale per block (float32, or uint8
    under double quantization with ``weight.nested_absmax`` float32 per block of those), the
    codebooks ``weight.quant_map`` / ``weight.nested_quant_map`` and the JSON quant state
    ``weight.quant_state.bitsandbytes__nf4`` (shape, blocksizes, nested offset). The logical
    shape is only in that JSON, which is tensor data: the count is two codes a packed byte."""
    weight, absmax = s.get("weight"), s.get("weight.absmax")
    if weight is None or absmax is None or weight.dtype not in ("uint8", "int8"):
        return None
    kind = blob.name.rsplit("__", 1)[-1]
    n = 2 * weight.numel
    nested, nested_map = s.get("weight.nested_absmax"), s.get("weight.nested_quant_map")
    counted = [weight, absmax] + ([nested] if nested is not None else [])
    uncounted = [r for r in (s.get("weight.quant_map"), nested_map, blob) if r is not None]
    block = _pow2(n / absmax.numel) if absmax.numel else 0
    label = f"4-bit bitsandbytes {kind}, block {block}"
    if nested is not None:
        label += ", double quant"
    return Found(s.base + "weight", label, (), n, tuple(counted), tuple(uncounted))


def _pow2(x: float) -> int:
    """The power of two nearest ``x`` (a block size seen through a ceil division)."""
    p = 1
    while p * 2 <= x * 1.5:
        p *= 2
    return p


def _bnb8(scb: TensorRecord, s: Siblings) -> Found | None:
    """bitsandbytes LLM.int8() (``Linear8bitLt``, bitsandbytes/nn/modules.py
    ``_save_to_state_dict``): ``weight`` int8 ``[out, in]`` and ``SCB`` float32 ``[out]``, one
    absmax per row; ``weight_format`` is a format tag, not counted."""
    weight = s.get("weight")
    if (weight is None or weight.dtype != "int8" or len(weight.shape) != 2
            or scb.numel != weight.shape[0]):
        return None
    tag = s.get("weight_format")
    return Found(s.base + "weight", "8-bit bitsandbytes LLM.int8()", weight.shape,
                 weight.numel, (weight, scb), (tag,) if tag is not None else ())


_FP8 = {"float8_e4m3fn": "e4m3", "float8_e4m3fnuz": "e4m3", "float8_e5m2": "e5m2",
        "float8_e5m2fnuz": "e5m2"}
#: Activation scales stored beside an fp8 weight: neither parameters nor counted.
_ACTIVATION_SCALES = ("input_scale", "activation_scale", "output_scale")


def _activation_scales(s: Siblings) -> tuple[TensorRecord, ...]:
    return tuple(r for r in map(s.get, _ACTIVATION_SCALES) if r is not None)


def _fp8_tensor(scale: TensorRecord, s: Siblings) -> Found | None:
    """fp8 e4m3/e5m2 with a per-tensor or per-channel ``weight_scale`` (AutoFP8 / vLLM
    ``fp8`` checkpoints; transformers integrations/fbgemm_fp8.py ``[out, 1]``). A
    compressed-tensors checkpoint names its scales alike and is left to its own layout."""
    if s.config.get("quant_method") == "compressed-tensors":
        return None
    weight = s.get("weight")
    if weight is None or weight.dtype not in _FP8 or not weight.shape:
        return None
    rows = weight.numel // weight.shape[-1] if weight.shape[-1] else 0
    if scale.numel <= 1:
        how = "per-tensor scale"
    elif scale.numel == rows:
        how = "per-channel scale"
    else:
        how = f"{scale.numel} scales"
    return Found(s.base + "weight", f"fp8 {_FP8[weight.dtype]}, {how}", weight.shape,
                 weight.numel, (weight, scale), _activation_scales(s))


def _fp8_block(scale: TensorRecord, s: Siblings) -> Found | None:
    """fp8 with per-block ``weight_scale_inv`` (DeepSeek-V3 inference/model.py, transformers
    integrations/finegrained_fp8.py ``FP8Linear``): ``weight`` float8 ``[out, in]``, one
    float32 (or e8m0) scale per ``weight_block_size`` tile, 128x128 by default."""
    weight = s.get("weight")
    if (weight is None or weight.dtype not in _FP8 or len(weight.shape) < 2
            or len(scale.shape) != len(weight.shape) or not all(scale.shape)):
        return None
    block = s.config.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) for b in block)):
        block = [_tile(weight.shape[-2], scale.shape[-2]), _tile(weight.shape[-1], scale.shape[-1])]
    label = f"fp8 {_FP8[weight.dtype]}, block {block[0]}x{block[1]}"
    return Found(s.base + "weight", label, weight.shape, weight.numel, (weight, scale),
                 _activation_scales(s))


def _tile(size: int, tiles: int) -> int:
    """The tile that cuts ``size`` into ``tiles``: a power of two where one does (a 200-row
    weight in 2 tiles of 128), else the ceil division."""
    least = -(-size // tiles)
    p = 1 << (least - 1).bit_length()
    return p if -(-size // p) == tiles else least


def _mxfp4(blocks: TensorRecord, s: Siblings) -> Found | None:
    """MXFP4 as gpt-oss stores its experts (transformers integrations/mxfp4.py
    ``convert_moe_packed_tensors``; OCP Microscaling spec v1.0): ``*_blocks`` uint8
    ``[..., rows, G, 16]`` (32 e2m1 codes in 16 bytes) and ``*_scales`` uint8 ``[..., rows, G]``
    (one e8m0 exponent per 32). Unpacked, experts' ``[E, rows, G*32]`` is transposed to
    ``[E, G*32, rows]``, the shape of the unquantized parameter."""
    scales = s.get("scales")
    if (scales is None or blocks.dtype != "uint8" or len(blocks.shape) < 3
            or blocks.shape[:-1] != scales.shape
            or scales.dtype not in ("uint8", "float8_e8m0fnu")):
        return None
    *prefix, rows, groups, nbytes = blocks.shape
    cols = groups * nbytes * 2
    shape = (*prefix, cols, rows) if prefix else (rows, cols)
    return Found(s.base[:-1], f"MXFP4, block {nbytes * 2}", tuple(shape), blocks.numel * 2,
                 (blocks, scales))


#: Data tensors of torchao's tensor subclasses (``tensor_data_names``): the packed values and
#: their scales and zero points, all counted.
_TORCHAO_PARTS = ("scale", "zero_point", "group_scale", "group_zero", "row_scale", "scale_and_zero")


def _torchao(qdata: TensorRecord, s: Siblings) -> Found | None:
    """torchao tensor subclasses saved by ``torch.save(model.state_dict())`` after
    ``quantize_`` (torchao/quantization/quantize_/workflows: ``Int8Tensor``,
    ``Float8Tensor``, ``IntxUnpackedToInt8Tensor``, ``Int4Tensor``...): the wrapper records
    the logical dtype and shape with no storage of its own (tagged with its class by the torch
    reader), its ``qdata``, ``scale`` and ``zero_point`` are its stored parts."""
    wrapper = s.records.get(s.module())
    kind = next((t.split("=", 1)[1] for t in wrapper.tags if t.startswith("subclass=")), "") \
        if wrapper is not None else ""
    if wrapper is None or wrapper.storage is not None or not kind:
        return None
    parts = [r for r in map(s.get, _TORCHAO_PARTS) if r is not None]
    label = f"torchao {kind.rsplit('.', 1)[-1]}, {qdata.dtype}"
    scale = s.get("scale")
    if scale is not None and len(scale.shape) == len(wrapper.shape) == 2:
        per = wrapper.shape[1] // scale.shape[1] if scale.shape[1] else 0
        label += ", per row" if per == wrapper.shape[1] else f", group {per}"
    return Found(wrapper.name, label, wrapper.shape, wrapper.numel, (qdata, *parts),
                 (wrapper,))


#: llama.cpp's ``enum llama_ftype`` (gguf-py ``LlamaFileType``): ``general.file_type``.
GGUF_FILE_TYPES: dict[int, str] = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
    11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
    17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS",
    23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S",
    29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0", 37: "TQ2_0",
    38: "MXFP4_MOE", 39: "NVFP4", 40: "Q1_0",
}


def _title(inventory: Inventory) -> str:
    """A file's own name for its quantization: GGUF's ``general.file_type`` (``Q4_K_M``)."""
    ftype = inventory.facts.get("gguf.file_type")
    if ftype is None or not str(ftype).isdigit():
        return ""
    name = GGUF_FILE_TYPES.get(int(str(ftype)))
    return f"GGUF {name}" if name else f"GGUF file type {ftype}"


def is_quantized(layout: str) -> bool:
    """A layout of :data:`LAYOUTS`, or a dtype that packs elements in blocks (ggml's q4_K,
    float4): each stored value is not one element of its own."""
    if layout in LAYOUTS:
        return True
    d = DTYPES.get(layout.removeprefix("dtype:"))
    return d is not None and d.block > 1


#: The registry, in the order matchers are tried for a shared anchor.
LAYOUTS: dict[str, Layout] = {
    layout.key: layout for layout in (
        # qlay1: GPTQ, AWQ, compressed-tensors, MLX
        Layout("gptq", ".qweight", _gptq, _GPTQ_SPEC),
        Layout("awq-gemm", ".qweight", _awq_gemm, _AWQ_GEMM_SPEC),
        Layout("awq-gemv", ".qweight", _awq_gemv, _AWQ_GEMV_SPEC),
        Layout("ct-pack-quantized", ".weight_packed", _ct_pack_quantized, _CT_PACK_SPEC),
        Layout("ct-fp4-pack-quantized", ".weight_packed", _ct_fp4_packed, _CT_FP4_SPEC),
        Layout("ct-int-quantized", ".weight", _ct_int_quantized, _CT_NAIVE_SPEC),
        Layout("ct-float-quantized", ".weight", _ct_float_quantized, _CT_NAIVE_SPEC),
        Layout("mlx", ".scales", _mlx, _MLX_SPEC),
        # qlay2: bitsandbytes, fp8, MXFP4, torchao
        Layout("bnb-nf4", ".weight.quant_state.bitsandbytes__nf4", _bnb4,
               "bitsandbytes bitsandbytes/functional.py QuantState.as_dict"),
        Layout("bnb-fp4", ".weight.quant_state.bitsandbytes__fp4", _bnb4,
               "bitsandbytes bitsandbytes/functional.py QuantState.as_dict"),
        Layout("bnb-int8", ".SCB", _bnb8,
               "bitsandbytes bitsandbytes/nn/modules.py Linear8bitLt._save_to_state_dict"),
        Layout("fp8-block", ".weight_scale_inv", _fp8_block,
               "transformers src/transformers/integrations/finegrained_fp8.py FP8Linear"),
        Layout("fp8", ".weight_scale", _fp8_tensor,
               "vllm vllm/model_executor/layers/quantization/fp8.py Fp8LinearMethod"),
        Layout("mxfp4", "_blocks", _mxfp4,
               "transformers src/transformers/integrations/mxfp4.py convert_moe_packed_tensors"),
        Layout("torchao", ".qdata", _torchao,
               "torchao torchao/quantization/quantize_/workflows (Int8Tensor, Float8Tensor...)"),
    )
}


def _anchors() -> dict[str, list[Layout]]:
    out: dict[str, list[Layout]] = {}
    for layout in LAYOUTS.values():
        out.setdefault(layout.anchor, []).append(layout)
    return out


# ---------------------------------------------------------------------------------------------
# Analysis


def _dtype_label(dtype: str) -> str:
    return dtype


def analyze(inventory: Inventory, config: Mapping[str, Any] | None = None) -> Quantization:
    """Parameters and bits per weight of ``inventory`` (``config`` is the model's
    ``quantization_config``; :func:`config_for` finds it beside the file)."""
    config = {} if config is None else config
    records: dict[str, TensorRecord] = {}
    order: list[TensorRecord] = []
    looked_at = _LOOKED_AT
    tensors = [t for t in inventory.tensors
               if t.category in looked_at and t.duplicate_of is None]
    # A tensor charged with fewer bytes than it holds is a view of bytes shared with another
    # (tied weights) or compressed; only then are views of the same bytes looked for.
    shared = any(t.stored_nbytes < t.nbytes for t in tensors)
    seen_storage: set[tuple[str, int, tuple[int, ...], str]] = set()
    for t in tensors:
        if shared and t.storage is not None:
            ident = (t.storage, t.storage_offset, t.shape, t.dtype)
            if ident in seen_storage:
                continue  # a second view of the same bytes (tied weights)
            seen_storage.add(ident)
        records[t.name if not t.container else t.key] = t
        order.append(t)
    del seen_storage, tensors
    anchors = _anchors()
    suffixes = tuple(anchors)
    wide = _WIDE
    claimed: set[str] = set()
    found: list[QuantizedWeight] = []
    for t in order:
        key = t.name if not t.container else t.key
        if not key.endswith(suffixes) or key in claimed:
            continue
        if t.dtype in wide and key.endswith(".weight"):
            continue  # a float16/32 weight anchors no layout: their anchors are packs, scales
        for suffix in suffixes:
            if not key.endswith(suffix):
                continue
            sib = Siblings(key[: len(key) - len(suffix) + 1], records, config)
            for layout in anchors[suffix]:
                hit = layout.match(t, sib)
                if hit is None or any(p.key in claimed for p in (*hit.counted, *hit.uncounted)):
                    continue
                parts = (*hit.counted, *hit.uncounted)
                claimed.update(p.key for p in parts)
                found.append(QuantizedWeight(
                    hit.name, layout.key, hit.label, hit.shape, hit.parameters,
                    sum(_tensor_bytes(p) for p in hit.counted), tuple(p.name for p in parts)))
                break
            if key in claimed:
                break
    weights = Category.WEIGHTS
    plain = tuple(t for t in order if t.category is weights
                  and (not claimed or (t.name if not t.container else t.key) not in claimed))
    return Quantization(tuple(found), config=config, title=_title(inventory), plain=plain)


def _plain_layout(dtype: str) -> str:
    d = DTYPES.get(dtype) or DTYPES.get(canonical(dtype) or "")
    return f"dtype:{d.name if d else dtype}"


def config_for(inventory: Inventory) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The model's quantization settings from a ``config.json`` beside the checkpoint:
    ``quantization_config`` (transformers), ``quantization`` (MLX), ``compression_config``
    (older compressed-tensors). Empty when there is none; a note when it cannot be read."""
    files = inventory.files
    if not files:
        return {}, ()
    path = inventory.path
    folder = path if path.is_dir() else Path(files[0].path).parent
    cfg = folder / "config.json"
    try:
        if not cfg.is_file() or cfg.stat().st_size > _CONFIG_LIMIT:
            return {}, ()
        data = json.loads(cfg.read_bytes())
    except (OSError, ValueError) as exc:
        return {}, (f"{cfg.name} beside the checkpoint was not read: {exc}",)
    if not isinstance(data, dict):
        return {}, ()
    for key in ("quantization_config", "quantization", "compression_config"):
        value = data.get(key)
        if isinstance(value, dict):
            return value, ()
    return {}, ()


def paired(a: Iterable[QuantizedWeight], b: Iterable[QuantizedWeight]
           ) -> list[tuple[QuantizedWeight, QuantizedWeight]]:
    """Weights of two checkpoints with the same logical name and shape, where at least one
    is quantized: a quantized tensor beside its unquantized source."""
    right = {w.name: w for w in b}
    out = []
    for w in a:
        other = right.get(w.name)
        if other is None or not (is_quantized(w.layout) or is_quantized(other.layout)):
            continue
        if w.shape and other.shape and w.shape != other.shape:
            continue
        if not (w.shape and other.shape) and w.parameters != other.parameters:
            continue  # a packed weight whose shape the file does not say (bitsandbytes 4-bit)
        out.append((w, other))
    return out

