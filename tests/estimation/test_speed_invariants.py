"""The shortcuts that make a rank's trace fast change nothing it counts.

Each shortcut stands in for a piece of PyTorch (FSDP2's chunking of a parameter over the
ranks, DTensor's strided-shard check of a foreach op): here it is compared with that piece,
and a whole rank's trace with the shortcuts with one made by PyTorch's own code.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from modelsize.estimation import parallel_trace
from modelsize.estimation.optimizers import Implementation
from modelsize.estimation.trace import Program
from tests.estimation.models import Stack, tiny_llama


@pytest.mark.parametrize("shape", [(0, 3), (1, 3), (10, 3), (16, 3), (17, 3), (1000, 2)])
@pytest.mark.parametrize("chunks", [1, 3, 8, 1024])
@pytest.mark.parametrize("dim", [0, 1])
def test_lazy_chunks_are_fsdp2s_chunks(shape: tuple[int, int], chunks: int, dim: int) -> None:
    from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

    t = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape)
    theirs = _chunk_with_empty(t, chunks, dim)
    ours = parallel_trace._LazyChunks(t, chunks, dim)
    assert len(ours) == len(theirs) == chunks
    for i in (*range(min(chunks, 40)), chunks - 1, -1):
        a, b = ours[i], theirs[i]
        assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype)
        if b.numel():
            assert a.storage_offset() == b.storage_offset()
            assert a.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
            assert torch.equal(a, b)
    assert [x.shape for x in ours[1:4]] == [x.shape for x in theirs[1:4]]
    with pytest.raises(IndexError):
        ours[chunks]


def test_strided_shard_check_runs_only_where_it_can_do_something() -> None:
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    calls: list[Any] = []
    check = parallel_trace._OncePerSchema(lambda strategy, schema: calls.append(strategy))
    plain = SimpleNamespace(args_spec=[SimpleNamespace(placements=(Shard(0),)),
                                       SimpleNamespace(placements=(Replicate(),))])
    for child in range(3):
        check(child, plain)
    assert calls == []
    strided = SimpleNamespace(args_spec=[
        SimpleNamespace(placements=(Shard(0),)),
        SimpleNamespace(placements=(_StridedShard(0, split_factor=2),),
                        use_strided_shard_as_shard_order=False)])
    for child in range(3):
        check(child, strided)
    assert calls == [0, 1, 2]


@pytest.mark.parametrize("flags", [
    [None], [False], [True], [False, False], [True, False], [False, True], [False, None],
    [None, False], [None, None], [True, None, False], ["plain", False], [False, "plain", True]])
def test_strided_shard_check_fixes_children_as_dtensor_does(flags: list[Any]) -> None:
    import copy

    from torch.distributed.tensor import _sharding_prop
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    orig = _sharding_prop._propagate_use_strided_shard_flag

    def spec(flag: Any) -> SimpleNamespace:
        if flag == "plain":
            return SimpleNamespace(placements=(Shard(0), Replicate()),
                                   use_strided_shard_as_shard_order=None, shard_order=None)
        return SimpleNamespace(placements=(_StridedShard(0, split_factor=2), Shard(1)),
                               use_strided_shard_as_shard_order=flag, shard_order="old")

    schema = SimpleNamespace(args_spec=[spec(f) for f in flags])
    children = [SimpleNamespace(strategies=[SimpleNamespace(
        output_specs=(spec(f), None, spec("plain")) if k % 2 else (spec(f),),
        input_specs=[spec(g) for g in (False, True, None, "plain")])
        for f in (None, False, True)]) for k in range(3)]
    theirs, ours = copy.deepcopy(children), copy.deepcopy(children)
    for child in theirs:
        orig(child, schema)
    check = parallel_trace._OncePerSchema(orig)
    for child in ours:
        check(child, schema)

    def state(children: Any) -> Any:
        return repr([(s.use_strided_shard_as_shard_order, s.shard_order)
                     for c in children for st in c.strategies
                     for s in (*st.output_specs, *st.input_specs) if s is not None])

    assert state(ours) == state(theirs)
    assert state(ours) != state(children) or all(f in (None, "plain") for f in flags)


class _PyTorchsChildren:
    """In place of :class:`parallel_trace._SameChildren`: DTensor's own functions."""

    def __init__(self, expand_to_mesh: Any, expand_full: Any, prepare: Any) -> None:
        self.expand_to_mesh, self.expand_full = expand_to_mesh, expand_full
        self.prepare = prepare


def _allocations(monkeypatch: pytest.MonkeyPatch | None, world: int,
                 tp: int = 1) -> list[tuple[Any, ...]]:
    if monkeypatch is not None:  # PyTorch's own code where the trace takes shortcuts
        from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

        monkeypatch.setattr(parallel_trace, "_LazyChunks", _chunk_with_empty)
        monkeypatch.setattr(parallel_trace, "_OncePerSchema", lambda orig: orig)
        monkeypatch.setattr(parallel_trace, "_SameChildren", _PyTorchsChildren)
    torch.manual_seed(0)
    program = Program(optimizer="adamw", implementation=Implementation.FOREACH)
    if tp > 1:
        model, inputs = tiny_llama()
        rank = parallel_trace.run_rank_trace(model, inputs, program, world, world - 1, tp=tp,
                                             mp_dtype=torch.bfloat16)
    else:
        model = Stack(d=24, n=3)
        rank = parallel_trace.run_rank_trace(model, (torch.randn(2, 8, 24),), program, world,
                                             world - 1)
    mode = rank.trace.mode
    return [(mode.peak_bytes, mode.peak_tick, mode.tick, len(rank.communication)),
            *((r.nbytes, r.origin, r.created, r.freed, r.is_grad, r.is_state)
              for r in mode.allocations)]


