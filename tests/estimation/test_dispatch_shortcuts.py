"""The counting mode's shortcuts through FakeTensorMode's dispatch change nothing it returns.

``CountingFakeMode`` makes the fake-tensor dispatch cache's key in one pass, builds a cache
hit's output tensor from a template, and makes ``torch.tensor(x)``'s fake constant without
the generic conversion (tracker.py). Each is compared here with FakeTensorMode's own code: the
keys tell apart exactly the calls FakeTensorMode's keys tell apart, the outputs are the same
tensors (type, metadata, storage, attributes, dispatch keys; a constant's value, memo and
invalidation), and whole traces made with and without the shortcuts are identical, op by op
and allocation by allocation.
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

from modelsize.estimation import tracker
from modelsize.estimation.tracker import _KEY_MARK, CountingFakeMode, FunctionModesOff
from tests.estimation.replay_helpers import ids, llama, snapshot

aten = torch.ops.aten
_SHORTCUTS = ("_cache_key", "_get_output_tensor_from_cache_entry")


def _theirs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Route the counting mode through FakeTensorMode's own key, output, lift, foreach and
    metadata-query code."""
    from modelsize.estimation import trace

    for name in _SHORTCUTS:
        monkeypatch.setattr(CountingFakeMode, name, getattr(FakeTensorMode, name))
    monkeypatch.setattr(tracker, "SHORTCUTS", {})
    monkeypatch.setattr(tracker, "_META_QUERIES", {})
    monkeypatch.setattr(trace, "_META_QUERIES", {})


def _route(m: pytest.MonkeyPatch, theirs: bool, taken: list[Any],
           noted: Callable[[Any], bool]) -> None:
    """FakeTensorMode's own code (``theirs``), or the shortcuts, with the calls of ``noted``
    ops that they leave to ``FakeTensorMode.dispatch`` appended to ``taken``."""
    if theirs:
        _theirs(m)
        return
    dispatch = FakeTensorMode.dispatch

    def counted(self: Any, func: Any, *rest: Any) -> Any:
        if noted(func):
            taken.append(func)
        return dispatch(self, func, *rest)

    m.setattr(FakeTensorMode, "dispatch", counted)


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
    {"mode": "train", "steps": 2, "optimizer": "adamw", "device": "cuda"},  # foreach AdamW
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


def _lifted() -> list[torch.Tensor]:
    """Real tensors as ``torch.tensor`` hands them to ``lift_fresh``: ones FakeTensorMode makes
    constants, and ones the shortcut leaves to it."""
    strided = torch.zeros(2)[1:]  # a view at a storage offset (its copy is not)
    return [torch.tensor(0.0), torch.tensor(3, dtype=torch.int64), torch.tensor(True),
            torch.tensor([2.5], dtype=torch.float64), torch.tensor([], dtype=torch.float16),
            torch.tensor(1.5, dtype=torch.bfloat16), torch.tensor(1 + 2j), strided,
            torch.tensor([1.0, 2.0]), torch.tensor(1.0, requires_grad=True)]


def test_lift_fresh_makes_the_constant_fake_tensor_mode_makes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert tracker.SHORTCUTS  # installed on this torch
    made = []
    taken: list[Any] = []  # the lifts the shortcut leaves to FakeTensorMode
    for theirs in (False, True):
        mode = CountingFakeMode()
        with monkeypatch.context() as m:
            _route(m, theirs, taken, lambda func: func is aten.lift_fresh.default)
            xs = _lifted()
            with mode:
                outs = [aten.lift_fresh.default(x) for x in xs]
                consts = [None if t.constant is None else
                          (t.constant.dtype, t.constant.shape, t.constant.tolist()) for t in outs]
                memo = [t.constant is not None and mode.fake_tensor_converter._get_memo(
                    t.constant) is t for t in outs]
                refs = mode.fake_tensor_converter.constant_storage_mapping.values()
                mapped = [t.constant is not None and any(r() is t for rs in refs for r in rs)
                          for t in outs]
                facts = [_facts(t) for t in outs]
                views = [aten.unsqueeze.default(t, 0) for t in outs]  # constants propagated
                shared = [v.untyped_storage()._cdata == t.untyped_storage()._cdata
                          for v, t in zip(views, outs, strict=True)]
                facts += [_facts(v) for v in views]
                for t in outs:  # a write into a constant: FakeTensorMode's bookkeeping
                    if t.dtype is not torch.bool and t.numel():
                        t.add_(1)
                after = [t.constant for t in outs]
        made.append((facts, consts, memo, mapped, after, mode, shared))
    (f1, c1, m1, p1, a1, mode1, s1), (f2, c2, m2, p2, a2, mode2, s2) = made
    assert s1 == s2 and all(s2)  # a view of a constant shares the fake's storage
    for u, v in zip(f1, f2, strict=True):
        assert [x for x in u if not isinstance(x, list) and x is not mode1] == [
            x for x in v if not isinstance(x, list) and x is not mode2]
        du, dv = dict(u[11]), dict(v[11])
        assert du.keys() == dv.keys()
        for k in du:
            if k == "fake_mode":
                assert du[k] is mode1 and dv[k] is mode2
            elif k == "constant":
                assert (du[k] is None) == (dv[k] is None)
            else:
                assert du[k] == dv[k], k
    assert c1 == c2
    assert len(taken) == 2  # two elements; requiring grad
    assert sum(c is not None for c in c1) == 9  # two elements: no constant
    assert m1 == m2 and p1 == p2
    assert [c is None for c in a1] == [c is None for c in a2]


