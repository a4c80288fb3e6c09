"""The memory of ``scaled_dot_product_attention`` on a CUDA GPU, for a generation traced on CPU.

A CUDA estimate traces CPU kernels (fake CUDA tensors abort a CPU-only build), and the CPU
picks its own attention kernel (``_scaled_dot_product_flash_attention_for_cpu``, whose buffers
are per thread). Under ``no_grad`` (generation), every ``F.scaled_dot_product_attention`` call
is replaced here by the allocations of the kernel PyTorch would pick on the GPU, following
``select_sdp_backend`` in ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`` (the order
flash, memory-efficient, math; an sm80+ GPU such as the H100):

* **flash** (``_scaled_dot_product_flash_attention``) when q, k and v are float16/bfloat16,
  there is no mask, their head dims are equal and at most 256, and ``is_causal`` comes with
  as many queries as keys. Grouped-query attention is native (``enable_gqa``: the keys and
  values are read, not repeated). It allocates the output (batch x queries x heads x dim, the
  input dtype, returned transposed) and the log-sum-exp (batch x heads x queries, float32,
  dropped by the Python call); head dims that are no multiple of 8 are padded (copies of q, k
  and v). For decoding (one query), FlashAttention-2's split-KV path adds float32
  accumulators of ``num_splits x batch x heads x queries x (dim rounded to 32)``, with
  ``num_splits`` from its ``num_splits_heuristic`` on 132 SMs (an H100 SXM);
* **memory-efficient** (``_scaled_dot_product_efficient_attention``) with a mask, or in float32,
  when the head dims are multiples of 8 (4 in float32): the front door first turns a boolean
  mask into an additive one of the query's dtype (``convert_boolean_attn_mask``: one
  ``where(mask, 0, -inf)``, as PyTorch 2.6+ writes it; older versions also held a boolean
  ``logical_not`` of the mask meanwhile), then pads its last dim to a multiple of 16
  (``preprocess_mask``); the kernel allocates the output, an
  empty log-sum-exp under ``no_grad``, and a float32 output accumulator when the value dim
  exceeds 128 (no single-iteration kernel);
* **math** otherwise: ``_scaled_dot_product_attention_math``, which keeps float16/bfloat16
  inputs in float32 copies (``allowFP16BF16ReductionMathSDP`` is off by default) and
  materialises the scores, traced op by op.

cuDNN attention, which PyTorch builds with cuDNN newer than 9.15 try first on sm90/sm100,
allocates the same output and statistics (its workspace is not modelled). Not modelled either:
the philox seed and offset tensors (a few bytes), kernels' internal workspaces outside
PyTorch's allocator. With gradients enabled the training path of
:mod:`modelsize.estimation.cuda_kernels` applies.
"""

from __future__ import annotations

import math
from enum import Enum
from typing import Any

import torch
import torch.nn.functional as F

from modelsize.estimation.cuda_kernels import CudaKernelChoices

_ATEN = torch.ops.aten
_HALF = (torch.float16, torch.bfloat16)
#: Streaming multiprocessors of the GPU the split-KV heuristic is run for (H100 SXM).
SMS = 132


class Backend(str, Enum):
    """The SDPA kernels of a CUDA build."""

    FLASH = "flash"
    EFFICIENT = "efficient"
    MATH = "math"

    def __str__(self) -> str:
        return self.value


def choose(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           attn_mask: torch.Tensor | None, dropout_p: float, is_causal: bool,
           enable_gqa: bool) -> Backend:
    """The backend ``select_sdp_backend`` picks for these arguments on an sm80+ GPU."""
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
    if (half and attn_mask is None and dq == dk == dv and dq <= 256
            and (not is_causal or query.shape[-2] == key.shape[-2])):
        return Backend.FLASH
    align = 8 if half else 4
    if (query.dtype in (*_HALF, torch.float32) and dq == dk and dq % align == 0
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


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``convert_boolean_attn_mask``: ``where(mask, 0, -inf)`` in the query's dtype."""
    if mask.dtype != torch.bool:
        return mask
    return torch.empty_like(mask, dtype=dtype, memory_format=torch.contiguous_format)


def _mask_for_efficient(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    mask = _additive(mask, dtype)
    last = mask.shape[-1]
    if last % 16:  # preprocess_mask: pad_bias to the kernel's 16-element alignment
        mask = F.pad(mask, (0, 16 - last % 16))[..., :last]
    return mask


def _efficient(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attn_mask: torch.Tensor | None) -> torch.Tensor:
    mask = _mask_for_efficient(attn_mask, query.dtype) if attn_mask is not None else None
    b, hq, lq, _ = query.shape
    dv = value.shape[-1]
    out = torch.empty((b, lq, hq, dv), dtype=query.dtype)
    if dv > 128 and query.dtype != torch.float32:
        accum = torch.empty((b, lq, hq, dv), dtype=torch.float32)
        del accum
    del mask
    return out.transpose(1, 2)


def _math(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
          attn_mask: torch.Tensor | None, dropout_p: float, is_causal: bool,
          scale: float | None, enable_gqa: bool) -> torch.Tensor:
    if attn_mask is not None:
        attn_mask = _additive(attn_mask, query.dtype)
    out = _ATEN._scaled_dot_product_attention_math(
        query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale,
        enable_gqa=enable_gqa)
    return out[0]


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
              is_causal: bool = False, scale: float | None = None,
              enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with the allocations of the CUDA kernel it picks."""
    backend = choose(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    if backend is Backend.FLASH:
        return _flash(query, key, value, dropout_p)
    if backend is Backend.EFFICIENT:
        return _efficient(query, key, value, attn_mask)
    return _math(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


class GenerationKernels(CudaKernelChoices):
    """:class:`CudaKernelChoices`, with attention under ``no_grad`` as :func:`attention`."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if func is F.scaled_dot_product_attention and not torch.is_grad_enabled():
            return attention(*args, **(kwargs or {}))
        return super().__torch_function__(func, types, args, kwargs)
