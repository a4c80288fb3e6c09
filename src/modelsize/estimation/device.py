"""From the tensor peak to what a device reports: each term named, each assumption stated.

CPU: PyTorch's CPU allocator hands out exactly the bytes asked for (the profiler's
``[memory]`` events carry the requested sizes), so the device estimate is the tensor peak,
kernel scratch included. Validated against the profiler in tests/estimate.

CUDA (not validated here: no GPU was available when this model was written; see
benchmarks/RESULTS.md):

* ``allocator_rounding``: the caching allocator rounds every block up to a multiple of 512
  bytes (``kMinBlockSize``); the peak of rounded sizes is replayed from the trace, allocation
  by allocation, so it is not just the rounded peak;
* ``cublas_workspace``: one cuBLAS/cuBLASLt workspace per handle and stream, allocated through
  the caching allocator on the first matmul: 32 MiB on Hopper (sm90), 8 MiB + 128 KiB on other
  GPUs (PyTorch's ``CUBLAS_WORKSPACE_CONFIG`` defaults);
* ``cuda_context``: the driver context, kernels and cuDNN/cuBLAS handles, outside PyTorch's
  allocator (seen in ``nvidia-smi``, not in ``max_memory_allocated``): several hundred MiB
  depending on the GPU, the driver and lazy loading; 512 MiB is assumed;
* not modelled: cuDNN convolution workspaces (chosen by the autotuner at run time), caching
  allocator fragmentation (``max_memory_reserved`` minus ``max_memory_allocated``), kernels
  that differ between CPU and CUDA (the trace runs the CPU kernels' shapes).
"""

from __future__ import annotations

from collections.abc import Sequence

from modelsize.estimation.result import DeviceEstimate, DeviceTerm
from modelsize.estimation.tracker import Allocation

CUDA_BLOCK = 512
CUBLAS_WORKSPACE_SM90 = 32 * 2**20
CUBLAS_WORKSPACE_DEFAULT = 4096 * 1024 * 2 + 16 * 1024 * 8
CUDA_CONTEXT = 512 * 2**20


def round_up(n: int, block: int) -> int:
    """``n`` rounded up to a multiple of ``block`` (0 stays 0)."""
    return -(-n // block) * block


def rounded_peak(allocations: Sequence[Allocation], scratch_at: dict[int, int],
                 ticks: int, block: int) -> int:
    """The peak of live bytes when every allocation is rounded up to ``block`` bytes."""
    born = [0] * (ticks + 2)
    dead = [0] * (ticks + 2)
    live = 0
    for rec in allocations:
        size = round_up(rec.nbytes, block)
        if rec.freed == 0:
            continue  # gone before the first op
        if rec.created == 0:
            live += size
        else:
            born[rec.created] += size
        if rec.freed >= 0:
            dead[max(rec.freed, rec.created)] += size
    peak = live
    for tick in range(1, ticks + 1):
        live += born[tick]
        extra = scratch_at.get(tick, 0)
        peak = max(peak, live + round_up(extra, block))
        live -= dead[tick]
    return peak


def device_estimate(device: str, peak_bytes: int, scratch_bytes: int,
                    allocations: Sequence[Allocation], scratch_at: dict[int, int],
                    ticks: int, uses_matmul: bool, gpu: str = "sm90") -> DeviceEstimate:
    """The named terms between the tensor peak and what ``device`` would report."""
    terms: tuple[DeviceTerm, ...]
    if device != "cuda":
        terms = (
            DeviceTerm("tensors", peak_bytes - scratch_bytes, "live tensor storages at the peak"),
            DeviceTerm("kernel_scratch", scratch_bytes, "buffers the kernels allocate internally"),
        )
        return DeviceEstimate(device, terms, True, peak_bytes, peak_bytes)
    rounded = rounded_peak(allocations, scratch_at, ticks, CUDA_BLOCK)
    workspace = 0
    if uses_matmul:
        workspace = CUBLAS_WORKSPACE_SM90 if gpu == "sm90" else CUBLAS_WORKSPACE_DEFAULT
    terms = (
        DeviceTerm("tensors", peak_bytes - scratch_bytes, "live tensor storages at the peak"),
        DeviceTerm("kernel_scratch", scratch_bytes, "CPU kernels' buffers (CUDA kernels differ)"),
        DeviceTerm("allocator_rounding", rounded - peak_bytes,
                   "caching allocator rounds each block up to 512 bytes"),
        DeviceTerm("cublas_workspace", workspace,
                   "one cuBLAS workspace, 32 MiB on sm90 (8.1 MiB on older GPUs)"),
        DeviceTerm("cuda_context", CUDA_CONTEXT,
                   "driver context and kernels, outside the allocator (assumed)"),
    )
    allocated = rounded + workspace
    return DeviceEstimate("cuda", terms, False, allocated, allocated + CUDA_CONTEXT)
