"""The CUDA attention model of generation estimates (:mod:`modelsize.estimation.sdpa_cuda`).

No GPU here: the backend choice is checked against PyTorch's rules written out case by case
(``sdp_utils.cpp``: cuDNN first on sm90 with cuDNN 9.15+, as on the H100 of
benchmarks/gpu_generate.py), the split-KV heuristic against values worked by hand, and the
allocations of each kernel against the sizes the caching allocator recorded for them on an
H100 (PyTorch 2.11, cuDNN 9.19; benchmarks/gpu_diagnose.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from modelsize.estimation import MemoryCategory, estimate
from modelsize.estimation.sdpa_cuda import Backend, choose, num_splits
from tests.estimation import generators as gen

BF16 = torch.bfloat16


def _qkv(dim: int = 64, dtype: torch.dtype = BF16, q_len: int = 16, kv_len: int = 16,
         heads: int = 8, kv_heads: int = 8) -> tuple[torch.Tensor, ...]:
    meta = torch.device("meta")
    return (torch.empty(2, heads, q_len, dim, dtype=dtype, device=meta),
            torch.empty(2, kv_heads, kv_len, dim, dtype=dtype, device=meta),
            torch.empty(2, kv_heads, kv_len, dim, dtype=dtype, device=meta))


_CASES = [
    # (case, kwargs, backend on an H100 with cuDNN 9.19, backend where cuDNN is not preferred)
    ("bf16, no mask", {}, Backend.CUDNN, Backend.FLASH),
    ("head dim 80: cuDNN takes multiples of 8, flash pads to 88", {"dim": 80},
     Backend.CUDNN, Backend.FLASH),
    ("head dim 84: no multiple of 8, flash pads it", {"dim": 84}, Backend.FLASH, Backend.FLASH),
    ("grouped KV heads with enable_gqa", {"kv_heads": 2, "gqa": True},
     Backend.CUDNN, Backend.FLASH),
    ("grouped KV heads without enable_gqa", {"kv_heads": 2}, Backend.MATH, Backend.MATH),
    ("grouped KV heads, a mask: no native GQA in the efficient kernel",
     {"kv_heads": 2, "gqa": True, "mask": True}, Backend.CUDNN, Backend.MATH),
    ("a mask", {"mask": True}, Backend.CUDNN, Backend.EFFICIENT),
    ("float32", {"dtype": torch.float32}, Backend.EFFICIENT, Backend.EFFICIENT),
    ("causal, 16 queries over 32 keys", {"causal": True, "kv_len": 32},
     Backend.CUDNN, Backend.EFFICIENT),
    ("one key: not cuDNN", {"kv_len": 1}, Backend.FLASH, Backend.FLASH),
    ("head dim 260: over 256, no multiple of 8", {"dim": 260}, Backend.MATH, Backend.MATH),
    ("a mask and head dim 100 (not a multiple of 8)", {"dim": 100, "mask": True},
     Backend.MATH, Backend.MATH),
]


@pytest.mark.parametrize(("case", "kwargs", "sm90", "other"), _CASES)
def test_backend_choice(case: str, kwargs: dict[str, Any], sm90: Backend,
                        other: Backend) -> None:
    mask = kwargs.pop("mask", False)
    causal = kwargs.pop("causal", False)
    gqa = kwargs.pop("gqa", False)
    q, k, v = _qkv(**kwargs)
    attn_mask = torch.ones(2, 1, q.shape[2], k.shape[2], dtype=torch.bool,
                           device="meta") if mask else None
    assert choose(q, k, v, attn_mask, 0.0, causal, gqa) is sm90, case
    assert choose(q, k, v, attn_mask, 0.0, causal, gqa, cudnn_first=False) is other, case


def test_split_kv_heuristic() -> None:
    # 8 (batch x heads x query blocks) on 264 slots, 8 KV blocks: efficiencies 8s/264 for the
    # eligible splits 1, 2, 3, 4, 8 (5-7 give the same blocks per split as 4): 8 is the best
    assert num_splits(8, 8) == 8
    assert num_splits(256, 64) == 1  # 256 >= 0.8 x 264: the SMs are already full
    assert num_splits(8, 1) == 1  # one KV block: nothing to split


def _attention_peak(mask: bool, kv_len: int = 256, dtype: torch.dtype = BF16,
                    queries: int = 256) -> int:
    """Bytes :func:`attention` allocates at its peak beyond its inputs (batch 1, 4 heads,
    head dim 64), with the CUDA kernels' workspaces."""
    from modelsize.estimation import scratch
    from modelsize.estimation.sdpa_cuda import attention
    from modelsize.estimation.tracker import CountingFakeMode

    mode = CountingFakeMode(scratch=scratch.table("cuda"))
    with mode:
        q = torch.empty(1, 4, queries, 64, dtype=dtype)
        k = torch.empty(1, 4, kv_len, 64, dtype=dtype)
        v = torch.empty(1, 4, kv_len, 64, dtype=dtype)
        m = torch.ones(1, 1, queries, kv_len, dtype=torch.bool) if mask else None
        base = mode.live_bytes
        out = attention(q, k, v, attn_mask=m, is_causal=not mask and queries == kv_len)
        assert tuple(out.shape) == (1, 4, queries, 64)
    return mode.peak_bytes - base


