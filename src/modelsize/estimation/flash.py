"""The scratch of the CPU flash attention kernels, from ATen's source rather than a real run.

``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward
(``aten/src/ATen/native/cpu/FlashAttentionKernel.cpp``) tile the queries into blocks of
``qSplitSize`` rows (256 from 768 queries on, 64 from 192, else 32; never more than the
queries) and the keys into blocks of ``kvSplitSize`` = min(512, keys), and give each of the
``at::get_num_threads()`` threads its own buffers, whatever the batch and the heads:

* forward: ``buf``, float (double for float64) ``qk`` block, row maxima, row sums and the
  ``qSplitSize x headSize`` output block; for bfloat16 and float16 also ``buf_reduced``, the
  ``qk`` block in the input dtype;
* backward: ``buf``, the float ``attn`` and ``grad_attn`` blocks; their reduced-precision
  twins for bfloat16 and float16; one ``dsum`` row of ``qSplitSize`` floats (allocated inside
  the parallel loop: the profiler sees the calling thread's, once there is any work); and a
  contiguous copy of ``grad_out`` unless ``grad_out.transpose(1, 2)`` is already contiguous
  (the kernel reads it as batch x queries x heads x dim).

The masks the op accepts (float, of the query's dtype, 2-d or 4-d) are read in place.
Checked against the allocator's own events, dtype by dtype, thread count by thread count, in
tests/estimation/test_flash.py. The model does not cover the packed float16 path of CPUs with
AMX-FP16 (its blocks are padded to 64): :func:`packs_half` says when the tracker must probe;
nor bfloat16 and float16 on CPUs where oneDNN runs those GEMMs (AVX512-BF16, AVX512-FP16,
AMX: ``scratch.onednn_matmul``), whose scratch pads come on top: probed there too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

_REDUCED = (torch.bfloat16, torch.float16)


def packs_half() -> bool:
    """Whether this CPU's float16 flash attention packs its blocks (AMX-FP16): not modelled."""
    supported = getattr(torch.cpu, "_is_amx_fp16_supported", None)
    return bool(supported()) if supported is not None else True


def _splits(queries: int, keys: int) -> tuple[int, int]:
    """``qSplitSize`` and ``kvSplitSize`` as the kernel picks them."""
    q_split = 256 if queries >= 768 else 64 if queries >= 192 else 32
    return min(q_split, queries), min(512, keys)


def _accum_size(dtype: torch.dtype) -> int:
    """Bytes of ``at::opmath_type``: double for float64, float for the rest."""
    return 8 if dtype == torch.float64 else 4


def _contiguous(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """``Tensor.is_contiguous()`` from a shape and strides (size-1 dimensions are free)."""
    if 0 in shape:
        return True
    expected = 1
    for n, s in zip(reversed(shape), reversed(stride), strict=True):
        if n != 1:
            if s != expected:
                return False
            expected *= n
    return True


def forward_scratch(args: Sequence[Any]) -> int:
    """Bytes the forward allocates beyond its outputs (query, key, value: B x H x L x D)."""
    q, k = args[0], args[1]
    queries, keys, head = int(q.shape[2]), int(k.shape[2]), int(q.shape[3])
    if not queries or not keys:
        return 0  # the kernel divides by the block sizes: no real run to follow
    qs, kvs = _splits(queries, keys)
    threads = torch.get_num_threads()
    total = threads * (qs * kvs + 2 * qs + qs * head) * _accum_size(q.dtype)
    if q.dtype in _REDUCED:
        total += threads * qs * kvs * q.element_size()
    return total


def backward_scratch(args: Sequence[Any]) -> int:
    """Bytes the backward allocates beyond its gradients (grad_out, query, key, value, ...)."""
    grad, q, k = args[0], args[1], args[2]
    queries, keys = int(q.shape[2]), int(k.shape[2])
    if not queries or not keys:
        return 0
    qs, kvs = _splits(queries, keys)
    threads, accum = torch.get_num_threads(), _accum_size(q.dtype)
    total = threads * 2 * qs * kvs * accum
    if q.dtype in _REDUCED:
        total += threads * 2 * qs * kvs * q.element_size()
    if q.shape[0] * q.shape[1]:
        total += qs * accum  # dsum
    shape, stride = list(grad.shape), list(grad.stride())
    shape[1], shape[2], stride[1], stride[2] = shape[2], shape[1], stride[2], stride[1]
    if not _contiguous(shape, stride):
        total += grad.numel() * grad.element_size()
    return total
