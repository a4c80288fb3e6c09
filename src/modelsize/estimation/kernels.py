"""Which code path a real run takes where the counted trace would take another.

The trace runs every op on fake tensors under a dispatch mode. ATen and autograd choose
their code path partly by asking whether a tensor is "subclass-like", and the answer is yes
for every tensor while any dispatch mode is active (``at::isTensorSubclassLike``). Where the
two paths allocate differently, the trace counts memory a real run never holds. Each case
below was found by running the real program with and without a do-nothing
``TorchDispatchMode`` under the CPU allocator's profiler (OpInfo samples and models), and is
measured again by tests/estimation/test_kernel_paths.py:

* **A composite op that also has a kernel.** The real run dispatches ``silu_backward``,
  ``mish_backward`` and ``native_channel_shuffle`` (CPU) to their kernels; the fake mode
  decomposes them into their CompositeImplicitAutograd parts, whose temporaries a real run
  never makes (+7-26% on SiLU/Mish CNN training). :func:`runs_as_kernel` answers from the
  dispatcher (CPU) or from the installed ``native_functions.yaml`` (CUDA kernels are not
  registered in a CPU build).
* **Composite-compliance branches in composite kernels**, taken over here while a trace runs
  (:func:`real_branches` registers a Python kernel for the CompositeImplicitAutograd key and
  removes it afterwards); each one takes the branch of a real run on plain tensors and
  allocates what that branch allocates:

  - ``linear`` on a non-contiguous input with bias: ``output.add_(bias)``, not ``add``
    (one output-sized buffer; a batch-first GRU/LSTM feeding a Linear);
  - ``max_pool1d`` without grad on CPU: the output only, no ``int64`` indices;
  - ``gather_backward``, ``index_select_backward``, ``value_selecting_reduction_backward``
    (the backward of ``max/min(dim)``, ``topk``, ``sort``, ``kthvalue``, ``mode``,
    ``median(dim)``): ``scatter_add_``/``index_add_``/``scatter_`` into the zeros, not
    their out-of-place forms (one input-sized buffer).
* **Branches inside autograd formulas and the engine**, which no kernel registration reaches;
  the counting mode runs the real path's in-place op instead (:data:`NODE_INPLACE`):

  - ``IndexBackward0`` (the backward of advanced indexing): ``index_put_`` into the zeros;
  - the engine's gradient accumulation (``InputBuffer::accumulate``): a gradient that
    reaches a tensor used twice is added in place when the engine holds the only
    reference to the first one (``old_var.add_(var)``), see
    ``CountingFakeMode._accumulates_in_place``.

Known and not modelled (each measured, each rare in models, see the tests' docstring):
branches that depend on tensor values (``prod``/``cumprod`` backward without zeros in the
input, ``max()``/``min()`` without ``dim``, ``masked_fill`` with a tensor value), the
``linalg`` ops that skip computing unused factors (``svdvals``, ``eigvalsh``,
``matrix_rank``, ``cond``, nuclear norms), ``clamp`` with tensor bounds, and
``masked_select``/``take``/``trace``/circular padding/``repeat_interleave`` backward.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

aten = torch.ops.aten

# -- composite ops that have a kernel ------------------------------------------------------

_EXPLICIT_KEYS = ("CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional")


def runs_as_kernel(func: Any, device_type: str) -> bool:
    """Whether a real run on ``device_type`` runs ``func`` as one kernel (not decomposed).

    True for every op without a CompositeImplicitAutograd kernel, and for the composite ones
    that also have a kernel for the device, which the dispatcher prefers.
    """
    return _runs_as_kernel(func, device_type)


@functools.cache
def _runs_as_kernel(func: Any, device_type: str) -> bool:
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    name = func.name()
    try:
        if not has(name, "CompositeImplicitAutograd"):
            return True
    except RuntimeError:  # prim:: ops are not registered with the dispatcher
        return True
    if any(has(name, key) for key in _EXPLICIT_KEYS):
        return True
    if device_type == "cuda":
        return name in _cuda_composites_with_kernels()
    return bool(has(name, device_type.upper()))


@functools.lru_cache(maxsize=1)
def _cuda_composites_with_kernels() -> frozenset[str]:
    """Composite ops with a CUDA kernel, read from the installed ``native_functions.yaml``.

    A CPU build of PyTorch registers no CUDA kernel, so the dispatcher cannot answer; the
    yaml the build was generated from can (``CUDA:`` in the op's dispatch table or in the
    one of its ``structured_delegate``).
    """
    import torchgen
    import yaml

    path = os.path.join(os.path.dirname(torchgen.__file__), "packaged", "ATen", "native",
                        "native_functions.yaml")
    try:
        with open(path, encoding="utf-8") as f:
            entries = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except OSError:
        return frozenset()

    def keys(entry: dict[str, Any]) -> set[str]:
        out: set[str] = set()
        for k in entry.get("dispatch") or {}:
            out |= {s.strip() for s in str(k).split(",")}
        return out

    by_name = {e["func"].split("(")[0]: e for e in entries if "func" in e}
    names = set()
    for name, entry in by_name.items():
        own = keys(entry)
        if "CompositeImplicitAutograd" not in own:
            continue
        delegate = by_name.get(entry.get("structured_delegate") or "")
        if "CUDA" in own or (delegate is not None and "CUDA" in keys(delegate)):
            names.add("aten::" + name)
    return frozenset(names)


# -- composite kernels with composite-compliance branches -----------------------------------


def _counting_mode(tensors: Sequence[Any]) -> Any:
    """The counting mode whose fake tensors these are, or None for any other call."""
    for t in tensors:
        if isinstance(t, FakeTensor) and getattr(t.fake_mode, "counts_real_kernels", False):
            return t.fake_mode
    return None


def _subclass_like(*tensors: Any) -> bool:
    """``at::areAnyTensorSubclassLike`` as the run being modelled answers it.

    For the counted trace that run is a real one on plain tensors: no. For any other call
    (another thread while a trace runs, a scratch probe's real kernel) the live answer.
    """
    present = [t for t in tensors if isinstance(t, torch.Tensor)]
    if _counting_mode(present) is not None:
        return False
    return any(torch._C._dispatch_isTensorSubclassLike(t) for t in present)


def _forward_ad() -> bool:
    return torch.autograd.forward_ad._current_level >= 0


def _linear(input: torch.Tensor, weight: torch.Tensor,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    """``at::native::linear`` (PyTorch 2.13): the fused ``addmm`` paths, else matmul + bias."""
    if input.dim() == 2 and bias is not None:
        return aten.addmm(bias, input, weight.t())
    if bias is not None and bias.dim() == 1 and input.dim() >= 1 and input.is_contiguous():
        rows = 1
        for n in input.shape[:-1]:
            rows *= n
        out = aten.addmm(bias, input.view(rows, input.shape[-1]), weight.t())
        return out.view(*input.shape[:-1], out.shape[1])
    output = aten.matmul(input, weight.t())
    if bias is not None:
        if _subclass_like(bias) or _forward_ad():
            return aten.add(output, bias)
        output.add_(bias)
    return output


def _max_pool1d(self: torch.Tensor, kernel_size: Sequence[int], stride: Sequence[int] = (),
                padding: Sequence[int] = (0,), dilation: Sequence[int] = (1,),
                ceil_mode: bool = False) -> torch.Tensor:
    """``at::native::max_pool1d``: without grad, on CPU, one output and no indices."""
    mode = _counting_mode([self])
    device = getattr(mode, "device_type", self.device.type) if mode else self.device.type
    if ((self.requires_grad and torch.is_grad_enabled()) or _forward_ad() or device != "cpu"
            or _subclass_like(self) or mode is None):
        # Outside a trace the indices-free kernel is not reachable from Python; the values
        # are the same.
        return aten.max_pool1d_with_indices(self, kernel_size, stride, padding, dilation,
                                            ceil_mode)[0]
    from torch._meta_registrations import pooling_output_shape

    if self.dim() not in (2, 3) or len(kernel_size) != 1:
        return aten.max_pool1d_with_indices(self, kernel_size, stride, padding, dilation,
                                            ceil_mode)[0]  # its own error messages
    kw = kernel_size[0]
    sw = stride[0] if len(stride) else kw
    width = pooling_output_shape(self.shape[-1], kw, padding[0], sw, dilation[0], ceil_mode)
    shape = (*self.shape[:-1], width)
    return self.new_empty(shape)


def _gather_backward(grad: torch.Tensor, self: torch.Tensor, dim: int, index: torch.Tensor,
                     sparse_grad: bool = False) -> torch.Tensor:
    if sparse_grad:
        return aten._gather_sparse_backward(self, dim, index, grad)
    result = grad.new_zeros(self.shape)
    if _subclass_like(index, grad):
        return result.scatter_add(dim, index, grad)
    result.scatter_add_(dim, index, grad)
    return result


def _index_select_backward(grad: torch.Tensor, self_sizes: Sequence[int], dim: int,
                           index: torch.Tensor) -> torch.Tensor:
    zeros = grad.new_zeros(self_sizes)
    if _subclass_like(index):
        return zeros.index_add(dim, index, grad)
    return zeros.index_add_(dim, index, grad)


def _value_selecting_reduction_backward(grad: torch.Tensor, dim: int, indices: torch.Tensor,
                                        sizes: Sequence[int], keepdim: bool) -> torch.Tensor:
    subclass = _subclass_like(grad, indices)
    grad_out, index = grad, indices
    if not keepdim and len(sizes):
        grad_out, index = grad.unsqueeze(dim), indices.unsqueeze(dim)
    grad_in = torch.zeros(sizes, dtype=grad.dtype, layout=grad.layout, device=grad.device)
    if subclass:
        return grad_in.scatter(dim, index, grad_out)
    return grad_in.scatter_(dim, index, grad_out)


#: Composite op -> the Python kernel that takes a real run's branch (while a trace runs).
COMPOSITE_KERNELS: dict[str, Callable[..., torch.Tensor]] = {
    "linear": _linear,
    "max_pool1d": _max_pool1d,
    "gather_backward": _gather_backward,
    "index_select_backward": _index_select_backward,
    "value_selecting_reduction_backward": _value_selecting_reduction_backward,
}

#: (autograd node, out-of-place op) -> the in-place op the node's formula runs for real,
#: on a zero tensor the formula itself made.
NODE_INPLACE: dict[tuple[str, Any], Any] = {
    ("IndexBackward0", aten.index_put.default): aten.index_put_.default,
}


class _Registration:
    """The Python kernels, registered while at least one trace runs (any thread)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0
        self.library: Any = None

    def acquire(self) -> None:
        with self.lock:
            if self.users == 0:
                library = torch.library.Library("aten", "IMPL")
                with warnings.catch_warnings():
                    # "Overriding a previously registered kernel": that is the point, and
                    # the library's destruction puts the C++ kernel back.
                    warnings.simplefilter("ignore")
                    for name, kernel in COMPOSITE_KERNELS.items():
                        library.impl(name, kernel, "CompositeImplicitAutograd")
                self.library = library
            self.users += 1

    def release(self) -> None:
        with self.lock:
            self.users -= 1
            if self.users == 0 and self.library is not None:
                self.library._destroy()
                self.library = None


_REGISTRATION = _Registration()


@contextlib.contextmanager
def real_branches() -> Iterator[None]:
    """Run composite kernels down a real run's branches while the block runs."""
    _REGISTRATION.acquire()
    try:
        yield
    finally:
        _REGISTRATION.release()


def acquire() -> None:
    """Enter :func:`real_branches` without a ``with`` block (the counting mode's entry)."""
    _REGISTRATION.acquire()


def release() -> None:
    """Leave what :func:`acquire` entered."""
    _REGISTRATION.release()
