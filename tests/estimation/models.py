"""Tiny real models for the estimate tests (each traces and runs for real in well under 1 s)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class SmallCNN(nn.Module):
    """The MNIST example network, narrower: conv, relu, conv, relu, pool, dropout, 2 linears."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3)
        self.conv2 = nn.Conv2d(16, 32, 3)
        self.dropout = nn.Dropout(0.25)
        self.fc1 = nn.Linear(32 * 12 * 12, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.max_pool2d(torch.relu(self.conv2(torch.relu(self.conv1(x)))), 2)
        x = torch.flatten(self.dropout(x), 1)
        return self.fc2(torch.relu(self.fc1(x)))


class ResBlockNet(nn.Module):
    """Stem (7x7 stride 2, BatchNorm, max-pool), one residual block, a strided 1x1 shortcut."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 7, 2, 3, bias=False), nn.BatchNorm2d(16),
                                  nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        self.block = nn.Sequential(nn.Conv2d(16, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16),
                                   nn.ReLU(), nn.Conv2d(16, 16, 3, 1, 1, bias=False),
                                   nn.BatchNorm2d(16))
        self.down = nn.Sequential(nn.Conv2d(16, 32, 1, 2, bias=False), nn.BatchNorm2d(32))
        self.fc = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = torch.relu(x + self.block(x))
        x = torch.relu(self.down(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class Block(nn.Module):
    """Pre-norm MLP block with a residual: LayerNorm, Linear, GELU, Linear."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.ln(x))))


class Stack(nn.Module):
    """Blocks on (batch, seq, d) inputs; ``checkpointed`` runs each under checkpoint."""

    def __init__(self, d: int = 32, n: int = 3, checkpointed: bool = False,
                 preserve_rng_state: bool = True) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 10)
        self.checkpointed = checkpointed
        self.preserve_rng_state = preserve_rng_state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = (checkpoint(b, x, use_reentrant=False, preserve_rng_state=self.preserve_rng_state)
                 if self.checkpointed else b(x))
        return self.head(x)


class Wide(nn.Module):
    """Large weights, one sample: the optimizer step holds the peak."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(256, 512)
        self.b = nn.Linear(512, 256)
        self.ln = nn.LayerNorm(256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(self.b(torch.relu(self.a(x))))


class Recurrent(nn.Module):
    """A 2-layer LSTM (oneDNN kernels on CPU) and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(16, 32, num_layers=2)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0])


def tiny_gpt2() -> tuple[nn.Module, dict[str, Any]]:
    """A 2-layer, 64-wide GPT-2 from transformers with token inputs and labels."""
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512,
                                     n_positions=64, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 512, (2, 64))
    return model, {"input_ids": ids, "labels": ids}


def tiny_llama() -> tuple[nn.Module, dict[str, Any]]:
    """A 2-layer Llama with grouped KV heads and SwiGLU, token inputs and labels."""
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=176, vocab_size=512,
                                      bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 512, (2, 64))
    return model, {"input_ids": ids, "labels": ids}


def tiny_seq2seq(family: str) -> tuple[nn.Module, dict[str, Any]]:
    """A 2+2-layer BART or Pegasus (a float32 ``final_logits_bias`` buffer added to the
    logits; Pegasus adds sinusoidal positions) with encoder and decoder token inputs."""
    import transformers

    transformers.logging.set_verbosity_error()
    config_class, model_class = {
        "bart": (transformers.BartConfig, transformers.BartForConditionalGeneration),
        "pegasus": (transformers.PegasusConfig, transformers.PegasusForConditionalGeneration),
    }[family]
    config = config_class(vocab_size=512, d_model=64, encoder_layers=2, decoder_layers=2,
                          encoder_attention_heads=4, decoder_attention_heads=4,
                          encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=128)
    torch.manual_seed(0)
    model = model_class(config)
    ids = torch.randint(0, 512, (2, 32))
    return model, {"input_ids": ids, "decoder_input_ids": ids}


class SparseBag(nn.Module):
    """An ``nn.Embedding(sparse=True)`` (sparse COO gradients), optionally a Linear head."""

    def __init__(self, padding_idx: int | None = None, head: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(1000, 32, sparse=True, padding_idx=padding_idx)
        self.head = nn.Linear(32, 4) if head else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        return self.head(x) if self.head is not None else x.sum()


def repeated_ids() -> torch.Tensor:
    """(4, 16) token ids with repeats (coalescing a gradient merges them), 7 among them."""
    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (4, 16))
    ids[0, :5] = 7
    return ids