def test_kernel_allocations() -> None:
    output = 1 * 256 * 4 * 64 * 2
    seeds = 2 * 8  # cuDNN's philox seed and offset, int64 each
    # cuDNN, causal: the output, the seeds and the 256-byte workspace; no log-sum-exp without
    # a gradient (measured on an H100: 8, 8, the output, 256)
    assert _attention_peak(mask=False) == seeds + output + 256
    # a boolean mask: the bf16 additive mask, made from two 0-dim bf16 tensors, then the same
    additive = 256 * 256 * 2
    assert _attention_peak(mask=True) == additive + seeds + output + 256
    # one query over 2048 keys (a decode step): cuDNN splits the keys (16 blocks of 128),
    # batch x heads x splits x (4 x dim + 8) + 128 bytes of workspace
    decode = 1 * 1 * 4 * 64 * 2
    assert _attention_peak(mask=False, kv_len=2048, queries=1) == (
        seeds + decode + 1 * 4 * 16 * (4 * 64 + 8) + 128)
    # float32 takes the efficient kernel: at 250 keys the fp32 additive mask, which the front
    # door holds through the call, and its copy padded to 256 columns (16-element alignment)
    fp32_additive, padded, fp32_out = 256 * 250 * 4, 256 * 256 * 4, output * 2
    assert _attention_peak(mask=True, kv_len=250, dtype=torch.float32) == (
        fp32_additive + padded + fp32_out)


def test_flash_keeps_no_score_matrix() -> None:
    model, _ = gen.llama()
    model = model.to(BF16)
    inputs = gen.tokens(batch=1, prompt=256)
    scores = 1 * 4 * 256 * 256 * 4  # batch x heads x queries x keys, float32
    cuda = estimate(model, inputs, mode="generate", new_tokens=2, device="cuda")
    assert cuda.generation is not None
    assert cuda.categories[MemoryCategory.TEMPORARIES] < scores


def test_offloaded_cache_keeps_one_layer_on_the_gpu() -> None:
    import transformers as tf

    layers, batch, prompt, new = 6, 2, 40, 3
    config = tf.LlamaConfig(**{**gen.BASE, "num_hidden_layers": layers})
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(config).to(BF16)
    inputs = gen.tokens(batch=batch, prompt=prompt)
    est = estimate(model, inputs, mode="generate", new_tokens=new, device="cuda",
                   generation={"cache_implementation": "offloaded"})
    info = est.generation
    assert info is not None
    # one layer's keys and values (2 KV heads x head dim 16, bf16) for the tokens held
    layer = batch * 2 * 2 * 16 * 2 * (prompt + new - 1)
    assert info.final_cache_bytes == layer  # layer 0, prefetched for the next step
    assert info.host_cache_bytes == (layers - 1) * layer
    assert est.categories[MemoryCategory.KV_CACHE] <= 2 * batch * 2 * 2 * 16 * 2 * prompt
    dynamic = estimate(model, inputs, mode="generate", new_tokens=new, device="cuda")
    assert dynamic.generation is not None and dynamic.generation.host_cache_bytes == 0
    assert est.peak_bytes < dynamic.peak_bytes
