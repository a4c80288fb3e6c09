"""``estimate`` leaves the model exactly as it found it, whatever it was built on."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from modelsize.estimation import estimate
from tests.estimation import models


def _has_data(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and not isinstance(t, FakeTensor)


def _snapshot(model: nn.Module) -> dict[str, Any]:
    return {
        "params": {n: (p, p.device, p.dtype, p.requires_grad, p.untyped_storage()._cdata,
                       p._version) for n, p in model.named_parameters()},
        "values": {n: p.detach().clone() for n, p in model.named_parameters()
                   if _has_data(p)},
        "grads": {n: None if p.grad is None else p.grad.clone()
                  for n, p in model.named_parameters() if _has_data(p)},
        "buffers": {n: (b, b._version) for n, b in model.named_buffers()},
        "buffer_values": {n: b.clone() for n, b in model.named_buffers() if _has_data(b)},
        "training": {n: m.training for n, m in model.named_modules()},
        "hooks": {n: (dict(m._forward_hooks), dict(m._forward_pre_hooks),
                      dict(m._backward_hooks)) for n, m in model.named_modules()},
        "forward": {n: "forward" in m.__dict__ for n, m in model.named_modules()},
    }


def _assert_same(before: dict[str, Any], model: nn.Module) -> None:
    after = _snapshot(model)
    for key in ("training", "hooks", "forward"):
        assert before[key] == after[key], key
    for n, (p, device, dtype, rg, ptr, version) in before["params"].items():
        q = dict(model.named_parameters())[n]
        assert q is p and q.device == device and q.dtype == dtype
        assert q.requires_grad == rg and q.untyped_storage()._cdata == ptr
        assert q._version == version
    for n, v in before["values"].items():
        assert torch.equal(v, dict(model.named_parameters())[n].detach()), n
    for n, g in before["grads"].items():
        now = dict(model.named_parameters())[n].grad
        assert (g is None and now is None) or torch.equal(g, now), n
    for n, (b, version) in before["buffers"].items():
        assert dict(model.named_buffers())[n] is b and b._version == version
    for n, v in before["buffer_values"].items():
        assert torch.equal(v, dict(model.named_buffers())[n]), n


def test_real_model_with_grads_hooks_frozen_params_and_mixed_flags() -> None:
    torch.manual_seed(0)
    model = models.ResBlockNet()
    model.stem[0].weight.requires_grad_(False)
    model.block.eval()
    model.fc.register_forward_hook(lambda m, i, o: None)
    x = torch.randn(2, 3, 32, 32)
    model(x).sum().backward()  # real .grad values that must survive
    before = _snapshot(model)
    for mode in ("train", "infer"):
        estimate(model, (x,), mode=mode, device="cpu")
        estimate(model, (x,), mode=mode, device="cuda")
    _assert_same(before, model)


def test_checkpointed_modules_get_their_forward_back() -> None:
    model = models.Stack()
    before = _snapshot(model)
    estimate(model, (torch.randn(2, 8, 32),), checkpoint=("blocks.*",), device="cpu")
    _assert_same(before, model)


def test_meta_model_and_meta_inputs() -> None:
    with torch.device("meta"):
        model = models.Stack(d=64)
    x = torch.empty(4, 16, 64, device="meta")
    before = _snapshot(model)
    est = estimate(model, (x,), device="cpu")
    _assert_same(before, model)
    real = models.Stack(d=64)
    assert est.peak_bytes == estimate(real, (torch.zeros(4, 16, 64),), device="cpu").peak_bytes


def test_model_built_under_fake_tensors() -> None:
    with FakeTensorMode():
        model = models.Stack(d=64)
        x = torch.empty(4, 16, 64)
    before = _snapshot(model)
    est = estimate(model, (x,), device="cpu")
    _assert_same(before, model)
    real = models.Stack(d=64)
    assert est.peak_bytes == estimate(real, (torch.zeros(4, 16, 64),), device="cpu").peak_bytes


def test_tied_weights_count_once() -> None:
    model, inputs = models.tiny_gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    est = estimate(model, inputs, mode="infer", device="cpu")
    unique = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
              for p in model.parameters()}
    assert est.categories["parameters"] == sum(unique.values())


def test_parameters_viewing_one_flat_storage_count_it_once() -> None:
    flat = torch.zeros(2 * 16 * 16 + 7)
    model = nn.Sequential(nn.Linear(16, 16, bias=False), nn.Linear(16, 16, bias=False))
    model[0].weight = nn.Parameter(flat[:256].view(16, 16))
    model[1].weight = nn.Parameter(flat[256:512].view(16, 16).t())
    est = estimate(model, (torch.zeros(2, 16),), mode="infer", device="cpu")
    assert est.categories["parameters"] == flat.nbytes
