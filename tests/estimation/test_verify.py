"""``verify=True`` / ``--verify``: the program run for real on CPU, beside its estimate.

The verification's measured number is itself checked against :mod:`tests.estimation.groundtruth`
(written apart from the library), and the estimate must equal it to the byte.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import nn

from modelsize.estimation import estimate
from modelsize.report.estimate_text import render_estimate
from tests.estimation import models
from tests.estimation.groundtruth import measure

ADAMW = functools.partial(torch.optim.AdamW, foreach=False)  # the default, as run on CPU


class ConvNet(nn.Module):
    """Conv, BatchNorm, ReLU, pooling, a second conv, global pooling and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class Tagger(nn.Module):
    """Embedding, a batch-first bidirectional GRU, and a linear head on every step."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 16)
        self.gru = nn.GRU(16, 32, batch_first=True, bidirectional=True)
        self.head = nn.Linear(64, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.gru(self.emb(ids))[0])


class Encoder(nn.Module):
    """Token embedding, two ``nn.TransformerEncoderLayer``s and a vocabulary head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 100)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.emb(ids)))


def conv_net() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return ConvNet(), (torch.randn(4, 3, 32, 32),)


def tagger() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return Tagger(), (torch.randint(0, 100, (4, 12)),)


def encoder() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return Encoder(), (torch.randint(0, 100, (4, 16)),)


@pytest.mark.parametrize("build", [conv_net, tagger, encoder])
@pytest.mark.parametrize("mode", ["train", "infer"])
def test_measured_equals_estimated(build: Any, mode: str) -> None:
    model, inputs = build()
    est = estimate(model, inputs, mode=mode, verify=True)
    v = est.verification
    assert v is not None and v.batch is None and v.requested_batch == 4 and not v.reason
    assert v.measured_bytes == measure(model, inputs, mode=mode, optimizer=ADAMW)
    assert v.estimated_bytes == est.peak_bytes
    assert v.difference == 0
    line = render_estimate(est).splitlines()[3]
    assert line.startswith(f"verified on CPU: measured {v.measured_bytes:,} bytes")
    assert "difference 0 bytes" in line


def test_a_program_over_the_budget_runs_at_a_smaller_batch() -> None:
    model, (x,) = conv_net()
    x = torch.randn(8, 3, 32, 32)
    budget = estimate(model, (x[:3].clone(),)).peak_bytes  # room for 3 images, not 4
    est = estimate(model, (x,), verify=True, verify_budget=budget)
    v = est.verification
    assert v is not None and v.batch == 3 and v.requested_batch == 8
    assert v.measured_bytes == measure(model, (x[:3].clone(),), optimizer=ADAMW)
    assert v.difference == 0 and v.estimated_bytes < est.peak_bytes
    assert f"batch 8 needs {est.peak_bytes:,} bytes, over the {budget:,}-byte budget" in v.reason
    assert "verified on CPU at batch 3 (batch 8 needs" in render_estimate(est)
    none = estimate(model, (x,), verify=True, verify_budget=1000).verification
    assert none is not None and none.measured_bytes is None and "even batch 1" in none.reason


def test_a_meta_model_runs_zero_filled_with_its_ties_kept() -> None:
    import transformers

    real, inputs = models.tiny_gpt2()
    with torch.device("meta"):
        meta = transformers.GPT2LMHeadModel(real.config)
    meta_inputs = {k: torch.empty(v.shape, dtype=v.dtype, device="meta")
                   for k, v in inputs.items()}
    est = estimate(meta, meta_inputs, verify=True)
    v = est.verification
    assert v is not None and v.difference == 0
    # the same program on the real model (tied lm_head and wte) measures the same
    zeros = {k: torch.zeros_like(v) for k, v in inputs.items()}
    assert v.measured_bytes == measure(real, zeros, optimizer=ADAMW)


def test_a_cuda_estimate_is_verified_through_its_cpu_twin() -> None:
    model, inputs = tagger()
    est = estimate(model, inputs, device="cuda", verify=True)
    v = est.verification
    assert v is not None and v.difference == 0
    cpu = estimate(model, inputs, device="cpu", implementation="foreach")  # CUDA's default
    assert v.estimated_bytes == cpu.peak_bytes
    foreach = functools.partial(torch.optim.AdamW, foreach=True)
    assert v.measured_bytes == measure(model, inputs, optimizer=foreach)
    assert "through the same program's CPU estimate" in render_estimate(est)


def test_the_model_and_the_random_state_are_left_alone() -> None:
    model, inputs = encoder()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.eval()
    rng = torch.get_rng_state()
    estimate(model, inputs, verify=True)
    assert torch.equal(torch.get_rng_state(), rng)
    assert not model.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
