"""Repeated blocks of a training step replayed from real twins give the very trace that runs
every block for real (estimation/train_replay.py, block_replay.py): the same bytes at every
tick, the same allocation records (sizes, lifetimes, origins, modules, ops, saved-for-backward
names), the same peak. Blocks that differ (MoE and dense, sliding and full attention) or whose
record cannot be replayed exactly are traced for real, and the trace stays the same."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from tests.estimation.replay_helpers import both, ids, llama  # noqa: E402


def _both(make: Callable[[], nn.Module], inputs: Any, **program: Any) -> str:
    """Trace with and without block replay; assert equal; return the replay's summary."""
    return both(make, inputs, "replay_blocks", lambda trace: trace.blocks, **program)


def _ids(vocab: int = 128) -> dict[str, torch.Tensor]:
    return ids(vocab)


def _llama(layers: int = 8) -> nn.Module:
    return llama(layers)


@pytest.mark.parametrize("program", [
    {"optimizer": "adamw"},
    {"optimizer": "adamw", "amp": torch.bfloat16, "implementation": "for-loop"},
    {"optimizer": "sgd", "accumulate": 2, "steps": 1},
], ids=["fp32", "bf16-autocast", "accumulate"])
def test_llama_training_replays_blocks_exactly(program: dict[str, Any]) -> None:
    from modelsize.estimation.optimizers import Implementation

    if "implementation" in program:
        program["implementation"] = Implementation(program["implementation"])
    blocks = _both(_llama, _ids(), mode="train", **program)
    assert "replayed" in blocks and not blocks.startswith("traced again")


def test_llama_inference_replays_blocks_exactly() -> None:
    _both(_llama, {"input_ids": _ids()["input_ids"]}, mode="infer")


def test_gpt2_training_same_trace() -> None:
    cfg = transformers.GPT2Config(n_embd=64, n_layer=6, n_head=4, vocab_size=128,
                                  n_positions=32)
    _both(lambda: transformers.GPT2LMHeadModel(cfg), _ids(), mode="train", optimizer="adam")


def test_moe_and_dense_layers_same_trace() -> None:
    """Qwen2-MoE with dense layers between the sparse ones: two kinds of block."""
    cfg = transformers.Qwen2MoeConfig(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
        num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
        mlp_only_layers=[0, 3, 6])
    _both(lambda: transformers.Qwen2MoeForCausalLM(cfg), _ids(), mode="train",
          optimizer="adamw")


def test_mixtral_training_same_trace() -> None:
    cfg = transformers.MixtralConfig(hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=6, num_attention_heads=4,
                                     num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, vocab_size=128)
    _both(lambda: transformers.MixtralForCausalLM(cfg), _ids(), mode="train",
          optimizer="adamw")


def test_sliding_and_full_attention_layers_same_trace() -> None:
    layer_types = ["sliding_attention", "full_attention"] * 4
    cfg = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=128, use_sliding_window=True, sliding_window=8,
                                   layer_types=layer_types)
    _both(lambda: transformers.Qwen2ForCausalLM(cfg), _ids(), mode="train", optimizer="adamw")


def test_torch_transformer_encoder_same_trace() -> None:
    def make() -> nn.Module:
        layer = nn.TransformerEncoderLayer(64, 4, 128, batch_first=True, dropout=0.0)
        return nn.TransformerEncoder(layer, 6, enable_nested_tensor=False)

    x = torch.randn(2, 16, 64)
    _both(make, (x,), mode="train", optimizer="adamw")


def test_lora_same_trace() -> None:
    peft = pytest.importorskip("peft")

    def make() -> nn.Module:
        config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        return peft.get_peft_model(_llama(), config)

    _both(make, _ids(), mode="train", optimizer="adamw")


def test_checkpointed_layers_same_trace() -> None:
    _both(_llama, _ids(), mode="train", optimizer="adamw", checkpoint=("model.layers.*",))
