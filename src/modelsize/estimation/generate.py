"""``mode="generate"``: the peak of ``model.generate()``, run with the model's own cache code.

The program is exactly::

    model.eval(); with torch.no_grad():
        model.generate(**inputs, max_new_tokens=N, min_new_tokens=N, do_sample=False,
                       **generation)

traced on fake tensors like a forward (:mod:`modelsize.estimation.trace`), and measured the
same way for ``verify=True`` (:func:`measure_generate`, the CPU allocator's events). Its
phases: ``setup`` (generate's own preparation), ``encode`` (encoder-decoders), ``prefill``
(one forward over the prompt, or one per chunk with ``prefill_chunk_size``), then ``decode``
steps 1 .. N-1 (the first new token comes from the prefill's logits).

What a trace cannot know, and what it does instead:

* **the tokens**: each step's argmax (beam search's top-k) reads logits the trace never
  computes. Outside the model's forward those results are given a value: a token id that is
  no end-of-sequence, pad or start id. With ``min_new_tokens=N`` generate never stops early,
  and which ids are chosen changes the size of no tensor, so the rest of the loop (stopping
  criteria, beam bookkeeping, ``unfinished_sequences.max() == 0``) runs on real values;
* **MoE routing**: inside the forward, a top-k (argmax) over router logits decides which
  experts run. transformers' default experts (``grouped_mm``) process ``tokens x top_k`` rows
  whatever the routing: exact. Where the model's code reads the routing (an eager loop over
  the experts hit, ``nonzero``), the trace sends every token to the same ``top_k`` experts:
  each then processes all the tokens, its capacity, an upper bound on the per-expert
  temporaries; the estimate's ``generation.routing`` says where.

The cache's bytes (category ``kv_cache``) are found by owner: after every forward the cache
object passed to it (``cache=``) is walked, layer by layer, and the storages its tensors hold
(keys, values, quantized keys, convolution and recurrent states) are the cache's. Bytes per
token by layer kind come from those tensors' shapes (:class:`CacheGroup`).

The model is left as found: generate's own attributes (``_previous_max_cache_length``, set
by a static cache) are put back after the trace.
"""

from __future__ import annotations

import contextlib
import gc
import time
import traceback
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
)
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.weak import WeakIdKeyDictionary

from modelsize.errors import EstimateError, MissingDependencyError, ModelSizeError, UsageError
from modelsize.estimation.block_replay import BlockReplay, BlockRetrace, BlockSummary
from modelsize.estimation.decode_replay import DecodeReplay, DecodeSummary, Retrace
from modelsize.estimation.result import (
    CacheGroup,
    CacheKind,
    Estimate,
    GenerationInfo,
    MemoryCategory,
    Source,
    Verification,
)
from modelsize.estimation.trace import (
    Program,
    RealValues,
    Trace,
    _fake_inputs,
    _FakeCopier,
    _module_names,
    _swapped_state,
    fake_state,
    leaves,
    map_inputs,
    training_flags,
    user_code,
)
from modelsize.estimation.tracker import Allocation, CountingFakeMode, Origin

_ATEN = torch.ops.aten
#: Ops that choose among values: their results are the tokens (outside the model) or the
#: experts (inside it).
_CHOICE = frozenset({_ATEN.argmax.default, _ATEN.topk.default, _ATEN.max.dim,
                     _ATEN.sort.default, _ATEN.sort.stable})
#: ``generate()`` arguments the program fixes.
_FIXED = ("max_new_tokens", "min_new_tokens", "do_sample", "max_length", "min_length")
#: Layer attributes that hold a recurrent (per-sequence) state rather than tokens.
_STATE_ATTRS = frozenset({"conv_states", "recurrent_states"})


