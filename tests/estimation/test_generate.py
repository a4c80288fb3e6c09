"""``mode="generate"``: the traced ``generate()`` equals the real one, family by family.

Measured side: :func:`tests.estimation.generators.measure` runs ``generate()`` for real under
the CPU allocator's profiler. Bytes per token are checked against formulas written from each
family's config (K and V per KV head and head dim, windows, latent ranks, Mamba states).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from modelsize.errors import UsageError
from modelsize.estimation import CacheKind, MemoryCategory, estimate
from tests.estimation import generators as gen
from tests.estimation.generators import FAMILIES, measure

NEW = 4
F32 = 4


def _estimate(model: Any, inputs: Any, **generation: Any) -> Any:
    return estimate(model, inputs, mode="generate", new_tokens=NEW, generation=generation)


@functools.cache
def _default(family: str) -> tuple[Any, Any, Any]:
    """The family's model, inputs and default-cache estimate (traced once per session)."""
    model, inputs = FAMILIES[family]()
    return model, inputs, _estimate(model, inputs)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_dynamic_cache_equals_the_real_generate(family: str) -> None:
    model, inputs, est = _default(family)
    assert est.peak_bytes == measure(model, inputs, NEW)
    assert sum(est.categories.values()) == est.peak_bytes
    assert est.generation is not None and est.generation.cache_class


STATIC = ["llama", "mistral", "gpt2", "gemma3", "gpt_oss", "deepseek_v3", "mamba", "jamba",
          "qwen3_next", "t5", "bart", "whisper"]


@pytest.mark.parametrize("family", STATIC)
def test_static_cache_equals_the_real_generate(family: str) -> None:
    model, inputs = FAMILIES[family]()
    est = _estimate(model, inputs, cache_implementation="static")
    assert est.peak_bytes == measure(model, inputs, NEW, cache_implementation="static")


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3_moe", "falcon"])
def test_left_padding_equals_the_real_generate(family: str) -> None:
    model, _ = FAMILIES[family]()
    inputs = gen.tokens(left_pad=5)
    for cache in ({}, {"cache_implementation": "static"}):
        est = _estimate(model, inputs, **cache)
        assert est.peak_bytes == measure(model, inputs, NEW, **cache)


@pytest.mark.parametrize("family", ["llama", "mistral", "t5", "deepseek_v2"])
def test_beam_search_equals_the_real_generate(family: str) -> None:
    model, inputs = FAMILIES[family]()
    est = _estimate(model, inputs, num_beams=3)
    assert est.peak_bytes == measure(model, inputs, NEW, num_beams=3)
    assert est.generation is not None and est.generation.rows == 3 * gen.BATCH


def test_chunked_prefill_and_fp8_cache_equal_the_real_generate() -> None:
    model, inputs = gen.llama()
    for options in ({"prefill_chunk_size": 5},
                    {"prefill_chunk_size": 5, "cache_implementation": "static"},
                    {"cache_implementation": "quantized", "cache_config": {"backend": "fp8"}}):
        est = _estimate(model, inputs, **options)
        assert est.peak_bytes == measure(model, inputs, NEW, **options), options
    chunked = _estimate(model, inputs, prefill_chunk_size=5)
    assert chunked.generation is not None and chunked.generation.prefill_chunks == 3


def test_longer_generation_peaks_in_a_decode_step() -> None:
    model, _ = gen.llama()
    inputs = gen.tokens(batch=1, prompt=2)
    est = estimate(model, inputs, mode="generate", new_tokens=40)
    assert est.peak_bytes == measure(model, inputs, 40)
    assert est.phase.name == "decode" and 1 <= est.phase.step <= 39


# -- bytes per token, from each family's config ------------------------------------------------


def _kv(layers: int, kv_heads: int, head_dim: int) -> int:
    return 2 * layers * kv_heads * head_dim * F32


def _mamba(layers: int, inner: int, conv: int, state: int) -> int:
    return layers * (inner * conv + inner * state) * F32


