"""optimum-quanto weight-only models in ``estimate``, each against the same program run for
real on CPU under the allocator's profiler (``verify=True``).

Before: quanto's ops have no fake kernels, so the trace ran ``quanto::qbytes_mm`` as one op
and counted its output only: a float32 qint8 model was 309,264 B estimated against 1,341,456 B
measured (the CPU kernel casts the int8 weight to float32 and scales it before the matmul); a
qint4 float32 model dequantized each weight twice in the trace (the value-tracking mode ran
``aten.t`` again on the quantized weight's fake twin): 1,879,056 B against 1,354,768 B; a
bf16 qint4 (TinyGemm) model 187,912 B against 161,288 B (a float32 copy of each input from
``input.dequantize()``, which quanto calls on anything not exactly a ``torch.Tensor``).

qint4/qint2 weights (``WeightQBitsTensor``) dequantize through ``quanto::unpack``, whose CPU
kernel is a C++ extension quanto compiles on first use (``torch.utils.cpp_extension.load``:
ninja and a C++ compiler at run time); those cases are skipped where either is missing.
"""

from __future__ import annotations

import os
import shutil

import pytest

torch = pytest.importorskip("torch")
quanto = pytest.importorskip("optimum.quanto")

from torch import nn  # noqa: E402

import modelsize  # noqa: E402


def _model(weights: str, dtype: torch.dtype, trainable: tuple[str, ...]) -> nn.Module:
    """A trainable stem and head around a quanto-quantized (frozen) body."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 512), nn.ReLU(),
                        nn.Linear(512, 256), nn.Linear(256, 64)).to(dtype)
    body = nn.Sequential(net[1], net[3])
    quanto.quantize(body, weights=getattr(quanto, weights))
    quanto.freeze(body)
    net[1], net[3] = body[0], body[1]
    for name, p in net.named_parameters():
        p.requires_grad_(name.split(".")[0] in trainable)
    return net


CASES = [
    # (weights, dtype, mode, trainable): qint8 and qfloat8 run quanto::qbytes_mm, whose CPU
    # kernel is torch code (no compiler needed)
    ("qint8", torch.float32, "infer", ()),
    ("qint8", torch.bfloat16, "infer", ()),  # _weight_int8pack_mm
    ("qint8", torch.float32, "train", ("0", "4")),  # training the unquantized parts
    ("qfloat8", torch.float32, "infer", ()),
    ("qfloat8", torch.bfloat16, "train", ("4",)),
    # qint4 in bfloat16: TinyGemm (_weight_int4pack_mm_for_cpu), no unpack at run time
    ("qint4", torch.bfloat16, "infer", ()),
    ("qint4", torch.bfloat16, "train", ("0", "4")),
]

_COMPILER = pytest.mark.skipif(
    not (shutil.which("ninja") and (shutil.which("c++") or shutil.which("g++")))
    or os.environ.get("MODELSIZE_QUANTO_COMPILE") != "1",
    reason="quanto::unpack's CPU kernel is a C++ extension compiled at run time (a minute "
           "or more the first time): set MODELSIZE_QUANTO_COMPILE=1 to run these")

UNPACK_CASES = [
    # WeightQBitsTensor: each forward dequantizes (quanto::unpack, scale, shift)
    ("qint4", torch.float32, "infer", ()),
    ("qint4", torch.float32, "train", ("0", "4")),
    ("qint2", torch.float32, "infer", ()),
    ("qint2", torch.bfloat16, "infer", ()),  # group of 64: not TinyGemm's
]


@pytest.mark.parametrize(("weights", "dtype", "mode", "trainable"), CASES)
def test_quanto_trace_matches_real_run(weights: str, dtype: torch.dtype, mode: str,
                                       trainable: tuple[str, ...]) -> None:
    _check(weights, dtype, mode, trainable)


@_COMPILER
@pytest.mark.parametrize(("weights", "dtype", "mode", "trainable"), UNPACK_CASES)
def test_quanto_unpacked_weights_match_real_run(weights: str, dtype: torch.dtype, mode: str,
                                                trainable: tuple[str, ...]) -> None:
    _check(weights, dtype, mode, trainable)


def _check(weights: str, dtype: torch.dtype, mode: str, trainable: tuple[str, ...]) -> None:
    model = _model(weights, dtype, trainable)
    x = torch.randn(8, 256, dtype=dtype)
    est = modelsize.estimate(model, (x,), mode=mode, verify=True)
    v = est.verification
    assert v is not None and v.measured_bytes is not None, v
    assert est.peak_bytes == v.measured_bytes


def test_qint8_float32_counts_the_scaled_weight() -> None:
    # quanto::qbytes_mm on CPU with float32 inputs (library/qbytes_mm.py, qbytes_mm): the
    # int8 weight is made float32 and scaled (output_scales * weights) before the matmul; at
    # least one float32 copy of the larger weight is live at the peak, beyond the inputs and
    # the int8 weights
    model = _model("qint8", torch.float32, ())
    est = modelsize.estimate(model, (torch.randn(8, 256),), mode="infer")
    params = sum(t.numel() * t.element_size() for t in (
        model[0].weight, model[0].bias, model[4].weight, model[4].bias,
        model[1].bias, model[3].bias)) + 2 * 512 * 256 + (512 + 256) * 4
    assert est.peak_bytes >= params + 512 * 256 * 4
