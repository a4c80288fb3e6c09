"""The estimate equals the CPU allocator's measured peak, to the byte.

Measured side: :mod:`tests.estimation.groundtruth` runs the same program for real under
``torch.profiler`` and reads the allocator's own alloc/free events. Nothing here calls into
the estimator to compute an expected number.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

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


# -- bfloat16 matmuls: oneDNN where this CPU supports it, BLAS elsewhere ----------------------


@contextlib.contextmanager
def _onednn(enabled: bool) -> Iterator[None]:
    """oneDNN off stands for a CPU without its bfloat16/float16 GEMMs (BLAS runs them)."""
    saved = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = enabled
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = saved


@pytest.mark.parametrize("onednn", [True, False], ids=["onednn", "blas"])
def test_pure_bf16_model(onednn: bool) -> None:
    """On a CPU with AVX512-BF16 or AMX, PyTorch runs bfloat16 matmuls through oneDNN, whose
    scratch pads the estimate probes (this machine's), and says so; without, through BLAS."""
    torch.manual_seed(0)
    model = models.Stack().to(torch.bfloat16)
    x = torch.randn(2, 16, 32, dtype=torch.bfloat16)
    with _onednn(onednn):
        _check(model, (x,))
        est = estimate(model, (x,), implementation="for-loop", device="cpu")
    on_onednn = onednn and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert any("bfloat16 matmuls run through oneDNN" in n for n in est.notes) == on_onednn


# -- a model that checkpoints its own blocks ----------------------------------------------------


@pytest.mark.parametrize("mode", ["train", "infer"])
@pytest.mark.parametrize("blocks", [1, 4])
def test_model_that_checkpoints_its_own_blocks(mode: str, blocks: int) -> None:
    """``checkpoint(block, x, use_reentrant=False)`` in the model's forward keeps the CPU
    generator's state (``torch.get_rng_state()``, 5,056 bytes) per block until its backward,
    and the recomputation forks the generator (one more copy while it runs)."""
    torch.manual_seed(0)
    _check(models.Stack(n=blocks, checkpointed=True), (torch.randn(8, 32, 32),), mode=mode)


def test_checkpoint_rng_states_are_host_memory_for_cuda() -> None:
    """For a CUDA estimate the saved RNG states (CPU tensors) are not GPU memory: a model
    that preserves them needs what one that does not needs, and the note names them."""
    torch.manual_seed(0)
    x = torch.randn(8, 32, 32)
    kept = estimate(models.Stack(n=3, checkpointed=True), (x,), device="cuda")
    dropped = estimate(models.Stack(n=3, checkpointed=True, preserve_rng_state=False), (x,),
                       device="cuda")
    assert kept.peak_bytes == dropped.peak_bytes
    assert any("RNG states" in n and "16 bytes" in n and "host memory" in n for n in kept.notes)
    assert not any("RNG states" in n for n in dropped.notes)


# -- autocast: a half tensor added to a float32 one -------------------------------------------


@pytest.mark.parametrize("family", ["bart", "pegasus"])
@pytest.mark.parametrize("amp", [torch.bfloat16, torch.float16])
def test_encoder_decoder_autocast_inference(family: str, amp: torch.dtype) -> None:
    """The half logits plus the float32 ``final_logits_bias``: the CPU TensorIterator copies
    the logits to float32 for the add (a temporary the meta kernel never makes)."""
    model, inputs = models.tiny_seq2seq(family)
    _check(model, inputs, amp=amp, mode="infer")


@pytest.mark.parametrize("op", ["add", "mul", "where", "add_"])
def test_type_promotion_copies_the_other_input(op: str) -> None:
    a, b = torch.zeros(2, 32, 512, dtype=torch.bfloat16), torch.zeros(1, 512)

    class Op(nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            if op == "where":
                return torch.where(x > 0, x, y)
            if op == "add_":
                return x.clone().add_(y)
            return getattr(torch, op)(x, y)

    est = estimate(Op(), (a, b), mode="infer", device="cpu")
    assert est.peak_bytes == measure(Op(), (a, b), mode="infer")


# -- sparse gradients ---------------------------------------------------------------------------


SPARSE = {
    "sparse-adam": torch.optim.SparseAdam,
    "sgd": functools.partial(torch.optim.SGD, lr=0.1),
    "adagrad": torch.optim.Adagrad,
}


@pytest.mark.parametrize("optimizer", list(SPARSE))
@pytest.mark.parametrize("padding_idx", [None, 7], ids=["all", "padding"])
@pytest.mark.parametrize("head", [False, True], ids=["sum", "head"])
def test_sparse_embedding_gradients(optimizer: str, padding_idx: int | None,
                                    head: bool) -> None:
    """``nn.Embedding(sparse=True)``: sparse COO gradients (indices and values), coalesced by
    the optimizer to the distinct indices, which the trace counts from the real ids."""
    if optimizer == "sparse-adam" and head:
        pytest.skip("SparseAdam takes sparse gradients only")
    model, ids = models.SparseBag(padding_idx, head), models.repeated_ids()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Adagrad: sparse invariant checks
        est = estimate(model, (ids,), optimizer=SPARSE[optimizer], device="cpu")
        real = measure(model, (ids,), optimizer=SPARSE[optimizer])
    assert est.peak_bytes == real, (est.peak_bytes - real, est.phase)
    assert not est.notes


def test_sparse_gradients_without_index_values_are_an_upper_bound() -> None:
    model, ids = models.SparseBag(), models.repeated_ids()
    meta = torch.empty(ids.shape, dtype=ids.dtype, device="meta")
    est = estimate(model, (meta,), optimizer=torch.optim.SparseAdam, device="cpu")
    assert est.peak_bytes > measure(model, (ids,), optimizer=torch.optim.SparseAdam)
    assert any("coalesce keeps every index" in n for n in est.notes)


def test_sparse_momentum_is_named_not_modelled() -> None:
    model, ids = models.SparseBag(head=True), models.repeated_ids()
    sgd = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    est = estimate(model, (ids,), optimizer=sgd, device="cpu")
    assert any("in-place arithmetic on a sparse tensor" in n for n in est.notes)
