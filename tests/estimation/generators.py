"""Tiny generative models of every family, and the measured side of generation tests.

Each builder returns a real, randomly initialised model (seeded) from a transformers config
with small sizes (nothing downloaded) and its ``generate()`` inputs. :func:`measure` runs
``generate()`` for real under the CPU allocator's profiler, independently of the estimator
(the way :mod:`tests.estimation.groundtruth` measures a forward).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tests.estimation.groundtruth import allocator_events, peak_of, storage_bytes

Built = tuple[nn.Module, dict[str, torch.Tensor]]

#: Decoder-only defaults: 2 layers, 4 query heads over 2 KV heads (GQA), a 512-token vocabulary.
BASE: dict[str, Any] = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                            num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                            max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                            pad_token_id=0)
BATCH, PROMPT = 2, 12


def tokens(batch: int = BATCH, prompt: int = PROMPT, left_pad: int = 0) -> dict[str, torch.Tensor]:
    """Random prompt ids (no special id) and an attention mask, the first row unpadded."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 500, (batch, prompt), generator=g)
    mask = torch.ones(batch, prompt, dtype=torch.long)
    if left_pad:
        mask[1:, :left_pad] = 0
        ids[1:, :left_pad] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _tf() -> Any:
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def _build(make: Callable[[Any], nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return make(_tf()).eval()


def llama() -> Built:
    return _build(lambda tf: tf.LlamaForCausalLM(tf.LlamaConfig(**BASE))), tokens()


def qwen2() -> Built:
    return _build(lambda tf: tf.Qwen2ForCausalLM(tf.Qwen2Config(**BASE))), tokens()


def qwen3() -> Built:
    return _build(lambda tf: tf.Qwen3ForCausalLM(tf.Qwen3Config(**BASE, head_dim=16))), tokens()


def mistral() -> Built:
    """Every layer a sliding window of 8 tokens, shorter than prompt + new tokens."""
    return _build(lambda tf: tf.MistralForCausalLM(tf.MistralConfig(**BASE, sliding_window=8))), \
        tokens()


def gpt2() -> Built:
    return _build(lambda tf: tf.GPT2LMHeadModel(tf.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=256, bos_token_id=1,
        eos_token_id=2))), tokens()


def falcon() -> Built:
    """Multi-query attention: one KV head."""
    return _build(lambda tf: tf.FalconForCausalLM(tf.FalconConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, multi_query=True,
        vocab_size=512, new_decoder_architecture=False, bos_token_id=1, eos_token_id=2))), \
        tokens()


def gemma2() -> Built:
    """Sliding and full attention layers alternating."""
    return _build(lambda tf: tf.Gemma2ForCausalLM(tf.Gemma2Config(
        **BASE, head_dim=16, sliding_window=8))), tokens()


def gemma3() -> Built:
    """Two sliding layers per full one."""
    return _build(lambda tf: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(
        **{**BASE, "num_hidden_layers": 3}, head_dim=16, sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"]))), tokens()


def gpt_oss() -> Built:
    """Sliding and full attention alternating, mixture of experts."""
    return _build(lambda tf: tf.GptOssForCausalLM(tf.GptOssConfig(
        **BASE, head_dim=16, sliding_window=8, num_local_experts=4,
        num_experts_per_tok=2))), tokens()


_MLA = dict(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            first_k_dense_replace=1)


def deepseek_v2() -> Built:
    """Multi-head latent attention, MoE after the first dense layer."""
    return _build(lambda tf: tf.DeepseekV2ForCausalLM(tf.DeepseekV2Config(
        **{**BASE, "num_key_value_heads": 4}, q_lora_rank=None, n_shared_experts=1,
        **_MLA))), tokens()


def deepseek_v3() -> Built:
    return _build(lambda tf: tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(
        **{**BASE, "num_key_value_heads": 4}, q_lora_rank=48, n_group=2, topk_group=1,
        **_MLA))), tokens()


def mixtral() -> Built:
    return _build(lambda tf: tf.MixtralForCausalLM(tf.MixtralConfig(
        **BASE, num_local_experts=4, num_experts_per_tok=2))), tokens()


def qwen3_moe() -> Built:
    return _build(lambda tf: tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
        **BASE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32))), tokens()


def mamba() -> Built:
    return _build(lambda tf: tf.MambaForCausalLM(tf.MambaConfig(
        num_hidden_layers=2, hidden_size=64, state_size=8, vocab_size=512, expand=2,
        conv_kernel=4, bos_token_id=1, eos_token_id=2, pad_token_id=0))), tokens()


def jamba() -> Built:
    """Mamba layers with an attention layer every second one, MoE every second one."""
    return _build(lambda tf: tf.JambaForCausalLM(tf.JambaConfig(
        **BASE, num_experts=2, num_experts_per_tok=1, expert_layer_period=2,
        expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8,
        mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8))), tokens()


def qwen3_next() -> Built:
    """Gated DeltaNet (linear attention) layers with a full attention layer every fourth."""
    return _build(lambda tf: tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(
        **{**BASE, "num_hidden_layers": 4}, head_dim=16, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4))), tokens()


def t5() -> Built:
    return _build(lambda tf: tf.T5ForConditionalGeneration(tf.T5Config(
        d_model=64, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4, d_kv=16,
        vocab_size=512, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))), tokens()


def bart() -> Built:
    return _build(lambda tf: tf.BartForConditionalGeneration(tf.BartConfig(
        d_model=64, encoder_ffn_dim=128, decoder_ffn_dim=128, encoder_layers=2,
        decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        vocab_size=512, max_position_embeddings=128))), tokens()


def whisper() -> Built:
    """Audio features in, 50 encoder positions (100 mel frames), cross-attention cache."""
    model = _build(lambda tf: tf.WhisperForConditionalGeneration(tf.WhisperConfig(
        d_model=64, encoder_ffn_dim=128, decoder_ffn_dim=128, encoder_layers=2,
        decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        vocab_size=512, num_mel_bins=16, max_source_positions=50, max_target_positions=64,
        decoder_start_token_id=1, eos_token_id=2, pad_token_id=2, bos_token_id=1)))
    g = torch.Generator().manual_seed(1)
    return model, {"input_features": torch.randn(BATCH, 16, 100, generator=g)}


FAMILIES: dict[str, Callable[[], Built]] = {
    "llama": llama, "qwen2": qwen2, "qwen3": qwen3, "mistral": mistral, "gpt2": gpt2,
    "falcon": falcon, "gemma2": gemma2, "gemma3": gemma3, "gpt_oss": gpt_oss,
    "deepseek_v2": deepseek_v2, "deepseek_v3": deepseek_v3, "mixtral": mixtral,
    "qwen3_moe": qwen3_moe, "mamba": mamba, "jamba": jamba, "qwen3_next": qwen3_next,
    "t5": t5, "bart": bart, "whisper": whisper,
}


def measure(model: nn.Module, inputs: dict[str, torch.Tensor], new_tokens: int,
            **generation: Any) -> int:
    """The real CPU peak of ``model.generate(**inputs, max_new_tokens=new_tokens,
    min_new_tokens=new_tokens, do_sample=False, **generation)``: the allocator's events plus
    the parameters, buffers and inputs live before it starts."""
    before = storage_bytes([*model.parameters(), *model.buffers(), *inputs.values()])
    model.eval()
    with allocator_events() as events, torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, **generation)
        del out
    return before + peak_of(events)
