"""MODEL given as weights: a Hugging Face model folder, a GGUF file, or a Hub repository.

The model is built on the meta device from its config, as for a ``config.json``
(:mod:`modelsize.estimation.zoo`). The weights add what a config cannot say, read by
modelsize's own readers (:func:`modelsize.formats.read`: headers only, no tensor byte read,
nothing loaded or executed):

* **the dtype in memory**, by ``from_pretrained(dtype="auto")``'s rule (transformers
  ``modeling_utils._get_dtype``): the config's ``dtype``, else the index's ``metadata.dtype``,
  else the first floating-point tensor (float8/float4 skipped) of the first weights file, in
  the order the loader reads it (safetensors: by name). Every floating-point weight is cast
  to it on loading (a bf16 checkpoint's float32 norms become bf16), except the modules the
  class keeps in float32 (``_keep_in_fp32_modules_strict``, and ``_keep_in_fp32_modules``
  in float16). The report gives the checkpoint's own dtypes beside what loading makes of
  them (:class:`WeightsPlan`);
* **quantized weights** (a ``quantization_config``): for bitsandbytes, torchao, GPTQ,
  AWQ, fp8 (per device: dequantized on CPU) and compressed-tensors (decompressed on the
  first forward) the layers are built on the meta device as loading builds them
  (:mod:`modelsize.estimation.quant_checkpoint`), so their kernels are traced. For other
  methods a quantized layer holds its checkpoint tensors (float8, scales, ...) as stored.
  The trace runs the model with those layers in the compute dtype; their parameters' traced
  bytes are replaced by the checkpoint tensors' bytes (exact); the dequantization kernels'
  temporaries are not traced (named in the report);
* **GGUF** (llama.cpp): the architecture and hyperparameters come from the file's metadata,
  mapped to a transformers config for the architectures in :data:`GGUF_ARCHITECTURES`; the
  parameters are the file's tensor data, byte for byte (quantized blocks as stored), in
  place of the traced float model's; the trace runs in float16 (llama.cpp's default KV cache
  type) unless ``--dtype`` says otherwise;
* **a Hub repository** (``hf://ORG/REPO[@REVISION]`` or ``ORG/REPO``): config.json, the
  safetensors index and each safetensors header are fetched over HTTP ranges
  (:mod:`modelsize.remote`: ``$HF_ENDPOINT``, ``$HF_TOKEN``, the Hugging Face cache when the
  snapshot is there); the bytes and requests are counted and reported.
"""

from __future__ import annotations

import json
import os
import re
import struct
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modelsize.errors import UsageError, printable

if TYPE_CHECKING:
    from torch import nn

    from modelsize.estimation.result import Estimate
    from modelsize.remote import Stats


class SourceKind(str, Enum):
    """What MODEL names."""

    DIRECTORY = "directory"
    GGUF = "gguf"
    HUB = "hub"

    def __str__(self) -> str:
        return self.value


#: Weights files of a Hugging Face model folder, most preferred first.
_WEIGHTS = (".safetensors", ".bin")
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?")
#: Floating dtypes a model can be built in (``from_pretrained`` skips float8/float4 when it
#: picks the dtype from the weights).
_BUILDABLE = ("float32", "float16", "bfloat16", "float64")


def kind_of(spec: str) -> SourceKind | None:
    """The kind of weights ``spec`` names, or None (a built-in name, a config.json, a
    factory)."""
    if spec.lower().startswith("hf://"):
        return SourceKind.HUB
    path = Path(spec)
    if path.is_file():
        if path.suffix.lower() == ".gguf" or _head(path, 4) == b"GGUF":
            return SourceKind.GGUF
        return None
    if path.is_dir():
        return SourceKind.DIRECTORY if weight_files(path) else None
    if ":" not in spec and not spec.endswith(".json") and _HUB_NAME.fullmatch(spec):
        return SourceKind.HUB
    return None


def _head(path: Path, n: int) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read(n)
    except OSError:
        return b""


