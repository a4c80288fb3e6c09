"""``--fit`` across GPUs: the fewest GPUs whose worst rank fits, and the largest batch per rank
on a given count, both checked against estimates traced at each count."""

from __future__ import annotations

import pytest
import torch

from modelsize.estimation import estimate
from modelsize.estimation.parallel import Parallel
from modelsize.estimation.targets import Options, Target, fit_both, fit_target, world_allowed
from modelsize.report.estimate_text import render_fit
from tests.estimation.models import Stack, tiny_llama

OPTIONS = Options("train", "adamw", "default", None, "cpu", 1, ())


@pytest.fixture(scope="module")
def target() -> Target:
    model = Stack(d=32, n=3)

    def make(batch: int, seq: int, train: bool) -> tuple[torch.Tensor]:
        return (torch.randn(batch, seq, 32, generator=torch.Generator().manual_seed(0)),)

    return Target("stack", "3 MLP blocks", model, make, 2, 16, "Block")


def peak(target: Target, world: int, batch: int = 2) -> int:
    return estimate(target.model, target.make_inputs(batch, 16, True), mode="train",
                    optimizer="adamw", device="cpu",
                    parallel=Parallel(world)).device_estimate.total_bytes


def test_fewest_gpus_is_the_first_count_whose_rank_fits(target: Target) -> None:
    peaks = {w: peak(target, w) for w in (1, 2, 3)}
    assert peaks[1] > peaks[2] > peaks[3]
    result = fit_target(target, 2, 16, OPTIONS, peaks[3], "gpus", parallel=Parallel(1))
    assert result.smallest and result.best == 3 and result.best_bytes == peaks[3]
    assert dict(result.probes)[2] == peaks[2]
    text = render_fit(result)
    assert "fewest GPUs that fit" in text and ": 3 (" in text and "2 GPUs need" in text


def test_largest_batch_per_rank_with_and_without_checkpointing(target: Target) -> None:
    budget = peak(target, 4, batch=5)
    results = fit_both(target, 2, 16, OPTIONS, budget, "batch", parallel=Parallel(4))
    assert [r.label for r in results] == ["", "with checkpointing on every Block"]
    probes = dict(results[0].probes)
    best = results[0].best
    assert best >= 5 and probes[best] <= budget < probes[best + 1]
    assert probes[best + 1] == peak(target, 4, batch=best + 1)
    asked = fit_both(target, 2, 16, Options("train", "adamw", "default", None, "cpu", 1,
                                            ("Block",)), 10**7, "gpus", parallel=Parallel(1))
    assert len(asked) == 1 and asked[0].best == 1


def test_tensor_parallel_counts_must_split_the_heads() -> None:
    model, _ = tiny_llama()
    tp = Parallel(2, "tp")
    # 4 attention heads, 2 KV heads
    assert [w for w in range(1, 9) if world_allowed(model, tp, w)] == [1, 2]
    assert world_allowed(model, Parallel(2), 3)


def test_cli_fit_across_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from modelsize.cli import main

    args = ["estimate", "tests.estimation.models:Stack", "--input", "2x16x32", "--device",
            "cpu", "--no-suggest"]
    torch.manual_seed(0)
    model = Stack()
    peaks = {w: estimate(model, (torch.randn(2, 16, 32),), optimizer="adamw", device="cpu",
                         parallel=Parallel(w)).peak_bytes for w in (2, 3)}
    assert main([*args, "--fit", str(peaks[3]), "--fit-dim", "gpus", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fit"]["best"] == 3 and data["fit"]["smallest"]
    assert data["parallel"]["world"] == 3 and data["peak_bytes"] == peaks[3]
    assert data["fit_checkpointed"]["label"] == "with checkpointing on every Block"
    assert main([*args, "--gpus", "2", "--fit", "1MB", "--fit-dim", "gpus"]) == 2
    assert "leave out --gpus" in capsys.readouterr().err


def test_api_verify_across_gpus() -> None:
    torch.manual_seed(0)
    est = estimate(Stack(), (torch.randn(2, 16, 32),), optimizer="adamw", device="cpu",
                   parallel=Parallel(2), verify=True)
    assert est.verification is not None
    assert est.verification.measured_bytes == est.peak_bytes


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_accounted_ranks_device_terms_follow_the_divided_peak(device: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 16, 32)
    single = estimate(Stack(), (x,), optimizer="adamw", device=device)
    zero2 = estimate(Stack(), (x,), optimizer="adamw", device=device,
                     parallel=Parallel(4, "zero2"))
    assert zero2.peak_bytes < single.peak_bytes
    dev = zero2.device_estimate
    terms = {t.name: t.nbytes for t in dev.terms}
    assert terms["tensors"] + terms["kernel_scratch"] == zero2.peak_bytes
    if device == "cpu":
        assert dev.total_bytes == dev.allocated_bytes == zero2.peak_bytes
    else:  # rounding of the rank's own allocations, same workspace and context
        assert 0 <= terms["allocator_rounding"] < 512 * 400
        single_terms = {t.name: t.nbytes for t in single.device_estimate.terms}
        assert terms["cuda_context"] == single_terms["cuda_context"]
        assert dev.total_bytes == (zero2.peak_bytes + terms["allocator_rounding"]
                                   + terms["cublas_workspace"] + terms["cuda_context"])
        assert dev.total_bytes < single.device_estimate.total_bytes
