"""The random-number-generator states that activation checkpointing keeps, counted.

``torch.utils.checkpoint.checkpoint`` (both implementations, ``preserve_rng_state=True`` by
default) copies the CPU generator's state with ``torch.get_rng_state()`` when a region's
forward runs, and keeps the copy until the region is recomputed in the backward; the
recomputation forks the generator (``torch.random.fork_rng``), which copies the state once
more for its duration. Each copy is a real ``uint8`` CPU tensor from the CPU allocator
(5,056 bytes for the Mersenne Twister state of PyTorch's default CPU generator: 624 32-bit
words and the generator's other fields, ``CPUGeneratorImpl::get_state``). It is made by C++,
outside any dispatch mode, so a fake trace never sees it.

While a trace for CPU runs (:func:`acquire` to :func:`release`), ``torch.get_rng_state``
returns a fake tensor of the real state's size, allocated under the counting mode (so it
lives exactly as long as the checkpoint holds it), and ``torch.set_rng_state`` ignores fake
states. Any other caller (another thread, a trace for CUDA, no trace at all) gets PyTorch's
own functions.

A CUDA run keeps these states in host memory: the CPU state above, and per CUDA device the
Philox generator's state, ``torch.cuda.get_rng_state()``, a 16-byte CPU tensor (the 64-bit
seed and the 64-bit offset, ``CUDAGeneratorImpl::get_state`` in
``aten/src/ATen/cuda/CUDAGeneratorImpl.cpp``). Neither is GPU memory, so a trace for CUDA
does not count them; it counts the copies (``CountingFakeMode.host_rng_copies``) for the
estimate's note, which names both sizes (:data:`CUDA_STATE_BYTES`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from modelsize.estimation.patching import SharedPatch

#: Bytes of ``torch.cuda.get_rng_state()``: the Philox seed and offset (a CPU tensor).
CUDA_STATE_BYTES = 16


@functools.cache
def cpu_state_bytes() -> int:
    """Bytes of ``torch.get_rng_state()`` (5,056 with PyTorch's CPU generator)."""
    return int(torch.random.default_generator.get_state().nbytes)


def _counting_mode() -> Any:
    """The counting fake mode of a trace running on this thread, or None."""
    mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
    return mode if getattr(mode, "counts_real_kernels", False) else None


def _replacements() -> list[tuple[Any, str, Any]]:
    """``get_rng_state`` / ``set_rng_state`` of ``torch`` and ``torch.random``, counted."""
    get, put = torch.random.get_rng_state, torch.random.set_rng_state
    return [(m, name, _get(get) if name == "get_rng_state" else _set(put))
            for m in (torch, torch.random) for name in ("get_rng_state", "set_rng_state")]


def host_note(copies: int) -> str:
    """The note of a trace for CUDA whose checkpoints copied the RNG states ``copies`` times."""
    return (f"checkpoint copied the RNG states {copies:,} times (the CPU generator's, "
            f"{cpu_state_bytes():,} bytes, and each CUDA device's Philox seed and offset, "
            f"{CUDA_STATE_BYTES} bytes): CPU tensors in host memory, not counted")


def _get(original: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    def get_rng_state() -> torch.Tensor:
        mode = _counting_mode()
        if mode is None:
            return original()
        if mode.device_type != "cpu":  # host memory beside a GPU: named, not counted
            mode.host_rng_copies += 1
            return original()
        return torch.empty(cpu_state_bytes(), dtype=torch.uint8, device="cpu")

    get_rng_state.__doc__ = original.__doc__
    return get_rng_state


def _set(original: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
    def set_rng_state(new_state: torch.Tensor) -> None:
        if isinstance(new_state, FakeTensor):
            return  # a traced state: the real generator is left as it is
        original(new_state)

    set_rng_state.__doc__ = original.__doc__
    return set_rng_state


_PATCH = SharedPatch(_replacements)


def acquire() -> None:
    """Count the CPU RNG states a trace for CPU copies, until :func:`release` (the counting
    mode's entry and exit; nested and concurrent traces share one patch)."""
    _PATCH.acquire()


def release() -> None:
    """Leave what :func:`acquire` entered."""
    _PATCH.release()
