"""The estimate equals the CPU allocator's measured peak, to the byte.

Measured side: :mod:`tests.estimation.groundtruth` runs the same program for real under
``torch.profiler`` and reads the allocator's own alloc/free events. Nothing here calls into
the estimator to compute an expected number.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from modelsize.estimation import estimate
from tests.estimation import models
from tests.estimation.groundtruth import measure

OPTIMIZERS = {
    "sgd": functools.partial(torch.optim.SGD, lr=0.1),
    "momentum": functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "adagrad": torch.optim.Adagrad,
    "rmsprop": torch.optim.RMSprop,
}


def _flags(impl: str) -> dict[str, bool]:
    return {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}


def _check(model: torch.nn.Module, inputs: Any, *, optimizer: str = "adamw",
           impl: str = "for-loop", mode: str = "train", accumulate: int = 1,
           amp: torch.dtype | None = None, checkpoint: tuple[str, ...] = (),
           measured_model: torch.nn.Module | None = None) -> None:
    est = estimate(model, inputs, mode=mode, optimizer=optimizer, implementation=impl,
                   accumulate=accumulate, amp=amp, checkpoint=checkpoint, device="cpu")
    real = measure(measured_model or model, inputs, mode=mode,
                   optimizer=functools.partial(OPTIMIZERS[optimizer], **_flags(impl)),
                   accumulate=accumulate, amp=amp)
    assert est.peak_bytes == real, (est.peak_bytes - real, est.phase)
    assert sum(est.categories.values()) == est.peak_bytes


@pytest.mark.parametrize("mode", ["train", "infer"])
@pytest.mark.parametrize("batch", [1, 8])
def test_cnn_with_kernel_scratch(mode: str, batch: int) -> None:
    torch.manual_seed(0)
    _check(models.SmallCNN(), (torch.randn(batch, 1, 28, 28),), mode=mode)


def test_cnn_scratch_is_most_of_an_inference_peak() -> None:
    torch.manual_seed(0)
    model, x = models.SmallCNN(), torch.randn(8, 1, 28, 28)
    est = estimate(model, (x,), mode="infer", device="cpu")
    assert est.scratch_bytes > 0
    assert est.peak_bytes == measure(model, (x,), mode="infer")


@pytest.mark.parametrize("mode", ["train", "infer"])
def test_batchnorm_resnet_block(mode: str) -> None:
    torch.manual_seed(0)
    _check(models.ResBlockNet(), (torch.randn(4, 3, 64, 64),), mode=mode)


@pytest.mark.parametrize("mode", ["train", "infer"])
def test_lstm_workspace(mode: str) -> None:
    torch.manual_seed(0)
    _check(models.Recurrent(), (torch.randn(20, 4, 16),), mode=mode)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("impl", ["for-loop", "foreach", "fused"])
def test_optimizers_where_the_step_is_the_peak(optimizer: str, impl: str) -> None:
    if impl == "fused" and optimizer == "rmsprop":
        pytest.skip("torch.optim.RMSprop has no fused implementation")
    torch.manual_seed(0)
    _check(models.Wide(), (torch.randn(1, 256),), optimizer=optimizer, impl=impl)


def test_optimizer_given_as_a_callable() -> None:
    torch.manual_seed(0)
    model, x = models.Wide(), torch.randn(1, 256)
    factory = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, foreach=True)
    est = estimate(model, (x,), optimizer=factory, device="cpu")
    assert est.peak_bytes == measure(model, (x,), optimizer=factory)
    assert est.setup.optimizer == "SGD"


@pytest.mark.parametrize("build", [models.tiny_gpt2, models.tiny_llama])
@pytest.mark.parametrize("mode", ["train", "infer"])
def test_transformers(build: Any, mode: str) -> None:
    model, inputs = build()
    _check(model, inputs, mode=mode)


@pytest.mark.parametrize("build", [models.tiny_gpt2, models.tiny_llama])
@pytest.mark.parametrize("amp", [torch.bfloat16, torch.float16])
def test_autocast(build: Any, amp: torch.dtype) -> None:
    model, inputs = build()
    _check(model, inputs, amp=amp)


def test_autocast_inference() -> None:
    model, inputs = models.tiny_llama()
    _check(model, inputs, amp=torch.bfloat16, mode="infer")


def test_pure_bf16_model() -> None:
    torch.manual_seed(0)
    model = models.Stack().to(torch.bfloat16)
    _check(model, (torch.randn(2, 16, 32, dtype=torch.bfloat16),))


def test_gradient_accumulation() -> None:
    model, inputs = models.tiny_gpt2()
    _check(model, inputs, accumulate=3)


def test_expanded_gradient_is_cloned_by_blas() -> None:
    # sum() hands an expanded (stride 0) gradient to the last Linear's mm
    torch.manual_seed(0)
    _check(models.Stack(), (torch.randn(4, 16, 32),))


def test_activation_checkpointing() -> None:
    torch.manual_seed(0)
    plain = models.Stack(n=4)
    torch.manual_seed(0)
    checkpointed = models.Stack(n=4, checkpointed=True)
    x = torch.randn(8, 32, 32)
    _check(plain, (x,), checkpoint=("blocks.*",), measured_model=checkpointed)
    without = estimate(plain, (x,), optimizer="adamw", implementation="for-loop", device="cpu")
    with_ckpt = estimate(plain, (x,), optimizer="adamw", implementation="for-loop",
                         checkpoint=("Block",), device="cpu")
    assert with_ckpt.peak_bytes < without.peak_bytes
