"""The public surface of ``modelsize.estimate``: result types, errors, laziness, no real memory."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import modelsize
import modelsize.estimation as api
from modelsize.errors import EstimateError, UsageError
from modelsize.estimation import Estimate, MemoryCategory, estimate
from tests.estimation import models


def test_public_api_is_locked() -> None:
    assert sorted(api.__all__) == sorted([
        "CacheGroup", "CacheKind", "DeviceEstimate", "DeviceTerm", "Estimate",
        "GenerationInfo", "LoraSpec", "MemoryCategory", "Parallel", "PhaseSpan", "Setup", "Source",
        "Strategy", "Verification", "estimate",
    ])
    assert modelsize.Estimate is Estimate
    assert [c.value for c in MemoryCategory] == [
        "parameters", "buffers", "gradients", "optimizer_state", "activations", "kv_cache",
        "temporaries", "inputs", "communication",
    ]


def test_the_public_name_stays_the_function() -> None:
    # Once, the function and its subpackage shared the name modelsize.estimate: importing the
    # subpackage (or anything that imported it) rebound the attribute to the module.
    code = textwrap.dedent("""
        import types
        import torch
        import modelsize
        import modelsize.estimation
        import modelsize.estimation.core
        from torch import nn
        model, x = nn.Linear(4, 2), (torch.randn(3, 4),)
        first = modelsize.estimate(model, x, mode="infer").peak_bytes
        modelsize.Estimate
        second = modelsize.estimate(model, x, mode="infer").peak_bytes
        from modelsize import estimate
        third = estimate(model, x, mode="infer").peak_bytes
        print(first, second, third, isinstance(estimate, types.FunctionType),
              estimate is modelsize.estimate)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    # weight 2x4 + bias 2 (fp32), input 3x4, output 3x2: all live at the end of the forward
    peak = (2 * 4 + 2) * 4 + 3 * 4 * 4 + 3 * 2 * 4
    assert out.stdout.split() == [str(peak)] * 3 + ["True", "True"]


def test_defaults_are_recorded_as_defaults() -> None:
    model, x = models.Wide(), torch.randn(1, 256)
    est = estimate(model, (x,))
    assert (est.setup.device, est.setup.optimizer) == ("cpu", "adamw")
    assert est.setup.to_dict()["sources"] == {"device": "default", "optimizer": "default"}
    given = estimate(model, (x,), device="cpu", optimizer="sgd")
    assert given.setup.to_dict()["sources"] == {"device": "given", "optimizer": "given"}