def _expected(family: str) -> dict[CacheKind, tuple[int, int, int]]:
    """``kind -> (layers, bytes per token, bytes per sequence)`` written from the configs of
    :mod:`tests.estimation.generators`."""
    full, sliding, rec = CacheKind.FULL_ATTENTION, CacheKind.SLIDING_WINDOW, CacheKind.RECURRENT
    cross = CacheKind.CROSS_ATTENTION
    head = 64 // 4
    table: dict[str, dict[CacheKind, tuple[int, int, int]]] = {
        "llama": {full: (2, _kv(2, 2, head), 0)}, "qwen2": {full: (2, _kv(2, 2, head), 0)},
        "qwen3": {full: (2, _kv(2, 2, 16), 0)}, "mixtral": {full: (2, _kv(2, 2, head), 0)},
        "qwen3_moe": {full: (2, _kv(2, 2, head), 0)},
        "mistral": {sliding: (2, _kv(2, 2, head), 0)},
        "gpt2": {full: (2, _kv(2, 4, head), 0)},  # multi-head: 4 KV heads
        "falcon": {full: (2, _kv(2, 1, head), 0)},  # multi-query: 1 KV head
        "gemma2": {full: (1, _kv(1, 2, 16), 0), sliding: (1, _kv(1, 2, 16), 0)},
        "gemma3": {full: (1, _kv(1, 2, 16), 0), sliding: (2, _kv(2, 2, 16), 0)},
        "gpt_oss": {full: (1, _kv(1, 2, 16), 0), sliding: (1, _kv(1, 2, 16), 0)},
        # latent: kv_lora_rank 32 + qk_rope_head_dim 8 per layer, not K and V per head
        "deepseek_v2": {CacheKind.LATENT: (2, 2 * (32 + 8) * F32, 0)},
        "deepseek_v3": {CacheKind.LATENT: (2, 2 * (32 + 8) * F32, 0)},
        # conv (inner x kernel 4) + SSM (inner x state 8), inner = expand 2 x hidden 64
        "mamba": {rec: (2, 0, _mamba(2, 128, 4, 8))},
        "jamba": {full: (1, _kv(1, 2, head), 0), rec: (1, 0, _mamba(1, 128, 4, 8))},
        # Gated DeltaNet: conv over 2 x key dim (2 x 16) + value dim (4 x 16), kernel 4;
        # recurrent 4 value heads x 16 x 16
        "qwen3_next": {full: (1, _kv(1, 2, 16), 0),
                       rec: (3, 0, 3 * ((2 * 32 + 64) * 4 + 4 * 16 * 16) * F32)},
        "t5": {full: (2, _kv(2, 4, 16), 0), cross: (2, _kv(2, 4, 16), 0)},
        "bart": {full: (2, _kv(2, 4, head), 0), cross: (2, _kv(2, 4, head), 0)},
        "whisper": {full: (2, _kv(2, 4, head), 0), cross: (2, _kv(2, 4, head), 0)},
    }
    return table[family]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bytes_per_token_by_layer_kind(family: str) -> None:
    est = _default(family)[2]
    assert est.generation is not None
    got = {g.kind: (g.layers, g.bytes_per_token, g.bytes_per_sequence)
           for g in est.generation.groups}
    assert got == _expected(family)


def test_windows_cap_the_tokens_held() -> None:
    est = _default("gemma3")[2]
    assert est.generation is not None
    groups = {g.kind: g for g in est.generation.groups}
    held = gen.PROMPT + NEW - 1  # the last new token is never fed back
    assert groups[CacheKind.FULL_ATTENTION].tokens == held
    assert groups[CacheKind.FULL_ATTENTION].capacity is None
    assert groups[CacheKind.SLIDING_WINDOW].capacity == 8
    assert groups[CacheKind.SLIDING_WINDOW].tokens == 8  # window - 1 kept + the newest token
    latent = _default("deepseek_v3")[2].generation
    assert latent is not None and latent.groups[0].latent_bytes_per_token == 2 * 40 * F32


def test_final_cache_and_kv_category() -> None:
    model, _, est = _default("llama")
    info = est.generation
    assert info is not None
    per_row_token = _kv(2, 2, 16)
    assert info.final_cache_bytes == gen.BATCH * per_row_token * (gen.PROMPT + NEW - 1)
    assert info.prefill_cache_bytes == gen.BATCH * per_row_token * gen.PROMPT
    assert info.bytes_per_token == per_row_token
    # the peak is in the prefill, after its last layer stored the prompt's keys and values
    assert est.phase.name == "prefill"
    assert est.categories[MemoryCategory.KV_CACHE] == info.prefill_cache_bytes
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert est.categories[MemoryCategory.PARAMETERS] == params


# -- values the trace cannot know --------------------------------------------------------------