def weight_files(folder: Path) -> list[Path]:
    """The weights files at the top of a model folder: the safetensors (by the index when
    there is one), else ``pytorch_model*.bin``; empty when it has none or no config.json."""
    if not (folder / "config.json").is_file():
        return []
    for suffix in _WEIGHTS:
        index = folder / f"{'model' if suffix == '.safetensors' else 'pytorch_model'}" \
            f"{suffix}.index.json"
        if index.is_file():
            try:
                shards = json.loads(index.read_text())["weight_map"].values()
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                raise UsageError(f"{index}: not an index with a weight_map") from None
            return [folder / s for s in sorted(set(shards))]
        found = sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(suffix)
                       and (suffix != ".bin" or p.name.startswith("pytorch_model")))
        if found:
            return found
    return []


# -- what the weights say --------------------------------------------------------------------


@dataclass(frozen=True)
class TensorInfo:
    """One checkpoint tensor as its file describes it."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class Checkpoint:
    """A model folder's weights, from their headers.

    ``order`` is the order ``from_pretrained`` reads the first weights file in (it picks the
    dtype from the first floating-point tensor there); ``index_dtype`` the index's
    ``metadata.dtype``; ``quantization`` the config's ``quantization_config``.
    """

    folder: Path
    files: tuple[str, ...]
    tensors: dict[str, TensorInfo]
    order: tuple[str, ...]
    index_dtype: str = ""
    quantization: dict[str, Any] = field(default_factory=dict)
    format: str = ""

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor."""
        return sum(t.nbytes for t in self.tensors.values())

    def by_dtype(self) -> dict[str, tuple[int, int]]:
        """``dtype -> (tensors, bytes)``, largest first."""
        out: dict[str, list[int]] = {}
        for t in self.tensors.values():
            row = out.setdefault(t.dtype, [0, 0])
            row[0] += 1
            row[1] += t.nbytes
        return {k: (v[0], v[1]) for k, v in sorted(out.items(), key=lambda kv: -kv[1][1])}


def read_checkpoint(folder: Path) -> Checkpoint:
    """The weights of a model folder, by modelsize's readers (headers only)."""
    from modelsize import formats
    from modelsize.categories import Category
    from modelsize.inventory import READ_DATA

    files = weight_files(folder)
    if not files:
        raise UsageError(f"{printable(str(folder))}: no config.json with weights files "
                         "(*.safetensors, pytorch_model*.bin) in it")
    suffix = files[0].suffix
    index = next((p for p in folder.iterdir()
                  if p.name.endswith(f"{suffix}.index.json")), None)
    token = READ_DATA.set(False)  # the duplicate search reads tensor bytes: never here
    try:
        tensors: dict[str, TensorInfo] = {}
        first: list[str] = []
        fmt = ""
        for i, path in enumerate(files):
            inv = formats.read(path)
            fmt = inv.format
            for t in inv.tensors:
                if t.category not in (Category.WEIGHTS, Category.BUFFERS):
                    continue
                tensors.setdefault(t.key, TensorInfo(t.dtype, tuple(t.shape), t.nbytes))
                if i == 0:
                    first.append(t.key)
    finally:
        READ_DATA.reset(token)
    order = tuple(sorted(first)) if suffix == ".safetensors" else tuple(first)
    index_dtype = ""
    if index is not None:
        try:
            meta = json.loads(index.read_text()).get("metadata") or {}
            index_dtype = str(meta.get("dtype") or "") if isinstance(meta, dict) else ""
        except (OSError, ValueError, AttributeError):
            index_dtype = ""
    raw = _config(folder)
    quant = raw.get("quantization_config") or {}
    return Checkpoint(folder, tuple(p.name for p in files), tensors, order,
                      index_dtype.removeprefix("torch."),
                      quant if isinstance(quant, dict) else {}, fmt)


def _config(folder: Path) -> dict[str, Any]:
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"{folder / 'config.json'}: not a readable JSON config ({exc})") from exc
    return raw if isinstance(raw, dict) else {}


# -- what loading makes of them --------------------------------------------------------------


