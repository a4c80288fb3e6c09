"""How close is each memory estimator to the CPU allocator's measured peak?

Run from the repository root: ``python benchmarks/estimate_accuracy.py`` (about 5 minutes on
2 cores). Writes the ``estimate_accuracy`` section of benchmarks/RESULTS.md.

For every model, batch size and mode (a training step of AdamW, or inference):

* **measured**: the model runs for real on CPU under ``torch.profiler(profile_memory=True)``;
  the peak is read from the allocator's own alloc/free events plus what was live before the
  program (parameters, buffers, inputs). Training runs two steps (Adam creates its state in
  the first), inference one forward under ``no_grad``.
* **modelsize**: ``modelsize.estimate(..., device="cpu")`` on the same model and inputs.
* **torchinfo**: ``summary(...)`` "estimated total size" (inputs + forward/backward pass +
  parameters).
* **accelerate**: ``accelerate estimate-memory``'s Python functions on a model built under
  ``init_empty_weights``: the model size for inference, the Adam training peak for training.
* **deepspeed**: ZeRO-2 model-states estimate, one GPU, no offload (training only).
* **MemTracker**: ``torch.distributed._tools.mem_tracker.MemTracker`` on the same program,
  with the model built under ``FakeTensorMode``.
* **formula**: 16 bytes/parameter (ZeRO's model states for Adam) for training, 4
  bytes/parameter for fp32 inference, plus Korthikanti et al.'s ``sbh(34 + 5as/h)``
  activation bytes per layer for the transformers.

Every cell is the signed error against measured: ``(estimate - measured) / measured``.
"""

from __future__ import annotations

import contextlib
import functools
import random
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import transformers
from torch import nn
from torch.profiler import ProfilerActivity, profile

from _results import write_section
from modelsize.errors import ModelSizeError
from modelsize.estimation import estimate
from modelsize.estimation.core import Settings
from modelsize.estimation.optimizers import make_factory
from modelsize.estimation.trace import caller, checkpointed
from modelsize.estimation.verify import measure
from modelsize.estimation.zoo import ResNet, SeedCNN

transformers.logging.set_verbosity_error()
warnings.filterwarnings("ignore")

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-4, foreach=False)


@dataclass
class Case:
    """One model at one size."""

    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[int], Any]
    batches: tuple[int, int]
    layers: int = 0  # transformer layers, for the activation formula
    seq: int = 0
    hidden: int = 0
    heads: int = 0


def _tokens(seq: int, vocab: int, labels: bool) -> Callable[[int], Any]:
    def make(batch: int) -> Any:
        ids = torch.randint(0, vocab, (batch, seq))
        return {"input_ids": ids, "labels": ids} if labels else {"input_ids": ids}

    return make


