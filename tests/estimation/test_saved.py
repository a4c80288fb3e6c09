"""What a training step keeps for the backward: the table adds up to the activations at the
peak, names the op and the autograd node, and finds the two bitsandbytes QLoRA bugs.

The quantized layers here are synthetic (no bitsandbytes): a packed 4-bit weight (two codes
per uint8, an NF4-like codebook, one absmax per block of 64) and ``MatMul4Bit`` as
bitsandbytes wrote it around its PR 1270 (bitsandbytes/autograd/_functions.py, 0.43.x):

* before PR 1270 its forward kept ``ctx.tensors = (A, B)``: the input ``A`` and the packed
  weight ``B``; the fix keeps ``(None, B)``: ``A`` serves only the gradient of ``B``, which a
  quantized weight never gets;
* PR 1935: ``F.linear(A, dequantize_4bit(B, state).to(A.dtype).t(), bias)`` run where
  autograd records it: the linear's node keeps the dequantized weight until the backward.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import modelsize
from modelsize.estimation.result import MemoryCategory, SavedFindingKind
from modelsize.report.estimate_text import render_estimate
from modelsize.report.html import render_estimate as render_html
from tests.estimation.models import ResBlockNet, SmallCNN, Stack, tiny_gpt2

BLOCK = 64


def _acts(est: Any) -> int:
    return int(est.categories[MemoryCategory.ACTIVATIONS])


def _check_sum(est: Any) -> None:
    saved = est.saved_for_backward
    assert saved is not None
    assert sum(r.nbytes for r in saved.rows) == saved.nbytes == _acts(est)
    assert sum(r["bytes"] for r in est.to_dict()["saved_for_backward"]["rows"]) == _acts(est)


# -- the rows add up to the activations at the peak ------------------------------------------

def _mlp() -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    return (nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.ReLU(),
                          nn.Linear(64, 10)), (torch.randn(2048, 64),))


def _cnn() -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    return SmallCNN(), (torch.randn(64, 1, 28, 28),)


def _resnet() -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    return ResBlockNet(), (torch.randn(16, 3, 64, 64),)


def _stack() -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    return Stack(d=64, n=3), (torch.randn(8, 128, 64),)


def _own_checkpoint() -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    return Stack(d=64, n=3, checkpointed=True), (torch.randn(8, 128, 64),)


def _gpt2() -> tuple[nn.Module, Any]:
    return tiny_gpt2()


CASES = {
    "mlp": (_mlp, ()), "mlp-checkpoint": (_mlp, ("1",)),
    "cnn": (_cnn, ()), "resnet": (_resnet, ()), "resnet-checkpoint": (_resnet, ("block",)),
    "stack": (_stack, ()), "stack-checkpoint": (_stack, ("blocks.*",)),
    "stack-own-checkpoint": (_own_checkpoint, ()),
    "gpt2": (_gpt2, ()), "gpt2-checkpoint": (_gpt2, ("transformer.h.*",)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_rows_add_up_to_the_activations_at_the_peak(case: str) -> None:
    make, ckpt = CASES[case]
    model, inputs = make()
    est = modelsize.estimate(model, inputs, optimizer="sgd", steps=1, checkpoint=ckpt)
    assert _acts(est) > 0, est.phase  # the peak holds activations: the test means something
    _check_sum(est)
    names = {n for r in est.saved_for_backward.rows for n in r.saved_by}
    if ckpt or case.endswith("own-checkpoint"):
        assert names & {"checkpoint", "recomputed"}, names
    else:
        assert names, names  # autograd nodes are named


def test_the_mlp_rows_are_the_tensors_autograd_saves() -> None:
    """Linear, GELU, Linear: GELU keeps the first linear's output, the second linear keeps
    GELU's output, each 2048 x 256 float32; the loss is alive, kept by no node."""
    model, inputs = _mlp()
    est = modelsize.estimate(model, inputs, optimizer="sgd", steps=1)
    rows = {(r.module, r.op, r.saved_by): (r.shape, r.nbytes)
            for r in est.saved_for_backward.rows}
    assert rows[("0", "aten.addmm", ("GeluBackward0",))] == ((2048, 256), 2048 * 256 * 4)
    assert rows[("1", "aten.gelu", ("AddmmBackward0",))] == ((2048, 256), 2048 * 256 * 4)
    assert rows[("<model>", "aten.sum", ())] == ((), 4)
    # GELU's output is a pointwise function of its input, which is kept too
    (finding,) = est.saved_for_backward.findings
    assert finding.kind is SavedFindingKind.RECOMPUTABLE
    assert (finding.op, finding.nbytes) == ("aten.gelu", 2048 * 256 * 4)


