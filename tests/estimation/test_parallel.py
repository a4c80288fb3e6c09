"""Estimates across GPUs: the formulas (the ZeRO paper's own example), FSDP2 traced on a fake
process group against the same program run for real and measured, and the accounted ZeRO-1/2."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import torch
from torch import nn

from modelsize.errors import UsageError
from modelsize.estimation import MemoryCategory, estimate
from modelsize.estimation.parallel import (
    Parallel,
    Strategy,
    deepspeed_zero2_gpu_bytes,
    deepspeed_zero3_gpu_bytes,
    zero_model_states,
)
from tests.estimation.groundtruth import (
    allocator_events,
    llama_tp_plan,
    measured,
    peak_of,
    storage_bytes,
)
from tests.estimation.models import Block, Stack, tiny_llama

# The ZeRO paper (Rajbhandari et al., SC 2020), figure 1: a 7.5B-parameter model on 64 GPUs
# with mixed-precision Adam (K = 12) needs 120 GB per GPU with plain data parallelism, and
# 31.4 / 16.6 / 1.9 GB with ZeRO stages 1 / 2 / 3.
PAPER_PARAMS = 7_500_000_000
PAPER_GB = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_formula_reproduces_the_papers_example(stage: int) -> None:
    states = zero_model_states(PAPER_PARAMS, 64, stage)
    assert round(states.total / 1e9, 1) == PAPER_GB[stage]


def test_zero_formula_terms() -> None:
    # stage 2: 2 bytes of fp16 parameters per parameter, gradients and state sharded
    s = zero_model_states(PAPER_PARAMS, 64, 2)
    assert s.parameters == 2 * PAPER_PARAMS
    assert s.gradients == 2 * PAPER_PARAMS // 64
    assert s.optimizer_state == 12 * PAPER_PARAMS // 64
    # an uneven split: each rank holds ceil(params / world)
    assert zero_model_states(10, 4, 3).parameters == 3 * 2


def test_deepspeed_estimators() -> None:
    # DeepSpeed's stage_1_and_2 / stage3 arithmetic, written out for 13B on 8 GPUs (no offload)
    total, largest = 13_000_000_000, 325_000_000
    assert deepspeed_zero2_gpu_bytes(total, 8) == 4 * total + 16 * total // 8
    assert deepspeed_zero2_gpu_bytes(total, 8, cpu_offload=True) == 2 * total
    assert deepspeed_zero3_gpu_bytes(total, largest, 8) == 4 * largest + 18 * total // 8
    assert deepspeed_zero3_gpu_bytes(total, largest, 8, cpu_offload=True) == (
        4 * largest + 2 * total // 8)
    assert deepspeed_zero3_gpu_bytes(total, largest, 8, cpu_offload=True,
                                     cpu_offload_params=True) == 4 * largest


def test_parallel_validates() -> None:
    assert Parallel(8, "FSDP").strategy is Strategy.FSDP
    assert Parallel(8).ranks_to_trace() == (0,)
    assert Parallel(8, ranks=(7, 0, 7)).ranks_to_trace() == (0, 7)
    with pytest.raises(UsageError, match="strategy"):
        Parallel(8, "zero4")
    with pytest.raises(UsageError, match="world"):
        Parallel(0)
    with pytest.raises(UsageError, match="ranks"):
        Parallel(4, ranks=(4,))


# -- FSDP2 traced, against the same program run for real on the fake process group -----------


def measured_fsdp(model: nn.Module, inputs: dict[str, Any] | tuple[Any, ...], world: int,
                  rank: int, units: list[str], *, reshard: bool = True,
                  checkpoint: tuple[str, ...] = ()) -> int:
    """Rank ``rank``'s real CPU peak: FSDP2 on real tensors, a fake process group of ``world``,
    two AdamW steps, read from the allocator's events (the estimator is not used)."""
    return measured(model, inputs, world, rank, units, reshard=reshard, checkpoint=checkpoint)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_fsdp_rank_peak_equals_the_real_run(world: int) -> None:
    torch.manual_seed(0)
    model = Stack(d=32, n=3)
    x = torch.randn(2, 16, 32)
    est = estimate(model, (x,), optimizer="adamw", parallel=Parallel(world, "fsdp"))
    assert est.parallel is not None
    assert est.parallel.method == "traced"
    assert est.parallel.units == ("blocks.0", "blocks.1", "blocks.2")
    assert [r.rank for r in est.parallel.ranks] == [0]
    real = measured_fsdp(model, (x,), world, 0, ["blocks.0", "blocks.1", "blocks.2"])
    assert abs(est.peak_bytes - real) <= 0.01 * real
    assert est.categories[MemoryCategory.COMMUNICATION] > 0
    assert sum(est.categories.values()) == est.peak_bytes


