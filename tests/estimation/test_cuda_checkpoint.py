"""A CUDA estimate with activation checkpointing: the recomputation in the backward takes the
same (CUDA) kernels as the forward, for both checkpoint implementations."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as ckpt
from torch import nn

from modelsize.estimation import estimate
from tests.estimation.models import tiny_llama


class Attention(nn.Module):
    """Self-attention through scaled_dot_product_attention with dropout, checkpointed by hand."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.pre = nn.Linear(32, 32)
        self.qkv = nn.Linear(32, 96)
        self.out = nn.Linear(32, 32)
        self.reentrant = reentrant

    def block(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 4, 8).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), dropout_p=0.1)
        return F.dropout(self.out(y.transpose(1, 2).reshape(x.shape)), 0.1, self.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ckpt.checkpoint(self.block, self.pre(x), use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [False, True])
def test_hand_checkpointed_attention_traces_for_cuda(reentrant: bool) -> None:
    run_fn = ckpt._run_fn_with_dynamo_disabled
    backward = ckpt.CheckpointFunction.__dict__["backward"]
    x = torch.randn(2, 16, 32)
    est = estimate(Attention(reentrant), (x,), optimizer="sgd", device="cuda", steps=1)
    assert est.peak_bytes > 0
    # the rerouting is put back
    assert ckpt._run_fn_with_dynamo_disabled is run_fn
    assert ckpt.CheckpointFunction.__dict__["backward"] is backward


def test_llama_checkpointed_for_cuda_saves_less_than_without() -> None:
    model, _ = tiny_llama()
    ids = torch.randint(0, 512, (16, 64))
    inputs = {"input_ids": ids, "labels": ids}
    kw = {"optimizer": "adamw", "device": "cuda", "amp": "bf16", "steps": 1}
    plain = estimate(model, inputs, **kw)
    checkpointed = estimate(model, inputs, checkpoint=("LlamaDecoderLayer",), **kw)
    assert checkpointed.peak_bytes < plain.peak_bytes
