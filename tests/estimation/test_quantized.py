"""Quantized layers in ``estimate``: torchao tensor subclasses and bitsandbytes layers traced
exactly, each against the same program run for real on CPU under the allocator's profiler
(``verify=True``); ``quantize=`` and ``--quantize``.

Before: torchao int8 weight-only weights were counted at float32 (the wrapper's nominal
storage, not its int8 ``qdata`` and scales), a bitsandbytes ``Linear4bit`` model failed to
trace (``Params4bit`` rebuilt around a fake tensor), ``gemm_4bit``'s dequantized weight was
missing (its fake kernel makes the output only), and a ``Linear8bitLt`` trace left fake
tensors in the layer's ``state``.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchao")
pytest.importorskip("bitsandbytes")

from torch import nn  # noqa: E402

import modelsize  # noqa: E402
from modelsize.errors import UsageError  # noqa: E402
from modelsize.estimation import MemoryCategory  # noqa: E402
from modelsize.estimation.quantized import (  # noqa: E402
    quantization_of,
    quantize_model,
    storages,
)

pytestmark = pytest.mark.filterwarnings(
    # torchao 0.18 registers an Enum with torch.compile's pytree the deprecated way
    "ignore:.*is an Enum subclass and is now natively supported:FutureWarning",
)


class _Net(nn.Module):
    """A quantizable body (``a``, ``b``) between a trainable stem and head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(256, 256)
        self.a = nn.Linear(256, 512)
        self.b = nn.Linear(512, 256)
        self.head = nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.b(torch.relu(self.a(self.stem(x))))))


def _net(scheme: str | None, dtype: torch.dtype, trainable: tuple[str, ...]) -> nn.Module:
    """``_Net`` with ``a`` and ``b`` quantized by ``scheme``; only ``trainable`` train."""
    torch.manual_seed(0)
    net = _Net().to(dtype)
    if scheme is not None:
        body = nn.Sequential(net.a, net.b)
        quantize_model(body, scheme)
        net.a, net.b = body[0], body[1]
    for name, p in net.named_parameters():
        p.requires_grad_(name.split(".")[0] in trainable)
    return net


def _measured(model: nn.Module, x: torch.Tensor, mode: str) -> tuple[int, int]:
    est = modelsize.estimate(model, (x,), mode=mode, verify=True)
    v = est.verification
    assert v is not None and v.measured_bytes is not None, v
    return est.peak_bytes, v.measured_bytes


CASES = [
    # (scheme, dtype, mode, trainable): every one exact against the real CPU run
    ("int8", torch.float32, "infer", ()),
    ("int8", torch.bfloat16, "infer", ()),
    ("int8", torch.float32, "train", ("stem", "head")),  # training the unquantized parts
    ("int4", torch.bfloat16, "infer", ()),
    ("int4", torch.bfloat16, "train", ("head",)),
    ("fp8", torch.bfloat16, "infer", ()),
    ("fp8", torch.float32, "train", ("head",)),
    ("nf4", torch.float32, "infer", ()),
    ("nf4", torch.float32, "train", ("head",)),  # gemm_4bit without grad: dequant scratch
    ("nf4", torch.float32, "train", ("stem", "head")),  # MatMul4Bit forward and backward
    ("nf4", torch.bfloat16, "train", ("stem", "head")),
]


@pytest.mark.parametrize(("scheme", "dtype", "mode", "trainable"), CASES)
def test_quantized_trace_matches_real_run(scheme: str, dtype: torch.dtype, mode: str,
                                          trainable: tuple[str, ...]) -> None:
    model = _net(scheme, dtype, trainable)
    x = torch.randn(8, 256, dtype=dtype)
    estimated, measured = _measured(model, x, mode)
    assert estimated == measured


def test_nf4_bfloat16_inference_within_a_kilobyte() -> None:
    # Exact when run alone (and in float32 always); after other bitsandbytes runs in the same
    # process the trace is 1,024 bytes (0.08%) over the real run: something bitsandbytes'
    # CPU inference path (the AVX512-BF16 repacking, _convert_weight_packed_for_cpu) makes
    # once per process and then reuses. Not yet identified.
    model = _net("nf4", torch.bfloat16, ())
    estimated, measured = _measured(model, torch.randn(8, 256, dtype=torch.bfloat16), "infer")
    assert measured <= estimated <= measured + 1024


