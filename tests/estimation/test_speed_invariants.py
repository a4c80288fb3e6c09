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
from tests.estimation.models import Stack


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


def _allocations(monkeypatch: pytest.MonkeyPatch | None, world: int) -> list[tuple[Any, ...]]:
    if monkeypatch is not None:  # PyTorch's own code where the trace takes shortcuts
        from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

        monkeypatch.setattr(parallel_trace, "_LazyChunks", _chunk_with_empty)
        monkeypatch.setattr(parallel_trace, "_OncePerSchema", lambda orig: orig)
    torch.manual_seed(0)
    model = Stack(d=24, n=3)
    program = Program(optimizer="adamw", implementation=Implementation.FOREACH)
    rank = parallel_trace.run_rank_trace(model, (torch.randn(2, 8, 24),), program, world,
                                         world - 1)
    mode = rank.trace.mode
    return [(mode.peak_bytes, mode.peak_tick, mode.tick, len(rank.communication)),
            *((r.nbytes, r.origin, r.created, r.freed, r.is_grad, r.is_state)
              for r in mode.allocations)]


@pytest.mark.parametrize("world", [5, 64])
def test_rank_trace_equals_one_without_shortcuts(monkeypatch: pytest.MonkeyPatch,
                                                 world: int) -> None:
    # 24 rows over 64 ranks: the last rank holds only padding
    fast = _allocations(None, world)
    with monkeypatch.context() as m:
        slow = _allocations(m, world)
    assert fast == slow