def test_fsdp_uneven_shards_rank_0_is_the_worst() -> None:
    # 10 output rows over 8 ranks: torch.chunk gives ranks 0-4 two rows, ranks 5-7 none; the
    # optimizer step holds the peak (one sample, wide weights)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 10), nn.Linear(10, 512), nn.Linear(512, 10))
    x = torch.randn(1, 512)
    est = estimate(model, (x,), parallel=Parallel(8, ranks=(0, 7), units=("0", "1", "2")))
    assert est.parallel is not None
    peaks = {r.rank: r.peak_bytes for r in est.parallel.ranks}
    assert est.parallel.worst_rank == 0 and peaks[0] > peaks[7]
    for rank in (0, 7):
        assert peaks[rank] == measured_fsdp(model, (x,), 8, rank, ["0", "1", "2"])


def test_fsdp_sharding_shrinks_each_rank() -> None:
    torch.manual_seed(0)
    model = Stack(d=32, n=3)
    x = torch.randn(2, 16, 32)
    params = sum(p.numel() * 4 for p in model.parameters())
    e2 = estimate(model, (x,), parallel=Parallel(2, ranks=(0,)))
    e8 = estimate(model, (x,), parallel=Parallel(8, ranks=(0,)))
    assert e8.peak_bytes < e2.peak_bytes
    # every rank holds a padded 1/8 of each parameter: at most 1/8 of them plus one row each
    assert e8.categories[MemoryCategory.PARAMETERS] < params / 8 + 4 * 32 * 9


@pytest.mark.parametrize("world", [2])
def test_fsdp_llama_with_checkpointing_and_no_reshard(world: int) -> None:
    model, inputs = tiny_llama()
    units = ["model.layers.0", "model.layers.1"]
    est = estimate(model, inputs, checkpoint=units,
                   parallel=Parallel(world, "zero3", reshard_after_forward=False, ranks=(1,)))
    assert est.parallel is not None and est.parallel.units == tuple(units)  # _no_split_modules
    real = measured_fsdp(model, inputs, world, est.parallel.worst_rank, units, reshard=False,
                         checkpoint=tuple(units))
    assert abs(est.peak_bytes - real) <= 0.01 * real


def test_fsdp_leaves_the_model_and_process_alone() -> None:
    import torch.distributed as dist

    torch.manual_seed(0)
    model = Stack(d=16, n=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    estimate(model, (torch.randn(2, 4, 16),), parallel=Parallel(4))
    assert not dist.is_initialized()
    assert type(model.blocks[0]) is Block
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None and not hasattr(p, "_local_tensor") for p in model.parameters())


def test_tensor_parallel_needs_whole_heads() -> None:
    model, inputs = tiny_llama()  # 2 key/value heads
    with pytest.raises(UsageError, match="num_key_value_heads"):
        estimate(model, inputs, parallel=Parallel(4, "tp"))


@pytest.mark.parametrize("world", [2])
def test_tensor_parallel_rank_peak_equals_the_real_run(world: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    model, inputs = tiny_llama()
    est = estimate(model, inputs, parallel=Parallel(world, "tp"))
    assert est.parallel is not None and est.parallel.method == "traced"
    work = copy.deepcopy(model)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        parallelize_module(work, init_device_mesh("cpu", (world,)), llama_tp_plan())
        params = list(work.parameters())
        before = storage_bytes([getattr(p, "_local_tensor", p) for p in params]
                               + list(work.buffers()) + list(inputs.values()))
        opt = torch.optim.AdamW(params)
        with allocator_events() as events:
            for _ in range(2):
                loss = work(**inputs).loss
                loss.backward()
                del loss
                opt.step()
                opt.zero_grad(set_to_none=True)
            del opt
    finally:
        dist.destroy_process_group()
    real = before + peak_of(events)
    assert abs(est.peak_bytes - real) <= 0.01 * real


# -- the accounted strategies ------------------------------------------------------------------


def test_replay_of_a_trace_gives_back_its_peak() -> None:
    from modelsize.estimation.parallel_trace import replay
    from modelsize.estimation.trace import Program, run_trace

    torch.manual_seed(0)
    trace = run_trace(Stack(d=32, n=2), (torch.randn(2, 8, 32),), Program(optimizer="adamw"))
    assert replay(trace.mode, lambda rec: rec.nbytes) == (trace.mode.peak_bytes,
                                                          trace.mode.peak_tick)


def test_accounted_strategies() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256))
    x = torch.randn(1, 256)  # tiny activations: the optimizer step holds the peak
    single = estimate(model, (x,), optimizer="adamw")
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    ddp = estimate(model, (x,), optimizer="adamw", parallel=Parallel(4, "ddp"))
    assert ddp.parallel is not None and ddp.parallel.method == "accounted"
    assert ddp.peak_bytes == single.peak_bytes + param_bytes  # + the Reducer's buckets
    assert ddp.categories[MemoryCategory.COMMUNICATION] == param_bytes
    one = estimate(model, (x,), optimizer="adamw", parallel=Parallel(1, "zero2"))
    assert one.peak_bytes == single.peak_bytes
    z1 = estimate(model, (x,), optimizer="adamw", parallel=Parallel(4, "zero1"))
    z2 = estimate(model, (x,), optimizer="adamw", parallel=Parallel(4, "zero2"))
    assert z2.peak_bytes < z1.peak_bytes < single.peak_bytes
    # Adam's two moments per parameter (4 bytes each), a quarter of them per rank
    state = z1.categories[MemoryCategory.OPTIMIZER_STATE]
    assert 2 * param_bytes / 4 <= state <= 2 * param_bytes / 4 + 4 * 8 * 4
    assert z2.categories[MemoryCategory.GRADIENTS] <= param_bytes / 4 + 4 * 4
    assert z1.categories[MemoryCategory.PARAMETERS] == param_bytes
    for est in (ddp, z1, z2):
        assert sum(est.categories.values()) == est.peak_bytes


