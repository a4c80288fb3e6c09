"""From the tensor peak to what a device reports: each term named, each assumption stated.

CPU: PyTorch's CPU allocator hands out exactly the bytes asked for (the profiler's
``[memory]`` events carry the requested sizes), so the device estimate is the tensor peak,
kernel scratch included. Validated against the profiler in tests/estimate.

CUDA (checked against ``torch.cuda.max_memory_allocated()`` and the caching allocator's own
event history on an H100, PyTorch 2.11: benchmarks/gpu_*.py, tests/estimation/test_cuda_*):

* ``allocator_rounding``: ``max_memory_allocated`` counts the caching allocator's *blocks*.
  The trace's allocations and frees, in order (the resident parameters, buffers and inputs
  first), are replayed through a model of the allocator
  (:mod:`modelsize.estimation.cuda_allocator`): 512-byte rounding, 2 MiB / 20 MiB / rounded
  segments, best-fit reuse, and large blocks that are not split when at most 1 MiB would
  remain. The term is the replay's peak minus the tensor peak and the workspaces;
* ``cublas_workspace``: cuBLAS allocates its workspace through the caching allocator on the
  first call of each thread's handle and keeps it: 32 MiB on Hopper (sm90; 8 MiB + 128 KiB on
  other GPUs) on the first cuBLAS call of the main thread, and again on the first of the
  autograd engine's thread (the backward); cuBLASLt's 1 MiB on the first call that takes
  the Lt path (``addmm`` with a bias vector). Each is placed in the replay after the
  outputs of the op that creates it, as the allocator sees them;
* ``cuda_context``: the driver context, kernels and cuDNN/cuBLAS handles, outside PyTorch's
  allocator (seen in ``nvidia-smi``, not in ``max_memory_allocated``): several hundred MiB
  depending on the GPU, the driver and lazy loading; 512 MiB is assumed;
* not counted (named in the estimate's notes): cuDNN's convolution workspaces, allocated for
  each call and freed after it, whose size is the workspace of the engine cuDNN's heuristics
  pick at run time (:mod:`modelsize.estimation.cuda_kernels`); transient allocations inside
  a few small kernels (``isin``'s temporaries, CUB's scan storage: bytes to kilobytes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from modelsize.estimation.cuda_allocator import Block, CachingAllocator
from modelsize.estimation.result import DeviceEstimate, DeviceTerm
from modelsize.estimation.tracker import Allocation

CUDA_BLOCK = 512
CUBLAS_WORKSPACE_SM90 = 32 * 2**20
CUBLAS_WORKSPACE_DEFAULT = 4096 * 1024 * 2 + 16 * 1024 * 8
CUBLASLT_WORKSPACE = 2**20
CUDA_CONTEXT = 512 * 2**20


def round_up(n: int, block: int) -> int:
    """``n`` rounded up to a multiple of ``block`` (0 stays 0)."""
    return -(-n // block) * block


@dataclass(frozen=True)
class Replay:
    """The caching allocator replayed over one trace: its peak and what made it up."""

    peak: int
    """``max_memory_allocated``: the highest sum of blocks."""
    tick: int
    """The op at whose allocations the peak was reached (0: the resident tensors)."""
    requested: int
    """Bytes the tensors and kernel scratch asked for at that moment."""
    workspaces: int
    """Bytes of library workspaces (cuBLAS, cuBLASLt) held at that moment."""
    reserved: int
    """Bytes of the segments mapped by the end (``max_memory_reserved``)."""


def workspace_plan(first_calls: Mapping[tuple[str, bool], int], gpu: str = "sm90"
                   ) -> dict[int, list[tuple[int, str]]]:
    """Where each library workspace is allocated: tick -> ``[(bytes, name)]``.

    ``first_calls`` maps (library, on the backward thread) to the tick of its first call
    (see :attr:`CountingFakeMode.first_calls`); the Lt path creates the cuBLAS handle's
    workspace first, then its own.
    """
    cublas = CUBLAS_WORKSPACE_SM90 if gpu == "sm90" else CUBLAS_WORKSPACE_DEFAULT
    plan: dict[int, list[tuple[int, str]]] = {}
    for backward in (False, True):
        blas = first_calls.get(("cublas", backward))
        lt = first_calls.get(("cublaslt", backward))
        handle = min((t for t in (blas, lt) if t is not None), default=None)
        if handle is not None:
            plan.setdefault(handle, []).append((cublas, "cublas_workspace"))
        if lt is not None:
            plan.setdefault(lt, []).append((CUBLASLT_WORKSPACE, "cublas_workspace"))
    return plan


@dataclass(frozen=True)
class Event:
    """One allocation or free the caching allocator sees, in order."""

    tick: int
    """The op it belongs to (0: the resident tensors, before the first op)."""
    alloc: bool
    key: int
    """The same for an allocation and its free."""
    nbytes: int
    kind: str
    """``tensor``, ``workspace`` or ``scratch``."""


def device_events(allocations: Sequence[Allocation], scratch_at: Mapping[int, int],
                  ticks: int, workspaces: Mapping[int, Sequence[tuple[int, str]]] | None = None,
                  scratch_parts: Mapping[int, Sequence[int]] | None = None) -> list[Event]:
    """The trace as the caching allocator sees it: every allocation and free, in order.

    First the resident tensors (parameters, buffers, inputs: created before the first op).
    Then, op by op: its outputs (in the order they were counted), the workspaces it creates
    (kept to the end), its scratch (allocated part by part, ``scratch_parts``, then freed in
    reverse), then the storages freed after it. Storages of 0 bytes and host-side ones
    (``Allocation.host``) allocate nothing.
    """
    workspaces = workspaces or {}
    parts = scratch_parts or {}
    events: list[Event] = []
    born: dict[int, list[int]] = {}
    dead: dict[int, list[int]] = {}
    for key, rec in enumerate(allocations):
        if rec.freed == 0 or rec.host or rec.nbytes <= 0:
            continue  # gone before the first op, or nothing on the device
        if rec.created == 0:
            events.append(Event(0, True, key, rec.nbytes, "tensor"))
        else:
            born.setdefault(rec.created, []).append(key)
        if rec.freed >= 0:
            dead.setdefault(max(rec.freed, rec.created), []).append(key)
    extra_key = len(allocations)
    for tick in range(1, ticks + 1):
        for key in born.get(tick, ()):
            events.append(Event(tick, True, key, allocations[key].nbytes, "tensor"))
        for nbytes, _name in workspaces.get(tick, ()):
            events.append(Event(tick, True, extra_key, nbytes, "workspace"))
            extra_key += 1
        extra = scratch_at.get(tick, 0)
        pieces = [(extra_key + i, n) for i, n in
                  enumerate(parts.get(tick) or ((extra,) if extra else ()))]
        extra_key += len(pieces)
        events.extend(Event(tick, True, k, n, "scratch") for k, n in pieces)
        events.extend(Event(tick, False, k, n, "scratch") for k, n in reversed(pieces))
        for key in dead.get(tick, ()):
            events.append(Event(tick, False, key, allocations[key].nbytes, "tensor"))
    return events


def replay(allocations: Sequence[Allocation], scratch_at: Mapping[int, int], ticks: int,
           workspaces: Mapping[int, Sequence[tuple[int, str]]] | None = None,
           scratch_parts: Mapping[int, Sequence[int]] | None = None) -> Replay:
    """The caching allocator's peak over the trace (:func:`device_events`), allocation by
    allocation."""
    sim = CachingAllocator()
    blocks: dict[int, Block | None] = {}
    best = Replay(0, 0, 0, 0, 0)
    held = 0
    for e in device_events(allocations, scratch_at, ticks, workspaces, scratch_parts):
        if not e.alloc:
            sim.free(blocks.pop(e.key), e.nbytes)
            continue
        blocks[e.key] = sim.malloc(e.nbytes)
        if e.kind == "workspace":
            held += e.nbytes
        if sim.allocated > best.peak:
            best = Replay(sim.allocated, e.tick, sim.requested - held, held, 0)
    return Replay(best.peak, best.tick, best.requested, best.workspaces, sim.reserved)


def device_estimate(device: str, peak_bytes: int, scratch_bytes: int,
                    allocations: Sequence[Allocation], scratch_at: dict[int, int],
                    ticks: int, uses_matmul: bool, gpu: str = "sm90", *,
                    first_calls: Mapping[tuple[str, bool], int] | None = None,
                    scratch_parts: Mapping[int, Sequence[int]] | None = None
                    ) -> DeviceEstimate:
    """The named terms between the tensor peak and what ``device`` would report.

    ``first_calls`` places the library workspaces (:func:`workspace_plan`); without it, a
    program that uses a matmul (``uses_matmul``) gets one cuBLAS workspace from its first op.
    ``scratch_parts`` splits a kernel's scratch into the allocations it makes.
    """
    terms: tuple[DeviceTerm, ...]
    if device != "cuda":
        terms = (
            DeviceTerm("tensors", peak_bytes - scratch_bytes, "live tensor storages at the peak"),
            DeviceTerm("kernel_scratch", scratch_bytes, "buffers the kernels allocate internally"),
        )
        return DeviceEstimate(device, terms, True, peak_bytes, peak_bytes)
    if first_calls is not None:
        plan = workspace_plan(first_calls, gpu)
    else:
        size = CUBLAS_WORKSPACE_SM90 if gpu == "sm90" else CUBLAS_WORKSPACE_DEFAULT
        plan = {1: [(size, "cublas_workspace")]} if uses_matmul and ticks else {}
    result = replay(allocations, scratch_at, ticks, plan, scratch_parts)
    allocated = max(result.peak, peak_bytes)
    where = ("" if result.tick == 0 or not ticks else
             f"; the blocks peak at op {result.tick}")
    # Where the blocks peak at another op than the tensors (a workspace made after the
    # tensor peak), what is live there differs from the tensor peak: a term of its own, so
    # that the rounding is the blocks' excess over what was asked for at their peak.
    shift = result.requested - peak_bytes if result.peak >= peak_bytes else 0
    moment: tuple[DeviceTerm, ...] = ()
    if shift:
        moment = (DeviceTerm(
            "peak_moment", shift,
            f"the blocks peak at op {result.tick}, where the live tensors and scratch are "
            f"{abs(shift):,} bytes {'fewer' if shift < 0 else 'more'} than at the tensor "
            "peak (the workspaces held there come after it)"),)
    terms = (
        DeviceTerm("tensors", peak_bytes - scratch_bytes, "live tensor storages at the peak"),
        DeviceTerm("kernel_scratch", scratch_bytes, "buffers the kernels allocate internally"),
        *moment,
        DeviceTerm("allocator_rounding", allocated - peak_bytes - shift - result.workspaces,
                   "the caching allocator's blocks beyond the bytes asked for (512-byte "
                   "rounding, large blocks not split), replayed allocation by allocation"
                   + where),
        DeviceTerm("cublas_workspace", result.workspaces,
                   "cuBLAS workspaces held at the peak: 32 MiB per thread's handle on sm90 "
                   "(8.1 MiB on older GPUs), 1 MiB more for cuBLASLt"),
        DeviceTerm("cuda_context", CUDA_CONTEXT,
                   "driver context and kernels, outside the allocator (assumed)"),
    )
    return DeviceEstimate("cuda", terms, False, allocated, allocated + CUDA_CONTEXT)