class LSTMTagger(nn.Module):
    """Two-layer LSTM over (seq, batch, 256) features with a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(256, 512, num_layers=2)
        self.head = nn.Linear(512, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0])


def _gpt2() -> nn.Module:
    return transformers.GPT2LMHeadModel(transformers.GPT2Config())


def _bert() -> nn.Module:
    return transformers.BertForMaskedLM(transformers.BertConfig())


def _llama() -> nn.Module:
    config = transformers.LlamaConfig(
        num_hidden_layers=4, hidden_size=512, num_attention_heads=8, num_key_value_heads=4,
        intermediate_size=1376, vocab_size=32000, bos_token_id=0, eos_token_id=0,
    )
    return transformers.LlamaForCausalLM(config)


CASES = [
    Case("seed CNN", SeedCNN, lambda b: (torch.randn(b, 1, 28, 28),), (1, 64)),
    Case("ResNet-50", ResNet, lambda b: (torch.randn(b, 3, 224, 224),), (1, 8)),
    Case("LSTM 2x512", LSTMTagger, lambda b: (torch.randn(100, b, 256),), (1, 32)),
    Case("BERT-base", _bert, _tokens(128, 30522, True), (1, 4), 12, 128, 768, 12),
    Case("GPT-2 small", _gpt2, _tokens(256, 50257, True), (1, 4), 12, 256, 768, 12),
    Case("Llama 4 layers", _llama, _tokens(256, 32000, True), (1, 4), 4, 256, 512, 8),
]


# ---- the wide set: one configuration each, chosen to break the estimator ----------------


@dataclass
class Wide:
    """One model, one batch, one program (``estimate`` keyword arguments)."""

    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[], Any]
    settings: dict[str, Any]


def _seq2seq(vocab: int, batch: int = 2, src: int = 32, tgt: int = 16) -> Callable[[], Any]:
    def make() -> Any:
        return {"input_ids": torch.randint(3, vocab, (batch, src)),
                "labels": torch.randint(3, vocab, (batch, tgt))}

    return make


def _t5() -> nn.Module:
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=1000, d_model=128, d_kv=32, d_ff=256, num_layers=2, num_heads=4,
        decoder_start_token_id=0, pad_token_id=0))


def _bart() -> nn.Module:
    return transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=1000, d_model=128, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=256,
        decoder_ffn_dim=256, max_position_embeddings=64))


def _mixtral() -> nn.Module:
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=128))


def _qwen_moe() -> nn.Module:
    return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        vocab_size=1000, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        shared_expert_intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=128))


def _llama_gqa() -> nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=0, eos_token_id=0))


def _gpt2_tiny() -> nn.Module:
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=1000, n_positions=128, n_embd=128, n_layer=2, n_head=4))


def _bert_tiny() -> nn.Module:
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=256, max_position_embeddings=128))


def _frozen_bert() -> nn.Module:
    model = _bert_tiny()
    for p in model.bert.parameters():
        p.requires_grad_(False)
    return model


def _whisper() -> nn.Module:
    return transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(
        vocab_size=1000, num_mel_bins=16, d_model=64, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
        decoder_ffn_dim=128, max_source_positions=50, max_target_positions=32,
        decoder_start_token_id=1, pad_token_id=0, begin_suppress_tokens=None,
        suppress_tokens=None))


def _whisper_inputs() -> Any:
    return {"input_features": torch.randn(2, 16, 100),
            "labels": torch.randint(3, 1000, (2, 12))}


def _wav2vec2() -> nn.Module:
    return transformers.Wav2Vec2ForCTC(transformers.Wav2Vec2Config(
        vocab_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, conv_dim=(32, 32, 32), conv_stride=(5, 2, 2),
        conv_kernel=(10, 3, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
        pad_token_id=0, mask_time_prob=0.0))


def _wav2vec2_inputs() -> Any:
    return {"input_values": torch.randn(2, 4000), "labels": torch.randint(1, 32, (2, 20))}


def _convnext() -> nn.Module:
    return transformers.ConvNextForImageClassification(transformers.ConvNextConfig(
        num_channels=3, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 2, 1], num_labels=10))


def _swin() -> nn.Module:
    return transformers.SwinForImageClassification(transformers.SwinConfig(
        image_size=64, patch_size=4, embed_dim=24, depths=[1, 2], num_heads=[2, 4],
        window_size=4, num_labels=10))


def _vit() -> nn.Module:
    return transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=64, patch_size=8, hidden_size=96, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=192, num_labels=10))


def _mobilenet_hf() -> nn.Module:
    return transformers.MobileNetV2ForImageClassification(transformers.MobileNetV2Config(
        image_size=64, depth_multiplier=0.35, num_labels=10))


class InvertedResidual(nn.Module):
    """MobileNetV2's block: 1x1 expand, 3x3 depthwise, 1x1 project, residual."""

    def __init__(self, ch: int, expand: int = 4) -> None:
        super().__init__()
        mid = ch * expand
        self.body = nn.Sequential(
            nn.Conv2d(ch, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU6(),
            nn.Conv2d(mid, mid, 3, padding=1, groups=mid, bias=False), nn.BatchNorm2d(mid),
            nn.ReLU6(), nn.Conv2d(mid, ch, 1, bias=False), nn.BatchNorm2d(ch))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


class MobileNetish(nn.Module):
    """A stem, four inverted residual blocks (depthwise convolutions), a pooled head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16),
                                  nn.Hardswish())
        self.blocks = nn.Sequential(*(InvertedResidual(16) for _ in range(4)))
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


class UNetBlock(nn.Module):
    """Two 3x3 convolutions with GroupNorm and SiLU."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(8, cout),
                                  nn.SiLU(), nn.Conv2d(cout, cout, 3, padding=1),
                                  nn.GroupNorm(8, cout), nn.SiLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class UNet(nn.Module):
    """A two-level U-Net with GroupNorm, transposed-convolution upsampling and skips."""

    def __init__(self) -> None:
        super().__init__()
        self.down1, self.down2 = UNetBlock(3, 16), UNetBlock(16, 32)
        self.mid = UNetBlock(32, 64)
        self.up2 = nn.ConvTranspose2d(64, 32, 2, stride=2)
        self.dec2 = UNetBlock(64, 32)
        self.up1 = nn.ConvTranspose2d(32, 16, 2, stride=2)
        self.dec1 = UNetBlock(32, 16)
        self.out = nn.Conv2d(16, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d1 = self.down1(x)
        d2 = self.down2(nn.functional.max_pool2d(d1, 2))
        m = self.mid(nn.functional.max_pool2d(d2, 2))
        u2 = self.dec2(torch.cat([self.up2(m), d2], 1))
        return self.out(self.dec1(torch.cat([self.up1(u2), d1], 1)))


class ConvNeXtish(nn.Module):
    """ConvNeXt blocks written out: 7x7 depthwise, channels-last LayerNorm, MLP, layer scale."""

    def __init__(self, ch: int = 32) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, ch, 4, stride=4)
        self.dw = nn.ModuleList(nn.Conv2d(ch, ch, 7, padding=3, groups=ch) for _ in range(2))
        self.norm = nn.ModuleList(nn.LayerNorm(ch) for _ in range(2))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(ch, 4 * ch), nn.GELU(),
                                               nn.Linear(4 * ch, ch)) for _ in range(2))
        self.gamma = nn.ParameterList(nn.Parameter(torch.full((ch,), 1e-6)) for _ in range(2))
        self.head = nn.Linear(ch, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for dw, norm, mlp, gamma in zip(self.dw, self.norm, self.mlp, self.gamma, strict=True):
            y = norm(dw(x).permute(0, 2, 3, 1))
            x = x + (gamma * mlp(y)).permute(0, 3, 1, 2)
        return self.head(x.mean((2, 3)))


class RNNNet(nn.Module):
    """One recurrent layer of any flavour over (batch, seq, 32) features, a linear head."""

    def __init__(self, kind: str, **kwargs: Any) -> None:
        super().__init__()
        cls = {"rnn": nn.RNN, "gru": nn.GRU, "lstm": nn.LSTM}[kind]
        self.rnn = cls(32, 64, batch_first=True, **kwargs)
        out = kwargs.get("proj_size") or 64
        self.head = nn.Linear(out * (2 if kwargs.get("bidirectional") else 1), 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0])