@dataclass(frozen=True)
class GenerateProgram:
    """What runs: ``generate()`` with ``new_tokens`` and the extra keyword arguments."""

    new_tokens: int
    options: Mapping[str, Any] = field(default_factory=dict)
    device: str = "cpu"
    amp: torch.dtype | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.new_tokens, int) or self.new_tokens < 1:
            raise UsageError(f"new_tokens must be a positive integer, not {self.new_tokens!r}")
        fixed = [k for k in _FIXED if k in self.options]
        if fixed:
            raise UsageError(f"generation must not set {', '.join(fixed)}: the program is "
                             "generate(max_new_tokens=N, min_new_tokens=N, do_sample=False)")
        if self.device not in ("cpu", "cuda"):
            raise UsageError(f"device must be 'cpu' or 'cuda', not {self.device!r}")
        if self.options.get("cache_implementation") in ("offloaded", "offloaded_static") \
                and self.device != "cuda":
            raise UsageError("the offloaded cache moves layers between a GPU and the host "
                             "(CUDA streams): estimate it with device='cuda'")

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``generate()``, inputs aside."""
        return {"max_new_tokens": self.new_tokens, "min_new_tokens": self.new_tokens,
                "do_sample": False, **dict(self.options)}

    @property
    def beams(self) -> int:
        """``num_beams`` (1 unless given)."""
        return int(self.options.get("num_beams", 1) or 1)


@dataclass
class GenerateTrace:
    """A traced generation: the counting mode, and what the watchers saw."""

    trace: Trace
    cache: _CacheWatch
    values: _GenerationValues
    filler: int
    decode: DecodeSummary = field(default_factory=DecodeSummary)
    """Which decode steps ran for real and which were replayed (:mod:`.decode_replay`)."""
    blocks: BlockSummary = field(default_factory=BlockSummary)
    """How many repeated-block calls were replayed (:mod:`.block_replay`)."""


# -- inputs ----------------------------------------------------------------------------------


def filler_token(model: nn.Module) -> int:
    """The smallest token id that is no end-of-sequence, pad, start or decoder-start id."""
    special: set[int] = set()
    for cfg in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        for name in ("eos_token_id", "pad_token_id", "bos_token_id", "decoder_start_token_id"):
            value = getattr(cfg, name, None) if cfg is not None else None
            values = value if isinstance(value, (list, tuple)) else [value]
            special |= {int(v) for v in values if isinstance(v, int)}
    token = 0
    while token in special:
        token += 1
    return token


def generation_inputs(model: nn.Module, batch: int, prompt: int, left_pad: int = 0,
                      dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Real inputs of ``generate()`` for ``batch`` prompts of ``prompt`` tokens (CLI, fit).

    Token ids are :func:`filler_token` (their values change no size); ``left_pad`` > 0 pads
    every row but the first on the left by that many positions (pad id, mask 0), as a batch
    of prompts of different lengths is padded. A model whose main input is audio features
    (Whisper) gets zero features of its full input length, and no prompt.
    """
    if batch < 1 or prompt < 1:
        raise UsageError("generation needs a batch and a prompt of at least 1")
    if not 0 <= left_pad < prompt:
        raise UsageError(f"--left-pad must be between 0 and the prompt length - 1, not "
                         f"{left_pad}")
    config = getattr(model, "config", None)
    main = getattr(model, "main_input_name", "input_ids")
    if main == "input_features":
        mels = int(getattr(config, "num_mel_bins", 80))
        frames = 2 * int(getattr(config, "max_source_positions", 1500))
        dtype = dtype or next((p.dtype for p in model.parameters()), torch.float32)
        return {"input_features": torch.zeros(batch, mels, frames, dtype=dtype)}
    token = filler_token(model)
    ids = torch.full((batch, prompt), token, dtype=torch.long)
    mask = torch.ones(batch, prompt, dtype=torch.long)
    if left_pad:
        pad = getattr(getattr(model, "generation_config", None), "pad_token_id", None)
        rows = slice(1, None) if batch > 1 else slice(None)
        mask[rows, :left_pad] = 0
        if isinstance(pad, int):
            ids[rows, :left_pad] = pad
    return {"input_ids": ids, "attention_mask": mask}