@dataclass(frozen=True)
class WeightsPlan:
    """The weights in memory, and where each dtype came from.

    ``dtype`` is the dtype the model is built in, ``dtype_from`` says why (in words);
    ``kept_fp32`` the parameters a keep-in-float32 rule leaves in float32; ``cast`` the
    checkpoint's floating-point tensors loading casts, by their dtype (``{dtype: (tensors,
    bytes)}``). ``stored`` counts checkpoint tensors held as stored (quantized layers, every
    tensor of a GGUF file) and ``replaced`` the traced model's parameters they stand for:
    the estimate's parameters are the traced ones plus ``stored_bytes - replaced_bytes``.
    """

    dtype: str
    dtype_from: str
    kind: SourceKind
    checkpoint_bytes: int
    checkpoint_dtypes: dict[str, tuple[int, int]]
    cast: dict[str, tuple[int, int]] = field(default_factory=dict)
    kept_fp32: tuple[str, ...] = ()
    stored: int = 0
    stored_bytes: int = 0
    replaced: int = 0
    replaced_bytes: int = 0
    quant_method: str = ""
    unused: int = 0
    """Checkpoint tensors no parameter takes (not counted)."""
    notes: tuple[str, ...] = ()
    replaced_numel: int = 0
    """Elements of the replaced parameters (their bytes in another dtype: vLLM's)."""

    @property
    def delta(self) -> int:
        """Bytes the stored tensors add to the traced parameters (negative: they save)."""
        return self.stored_bytes - self.replaced_bytes

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"source": str(self.kind), "dtype": self.dtype, "dtype_from": self.dtype_from,
                "checkpoint_bytes": self.checkpoint_bytes,
                "checkpoint_dtypes": {k: {"tensors": n, "bytes": b}
                                      for k, (n, b) in self.checkpoint_dtypes.items()},
                "cast_on_loading": {k: {"tensors": n, "bytes": b}
                                    for k, (n, b) in self.cast.items()},
                "kept_float32": list(self.kept_fp32),
                "stored_tensors": self.stored, "stored_bytes": self.stored_bytes,
                "replaced_parameters": self.replaced,
                "replaced_traced_bytes": self.replaced_bytes,
                "quant_method": self.quant_method or None, "unused_tensors": self.unused,
                "notes": list(self.notes)}


def pretrained_dtype(raw: dict[str, Any], ckpt: Checkpoint) -> tuple[str, str]:
    """``from_pretrained(dtype="auto")``'s dtype and where it came from (module docstring)."""
    from modelsize.estimation.zoo import config_dtype

    own = config_dtype(raw) or config_dtype(raw.get("text_config") or {})
    if own:
        return own, "config.json's dtype"
    if ckpt.index_dtype in _BUILDABLE:
        return ckpt.index_dtype, "the weights index's metadata dtype"
    for name in ckpt.order:
        t = ckpt.tensors[name]
        if t.dtype in _BUILDABLE:
            return t.dtype, (f"the first floating-point tensor of {ckpt.files[0]} "
                             f"({printable(name, 80)}), as from_pretrained(dtype='auto') picks "
                             "it (config.json names no dtype)")
    return "float32", "PyTorch's default dtype (no floating-point weights, no config dtype)"


def build_pretrained(entry: Any, dtype: str) -> nn.Module:
    """``entry``'s model on the meta device as ``from_pretrained`` builds it: under the
    default dtype ``dtype`` (buffers computed in float32 stay float32), config.dtype set."""
    import torch

    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        with torch.device("meta"):
            model = entry.build()
    finally:
        torch.set_default_dtype(previous)
    config = getattr(model, "config", None)
    if config is not None:
        config.dtype = getattr(torch, dtype)
    return model