class CellLoop(nn.Module):
    """An LSTMCell and a GRUCell stepped in a Python loop."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm, self.gru = nn.LSTMCell(32, 64), nn.GRUCell(64, 64)
        self.head = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = c = g = x.new_zeros(x.shape[0], 64)
        for t in range(x.shape[1]):
            h, c = self.lstm(x[:, t], (h, c))
            g = self.gru(h, g)
        return self.head(g)


class MHA(nn.Module):
    """``nn.MultiheadAttention`` self-attention with a key padding mask."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(128, 4, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(x.shape[:2], dtype=torch.bool)
        return self.attn(x, x, x, key_padding_mask=mask)[0]


def _encoder(norm_first: bool = False) -> nn.Module:
    layer = nn.TransformerEncoderLayer(128, 4, 256, batch_first=True, norm_first=norm_first)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


def _images(batch: int, size: int, ch: int = 3) -> Callable[[], Any]:
    return lambda: (torch.randn(batch, ch, size, size),)


def _seq(batch: int, seq: int, dim: int) -> Callable[[], Any]:
    return lambda: (torch.randn(batch, seq, dim),)


def _lm(batch: int, seq: int, vocab: int = 1000) -> Callable[[], Any]:
    return lambda: _tokens(seq, vocab, True)(batch)


def _cls(batch: int, seq: int) -> Callable[[], Any]:
    return lambda: {"input_ids": torch.randint(0, 1000, (batch, seq)),
                    "labels": torch.randint(0, 2, (batch,))}


def _wav2vec2_nodrop() -> nn.Module:
    model = _wav2vec2()
    model.config.layerdrop = 0.0
    return model


def _albert() -> nn.Module:
    return transformers.AlbertForMaskedLM(transformers.AlbertConfig(
        vocab_size=1000, embedding_size=64, hidden_size=128, num_hidden_layers=4,
        num_attention_heads=4, intermediate_size=256, max_position_embeddings=128))


def _transformer() -> nn.Module:
    return nn.Transformer(128, 4, 2, 2, 256, batch_first=True)


def _pair(batch: int, src: int, tgt: int, dim: int) -> Callable[[], Any]:
    return lambda: (torch.randn(batch, src, dim), torch.randn(batch, tgt, dim))


class PaddedEncoder(nn.Module):
    """``nn.TransformerEncoder`` with a key padding mask: the nested-tensor fast path."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(128, 4, 256, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        pad = torch.arange(x.shape[1])[None, :] >= lengths[:, None]
        return self.encoder(x, src_key_padding_mask=pad)


class PackedLSTM(nn.Module):
    """An LSTM over a packed batch of variable-length sequences."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(32, 64, batch_first=True)
        self.head = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True,
                                                   enforce_sorted=False)
        out, _ = nn.utils.rnn.pad_packed_sequence(self.lstm(packed)[0], batch_first=True)
        return self.head(out)


class Conv1d3d(nn.Module):
    """A 1-d convolution stack (audio) and a 3-d one (video) with BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Sequential(nn.Conv1d(8, 32, 5, padding=2), nn.BatchNorm1d(32), nn.ReLU(),
                                nn.Conv1d(32, 32, 3, stride=2))
        self.c3 = nn.Sequential(nn.Conv3d(3, 8, 3, padding=1), nn.BatchNorm3d(8), nn.ReLU(),
                                nn.Conv3d(8, 8, 3, stride=2))

    def forward(self, a: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.c1(a).mean() + self.c3(v).mean()


def _channels_last() -> Any:
    return (torch.randn(4, 3, 64, 64).contiguous(memory_format=torch.channels_last),)


class PureBF16(nn.Module):
    """A small MLP-mixer-ish model held entirely in bfloat16 (no autocast)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.LayerNorm(256),
                                 nn.Linear(256, 64)).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.to(torch.bfloat16))


TRAIN = {"mode": "train", "optimizer": "adamw"}
INFER = {"mode": "infer"}