def test_int8_weights_counted_as_int8_and_scales() -> None:
    model = _net("int8", torch.float32, ())
    est = modelsize.estimate(model, (torch.randn(8, 256),), mode="infer")
    # independent count: int8 qdata, per output row a float32 scale and an int8 zero point
    # (torchao 0.18's Int8Tensor), float32 rest
    quantized = sum(out * inp + out * 4 + out for out, inp in ((512, 256), (256, 512)))
    plain = (256 * 256 + 256 * 64) * 4 + (256 + 512 + 256 + 64) * 4
    assert est.categories[MemoryCategory.PARAMETERS] == quantized + plain
    assert est.setup.quantization == "int8 (torchao Int8Tensor)"


def test_nf4_weights_counted_with_quant_state() -> None:
    model = _net("nf4", torch.float32, ())
    est = modelsize.estimate(model, (torch.randn(8, 256),), mode="infer")
    # nf4, blocks of 64, double quantization (QLoRA's layout): packed nibbles, one uint8
    # absmax per block, per 256 blocks one float32 absmax, 16 float32 codes and a float32
    # offset; the second level's 256-entry float32 code; float32 everything else
    def nf4(n: int) -> int:
        blocks = n // 64
        return n // 2 + blocks + math.ceil(blocks / 256) * 4 + 16 * 4 + 4 + 256 * 4

    quantized = nf4(512 * 256) + nf4(256 * 512)
    plain = (256 * 256 + 256 * 64) * 4 + (256 + 512 + 256 + 64) * 4
    assert est.categories[MemoryCategory.PARAMETERS] == quantized + plain
    assert est.setup.quantization == "nf4 (bitsandbytes Linear4bit)"


@pytest.mark.parametrize("mode", ["infer", "train"])
def test_linear8bitlt_matches_real_run(mode: str) -> None:
    import bitsandbytes as bnb

    torch.manual_seed(0)
    layer = bnb.nn.Linear8bitLt(256, 512, has_fp16_weights=False, threshold=0.0)
    layer.load_state_dict(nn.Linear(256, 512).state_dict())
    layer = layer.to("cpu")  # quantizes: int8 CB and float32 SCB
    model = nn.Sequential(nn.Linear(256, 256), layer, nn.ReLU(), nn.Linear(512, 64))
    for name, p in model.named_parameters():
        p.requires_grad_(name[0] in "03")
    estimated, measured = _measured(model, torch.randn(8, 256), mode)
    assert estimated == measured
    # the trace left the layer's state as it was (no fake tensor stored in the model)
    from torch._subclasses.fake_tensor import FakeTensor

    state = model[1].state
    assert not any(isinstance(getattr(state, n, None), FakeTensor) for n in ("CB", "SCB"))


def test_quantize_argument_leaves_the_model_alone() -> None:
    model = _net(None, torch.float32, ())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    est = modelsize.estimate(model, (torch.randn(8, 256),), mode="infer", quantize="nf4")
    assert est.setup.quantization == "nf4 (bitsandbytes Linear4bit)"
    assert est.to_dict()["setup"]["quantization"] == "nf4 (bitsandbytes Linear4bit)"
    assert all(type(m) in (_Net, nn.Linear) for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert quantization_of(model) is None


def test_quantize_unknown_scheme_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="unknown quantization 'int3'"):
        modelsize.estimate(_net(None, torch.float32, ()), (torch.randn(2, 256),),
                           mode="infer", quantize="int3")


def test_storages_of_quantized_weights() -> None:
    model = _net("int8", torch.float32, ())
    w = model.a.weight
    parts = storages(w)
    assert sorted(str(p.dtype) for p in parts) == ["torch.float32", "torch.int8", "torch.int8"]
    assert sum(p.nbytes for p in parts) == 512 * 256 + 512 * 4 + 512


def test_cli_quantize_refuses_a_meta_model_in_one_line(capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    from modelsize.cli import main

    assert main(["estimate", "seed-cnn", "--infer", "--quantize", "int8", "--no-suggest"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["modelsize: --quantize int8: seed-cnn is built on the meta device (no weight "
                   "values to quantize); give a model folder or a factory"]