def _fp32_patterns(model: nn.Module, dtype: str) -> list[str]:
    import torch

    get = getattr(model, "_get_dtype_plan", None)
    if callable(get):
        try:
            plan = get(getattr(torch, dtype))
        except (TypeError, AttributeError, ValueError):
            plan = {}
        return [k for k, v in plan.items() if v == torch.float32]
    out: list[str] = list(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    if dtype == "float16":
        out += list(getattr(model, "_keep_in_fp32_modules", None) or ())
    return out


def _matcher(patterns: list[str]) -> Any:
    try:
        from transformers.core_model_loading import build_glob_alternation

        alternation, _, _ = build_glob_alternation(list[Any](patterns))
        return alternation.search
    except (ImportError, AttributeError, TypeError, ValueError):
        joined = "|".join(rf"(^|\.){re.escape(p)}(\.|$)" for p in patterns)
        return re.compile(joined).search


def keep_fp32(model: nn.Module, dtype: str) -> tuple[str, ...]:
    """Cast the parameters the model's keep-in-float32 rule names to float32 (as loading
    does); their names."""
    import torch
    from torch import nn

    patterns = _fp32_patterns(model, dtype)
    if not patterns or dtype == "float32":
        return ()
    match = _matcher(patterns)
    kept: list[str] = []
    for module_name, module in model.named_modules():
        for name, param in list(module.named_parameters(recurse=False)):
            full = f"{module_name}.{name}" if module_name else name
            assert param is not None
            if not param.is_floating_point() or not match(full):
                continue
            if param.dtype != torch.float32:
                module._parameters[name] = nn.Parameter(param.detach().to(torch.float32),
                                                        requires_grad=param.requires_grad)
            kept.append(full)
    return tuple(kept)


def plan_folder(model: nn.Module, raw: dict[str, Any], ckpt: Checkpoint, dtype: str,
                dtype_from: str, kind: SourceKind, device: str | None = None) -> WeightsPlan:
    """Apply loading's rules to ``model`` (keep-in-float32 casts) and account for quantized
    tensors held as stored: the :class:`WeightsPlan` of a model folder."""
    kept = keep_fp32(model, dtype)
    quant = ckpt.quantization
    built = None
    if quant:
        from modelsize.estimation.quant_checkpoint import build_layers

        built = build_layers(model, quant, ckpt.tensors, dtype, device)
        if built.done:
            return _plan_built(model, ckpt, dtype, dtype_from, kind, kept, built)
    params = dict(model.named_parameters())
    cast: dict[str, list[int]] = {}
    stored = stored_bytes = replaced = replaced_bytes = unused = replaced_numel = 0
    replaced_modules: set[str] = set()
    if quant:
        for name, p in params.items():
            t = ckpt.tensors.get(name)
            if t is None or t.dtype not in _BUILDABLE or t.shape != tuple(p.shape):
                replaced += 1
                replaced_bytes += p.numel() * p.element_size()
                replaced_numel += p.numel()
                replaced_modules.add(name.rpartition(".")[0])
    for name, t in ckpt.tensors.items():
        p = params.get(name)  # type: ignore[assignment]
        if quant and (p is None or t.dtype not in _BUILDABLE or t.shape != tuple(p.shape)):
            if name.rpartition(".")[0] in replaced_modules:
                stored += 1
                stored_bytes += t.nbytes
            else:
                unused += 1
            continue
        if p is not None and t.dtype in _BUILDABLE and str(p.dtype).removeprefix("torch.") \
                != t.dtype:
            row = cast.setdefault(t.dtype, [0, 0])
            row[0] += 1
            row[1] += t.nbytes
    notes = [built.note()] if built is not None else []
    method = str(quant.get("quant_method", "")) if quant else ""
    if quant:
        notes.append(f"quantized weights ({method or 'quantization_config'}): {stored} checkpoint "
                     f"tensors held as stored ({stored_bytes:,} bytes) in place of the "
                     f"{replaced} parameters the trace runs in {dtype} ({replaced_bytes:,} "
                     "bytes); the dequantization kernels' temporaries are not traced")
    if unused:
        notes.append(f"{unused} checkpoint tensors no parameter of the model takes (not "
                     "counted)")
    return WeightsPlan(dtype, dtype_from, kind, ckpt.nbytes, ckpt.by_dtype(),
                       {k: (v[0], v[1]) for k, v in cast.items()}, kept, stored, stored_bytes,
                       replaced, replaced_bytes, method, unused, tuple(notes), replaced_numel)


def _plan_built(model: nn.Module, ckpt: Checkpoint, dtype: str, dtype_from: str,
                kind: SourceKind, kept: tuple[str, ...], built: Any) -> WeightsPlan:
    """The plan of a checkpoint whose quantized layers were built
    (:mod:`modelsize.estimation.quant_checkpoint`): the model holds its tensors itself, so
    nothing is held as stored; checkpoint tensors of a quantized layer that are no tensor of
    the model (bitsandbytes' serialized quant state, kept as attributes) are named."""
    from modelsize.estimation.quantized import is_quantized

    state = {**dict(model.named_parameters(remove_duplicate=False)),
             **dict(model.named_buffers(remove_duplicate=False))}
    layers = {name for name, m in model.named_modules()
              if type(m).__name__ in built.layers
              or any(is_quantized(p) for p in m.parameters(recurse=False))}
    if built.dequantized:  # the layers loading dequantized: the modules holding the scales
        layers |= {n.rpartition(".")[0] for n in ckpt.tensors if n.endswith("_scale_inv")}
        layers |= {n for n, m in model.named_modules()
                   if getattr(m, "quantization_scheme", None) is not None}  # compressed-tensors
    cast: dict[str, list[int]] = {}
    unused = in_layers = 0
    for name, t in ckpt.tensors.items():
        p = state.get(name)
        if p is None:
            owner = name
            while owner and owner not in layers:
                owner = owner.rpartition(".")[0]
            if owner:
                in_layers += 1
            else:
                unused += 1
            continue
        if t.dtype in _BUILDABLE and p.is_floating_point() and \
                str(p.dtype).removeprefix("torch.") != t.dtype:
            row = cast.setdefault(t.dtype, [0, 0])
            row[0] += 1
            row[1] += t.nbytes
    notes = [built.note()]
    if in_layers and built.dequantized:
        notes.append(f"{in_layers} checkpoint tensors of the quantized layers are consumed by "
                     "their dequantization (not held)")
    elif in_layers:
        notes.append(f"{in_layers} checkpoint tensors of the quantized layers are parts of their "
                     "quantized weights (inner tensors, bitsandbytes' quantization state)")
    if unused:
        notes.append(f"{unused} checkpoint tensors no parameter of the model takes (not "
                     "counted)")
    return WeightsPlan(dtype, dtype_from, kind, ckpt.nbytes, ckpt.by_dtype(),
                       {k: (v[0], v[1]) for k, v in cast.items()}, kept,
                       quant_method=built.method, unused=unused, notes=tuple(notes))


def with_weights(est: Estimate, plan: WeightsPlan) -> Estimate:
    """``est`` with the stored tensors' bytes in place of the parameters they stand for.

    Parameters are live from the first op to the last, so the peak stays where it was and
    every point of the timeline moves by the same bytes.
    """
    from modelsize.estimation.result import MemoryCategory

    delta = plan.delta
    notes = (*est.notes, *plan.notes)
    if not delta:
        return replace(est, notes=notes)
    cats = dict(est.categories)
    cats[MemoryCategory.PARAMETERS] += delta
    dev = est.device_estimate
    terms = tuple(replace(t, nbytes=t.nbytes + delta) if t.name == "tensors" else t
                  for t in dev.terms)
    dev = replace(dev, terms=terms, allocated_bytes=dev.allocated_bytes + delta,
                  total_bytes=dev.total_bytes + delta)
    return replace(est, peak_bytes=est.peak_bytes + delta, categories=cats,
                   timeline=tuple((t, b + delta) for t, b in est.timeline),
                   device_estimate=dev, notes=notes)


# -- GGUF ------------------------------------------------------------------------------------

#: llama.cpp architectures (``general.architecture``) read here, and the transformers
#: model_type each maps to (``llama`` with experts is Mixtral; with "mistral" in its name,
#: Mistral; ``deepseek2`` with sigmoid gating is DeepSeek-V3).
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2",
                      "qwen3": "qwen3", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe",
                      "gemma2": "gemma2", "gemma3": "gemma3_text", "phi3": "phi3",
                      "deepseek2": "deepseek_v2"}

