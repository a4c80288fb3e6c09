"""``--engine vllm``: vLLM 0.33.0's start-up plan against hand computations of its formulas.

Each expected number is worked out here from vLLM's rules as written in its source
(``v1/kv_cache_interface.py`` page sizes and ``max_memory_usage_bytes``,
``v1/core/kv_cache_planning.py`` grouping, ``v1/core/kv_cache_utils.py`` capacity,
``platforms/interface.py`` hybrid block size, ``mamba_utils.py`` state shapes), for
published configurations (Llama 3 8B, Gemma 3 1B, DeepSeek-V3, Jamba 1.5 Mini), without
calling the code under test for any intermediate value.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from modelsize.cli import main
from modelsize.estimation import engine_vllm as ev

tf = pytest.importorskip("transformers")
GIB = 2**30


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def settings(**kw: Any) -> ev.VllmSettings:
    return ev.VllmSettings(ev.Gpu("H100", 80 * GIB), **kw)


def tokens_and_concurrency(blocks: int, per_request: int, max_model_len: int
                           ) -> tuple[int, float]:
    """``get_kv_cache_capacity``: int(num_blocks / blocks per request x max_model_len)."""
    concurrency = blocks / per_request
    return int(concurrency * max_model_len), concurrency


def test_llama_3_8b_gqa() -> None:
    config = tf.LlamaConfig(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                            num_key_value_heads=8, max_position_embeddings=8192)
    specs = ev.layer_specs(config, "bfloat16", settings())
    available = 60 * GIB + 12345
    got = ev.plan_kv(specs, available, 8192, 8192)
    page = 16 * 8 * (128 + 128) * 2  # block x kv heads x (K + V head dims) x bf16
    per_block = 32 * page  # one group of all 32 layers
    blocks = available // per_block
    per_request = cdiv(8192, 16)
    tokens, conc = tokens_and_concurrency(blocks, per_request, 8192)
    assert (got["bytes_per_block"], got["num_gpu_blocks"]) == (per_block, blocks) == (
        2 * 2**20, 30720)
    assert got["blocks_per_request"] == per_request
    assert got["kv_cache_tokens"] == tokens == 491520 and got["max_concurrency"] == conc
    # fp8 KV cache: one byte per element, twice the blocks
    fp8 = ev.plan_kv(ev.layer_specs(config, "bfloat16", settings(kv_cache_dtype="fp8")),
                     available, 8192, 8192)
    assert fp8["bytes_per_block"] == per_block // 2
    assert fp8["num_gpu_blocks"] == available // (per_block // 2)


def test_gemma_3_1b_sliding_and_full_layers() -> None:
    """26 layers, every 6th full attention (4 layers), 22 sliding (window 512); one KV head
    of 256. Groups of the smallest type's count (4): 1 full group and cdiv(22, 4) = 6
    sliding groups; a block is 4 layers' pages; a sliding layer holds at most
    window - 1 + 2 x max_num_batched_tokens tokens, plus one block."""
    config = tf.Gemma3TextConfig(num_hidden_layers=26, hidden_size=1152, num_attention_heads=4,
                                 num_key_value_heads=1, head_dim=256, sliding_window=512,
                                 max_position_embeddings=32768)
    types = config.layer_types
    assert types.count("full_attention") == 4 and types.count("sliding_attention") == 22
    specs = ev.layer_specs(config, "bfloat16", settings())
    mml, batched, available = 32768, 8192, 20 * GIB
    got = ev.plan_kv(specs, available, mml, batched)
    page = 16 * 1 * (256 + 256) * 2
    per_block = 4 * page
    sliding_blocks = cdiv(min(512 - 1 + 2 * batched, mml), 16) + 1
    per_request = cdiv(mml, 16) + 6 * sliding_blocks
    assert sliding_blocks == 1057 and per_request == 8390
    assert len(got["groups"]) == 7
    assert sorted(len(g.layers) for g in got["groups"]) == [3, 3, 4, 4, 4, 4, 4]
    assert got["bytes_per_block"] == per_block
    assert got["blocks_per_request"] == per_request
    blocks = available // per_block
    tokens, conc = tokens_and_concurrency(blocks, per_request, mml)
    assert (got["num_gpu_blocks"], got["kv_cache_tokens"]) == (blocks, tokens)
    assert got["max_concurrency"] == conc
    # a short max_model_len: the window is capped by it
    short = ev.plan_kv(specs, available, 2048, batched)
    assert short["blocks_per_request"] == cdiv(2048, 16) + 6 * (cdiv(2048, 16) + 1)


def test_deepseek_v3_mla_latent_pages() -> None:
    config = tf.DeepseekV3Config()  # 61 layers, kv_lora_rank 512, qk_rope_head_dim 64
    assert (config.num_hidden_layers, config.kv_lora_rank, config.qk_rope_head_dim) == (
        61, 512, 64)
    specs = ev.layer_specs(config, "bfloat16", settings())
    page = 16 * 1 * (512 + 64) * 2  # MLA: one latent row per token, no separate V
    available = 30 * GIB
    got = ev.plan_kv(specs, available, 163840, 8192)
    assert got["bytes_per_block"] == 61 * page
    blocks = available // (61 * page)
    tokens, conc = tokens_and_concurrency(blocks, cdiv(163840, 16), 163840)
    assert (got["num_gpu_blocks"], got["kv_cache_tokens"]) == (blocks, tokens)
    assert got["max_concurrency"] == conc
    fp8 = ev.layer_specs(config, "bfloat16", settings(kv_cache_dtype="fp8"))
    assert fp8[0].page == 16 * 576


def test_jamba_mamba_hybrid_block_size_and_state_padding() -> None:
    """Jamba 1.5 Mini's shape: 32 layers, attention every 8th (offset 4), 8 KV heads of 128;
    Mamba-1 layers of 2 x 4096 channels, d_state 16, d_conv 4. The attention block grows to
    the smallest multiple of 16 tokens whose page covers a Mamba state; the state is padded
    to that page; groups of 4 layers (the attention count)."""
    config = tf.JambaConfig(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                            num_key_value_heads=8, attn_layer_period=8, attn_layer_offset=4,
                            mamba_expand=2, mamba_d_state=16, mamba_d_conv=4,
                            max_position_embeddings=262144)
    specs = ev.layer_specs(config, "bfloat16", settings())
    inner = 2 * 4096
    state = (inner * (4 - 1) + inner * 16) * 2  # conv (d_conv - 1) + SSM (d_state), bf16
    attn_token = 8 * (128 + 128) * 2
    block = 16 * cdiv(state, 16 * attn_token)
    assert (state, block) == (311296, 80)
    page = block * attn_token
    kinds = [s.kind for s in specs]
    assert kinds.count("full") == 4 and kinds.count("mamba") == 28
    assert {s.page for s in specs} == {page}
    mml, available = 65536, 40 * GIB
    got = ev.plan_kv(specs, available, mml, 8192)
    assert len(got["groups"]) == 8  # 1 attention group + 28 / 4 Mamba groups
    assert got["bytes_per_block"] == 4 * page
    per_request = cdiv(mml, block) + 7  # one state block per Mamba group
    assert got["blocks_per_request"] == per_request
    blocks = available // (4 * page)
    assert got["kv_cache_tokens"] == tokens_and_concurrency(blocks, per_request, mml)[0]


def test_start_up_fails_when_one_request_does_not_fit() -> None:
    """``_check_enough_kv_cache_memory``: the available memory less the null block must hold
    one request of max_model_len; vLLM's binary search gives the longest that fits."""
    config = tf.LlamaConfig(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                            num_key_value_heads=8, max_position_embeddings=131072)
    specs = ev.layer_specs(config, "bfloat16", settings())
    per_block = 32 * 16 * 8 * 256 * 2
    available = 10 * GIB
    got = ev.plan_kv(specs, available, 131072, 8192)
    assert not got["fits"]
    usable_blocks = (available - per_block) // per_block
    assert got["longest"] == usable_blocks * 16  # full attention: cdiv(L, 16) blocks


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama config.json in float32 (vLLM serves it in bfloat16)."""
    path = tmp_path_factory.mktemp("vllm") / "config.json"
    path.write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2,
        "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 4096,
        "dtype": "float32"}))
    return path


def test_cli_terms_add_up_and_name_their_source(folder: Path, capsys: Any) -> None:
    assert main(["estimate", str(folder), "--engine", "vllm", "--gpu-memory", "24GiB",
                 "--seq", "1000", "--generate", "24", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    plan = data["plan"]
    total = 24 * GIB
    requested = math.ceil(total * 0.92)
    assert plan["requested_bytes"] == requested
    terms = {t["name"]: t for t in plan["terms"]}
    assert plan["available_kv_cache_bytes"] == requested - sum(t["bytes"] for t in terms.values())
    # defaults for a 24 GiB GPU (vllm serve): 2048 batched tokens, 256 sequences
    assert (plan["max_num_batched_tokens"], plan["max_num_seqs"]) == (2048, 256)
    assert plan["dtype"] == "bfloat16"  # a float32 config is served in bfloat16
    params = sum(p.numel() for p in tf.LlamaForCausalLM(tf.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512)).parameters())
    rope = 4096 * 16 * 2  # [max_position, head_dim] in bfloat16
    assert terms["weights"]["bytes"] == 2 * params + rope
    assert terms["runner buffers"]["bytes"] == 2048 * (4 + 8) + 256 * cdiv(4096, 16) * 4 + \
        2048 * 8
    assert terms["non-torch memory"]["how"] == "not traced"
    assert terms["profile transient"]["how"] == "traced"
    assert terms["CUDA graphs"]["how"] == "estimate"
    per_block = 2 * 16 * 2 * 32 * 2
    blocks = plan["available_kv_cache_bytes"] // per_block
    assert plan["num_gpu_blocks"] == blocks
    assert plan["kv_cache_tokens"] == int(blocks / cdiv(4096, 16) * 4096)
    assert plan["request_concurrency"] == blocks / cdiv(1024, 16)
    assert main(["estimate", str(folder), "--engine", "vllm", "--gpu-memory", "24GiB"]) == 0
    text = capsys.readouterr().out
    assert f"GPU KV cache size: {plan['kv_cache_tokens']:,} tokens" in text
    assert (f"Maximum concurrency for 4,096 tokens per request: "
            f"{plan['max_concurrency']:.2f}x") in text
    assert "vLLM 0.33.0" in text and "sha256" in text


def test_cli_refuses_what_vllm_does_not_take(folder: Path, capsys: Any) -> None:
    for extra in (["--verify"], ["--beams", "2"], ["--kv-dtype", "int4"], ["--device", "cpu"]):
        assert main(["estimate", str(folder), "--engine", "vllm", *extra]) == 2
        assert capsys.readouterr().err.count("\n") == 1
    assert main(["estimate", str(folder), "--generate", "2", "--gpu-memory", "H100"]) == 2
    assert "--engine vllm" in capsys.readouterr().err


def test_enforce_eager_and_a_gpu_too_small(folder: Path, capsys: Any) -> None:
    assert main(["estimate", str(folder), "--engine", "vllm", "--gpu-memory", "24GiB",
                 "--enforce-eager", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    graphs = next(t for t in plan["terms"] if t["name"] == "CUDA graphs")
    assert graphs["bytes"] == 0
    small = ["estimate", str(folder), "--engine", "vllm", "--gpu-memory", "4MiB",
             "--enforce-eager"]
    assert main([*small, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    per_block = 2 * 16 * 2 * 32 * 2
    usable = (plan["available_kv_cache_bytes"] - per_block) // per_block
    assert not plan["fits"] and 0 < usable < cdiv(4096, 16)
    assert plan["longest_fitting_max_model_len"] == usable * 16
    assert main(small) == 0
    out = capsys.readouterr().out
    assert "vLLM would not start" in out
    assert f"the estimated maximum model length is {usable * 16}" in out


def _meta_llama(vocab: int) -> Any:
    config = tf.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                            num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                            max_position_embeddings=4096)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            return tf.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)


def test_profile_run_skips_attention() -> None:
    """No attention metadata in a profile run: nothing grows with tokens squared."""
    model = _meta_llama(512)
    one, _ = ev.trace_profile(model, 1024, 1, sampler=False)
    two, _ = ev.trace_profile(model, 2048, 1, sampler=False)
    four, _ = ev.trace_profile(model, 4096, 1, sampler=False)
    assert four - two == 2 * (two - one)


def test_sampler_warm_up_by_hand() -> None:
    """With a large vocabulary the sampler is the profile run's peak: bf16 logits [R, V],
    their float32 copy, the float32 probabilities and exponential noise, the Triton top-k/
    top-p buffer of min(next_pow2(min(SMs, R)), SMs) rows, and three [R] vectors (the greedy
    and sampled ids, int64, and the float32 temperatures)."""
    rows, vocab, sms = 256, 32768, 132
    got, _ = ev.trace_profile(_meta_llama(vocab), 2048, rows, sampler=True, sms=sms)
    assert got == rows * vocab * (2 + 4 + 4 + 4) + sms * vocab * 4 + rows * (8 + 8 + 4)
