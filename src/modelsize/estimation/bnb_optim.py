"""bitsandbytes' 8-bit AdamW (``--optimizer adamw8bit`` / ``paged_adamw8bit``), traced.

The optimizer is bitsandbytes' own (``bnb.optim.AdamW8bit`` / ``PagedAdamW8bit``), built and
stepped on the fake parameters, so its state is what its ``init_state`` makes
(``bitsandbytes/optim/optimizer.py``, ``Optimizer2State.init_state``): for a parameter of at
least ``min_8bit_size`` (4,096) elements two ``uint8`` states of the parameter's shape and
two ``float32`` ``absmax`` vectors, one entry per block of 256 elements; for a smaller one two
``float32`` states; and, once, the two 256-entry ``float32`` quantization maps
(``create_dynamic_map``) that every 8-bit state shares.

The update is one custom op (``bitsandbytes::optimizer_update_8bit_blockwise``, or
``optimizer_update_32bit`` for the small parameters) whose fake kernel allocates nothing: a
CUDA step updates in place. bitsandbytes' CPU kernels (``bitsandbytes/backends/cpu/ops.py``,
``_optimizer_update_8bit_blockwise_cpu`` and ``_optimizer_update_32bit_cpu``) are torch code
that dequantizes both states to ``float32`` temporaries, updates, and quantizes back; a trace
for CPU runs that code itself on the fake tensors (:func:`cpu_kernels`), so its temporaries
are counted as the real CPU run allocates them.

Paged (``PagedAdamW8bit``): on CUDA the two states of a parameter of at least 100,000
elements are allocated in CUDA unified memory (``cudaMallocManaged``, ``get_state_buffer``),
outside PyTorch's caching allocator: the bytes are the same, they live on the GPU until the
driver pages them out under memory pressure, and ``torch.cuda.max_memory_allocated`` does not
see them. The estimate counts them as optimizer state and its note names how many of those
bytes are paged (:func:`paged_note`). On CPU bitsandbytes falls back to ordinary tensors.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from modelsize.errors import MissingDependencyError
from modelsize.estimation.patching import SharedPatch

#: bitsandbytes' blockwise quantization block of optimizer states (``init_state``).
BLOCK = 256
#: Parameters under this many elements keep 32-bit states (``min_8bit_size``'s default).
MIN_8BIT_SIZE = 4096
#: Parameters of at least this many elements get paged states (``get_state_buffer``).
MIN_PAGED_SIZE = 100_000


def factory(paged: bool, lr: float) -> Callable[[Iterable[Any]], Any]:
    """A builder of ``bnb.optim.AdamW8bit`` (``PagedAdamW8bit`` when ``paged``)."""
    try:
        import bitsandbytes as bnb
    except ImportError as exc:
        name = "paged_adamw8bit" if paged else "adamw8bit"
        raise MissingDependencyError("bitsandbytes", f"--optimizer {name}", extra="quant") from exc
    cls = bnb.optim.PagedAdamW8bit if paged else bnb.optim.AdamW8bit

    def build(params: Iterable[Any]) -> Any:
        opt = cls(params, lr=lr)
        opt._cpu_paged_warned = True  # its CPU fallback is what a trace for CPU runs: said here
        return opt

    build.__name__ = cls.__name__
    return build


def state_bytes(numel: int, min_8bit_size: int = MIN_8BIT_SIZE) -> int:
    """Bytes of one parameter's AdamW8bit state (the shared quantization maps not included)."""
    if numel < min_8bit_size:
        return 2 * 4 * numel
    blocks = -(-numel // BLOCK)
    return 2 * numel + 2 * 4 * blocks


def paged_note(numels: Iterable[int]) -> str:
    """The note of a ``paged_adamw8bit`` estimate for CUDA over parameters of these sizes."""
    paged = sum(2 * n for n in numels if n >= MIN_PAGED_SIZE)
    return (f"paged_adamw8bit: {paged:,} bytes of the optimizer state (the 8-bit states of "
            f"parameters of at least {MIN_PAGED_SIZE:,} elements) are CUDA unified memory "
            "(cudaMallocManaged), counted here as GPU memory: outside PyTorch's allocator, "
            "so torch.cuda.max_memory_allocated() does not show them, and paged to the host "
            "only under memory pressure")


def _replacements() -> list[tuple[Any, str, Any]]:
    """bitsandbytes.functional's two update functions, running the CPU kernels on fakes."""
    from bitsandbytes import functional as F
    from bitsandbytes.backends.cpu import ops

    pairs: tuple[tuple[str, Any], ...] = (
        ("optimizer_update_8bit_blockwise", ops._optimizer_update_8bit_blockwise_cpu),
        ("optimizer_update_32bit", ops._optimizer_update_32bit_cpu))
    return [(F, name, _on_fakes(getattr(F, name), kernel)) for name, kernel in pairs]


def _on_fakes(original: Callable[..., None], kernel: Callable[..., None]) -> Callable[..., None]:
    """``original`` (bitsandbytes' wrapper of the op), but on fake tensors ``kernel`` (the CPU
    kernel the op dispatches to for real CPU tensors), called by argument name."""
    from torch._subclasses.fake_tensor import FakeTensor

    signature = inspect.signature(original)
    wanted = inspect.signature(kernel).parameters

    @functools.wraps(original)
    def update(*args: Any, **kwargs: Any) -> None:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        given = bound.arguments
        if not isinstance(given.get("p"), FakeTensor):
            return original(*args, **kwargs)
        if "param_norm" in wanted and "param_norm" not in given:
            import torch

            p = given["p"]
            given["param_norm"] = (torch.norm(p.data.float()) if given.get("max_unorm", 0) > 0
                                   else 0.0)
        return kernel(**{k: v for k, v in given.items() if k in wanted})

    return update


_PATCH = SharedPatch(_replacements)


@contextlib.contextmanager
def cpu_kernels(load: bool = False) -> Iterator[None]:
    """bitsandbytes' CPU optimizer kernels run on the fake tensors of a trace for CPU, for the
    block: where bitsandbytes is already imported (a factory may build one of its optimizers)
    or ``load`` (the program's optimizer is one of them)."""
    if not load and "bitsandbytes" not in sys.modules:
        yield
        return
    try:
        _PATCH.acquire()
    except (ImportError, AttributeError):  # another bitsandbytes layout: its fake kernels
        yield
        return
    try:
        yield
    finally:
        _PATCH.release()