_FLOAT32, _FLOAT64, _ARRAY = 6, 12, 9
_INT_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 7: "?", 10: "Q", 11: "q"}


@dataclass(frozen=True)
class GgufModel:
    """A GGUF file's model: the transformers config it maps to, and its tensors' bytes."""

    path: Path
    architecture: str
    config: dict[str, Any]
    tensor_bytes: int
    tensors: int
    types: dict[str, tuple[int, int]]
    """``ggml type -> (tensors, bytes)``."""
    name: str = ""


def _gguf_values(path: Path) -> tuple[dict[str, Any], Any]:
    """Every scalar metadata value (floats included), small integer arrays, and the layout."""
    from modelsize.formats.gguf import read_layout

    layout = read_layout(path)
    values: dict[str, Any] = {}
    with open(path, "rb") as fh:
        for kv in layout.kvs:
            if kv.value is not None:
                values[kv.key] = kv.value
            elif kv.value_type in (_FLOAT32, _FLOAT64):
                fh.seek(kv.value_start)
                fmt = "f" if kv.value_type == _FLOAT32 else "d"
                (values[kv.key],) = struct.unpack(layout.endian + fmt,
                                                  fh.read(struct.calcsize(fmt)))
            elif kv.value_type == _ARRAY and not kv.key.startswith("tokenizer."):
                fh.seek(kv.value_start)
                item, count = struct.unpack(layout.endian + "IQ", fh.read(12))
                if item in _INT_FORMATS and count <= 4096:
                    fmt = _INT_FORMATS[item]
                    size = struct.calcsize(fmt)
                    values[kv.key] = list(struct.unpack(f"{layout.endian}{count}{fmt}",
                                                        fh.read(size * count)))
    return values, layout