def test_ddp_accounting_equals_the_real_engine() -> None:
    """Real DDP on the fake process group, measured: the Reducer's buckets are one copy of the
    gradients, held from construction, which is what the accounting adds."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def allreduce(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks the annotations
        # the fake backend's allreduce future yields None, which DDP rejects: an in-place
        # allreduce leaves the bucket where it is, so hand the bucket back
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256))
    x = torch.randn(4, 256)
    est = estimate(model, (x,), optimizer="adamw", parallel=Parallel(4, "ddp"))
    work = copy.deepcopy(model)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        before = storage_bytes([*work.parameters(), x])
        with allocator_events() as events:
            ddp = DistributedDataParallel(work, bucket_cap_mb=1)
            ddp.register_comm_hook(None, allreduce)
            opt = torch.optim.AdamW(ddp.parameters())
            for _ in range(2):
                loss = ddp(x).sum()
                loss.backward()
                del loss
                opt.step()
                opt.zero_grad(set_to_none=True)
            del opt, ddp
    finally:
        dist.destroy_process_group()
    assert est.peak_bytes == before + peak_of(events)


# -- the command -----------------------------------------------------------------------------


def _cli(capsys: Any, *args: str) -> tuple[int, str, str]:
    from modelsize.cli import main

    code = main(["estimate", "tests.estimation.models:Stack", "--input", "2x16x32",
                 "--device", "cpu", "--no-suggest", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_gpus(capsys: Any) -> None:
    code, out, err = _cli(capsys, "--gpus", "4", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["parallel"]["world"] == 4 and data["parallel"]["method"] == "traced"
    assert data["parallel"]["units"] == ["blocks.0", "blocks.1", "blocks.2"]
    torch.manual_seed(0)  # the factory's model, built again: the same program by the API
    x = torch.randn(2, 16, 32)
    est = estimate(Stack(), (x,), optimizer="adamw", parallel=Parallel(4))
    assert data["peak_bytes"] == est.peak_bytes
    assert data["categories"]["communication"] == est.categories[MemoryCategory.COMMUNICATION]

    code, out, err = _cli(capsys, "--gpus", "4", "--strategy", "zero2")
    assert code == 0, err
    assert "per rank of 4 GPUs, zero2: accounted" in out
    assert "ZeRO formula, stage 3" in out and "DeepSpeed estimate_zero3" in out


def test_cli_gpus_verifies_traced_ranks_only(capsys: Any) -> None:
    for refused in (("--strategy", "zero2"), ("--cpu-offload",)):
        code, _, err = _cli(capsys, "--gpus", "2", "--verify", *refused)
        assert code == 2
        assert len(err.strip().splitlines()) == 1 and "--verify" in err
    # a traced rank: the real run on the fake process group, measured by the test's own code
    code, out, err = _cli(capsys, "--gpus", "2", "--verify", "--json")
    assert code == 0, err
    data = json.loads(out)["verification"]
    torch.manual_seed(0)  # the factory's model and input, built again
    model = Stack()
    x = torch.randn(2, 16, 32)
    real = measured_fsdp(model, (x,), 2, 0, ["blocks.0", "blocks.1", "blocks.2"])
    assert data["measured_bytes"] == real == data["estimated_bytes"]


def test_shard_units() -> None:
    from modelsize.estimation.parallel_trace import shard_units

    model = Stack(d=8, n=2)
    assert shard_units(model) == ["blocks.0", "blocks.1"]  # the largest ModuleList
    assert shard_units(model, ["Block"]) == ["blocks.0", "blocks.1"]  # a class name
    assert shard_units(model, ["blocks.*", "blocks.0.ln"]) == ["blocks.0", "blocks.1"]
    assert shard_units(nn.Sequential(nn.Linear(2, 2))) == []  # no repeated blocks: root only
    with pytest.raises(UsageError, match="no module matches"):
        shard_units(model, ["decoder.*"])