WIDE = [
    Wide("T5 enc-dec", _t5, _seq2seq(1000), TRAIN),
    Wide("T5 enc-dec", _t5, _seq2seq(1000), INFER),
    Wide("BART enc-dec", _bart, _seq2seq(1000), TRAIN),
    Wide("Whisper", _whisper, _whisper_inputs, TRAIN),
    Wide("Wav2Vec2 CTC", _wav2vec2, _wav2vec2_inputs, TRAIN),
    Wide("Mixtral MoE", _mixtral, _lm(2, 64), TRAIN),
    Wide("Mixtral MoE", _mixtral, _lm(2, 64), INFER),
    Wide("Qwen2 MoE", _qwen_moe, _lm(2, 64), TRAIN),
    Wide("Llama GQA", _llama_gqa, _lm(2, 128), TRAIN),
    Wide("Llama GQA", _llama_gqa, _lm(2, 128), INFER),
    Wide("MobileNet-ish dw", MobileNetish, _images(4, 64), TRAIN),
    Wide("MobileNetV2 (HF)", _mobilenet_hf, _images(2, 64), INFER),
    Wide("U-Net GroupNorm", UNet, _images(2, 64), TRAIN),
    Wide("ConvNeXt-ish", ConvNeXtish, _images(4, 64), TRAIN),
    Wide("ConvNeXt (HF)", _convnext, _images(2, 64), TRAIN),
    Wide("Swin (HF)", _swin, _images(2, 64), TRAIN),
    Wide("ViT (HF)", _vit, _images(2, 64), INFER),
    Wide("RNN tanh", lambda: RNNNet("rnn", num_layers=2), _seq(4, 50, 32), TRAIN),
    Wide("GRU bidir", lambda: RNNNet("gru", bidirectional=True), _seq(4, 50, 32), TRAIN),
    Wide("GRU bidir", lambda: RNNNet("gru", bidirectional=True), _seq(4, 50, 32), INFER),
    Wide("LSTM proj", lambda: RNNNet("lstm", proj_size=16), _seq(4, 50, 32), TRAIN),
    Wide("LSTM/GRU cells", CellLoop, _seq(4, 20, 32), TRAIN),
    Wide("frozen BERT", _frozen_bert, _cls(4, 64), TRAIN),
    Wide("frozen BERT adagrad all", _frozen_bert, _cls(4, 64),
         {"mode": "train", "optimizer": "adagrad", "optimize_frozen": True}),
    Wide("GPT-2 tiny sgd", _gpt2_tiny, _lm(2, 64), {"mode": "train", "optimizer": "sgd"}),
    Wide("GPT-2 tiny momentum", _gpt2_tiny, _lm(2, 64),
         {"mode": "train", "optimizer": "momentum"}),
    Wide("GPT-2 tiny adam", _gpt2_tiny, _lm(2, 64), {"mode": "train", "optimizer": "adam"}),
    Wide("GPT-2 tiny adagrad", _gpt2_tiny, _lm(2, 64),
         {"mode": "train", "optimizer": "adagrad"}),
    Wide("GPT-2 tiny rmsprop", _gpt2_tiny, _lm(2, 64),
         {"mode": "train", "optimizer": "rmsprop"}),
    Wide("GPT-2 tiny adamw foreach", _gpt2_tiny, _lm(2, 64),
         {"mode": "train", "optimizer": "adamw", "implementation": "foreach"}),
    Wide("GPT-2 tiny adamw fused", _gpt2_tiny, _lm(2, 64),
         {"mode": "train", "optimizer": "adamw", "implementation": "fused"}),
    Wide("GPT-2 tiny sgd foreach", _gpt2_tiny, _lm(2, 64),
         {"mode": "train", "optimizer": "momentum", "implementation": "foreach"}),
    Wide("GPT-2 tiny adagrad fused", _gpt2_tiny, _lm(2, 64),
         {"mode": "train", "optimizer": "adagrad", "implementation": "fused"}),
    Wide("GPT-2 tiny rmsprop foreach", _gpt2_tiny, _lm(2, 64),
         {"mode": "train", "optimizer": "rmsprop", "implementation": "foreach"}),
    Wide("GPT-2 tiny bf16 autocast", _gpt2_tiny, _lm(2, 64), {**TRAIN, "amp": "bf16"}),
    Wide("GPT-2 tiny bf16 autocast", _gpt2_tiny, _lm(2, 64), {**INFER, "amp": "bf16"}),
    Wide("MobileNet-ish bf16 autocast", MobileNetish, _images(4, 64), {**TRAIN, "amp": "bf16"}),
    Wide("Llama GQA checkpointed", _llama_gqa, _lm(2, 128),
         {**TRAIN, "checkpoint": ("model.layers.*",)}),
    Wide("U-Net checkpointed", UNet, _images(2, 64), {**TRAIN, "checkpoint": ("UNetBlock",)}),
    Wide("GPT-2 tiny accumulate 3", _gpt2_tiny, _lm(2, 64), {**TRAIN, "accumulate": 3}),
    Wide("nn.MultiheadAttention", MHA, _seq(4, 64, 128), INFER),
    Wide("nn.MultiheadAttention", MHA, _seq(4, 64, 128), TRAIN),
    Wide("nn.TransformerEncoder", _encoder, _seq(4, 64, 128), INFER),
    Wide("nn.TransformerEncoder pre-norm", lambda: _encoder(True), _seq(4, 64, 128), INFER),
    Wide("nn.TransformerEncoder", _encoder, _seq(4, 64, 128), TRAIN),
    Wide("Wav2Vec2 CTC no LayerDrop", _wav2vec2_nodrop, _wav2vec2_inputs, TRAIN),
    Wide("ALBERT shared layers", _albert, _lm(2, 64), TRAIN),
    Wide("nn.Transformer enc-dec", _transformer, _pair(2, 32, 16, 128), TRAIN),
    Wide("nn.Transformer enc-dec", _transformer, _pair(2, 32, 16, 128), INFER),
    Wide("nn.TransformerEncoder padded", PaddedEncoder,
         lambda: (torch.randn(4, 64, 128), torch.tensor([64, 40, 17, 5])), INFER),
    Wide("LSTM packed sequences", PackedLSTM,
         lambda: (torch.randn(4, 50, 32), torch.tensor([50, 31, 12, 7])), TRAIN),
    Wide("Conv1d + Conv3d BatchNorm", Conv1d3d,
         lambda: (torch.randn(4, 8, 400), torch.randn(2, 3, 8, 32, 32)), TRAIN),
    Wide("MobileNet-ish channels_last", MobileNetish, _channels_last, TRAIN),
    Wide("MobileNet-ish bf16 autocast", MobileNetish, _images(4, 64), {**INFER, "amp": "bf16"}),
    Wide("pure bf16 MLP", PureBF16, _seq(8, 64, 64), {"mode": "train", "optimizer": "adam"}),
    Wide("Swin (HF)", _swin, _images(2, 64), INFER),
    Wide("frozen BERT bf16 autocast", _frozen_bert, _cls(4, 64), {**TRAIN, "amp": "bf16"}),
]