@pytest.mark.parametrize(("world", "tp"), [(5, 1), (64, 1), (4, 2)])
def test_rank_trace_equals_one_without_shortcuts(monkeypatch: pytest.MonkeyPatch,
                                                 world: int, tp: int) -> None:
    # 24 rows over 64 ranks: the last rank holds only padding; tp 2: FSDP2 x tensor
    # parallelism, its parameters _StridedShard
    fast = _allocations(None, world, tp)
    with monkeypatch.context() as m:
        slow = _allocations(m, world, tp)
    assert fast == slow


def _strategy_state(strategy: Any) -> list[Any]:
    """Everything a foreach op's strategy holds that DTensor reads: each child's specs (with
    their strided-shard flag and shard order) and redistribute costs."""
    def spec(s: Any) -> Any:
        if s is None:
            return None
        if isinstance(s, tuple):
            return tuple(spec(x) for x in s)
        return (s.mesh, s.placements, s.tensor_meta, s.use_strided_shard_as_shard_order,
                s.shard_order)

    return [[(spec(o.output_specs), [spec(i) for i in o.input_specs or ()],
              o.redistribute_cost) for o in child.strategies]
            for child in strategy.children]


@pytest.mark.parametrize("op", ["_foreach_mul_", "_foreach_div_", "_foreach_add",
                                "_foreach_lerp_"])
def test_foreach_children_expanded_once_as_dtensor_does(monkeypatch: pytest.MonkeyPatch,
                                                        op: str) -> None:
    from torch.distributed.tensor import DTensor, _sharding_prop
    from torch.distributed.tensor._ops import single_dim_strategy, utils
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    orig_to_mesh = _sharding_prop._expand_single_dim_strategy_to_mesh
    orig_full = utils.expand_to_full_mesh_op_strategy
    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(_sharding_prop, "_expand_single_dim_strategy_to_mesh",
                        lambda *args: calls.append(args) or orig_to_mesh(*args))
    with parallel_trace.fake_process_group(8, 0, tp=2) as mesh:
        # FSDP2 x tensor parallelism's placements, of repeated and distinct shapes
        layouts = [((_StridedShard(0, split_factor=2), Shard(0)), (8, 6)),
                   ((Shard(0), Shard(1)), (8, 6)),
                   ((Shard(0), Replicate()), (4,)),
                   ((_StridedShard(0, split_factor=2), Shard(0)), (8, 6)),
                   ((Shard(0), Shard(1)), (8, 6)),
                   ((_StridedShard(0, split_factor=2), Shard(0)), (16, 6)),
                   ((Shard(0), Replicate()), (4,))]

        def tensors() -> list[Any]:
            return [DTensor.from_local(torch.ones(shape), mesh, placements, run_check=False)
                    for placements, shape in layouts]

        xs, ys = tensors(), tensors()
        DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
        if op == "_foreach_mul_":
            torch._foreach_mul_(xs, 0.5)
        elif op == "_foreach_div_":  # a list of scalars, as AdamW's bias corrections
            torch._foreach_div_(xs, [0.5 + i for i in range(len(xs))])
        elif op == "_foreach_add":
            torch._foreach_add(xs, ys, alpha=2.0)
        else:
            torch._foreach_lerp_(xs, ys, 0.1)
        assert len(calls) == 1
        args = calls[0]
        schema = args[1]
        theirs = orig_to_mesh(*args)(schema.op, schema.args_meta, schema.kwargs_meta)

        expanded: list[Any] = []

        def counting(*a: Any, **k: Any) -> Any:
            expanded.append(a[1])
            return orig_full(*a, **k)

        prepared: list[Any] = []

        def preparing(*a: Any, **k: Any) -> Any:
            prepared.append(orig_prepare(*a, **k))
            return prepared[-1]

        orig_prepare = single_dim_strategy._PreparedSingleDimStrategy
        children = parallel_trace._SameChildren(orig_to_mesh, counting, preparing)
        monkeypatch.setattr(utils, "expand_to_full_mesh_op_strategy", children.expand_full)
        monkeypatch.setattr(single_dim_strategy, "_PreparedSingleDimStrategy", children.prepare)
        ours = children.expand_to_mesh(*args)(schema.op, schema.args_meta, schema.kwargs_meta)
        assert len(ours.children) == len(theirs.children) == len(layouts)
        assert _strategy_state(ours) == _strategy_state(theirs)
        assert len(expanded) == len({id(s) for s in expanded}) == 4  # one per distinct child
        assert len(prepared) == 4
        assert children._memo is None
        # outside an op's propagation, no memo: each call expands
        inputs = len(expanded[0].args_strategy) + len(expanded[0].kwargs_strategy)
        children.expand_full(mesh, expanded[0], [[Replicate()] * (1 + inputs)])
        assert len(expanded) == 5


def test_trace_puts_dtensor_back() -> None:
    from torch.distributed.tensor import _sharding_prop
    from torch.distributed.tensor._ops import single_dim_strategy, utils

    def now() -> list[Any]:
        return [_sharding_prop._expand_single_dim_strategy_to_mesh,
                utils.expand_to_full_mesh_op_strategy,
                single_dim_strategy._PreparedSingleDimStrategy,
                _sharding_prop._propagate_use_strided_shard_flag]

    before = now()
    mode = SimpleNamespace(allocations=[], counting=True)
    with parallel_trace._Collectives(mode, set()):  # type: ignore[arg-type]
        during = now()
    assert all(a is not b for a, b in zip(during, before, strict=True))
    assert now() == before
