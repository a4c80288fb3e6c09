"""The CPU flash attention model against the allocator's own events, case by case.

Each case runs the real kernel under the CPU profiler and takes the high-water mark of its
allocations above what stays allocated (its outputs): the model must give exactly that.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from modelsize.estimation import flash, scratch
from modelsize.estimation.tracker import CountingFakeMode

aten = torch.ops.aten
FWD = aten._scaled_dot_product_flash_attention_for_cpu.default
BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default

pytestmark = pytest.mark.skipif(
    flash.packs_half(), reason="AMX-FP16 CPU: float16 takes the packed path, which is probed")


@contextlib.contextmanager
def _without_onednn() -> Iterator[None]:
    """PyTorch with oneDNN off: the kernels a CPU without oneDNN's bfloat16/float16 GEMMs
    runs (where this CPU has them, they add scratch pads the analytic model leaves to probes)."""
    saved = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = saved


def _measure(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = func(*args, **kwargs)
    del out
    cur = high = 0
    for e in prof.profiler.kineto_results.events():
        if e.name() == "[memory]":
            cur += e.nbytes()
            high = max(high, cur)
    return high - cur


def _bhld(b: int, h: int, n: int, d: int, dtype: torch.dtype, layout: str) -> torch.Tensor:
    """A (B, H, L, D) tensor laid out as B x H x L x D, B x L x H x D, or expanded heads."""
    if layout == "bhld":
        return torch.randn(b, h, n, d).to(dtype)
    if layout == "blhd":
        return torch.randn(b, n, h, d).to(dtype).transpose(1, 2)
    return torch.randn(b, 1, n, d).to(dtype).expand(b, h, n, d)


def _cases() -> Iterator[tuple[str, int, tuple[int, int, int, int, int], torch.dtype, str,
                               str | None]]:
    shapes = [(1, 2, 10, 10, 64), (2, 3, 100, 37, 33), (1, 2, 191, 600, 64),
              (1, 2, 192, 192, 128), (1, 1, 300, 520, 64), (1, 1, 767, 100, 16),
              (1, 1, 768, 530, 16), (0, 2, 50, 50, 64), (1, 2, 40, 40, 0)]
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        for shape in shapes:
            yield "plain", 2, shape, dtype, "bhld", None
    for threads in (1, 3):
        for dtype in (torch.float32, torch.bfloat16):
            yield "threads", threads, (1, 2, 300, 300, 64), dtype, "blhd", None
    for layout in ("blhd", "expand"):
        yield "layout", 2, (2, 4, 200, 200, 64), torch.bfloat16, layout, None
    for mask in ("2d", "4d", "broadcast"):
        yield "mask", 2, (1, 2, 200, 150, 64), torch.float32, "bhld", mask


def _mask(kind: str | None, b: int, h: int, n: int, s: int, dtype: torch.dtype) -> Any:
    if kind is None:
        return None
    shape = {"2d": (n, s), "4d": (b, h, n, s), "broadcast": (1, 1, n, 1)}[kind]
    return torch.zeros(shape, dtype=dtype)


@pytest.mark.parametrize("case", list(_cases()), ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}-{c[3]}"
                         f"-{c[4]}-{c[5]}")
def test_flash_attention_scratch_is_exact(
    case: tuple[str, int, tuple[int, int, int, int, int], torch.dtype, str, str | None],
) -> None:
    _, threads, (b, h, n, s, d), dtype, layout, mask_kind = case
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with _without_onednn():
            _check_case(b, h, n, s, d, dtype, layout, mask_kind)
    finally:
        torch.set_num_threads(saved)


def _check_case(b: int, h: int, n: int, s: int, d: int, dtype: torch.dtype, layout: str,
                mask_kind: str | None) -> None:
    torch.manual_seed(0)
    q, k, v = (_bhld(b, h, m, d, dtype, layout) for m in (n, s, s))
    kwargs = {"attn_mask": _mask(mask_kind, b, h, n, s, dtype)} if mask_kind else {}
    out, lse = FWD(q, k, v, **kwargs)
    assert flash.forward_scratch((q, k, v)) == _measure(FWD, (q, k, v), kwargs)
    for grad in (torch.ones_like(out), torch.ones(b, n, h, d).to(dtype).transpose(1, 2),
                 torch.ones(1, 1, 1, 1).to(dtype).expand_as(out)):
        args = (grad, q, k, v, out, lse, 0.0, False)
        assert flash.backward_scratch(args) == _measure(BWD, args, kwargs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_attention_on_onednn_gemms_is_probed(dtype: torch.dtype) -> None:
    """Where oneDNN runs this dtype's GEMMs (this CPU), the kernel's scratch pads come on top
    of the analytic model's buffers: the table probes the call, and matches the real run."""
    if dtype not in scratch.onednn_matmul():
        pytest.skip(f"this CPU runs {dtype} GEMMs through BLAS: the analytic model applies")
    torch.manual_seed(0)
    q, k, v = (_bhld(2, 4, m, 64, dtype, "bhld") for m in (200, 150, 150))
    out, lse = FWD(q, k, v)
    grad = torch.ones_like(out)
    real_fwd, real_bwd = _measure(FWD, (q, k, v), {}), _measure(
        BWD, (grad, q, k, v, out, lse, 0.0, False), {})
    models = scratch.table("cpu")
    mode = CountingFakeMode()
    fq, fk, fv, fo, fl, fg = (mode.from_tensor(t) for t in (q, k, v, out, lse, grad))
    fwd = models.cost(FWD, (fq, fk, fv), {}, (fo, fl))  # outside the mode, as the tracker does
    bwd = models.cost(BWD, (fg, fq, fk, fv, fo, fl, 0.0, False), {}, None)
    assert fwd is not None and fwd.scratch == real_fwd
    assert bwd is not None and bwd.scratch == real_bwd
    assert models.probes_run > 0
    assert any("oneDNN" in note for note in models.notes)


def test_the_table_uses_the_model_and_runs_nothing() -> None:
    with _without_onednn():
        models = scratch.table("cpu")
    mode = CountingFakeMode()
    with mode:
        q = torch.empty(1, 8, 2048, 128, dtype=torch.bfloat16)
        out, lse = FWD(q, q, q, 0.0, True)
        cost = models.cost(FWD, (q, q, q, 0.0, True), {}, (out, lse))
        back = models.cost(BWD, (out, q, q, q, out, lse, 0.0, True), {}, None)
    threads = torch.get_num_threads()
    # buf: qk 256 x 512, row max and sum, 256 x 128 out block, in float; qk again in bf16
    assert cost is not None and cost.scratch == threads * (
        4 * (256 * 512 + 2 * 256 + 256 * 128) + 2 * 256 * 512)
    # attn and grad_attn blocks in float and bf16, a dsum row, the grad_out copy
    assert back is not None and back.scratch == threads * 2 * 256 * 512 * (4 + 2) + 4 * 256 + (
        2 * 8 * 2048 * 128)
    assert models.probes_run == 0