def test_function_modes_off_for_the_bookkeeping_and_back_in_order() -> None:
    from torch.overrides import TorchFunctionMode

    class Counting(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def __torch_function__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            self.calls += 1
            return func(*args, **(kwargs or {}))

    outer, inner = Counting(), Counting()
    x = torch.ones(2)
    with outer, inner:
        with FunctionModesOff():
            x + 1
            _ = x.shape
        assert outer.calls == inner.calls == 0
        with pytest.raises(ValueError), FunctionModesOff():
            raise ValueError
        stack = [torch._C._get_function_stack_at(i)
                 for i in range(torch._C._len_torch_function_stack())]
        assert stack == [outer, inner]
        x + 1
    assert inner.calls == 1 and outer.calls == 1


def _foreach_calls(mode: CountingFakeMode) -> list[tuple[Any, tuple[Any, ...], dict[str, Any]]]:
    """Foreach calls the shortcuts take (an optimizer's) and ones they leave to FakeTensorMode:
    broadcasting, mixed dtypes, integers, constants, a single tensor, transposed inputs."""
    fake = mode.from_tensor

    def fakes(*shapes: tuple[int, ...], dtype: torch.dtype = torch.float32,
              device: str = "cuda") -> list[Any]:
        return [torch.empty(s, dtype=dtype, device=device) for s in shapes]

    shapes = ((4, 8), (8,), (), (3, 2, 5))
    a, b, c = fakes(*shapes), fakes(*shapes), fakes(*shapes)
    h = fakes(*shapes, dtype=torch.bfloat16)
    cpu = fakes(*shapes, device="cpu")
    scalars = [0.5, 2, True, 1e-8]
    calls: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = [
        (aten._foreach_add_.Scalar, (a, 1), {}),
        (aten._foreach_add_.List, (a, b), {"alpha": 0.1}),
        (aten._foreach_mul_.Scalar, (h, 0.9), {}),
        (aten._foreach_lerp_.Scalar, (a, b, 0.1), {}),
        (aten._foreach_addcmul_.Scalar, (a, b, c), {"value": 0.001}),
        (aten._foreach_addcdiv_.ScalarList, (a, b, c, scalars), {}),
        (aten._foreach_div_.ScalarList, (cpu, scalars), {}),
        (aten._foreach_sqrt.default, (a,), {}),
        (aten._foreach_sqrt.default, (h,), {}),
        (aten._foreach_add.Scalar, (a, 1e-8), {}),
        (aten._foreach_mul.List, (cpu, cpu), {}),
        (aten._foreach_addcdiv.ScalarList, (a, b, c, scalars), {}),
        (aten._foreach_neg.default, (h,), {}),
        # left to FakeTensorMode:
        (aten._foreach_add_.List, (fakes((4, 8)), fakes((1, 8))), {}),  # broadcast
        (aten._foreach_add.List, (fakes((4, 8)), fakes((1, 8))), {}),
        (aten._foreach_add.List, (a, h), {}),  # mixed dtypes
        (aten._foreach_add.Scalar, (fakes((4,), dtype=torch.int64), 2), {}),
        (aten._foreach_mul.Scalar, (fakes((4,), dtype=torch.int64), 0.5), {}),
        (aten._foreach_sqrt.default, ([fake(torch.zeros(4, 8)).t()],), {}),
        (aten._foreach_mul.Tensor, (a, fake(torch.tensor(2.0))), {}),
        (aten._foreach_add.Scalar, ([torch.tensor(1.0)], 1), {}),  # a constant
    ]
    return calls


def test_foreach_shortcuts_return_what_fake_tensor_mode_returns(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The optimizer's foreach ops: nothing for the in-place ones, new tensors with the same
    facts for the others; what the shortcuts do not cover goes to FakeTensorMode."""
    taken: list[Any] = []
    results = []
    for theirs in (False, True):
        mode = CountingFakeMode()
        with monkeypatch.context() as m:
            _route(m, theirs, taken, lambda func: "_foreach_" in str(func))
            with mode:
                calls = _foreach_calls(mode)
                outs = [func(*args, **kwargs) for func, args, kwargs in calls]
        results.append([None if o is None else [_facts(t)[:-1] for t in o] for o in outs])
    ours, theirs = results
    for u, v, call in zip(ours, theirs, calls, strict=True):
        assert (u is None) == (v is None), call[0]
        if u is not None:
            for x, y in zip(u, v, strict=True):
                assert x[:11] == y[:11], call[0]
                assert [k for k, _ in x[11]] == [k for k, _ in y[11]], call[0]
    assert [str(f) for f in taken] == [str(f) for f, _, _ in calls[13:]]
    assert all(f in tracker.SHORTCUTS for f, _, _ in calls[:13])


def test_metadata_queries_answer_as_fake_tensor_mode_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """C++ code asks a fake tensor its device, sizes and strides through the dispatcher
    (grouping an optimizer's tensors): answered before the counting mode's bookkeeping."""
    assert set(tracker._META_QUERIES) >= {torch.ops.prim.device.default}
    got = []
    for theirs in (False, True):
        mode = CountingFakeMode()
        with monkeypatch.context() as m:
            if theirs:
                _theirs(m)
            with mode:
                xs = [torch.empty(3, dtype=d, device=dev)
                      for d in (torch.float32, torch.bfloat16) for dev in ("cuda", "cpu")]
                tick = mode.tick
                grouped = torch._C._group_tensors_by_device_and_dtype([xs], False)
                got.append(({k: [len(v) for v in vs] for k, (vs, _) in grouped.items()},
                            [(torch.ops.prim.device.default(x), x.size(), x.stride())
                             for x in xs], mode.tick - tick))
    assert got[0] == got[1]
    assert len(got[0][0]) == 4 and got[0][2] == 0  # four groups; nothing counted