def _loss(out: Any) -> torch.Tensor:
    if getattr(out, "loss", None) is not None:
        return out.loss
    t = out if isinstance(out, torch.Tensor) else out[0]
    return t.sum()


def _call(model: nn.Module, inputs: Any) -> Any:
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def measured_peak(model: nn.Module, inputs: Any, train: bool) -> int:
    """The real CPU peak: allocator events under the profiler plus what was already live."""
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [v for v in (inputs.values() if isinstance(inputs, dict) else inputs)
                if isinstance(v, torch.Tensor)]
    before = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                  for t in tensors}.values())
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        if train:
            model.train()
            opt = ADAMW(model.parameters())
            for _ in range(2):
                loss = _loss(_call(model, inputs))
                loss.backward()
                del loss
                opt.step()
                opt.zero_grad(set_to_none=True)
            del opt
        else:
            model.eval()
            with torch.no_grad():
                out = _call(model, inputs)
            del out
    cur = high = 0
    for e in prof.profiler.kineto_results.events():
        if e.name() == "[memory]":
            cur += e.nbytes()
            high = max(high, cur)
    return before + high


def torchinfo_total(model: nn.Module, inputs: Any, train: bool) -> int:
    """torchinfo's "Estimated Total Size" in bytes."""
    import torchinfo

    data = dict(inputs) if isinstance(inputs, dict) else list(inputs)
    stats = torchinfo.summary(model, input_data=data, verbose=0, mode="train" if train else "eval")
    return int(stats.total_input + stats.total_output_bytes + stats.total_param_bytes)


def accelerate_total(build: Callable[[], nn.Module], train: bool) -> int:
    """accelerate estimate-memory: model size (inference) or Adam training peak."""
    from accelerate import init_empty_weights
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes

    with init_empty_weights():
        model = build()
    total, _largest = calculate_maximum_sizes(model)
    if not train:
        return int(total)
    return int(max(estimate_training_usage(total, "float32").values()))


def deepspeed_total(params: int) -> int | None:
    """DeepSpeed ZeRO-2 model states per GPU (1 GPU, no offload), or None if unavailable."""
    try:
        with contextlib.redirect_stdout(None), contextlib.redirect_stderr(None):
            from deepspeed.runtime.zero.stage_1_and_2 import (
                estimate_zero2_model_states_mem_needs,
            )
    except Exception:
        return None
    gpu, _cpu = estimate_zero2_model_states_mem_needs(params, num_gpus_per_node=1, num_nodes=1,
                                                      cpu_offload=False)
    return int(gpu)


