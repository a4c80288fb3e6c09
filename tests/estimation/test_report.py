"""The human report of an estimate."""

from __future__ import annotations

import torch

from modelsize.estimation import estimate
from modelsize.estimation.result import FitResult, Suggestion
from modelsize.report.estimate_text import module_groups, render_estimate, render_fit
from tests.estimation import models


def test_report_lists_every_category_and_the_peak() -> None:
    model, inputs = models.tiny_gpt2()
    est = estimate(model, inputs, device="cuda")
    text = render_estimate(est, description="tiny", batch=2, seq=64,
                           suggestions=[Suggestion("half the batch (1)", "--batch 1",
                                                   est.peak_bytes // 2, 0)])
    assert f"({est.peak_bytes:,} bytes)" in text
    for cat, n in est.categories.items():
        if cat.value in ("communication", "kv_cache"):  # one device, no generation: left out
            assert n == 0 and cat.value not in text
            continue
        assert cat.value in text and f"{n:,}" in text
    assert "--batch 1" in text and "-50%" in text
    assert "CUDA device estimate (PyTorch 2.11's kernels" in text
    assert "cublas_workspace" in text and "cuda_context" in text


def test_module_groups_fold_numbered_layers() -> None:
    groups = dict(module_groups({"h.0.attn": 3, "h.0.mlp": 4, "h.1.attn": 5, "ln_f": 1}))
    assert groups == {"h.0": 7, "h.1": 5, "ln_f": 1}


def test_fit_sentences() -> None:
    fit = FitResult("batch", 100, "peak", 9, 95, 1000, ((1, 15), (2, 25), (9, 95), (10, 105)))
    text = render_fit(fit)
    assert "largest batch" in text and ": 9 " in text and "10 needs" in text
    none = FitResult("batch", 10, "peak", 0, 0, 1000, ((1, 15),))
    assert "nothing fits" in render_fit(none)


def test_inference_report() -> None:
    torch.manual_seed(0)
    est = estimate(models.Stack(), (torch.randn(2, 8, 32),), mode="infer", device="cpu")
    text = render_estimate(est)
    assert "inference" in text and "optimizer_state" in text
