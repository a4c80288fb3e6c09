"""The memory of ``scaled_dot_product_attention`` on a CUDA GPU, for a trace that runs on CPU.

A CUDA estimate traces CPU kernels (fake CUDA tensors abort a CPU-only PyTorch build), and the
CPU picks its own attention kernel (``_scaled_dot_product_flash_attention_for_cpu``, whose
buffers are per thread). Every ``F.scaled_dot_product_attention`` call is replaced here by the
allocations of the kernel PyTorch 2.11 picks on an H100 (sm90), following ``sdpa`` in
``aten/src/ATen/native/transformers/attention.cpp`` and ``select_sdp_backend`` in
``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``:

* the front door turns a boolean mask into an additive one of the query's dtype
  (``convert_boolean_attn_mask``: ``where(mask, scalar_tensor(0), scalar_tensor(-inf))``, so
  two 0-dim tensors of the query's dtype live while the mask is made), for every backend;
* **cuDNN** (``_scaled_dot_product_cudnn_attention``) comes first on sm90/sm100 with cuDNN
  newer than 9.15 (``check_prefer_cudnn_attention``), for float16/bfloat16 q, k and v, head
  dims that are multiples of 8 and at most 256, more than one key, grouped heads allowed, and
  any mask (read as given: no copy, no padding). It allocates the philox seed and offset (8
  bytes each), the output, the float32 log-sum-exp only when a gradient is needed, and a
  workspace for the call (:func:`modelsize.estimation.cuda_kernels.cudnn_workspace`);
* **flash** (``_scaled_dot_product_flash_attention``) when q, k and v are float16/bfloat16,
  there is no mask, their head dims are equal and at most 256, and ``is_causal`` comes with
  as many queries as keys. Grouped-query attention is native. It allocates the output and
  the log-sum-exp (batch x heads x queries, float32); head dims that are no multiple of 8 are
  padded (copies of q, k and v). For decoding (one query), FlashAttention-2's split-KV path
  adds float32 accumulators of ``num_splits x batch x heads x queries x (dim rounded to
  32)``, with ``num_splits`` from its ``num_splits_heuristic`` on 132 SMs;
* **memory-efficient** (``_scaled_dot_product_efficient_attention``) with a mask, or in
  float32, when the head dims are multiples of 8 (4 in float32) and the heads are not
  grouped (no native GQA: grouped heads take the math path): it pads the additive mask's
  last dim to a multiple of 16 (``preprocess_mask``) and allocates the output, the
  log-sum-exp (empty unless a gradient is needed), and a float32 output accumulator when the
  value dim exceeds 128;
* **math** otherwise: ``_scaled_dot_product_attention_math``, traced op by op.

Under the CUDA autocast policy (:mod:`modelsize.estimation.cuda_autocast`)
``scaled_dot_product_attention`` casts its floating-point arguments to the autocast dtype
first. Not modelled: kernels' internal workspaces outside PyTorch's allocator.
"""

from __future__ import annotations

import math
from enum import Enum

import torch
import torch.nn.functional as F

_ATEN = torch.ops.aten
_HALF = (torch.float16, torch.bfloat16)
#: Streaming multiprocessors of the GPU the split-KV heuristic is run for (H100 SXM).
SMS = 132


class Backend(str, Enum):
    """The SDPA kernels of a CUDA build."""

    CUDNN = "cudnn"
    FLASH = "flash"
    EFFICIENT = "efficient"
    MATH = "math"

    def __str__(self) -> str:
        return self.value