def test_inference_has_no_table() -> None:
    model, inputs = _mlp()
    est = modelsize.estimate(model, inputs, mode="infer")
    assert est.saved_for_backward is None
    assert est.to_dict()["saved_for_backward"] is None


# -- the two bitsandbytes bugs ---------------------------------------------------------------

NF4 = [-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0,
       0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0]


def dequantize_4bit(packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor,
                    shape: tuple[int, int]) -> torch.Tensor:
    """Two 4-bit codes per byte, looked up in the codebook, times each block's absmax."""
    codes = torch.stack([packed >> 4, packed & 15], dim=-1).flatten().long()
    return (code[codes].view(-1, BLOCK) * absmax.view(-1, 1)).view(shape)


class MatMul4Bit(torch.autograd.Function):
    """bitsandbytes' MatMul4Bit; ``keep_input``: what it kept before PR 1270."""

    @staticmethod
    def forward(ctx: Any, A: torch.Tensor, B: torch.Tensor, absmax: torch.Tensor,
                code: torch.Tensor, shape: tuple[int, int], keep_input: bool) -> torch.Tensor:
        output = F.linear(A, dequantize_4bit(B, absmax, code, shape).to(A.dtype))
        ctx.state = (absmax, code, shape)
        ctx.tensors = (A, B) if keep_input else (None, B)
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:
        _, B = ctx.tensors
        absmax, code, shape = ctx.state
        grad_A = grad_output @ dequantize_4bit(B, absmax, code, shape).to(grad_output.dtype)
        return grad_A, None, None, None, None, None


