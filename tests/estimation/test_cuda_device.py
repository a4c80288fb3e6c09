"""The CUDA device model against the caching allocator's records of real runs.

The numbers asserted here were recorded on an NVIDIA H100 80GB HBM3 with PyTorch 2.11.0+cu130
(cuDNN 9.19, transformers 5.17.0) by benchmarks/gpu_train.py, gpu_generate.py and
gpu_diagnose.py; the traces behind them are summarised in tests/fixtures/cuda_traces (see its
generate.py). No GPU is needed: the allocator's rules are replayed in Python, and the CPU
trace of a program is compared with what the GPU's allocator saw.
"""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from modelsize.estimation import estimate
from modelsize.estimation.cuda_allocator import CachingAllocator, allocation_size, round_size
from modelsize.estimation.cuda_kernels import (
    _cublas_copy,
    cudnn_workspace,
    reduce_buffers,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "cuda_traces"
MiB = 2**20


def _fixture(name: str) -> Any:
    with gzip.open(FIXTURES / name, "rt") as f:
        return json.load(f)


# -- the caching allocator's rules, worked by hand --------------------------------------------

def test_requests_round_to_512_bytes_and_small_ones_share_2_mib_segments() -> None:
    sim = CachingAllocator()
    a = sim.malloc(1)
    b = sim.malloc(513)
    assert (a.size, b.size) == (512, 1024)  # type: ignore[union-attr]
    assert sim.segments == [2 * MiB] and sim.allocated == 1536
    assert sim.malloc(0) is None


def test_large_segments_and_the_1_mib_split_rule() -> None:
    assert allocation_size(round_size(MiB + 1)) == 20 * MiB  # 1-10 MiB: a 20 MiB segment
    assert allocation_size(round_size(11 * MiB + 1)) == 12 * MiB  # >= 10 MiB: 2 MiB steps
    sim = CachingAllocator()
    big = sim.malloc(int(10.5 * MiB))
    # the 12 MiB segment keeps 1.5 MiB after the request: more than 1 MiB, split off
    assert big.size == round_size(int(10.5 * MiB))  # type: ignore[union-attr]
    sim = CachingAllocator()
    tight = sim.malloc(11 * MiB + 512)
    # 12 MiB segment, 1 MiB - 512 B would remain: not split, the whole segment is the block
    assert tight.size == 12 * MiB and sim.allocated == 12 * MiB  # type: ignore[union-attr]


def test_best_fit_reuse_merging_and_empty_cache() -> None:
    sim = CachingAllocator()
    blocks = [sim.malloc(4 * MiB) for _ in range(4)]  # four blocks of one 20 MiB segment
    assert sim.segments == [20 * MiB]
    sim.free(blocks[1])
    sim.free(blocks[2])  # merged with its free neighbour: 8 MiB free in the middle
    again = sim.malloc(7 * MiB)
    # best fit is the 8 MiB hole (the 4 MiB tail is too small); 1 MiB would remain: unsplit
    assert again.addr == blocks[1].addr and again.size == 8 * MiB  # type: ignore[union-attr]
    assert sim.segments == [20 * MiB]
    for b in (blocks[0], again, blocks[3]):
        sim.free(b)
    sim.empty_cache()
    assert sim.reserved == 0 and sim.allocated == 0


def test_replaying_a_recorded_generation_gives_its_max_memory_allocated() -> None:
    """Gemma-3-like, batch 1, 16k context: 12,514 allocations recorded on an H100."""
    data = _fixture("gemma3_b1_16k.json.gz")
    sim = CachingAllocator()
    for n in data["resident"]:
        sim.malloc(n)
    assert sim.allocated == data["allocated_before"]
    first = len(sim.segments)
    sim.reset_peak()
    blocks = []
    for e in data["events"]:
        if e > 0:
            blocks.append(sim.malloc(e))
        else:
            sim.free(blocks[-e - 1])
    assert sim.peak == data["max_memory_allocated"] == 5_570_690_560
    assert sim.segments[first:] == data["segments"]


# -- what CUDA kernels allocate, against the sizes recorded ------------------------------------

def test_reduction_buffers_of_gpt2_bias_gradients() -> None:
    # the bias gradient of a [4 x 512, n] output: a sum over 2,048 rows (recorded in backward)
    for n, recorded in ((768, (12_582_912, 24)), (2304, (37_748_736, 72)),
                        (3072, (50_331_648, 96))):
        assert reduce_buffers((2048, n), (n, 1), [0], 4, 4) == recorded
        assert reduce_buffers((2048, n), (n, 1), [0], 2, 4) == recorded  # bf16, float acc
        assert reduce_buffers((4, 512, n), (512 * n, n, 1), [0, 1], 4, 4) == recorded
    assert reduce_buffers((2048, 2048), (2048, 1), [1], 4, 4) == (0, 0)  # rows: no split


def test_cudnn_attention_workspaces() -> None:
    def ws(b: int, h: int, q: int, k: int, d: int) -> int:
        meta = torch.device("meta")
        return cudnn_workspace(torch.empty(b, h, q, d, device=meta),
                               torch.empty(b, h, k, d, device=meta),
                               torch.empty(b, h, k, d, device=meta))
    assert ws(1, 8, 16376, 16376, 256) == 256  # a prefill
    assert ws(1, 8, 1, 16384, 256) == 528_512  # gemma3-like decode, full attention
    assert ws(1, 8, 1, 1024, 256) == 66_176  # its sliding layers
    assert ws(1, 32, 1, 2045, 64) == 135_296  # llama-like decode


def test_cublas_copies_operands_it_cannot_read() -> None:
    meta = torch.device("meta")
    grad = torch.empty(1, 1, device=meta).expand(64, 100)  # d(sum)/d(out): stride 0
    assert _cublas_copy(grad) == 64 * 100 * 4  # recorded: 25,600 bytes, twice per step
    assert _cublas_copy(torch.empty(64, 100, device=meta)) == 0
    assert _cublas_copy(torch.empty(100, 64, device=meta).t()) == 0


# -- whole programs ------------------------------------------------------------------------------

class ConvNet(nn.Module):
    """benchmarks/gpu_train.py's image classifier (width 64)."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        cin = 3
        for cout in (width, 2 * width, 4 * width):
            layers += [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(),
                       nn.MaxPool2d(2)]
            cin = cout
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(cin, 100)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


def test_convnet_training_matches_the_h100() -> None:
    """Two AdamW steps at batch 64 x 3 x 64 x 64 in a fresh process: 420,122,112 bytes."""
    with torch.device("meta"):
        model = ConvNet()
    est = estimate(model, (torch.randn(64, 3, 64, 64),), mode="train", device="cuda")
    assert est.device_estimate.allocated_bytes == 420_122_112
    terms = {t.name: t.nbytes for t in est.device_estimate.terms}
    # the main thread's cuBLAS and cuBLASLt workspaces (the head's addmm) and the autograd
    # thread's cuBLAS workspace
    assert terms["cublas_workspace"] == 2 * 32 * MiB + MiB


def test_foreach_step_counters_are_host_memory() -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    x = torch.randn(4, 64)
    kwargs: dict[str, Any] = {"mode": "train", "optimizer": "adamw",
                              "implementation": "foreach"}
    cpu = estimate(model, (x,), device="cpu", **kwargs)
    cuda = estimate(model, (x,), device="cuda", **kwargs)
    state = "optimizer_state"
    params = sum(p.numel() for p in model.parameters()) * 4
    # two moments per parameter on both; four float32 step counters on the CPU only
    assert cpu.categories[state] == 2 * params + 4 * 4  # type: ignore[index]
    assert cuda.categories[state] == 2 * params  # type: ignore[index]


def _events_by_step(events: list[Any]) -> list[tuple[list[int], Counter[int]]]:
    steps: list[tuple[list[int], Counter[int]]] = []
    for e in events:
        if e.alloc:
            if not steps or steps[-1][1]:
                steps.append(([], Counter()))
            steps[-1][0].append(e.nbytes)
        elif steps:
            steps[-1][1][e.nbytes] += 1
    return steps


def test_gpt2_bf16_training_allocates_as_on_the_h100() -> None:
    """Every allocation and free of two AdamW steps of GPT-2 under bf16 autocast, in order:
    CUDA's autocast lists (GELU's pow in float32), cuDNN attention, the reductions' buffers,
    the workspaces of both threads, the CPU step counters (benchmarks/gpu_train.py)."""
    transformers = pytest.importorskip("transformers")
    from modelsize.estimation.core import Settings
    from modelsize.estimation.device import device_events, workspace_plan
    from modelsize.estimation.trace import run_trace

    config = transformers.GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257,
                                     n_positions=1024)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 50257, (4, 512), generator=torch.Generator().manual_seed(0))
    settings = Settings(mode="train", optimizer="adamw", loss=None, amp=torch.bfloat16,
                        device="cuda", implementation=None, accumulate=1, checkpoint=(),
                        steps=None, optimize_frozen=False)
    mode = run_trace(model, {"input_ids": ids, "labels": ids.clone()},
                     settings.program()).mode
    plan = workspace_plan(mode.first_calls)
    events = [e for e in device_events(mode.allocations, mode.scratch_at, mode.tick, plan,
                                       mode.scratch_parts) if e.tick > 0]
    # the recording process had run a matmul before: its main-thread cuBLAS workspace existed
    first = next(i for i, e in enumerate(events) if e.kind == "workspace")
    assert events[first].nbytes == 32 * MiB
    del events[first]
    ours = _events_by_step(events)
    recorded = _fixture("gpt2_train_bf16.json.gz")["steps"]
    assert len(ours) >= len(recorded) - 1
    for k, (allocs, frees) in enumerate(recorded[:-1]):  # the last: the program's end
        assert ours[k][0] == allocs, k
        assert ours[k][1] == Counter(frees), k