def test_import_does_not_import_torch() -> None:
    code = "import sys, modelsize, modelsize.estimation; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_missing_torch_is_one_clear_error() -> None:
    code = textwrap.dedent("""
        import sys
        sys.modules["torch"] = None
        import modelsize
        try:
            modelsize.estimate(object(), ())
        except modelsize.MissingDependencyError as exc:
            print(exc)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert "needs torch" in out.stdout and "modelsize[estimate]" in out.stdout


def test_result_shape_and_json() -> None:
    model, inputs = models.tiny_gpt2()
    est = estimate(model, inputs, device="cpu")
    assert sum(est.categories.values()) == est.peak_bytes
    assert max(v for _, v in est.timeline) == est.peak_bytes
    assert est.phase.name in ("forward", "backward", "optimizer")
    assert [p.name for p in est.phases][:4] == ["forward", "backward", "optimizer", "zero_grad"]
    assert est.phases[-1].step == 2
    assert est.parameter_count == sum(p.numel() for p in model.parameters())
    assert any(name.startswith("transformer.h.0") for name in est.module_activations)
    data = json.loads(json.dumps(est.to_dict()))
    assert data["peak_bytes"] == est.peak_bytes
    assert set(data["categories"]) == {c.value for c in MemoryCategory}
    assert data["device_estimate"]["allocated_bytes"] == est.peak_bytes


def test_inference_activations_are_the_output_and_what_modules_keep() -> None:
    torch.manual_seed(0)
    model = models.Stack()
    x = torch.randn(2, 8, 32)
    est = estimate(model, (x,), mode="infer", device="cpu")
    assert est.setup.optimizer is None
    # no_grad keeps nothing but the output (2x8x10 floats) once the forward ends
    assert sum(est.module_activations.values()) == 2 * 8 * 10 * 4


def test_cuda_terms_add_up_and_are_marked_unvalidated() -> None:
    model, inputs = models.tiny_gpt2()
    est = estimate(model, inputs, device="cuda")
    dev = est.device_estimate
    assert not dev.validated
    terms = {t.name: t.nbytes for t in dev.terms}
    assert terms["tensors"] + terms["kernel_scratch"] == est.peak_bytes
    assert dev.allocated_bytes == est.peak_bytes + terms["allocator_rounding"] + terms[
        "cublas_workspace"]
    assert dev.total_bytes == dev.allocated_bytes + terms["cuda_context"]
    assert terms["allocator_rounding"] >= 0
    assert any("other GPUs and versions are not" in n for n in est.notes)


def test_cuda_terms_when_the_blocks_peak_after_the_tensors() -> None:
    """A CNN's tensors peak in its convolutions; cuBLAS's 32 MiB workspace comes with the
    linear head, after them, and the blocks peak there. The terms still add up, and the
    rounding is the blocks' excess at their own peak (it read -20.6 MiB for ResNet-50)."""
    model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(32, 10))
    est = estimate(model, (torch.randn(4, 3, 64, 64),), mode="infer", device="cuda")
    dev = est.device_estimate
    terms = {t.name: t.nbytes for t in dev.terms}
    assert terms["tensors"] + terms["kernel_scratch"] == est.peak_bytes
    assert terms["peak_moment"] < 0
    assert 0 <= terms["allocator_rounding"] < 512 * 16
    assert terms["cublas_workspace"] >= 32 << 20
    assert dev.allocated_bytes == sum(v for k, v in terms.items() if k != "cuda_context")
    assert dev.allocated_bytes < est.peak_bytes + terms["cublas_workspace"]


def test_bad_arguments_are_usage_errors() -> None:
    model = models.Wide()
    x = torch.randn(1, 256)
    with pytest.raises(UsageError):
        estimate(model, (x,), mode="inference")
    with pytest.raises(UsageError):
        estimate(object(), (x,))  # type: ignore[arg-type]
    with pytest.raises(UsageError):
        estimate(model, (x,), optimizer="lion")
    with pytest.raises(UsageError):
        estimate(model, (x,), amp="fp8")
    with pytest.raises(UsageError):
        estimate(model, (x,), checkpoint=("nothing.matches",))
    with pytest.raises(UsageError):
        estimate(model, (x,), device="tpu")


def test_untraceable_model_is_one_estimate_error() -> None:
    class DataDependent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x)
            return y if bool(y.sum() > 0) else -y

    with pytest.raises(EstimateError, match="tracing DataDependent failed"):
        estimate(DataDependent(), (torch.randn(2, 4),))
    with pytest.raises(EstimateError, match="one-element"):
        estimate(models.Wide(), (torch.randn(1, 256),), loss=lambda out: out)


def test_no_real_memory_for_a_model_larger_than_this_machine() -> None:
    code = textwrap.dedent("""
        # VmHWM: the peak of this process's own memory; ru_maxrss carries the parent's
        # over across fork and exec (a pytest worker of 1.7 GB failed the test).
        import torch
        from torch import nn
        from modelsize.estimation import estimate
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(60000, 60000), nn.ReLU(), nn.Linear(60000, 60000))
        est = estimate(model, (torch.empty(8, 60000, device="meta"),), optimizer="adamw")
        hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM"))
        print(est.peak_bytes, int(hwm.split()[1]) * 1024)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    peak, rss = map(int, out.stdout.split())
    params = 2 * (60000 * 60000 + 60000) * 4
    assert peak > 4 * params  # weights, grads, two Adam moments: 115 GB on paper
    assert rss < 1 << 30