class Linear4bit(nn.Module):
    """A frozen linear layer stored as packed 4-bit codes; ``how`` picks the forward:
    ``"pr1270"`` (MatMul4Bit keeping A and B), ``"pr1935"`` (F.linear on the dequantized
    weight, recorded by autograd), ``"fixed"`` (MatMul4Bit keeping only B)."""

    def __init__(self, n_in: int, n_out: int, how: str) -> None:
        super().__init__()
        self.shape = (n_out, n_in)
        self.how = how
        g = torch.Generator().manual_seed(0)
        self.weight = nn.Parameter(torch.randint(0, 256, (n_out * n_in // 2, 1), generator=g,
                                                 dtype=torch.uint8), requires_grad=False)
        self.register_buffer("absmax", torch.rand(n_out * n_in // BLOCK, generator=g))
        self.register_buffer("code", torch.tensor(NF4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "pr1935":
            return F.linear(x, dequantize_4bit(self.weight, self.absmax, self.code,
                                               self.shape).to(x.dtype))
        return MatMul4Bit.apply(x, self.weight, self.absmax, self.code, self.shape,
                                self.how == "pr1270")


class QLoRAish(nn.Module):
    """A trainable projection, then two frozen 4-bit layers, then a trainable head: the
    gradient flows through the 4-bit layers to the projection, as QLoRA's flows to LoRA."""

    def __init__(self, how: str, d: int = 256) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(32, d)
        self.q1 = Linear4bit(d, 4 * d, how)
        self.q2 = Linear4bit(4 * d, d, how)
        self.head = nn.Linear(d, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x) + 1.0  # kept by nobody but a 4-bit layer
        return self.head(self.q2(self.q1(h) * 2.0))


def _qlora(how: str, n: int = 512) -> Any:
    return modelsize.estimate(QLoRAish(how), (torch.randn(n, 32),), optimizer="sgd", steps=1)


def test_pr1270_matmul4bit_keeping_its_input_is_found() -> None:
    est = _qlora("pr1270")
    _check_sum(est)
    saved = est.saved_for_backward
    rows = {(r.op, r.saved_by, r.kept_in): r for r in saved.rows if r.module == "<model>"}
    # q1 keeps its input h (proj's output + 1), q2 keeps q1's output times 2
    by = ("MatMul4BitBackward.tensors",)
    assert rows[("aten.add", by, ("q1",))].nbytes == 512 * 256 * 4
    assert rows[("aten.mul", by, ("q2",))].nbytes == 512 * 1024 * 4
    found = {f.module: f for f in saved.findings
             if f.kind is SavedFindingKind.INPUT_FOR_FROZEN_WEIGHT}
    assert {m: f.nbytes for m, f in found.items()} == {"q1": 512 * 256 * 4,
                                                       "q2": 512 * 1024 * 4}
    assert all(f.saved_by == by for f in found.values())
    assert not [f for f in saved.findings if f.kind is SavedFindingKind.DEQUANTIZED_WEIGHT]
    text = render_estimate(est)
    assert "MatMul4BitBackward.tensors" in text and "PR 1270" in text


def test_pr1935_linear_keeping_the_dequantized_weight_is_found() -> None:
    est = _qlora("pr1935")
    _check_sum(est)
    saved = est.saved_for_backward
    found = {f.module: f for f in saved.findings
             if f.kind is SavedFindingKind.DEQUANTIZED_WEIGHT}
    # each 4-bit layer's float32 weight, 256 x 1024, kept by the linear's MmBackward0
    assert {m: (f.nbytes, f.count) for m, f in found.items()} == {
        "q1": (256 * 1024 * 4, 1), "q2": (256 * 1024 * 4, 1)}
    assert all(f.saved_by == ("MmBackward0",) for f in found.values())
    rows = [r for r in saved.rows if r.module == "q1" and r.saved_by == ("MmBackward0",)
            and r.dtype == "float32"]  # made as (1024 x 256 / 64) blocks of 64
    assert [r.nbytes for r in rows] == [256 * 1024 * 4]
    assert "PR 1935" in render_estimate(est)
    assert "dequantized float32 copy of a quantized weight" in render_html(est)


def test_the_fixed_matmul4bit_has_no_finding() -> None:
    fixed, old = _qlora("fixed"), _qlora("pr1270")
    _check_sum(fixed)
    assert fixed.saved_for_backward.findings == ()
    assert not any("MatMul4Bit" in n for r in fixed.saved_for_backward.rows for n in r.saved_by)
    # what the old version kept alone when the forward ended: q1's input and q2's input
    kept = sum(old.module_activations.values()) - sum(fixed.module_activations.values())
    assert kept == 512 * 256 * 4 + 512 * 1024 * 4


def test_position_ids_are_not_a_quantized_weight() -> None:
    """An embedding looked up with an integer buffer derives from model state alone, yet is
    no dequantized weight (the ids index a table larger than themselves); a codebook lookup
    of packed codes is one."""
    class Positions(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(32, 32)
            self.pos = nn.Embedding(64, 32)
            self.register_buffer("ids", torch.arange(64))
            self.q = Linear4bit(32, 32, "pr1935")

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.q(self.proj(x) * self.pos(self.ids))

    from modelsize.estimation.trace import Program, run_trace
    from modelsize.estimation.tracker import STATE_FLOAT, STATE_NONE, STATE_PACKED

    trace = run_trace(Positions(), (torch.randn(4, 64, 32),), Program(optimizer="sgd", steps=1))
    forward = [r for r in trace.mode.allocations if r.origin.value == "forward"]
    states = {str(r.op.overloadpacket): r.state for r in forward
              if r.op is not None and not isinstance(r.op, str)}
    assert states["aten.embedding"] == STATE_FLOAT
    assert states["aten.index"] == STATE_PACKED  # the codebook lookup
    assert states["aten.addmm"] == STATE_NONE
    (emb,) = [r for r in forward if r.op is torch.ops.aten.embedding.default]
    assert emb.saved_by == ("MulBackward0",)


def test_dequantized_weights_of_repeated_layers_are_one_finding() -> None:
    """A GPTQ layer in training keeps its dequantized float weight for the backward (the
    matmul's MmBackward0): the same module of each of four layers is one finding, with its
    modules counted, not four."""
    from modelsize.estimation.quant_layers import GPTQLinear

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Linear(64, 64)
            self.layers = nn.ModuleList(GPTQLinear(4, 32, 64, 64, bias=False)
                                        for _ in range(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.stem(x)
            for layer in self.layers:
                x = torch.relu(layer(x))
            return x

    model = Net()
    est = modelsize.estimate(model, (torch.randn(8, 64),), mode="train")
    _check_sum(est)
    found = [f for f in est.saved_for_backward.findings
             if f.kind is SavedFindingKind.DEQUANTIZED_WEIGHT]
    (finding,) = found
    # the layers whose copies are alive at the peak (the last one's is freed by its backward
    # before the peak): one finding, its modules counted
    assert (finding.module, finding.modules, finding.count) == ("layers.*", 3, 3)
    assert "layers.* (3 modules) keeps a dequantized float32 copy" in finding.advice
    # each: the 64 x 64 float16 weight made float32 (.to(x.dtype)) for the matmul
    assert finding.nbytes == 3 * 64 * 64 * 4
