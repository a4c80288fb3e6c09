"""FSDP2's mixed-precision policy, FSDP2 + tensor parallelism on a 2D mesh, and CPU offload:
each traced rank against the same program run with real tensors on the fake process group,
measured by the allocator's profiler (the estimator is not used on the measured side)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from modelsize.errors import UsageError
from modelsize.estimation import MemoryCategory, estimate
from modelsize.estimation.parallel import Parallel, Strategy
from tests.estimation.groundtruth import measured
from tests.estimation.models import Stack, tiny_llama
from tests.estimation.test_parallel import _cli

STACK_UNITS = ["blocks.0", "blocks.1", "blocks.2"]
LLAMA_UNITS = ["model.layers.0", "model.layers.1"]


# -- 1. FSDP2 mixed precision ----------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 4])
def test_mixed_precision_policy_equals_the_real_run(world: int) -> None:
    torch.manual_seed(0)
    model = Stack(d=32, n=3)
    x = torch.randn(2, 16, 32)
    est = estimate(model, (x,), optimizer="adamw", amp=torch.bfloat16,
                   parallel=Parallel(world, "fsdp"))
    assert est.parallel is not None and est.parallel.mixed_precision == "policy"
    assert any("MixedPrecisionPolicy(param_dtype=bfloat16" in n for n in est.notes)
    assert est.peak_bytes == measured(model, (x,), world, 0, STACK_UNITS, mp=torch.bfloat16)


def test_mixed_precision_autocast_equals_the_real_run() -> None:
    torch.manual_seed(0)
    model = Stack(d=32, n=3)
    x = torch.randn(2, 16, 32)
    est = estimate(model, (x,), optimizer="adamw", amp=torch.bfloat16,
                   parallel=Parallel(2, "fsdp", mixed_precision="autocast"))
    assert est.parallel is not None and est.parallel.mixed_precision == "autocast"
    assert any("Autocast caches" in n for n in est.notes)
    assert est.peak_bytes == measured(model, (x,), 2, 0, STACK_UNITS, autocast=torch.bfloat16)


def test_autocast_caches_a_copy_of_every_gathered_parameter() -> None:
    """The autocast program holds a bf16 copy of every float32 parameter a Linear casts,
    gathered whole, until the forward ends, though FSDP2 frees the gathered float32 parameter
    after each block: with checkpointing (nothing saved for the backward) the forward's peak,
    in the last block, falls by exactly the earlier blocks' copies when autocast's cache is
    off (the last block's copy is live in both)."""
    torch.manual_seed(0)
    model = Stack(d=64, n=3)
    x = torch.randn(1, 4, 64)  # small activations: the copies stand out
    block = [m for m in model.blocks[0].modules() if isinstance(m, nn.Linear)]
    copies = sum(p.numel() * 2 for m in block for p in m.parameters())  # bf16, whole
    kw: dict[str, Any] = {"autocast": torch.bfloat16, "checkpoint": tuple(STACK_UNITS),
                          "forward_only": True}
    cached = measured(model, (x,), 4, 0, STACK_UNITS, **kw)
    uncached = measured(model, (x,), 4, 0, STACK_UNITS, cache=False, **kw)
    assert cached - uncached == 2 * copies
    # the estimate of that program sees the same copies, and the policy program does not
    train: dict[str, Any] = {"optimizer": "adamw", "amp": torch.bfloat16,
                             "checkpoint": STACK_UNITS}
    est = estimate(model, (x,), **train, parallel=Parallel(4, mixed_precision="autocast"))
    assert est.peak_bytes == measured(model, (x,), 4, 0, STACK_UNITS, autocast=torch.bfloat16,
                                      checkpoint=tuple(STACK_UNITS))
    pol = estimate(model, (x,), **train, parallel=Parallel(4))
    assert pol.peak_bytes < est.peak_bytes


# -- 2. fsdp+tp on a 2D mesh -----------------------------------------------------------------


def test_fsdp_tp_equals_the_real_run() -> None:
    model, inputs = tiny_llama()
    est = estimate(model, inputs, optimizer="adamw", parallel=Parallel(4, "fsdp+tp", tp=2))
    assert est.parallel is not None
    assert est.parallel.method == "traced" and est.parallel.mesh == (("dp", 2), ("tp", 2))
    assert est.parallel.units == tuple(LLAMA_UNITS)
    assert est.peak_bytes == measured(model, inputs, 4, 0, LLAMA_UNITS, tp=2)
    assert est.categories[MemoryCategory.COMMUNICATION] > 0
    assert sum(est.categories.values()) == est.peak_bytes


def test_fsdp_tp_with_mixed_precision_policy_equals_the_real_run() -> None:
    model, inputs = tiny_llama()
    est = estimate(model, inputs, optimizer="adamw", amp=torch.bfloat16,
                   parallel=Parallel(4, "fsdp+tp", tp=2, ranks=(3,)))
    assert est.parallel is not None and est.parallel.worst_rank == 3
    assert est.peak_bytes == measured(model, inputs, 4, 3, LLAMA_UNITS, tp=2, mp=torch.bfloat16)


def test_tp_degree_validation() -> None:
    assert Parallel(8, "fsdp+tp", tp=2).mesh == (("dp", 4), ("tp", 2))
    assert Parallel(8, "tp").tp == 8 and Parallel(8, "tp").mesh == (("tp", 8),)
    assert Parallel(8, "fsdp").tp == 1
    with pytest.raises(UsageError, match="divides 8"):
        Parallel(8, "fsdp+tp", tp=3)
    with pytest.raises(UsageError, match="needs a tensor-parallel degree"):
        Parallel(8, "fsdp+tp")
    with pytest.raises(UsageError, match="fsdp\\+tp"):
        Parallel(8, "tp", tp=2)
    with pytest.raises(UsageError, match="cannot exceed"):
        Parallel(4, "fsdp+tp", tp=8)
    with pytest.raises(UsageError, match="applies to strategies"):
        Parallel(8, "ddp", tp=2)
    with pytest.raises(UsageError, match="mixed precision"):
        Parallel(8, mixed_precision="fp8")
    with pytest.raises(UsageError, match="CPU offload"):
        Parallel(8, Strategy.TP, cpu_offload=True)


# -- 3. CPU offload ----------------------------------------------------------------------------


def test_cpu_offload_runs_the_real_engine_and_splits_gpu_and_host() -> None:
    from modelsize.estimation.parallel_trace import offload_split, run_rank_trace
    from modelsize.estimation.trace import Program

    torch.manual_seed(0)
    model = Stack(d=32, n=3)
    x = torch.randn(2, 16, 32)
    # the policy runs on the CPU mesh, where its copies are no-ops: the one memory it traces
    # equals the real run's
    rt = run_rank_trace(model, (x,), Program(optimizer="adamw"), 2, 0, units=STACK_UNITS,
                        cpu_offload=True)
    assert rt.trace.mode.peak_bytes == measured(model, (x,), 2, 0, STACK_UNITS, offload=True)
    split = offload_split(rt)
    assert not any(r.origin.name in ("PARAMETER", "OPTIMIZER") or r.is_state
                   for r in split.gpu)

    est = estimate(model, (x,), optimizer="adamw", parallel=Parallel(2, cpu_offload=True))
    plain = estimate(model, (x,), optimizer="adamw", parallel=Parallel(2))
    par = est.parallel
    assert par is not None and par.cpu_offload and par.method == "traced"
    assert par.accounted and any(n.startswith("accounted, not traced: CPU offload")
                                 for n in est.notes)
    assert est.peak_bytes < plain.peak_bytes
    for cat in (MemoryCategory.PARAMETERS, MemoryCategory.GRADIENTS,
                MemoryCategory.OPTIMIZER_STATE):
        assert est.categories[cat] == 0
    assert sum(est.categories.values()) == est.peak_bytes
    # the host holds rank 0's padded half of every parameter, and at its peak (the optimizer
    # step) the unpadded gradients and Adam's two moments too
    shards = [torch.chunk(p.detach().reshape(-1) if p.dim() == 1 else p.detach(), 2)[0]
              for p in model.parameters()]
    padded = sum(-(-p.shape[0] // 2) * (p[0].numel() if p.dim() > 1 else 1) * 4
                 for p in model.parameters())
    unpadded = sum(t.numel() * 4 for t in shards)
    assert par.host_peak_bytes is not None
    assert par.host_peak_bytes >= padded + unpadded + 2 * unpadded


# -- the command -------------------------------------------------------------------------------


def test_cli_mixed_precision_and_offload(capsys: Any) -> None:
    import json

    code, out, err = _cli(capsys, "--gpus", "2", "--amp", "bf16", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["parallel"]["mixed_precision"] == "policy"
    assert data["parallel"]["mesh"] == {"dp": 2}
    torch.manual_seed(0)  # the factory's model, built again
    x = torch.randn(2, 16, 32)
    est = estimate(Stack(), (x,), optimizer="adamw", amp=torch.bfloat16, parallel=Parallel(2))
    assert data["peak_bytes"] == est.peak_bytes

    code, out, err = _cli(capsys, "--gpus", "2", "--amp", "bf16", "--fsdp-mp", "autocast")
    assert code == 0, err
    assert "mixed precision by torch.autocast" in out and "Autocast caches" in out

    code, out, err = _cli(capsys, "--gpus", "2", "--cpu-offload")
    assert code == 0, err
    assert "CPU offload: GPU memory (host" in out and "accounted, not traced" in out


@pytest.mark.parametrize(("args", "message"), [
    (("--gpus", "4", "--tp", "3"), "divides 4"),
    (("--gpus", "4", "--strategy", "tp", "--tp", "2"), "fsdp+tp"),
    (("--gpus", "4", "--strategy", "ddp", "--cpu-offload"), "CPU offload"),
    (("--gpus", "4", "--fsdp-mp", "autocast"), "--amp"),
    (("--gpus", "4", "--strategy", "ddp", "--amp", "bf16", "--fsdp-mp", "policy"), "no FSDP2"),
])
def test_cli_refuses_bad_layouts_in_one_line(capsys: Any, args: tuple[str, ...],
                                             message: str) -> None:
    code, _, err = _cli(capsys, *args)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and message in err


def test_cli_tp_means_fsdp_tp_on_a_2d_mesh(tmp_path: Any, capsys: Any) -> None:
    import json

    from modelsize.cli import main

    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
              "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 176, "vocab_size": 512}
    (tmp_path / "config.json").write_text(json.dumps(config))
    base = ["estimate", str(tmp_path / "config.json"), "--batch", "2", "--seq", "32",
            "--device", "cpu", "--no-suggest", "--gpus", "4", "--tp", "2"]
    assert main(base) == 0
    out = capsys.readouterr().out
    assert "per rank of 4 GPUs, fsdp+tp" in out and "mesh dp 2 x tp 2" in out
    assert "rank 0 is (dp 0, tp 0)" in out
    # --verify: the same rank run with real tensors on the fake process group
    assert main([*base, "--amp", "bf16", "--verify", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["parallel"]["strategy"] == "fsdp+tp" and data["parallel"]["method"] == "traced"
    assert data["parallel"]["mesh"] == {"dp": 2, "tp": 2}
    assert data["parallel"]["units"] == LLAMA_UNITS
    assert data["parallel"]["mixed_precision"] == "policy"
    verified = data["verification"]
    assert verified["measured_bytes"] == verified["estimated_bytes"] == data["peak_bytes"]