def test_moe_routing_exact_with_grouped_experts_and_bounded_in_an_eager_loop() -> None:
    model, inputs = gen.mixtral()
    grouped = _estimate(model, inputs)
    assert grouped.generation is not None and "exact" in grouped.generation.routing
    model.set_experts_implementation("eager")
    try:
        eager = _estimate(model, inputs)
        real = measure(model, inputs, NEW)
    finally:
        model.set_experts_implementation("grouped_mm")
    assert eager.generation is not None
    assert "upper bound" in eager.generation.routing and "experts" in eager.generation.routing
    assert real <= eager.peak_bytes <= real * 1.05


def test_token_values_are_named() -> None:
    est = _default("llama")[2]
    assert est.generation is not None
    # id 3: the smallest id that is no pad (0), start (1) or end (2) id
    assert "takes id 3" in est.generation.token_values


def test_meta_inputs_and_a_meta_model() -> None:
    import transformers as tf

    with torch.device("meta"):
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**gen.BASE))
    ids = torch.empty(2, 12, dtype=torch.long, device="meta")
    est = estimate(model, {"input_ids": ids}, mode="generate", new_tokens=NEW)
    real_model, inputs = gen.llama()
    inputs = {"input_ids": inputs["input_ids"]}
    assert est.peak_bytes == estimate(real_model, inputs, mode="generate",
                                      new_tokens=NEW).peak_bytes


def test_the_model_is_left_as_found() -> None:
    model, inputs = gen.llama()
    params = [(n, p) for n, p in model.named_parameters()]
    model.train()
    before = dict(vars(model))
    est = _estimate(model, inputs, cache_implementation="static")
    assert est.peak_bytes > 0
    assert model.training and all(m.training for m in model.modules())
    assert "_previous_max_cache_length" not in vars(model)
    assert dict(vars(model)).keys() == before.keys()
    assert [(n, p) for n, p in model.named_parameters()] == params
    assert not any(isinstance(p, torch._subclasses.fake_tensor.FakeTensor)
                   for p in model.parameters())


def test_verify_runs_the_real_generate() -> None:
    model, inputs = gen.qwen2()
    est = estimate(model, inputs, mode="generate", new_tokens=NEW, verify=True)
    v = est.verification
    assert v is not None and v.measured_bytes == v.estimated_bytes == est.peak_bytes


def test_cuda_estimate_of_a_generation() -> None:
    model, inputs = gen.llama()
    est = estimate(model.to(torch.bfloat16), inputs, mode="generate", new_tokens=NEW,
                   device="cuda")
    names = {t.name for t in est.device_estimate.terms}
    assert {"cublas_workspace", "cuda_context", "allocator_rounding"} <= names
    assert est.setup.device == "cuda" and est.generation is not None


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"mode": "generate"}, "needs new_tokens"),
    ({"mode": "infer", "new_tokens": 3}, "for mode='generate'"),
    ({"mode": "generate", "new_tokens": 3, "optimizer": "sgd"}, "optimizer"),
    ({"mode": "generate", "new_tokens": 3, "generation": {"max_new_tokens": 9}},
     "must not set max_new_tokens"),
    ({"mode": "generate", "new_tokens": 0}, "positive"),
    ({"mode": "generate", "new_tokens": 3, "generation": {"cache_implementation": "offloaded"}},
     "device='cuda'"),
])
def test_usage_errors(kwargs: dict[str, Any], words: str) -> None:
    model, inputs = gen.llama()
    with pytest.raises(UsageError, match=words):
        estimate(model, inputs, **kwargs)


def test_a_model_without_generate_is_refused() -> None:
    with pytest.raises(UsageError, match="no generate"):
        estimate(torch.nn.Linear(4, 4), {"input_ids": torch.zeros(1, 4, dtype=torch.long)},
                 mode="generate", new_tokens=2)


def test_prompts_larger_than_the_value_limit_keep_their_values() -> None:
    # 32 x 70,000 ids are 17.9 MB of int64, over the 16 MiB a twin may take by default:
    # generate() still reads the mask (right padding check) and the ids (stopping criteria)
    import transformers as tf

    config = tf.LlamaConfig(**{**gen.BASE, "num_hidden_layers": 1,
                               "max_position_embeddings": 100_000})
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(config)
    ids = torch.full((32, 70_000), 3, dtype=torch.long)
    est = estimate(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                   mode="generate", new_tokens=2)
    assert est.generation is not None and est.generation.prompt_tokens == 70_000
    assert est.categories[MemoryCategory.KV_CACHE] >= 32 * 70_000 * _kv(1, 2, 16)
