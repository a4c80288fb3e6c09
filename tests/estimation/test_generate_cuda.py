"""The CUDA attention model of generation estimates (:mod:`modelsize.estimation.sdpa_cuda`).

No GPU here: the backend choice is checked against PyTorch's rules written out case by case
(``sdp_utils.cpp``), the split-KV heuristic against values worked by hand, and whole
estimates against the sizes of the tensors each kernel allocates.
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


@pytest.mark.parametrize(("case", "kwargs", "backend"), [
    ("bf16, no mask", {}, Backend.FLASH),
    ("head dim 80: flash pads it to 88", {"dim": 80}, Backend.FLASH),
    ("grouped KV heads with enable_gqa", {"kv_heads": 2, "gqa": True}, Backend.FLASH),
    ("grouped KV heads without enable_gqa", {"kv_heads": 2}, Backend.MATH),
    ("a mask", {"mask": True}, Backend.EFFICIENT),
    ("float32", {"dtype": torch.float32}, Backend.EFFICIENT),
    ("causal, 16 queries over 32 keys", {"causal": True, "kv_len": 32}, Backend.EFFICIENT),
    ("head dim 260: over flash's 256, no multiple of 8", {"dim": 260}, Backend.MATH),
    ("a mask and head dim 100 (not a multiple of 8)", {"dim": 100, "mask": True},
     Backend.MATH),
])
def test_backend_choice(case: str, kwargs: dict[str, Any], backend: Backend) -> None:
    mask = kwargs.pop("mask", False)
    causal = kwargs.pop("causal", False)
    gqa = kwargs.pop("gqa", False)
    q, k, v = _qkv(**kwargs)
    attn_mask = torch.ones(2, 1, q.shape[2], k.shape[2], dtype=torch.bool,
                           device="meta") if mask else None
    assert choose(q, k, v, attn_mask, 0.0, causal, gqa) is backend, case


def test_split_kv_heuristic() -> None:
    # 8 (batch x heads x query blocks) on 264 slots, 8 KV blocks: efficiencies 8s/264 for the
    # eligible splits 1, 2, 3, 4, 8 (5-7 give the same blocks per split as 4): 8 is the best
    assert num_splits(8, 8) == 8
    assert num_splits(256, 64) == 1  # 256 >= 0.8 x 264: the SMs are already full
    assert num_splits(8, 1) == 1  # one KV block: nothing to split


def _attention_peak(mask: bool, kv_len: int = 256) -> int:
    """Bytes :func:`attention` allocates at its peak beyond its inputs (batch 1, 4 heads,
    256 queries, head dim 64, bf16)."""
    from modelsize.estimation.sdpa_cuda import attention
    from modelsize.estimation.tracker import CountingFakeMode

    mode = CountingFakeMode()
    with mode:
        q = torch.empty(1, 4, 256, 64, dtype=BF16)
        k = torch.empty(1, 4, kv_len, 64, dtype=BF16)
        v = torch.empty(1, 4, kv_len, 64, dtype=BF16)
        m = torch.ones(1, 1, 256, kv_len, dtype=torch.bool) if mask else None
        base = mode.live_bytes
        out = attention(q, k, v, attn_mask=m, is_causal=not mask)
        assert tuple(out.shape) == (1, 4, 256, 64)
    return mode.peak_bytes - base


def test_kernel_allocations() -> None:
    output = 1 * 256 * 4 * 64 * 2
    # flash: the output and the float32 log-sum-exp (batch x heads x queries)
    assert _attention_peak(mask=False) == output + 1 * 4 * 256 * 4
    # efficient: the bf16 additive mask made of the boolean one, and the output
    assert _attention_peak(mask=True) == 256 * 256 * 2 + output
    # a key length of 250: the additive mask padded to 256 columns (16-element alignment)
    # replaces the unpadded one (freed) before the output is allocated
    additive, padded = 256 * 250 * 2, 256 * 256 * 2
    assert _attention_peak(mask=True, kv_len=250) == max(additive + padded, padded + output)


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
