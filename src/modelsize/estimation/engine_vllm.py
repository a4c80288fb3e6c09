"""``--engine vllm``: the memory plan vLLM makes at start-up, from its rules and the traced model.

Rules copied from vLLM **0.33.0** (the PyPI sdist ``vllm-0.33.0.tar.gz``, sha256
``f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112``), one device, no
tensor or pipeline parallelism, no speculative decoding, default layout (``LBNHC``: blocks
are not the outermost dimension, so mixed page sizes are unified, not packed):

* ``requested = ceil(total x gpu_memory_utilization)`` (``v1/worker/utils.py``
  ``request_memory``); the engine's budget, of which the KV cache gets what is left
  (``v1/worker/gpu_worker.py`` ``determine_available_memory``)::

      available = requested - weights - runner buffers - non-torch - profile transient
                  - CUDA graphs

* **weights** (traced): the model's parameters in vLLM's dtype (the config's, float32 read as
  bfloat16: ``config/model.py`` ``_resolve_auto_dtype``), quantized or GGUF tensors as stored,
  and the rotary cos/sin cache vLLM keeps per RoPE (``[max_position, rotary_dim]`` in the
  model dtype, ``model_executor/layers/rotary_embedding/base.py``) in place of transformers'
  ``inv_freq`` buffers;
* **runner buffers** (rule): the input ids (int32) and positions (int64) for
  ``max_num_batched_tokens`` tokens and the block table (``v1/worker/block_table.py``:
  ``max_num_seqs x cdiv(max_model_len, block_size)`` int32, and an int64 slot mapping);
* **non-torch memory** (not traced; ``--non-torch``): what the process takes outside
  PyTorch's allocator between the start-up snapshot and the end of profiling (vLLM measures
  it with ``cudaMemGetInfo``); 0 unless given;
* **profile transient** (traced): ``torch_peak - torch_allocated`` of ``profile_run``
  (``v1/worker/gpu_model_runner.py``): one forward over ``max_num_batched_tokens`` tokens
  split over ``min(max_num_seqs, tokens)`` requests, attention *not computed* (no attention
  metadata in a profile run: the layers return their output buffer) and Mamba scans skipped
  (``mamba_mixer*.py``: the profile run returns after the projections); then the last
  hidden state of each request, ``compute_logits`` and the sampler warmed up twice
  (``_dummy_sampler_run``: logits to float32, softmax, exponential noise; the Triton top-k/
  top-p kernel's ``[min(requests, SMs), vocab]`` float32 buffer). The forward traced is the
  transformers model's own (not vLLM's fused kernels);
* **CUDA graphs** (estimate; vLLM measures it on the GPU, ``profile_cudagraph_memory``):
  the first capture's pool, taken as the profile forward's transient at the largest capture
  size, plus vLLM's floor of 1 MiB for every further graph; 0 with ``--enforce-eager``;
* **KV cache specs** (rule, ``v1/kv_cache_interface.py``): per layer, a page of
  ``block_size`` tokens: full attention ``kv_heads x block x (head + head_v) x dtype``;
  sliding window the same page, ``cdiv(min(window - 1 + 2 x max_num_batched_tokens,
  max_model_len), block) + 1`` blocks per request; MLA one latent row
  (``kv_lora_rank + qk_rope_head_dim``) per token; Mamba one state page per request
  (``model_executor/layers/mamba/mamba_utils.py``), the attention block size raised until
  its page covers the state and the state padded to it (``platforms/interface.py``
  ``_align_hybrid_block_size``);
* **groups and blocks** (rule, ``v1/core/kv_cache_planning.py``): one group when every
  layer's spec is the same; otherwise pages unified (block sizes scaled, Mamba padded) and
  layers grouped by spec in groups of the smallest type's layer count (``layers[i::n]``);
  ``bytes_per_block`` is the widest group's pages; ``num_gpu_blocks = available //
  bytes_per_block``;
* **capacity** (rule, ``v1/core/kv_cache_utils.py``): a request of ``max_model_len`` tokens
  takes ``sum over groups of cdiv(max_memory_usage_bytes, page)`` blocks; ``maximum
  concurrency = num_gpu_blocks / that``; ``KV cache size = int(concurrency x
  max_model_len)`` tokens; start-up fails when ``available - one block`` cannot hold one
  request (with vLLM's estimate of the longest model length that fits).

vLLM itself is never imported.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from modelsize.errors import EstimateError, UsageError, printable

if TYPE_CHECKING:
    from torch import nn

    from modelsize.estimation.model_source import WeightsPlan
    from modelsize.estimation.result import Estimate

VERSION = "0.33.0"
SOURCE = ("vLLM 0.33.0 (PyPI sdist vllm-0.33.0.tar.gz, sha256 "
          "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112)")
GIB = 2**30
MIB = 2**20
#: vLLM defaults (``config/cache.py``, ``engine/arg_utils.py`` ``get_batch_defaults`` for
#: ``vllm serve``, ``config/vllm.py`` ``max_concurrent_batches`` with async scheduling).
DEFAULT_UTILIZATION = 0.92
DEFAULT_BLOCK_SIZE = 16
CONCURRENT_BATCHES = 2
#: Streaming multiprocessors of the GPU (the Triton top-k/top-p buffer has one row per
#: program, at most one per SM): H100 SXM.
DEFAULT_SMS = 132

#: Named GPUs: the total memory ``cudaMemGetInfo`` reports (``measured``), or the nominal
#: capacity in GiB where no card was at hand (the driver reports a little less).
GPUS: dict[str, tuple[int, int, bool]] = {
    # name: (bytes, SMs, measured)
    "h100": (80 * GIB, 132, False),
    "h200": (141 * GIB, 132, False),
    "a100-80gb": (80 * GIB, 108, False),
    "a100-40gb": (40 * GIB, 108, False),
    "l40s": (48 * GIB, 142, False),
    "l4": (24 * GIB, 58, False),
    "a10g": (24 * GIB, 80, False),
    "rtx4090": (24 * GIB, 128, False),
    "b200": (180 * GIB, 148, False),
}


@dataclass(frozen=True)
class Gpu:
    """The GPU the plan is for: its total memory and where that number came from."""

    name: str
    total_bytes: int
    sms: int = DEFAULT_SMS
    source: str = "given"

    @classmethod
    def parse(cls, text: str) -> Gpu:
        """A named GPU (``H100``, ``A100-80GB``...) or a size (``80GiB``, ``85031714816``)."""
        key = text.strip().lower().replace(" ", "").replace("_", "-")
        if key in GPUS:
            nbytes, sms, measured = GPUS[key]
            how = ("measured: cudaMemGetInfo's total" if measured else
                   "nominal capacity; the driver reports a little less: give --gpu-memory "
                   "with torch.cuda.mem_get_info()[1] for an exact plan")
            return cls(key.upper(), nbytes, sms, how)
        from modelsize.report.units import parse_size

        try:
            return cls("", parse_size(text), DEFAULT_SMS, "given")
        except ValueError:
            names = ", ".join(k.upper() for k in GPUS)
            raise UsageError(f"--gpu-memory {printable(text)}: expected a size (80GiB) or a "
                             f"GPU ({names})") from None


@dataclass(frozen=True)
class VllmSettings:
    """The engine arguments the plan depends on (vLLM's names), ``None``: vLLM's default."""

    gpu: Gpu
    gpu_memory_utilization: float = DEFAULT_UTILIZATION
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int | None = None
    kv_cache_dtype: str = "auto"
    enforce_eager: bool = False
    non_torch_bytes: int = 0
    dtype: str | None = None

    def batch_defaults(self) -> tuple[int, int]:
        """``(max_num_batched_tokens, max_num_seqs)`` for ``vllm serve`` on this GPU
        (``engine/arg_utils.py`` ``get_batch_defaults``)."""
        total, name = self.gpu.total_bytes, self.gpu.name.lower()
        if total >= 160 * GIB:
            return 16384, 1024
        if total >= 70 * GIB and "a100" not in name:
            return 8192, 1024
        return 2048, 256


# -- KV cache specs (v1/kv_cache_interface.py) -------------------------------------------------


def cdiv(a: int, b: int) -> int:
    """``-(-a // b)``: vLLM's ``cdiv``."""
    return -(-a // b)


@dataclass(frozen=True)
class Spec:
    """One layer's KV cache spec, as vLLM builds it (the fields its page size depends on).

    ``kind``: ``full``, ``sliding``, ``mla`` or ``mamba``. Attention pages are
    ``kv_heads x block_size x (head + head_v) x dtype_bytes`` (``AttentionSpec``); a Mamba
    page is its states' bytes (``state_bytes``). ``padded``: the page padded to that size.
    """

    kind: str
    block_size: int
    kv_heads: int = 0
    head: int = 0
    head_v: int = 0
    dtype_bytes: int = 0
    window: int = 0
    state_bytes: int = 0
    padded: int | None = None

    @property
    def unpadded_page(self) -> int:
        """Bytes of one block of this layer before padding."""
        if self.kind == "mamba":
            return self.state_bytes
        return self.kv_heads * self.block_size * (self.head + self.head_v) * self.dtype_bytes

    @property
    def page(self) -> int:
        """``page_size_bytes``."""
        return self.padded if self.padded is not None else self.unpadded_page

    @property
    def per_token(self) -> int:
        """Bytes one token takes in this layer (0 for a Mamba state)."""
        return 0 if self.kind == "mamba" else self.unpadded_page // self.block_size

    def max_memory_usage_bytes(self, max_model_len: int, in_flight: int) -> int:
        """The most one request can hold in this layer (``max_memory_usage_bytes``)."""
        if self.kind == "mamba":
            return self.page
        if self.kind == "sliding":
            tokens = min(self.window - 1 + in_flight, max_model_len)
            return (cdiv(tokens, self.block_size) + 1) * self.page
        return cdiv(max_model_len, self.block_size) * self.page

    def blocks_per_request(self, max_model_len: int, in_flight: int) -> int:
        """``cdiv(max_memory_usage_bytes, page_size_bytes)``."""
        return cdiv(self.max_memory_usage_bytes(max_model_len, in_flight), self.page)


@dataclass(frozen=True)
class Group:
    """A KV cache group: layers sharing one block table, and their spec."""

    layers: tuple[int, ...]
    spec: Spec


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if callable(get) else config


def _dtype_bytes(name: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1,
            "fp8_e5m2": 1}[name]


_MAMBA_TYPES = ("jamba", "mamba", "mamba2", "granitemoehybrid")


def _mamba_state_bytes(text: Any, model_type: str, dtype_bytes: int) -> int:
    """One Mamba layer's state bytes per request (``get_mamba_state_shape_from_config`` of
    the model, ``MambaStateShapeCalculator``; conv and SSM states in the model dtype)."""
    hidden = int(text.hidden_size)
    if model_type in ("jamba", "mamba"):
        if model_type == "jamba":
            inner, state, conv = (int(text.mamba_expand) * hidden, int(text.mamba_d_state),
                                  int(text.mamba_d_conv))
        else:
            inner, state, conv = (int(text.intermediate_size), int(text.state_size),
                                  int(text.conv_kernel))
        return (inner * (conv - 1) + inner * state) * dtype_bytes
    if model_type == "mamba2":
        inner = int(text.expand) * hidden
        groups, heads, head_dim = int(text.n_groups), int(text.num_heads), int(text.head_dim)
        state, conv = int(text.state_size), int(text.conv_kernel)
    elif model_type == "granitemoehybrid":
        inner = int(text.mamba_expand) * hidden
        groups, heads, head_dim = (int(text.mamba_n_groups), int(text.mamba_n_heads),
                                   int(text.mamba_d_head))
        state, conv = int(text.mamba_d_state), int(text.mamba_d_conv)
    else:
        raise UsageError(f"--engine vllm: the recurrent state of model_type {model_type!r} is "
                         f"not modelled (Mamba rules for: {', '.join(_MAMBA_TYPES)})")
    conv_dim = inner + 2 * groups * state
    return (conv_dim * (conv - 1) + heads * head_dim * state) * dtype_bytes


def layer_specs(config: Any, dtype: str, settings: VllmSettings) -> list[Spec]:
    """Every decoder layer's spec, by vLLM's rules (module docstring), before grouping."""
    text = _text_config(config)
    model_type = str(getattr(text, "model_type", "") or getattr(config, "model_type", ""))
    if getattr(config, "is_encoder_decoder", False):
        raise UsageError("--engine vllm: encoder-decoder models are not planned here")
    kv_name = dtype if settings.kv_cache_dtype == "auto" else settings.kv_cache_dtype
    kv_bytes = _dtype_bytes(kv_name)
    model_bytes = _dtype_bytes(dtype)
    block = settings.block_size or DEFAULT_BLOCK_SIZE
    layers = int(text.num_hidden_layers)
    heads = int(getattr(text, "num_attention_heads", 0) or 0)
    kv_heads = int(getattr(text, "num_key_value_heads", 0) or heads or 0)
    head = int(getattr(text, "head_dim", 0) or (int(text.hidden_size) // heads if heads else 0))
    types = list(getattr(text, "layer_types", None) or [])
    rank = int(getattr(text, "kv_lora_rank", 0) or 0)
    if not types:
        window = getattr(text, "sliding_window", None)
        types = ["sliding_attention" if window else "full_attention"] * layers
    if len(types) != layers:
        raise UsageError(f"--engine vllm: {len(types)} layer_types for {layers} layers")
    kinds = []
    for t in types:
        if t in ("linear_attention", "mamba", "mamba2"):
            kinds.append("mamba")
        elif t == "sliding_attention":
            kinds.append("sliding")
        elif t in ("full_attention", "attention"):
            kinds.append("mla" if rank else "full")
        else:
            raise UsageError(f"--engine vllm: layer type {printable(t)!r} is not modelled "
                             "(full, sliding, MLA and Mamba layers are)")
    mamba_state = 0
    if "mamba" in kinds:
        mamba_state = _mamba_state_bytes(text, model_type, model_bytes)
        attn_kinds = {k for k in kinds if k != "mamba"}
        if attn_kinds and attn_kinds != {"full"}:
            raise UsageError("--engine vllm: Mamba layers beside sliding or MLA attention are "
                             "not modelled")
        if attn_kinds:
            block = hybrid_block_size(block, kv_heads * 2 * head * kv_bytes, mamba_state)
    specs = []
    for kind in kinds:
        if kind == "mamba":
            padded = None
            if any(k != "mamba" for k in kinds):
                page = block * kv_heads * 2 * head * kv_bytes
                padded = page if page != mamba_state else None
            specs.append(Spec("mamba", block, state_bytes=mamba_state, padded=padded))
        elif kind == "mla":
            latent = rank + int(getattr(text, "qk_rope_head_dim", 0) or 0)
            specs.append(Spec("mla", block, 1, latent, 0, kv_bytes))
        elif kind == "sliding":
            specs.append(Spec("sliding", block, kv_heads, head, head, kv_bytes,
                              window=int(text.sliding_window)))
        else:
            specs.append(Spec("full", block, kv_heads, head, head, kv_bytes))
    return specs


def hybrid_block_size(block: int, attn_per_token: int, mamba_page: int) -> int:
    """``_align_hybrid_block_size``: the smallest multiple of the kernel block (16 for
    FLASH_ATTN) whose attention page covers the Mamba state."""
    align = max(16, block)
    size = align * cdiv(mamba_page, align * attn_per_token)
    size = 16 * cdiv(size, 16)
    return max(block, size)


# -- grouping (v1/core/kv_cache_planning.py) ------------------------------------------------------


def _same(a: Spec, b: Spec) -> bool:
    return a == b


def unify_page_size(specs: list[Spec]) -> list[Spec]:
    """``unify_kv_cache_spec_page_size``: smaller attention pages grow by block size (an
    integer ratio) or are padded; Mamba pages are padded."""
    pages = {s.page for s in specs}
    if len(pages) <= 1:
        return specs
    top = max(pages)
    out = []
    for s in specs:
        if s.page == top:
            out.append(s)
        elif s.kind == "mamba":
            out.append(replace(s, padded=top))
        elif top % s.page == 0:
            out.append(replace(s, block_size=s.block_size * (top // s.page)))
        elif s.kind != "mla":
            out.append(replace(s, padded=top))
        else:
            raise UsageError("--engine vllm: an MLA page that does not divide the largest page "
                             "cannot be unified (vLLM raises NotImplementedError)")
    return out


def kv_cache_groups(specs: list[Spec]) -> list[Group]:
    """``get_kv_cache_groups`` for the default layout."""
    if not specs:
        return []
    if all(_same(s, specs[0]) for s in specs):
        return [Group(tuple(range(len(specs))), specs[0])]
    specs = unify_page_size(specs)
    buckets: list[tuple[Spec, list[int]]] = []
    for i, s in enumerate(specs):
        for spec, members in buckets:
            if _same(spec, s):
                members.append(i)
                break
        else:
            buckets.append((s, [i]))
    smallest = min(len(m) for _, m in buckets)
    largest = max(len(m) for _, m in buckets)
    size = largest if largest < smallest * 1.5 else smallest
    groups = []
    for spec, members in buckets:
        n = cdiv(len(members), size)
        for i in range(n):
            groups.append(Group(tuple(members[i::n]), spec))
    return groups


def bytes_per_block(groups: list[Group]) -> int:
    """``_get_kv_cache_bytes_per_block`` (layer-outer): the widest group's pages."""
    return max(len(g.layers) * g.spec.page for g in groups)


# -- the plan ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Term:
    """One named term of the plan: its bytes, how it was obtained, and from where."""

    name: str
    nbytes: int
    how: str
    """``rule`` (copied from vLLM's source), ``traced``, ``given`` or ``estimate``."""
    where: str
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"name": self.name, "bytes": self.nbytes, "how": self.how, "where": self.where,
                "note": self.note}


@dataclass(frozen=True)
class GroupPlan:
    """One KV cache group as planned: its layers, kind, page and blocks per request."""

    kind: str
    layers: int
    block_size: int
    page_bytes: int
    per_token_bytes: int
    blocks_per_request: int
    window: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"kind": self.kind, "layers": self.layers, "block_size": self.block_size,
                "page_bytes": self.page_bytes, "per_token_bytes": self.per_token_bytes,
                "blocks_per_request": self.blocks_per_request, "window": self.window or None}


@dataclass(frozen=True)
class VllmPlan:
    """vLLM's start-up memory plan: the terms, the KV cache it leaves, and what it holds."""

    version: str
    gpu: Gpu
    dtype: str
    kv_cache_dtype: str
    gpu_memory_utilization: float
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    requested_bytes: int
    terms: tuple[Term, ...]
    available_bytes: int
    groups: tuple[GroupPlan, ...]
    bytes_per_block: int
    num_gpu_blocks: int
    blocks_per_request: int
    max_concurrency: float
    kv_cache_tokens: int
    fits: bool
    longest_fitting_len: int
    request_tokens: int | None = None
    request_concurrency: float | None = None
    notes: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"engine": "vllm", "version": self.version, "source": SOURCE,
                "gpu": {"name": self.gpu.name or None, "total_bytes": self.gpu.total_bytes,
                        "source": self.gpu.source},
                "dtype": self.dtype, "kv_cache_dtype": self.kv_cache_dtype,
                "gpu_memory_utilization": self.gpu_memory_utilization,
                "max_model_len": self.max_model_len, "max_num_seqs": self.max_num_seqs,
                "max_num_batched_tokens": self.max_num_batched_tokens,
                "block_size": self.block_size, "requested_bytes": self.requested_bytes,
                "terms": [t.to_dict() for t in self.terms],
                "available_kv_cache_bytes": self.available_bytes,
                "groups": [g.to_dict() for g in self.groups],
                "bytes_per_block": self.bytes_per_block,
                "num_gpu_blocks": self.num_gpu_blocks,
                "blocks_per_request": self.blocks_per_request,
                "max_concurrency": self.max_concurrency,
                "kv_cache_tokens": self.kv_cache_tokens, "fits": self.fits,
                "longest_fitting_max_model_len": self.longest_fitting_len,
                "request_tokens": self.request_tokens,
                "request_concurrency": self.request_concurrency, "notes": list(self.notes)}


def vllm_dtype(config_dtype: str) -> str:
    """vLLM's ``dtype="auto"`` on a CUDA GPU: the config's, float32 downcast to bfloat16."""
    return "bfloat16" if config_dtype in ("", "float32") else config_dtype


def plan_kv(specs: list[Spec], available: int, max_model_len: int, batched_tokens: int,
            request_tokens: int | None = None) -> dict[str, Any]:
    """Groups, blocks, concurrency and tokens from the available bytes (the rules only; no
    tracing): what :func:`plan` prints, testable by hand."""
    groups = kv_cache_groups(specs)
    in_flight = CONCURRENT_BATCHES * batched_tokens
    per_block = bytes_per_block(groups)
    blocks = max(available, 0) // per_block

    def per_request(length: int) -> int:
        return sum(g.spec.blocks_per_request(length, in_flight) for g in groups)

    need = per_request(max_model_len)
    concurrency = blocks / need
    fits = available - per_block >= per_block * need and available > 0
    longest = 0
    if not fits:
        lo, hi = 1, max_model_len
        if (available - per_block) >= per_block * per_request(1):
            longest = 1
            while lo <= hi:
                mid = (lo + hi) // 2
                if (available - per_block) >= per_block * per_request(mid):
                    longest, lo = mid, mid + 1
                else:
                    hi = mid - 1
    out: dict[str, Any] = {
        "groups": groups, "bytes_per_block": per_block, "num_gpu_blocks": blocks,
        "blocks_per_request": need, "max_concurrency": concurrency,
        "kv_cache_tokens": int(concurrency * max_model_len), "fits": fits,
        "longest": longest if not fits else max_model_len}
    if request_tokens:
        out["request_concurrency"] = blocks / per_request(min(request_tokens, max_model_len))
    return out


def rope_cache_bytes(text: Any, dtype_bytes: int) -> int:
    """vLLM's rotary cos/sin caches: ``[max_position, rotary_dim]`` per distinct RoPE."""
    heads = int(getattr(text, "num_attention_heads", 0) or 0)
    if not heads or not getattr(text, "max_position_embeddings", 0):
        return 0
    head = int(getattr(text, "head_dim", 0) or int(text.hidden_size) // heads)
    params = getattr(text, "rope_parameters", None)
    factor = getattr(text, "partial_rotary_factor", None)
    if factor is None and isinstance(params, dict):
        factor = params.get("partial_rotary_factor")
    rotary = int(getattr(text, "qk_rope_head_dim", 0) or 0) or int(head * float(factor or 1.0))
    # one cache per distinct RoPE (get_rope's _ROPE_DICT): per layer type where the config
    # gives each type its own parameters (Gemma 3's local and global RoPE)
    ropes = 1
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        ropes = len({repr(sorted(v.items())) for v in params.values()})
    elif getattr(text, "rope_local_base_freq", None):
        ropes = 2
    return ropes * int(text.max_position_embeddings) * rotary * dtype_bytes


def capture_sizes(settings: VllmSettings, batched: int, seqs: int) -> tuple[list[int], int]:
    """``config/vllm.py`` ``_set_cudagraph_sizes``: the capture sizes (tokens) and how many
    of them are FULL decode graphs (sizes up to ``max_num_seqs``)."""
    top = min(min(seqs * 2, 1024 if settings.gpu.total_bytes >= 160 * GIB else 512), batched)
    sizes = [s for s in (1, 2, 4) if s <= top]
    if top >= 8:
        sizes += list(range(8, min(top + 1, 256), 8))
    if top >= 256:
        sizes += list(range(256, top + 1, 16))
    if batched <= top and batched not in sizes:
        sizes.append(batched)
    if seqs <= top and seqs not in sizes:
        sizes.append(seqs)
    sizes.sort()
    return sizes, sum(1 for s in sizes if s <= seqs)


def plan(model: nn.Module, weights: WeightsPlan | None, settings: VllmSettings,
         trace: Callable[[int, int, bool], tuple[int, int]],
         request_tokens: int | None = None) -> VllmPlan:
    """vLLM's start-up plan for ``model`` (built in vLLM's dtype). ``trace(tokens,
    requests, sampler)`` returns the profile run's ``(transient bytes, persistent bytes)``
    (:func:`trace_profile`), with the sampler's warm-up or without (a graph capture)."""
    config = getattr(model, "config", None)
    if config is None:
        raise UsageError("--engine vllm plans a transformers model (one with a config)")
    text = _text_config(config)
    dtype = str(next((p.dtype for p in model.parameters() if p.is_floating_point()),
                     "torch.bfloat16")).removeprefix("torch.")
    dtype = settings.dtype or dtype
    default_batched, default_seqs = settings.batch_defaults()
    mml = settings.max_model_len or int(getattr(text, "max_position_embeddings", 0) or 0)
    if not mml:
        raise UsageError("--engine vllm: the config has no max_position_embeddings: give "
                         "--max-model-len")
    batched = settings.max_num_batched_tokens or default_batched
    seqs = settings.max_num_seqs or default_seqs
    specs = layer_specs(config, dtype, settings)
    block = min((s.block_size for s in specs if s.kind != "mamba"),
                default=specs[0].block_size if specs else DEFAULT_BLOCK_SIZE)
    requested = math.ceil(settings.gpu.total_bytes * settings.gpu_memory_utilization)
    dbytes = _dtype_bytes(dtype)

    params = sum(p.numel() * p.element_size() for p in model.parameters())
    delta = 0
    if weights is not None and weights.stored:
        delta = weights.stored_bytes - weights.replaced_numel * dbytes
    rope = rope_cache_bytes(text, dbytes)
    weights_bytes = params + delta + rope
    how_weights = "traced" if not weights or not weights.stored else "traced + checkpoint"
    tables = seqs * cdiv(mml, block) * 4 + batched * 8
    buffers = batched * (4 + 8) + tables
    requests = min(seqs, batched)
    transient, _persistent = trace(batched, requests, True)
    terms = [
        Term("weights", weights_bytes, how_weights, "the model's parameters in "
             f"{dtype}" + (f" (checkpoint tensors held as stored: {delta:+,} B)" if delta
                           else "") + f"; rotary cos/sin cache {rope:,} B (rule, "
             "model_executor/layers/rotary_embedding/base.py)"),
        Term("runner buffers", buffers, "rule",
             "v1/worker/gpu_model_runner.py, v1/worker/block_table.py",
             f"input ids and positions for {batched:,} tokens; block table {seqs} x "
             f"{cdiv(mml, block):,} int32 and slot mapping"),
        Term("non-torch memory", settings.non_torch_bytes,
             "given" if settings.non_torch_bytes else "not traced",
             "utils/mem_utils.py memory_profiling (cudaMemGetInfo)",
             "outside PyTorch's allocator; 0 unless --non-torch"),
        Term("profile transient", transient, "traced",
             "v1/worker/gpu_model_runner.py profile_run",
             f"forward over {batched:,} tokens as {requests} requests, attention skipped; "
             "compute_logits and the sampler warm-up"),
    ]
    if settings.enforce_eager:
        terms.append(Term("CUDA graphs", 0, "rule", "--enforce-eager", "no graphs captured"))
    else:
        sizes, full = capture_sizes(settings, batched, seqs)
        first, _ = trace(sizes[-1], min(seqs, sizes[-1]), False) if sizes else (0, 0)
        further = max(len(sizes) - 1, 0) + max(full - 1, 0)
        terms.append(Term("CUDA graphs", first + further * MIB, "estimate",
                          "v1/worker/gpu_model_runner.py profile_cudagraph_memory",
                          f"{len(sizes)} piecewise + {full} full graphs: the largest "
                          f"({sizes[-1] if sizes else 0} tokens) traced as the first "
                          "capture's pool, 1 MiB (vLLM's floor) for each further graph; "
                          "vLLM measures this on the GPU"))
    available = requested - sum(t.nbytes for t in terms)
    kv = plan_kv(specs, available, mml, batched, request_tokens)
    groups = tuple(GroupPlan(g.spec.kind, len(g.layers), g.spec.block_size, g.spec.page,
                             g.spec.per_token,
                             g.spec.blocks_per_request(mml, CONCURRENT_BATCHES * batched),
                             g.spec.window) for g in kv["groups"])
    notes = []
    if weights is not None and weights.stored:
        notes.append("quantized or GGUF weights are counted as stored; vLLM's own loader for "
                     "them may repack")
    if "mamba" in {s.kind for s in specs}:
        notes.append("Mamba states in the model dtype (mamba_cache_dtype and "
                     "mamba_ssm_cache_dtype auto), mamba_cache_mode none: one state block "
                     "per request")
    return VllmPlan(VERSION, settings.gpu, dtype, settings.kv_cache_dtype,
                    settings.gpu_memory_utilization, mml, seqs, batched, block, requested,
                    tuple(terms), available, groups, kv["bytes_per_block"],
                    kv["num_gpu_blocks"], kv["blocks_per_request"], kv["max_concurrency"],
                    kv["kv_cache_tokens"], kv["fits"], kv["longest"], request_tokens,
                    kv.get("request_concurrency"), tuple(notes))


# -- the profile run, traced ------------------------------------------------------------------

_ATTENTION = "modelsize_vllm_profile"


def _skip_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
                    **kwargs: Any) -> tuple[Any, None]:
    """vLLM's attention in a profile run: the output buffer, nothing computed."""
    batch, heads, tokens, _ = query.shape
    return value.new_empty((batch, tokens, heads, value.shape[-1])), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(_ATTENTION, _skip_attention)


class _ProfileRun:
    """The program ``profile_run`` runs, on a transformers causal LM (module docstring)."""

    def __init__(self, model: nn.Module, sms: int, sampler: bool = True) -> None:
        self.model = model
        self.sms = sms
        self.sampler = sampler

    def module(self) -> nn.Module:
        import torch
        from torch import nn

        outer = self

        class ProfileRun(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.lm = outer.model

            def forward(self, input_ids: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
                lm: Any = self.lm
                base: Any = lm.get_decoder() if hasattr(lm, "get_decoder") else None
                if base is None:
                    base = getattr(lm, "model", None)
                out = base(input_ids=input_ids, use_cache=False)
                hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state
                picked = hidden[0].index_select(0, last)
                del out, hidden
                if not outer.sampler:
                    return picked
                logits = lm.get_output_embeddings()(torch.rand_like(picked))
                del picked
                for _ in range(2):  # the sampler, warmed up twice (_dummy_sampler_run)
                    outer.sample(logits)
                return logits

        return ProfileRun()

    def sample(self, logits: Any) -> Any:
        """``Sampler.forward`` with the dummy metadata: not all greedy, not all random,
        top-k and top-p on every row (``v1/sample/sampler.py``, ``topk_topp_sampler.py``)."""
        import torch

        rows, vocab = logits.shape
        x = logits.to(torch.float32)
        greedy = x.argmax(dim=-1)
        temperature = torch.full((rows,), 0.5, dtype=torch.float32)
        x.div_(temperature.unsqueeze(1))
        programs = min(self.sms, rows)
        buffer = x.new_empty((min(1 << (programs - 1).bit_length(), self.sms), vocab))
        probs = x.softmax(dim=-1, dtype=torch.float32)
        noise = torch.empty_like(probs).exponential_()
        token = probs.div_(noise).argmax(dim=-1)
        del buffer, noise, probs, x
        return torch.where(temperature < 1e-5, greedy, token)


def _mamba_mixers(model: nn.Module) -> list[Any]:
    return [m for m in model.modules() if "Mamba" in type(m).__name__
            and hasattr(m, "in_proj") and hasattr(m, "out_proj")
            and hasattr(m.out_proj, "in_features")]


def trace_profile(model: nn.Module, tokens: int, requests: int, sampler: bool = True,
                  device: str = "cuda", sms: int = DEFAULT_SMS) -> tuple[int, int]:
    """``(transient, persistent)`` bytes of vLLM's profile run on ``model``: the traced
    peak above what the model holds (parameters, buffers) and the inputs."""
    import torch

    from modelsize.estimation import estimate
    from modelsize.estimation.result import MemoryCategory

    _register()
    config: Any = model.config
    saved = config._attn_implementation
    patched = _mamba_mixers(model)
    for m in patched:
        def forward(hidden_states: Any, *args: Any, __m: Any = m, **kwargs: Any) -> Any:
            projected = __m.in_proj(hidden_states)
            width = __m.out_proj.in_features
            return __m.out_proj(projected[..., :width].contiguous())

        m.forward = forward
    per = tokens // requests
    last = torch.tensor([per * (i + 1) - 1 for i in range(requests)], dtype=torch.long)
    last[-1] = tokens - 1
    inputs = {"input_ids": torch.zeros((1, tokens), dtype=torch.long, device="meta"),
              "last": last}
    try:
        config._attn_implementation = _ATTENTION
        est: Estimate = estimate(_ProfileRun(model, sms, sampler).module(), inputs, mode="infer",
                                 device=device, name="vllm profile run")
    except (RuntimeError, TypeError, ValueError, AttributeError) as exc:
        raise EstimateError(f"tracing vLLM's profile run failed: {printable(str(exc))}") \
            from exc
    finally:
        config._attn_implementation = saved
        for m in patched:
            del m.forward
    held = (est.categories[MemoryCategory.PARAMETERS] + est.categories[MemoryCategory.BUFFERS]
            + est.categories[MemoryCategory.INPUTS])
    return est.peak_bytes - held, held