def read_gguf(path: Path) -> GgufModel:
    """The transformers config of a GGUF file's model (its metadata mapped), and its tensors."""
    from modelsize import formats
    from modelsize.inventory import READ_DATA

    values, layout = _gguf_values(path)
    arch = str(values.get("general.architecture", ""))
    name = str(values.get("general.name", "") or "")
    token = READ_DATA.set(False)
    try:
        inv = formats.read(path)
    finally:
        READ_DATA.reset(token)
    types: dict[str, list[int]] = {}
    for t in inv.tensors:
        row = types.setdefault(t.dtype, [0, 0])
        row[0] += 1
        row[1] += t.nbytes
    tensor_bytes = sum(t.nbytes for t in inv.tensors)
    shapes = {i.name: tuple(reversed(i.dims)) for i in layout.infos}
    config = gguf_config(arch, name, values, shapes, path)
    return GgufModel(path, arch, config, tensor_bytes, len(inv.tensors),
                     {k: (v[0], v[1]) for k, v in types.items()}, name)


def _supported() -> str:
    return ", ".join(sorted(GGUF_ARCHITECTURES))


def gguf_config(arch: str, name: str, v: dict[str, Any], shapes: dict[str, tuple[int, ...]],
                path: Path) -> dict[str, Any]:
    """A transformers ``config.json`` dict from llama.cpp's ``<arch>.*`` metadata keys."""
    if arch not in GGUF_ARCHITECTURES:
        raise UsageError(f"{path}: GGUF architecture {printable(arch)!r} is not one modelsize "
                         f"maps to a transformers model (it reads {_supported()})")

    def get(key: str, default: Any = None, required: bool = False) -> Any:
        value = v.get(f"{arch}.{key}", default)
        if required and value is None:
            raise UsageError(f"{path}: GGUF metadata {arch}.{key} is missing")
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise UsageError(f"{path}: GGUF metadata {arch}.{key} varies by layer "
                                 f"({value[:8]}...): not supported")
            value = value[0]
        return value

    hidden = int(get("embedding_length", required=True))
    heads = int(get("attention.head_count", required=True))
    embd = shapes.get("token_embd.weight")
    vocab = int(get("vocab_size") or (embd[0] if embd else 0))
    if not vocab:
        raise UsageError(f"{path}: GGUF file has no token_embd.weight and no vocab_size")
    cfg: dict[str, Any] = {
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count", required=True)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "intermediate_size": int(get("feed_forward_length", 4 * hidden)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in shapes,
    }
    eps = get("attention.layer_norm_rms_epsilon")
    if eps is not None:
        cfg["rms_norm_eps"] = float(eps)
    theta = get("rope.freq_base")
    if theta is not None:
        cfg["rope_theta"] = float(theta)
    head_dim = get("attention.key_length")
    if head_dim is not None and arch != "deepseek2":
        cfg["head_dim"] = int(head_dim)
    for key, target in (("tokenizer.ggml.bos_token_id", "bos_token_id"),
                        ("tokenizer.ggml.eos_token_id", "eos_token_id"),
                        ("tokenizer.ggml.padding_token_id", "pad_token_id")):
        if isinstance(v.get(key), int):
            cfg[target] = v[key]
    model_type = GGUF_ARCHITECTURES[arch]
    experts = int(get("expert_count", 0) or 0)
    if arch == "llama" and experts:
        model_type = "mixtral"
        cfg.update(num_local_experts=experts,
                   num_experts_per_tok=int(get("expert_used_count", 2)))
    elif arch == "llama" and "mistral" in name.lower():
        model_type = "mistral"
    if arch in ("qwen2moe", "qwen3moe"):
        cfg.update(num_experts=experts, num_experts_per_tok=int(get("expert_used_count", 1)),
                   moe_intermediate_size=int(get("expert_feed_forward_length", 0) or
                                             cfg["intermediate_size"]))
        if arch == "qwen2moe":
            shared = get("expert_shared_feed_forward_length")
            if shared is not None:
                cfg["shared_expert_intermediate_size"] = int(shared)
    if arch in ("gemma2", "gemma3"):
        window = get("attention.sliding_window")
        if window is not None:
            cfg["sliding_window"] = int(window)
        for key, target in (("attn_logit_softcapping", "attn_logit_softcapping"),
                            ("final_logit_softcapping", "final_logit_softcapping")):
            if get(key) is not None:
                cfg[target] = float(get(key))
        if "head_dim" in cfg:
            cfg["query_pre_attn_scalar"] = cfg["head_dim"]
    if arch == "phi3":
        rope_dims = get("rope.dimension_count")
        if rope_dims is not None and rope_dims != hidden // heads:
            cfg["partial_rotary_factor"] = int(rope_dims) / (hidden // heads)
        window = get("attention.sliding_window")
        if window:
            cfg["sliding_window"] = int(window)
    if arch == "deepseek2":
        cfg.update(_deepseek2(get, cfg, experts))
        if get("expert_gating_func") == 2:  # sigmoid: DeepSeek-V3 / R1
            model_type = "deepseek_v3"
    cfg["model_type"] = model_type
    return cfg


def _deepseek2(get: Any, cfg: dict[str, Any], experts: int) -> dict[str, Any]:
    rope = int(get("rope.dimension_count", 64))
    # GGUFs converted with absorbed MLA keep the per-head sizes under *_mla
    key = int(get("attention.key_length_mla") or get("attention.key_length", 192))
    value = int(get("attention.value_length_mla") or get("attention.value_length", 128))
    out: dict[str, Any] = {
        "kv_lora_rank": int(get("attention.kv_lora_rank", required=True)),
        "q_lora_rank": int(get("attention.q_lora_rank")) if get("attention.q_lora_rank") else None,
        "qk_rope_head_dim": rope, "qk_nope_head_dim": key - rope, "v_head_dim": value,
        "head_dim": rope,
        "n_routed_experts": experts, "num_experts_per_tok": int(get("expert_used_count", 1)),
        "n_shared_experts": int(get("expert_shared_count", 0) or 0),
        "moe_intermediate_size": int(get("expert_feed_forward_length", 0) or
                                     cfg["intermediate_size"]),
        "first_k_dense_replace": int(get("leading_dense_block_count", 0) or 0),
        "n_group": int(get("expert_group_count", 1) or 1),
        "topk_group": int(get("expert_group_used_count", 1) or 1),
        "routed_scaling_factor": float(get("expert_weights_scale", 1.0) or 1.0),
        "norm_topk_prob": bool(get("expert_weights_norm", False)),
    }
    return out


def gguf_plan(model: nn.Module, gguf: GgufModel, dtype: str, dtype_from: str) -> WeightsPlan:
    """Every parameter of the traced model replaced by the GGUF file's tensor data."""
    params = list(model.parameters())
    replaced_bytes = sum(p.numel() * p.element_size() for p in params)
    note = (f"GGUF weights: the parameters are the file's {gguf.tensors} tensors as stored "
            f"({gguf.tensor_bytes:,} bytes: " + ", ".join(
                f"{k} {n} tensors {b:,} B" for k, (n, b) in
                sorted(gguf.types.items(), key=lambda kv: -kv[1][1])) +
            f"), in place of the traced {dtype} model's {replaced_bytes:,} bytes; activations "
            f"and the cache are traced in {dtype}")
    types = dict(sorted(gguf.types.items(), key=lambda kv: -kv[1][1]))
    return WeightsPlan(dtype, dtype_from, SourceKind.GGUF, gguf.tensor_bytes, types,
                       stored=gguf.tensors, stored_bytes=gguf.tensor_bytes,
                       replaced=len(params), replaced_bytes=replaced_bytes, quant_method="gguf",
                       notes=(note,), replaced_numel=sum(p.numel() for p in params))


# -- the Hub ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class HubFetch:
    """What reading a Hub repository cost: bytes and requests, or the cache folder used."""

    url: str
    fetched_bytes: int
    requests: int
    checkpoint_bytes: int
    files: tuple[str, ...]
    cache: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"url": self.url, "fetched_bytes": self.fetched_bytes,
                "requests": self.requests, "checkpoint_bytes": self.checkpoint_bytes,
                "files": list(self.files), "hf_cache": self.cache or None}

    def line(self) -> str:
        """One line for the report."""
        if self.cache:
            return (f"Read from the Hugging Face cache ({printable(self.cache)}): nothing "
                    "fetched.")
        share = 100.0 * self.fetched_bytes / max(self.checkpoint_bytes, 1)
        weights = [f for f in self.files if f != "config.json" and not f.endswith(".json")]
        index = " and index" if len(weights) < len(self.files) - 1 else ""
        return (f"Read from the Hub: {self.fetched_bytes:,} bytes in {self.requests} requests "
                f"(the listing, config.json{index} and the headers of {len(weights)} weights "
                f"files) for a {self.checkpoint_bytes:,}-byte checkpoint ({share:.4f}%).")


