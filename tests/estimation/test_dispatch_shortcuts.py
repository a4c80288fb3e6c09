"""The counting mode's shortcuts through FakeTensorMode's dispatch change nothing it returns.

``CountingFakeMode`` makes the fake-tensor dispatch cache's key in one pass and builds a cache
hit's output tensor from a template (tracker.py). Each is compared here with FakeTensorMode's
own code: the keys tell apart exactly the calls FakeTensorMode's keys tell apart, the outputs
are the same tensors (type, metadata, storage, attributes, dispatch keys), and whole traces
made with and without the shortcuts are identical, op by op and allocation by allocation.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import (
    FakeTensor,
    FakeTensorMode,
    _BypassDispatchCache,
    _CacheKeyState,
)

from modelsize.estimation.tracker import _KEY_MARK, CountingFakeMode
from tests.estimation.replay_helpers import ids, llama, snapshot

aten = torch.ops.aten
_SHORTCUTS = ("_cache_key", "_get_output_tensor_from_cache_entry")


def _theirs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Route the counting mode through FakeTensorMode's own key and output code."""
    for name in _SHORTCUTS:
        monkeypatch.setattr(CountingFakeMode, name, getattr(FakeTensorMode, name))


def _calls(mode: CountingFakeMode) -> list[tuple[Any, tuple[Any, ...], dict[str, Any]]]:
    """Calls that differ in one fact each FakeTensorMode's key holds (and a few that do not
    differ at all: two tensors with the same metadata)."""
    fake = mode.from_tensor
    x = fake(torch.zeros(4, 8))
    same = fake(torch.ones(4, 8))
    big = fake(torch.zeros(64)[:32].view(4, 8))  # a larger storage
    offset = fake(torch.zeros(40)[8:].view(4, 8))
    z = torch.zeros(4, 8, dtype=torch.complex64)
    variants = [x, same, big, offset, fake(torch.zeros(8, 4)).t(), fake(torch.zeros(4, 8).double()),
                fake(torch.zeros(4, 8, requires_grad=True)), fake(torch.zeros(2, 16)).view(4, 8),
                fake(z), fake(z.conj()), fake(torch._neg_view(z)), fake(torch.zeros(1, 8))]
    calls: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []
    for a, b in itertools.product(variants[:4], variants):
        calls.append((aten.add.Tensor, (a, b), {}))
    for v in variants:
        calls.append((aten.mul.Scalar, (v, 2), {}))
    for scalar in (1, 1.0, True, 2):
        calls.append((aten.add.Scalar, (x, scalar), {}))
    for alpha in (1, 2, 2.0):
        calls.append((aten.add.Tensor, (x, same), {"alpha": alpha}))
    calls += [(aten.view.default, (x, [8, 4]), {}), (aten.view.default, (x, (8, 4)), {}),
              (aten.view.default, (x, [32]), {}), (aten.sum.dim_IntList, (x, [0]), {}),
              (aten.sum.dim_IntList, (x, [1]), {}),
              (aten.sum.dim_IntList, (x, [1]), {"keepdim": True}),
              (aten.sum.dim_IntList, (x, [1]), {"dtype": torch.float64}),
              (aten.cat.default, ([x, same],), {}), (aten.cat.default, ([x, same, x],), {}),
              (aten.cat.default, ([x, same], 1), {})]
    return calls


def test_keys_tell_apart_what_fake_tensor_modes_keys_tell_apart() -> None:
    mode = CountingFakeMode()
    with mode:
        calls = _calls(mode)
        ours = [mode._cache_key(_CacheKeyState(), f, a, k) for f, a, k in calls]
        theirs = [FakeTensorMode._cache_key(mode, _CacheKeyState(), f, a, k)
                  for f, a, k in calls]
    assert all(_KEY_MARK in key.key for key in ours)
    for i, j in itertools.combinations(range(len(calls)), 2):
        assert (ours[i] == ours[j]) == (theirs[i] == theirs[j]), (calls[i], calls[j])
    assert len(set(theirs)) < len(calls)  # some calls are the same call


def test_what_the_key_does_not_cover_takes_fake_tensor_modes_key() -> None:
    mode = CountingFakeMode()
    real = torch.zeros(4)
    theirs = FakeTensorMode().from_tensor(real)
    with mode:
        x = mode.from_tensor(real)
        for args in [(x, real), (x, theirs)]:
            with pytest.raises(_BypassDispatchCache):  # real tensor; another mode's fake
                mode._cache_key(_CacheKeyState(), aten.add.Tensor, args, {})
        key = mode._cache_key(_CacheKeyState(), aten.add.Tensor, (x, x), {"alpha": object()})
    assert _KEY_MARK not in key.key


def _facts(t: Any) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    return (type(t), t.shape, t.stride(), t.storage_offset(), t.dtype, t.device,
            t.requires_grad, t.is_conj(), t.is_neg(), t.untyped_storage().nbytes(),
            str(torch._C._dispatch_keys(t)), sorted(vars(t).items(), key=lambda kv: kv[0]),
            t.fake_mode, t.fake_device)


def _ops(mode: CountingFakeMode) -> list[Callable[[], Any]]:
    fake = mode.from_tensor
    x = fake(torch.zeros(4, 8))
    w = fake(torch.zeros(8, 8, requires_grad=True))
    z = fake(torch.zeros(4, 8, dtype=torch.complex64))
    return [lambda: aten.add.Tensor(x, x), lambda: aten.t.default(x),
            lambda: aten.view.default(x, [32]), lambda: aten.mm.default(x, w),
            lambda: aten.slice.Tensor(x, 0, 1, 3), lambda: aten.conj.default(z),
            lambda: aten._neg_view.default(z), lambda: aten.max.dim(x, 1),
            lambda: aten.new_empty.default(x, [3], dtype=torch.float16),
            lambda: aten.empty.memory_format([2, 3], device=torch.device("cuda"))]


def test_cache_hits_make_the_tensors_fake_tensor_mode_makes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    mode = CountingFakeMode()
    with mode:
        ops = _ops(mode)
        for op in ops:
            op()  # the cache now holds each call
        hits = FakeTensorMode.cache_hits
        ours = [op() for op in ops]
        assert FakeTensorMode.cache_hits - hits == len(ops)
        assert mode._fakes  # made by the template
        with monkeypatch.context() as m:
            _theirs(m)
            theirs = [op() for op in ops]
    for a, b, op in zip(ours, theirs, ops, strict=True):
        assert type(a) is type(b)
        pairs = zip(a, b, strict=True) if isinstance(a, tuple) else [(a, b)]
        for u, v in pairs:
            assert _facts(u) == _facts(v), op
            assert isinstance(u, FakeTensor) and u is not v
            assert (u.untyped_storage()._cdata == v.untyped_storage()._cdata) == (
                u._base is not None)  # a view shares its input's storage; others are new


def _trace(make: Callable[[], Any], inputs: Any, **program: Any) -> dict[str, Any]:
    from modelsize.estimation.trace import Program, run_trace

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return snapshot(run_trace(make(), inputs, Program(**program)))


@pytest.mark.parametrize("program", [
    {"mode": "train", "steps": 2},
    {"mode": "train", "steps": 1, "amp": torch.bfloat16, "optimizer": "adamw"},
    {"mode": "infer"},
])
def test_a_trace_is_the_same_without_the_shortcuts(program: dict[str, Any],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    ours = _trace(lambda: llama(3), ids(), **program)
    with monkeypatch.context() as m:
        _theirs(m)
        theirs = _trace(lambda: llama(3), ids(), **program)
    for key in theirs:
        assert ours[key] == theirs[key], key