def _concrete(inputs: Any, model: nn.Module) -> dict[str, Any]:
    """``inputs`` as ``generate()`` keyword arguments, with real values for meta or fake ones
    (integer ids: :func:`filler_token`; masks: ones; features: zeros)."""
    if isinstance(inputs, torch.Tensor):
        inputs = {"input_ids": inputs}
    elif isinstance(inputs, (tuple, list)):
        if not inputs or not isinstance(inputs[0], torch.Tensor):
            raise UsageError("generation inputs: a dict of tensors (input_ids, attention_mask; "
                             "input_features for Whisper) or the input_ids tensor")
        inputs = {"input_ids": inputs[0]}
    if not isinstance(inputs, Mapping):
        raise UsageError(f"generation inputs must be a dict of tensors, not "
                         f"{type(inputs).__name__}")
    token = filler_token(model)

    def real(name: str, v: torch.Tensor) -> torch.Tensor:
        if not (v.is_meta or isinstance(v, FakeTensor)):
            return v
        if "mask" in name:
            return torch.ones(v.shape, dtype=v.dtype)
        if v.is_floating_point():
            return torch.zeros(v.shape, dtype=v.dtype)
        return torch.full(v.shape, token, dtype=v.dtype)

    return {k: real(k, v) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def describe_inputs(inputs: Mapping[str, Any]) -> tuple[tuple[str, tuple[int, ...], str], ...]:
    """``(name, shape, dtype)`` of each tensor input."""
    return tuple((k, tuple(v.shape), str(v.dtype).replace("torch.", ""))
                 for k, v in inputs.items() if isinstance(v, torch.Tensor))


# -- the values a trace cannot compute -------------------------------------------------------


class _GenerationValues(RealValues):
    """Real values for the generation loop: :class:`RealValues`, plus chosen values for the
    token choices outside the model and the expert choices inside it (module docstring)."""

    def __init__(self, mode: CountingFakeMode, token: int) -> None:
        super().__init__()
        self.mode = mode
        self.token = token
        self.token_choices = 0
        self.routed: dict[str, str] = {}  # module -> op, choices inside the model
        self.read_routing: set[str] = set()  # modules whose code read a routed value
        self.from_routing: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def _routed(self, args: Any) -> bool:
        return bool(self.from_routing) and any(
            isinstance(x, FakeTensor) and x in self.from_routing for x in leaves(args))

    def _reads(self, args: Any, kwargs: Any) -> None:
        if self._routed((args, kwargs)):
            self.read_routing.add(self.mode.modules[-1] if self.mode.modules else "<model>")

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if func is _ATEN._local_scalar_dense.default:
            self._reads(args, kwargs)
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _data_dependent(self, func: Any, args: Any, kwargs: Any) -> Any:
        self._reads(args, kwargs)
        return super()._data_dependent(func, args, kwargs)

    def _follow(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        if func in _CHOICE and self._real_args(func, args, kwargs) is None:
            inside = bool(self.mode.modules)
            with _disable_current_modes():
                for f in leaves(out):
                    if isinstance(f, FakeTensor):
                        self._set(f, self._chosen(f, inside))
                        if inside:
                            self.from_routing[f] = True
            if inside:
                self.routed.setdefault(self.mode.modules[-1], func.overloadpacket.__name__)
            else:
                self.token_choices += 1
            return
        super()._follow(func, args, kwargs, out)
        if self._routed((args, kwargs)):
            for f in leaves(out):
                if isinstance(f, FakeTensor):
                    self.from_routing[f] = True

    def _chosen(self, fake: torch.Tensor, inside: bool) -> torch.Tensor:
        if fake.is_floating_point():
            return torch.zeros(fake.shape, dtype=fake.dtype)
        if not inside:
            return torch.full(fake.shape, self.token, dtype=fake.dtype)
        # experts 0..k-1 for every token: each of them reached by all the tokens
        k = fake.shape[-1] if fake.dim() else 1
        idx = torch.arange(k, dtype=fake.dtype)
        return idx.expand(fake.shape).clone() if fake.dim() else idx[0].clone()

    def routing_note(self) -> str:
        """Where chosen values were read (a bound), or that none was (exact); or empty."""
        if self.read_routing:
            where = ", ".join(sorted(self.read_routing))
            return ("values the weights decide (MoE routing) are read by the code of "
                    f"{where}: traced as if every token chose the first top-k candidates "
                    "(experts 0..k-1), each expert at its capacity (all the tokens): an upper "
                    "bound on the per-expert temporaries, not the real routing")
        if not self.routed:
            return ""
        first = next(iter(self.routed))
        more = f" and {len(self.routed) - 1} more" if len(self.routed) > 1 else ""
        return (f"values the weights decide (top-k/argmax in {first}{more}, e.g. MoE "
                "routing) are read by no code: every expert's work is sized by tokens x "
                "top-k whatever the choice, so memory does not depend on them: exact")


# -- the cache -------------------------------------------------------------------------------


def _tensors_in(value: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif depth < 3 and isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors_in(v, depth + 1)
    elif depth < 3 and isinstance(value, dict):
        for v in value.values():
            yield from _tensors_in(v, depth + 1)


def _subcaches(cache: Any) -> list[tuple[Any, bool]]:
    """``(cache, is_cross_attention)`` for a cache and, for an encoder-decoder's, its parts."""
    parts = []
    for name, cross in (("self_attention_cache", False), ("cross_attention_cache", True)):
        part = getattr(cache, name, None)
        if part is not None:
            parts.append((part, cross))
    return parts or [(cache, False)]


def _is_cache(obj: Any) -> bool:
    try:
        from transformers.cache_utils import Cache
    except ImportError:  # pragma: no cover - generate() needs transformers
        return False
    return isinstance(obj, Cache)


def _cache_of(kwargs: Mapping[str, Any], output: Any = None) -> Any:
    for key in ("cache", "past_key_values", "cache_params"):
        value = kwargs.get(key)
        if _is_cache(value):
            return value
    for key in ("cache", "past_key_values", "cache_params"):
        value = getattr(output, key, None) if output is not None else None
        if _is_cache(value):
            return value
    return None


def _block_cache(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    """The cache a block is given, under whatever name (Falcon's ``layer_past``)."""
    found = _cache_of(kwargs)
    if found is None:
        found = next((v for v in (*args, *kwargs.values()) if _is_cache(v)), None)
    return found


class _CacheWatch:
    """Forward hooks on the model: the phases, and the cache's storages after each forward."""

    def __init__(self, mode: CountingFakeMode, model: nn.Module) -> None:
        self.mode = mode
        self.model = model
        self.records: set[int] = set()
        self.label = "setup"
        self.prefilling = False
        self.prefill_chunks = 0
        self.decode_steps = 0
        self.prefill_bytes = 0
        self.final_bytes = 0
        self.host_bytes = 0
        self.host: WeakIdKeyDictionary = WeakIdKeyDictionary()  # an offloaded cache's host copies
        self.cache_class = ""
        self.groups: tuple[CacheGroup, ...] = ()
        self._cache: weakref.ref[Any] | None = None
        config: Any = getattr(model, "config", None)
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") \
            else config
        rank = int(getattr(text, "kv_lora_rank", 0) or 0)
        self.latent_dims = rank + int(getattr(text, "qk_rope_head_dim", 0) or 0) if rank else 0

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        """The hooks, and ``_prefill`` wrapped to tell prefill forwards from decode steps."""
        handles = [self.model.register_forward_pre_hook(self._pre, with_kwargs=True),
                   self.model.register_forward_hook(self._post, with_kwargs=True)]
        encoder = None
        if getattr(getattr(self.model, "config", None), "is_encoder_decoder", False):
            get = getattr(self.model, "get_encoder", None)
            encoder = get() if callable(get) else None
        if isinstance(encoder, nn.Module) and encoder is not self.model:
            handles.append(encoder.register_forward_pre_hook(self._encode))
        original = getattr(self.model, "_prefill", None)
        if original is not None:
            def prefill(*args: Any, **kwargs: Any) -> Any:
                self.prefilling = True
                try:
                    return original(*args, **kwargs)
                finally:
                    self.prefilling = False

            vars(self.model)["_prefill"] = prefill  # an instance attribute, deleted below
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            if original is not None and "_prefill" in vars(self.model):
                del self.model._prefill

    def _encode(self, module: nn.Module, args: Any) -> None:
        self.label = "encode"
        self.mode.begin_phase("encode", 0)

    def _pre(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        cache = _cache_of(kwargs)
        if cache is not None:
            self._mark(cache)
            for part, _ in _subcaches(cache):
                if getattr(part, "offloading", False):
                    part.prefetch_stream = _NullStream()
        if self.prefilling or (not self.prefill_chunks and not self.decode_steps):
            self.prefill_chunks += 1
            self.label = f"prefill {self.prefill_chunks}"
            self.mode.begin_phase("prefill", 0, self.prefill_chunks)
        else:
            self.decode_steps += 1
            self.label = f"decode {self.decode_steps}"
            self.mode.begin_phase("decode", self.decode_steps)

    def _post(self, module: nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        cache = _cache_of(kwargs, output)
        if cache is None:
            return
        self._mark(cache)
        self.cache_class = type(cache).__name__
        nbytes = self._bytes(cache)
        self.host_bytes = self._bytes(cache, host=True)
        if not self.decode_steps:
            self.prefill_bytes = nbytes
        self.final_bytes = nbytes
        self.groups = self._groups(cache)
        if self._cache is None or self._cache() is not cache:
            self._cache = weakref.ref(cache)
            self._wrap_reorder(cache)

    def _wrap_reorder(self, cache: Any) -> None:
        """Beam search reorders the cache after each step: its new storages are the cache's."""
        parts = {id(cache): cache} | {id(c): c for c, _ in _subcaches(cache)}
        for part in parts.values():
            method = getattr(part, "reorder_cache", None)
            if method is None or "reorder_cache" in vars(part):
                continue

            def reorder(*args: Any, __method: Any = method, __part: Any = part) -> Any:
                out = __method(*args)
                self._mark(__part)
                return out

            part.reorder_cache = reorder

    def _storages(self, cache: Any) -> Iterator[tuple[Any, bool, str, torch.Tensor]]:
        for part, cross in _subcaches(cache):
            for layer in getattr(part, "layers", ()):
                for name, value in vars(layer).items():
                    for t in _tensors_in(value):
                        yield layer, cross, name, t

    def _mark(self, cache: Any) -> None:
        for *_, t in self._storages(cache):
            rec = self.mode.allocation_of(t) if isinstance(t, FakeTensor) else None
            if rec is not None:
                self.records.add(id(rec))

    def _bytes(self, cache: Any, host: bool = False) -> int:
        """Bytes of the cache's device storages (or of those in host memory)."""
        seen: dict[int, int] = {}
        for *_, t in self._storages(cache):
            if isinstance(t, FakeTensor) and (t in self.host) == host:
                st = t.untyped_storage()
                seen[st._cdata] = st.nbytes()
        return sum(seen.values())

    def _groups(self, cache: Any) -> tuple[CacheGroup, ...]:
        per_layer: dict[int, dict[str, Any]] = {}
        for layer, cross, name, t in self._storages(cache):
            if not isinstance(t, FakeTensor):
                continue
            info = per_layer.setdefault(id(layer), {
                "layer": layer, "cross": cross, "token": {}, "state": {}, "other": {},
                "rows": 0})
            st = t.untyped_storage()
            if name in _STATE_ATTRS:
                info["state"][st._cdata] = (st.nbytes(), t)
            elif t.dim() >= 3 and t.shape[-2] > 0 and t.numel():
                info["token"][st._cdata] = (st.nbytes(), t)
            else:
                info["other"][st._cdata] = (st.nbytes(), t)
        groups: dict[CacheKind, dict[str, Any]] = {}
        for info in per_layer.values():
            layer = info["layer"]
            kinds: list[tuple[CacheKind, str]] = []
            if info["state"]:
                kinds.append((CacheKind.RECURRENT, "state"))
            if info["token"]:
                kinds.append((self._attention_kind(layer, info["cross"]), "token"))
            if not kinds:
                continue
            for kind, part in kinds:
                g = groups.setdefault(kind, {"layers": 0, "per_token": 0, "per_seq": 0,
                                             "tokens": 0, "capacity": None, "nbytes": 0})
                g["layers"] += 1
                tensors = info[part]
                g["nbytes"] += sum(n for n, _ in tensors.values())
                if part == "state":
                    rows = max(int(t.shape[0]) for _, t in tensors.values())
                    g["per_seq"] += sum(n for n, _ in tensors.values()) // max(rows, 1)
                    continue
                for n, t in tensors.values():
                    rows, length = int(t.shape[0]), int(t.shape[-2])
                    token_bytes = t.numel() * t.element_size() // (rows * length)
                    g["per_token"] += token_bytes
                    g["tokens"] = max(g["tokens"], n // max(token_bytes * rows, 1))
                cap = self._capacity(layer, kind)
                if cap is not None:
                    g["capacity"] = cap if g["capacity"] is None else max(g["capacity"], cap)
            if info["other"]:
                kind = kinds[-1][0]
                groups[kind]["nbytes"] += sum(n for n, _ in info["other"].values())
        out = []
        for kind in CacheKind:
            if kind not in groups:
                continue
            g = groups[kind]
            latent = None
            if kind is CacheKind.LATENT and self.latent_dims:
                size = next(t.element_size() for *_, t in self._storages(cache)
                            if isinstance(t, FakeTensor) and t.dim() >= 3)
                latent = g["layers"] * self.latent_dims * size
            out.append(CacheGroup(kind, g["layers"], g["per_token"], g["per_seq"],
                                  g["tokens"] if g["per_token"] else 0, g["capacity"],
                                  g["nbytes"], latent))
        return tuple(out)

    def _attention_kind(self, layer: Any, cross: bool) -> CacheKind:
        if cross:
            return CacheKind.CROSS_ATTENTION
        if getattr(layer, "is_sliding", False):
            return CacheKind.SLIDING_WINDOW
        if self.latent_dims:
            return CacheKind.LATENT
        return CacheKind.FULL_ATTENTION

    @staticmethod
    def _capacity(layer: Any, kind: CacheKind) -> int | None:
        static = getattr(layer, "max_cache_len", None)
        if isinstance(static, int) and static > 0:
            return static
        window = getattr(layer, "sliding_window", None)
        if kind is CacheKind.SLIDING_WINDOW and isinstance(window, int):
            return window
        return None


# -- an offloaded cache on a GPU ---------------------------------------------------------------

#: Layer attributes an offloaded cache moves between the GPU and the host (transformers'
#: ``offload``/``prefetch`` of each layer class).
_MOVED = ("keys", "values", "indexer_keys", "conv_states", "recurrent_states")


class _NullStream:
    """A CUDA stream stand-in: waits and the stream context are no-ops on fake tensors."""

    def wait_stream(self, other: Any) -> None:
        """Nothing to wait for."""

    def __enter__(self) -> _NullStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class _Offload:
    """transformers' offloaded caches (``offloading=True``) as on a GPU, on fake CPU tensors.

    ``offload()`` copies a layer's tensors to the host: the copies are not device memory (not
    counted), and the device tensors are freed when the layer drops them; ``prefetch()``
    copies them back, counted as new device memory. The CUDA stream calls become no-ops.
    """

    def __init__(self, mode: CountingFakeMode) -> None:
        self.mode = mode
        self.host: WeakIdKeyDictionary = WeakIdKeyDictionary()  # the copies in host memory

    def _copy(self, t: torch.Tensor, host: bool) -> torch.Tensor:
        counting = self.mode.counting
        self.mode.counting = not host and counting
        try:
            out = t.clone()
        finally:
            self.mode.counting = counting
        if host:
            self.host[out] = True
        return out

    def _move(self, layer: Any, host: bool) -> None:
        for name in _MOVED:
            value = getattr(layer, name, None)
            if isinstance(value, torch.Tensor):
                if (value in self.host) != host and value.numel():
                    setattr(layer, name, self._copy(value, host))
            elif isinstance(value, list):
                for i, t in enumerate(value):
                    if isinstance(t, torch.Tensor) and t.numel() and (t in self.host) != host:
                        value[i] = self._copy(t, host)

    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        """Every cache layer class's ``offload``/``prefetch``, and ``torch.cuda.default_stream``."""
        from transformers import cache_utils

        saved: list[tuple[Any, str, Any]] = []
        for cls in vars(cache_utils).values():
            if not isinstance(cls, type) or cls.__module__ != cache_utils.__name__:
                continue
            if issubclass(cls, cache_utils.Cache):
                continue
            for name, host in (("offload", True), ("prefetch", False)):
                if name in vars(cls):
                    saved.append((cls, name, vars(cls)[name]))

                    def method(layer: Any, __host: bool = host) -> None:
                        self._move(layer, __host)

                    setattr(cls, name, method)
        saved.append((torch.cuda, "default_stream", torch.cuda.default_stream))
        null: Any = _NullStream()
        torch.cuda.default_stream = lambda device=None: null  # CPU builds have no CUDA stream
        try:
            yield
        finally:
            for owner, name, original in reversed(saved):
                setattr(owner, name, original)


# -- running it --------------------------------------------------------------------------------


@contextlib.contextmanager
def _attributes_kept(model: nn.Module) -> Iterator[None]:
    """The model's own attributes as they were (generate sets ``_previous_max_cache_length``)."""
    before = dict(vars(model))
    try:
        yield
    finally:
        now = vars(model)
        for key in [k for k in now if k not in before]:
            del now[key]
        for key, value in before.items():
            if now.get(key) is not value:
                now[key] = value


@contextlib.contextmanager
def _as_a_real_run(mode: CountingFakeMode) -> Iterator[None]:
    """transformers' ``is_tracing(tensor)`` false for this trace's fake tensors.

    transformers takes a fake tensor for a compile or export trace and then keeps tensors a
    real run drops: it materialises the causal mask SDPA would skip (``_ignore_causal_mask_sdpa``),
    keeps an all-ones attention mask. The trace is of the real run, whose values it computes
    where the inputs give them.
    """
    from modelsize.estimation.trace import transformers_sees_real

    with transformers_sees_real(lambda x: x.fake_mode is mode):
        yield


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' log at error level for the block (generate's notices are not ours)."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover
        yield
        return
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _call(model: nn.Module, kwargs: dict[str, Any], program: GenerateProgram) -> Any:
    generate: Any = getattr(model, "generate", None)
    if not callable(generate):
        raise UsageError(f"{type(model).__name__} has no generate(): mode='generate' needs a "
                         "transformers model with a generation head")
    ctx = (torch.autocast("cpu", dtype=program.amp) if program.amp is not None
           else contextlib.nullcontext())
    with torch.no_grad(), ctx:
        return generate(**kwargs, **program.kwargs())


#: After this many traces whose replayed steps a real one contradicted, every step is traced.
_ATTEMPTS = 3


def trace_generate(model: nn.Module, inputs: Any, program: GenerateProgram,
                   progress: Callable[[str, int], None] | None = None, *,
                   fast: bool = True) -> GenerateTrace:
    """Trace ``program`` on ``model`` with fake tensors (see the module docstring).

    ``fast``: decode steps whose allocations follow the steps before them are replayed
    (:mod:`modelsize.estimation.decode_replay`: the same timeline, tick for tick); False
    dispatches every op of every step.
    """
    forced: set[int] = set()
    start = time.perf_counter()
    why = ""
    blocks = fast
    for attempt in range(_ATTEMPTS + 1):
        try:
            with _no_cycle_collection():
                traced = _trace_once(model, inputs, program, progress,
                                     fast and attempt < _ATTEMPTS and _affine_cache(program),
                                     forced, blocks and attempt < _ATTEMPTS)
        except Retrace as exc:
            forced |= set(range(exc.lo, exc.hi + 1))
            why = str(exc)
            continue
        except BlockRetrace as exc:
            blocks = False
            why = f"repeated blocks: {exc}"
            continue
        traced.decode.retraces = attempt
        if attempt:
            traced.decode.note = f"traced again: {why}"
        elif not _affine_cache(program) and fast:
            traced.decode.note = "this cache's steps are not affine in the step"
        traced.trace.seconds = time.perf_counter() - start
        return traced
    raise AssertionError("unreachable: the last attempt replays nothing")  # pragma: no cover


@contextlib.contextmanager
def _no_cycle_collection() -> Iterator[None]:
    """The cycle collector off for the trace, as it is for a measured run
    (:func:`modelsize.estimation.verify.allocator_events`): storages held in reference cycles
    (transformers leaves some, the cache among them) are freed when they are in the real run,
    never at a random tick. No collection first: what an earlier program left in cycles is
    not this trace's (its storages are another mode's) and stays uncollected until the end,
    where a full collection would cost 0.1-0.2 s in a process that imported transformers."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _affine_cache(program: GenerateProgram) -> bool:
    """Whether the cache's decode steps may be affine in the step: not the offloaded cache
    (layers moved between devices) nor a quantized cache with a residual buffer (it fills and
    is quantized again every ``residual_length`` steps); the fp8 cache only appends."""
    cache = program.options.get("cache_implementation")
    if cache in ("offloaded", "offloaded_static"):
        return False
    if cache == "quantized":
        config = program.options.get("cache_config") or {}
        backend = config.get("backend") if isinstance(config, Mapping) else \
            getattr(config, "backend", None)
        return backend == "fp8"
    return True


def _trace_once(model: nn.Module, inputs: Any, program: GenerateProgram,
                progress: Callable[[str, int], None] | None, fast: bool,
                forced: set[int], blocks: bool) -> GenerateTrace:
    """One trace of ``program``; raises :class:`Retrace` where replayed steps were wrong."""
    from modelsize.estimation import scratch as scratch_models

    real_inputs = _concrete(inputs, model)
    device = torch.device(program.device)
    mode = CountingFakeMode(scratch=scratch_models.table(device.type))
    mode.counting = False
    copier = _FakeCopier(mode, torch.device("cpu"))
    fakes, state, unique = fake_state(model, copier, mode)
    token = filler_token(model)
    values = _GenerationValues(mode, token)
    # generate() reads values of the ids and the mask (and of what it makes from them) at
    # every step: they keep their twins however long the prompt
    largest = max((v.nbytes for v in real_inputs.values() if isinstance(v, torch.Tensor)),
                  default=0)
    values.value_limit = max(values.value_limit, 4 * largest)
    _, kwargs = _fake_inputs(real_inputs, copier, fakes, mode, values)
    del fakes
    watch = _CacheWatch(mode, model)
    replay = DecodeReplay(
        mode, model, program.new_tokens,
        lambda: watch.decode_steps if mode.phases and mode.phases[-1].name == "decode" else 0,
        forced, enabled=fast, cache_of=_cache_of, values=values)
    repeated = BlockReplay(mode, model, values=values, cache_of=_block_cache,
                           enabled=blocks and _affine_cache(program))
    if progress is not None:
        mode.progress = lambda tick: progress(watch.label, tick)
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        stack.enter_context(_attributes_kept(model))
        stack.enter_context(_quiet_transformers())
        stack.enter_context(_as_a_real_run(mode))
        stack.enter_context(training_flags(model, False))
        stack.enter_context(_swapped_state(model, state))
        stack.enter_context(_module_names(mode, model))
        stack.enter_context(watch.hooks())
        stack.enter_context(replay.installed())
        stack.enter_context(repeated.installed())
        stack.enter_context(mode)
        stack.enter_context(values)
        if device.type == "cuda":
            from modelsize.estimation.cuda_kernels import CudaKernelChoices

            stack.enter_context(CudaKernelChoices())
            if program.amp is not None:
                from modelsize.estimation.cuda_autocast import cuda_policy

                stack.enter_context(cuda_policy())
            offload = _Offload(mode)
            watch.host = offload.host
            stack.enter_context(offload.patched())
        mode.origin = Origin.FORWARD
        mode.counting = True
        mode.begin_phase("setup", 0)
        out = _call(model, kwargs, program)
        del out
        mode.end_phase()
        mode.counting = False
        replay.finish(watch.decode_steps)
        repeated.finish()
        mode.end_program()
    seconds = time.perf_counter() - start
    trace = Trace(mode, sum(p.numel() for p in unique),
                  sum(p.numel() for p in unique if p.requires_grad), seconds)
    return GenerateTrace(trace, watch, values, token, replay.summary, repeated.summary)


def measure_generate(model: nn.Module, inputs: Any, program: GenerateProgram) -> int:
    """The real CPU peak, in bytes, of ``program`` on a copy of ``model`` (the allocator's
    events, plus the parameters, buffers and inputs live before it starts)."""
    from modelsize.estimation.verify import _real_copy, allocator_events, peak_of, storage_bytes

    work = _real_copy(model)
    kwargs = _concrete(inputs, model)
    _, kwargs = map_inputs(kwargs, lambda v: v.detach())
    before = storage_bytes([*work.parameters(), *work.buffers(),
                            *(v for v in kwargs.values() if isinstance(v, torch.Tensor))])
    with _quiet_transformers(), training_flags(work, False), allocator_events() as events:
        out = _call(work, kwargs, program)
        del out
    return before + peak_of(events)


# -- the estimate ----------------------------------------------------------------------------


def estimate_api(model: nn.Module, inputs: Any, *, mode: str, new_tokens: int | None,
                 generation: Mapping[str, Any] | None, device: str | None,
                 amp: torch.dtype | None, verify: bool, verify_budget: int | None,
                 name: str | None, progress: Callable[[str, int], None] | None,
                 unused: Mapping[str, bool]) -> Estimate:
    """``modelsize.estimate(mode="generate", ...)``: the arguments checked, then
    :func:`estimate_generate`."""
    if mode != "generate":
        raise UsageError(f"new_tokens and generation are for mode='generate', not {mode!r}")
    if new_tokens is None:
        raise UsageError("mode='generate' needs new_tokens (the max_new_tokens of generate())")
    given = [k for k, v in unused.items() if v]
    if given:
        raise UsageError(f"mode='generate' runs generate() in eval mode under no_grad: "
                         f"{', '.join(given)} do not apply")
    if generation is not None and not isinstance(generation, Mapping):
        raise UsageError(f"generation must be a dict of generate() keyword arguments, not "
                         f"{type(generation).__name__}")
    program = GenerateProgram(new_tokens, dict(generation or {}),
                              device if device is not None else "cpu", amp)
    sources = {"device": Source.DEFAULT if device is None else Source.GIVEN}
    return estimate_generate(model, inputs, program, name=name or type(model).__name__,
                             sources=sources, verify=verify, verify_budget=verify_budget,
                             progress=progress)


def estimate_generate(model: nn.Module, inputs: Any, program: GenerateProgram, *,
                      name: str, sources: dict[str, Source] | None = None,
                      verify: bool = False, verify_budget: int | None = None,
                      progress: Callable[[str, int], None] | None = None,
                      fast: bool = True) -> Estimate:
    """The :class:`Estimate` of ``program`` (``modelsize.estimate(mode="generate")``);
    ``fast`` False traces every decode step op by op (see :func:`trace_generate`)."""
    from modelsize.estimation.core import summarize
    from modelsize.estimation.verify import RandomState

    if not isinstance(model, nn.Module):
        raise UsageError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    real_inputs = _concrete(inputs, model)
    start = RandomState.capture()
    try:
        traced = trace_generate(model, real_inputs, program, progress, fast=fast)
    except ModelSizeError:
        raise
    except (DataDependentOutputException, DynamicOutputShapeException) as exc:
        where = user_code(traceback.extract_tb(exc.__traceback__))
        raise EstimateError(f"tracing {name} failed: the model needs tensor values "
                            f"({exc.func}) at {where}, which the trace does not have") from exc
    except ImportError as exc:  # a cache backend generate() imports (optimum-quanto, hqq)
        package = getattr(exc, "name", None) or "a package"
        first = (str(exc).strip().splitlines() or [""])[0]
        if "optimum-quanto" in first:
            package = "optimum-quanto"
        raise MissingDependencyError(package, f"generate() with {program.options}") from exc
    except (RuntimeError, TypeError, ValueError, NotImplementedError, AttributeError,
            AssertionError, IndexError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise EstimateError(f"tracing {name} generate() failed: {first}") from exc
    finally:
        start.restore()
    mode = traced.trace.mode
    peak_phase = next((i for i, p in enumerate(mode.phases)
                       if p.start <= mode.peak_tick <= (p.end if p.end >= 0 else mode.tick)),
                      -1)
    records = traced.cache.records

    def category(rec: Allocation) -> MemoryCategory | None:
        if id(rec) in records:
            return MemoryCategory.KV_CACHE
        if rec.origin is Origin.FORWARD:
            return (MemoryCategory.ACTIVATIONS if rec.phase < peak_phase
                    else MemoryCategory.TEMPORARIES)
        return None

    setup_program = Program(mode="generate", device=program.device, amp=program.amp,
                            steps=program.new_tokens)
    est = summarize(traced.trace, setup_program, name, describe_inputs(real_inputs), sources,
                    category=category)
    est = replace(est, generation=_info(traced, program, real_inputs))
    if verify:
        est = replace(est, verification=verification(model, real_inputs, program, est,
                                                     budget=verify_budget, start=start))
    return est


def _info(traced: GenerateTrace, program: GenerateProgram,
          inputs: Mapping[str, Any]) -> GenerationInfo:
    watch = traced.cache
    first = next((v for v in inputs.values() if isinstance(v, torch.Tensor) and v.dim()),
                 None)
    batch = int(first.shape[0]) if first is not None else 1
    ids = inputs.get("input_ids")
    prompt = int(ids.shape[-1]) if isinstance(ids, torch.Tensor) and ids.dim() else 0
    options = {k: repr(v) for k, v in program.options.items()}
    token_values = (f"each step's token is an argmax over logits the trace does not compute: "
                    f"the trace takes id {traced.filler} (no end-of-sequence, pad or start "
                    f"id), as with min_new_tokens={program.new_tokens} generate never stops "
                    "early and which ids are chosen changes no tensor's size")
    return GenerationInfo(
        new_tokens=program.new_tokens, batch=batch, prompt_tokens=prompt, beams=program.beams,
        rows=batch * program.beams, prefill_chunks=watch.prefill_chunks,
        cache_class=watch.cache_class, options=options,
        prefill_cache_bytes=watch.prefill_bytes, final_cache_bytes=watch.final_bytes,
        host_cache_bytes=watch.host_bytes, groups=watch.groups, token_values=token_values,
        routing=traced.values.routing_note(), decode_trace="; ".join(
            d for d in (traced.decode.describe(), traced.blocks.describe()) if d))


def verification(model: nn.Module, inputs: Mapping[str, Any], program: GenerateProgram,
                 est: Estimate, *, budget: int | None = None,
                 start: Any = None) -> Verification:
    """``generate()`` run for real on CPU beside its CPU estimate (a smaller batch when the
    full one does not fit ``budget``)."""
    from modelsize.estimation.verify import default_budget, resize_batch
    from modelsize.estimation.verify import verify as run_verify

    if program.options.get("cache_implementation") in ("offloaded", "offloaded_static"):
        return Verification(None, est.peak_bytes, None, None,
                            default_budget() if budget is None else budget, 0.0,
                            "the offloaded cache needs a GPU (CUDA streams): it cannot run "
                            "on CPU")
    cpu = replace(program, device="cpu")

    def estimate_at(inp: Any) -> int:
        return trace_generate(model, inp, cpu).trace.mode.peak_bytes

    batch, resize = resize_batch(inputs)
    known = est.peak_bytes if program.device == "cpu" else None
    return run_verify(model, inputs, Program(mode="generate"), estimate_at, estimated=known,
                      batch=batch, resize=resize, budget=budget, start=start,
                      measure_with=lambda m, inp: measure_generate(m, inp, cpu))