def memtracker_total(case: Case, batch: int, train: bool) -> int | None:
    """PyTorch's MemTracker on the same program, model and inputs built under fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            torch.manual_seed(0)
            model = case.build()
            inputs = case.inputs(batch)
            tracker = MemTracker()
            if train:
                opt = ADAMW(model.parameters())
                tracker.track_external(model, opt)
                with tracker:
                    model.train()
                    for _ in range(2):
                        loss = _loss(_call(model, inputs))
                        loss.backward()
                        del loss
                        opt.step()
                        opt.zero_grad(set_to_none=True)
                        tracker.reset_mod_stats()  # else it refuses the second iteration
            else:
                tracker.track_external(model)
                with tracker, torch.no_grad():
                    model.eval()
                    out = _call(model, inputs)
                    del out
        snap = tracker.get_tracker_snapshot("peak")
        return int(sum(dev["Total"] for dev in snap.values()))
    except Exception as exc:  # reported as a failure in the table
        print(f"  MemTracker failed on {case.name}: {type(exc).__name__}: {exc}"[:200])
        return None


def formula_total(case: Case, params: int, batch: int, train: bool) -> int:
    """ZeRO's 16 B/param (training) or 4 B/param (inference) + Korthikanti activations."""
    states = 16 * params if train else 4 * params
    if not (train and case.layers):
        return states
    s, b, h, a = case.seq, batch, case.hidden, case.heads
    return states + case.layers * s * b * h * (34 + 5 * a * s // h)


def _err(value: int | None, truth: int) -> str:
    if value is None:
        return "n/a"
    return f"{100.0 * (value - truth) / truth:+.1f}%"


def _settings(w: Wide) -> Settings:
    kw = w.settings
    return Settings(
        mode=kw["mode"], optimizer=kw.get("optimizer", "adamw"), loss=None, amp=kw.get("amp"),
        device="cpu", implementation=kw.get("implementation"),
        accumulate=kw.get("accumulate", 1), checkpoint=tuple(kw.get("checkpoint", ())),
        steps=None, optimize_frozen=kw.get("optimize_frozen", False))


def _describe(w: Wide) -> str:
    kw = w.settings
    if kw["mode"] == "infer":
        parts = ["infer"]
    else:
        parts = [f"train {kw.get('optimizer', 'adamw')}"]
        if kw.get("implementation"):
            parts.append(kw["implementation"])
        if kw.get("optimize_frozen"):
            parts.append("all params")
        if kw.get("accumulate", 1) > 1:
            parts.append(f"accumulate {kw['accumulate']}")
        if kw.get("checkpoint"):
            parts.append("checkpoint " + ",".join(kw["checkpoint"]))
    if kw.get("amp"):
        parts.append(f"{kw['amp']} autocast")
    return ", ".join(parts)


def _seeded() -> None:
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)