def choose(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           attn_mask: torch.Tensor | None, dropout_p: float, is_causal: bool,
           enable_gqa: bool, cudnn_first: bool = True) -> Backend:
    """The backend ``select_sdp_backend`` picks for these arguments on an sm90 GPU
    (``cudnn_first=False``: the order of GPUs and builds that do not prefer cuDNN)."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return Backend.MATH
    dq, dk, dv = query.shape[-1], key.shape[-1], value.shape[-1]
    hq, hk = query.shape[1], key.shape[1]
    if hq != hk and not (enable_gqa and hk and hq % hk == 0):
        return Backend.MATH
    if query.dtype != key.dtype or query.dtype != value.dtype:
        return Backend.MATH
    if 0 in (query.shape[-2], key.shape[-2]):
        return Backend.MATH
    half = query.dtype in _HALF
    if (cudnn_first and half and dq == dk and dq % 8 == 0 and dv % 8 == 0 and dq <= 256
            and dv <= 256 and key.shape[-2] != 1
            and not (query.shape[-2] == 1 and dropout_p > 0.0)):
        return Backend.CUDNN
    if (half and attn_mask is None and dq == dk == dv and dq <= 256
            and (not is_causal or query.shape[-2] == key.shape[-2])):
        return Backend.FLASH
    align = 8 if half else 4
    if (query.dtype in (*_HALF, torch.float32) and hq == hk and dq == dk and dq % align == 0
            and dv % align == 0):
        return Backend.EFFICIENT
    return Backend.MATH


def num_splits(batch_heads_mblocks: int, n_blocks: int, sms: int = 2 * SMS,
               max_splits: int = 128) -> int:
    """FlashAttention-2's ``num_splits_heuristic``: how many KV splits a decode step uses."""
    if batch_heads_mblocks >= 0.8 * sms:
        return 1
    max_splits = min(max_splits, sms, n_blocks)
    if max_splits < 1:
        return 1

    def eligible(s: int) -> bool:
        return s == 1 or -(-n_blocks // s) != -(-n_blocks // (s - 1))

    efficiency = []
    for s in range(1, max_splits + 1):
        if not eligible(s):
            efficiency.append(0.0)
            continue
        waves = batch_heads_mblocks * s / sms
        efficiency.append(waves / math.ceil(waves))
    best = max(efficiency)
    for s in range(1, max_splits + 1):
        if eligible(s) and efficiency[s - 1] >= 0.85 * best:
            return s
    return 1


def _flash(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           dropout_p: float) -> torch.Tensor:
    b, hq, lq, d = query.shape
    hk, lk = key.shape[1], key.shape[-2]
    padded = -(-d // 8) * 8
    copies = []
    if padded != d:  # the kernel takes head dims in multiples of 8: padded copies
        copies = [F.pad(t, (0, padded - d)) for t in (query, key, value)]
    out = torch.empty((b, lq, hq, padded), dtype=query.dtype)
    lse = torch.empty((b, hq, lq), dtype=torch.float32)
    heads, queries = hq, lq
    if lq == 1 and hq > hk and dropout_p == 0.0 and d % 8 == 0:
        heads, queries = hk, hq // hk  # seqlenq_ngroups_swapped
    if dropout_p == 0.0:
        block_n = 256 if padded <= 64 else 128 if padded <= 128 else 64
        splits = num_splits(b * heads * -(-queries // 64), -(-lk // block_n))
        if splits > 1:
            rounded = -(-padded // 32) * 32 if padded <= 128 else -(-padded // 64) * 64
            lse_accum = torch.empty((splits, b, heads, queries), dtype=torch.float32)
            out_accum = torch.empty((splits, b, heads, queries, rounded), dtype=torch.float32)
            del lse_accum, out_accum
    del lse, copies
    return out[..., :d].transpose(1, 2)


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``convert_boolean_attn_mask``: ``where(mask, 0, -inf)`` in the query's dtype, made from
    two 0-dim tensors of that dtype (a float mask is used as it is)."""
    if mask.dtype != torch.bool:
        return mask
    zero = torch.empty((), dtype=dtype)
    minus_inf = torch.empty((), dtype=dtype)
    out = torch.empty_like(mask, dtype=dtype, memory_format=torch.contiguous_format)
    del zero, minus_inf
    return out


def _efficient(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attn_mask: torch.Tensor | None) -> torch.Tensor:
    mask = attn_mask
    if mask is not None and mask.shape[-1] % 16:  # preprocess_mask: 16-element alignment
        last = mask.shape[-1]
        mask = F.pad(mask, (0, 16 - last % 16))[..., :last]
    b, hq, lq, _ = query.shape
    dv = value.shape[-1]
    out = torch.empty((b, lq, hq, dv), dtype=query.dtype)
    if dv > 128 and query.dtype != torch.float32:
        accum = torch.empty((b, lq, hq, dv), dtype=torch.float32)
        del accum
    del mask
    return out.transpose(1, 2)


def _autocast(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """Autocast's ``lower_precision_fp`` casts of ``scaled_dot_product_attention``'s
    arguments, when the (emulated) autocast of the trace is on."""
    if not torch.is_autocast_enabled("cpu"):
        return list(tensors)
    dtype = torch.get_autocast_dtype("cpu")
    return [t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != dtype
            and t.dtype != torch.float64 else t for t in tensors]


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
              is_causal: bool = False, scale: float | None = None,
              enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with the allocations of the CUDA kernel it picks."""
    query, key, value, attn_mask = _autocast(query, key, value, attn_mask)  # type: ignore[assignment]
    assert query is not None and key is not None and value is not None
    if attn_mask is not None:
        attn_mask = additive(attn_mask, query.dtype)
    backend = choose(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if backend is Backend.CUDNN:
        return _ATEN._scaled_dot_product_cudnn_attention(
            query, key, value, attn_mask, grad, dropout_p, is_causal, False, scale=scale)[0]
    if backend is Backend.FLASH:
        if grad:
            return _ATEN._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, False, scale=scale)[0]
        return _flash(query, key, value, dropout_p)
    if backend is Backend.EFFICIENT:
        if grad:
            return _ATEN._scaled_dot_product_efficient_attention(
                query, key, value, attn_mask, True, dropout_p, is_causal, scale=scale)[0]
        return _efficient(query, key, value, attn_mask)
    out = _ATEN._scaled_dot_product_attention_math(
        query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale,
        enable_gqa=enable_gqa)
    return out[0]