@contextmanager
def hub_folder(spec: str) -> Iterator[tuple[Path, HubFetch, str]]:
    """A local folder holding the repository's config.json and its weights' headers (a
    sparse mirror, or the Hugging Face cache's snapshot), what it cost, and the repo's URL."""
    from modelsize.remote import HubRepo, Stats, cached_snapshot, hub_snapshot_headers

    hub = HubRepo.parse(spec)
    cached = cached_snapshot(hub)
    if cached is not None:
        files = tuple(p.name for p in sorted(cached.iterdir()))
        size = sum(p.stat().st_size for p in weight_files(cached))
        yield cached, HubFetch(hub.url, 0, 0, size, files, str(cached)), hub.url
        return
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        from modelsize.remote import RemoteError, hf_cache_dir

        raise RemoteError(f"{hub.url}: HF_HUB_OFFLINE is set and the Hugging Face cache "
                          f"({hf_cache_dir()}) has no complete snapshot of it")
    with tempfile.TemporaryDirectory(prefix="modelsize-hub-") as tmp:
        folder = Path(tmp) / hub.repo.split("/")[-1]
        folder.mkdir()
        stats: Stats = Stats(hub.url)
        names = hub_snapshot_headers(hub, folder, stats)
        yield folder, HubFetch(hub.url, stats.fetched, stats.requests, stats.size,
                               tuple(names)), hub.url