def memtracker_program(w: Wide) -> int | None:
    """MemTracker on the row's program, model and inputs built under fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    program = _settings(w).program()
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            _seeded()
            model = w.build()
            inputs = w.inputs()
            args, kwargs = ((), dict(inputs)) if isinstance(inputs, dict) else (inputs, {})
            call = caller(model, args, kwargs, program.amp)
            tracker = MemTracker()
            if program.mode == "infer":
                tracker.track_external(model)
                with tracker, torch.no_grad():
                    model.eval()
                    out = call()
                    del out
            else:
                params = [p for p in model.parameters()
                          if program.optimize_frozen or p.requires_grad]
                opt = make_factory(program.optimizer, program.implementation, "cpu")(params)
                tracker.track_external(model, opt)
                with tracker, checkpointed(model, program.checkpoint, real=True):
                    model.train()
                    for _ in range(program.steps):
                        for _ in range(program.accumulate):
                            loss = _loss(call())
                            loss.backward()
                            del loss
                            tracker.reset_mod_stats()  # else it refuses the next micro-batch
                        opt.step()
                        opt.zero_grad(set_to_none=True)
        snap = tracker.get_tracker_snapshot("peak")
        return int(sum(dev["Total"] for dev in snap.values()))
    except Exception as exc:  # reported as n/a in the table
        print(f"  MemTracker failed on {w.name}: {type(exc).__name__}: {exc}"[:200])
        return None


def measured_twice(model: nn.Module, inputs: Any, w: Wide) -> int:
    """The real peak, the larger of two runs of the same program.

    In a long process the profiler now and then misses an allocation (the run prints
    "Memory block of unknown size was allocated before the profiling started"), which can only
    lower a measured peak: seen once each on U-Net and Swin rows, -393,216 and -49,152 bytes
    against the same program measured three times in a fresh process (all equal).
    """
    runs = []
    for _ in range(2):
        _seeded()
        runs.append(measure(model, inputs, _settings(w).program()))
    if runs[0] != runs[1]:
        print(f"  {w.name}: two measurements differ: {runs[0]:,} and {runs[1]:,}")
    return max(runs)


def wide_section() -> None:
    """Run every wide row, print progress, write the ``estimate_accuracy_wide`` section."""
    started = time.time()
    tools = ["modelsize", "torchinfo", "accelerate", "deepspeed", "MemTracker", "formula"]
    rows, misses = [], []
    errors: dict[str, list[float]] = {}
    for w in WIDE:
        train = w.settings["mode"] == "train"
        label = f"{w.name} ({_describe(w)})"
        _seeded()
        model = w.build()
        params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        inputs = w.inputs()
        _seeded()
        t0 = time.time()
        try:
            ours: int | None = estimate(model, inputs, device="cpu", **w.settings).peak_bytes
            failure = ""
        except ModelSizeError as exc:
            ours, failure = None, str(exc).splitlines()[0]
        t_ours = time.time() - t0
        truth = measured_twice(model, inputs, w)
        values: dict[str, int | None] = {"modelsize": ours}
        _seeded()
        try:
            values["torchinfo"] = torchinfo_total(w.build(), inputs, train)
        except Exception as exc:
            print(f"  torchinfo failed on {w.name}: {type(exc).__name__}")
            values["torchinfo"] = None
        try:
            values["accelerate"] = accelerate_total(w.build, train)
        except Exception as exc:
            print(f"  accelerate failed on {w.name}: {type(exc).__name__}")
            values["accelerate"] = None
        values["deepspeed"] = deepspeed_total(params) if train else None
        values["MemTracker"] = memtracker_program(w)
        values["formula"] = 16 * params if train else 4 * params
        mode = "train" if train else "infer"
        for tool in tools:
            v = values[tool]
            if v is not None:
                errors.setdefault(f"{tool} {mode}", []).append(abs(100.0 * (v - truth) / truth))
        if ours is None:
            exact = "estimate refused"
        else:
            exact = "exact" if ours == truth else f"{ours - truth:+,} B"
        if ours is None or ours != truth:
            misses.append((label, ours, truth, failure))
        rows.append([w.name, _describe(w), f"{truth / 2**20:,.2f}",
                     *(_err(values[t], truth) for t in tools), exact,
                     f"{t_ours:.1f}"])
        print(f"{label:60s} measured {truth:>12,d} modelsize "
              f"{ours if ours is not None else 'refused':>12} ({exact})", flush=True)
    header = ["model", "program", "measured MiB", *tools, "modelsize vs measured",
              "modelsize s"]
    within = sum(1 for _, ours, truth, _ in misses
                 if ours is not None and abs(ours - truth) <= truth // 100)
    lines = [
        "## estimate_accuracy_wide",
        "",
        "Command: `python benchmarks/estimate_accuracy.py --wide`. "
        f"{len(WIDE)} configurations chosen to break the estimator, one batch each, on small "
        "models built from configs in `benchmarks/estimate_accuracy.py`. Measured = "
        "`modelsize.estimation.verify.measure` (the same program run for real on CPU under "
        "`torch.profiler(profile_memory=True)`: allocator events plus the bytes live before "
        "it); modelsize = `modelsize.estimate(..., device=\"cpu\")` with the row's "
        "settings. Peers as in the table above (formula: 16 B/param for training, whatever "
        "the optimizer, 4 B/param for inference; deepspeed n/a when not installed). "
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{torch.get_num_threads()} threads, CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}. Wall time {time.time() - started:.0f} s.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
        *("| " + " | ".join(r) + " |" for r in rows),
        "",
        "Median absolute error:",
        "",
        "| estimator | train | infer |",
        "|---|---|---|",
    ]
    for tool in tools:
        cells = []
        for m in ("train", "infer"):
            errs = errors.get(f"{tool} {m}")
            cells.append(f"{statistics.median(errs):.1f}%" if errs else "n/a")
        lines.append(f"| {tool} | {cells[0]} | {cells[1]} |")
    exact_rows = len(WIDE) - len(misses)
    lines += ["", f"modelsize: {exact_rows} of {len(WIDE)} rows exact to the byte, "
              f"{within} more within 1%, {len(misses) - within} over 1% or refused.", ""]
    for label, ours, truth, failure in misses:
        cause = CAUSES.get(label, "not investigated")
        what = (f"refused ({failure})" if ours is None
                else f"{ours - truth:+,} B ({100.0 * (ours - truth) / truth:+.2f}%)")
        lines.append(f"- **{label}**: {what}. {cause}")
    write_section("estimate_accuracy_wide", "\n".join(lines))
    print("\n".join(lines))


#: Why a wide row is not exact, found by comparing per-op allocations with a real run.
CAUSES: dict[str, str] = {
    "Wav2Vec2 CTC (train adamw)": (
        "By design: wav2vec2's LayerDrop (`layerdrop=0.1`) decides with a random draw whether "
        "each layer runs, so no trace knows which layers a step runs; the estimate stops with "
        "one line saying so. With LayerDrop off (next row) it is exact."),
    "nn.TransformerEncoder padded (infer)": (
        "Inference with `src_key_padding_mask` takes the encoder's nested-tensor fast path "
        "(`torch._nested_tensor_from_mask`), and the trace fails on the nested tensor "
        "(`NestedTensorImpl doesn't support sizes`). Without a mask (rows above) it is exact. "
        "A fix needs a model of the nested path in trace.py (not done)."),
    "LSTM packed sequences (train adamw)": (
        "`pack_padded_sequence` itself traces (its lengths are computed from the real input), "
        "but `_VF.lstm` on a packed batch is a composite whose C++ reads `batch_sizes` "
        "through `data_ptr`, which no dispatch mode can answer from the real twin; the trace "
        "fails. Fix needs a packed-LSTM decomposition in trace.py (not done)."),
    "nn.MultiheadAttention (train adamw)": (
        "`F.multi_head_attention_forward` runs through torch-function "
        "dispatch, where `trace._SavedScalars` is not active, so the 8-byte tensor autograd "
        "saves for `q * scale` is not counted (the xfail in tests/estimation/test_fused.py; "
        "a fix belongs in trace.py)."),
}


def main() -> None:
    """Run every case, print progress, write the RESULTS.md section."""
    started = time.time()
    rows = []
    errors: dict[str, list[float]] = {}
    tools = ["modelsize", "torchinfo", "accelerate", "deepspeed", "MemTracker", "formula"]
    for case in CASES:
        for batch in case.batches:
            for train in (True, False):
                mode = "train" if train else "infer"
                torch.manual_seed(0)
                model = case.build()
                params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
                torch.manual_seed(0)
                inputs = case.inputs(batch)
                t0 = time.time()
                ours = estimate(model, inputs, mode=mode, optimizer=ADAMW, device="cpu")
                t_ours = time.time() - t0
                truth = measured_peak(model, inputs, train)
                values: dict[str, int | None] = {"modelsize": ours.peak_bytes}
                torch.manual_seed(0)
                model = case.build()
                try:
                    values["torchinfo"] = torchinfo_total(model, inputs, train)
                except Exception as exc:
                    print(f"  torchinfo failed on {case.name}: {type(exc).__name__}")
                    values["torchinfo"] = None
                values["accelerate"] = accelerate_total(case.build, train)
                values["deepspeed"] = deepspeed_total(params) if train else None
                values["MemTracker"] = memtracker_total(case, batch, train)
                values["formula"] = formula_total(case, params, batch, train)
                for tool in tools:
                    v = values[tool]
                    if v is not None:
                        errors.setdefault(f"{tool} {mode}", []).append(
                            abs(100.0 * (v - truth) / truth))
                exact = "exact" if ours.peak_bytes == truth else f"{ours.peak_bytes - truth:+,} B"
                rows.append([case.name, str(batch), mode, f"{truth / 2**20:,.1f}",
                             *(_err(values[t], truth) for t in tools), exact,
                             f"{t_ours:.1f}"])
                print(f"{case.name:15s} b={batch:<3d} {mode:5s} measured {truth:>14,d} "
                      f"modelsize {ours.peak_bytes:>14,d} ({exact})", flush=True)
    header = ["model", "batch", "mode", "measured MiB", *tools, "modelsize vs measured",
              "modelsize s"]
    lines = [
        "## estimate_accuracy",
        "",
        "Command: `python benchmarks/estimate_accuracy.py`. Measured = the CPU allocator's "
        "peak from `torch.profiler(profile_memory=True)` events plus the bytes live before "
        "the program; training = two AdamW steps (for-loop, fp32), inference = one `no_grad` "
        "forward. Cells: signed error of each estimator against measured. "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"CPU capability {torch.backends.cpu.get_cpu_capability()}. "
        f"Wall time {time.time() - started:.0f} s.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
        *("| " + " | ".join(r) + " |" for r in rows),
        "",
        "Median absolute error:",
        "",
        "| estimator | train | infer |",
        "|---|---|---|",
    ]
    for tool in tools:
        cells = []
        for mode in ("train", "infer"):
            errs = errors.get(f"{tool} {mode}")
            cells.append(f"{statistics.median(errs):.1f}%" if errs else "n/a")
        lines.append(f"| {tool} | {cells[0]} | {cells[1]} |")
    lines += [
        "",
        "DeepSpeed's estimators count model states only, so they have no inference row; "
        "accelerate's ignore the batch; the formula's activation term is Korthikanti's "
        "16-bit transformer formula, applied as published to these fp32 runs. MemTracker "
        "sees what fake tensors see: it misses the oneDNN convolution buffers and the LSTM "
        "workspace that modelsize probes (see `modelsize/estimation/scratch.py`).",
        "",
        "**CUDA device model: not validated.** No GPU was available when it was written. "
        "`--device cuda` adds to the traced tensor peak the caching allocator's 512-byte "
        "rounding (replayed allocation by allocation), one cuBLAS workspace (32 MiB on sm90, "
        "8 MiB + 128 KiB otherwise) and an assumed 512 MiB CUDA context, and redirects dropout "
        "and scaled-dot-product attention to the CUDA kernels' memory behaviour (bool dropout "
        "masks; flash / memory-efficient attention). Not modelled: cuDNN workspaces, "
        "allocator fragmentation (`max_memory_reserved`), CUDA autocast's longer fp32 op "
        "list. To validate, compare `device_estimate.allocated_bytes` with "
        "`torch.cuda.max_memory_allocated()` after the same program on a GPU.",
    ]
    write_section("estimate_accuracy", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    if "--wide" in sys.argv[1:]:
        wide_section()
    else:
        main()
        wide_section()
