"""Models from the wide accuracy benchmark that once broke the estimator, one test per fix.

Each model is built here; the measured side is :mod:`tests.estimation.groundtruth` (the same
program run for real under the CPU allocator's profiler), independent of the estimator.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from modelsize.estimation import estimate
from modelsize.estimation.tracker import CountingFakeMode
from tests.estimation.groundtruth import measure

ADAMW = functools.partial(torch.optim.AdamW, foreach=False)


class ChannelsLastResidual(nn.Module):
    """An inverted residual block (1x1 expand, 3x3 depthwise, 1x1 project + BatchNorm) around
    a skip: the skip's gradient reaches the last BatchNorm's backward in contiguous layout
    while its input is channels-last."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.block = nn.Sequential(
            nn.Conv2d(8, 32, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU6(),
            nn.Conv2d(32, 32, 3, padding=1, groups=32, bias=False), nn.BatchNorm2d(32),
            nn.ReLU6(), nn.Conv2d(32, 8, 1, bias=False), nn.BatchNorm2d(8))
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = x + self.block(x)
        return self.head(x.mean((2, 3)))


def test_channels_last_residual_training_is_exact() -> None:
    torch.manual_seed(0)
    model = ChannelsLastResidual()
    x = torch.randn(2, 3, 16, 16).contiguous(memory_format=torch.channels_last)
    est = estimate(model, (x,), mode="train", optimizer=ADAMW, device="cpu")
    assert est.peak_bytes == measure(model, (x,), optimizer=ADAMW)


@pytest.mark.parametrize("grad_channels_last", [False, True])
@pytest.mark.parametrize("input_channels_last", [False, True])
def test_batch_norm_backward_grad_input_follows_input_layout(
        grad_channels_last: bool, input_channels_last: bool) -> None:
    go, x = torch.randn(2, 8, 4, 4), torch.randn(2, 8, 4, 4)
    if grad_channels_last:
        go = go.contiguous(memory_format=torch.channels_last)
    if input_channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    stats = [torch.ones(8), torch.zeros(8), torch.ones(8), torch.zeros(8), torch.ones(8)]
    op = torch.ops.aten.native_batch_norm_backward.default
    real = op(go, x, *stats, True, 1e-5, [True, True, True])
    with CountingFakeMode() as mode:
        fake = op(*(mode.from_tensor(t) for t in (go, x, *stats)), True, 1e-5,
                  [True, True, True])
        strides = [t.stride() for t in fake]
    assert strides == [t.stride() for t in real]


def test_swin_training_is_exact() -> None:
    """Swin's pooler reads the final LayerNorm's output transposed, so that LayerNorm's
    backward gets a transposed gradient; the kernel still returns a contiguous one."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.SwinForImageClassification(transformers.SwinConfig(
        image_size=16, patch_size=4, embed_dim=24, depths=[1], num_heads=[2], window_size=2,
        num_labels=10, drop_path_rate=0.0))
    x = torch.randn(2, 3, 16, 16)
    est = estimate(model, (x,), mode="train", optimizer=ADAMW, device="cpu")
    assert est.peak_bytes == measure(model, (x,), optimizer=ADAMW)


@pytest.mark.parametrize("grad_transposed", [False, True])
@pytest.mark.parametrize("input_transposed", [False, True])
def test_layer_norm_backward_grad_input_is_contiguous_like_the_kernel(
        grad_transposed: bool, input_transposed: bool) -> None:
    def rows(transposed: bool) -> torch.Tensor:
        return torch.randn(2, 8, 6).transpose(1, 2) if transposed else torch.randn(2, 6, 8)

    go, x = rows(grad_transposed), rows(input_transposed)
    stats = [torch.zeros(2, 6, 1), torch.ones(2, 6, 1), torch.ones(8), torch.zeros(8)]
    op = torch.ops.aten.native_layer_norm_backward.default
    real = op(go, x, [8], *stats, [True, True, True])
    with CountingFakeMode() as mode:
        go_f, x_f, *stats_f = (mode.from_tensor(t) for t in (go, x, *stats))
        fake = op(go_f, x_f, [8], *stats_f, [True, True, True])
        strides = [t.stride() for t in fake]
    assert strides == [t.stride() for t in real]
